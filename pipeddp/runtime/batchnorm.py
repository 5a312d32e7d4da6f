"""BatchNorm running statistics in a pipeline: never from a recompute, and optionally once per batch.

A BatchNorm layer in training mode normalises with the statistics of the
batch it sees and folds them into its running statistics. In a pipeline it
sees micro-batches, so by default it folds in one update per micro-batch
(what any micro-batching pipeline does). Two things are fixed here:

* A recompute (activation checkpointing) is a second forward of the same
  micro-batch; it must not update the running statistics a second time.
  ``frozen_statistics`` turns the updates off for the replay (the output is
  the same: training mode normalises with batch statistics either way).

* ``DeferredStatistics`` (``deferred_batch_norm=True``) makes the running
  statistics those of one whole-batch forward: each micro-batch still
  normalises with its own statistics, but its update is held back and its
  sums are accumulated; after the step's forwards one update is applied with
  the mean and the unbiased variance of the whole batch (``momentum=None``,
  the cumulative average, included)::

      micro-batch i:  n_i, sum_i x, sum_i x^2      (no update)
      end of step:    mean = S1 / N,  var = (S2 - N mean^2) / (N - 1)
                      running = (1 - momentum) running + momentum (mean, var);  num_batches_tracked += 1
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterator, List, Optional

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .rng import is_recomputing

__all__ = ["frozen_statistics", "DeferredStatistics", "batch_norms"]


def batch_norms(module: nn.Module) -> List[_BatchNorm]:
    """The BatchNorm layers (any dimension, SyncBatchNorm too) inside ``module``."""
    return [m for m in module.modules() if isinstance(m, _BatchNorm)]


@contextlib.contextmanager
def frozen_statistics(layers: List[_BatchNorm]) -> Iterator[None]:
    """Run the body with no running-statistics update in ``layers`` (their outputs do not change)."""
    changed = [m for m in layers if m.training and m.track_running_stats]
    for m in changed:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in changed:
            m.track_running_stats = True


#: the attribute that marks a layer holding back its statistics update during a micro-batch's forward
_HELD = "pipeddp_deferred"


class _Sums:
    """Per-channel sums of one BatchNorm layer's inputs over the micro-batches of a step."""

    def __init__(self) -> None:
        self.count = 0
        self.s1: Optional[torch.Tensor] = None
        self.s2: Optional[torch.Tensor] = None

    def add(self, x: torch.Tensor) -> None:
        flat = x.detach().transpose(0, 1).reshape(x.shape[1], -1).to(torch.float64)
        s1, s2 = flat.sum(dim=1), (flat * flat).sum(dim=1)
        self.s1 = s1 if self.s1 is None else self.s1 + s1
        self.s2 = s2 if self.s2 is None else self.s2 + s2
        self.count += flat.shape[1]


def _hold(layer: _BatchNorm, held: bool) -> None:
    """Normalise with the micro-batch's statistics and update nothing (``held``), or undo that.

    The mark is a plain attribute of the layer (``setattr``: nn.Module's typed
    ``__setattr__`` knows only tensors and modules), read back by ``_after`` and ``reset``.
    """
    layer.track_running_stats = not held
    setattr(layer, _HELD, held)


def _before(layer: _BatchNorm, args: Any) -> None:
    if layer.training and layer.track_running_stats:
        _hold(layer, True)


def _after(owner: "weakref.ReferenceType[DeferredStatistics]", layer: _BatchNorm, args: Any, output: Any) -> None:
    if getattr(layer, _HELD, False):
        _hold(layer, False)
        held = owner()
        if held is not None and not is_recomputing():
            held.add(layer, args[0])


class DeferredStatistics:
    """Hold back the running-statistics updates of every BatchNorm in ``module``; ``commit`` applies one per batch."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = batch_norms(module)
        self._sums = {id(m): _Sums() for m in self.layers}
        self._handles = []
        # the hooks reach this object through a weak reference: a layer holding its hook, the hook holding this
        # object and this object holding the layer would be a cycle, and a dropped pipeline's layers would wait
        # for the garbage collector
        me = weakref.ref(self)
        for m in self.layers:
            self._handles.append(m.register_forward_pre_hook(_before))
            self._handles.append(m.register_forward_hook(functools.partial(_after, me)))

    def add(self, layer: _BatchNorm, x: torch.Tensor) -> None:
        self._sums[id(layer)].add(x)

    def reset(self) -> None:
        """Forget the sums of a step that did not finish (and undo a hold-back its failure interrupted)."""
        for m in self.layers:
            if getattr(m, _HELD, False):
                _hold(m, False)
        self._sums = {id(m): _Sums() for m in self.layers}

    @torch.no_grad()
    def commit(self) -> None:
        """Apply one update per layer from the whole batch's sums (no-op for a layer that saw nothing)."""
        for m in self.layers:
            sums = self._sums[id(m)]
            if sums.count == 0 or sums.s1 is None or sums.s2 is None or m.running_mean is None \
                    or m.running_var is None or m.num_batches_tracked is None:
                continue
            n = sums.count
            mean = sums.s1 / n
            var = (sums.s2 - n * mean * mean) / max(n - 1, 1)
            m.num_batches_tracked.add_(1)
            factor = m.momentum if m.momentum is not None else 1.0 / float(m.num_batches_tracked)
            m.running_mean.mul_(1 - factor).add_(mean.to(m.running_mean.dtype), alpha=factor)
            m.running_var.mul_(1 - factor).add_(var.to(m.running_var.dtype), alpha=factor)
        self.reset()
