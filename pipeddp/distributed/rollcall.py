"""The roll call after the groups are made: a rank lost while they are made is named by every other rank.

A rank that dies (or stalls) while the process groups are made leaves the others waiting where nothing names it:
a gloo group made lazily waits for nobody when it is made, so the others go on to DDP's first collectives (a gloo
"Connection refused" with an address) or to the first step (its agreements wait for rows that never come); a
group made as a full mesh waits for a store key of torch's own, and times out naming no rank. So every rank of
the job, once its groups are made, counts itself in the store (``Rollcall.made``: its rank appended to one key, a
count added) and waits, at most the engine's timeout, until the last one in says every rank is there. A rank
whose wait expires, or whose making of the groups failed (``Rollcall.failed``), settles who is missing: the job's
ranks neither counted in nor failed themselves, after up to ``GRACE`` seconds for the others to report, posted
once for all (the first verdict stays), which ends every other rank's wait at once. Every rank then raises the
same error, naming the missing ranks (or the rank whose own error stopped it). The healthy path costs four store
operations per rank and the wait for the slowest rank (which DDP's first collective would wait for anyway).

The process that serves the store (world rank 0, where torch's ``env://`` rendezvous has it) stays until every
other rank present has read the verdict, ``LINGER`` seconds at most: its exit would take the verdict with it.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Set, Tuple

import torch.distributed as dist

from .topology import Topology

__all__ = ["Rollcall", "SetupFailed"]

#: how long a rank that settles the verdict waits for the other ranks present to report
GRACE = 5.0
#: how long the process that serves the store waits at most for every rank present to have read the verdict
LINGER = 5.0
#: how often a rank that settles (or lingers) looks at the store
POLL = 0.05
#: the longest error a verdict carries
LONGEST = 2000
#: the verdict of a roll call every rank answered
ALL_IN = "all in"


class SetupFailed(RuntimeError):
    """A rank of the job was lost (or failed) while the process groups were made; the message names it."""


class Rollcall:
    """One engine's roll call over the job's ranks (see the module's docstring). Every rank builds its engines in
    the same order, so the n-th engine over the same ranks has the same key on every rank."""

    _made: Dict[Tuple[int, ...], int] = {}

    def __init__(self, topology: Topology, timeout: timedelta) -> None:
        self.topology, self.timeout = topology, timeout
        ranks = tuple(topology.job_ranks)
        n = Rollcall._made[ranks] = Rollcall._made.get(ranks, 0) + 1
        self.key = f"pipeddp/rollcall/{'-'.join(map(str, ranks))}/{n}"
        self.store: Any = dist.distributed_c10d._get_default_store()

    def made(self) -> None:
        """This rank's groups are made: count in, and wait for every rank (``SetupFailed`` naming the missing)."""
        self.store.append(f"{self.key}/made", f"{self.topology.rank},")
        if int(self.store.add(f"{self.key}/count", 1)) == len(self.topology.job_ranks):
            self.store.compare_set(f"{self.key}/verdict", "", ALL_IN)  # the last one in: every rank is there
        try:
            self.store.wait([f"{self.key}/verdict"], self.timeout)
        except dist.DistError as exc:  # the timeout expired: settle who is missing
            self._raise(self._settle(None), exc)
        verdict = self.store.get(f"{self.key}/verdict").decode()
        if verdict != ALL_IN:
            self._raise(json.loads(verdict), None)

    def failed(self, exc: BaseException) -> None:
        """This rank's making of the groups raised ``exc``: settle who is missing and raise ``SetupFailed`` naming
        them (or this rank's own error, where every other rank is in), chained from ``exc``."""
        try:
            self.store.append(f"{self.key}/alive", f"{self.topology.rank},")
            verdict = self._settle(exc)
        except Exception:  # noqa: BLE001 - no store: this rank's own error stands
            raise exc from None
        self._raise(verdict, exc)

    def _present(self) -> Set[int]:
        """The ranks that counted in or reported their own failure."""
        present: Set[int] = set()
        for name in ("made", "alive"):
            if self.store.check([f"{self.key}/{name}"]):
                present.update(int(r) for r in self.store.get(f"{self.key}/{name}").decode().split(",") if r)
        return present

    def _settle(self, exc: Optional[BaseException]) -> Dict[str, Any]:
        """The verdict: posted already, else the ranks missing once every other rank is present or ``GRACE``
        seconds passed, posted here (with ``exc``, this rank's own error, where it failed)."""
        deadline = time.monotonic() + GRACE
        job = self.topology.job_ranks
        while True:
            if self.store.check([f"{self.key}/verdict"]):
                break
            present = self._present()
            if len(present) >= len(job) - 1 or time.monotonic() >= deadline:
                verdict = {"missing": [r for r in job if r not in present], "by": self.topology.rank,
                           "error": "" if exc is None else f"{type(exc).__name__}: {exc}"[:LONGEST]}
                self.store.compare_set(f"{self.key}/verdict", "", json.dumps(verdict))
                break
            time.sleep(POLL)
        raw = self.store.get(f"{self.key}/verdict").decode()
        return {"missing": [], "by": None, "error": ""} if raw == ALL_IN else dict(json.loads(raw))

    def _raise(self, verdict: Dict[str, Any], exc: Optional[BaseException]) -> None:
        """Raise ``SetupFailed`` for ``verdict``, after lingering where this process serves the store."""
        self._linger(len(verdict["missing"]))
        rank = self.topology.rank
        missing: List[int] = verdict["missing"]
        restart = ("every rank of the job stops with it. Restart the job (torchrun --max-restarts=N restarts it; "
                   "pipeddp.resume picks up the newest checkpoint)")
        if missing:
            who = ", ".join(f"rank {r}" for r in missing)
            message = (f"rank {rank}: {who} never finished making pipeddp's process groups: that process died, "
                       f"stalled or stopped while the groups were made (its own output, or the host's: a crash, "
                       f"the OOM killer, a signal, says why); " + restart)
        else:
            message = (f"rank {rank}: rank {verdict['by']} failed while making pipeddp's process groups with "
                       f"{verdict['error']}. That error is the one to fix; " + restart)
        raise SetupFailed(message) from exc

    def _linger(self, missing: int) -> None:
        """Count this rank as told; where this process serves the store, wait (``LINGER`` seconds at most) until
        every rank present was told."""
        try:
            told = int(self.store.add(f"{self.key}/told", 1))
            if dist.get_rank() != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                return
            deadline = time.monotonic() + LINGER
            while told < len(self.topology.job_ranks) - missing and time.monotonic() < deadline:
                time.sleep(POLL)
                told = int(self.store.add(f"{self.key}/told", 0))
        except Exception:  # noqa: BLE001 - a store that is gone has nobody left to tell
            return
