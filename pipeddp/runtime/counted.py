"""Losses over tokens: a loss_fn that returns ``(total, count)``, divided once by the count of the whole batch.

A language model's loss is the mean over the batch's non-ignored tokens. The
mean of micro-batch means weighted by rows is not that mean when padding
differs between micro-batches (nor across replicas), so a loss_fn may return
the micro-batch's *sum* and how many items it counted::

    def loss_fn(logits, labels):
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return total, (labels != -100).sum()

The step's loss is then sum(totals) / sum(counts) over every micro-batch (and
every replica), and so are its gradients. The counts are only known once every
micro-batch has run its forward, after the first backwards have started, so
backward runs from the totals and what the step added to ``.grad`` is divided
by the global count at its end (``Baseline.scale``). Gradients that were there
before the step (accumulation over calls) are kept aside in ``Baseline`` and
left as they were.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch
from torch import nn

__all__ = ["Baseline"]


class Baseline:
    """The gradients of ``params`` when a step starts: copied where the step's loss may be counted.

    ``counting`` is what the previous step's loss was (None: no step yet):
    after a step with a mean loss nothing is copied, and a step that then
    counts finds out whether it needed a copy (``scale`` refuses).
    """

    def __init__(self, params: Iterable[nn.Parameter], counting: Optional[bool]) -> None:
        self.params: List[nn.Parameter] = list({id(p): p for p in params}.values())
        self.had_grads = any(p.grad is not None for p in self.params)
        self.kept: Optional[Dict[int, torch.Tensor]] = None
        if self.had_grads and counting is not False:
            self.kept = {id(p): p.grad.detach().clone() for p in self.params if p.grad is not None}

    def scale(self, factor: float) -> None:
        """Multiply what the step added to every gradient by ``factor``; what was there before stays."""
        if self.had_grads and self.kept is None:
            raise ValueError(
                "this step's loss_fn returned (total, count) while the gradients held earlier steps' sums, after a "
                "step whose loss_fn returned a mean: what this step added cannot be told apart. Zero the gradients "
                "(optimizer.zero_grad()) before a step whose loss changes kind"
            )
        kept = self.kept or {}
        for p in self.params:
            if p.grad is None:
                continue
            before = kept.get(id(p))
            if before is None:
                p.grad.mul_(factor)
            else:
                p.grad.sub_(before).mul_(factor).add_(before)
