"""The agreement at a training step's end: one loss on every rank, and a non-finite step skipped on every rank alike.

Every rank reports one float64 row, (local loss, gradients not finite, count, counted), gathered (``rows``) into the
same table on every rank, from which each computes the same mean loss and the same vote. The gathering is made before
the step (``StepEnd.gathering``), so that a rank that takes others' rows (the first) posts its receives as soon as it
has issued every message of the step (``ordering.when_issued``), while it still computes its last backward: a row sent
by a rank that finished earlier then lands at once instead of waiting for that receive (``rows.Gathering``).
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..runtime.counted import Count, scalar_on
from ..runtime.dtensors import local
from ..runtime.warn import warn
from . import rows
from .calls import CallCheck
from .rows import Gathering

__all__ = ["StepEnd", "ROW"]

#: the length of a rank's row: (local loss, gradients not finite, count, counted)
ROW = 4
#: the gathering's kind (its tag, ``rows``): the call and batch check's is 0
KIND = 1
#: what a row is like (its length, dtype and device), for the gatherings made ahead of their rows
_LIKE = torch.zeros(ROW, dtype=torch.float64)


def _not_finite(grads: Sequence[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """1.0 where any of ``grads`` holds a NaN or an infinity, else 0.0 (float64 on ``dev``; no host sync).

    One fused inf-norm per device and dtype (a largest magnitude is finite exactly when every element is, and
    NaN propagates through it), not two ops per gradient. A sharded gradient votes with its own shard (the gather
    joins every rank's); an empty one has nothing to vote with.
    """
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for g in grads:
        t = local(g)
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    if not groups:
        return torch.zeros((), dtype=torch.float64, device=dev)
    largest = torch.cat([torch.stack(torch._foreach_norm(ts, math.inf)).to(dev, torch.float64)
                         for ts in groups.values()])
    return (~largest.isfinite().all()).to(torch.float64)


class StepEnd(CallCheck):
    """The loss agreement of ``Agreement`` (one is), over the job's ranks on ``host_group``."""

    def gathering(self) -> Gathering:
        """The gathering of a step's rows (the job's ranks, in order), made ahead: ``Gathering.post`` may post its
        receives before ``finish_step`` finishes it."""
        return Gathering(_LIKE, group=self.host_group, ranks=self.topology.job_ranks, rank=self.topology.rank,
                         kind=KIND)

    def finish_step(self, local_loss: Optional[torch.Tensor], params: Iterable[nn.Parameter], *, skip_nonfinite: bool,
                    skipped: int, overflow_to_scaler: bool = False, count: Optional[Count] = None,
                    carried: bool = False, gathering: Optional[Gathering] = None
                    ) -> Tuple[torch.Tensor, bool, Optional[float]]:
        """Average the loss over replicas (one collective); vote on non-finite gradients.

        ``local_loss``: this rank's loss, a tensor (None where it runs no last stage); it, the vote and the count
        come to the host in one copy, the step's one synchronisation with a device, and travel in one row.

        ``count``: where the loss_fn returned ``(total, count)``, ``local_loss``
        is this rank's sum of totals and ``count`` its sum of counts; the loss is
        then the sum of totals over the sum of counts of every rank, and that
        global count is returned (else None) for the gradients to be divided by.

        With ``overflow_to_scaler`` (a GradScaler judges the step): if any rank's
        gradients are not finite, every rank marks one of its own gradients inf,
        so that every rank's scaler skips the step and backs off its scale alike
        (each scaler sees only its own process's gradients). Otherwise, with
        ``skip_nonfinite``: a step with a non-finite loss or gradients anywhere is
        skipped, every rank drops its gradients (set to None, so
        ``optimizer.step()`` changes nothing) and a warning names the ranks.
        ``carried``: an earlier call of this optimizer step was skipped on this
        rank (``skipped.OpenSkip``); then this call is skipped on every rank too.
        ``gathering``: the one ``gathering()`` made before the step, its receives maybe posted already.
        Returns the global mean loss, whether the step was skipped and the global count.
        """
        params = list(params)
        grads = [p.grad for p in params if p.grad is not None]
        f64, vote = torch.float64, (skip_nonfinite or overflow_to_scaler) and bool(grads) and not carried
        on = [t.device for t in (local_loss, count) if isinstance(t, torch.Tensor)]
        if on or vote:  # (loss, grads not finite, count) on the device until one copy brings them to the host
            dev = on[0] if on else local(grads[0]).device
            bad = _not_finite(grads, dev) if vote else scalar_on(2.0 if carried else 0.0, dev)
            head = torch.stack([scalar_on(local_loss, dev), bad, scalar_on(count, dev)])
            mine = torch.cat([head.cpu(), torch.tensor([count is not None], dtype=f64)])
        else:  # all numbers (a rank without the loss, no vote: the first stage's): the row made at once
            mine = torch.tensor([float(local_loss or 0.0), 2.0 if carried else 0.0, float(count or 0.0),
                                 float(count is not None)], dtype=f64)
        if self.distributed:
            with self._waiting("waited for every rank's loss at the end of a step: a rank stalled or died in its "
                               "step, or skipped train_step (a collective: call it on every rank)"):
                gathered = rows.gather_rows([], mine, group=self.host_group, ranks=self.topology.job_ranks,
                                            rank=self.topology.rank, kind=KIND, ahead=gathering)
        else:
            gathered = mine[None]
        table = gathered.tolist()  # every rank's row (loss, bad grads, count, counted), on the host
        total = sum(t[0] for t in table)
        counted = any(t[3] > 0 for t in table)
        n = sum(t[2] for t in table) if counted else None
        loss = torch.tensor(total / self.topology.replicas if n is None else (total / n if n else float("nan")),
                            dtype=torch.float64)
        ranks = self.topology.job_ranks if self.distributed else [self.topology.rank]
        losses = [r for r, t in zip(ranks, table) if skip_nonfinite and not math.isfinite(t[0])]
        grads_bad = [r for r, t in zip(ranks, table) if t[1] == 1]
        held = any(t[1] == 2 for t in table)  # the step was skipped at an earlier call: this one goes with it
        if overflow_to_scaler and grads_bad:
            if grads:
                grads[0].fill_(float("inf"))  # any layout; the scaler only needs to find one inf
            return loss, False, n
        if not (losses or grads_bad or held):
            return loss, False, n
        for p in params:
            p.grad = None
        where = "; ".join(part for part in (
            f"non-finite loss on rank(s) {losses}" if losses else "",
            f"non-finite gradients on rank(s) {grads_bad}" if grads_bad else "",
            "an earlier call since the last optimizer.step() was skipped" if held else "") if part)
        warn(f"pipeddp: skipped a training step: {where}; gradients were dropped on every rank "
             f"({skipped + (0 if held else 1)} skipped so far)", RuntimeWarning)
        return loss, True, n
