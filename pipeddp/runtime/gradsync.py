"""How a stage's gradients meet its copies' in the other replicas: once per step, at its last weight action.

A stage accumulates weight gradients over the step's micro-batches, in
whatever order the schedule runs them: under 1F1B the last forward comes
before several backwards, and under zero-bubble the weight gradients arrive in
``W`` actions after every ``B``. So the reduction over replicas cannot be tied
to a forward (DDP's ``no_sync`` habit) or to every backward: the stage knows
its *last* action that accumulates weight gradients (``sync=True`` on that
``B`` or ``W``), and the strategy is told exactly there::

    arm(roots)   right before that action's autograd: the roots backward starts from, passed through
                 whatever must see them (DDP arms its reducer in a forward of the roots)
    finish()     right after it: whatever must run once the gradients are in (FSDP2's one reduce-scatter)

``NoSync`` (one replica, or a one-process ``Pipeline``) does nothing; DDP
(``distributed/ddp.py``) and FSDP2 (``distributed/shard.py``) are the others.
"""

from __future__ import annotations

from typing import List

import torch

__all__ = ["GradSync", "NoSync", "NO_SYNC"]


class GradSync:
    """The strategy's two calls around a stage's last weight action of a step (see the module docstring)."""

    def arm(self, roots: List[torch.Tensor]) -> List[torch.Tensor]:
        """The roots backward starts from, as the strategy needs them (default: as they are)."""
        return roots

    def finish(self) -> None:
        """Runs once the stage's gradients of the step are all in (default: nothing)."""


class NoSync(GradSync):
    """Gradients stay where they are: one replica."""


NO_SYNC = NoSync()
