"""A stage's whole backward handed to autograd's engine as ``torch.autograd.backward`` hands it, minus its Python.

``torch.autograd.backward`` spends about 10 us of Python per call before its engine starts (the arguments turned
into tuples, each tested for ``__torch_function__``, the implicit gradient of a scalar made through
``_make_grads``' checks for nested tensors and symbolic shapes, a logger's level read): on a small stage that is
a quarter of a backward action. A stage's backward never needs most of it: its roots are the plain tensors its
layers made (or its loss), and the gradients it is given were made as gradients of exactly those tensors by the
next stage. So where every root and gradient is a plain ``torch.Tensor`` of the root's shape, no functorch
transform and no ``__torch_function__`` mode is active and autograd's debug log is off, ``backward`` calls the
engine itself with what torch's wrapper would pass it (the same arguments, the scalar loss's gradient a
``ones_like``, the caller's context stashed for the engine's device threads as torch stashes it); anything else
goes through ``torch.autograd.backward`` as before, so its errors and overrides stay torch's.

A split backward (``split``) asks the engine five times a micro-batch on a four-layer stage (its input half, then
one call per place where its weight half starts, each from ``GradientEdge`` roots and to a few parameters), so
``grad`` and ``backward``'s ``inputs`` do the same for it: a root may be a gradient edge whose given gradient has
the shape the edge's node expects, and ``inputs`` plain tensors or edges.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Optional, Sequence, Tuple, Union, cast

import torch
from torch.autograd import graph
from torch.autograd.graph import GradientEdge
from torch.autograd.variable import Variable

__all__ = ["backward", "grad"]

_engine = Variable._execution_engine
_functorch_active = torch._C._are_functorch_transforms_active
_has_torch_function = torch._C._has_torch_function
_mode_on = torch._C._is_torch_function_mode_enabled
_Parameter = torch.nn.Parameter  # its __torch_function__ is torch's disabled one: a plain tensor to the wrapper
_stash = getattr(torch._C, "_stash_obj_in_tls", None)
_unstash = getattr(torch._C, "_remove_obj_from_tls", None)
#: the logger whose DEBUG level makes torch's wrapper hook every node of the graph (``_engine_run_backward``)
_graph_log = graph.log
_DEBUG = logging.DEBUG
#: this torch's wrapper does what is copied here (a torch without the context stash: its own wrapper, always)
_COPIED = _stash is not None and _unstash is not None and hasattr(graph, "_engine_run_backward")
#: where a backward starts or what it asks for: a tensor, or one input of a node (``torch.autograd.graph``)
Root = Union[torch.Tensor, GradientEdge]


def _plain(roots: Sequence[Root], grads: Optional[Sequence[Optional[torch.Tensor]]],
           inputs: Sequence[Root] = ()) -> bool:
    """Whether ``roots``, ``grads`` and ``inputs`` take the engine directly: plain tensors or gradient edges, a
    gradient of each root's shape (none given: scalar real tensor roots), nothing that torch's wrapper would treat
    otherwise."""
    if not _COPIED or _functorch_active() or _mode_on() or _graph_log.isEnabledFor(_DEBUG):
        return False  # (under a torch function mode, torch's own call is all the mode sees)
    tensors = [t for t in inputs if not isinstance(t, GradientEdge)] if inputs else []
    for given in tensors:
        if type(given) is not torch.Tensor and type(given) is not _Parameter:
            return False
    for t in roots:
        if isinstance(t, GradientEdge):
            if grads is None:
                return False
        elif type(t) is not torch.Tensor or t.is_nested or t.is_complex():
            return False
        else:
            tensors.append(t)
    if grads is None:
        for root in roots:  # (plain tensors: an edge without a gradient was refused above)
            if root.numel() != 1 or not root.is_floating_point():  # type: ignore[union-attr]
                return False
        return not _has_torch_function(tuple(tensors))
    if len(grads) != len(roots):
        return False
    for t, g in zip(roots, grads):
        if type(g) is not torch.Tensor or g.is_nested or g.is_complex():
            return False
        if isinstance(t, GradientEdge):
            meta = t.node._input_metadata[t.output_nr]
            if meta.is_nested_tensor or meta.dtype.is_complex or list(g.shape) != list(meta.shape):
                return False
        elif g.shape != t.shape:
            return False
        tensors.append(g)
    return not _has_torch_function(tuple(tensors))


def _ones(t: Root) -> torch.Tensor:
    """The implicit gradient of a scalar root, as torch's wrapper makes it."""
    return torch.ones_like(cast(torch.Tensor, t), memory_format=torch.preserve_format)


def _run(roots: Sequence[Root], grads: Optional[Sequence[Optional[torch.Tensor]]], inputs: Sequence[Root],
         keep_graph: bool, accumulate: bool) -> Tuple[torch.Tensor, ...]:
    """The engine's own call, as torch's ``_engine_run_backward`` makes it (``_plain`` checked by the caller)."""
    made = tuple(grads) if grads is not None else \
        (_ones(roots[0]),) if len(roots) == 1 else tuple(_ones(t) for t in roots)
    _stash("context", contextvars.copy_context())  # type: ignore[misc]  # as torch's _engine_run_backward
    try:
        return _engine.run_backward(tuple(roots), made, keep_graph, False, tuple(inputs), allow_unreachable=True,
                                    accumulate_grad=accumulate)
    finally:
        _unstash("context")  # type: ignore[misc]


def backward(roots: Sequence[Root], grads: Optional[Sequence[Optional[torch.Tensor]]], inputs: Sequence[Root] = (),
             keep_graph: bool = False) -> None:
    """``torch.autograd.backward(roots, grads, retain_graph=keep_graph, inputs=inputs or None)``: accumulate into
    the leaves' (or only ``inputs``') ``.grad``."""
    if _plain(roots, grads, inputs):
        _run(roots, grads, inputs, keep_graph, True)
    else:
        torch.autograd.backward(cast(Sequence[torch.Tensor], roots), grads, retain_graph=keep_graph,
                                inputs=cast(Sequence[torch.Tensor], inputs) if inputs else None)


def grad(roots: Sequence[Root], grads: Optional[Sequence[Optional[torch.Tensor]]], inputs: Sequence[Root],
         keep_graph: bool = False) -> Sequence[Optional[torch.Tensor]]:
    """``torch.autograd.grad(roots, inputs, grads, retain_graph=keep_graph, allow_unused=True)``: the gradients
    of ``inputs`` (None where unreachable), nothing accumulated."""
    if inputs and _plain(roots, grads, inputs):
        return _run(roots, grads, inputs, keep_graph, False)
    return torch.autograd.grad(cast(Sequence[torch.Tensor], roots), cast(Sequence[torch.Tensor], inputs), grads,
                               retain_graph=keep_graph, allow_unused=True)
