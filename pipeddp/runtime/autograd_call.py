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
"""

from __future__ import annotations

import contextvars
import logging
from typing import Optional, Sequence

import torch
from torch.autograd import graph
from torch.autograd.variable import Variable

__all__ = ["backward"]

_engine = Variable._execution_engine
_functorch_active = torch._C._are_functorch_transforms_active
_has_torch_function = torch._C._has_torch_function
_stash = getattr(torch._C, "_stash_obj_in_tls", None)
_unstash = getattr(torch._C, "_remove_obj_from_tls", None)
#: the logger whose DEBUG level makes torch's wrapper hook every node of the graph (``_engine_run_backward``)
_graph_log = graph.log
_DEBUG = logging.DEBUG
#: this torch's wrapper does what is copied here (a torch without the context stash: its own wrapper, always)
_COPIED = _stash is not None and _unstash is not None and hasattr(graph, "_engine_run_backward")


def _plain(roots: Sequence[torch.Tensor], grads: Optional[Sequence[Optional[torch.Tensor]]]) -> bool:
    """Whether ``roots`` and ``grads`` take the engine directly: plain tensors, a gradient of each root's shape
    (none given: scalar real roots), nothing that torch's wrapper would treat otherwise."""
    if not _COPIED or _functorch_active() or _graph_log.isEnabledFor(_DEBUG):
        return False
    for t in roots:
        if type(t) is not torch.Tensor or t.is_nested or t.is_complex():
            return False
    if grads is None:
        return all(t.numel() == 1 and t.is_floating_point() for t in roots)
    if len(grads) != len(roots):
        return False
    for t, g in zip(roots, grads):
        if type(g) is not torch.Tensor or g.is_nested or g.is_complex() or g.shape != t.shape:
            return False
    return not _has_torch_function(tuple(roots) + tuple(grads))


def backward(roots: Sequence[torch.Tensor], grads: Optional[Sequence[Optional[torch.Tensor]]]) -> None:
    """``torch.autograd.backward(roots, grads)``: accumulate into the leaves' ``.grad`` and free the graph."""
    if not _plain(roots, grads):
        torch.autograd.backward(list(roots), list(grads) if grads is not None else None)
        return
    made = tuple(torch.ones_like(t, memory_format=torch.preserve_format) for t in roots) if grads is None \
        else tuple(grads)
    _stash("context", contextvars.copy_context())  # type: ignore[misc]  # as torch's _engine_run_backward
    try:
        _engine.run_backward(tuple(roots), made, False, False, (), allow_unreachable=True, accumulate_grad=True)
    finally:
        _unstash("context")  # type: ignore[misc]
