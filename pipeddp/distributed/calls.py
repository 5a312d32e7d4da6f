"""Which of the engine's collective calls each rank is in, checked by the first collective of every one of them.

A rank in ``save`` that meets a rank in ``train_step`` raises with both ranks named, on every rank, instead of the two
entering collectives that do not match (a gloo abort, or a hang): the call rides in the first row each call gathers
(``rows``), beside what that call needs to agree on (``Agreement``'s batch check, a norm's shares).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List

import torch

from . import rows
from .topology import Topology

__all__ = ["CallCheck", "CollectiveError", "COLLECTIVES"]

#: The engine's calls that are collectives: every rank must make them together.
COLLECTIVES = ("train_step", "forward", "save", "save_checkpoint", "state_dict", "load", "resume", "evaluate",
               "save_pretrained", "clip_grad_norm_", "check_replicas")


class CollectiveError(RuntimeError):
    """The ranks did not enter the same collective call (or one never came)."""


class CallCheck:
    """Which of the engine's collective calls each rank is in: checked by the first collective of every one.

    ``topology`` and ``host_group`` are the agreement's (``Agreement`` is one).
    """

    topology: Topology
    host_group: Any

    @property
    def distributed(self) -> bool:
        return self.topology.world_size > 1

    def enter(self, call: str) -> None:
        """Every rank enters the collective ``call`` together (see ``_calls``); nothing else is exchanged."""
        if self.distributed:
            self._calls(call, [0, 0, 0, 0, 0], self.host_group, self.topology.job_ranks)

    def _calls(self, call: str, payload: List[int], group: Any, ranks: List[int]) -> List[List[int]]:
        """Every rank's ``payload`` (five ints), gathered with the name of the collective call each rank is in.

        The same small gathering (``gather_rows``) opens every collective call, so a rank in
        ``save`` meets a rank in ``train_step`` here and both raise naming the
        calls, instead of entering collectives that do not match (a gloo abort,
        or a hang). A rank that never comes leaves the others an error after the
        process group's timeout that says what to do.
        """
        t = torch.tensor([COLLECTIVES.index(call), *payload], dtype=torch.int64)  # host values, gathered on the host
        with self._waiting(f"entered {call}, a collective, and not every rank came: each must call {call} too, "
                           "together (not under `if rank == 0:`); or a rank stalled or died"):
            table: List[List[int]] = rows.gather_rows([], t, group=group, ranks=ranks, rank=self.topology.rank,
                                                      kind=0).tolist()
        calls = [COLLECTIVES[row[0]] if 0 <= row[0] < len(COLLECTIVES) else "?" for row in table]
        if len(set(calls)) > 1:
            listing = ", ".join(f"rank {r} {c}" for r, c in zip(ranks, calls))
            raise CollectiveError(
                f"rank {self.topology.rank}: the ranks entered different collective calls ({listing}). "
                f"{', '.join(COLLECTIVES[:1] + COLLECTIVES[2:])} (and state_dict in stage mode or with shard=) run "
                "on every rank together: call each on every rank, not under `if rank == 0:`"
            )
        return [row[1:] for row in table]

    @contextlib.contextmanager
    def _waiting(self, what: str) -> Iterator[None]:
        """A collective whose failure (a timeout, a peer gone) becomes a ``CollectiveError`` naming this rank (and
        its stage) and ``what`` it was doing, the process group's own error kept as the cause."""
        try:
            yield
        except RuntimeError as exc:
            topo = self.topology
            where = f"rank {topo.rank}" + (f" (stage {topo.stage})" if topo.mode == "stage" else "")
            raise CollectiveError(f"{where} {what} ({exc})") from exc
