"""A model whose layers carry gradient hooks, and the multi-process job that trains it (importable by the children).

Every hook halves the gradient it sees and counts its calls in ``CALLS`` (by the layer's tag), so a hook run twice
or not at all shows in the gradients and in the counts: tensor hooks on a layer's output (``register_hook``, the way
per-activation clipping, loss scaling by hand and probes attach), module backward hooks
(``register_full_backward_pre_hook`` on one layer, ``register_full_backward_hook`` on another), and hooks on the
weights of Linears used twice within a layer.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

import pipeddp
from hybrid_jobs import LOSS, global_batches, init, local_slice

#: hook calls by tag, in this process
CALLS: Counter = Counter()
WIDTH = 12


class Hooked(nn.Module):
    """A Linear whose output gets a tensor hook in every forward that builds a graph (on a 2-D input the hook sits
    on the ``addmm`` node, where the input and weight paths part: the node a split backward enters twice)."""

    def __init__(self, tag: str, scale: bool = False) -> None:
        super().__init__()
        self.tag = tag
        self.lin = nn.Linear(WIDTH, WIDTH)
        #: also a tensor hook on ``y * scale`` (a ``mul`` node: the input and one parameter part there too)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH)) if scale else None

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        CALLS[self.tag] += 1
        return grad * 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.requires_grad:
            y.register_hook(self._hook)
        if self.scale is not None:
            y = y * self.scale
            if y.requires_grad:
                y.register_hook(self._hook)
        return y


def _pre_hook(module: nn.Module, grad_output: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
    CALLS[f"pre:{module.tag}"] += 1  # type: ignore[operator]
    return tuple(g * 0.5 for g in grad_output)


def _full_hook(module: nn.Module, grad_input: Tuple[Any, ...], grad_output: Tuple[Any, ...]) -> Tuple[Any, ...]:
    CALLS[f"full:{module.tag}"] += 1  # type: ignore[operator]
    return tuple(None if g is None else g * 0.5 for g in grad_input)


class Twice(nn.Module):
    """One Linear used twice, side by side (``lin(x) + lin(tanh(x))``) or one use feeding the other
    (``lin(tanh(lin(x)))``), with a hook on its weight: W reaches the weight from two places, and the plain backward
    accumulates it (and runs the weight's hooks, and DDP's) once."""

    def __init__(self, tag: str, nested: bool) -> None:
        super().__init__()
        self.tag, self.nested = tag, nested
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.lin.weight.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        CALLS[self.tag] += 1
        return grad * 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.nested:
            return self.lin(torch.tanh(self.lin(x)))
        return self.lin(x) + self.lin(torch.tanh(x))


class Tagged(nn.Linear):
    def __init__(self, tag: str) -> None:
        super().__init__(WIDTH, WIDTH)
        self.tag = tag


def hooked_model(seed: int = 0) -> nn.Sequential:
    """14 float64 layers: tensor hooks, both module backward hooks and hooked weights used twice, spread so that
    every stage of a 2-, 3- or 4-stage uniform cut holds some, at its start, its middle and its end."""
    torch.manual_seed(seed)
    pre, full = Tagged("a"), Tagged("b")
    pre.register_full_backward_pre_hook(_pre_hook)
    full.register_full_backward_hook(_full_hook)
    layers = [nn.Linear(WIDTH, WIDTH), nn.Tanh(), Hooked("h0"), Twice("w0", nested=False),
              Hooked("h1", scale=True), nn.ReLU(), pre,
              full, nn.Tanh(), Hooked("h2"), Twice("w1", nested=True),
              nn.Linear(WIDTH, WIDTH), nn.ReLU(), Hooked("h3", scale=True)]
    return nn.Sequential(*layers).double()


def reference(steps: int, replicas: int = 1) -> Tuple[List[Dict[str, torch.Tensor]], Counter]:
    """The plain model on one device: each step's gradients by name (SGD, lr 0.1), and its hook calls per backward."""
    model = hooked_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    CALLS.clear()
    for x, y in global_batches(replicas, steps):
        opt.zero_grad()
        LOSS(model(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    per_backward = Counter({k: v // steps for k, v in CALLS.items()})
    CALLS.clear()
    return grads, per_backward


def train(engine: Any, steps: int, local: int, replicas: int = 1) -> List[Tuple[Dict[str, torch.Tensor], Counter]]:
    """SGD steps of ``global_batches``: each step's gradients by name and the hook calls this process saw in it."""
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    out = []
    replica = engine.topology.replica if replicas > 1 else 0
    for batch in global_batches(replicas, steps, local=local):
        x, y = local_slice(batch, replica, local)
        CALLS.clear()
        opt.zero_grad()
        first, last = getattr(engine, "is_first", True), getattr(engine, "is_last", True)
        engine.train_step(x if first else None, y if last else None, LOSS)
        out.append(({n: p.grad.clone() for n, p in engine.named_parameters()}, Counter(CALLS)))
        opt.step()
    return out


def two_process_job(layouts: List[Tuple[str, int, str]], chunks: int, steps: int) -> List[Any]:
    """``HybridParallel(schedule="zb")`` per (mode, virtual stages, placement) on two processes: ``"stage"`` is one
    stage group per process, ``"replica"`` two DDP replicas of a two-stage pipeline. Each step's gradients and hook
    calls, per layout."""
    init()
    out = []
    for mode, virtual, placement in layouts:
        engine = pipeddp.HybridParallel(hooked_model(), stages=2, mode=mode, chunks=chunks, schedule="zb",
                                        virtual_stages=virtual, placement=placement, balance="uniform")
        try:
            out.append(train(engine, steps, local=10, replicas=2 if mode == "replica" else 1))
        finally:
            engine.close()
    return out
