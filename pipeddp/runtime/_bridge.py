"""Connect ``pipe(x)``'s output to the user's autograd graph.

``pipe(x)`` runs every forward on the stage threads with the graph cut at the
stage boundaries. Its output must still answer ``loss.backward()``, and that
backward must be pipelined by the stage threads too. Two autograd functions
do it::

    x ----------------------------.
    token (cpu leaf) -> [Collect] -'-> link (cpu) -> [Emit] -> output (last device) -> loss
                          backward:                   backward:
                          run every stage's B         store d(loss)/d(output),
                          on its thread, return dx    return d(link) = 0

Why two: autograd runs a node on the thread of the device its gradient
arrives on. ``Emit``'s gradient is on the last device (a CUDA device thread
that must not block, because the stage backwards it waits for may need that
very thread), so ``Emit`` only stores the gradient. ``Collect``'s gradient is
a CPU scalar, so it runs on the thread that called ``loss.backward()``, which
may safely block while the stage threads run the backward schedule.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .microbatch import tree_map, tree_tensors
from .spec import Grads

__all__ = ["attach"]


class _Handle:
    """The state shared by one call's Collect and Emit nodes."""

    def __init__(self, run_backward: Callable[[List[Optional[Grads]], Any], List[Grads]],
                 sizes: Sequence[int], outputs: List[Any], wants: List[bool]) -> None:
        self.run_backward = run_backward
        self.wants = wants
        self.sizes = list(sizes)
        self.outputs = outputs
        self.grads: Optional[List[Optional[Grads]]] = None
        self.event: Any = None
        self.used = False


class _Emit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, handle: _Handle, link: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.handle = handle
        flat = [tree_tensors(o) for o in handle.outputs]
        merged = tuple(torch.cat([f[k] for f in flat], dim=0) for k in range(len(flat[0])))
        ctx.mark_non_differentiable(*[t for t in merged if not (t.is_floating_point() or t.is_complex())])
        return merged

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[None, torch.Tensor]:
        handle: _Handle = ctx.handle
        per_mb: List[Grads] = [[] for _ in handle.sizes]
        for g in grads:
            parts: Sequence[Optional[torch.Tensor]] = (
                torch.split(g, handle.sizes, dim=0) if g is not None else [None] * len(handle.sizes)
            )
            for i, part in enumerate(parts):
                per_mb[i].append(part)
        handle.grads = [mb for mb in per_mb]
        cuda = [g for g in grads if g is not None and g.is_cuda]
        if cuda:
            handle.event = torch.cuda.current_stream(cuda[0].device).record_event()
        return None, torch.zeros(())


class _Collect(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, handle: _Handle, token: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.handle = handle
        ctx.n_inputs = len(inputs)
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        handle: _Handle = ctx.handle
        if torch.is_grad_enabled():
            raise RuntimeError("higher-order gradients (create_graph=True) through a pipeddp Pipeline are not "
                               "supported")
        if handle.used:
            raise RuntimeError(
                "backward ran twice through the same Pipeline output; the pipeline frees its activations "
                "after the first backward (call pipe(x) again for a new graph)"
            )
        handle.used = True
        grads: List[Optional[Grads]] = handle.grads if handle.grads is not None else [None] * len(handle.sizes)
        input_grads = handle.run_backward(grads, handle.event)
        if ctx.n_inputs == 0:
            return (None, None)
        # input_grads[i] is aligned with the tensor leaves of micro-batch i; keep those that want grad.
        merged: List[Optional[torch.Tensor]] = []
        for k in range(len(input_grads[0])):
            col = [g[k] for g in input_grads]
            present = [c for c in col if c is not None]
            merged.append(torch.cat(present, dim=0) if len(present) == len(col) else None)
        wanted = [m for m, keep in zip(merged, handle.wants) if keep]
        return (None, None, *wanted)


def attach(run_backward: Callable[[List[Optional[Grads]], Any], List[Grads]], sizes: Sequence[int],
           outputs: List[Any], inputs: Any) -> Any:
    """Return the merged ``outputs`` wired so that their backward calls ``run_backward``.

    ``run_backward(grads_per_mb, event)`` runs the stages' backwards and returns
    the gradients of every micro-batch's input tensor leaves; those of the
    inputs that require grad flow on to ``inputs``.
    """
    leaves = tree_tensors(inputs)
    handle = _Handle(run_backward, sizes, outputs, [t.requires_grad for t in leaves])
    token = torch.zeros((), requires_grad=True)
    link = _Collect.apply(handle, token, *[t for t in leaves if t.requires_grad])
    merged = _Emit.apply(handle, link)
    handle.outputs = []  # the merged copies are what the user holds now
    it = iter(merged)
    return tree_map(lambda _: next(it), outputs[0])
