"""Tied weights whose uses sit in different processes (``mode="stage"``).

``runtime.tied`` keeps the copies of a tied parameter one weight inside a
process. Across processes the same two steps are collectives over a small
group per replica: the ranks of that replica holding a use of the tie::

    replica r:  rank of stage 0 (embedding)  <-- group -->  rank of stage S-1 (head)
    after the step:   all_reduce(SUM) of what each use gained in the step   (averaged over replicas by DDP)
    before a forward: broadcast of the value from the first stage's rank, where a use changed since
                      (``due``: decided alike on every rank, from a flag each rank adds to the batch
                      check that precedes every forward, so the forwards of an evaluation broadcast
                      nothing, and a deciding collective costs nothing extra)

Only the gains travel (``LocalTies.fold`` computes them and calls ``sum``
here), so a user's accumulation over several calls stays exact.

Groups are created on every rank in the same order (ties, then replicas), as
``torch.distributed.new_group`` requires; in replica mode every use is in one
process and no group is made. With virtual stages one process may hold
several uses of a tie (stage s lives on device ``row_of(s, devices, placement)``): the process
takes part with the sum of their gains and hands the result to each of them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.dtensors import local
from ..runtime.schedule.actions import row_of
from ..runtime.tied import LocalTies, Synced, Tie
from .groups import subgroup
from .topology import Topology

__all__ = ["TieExchange"]


class TieExchange:
    """The ties of this process that other processes share, and their collectives (``LocalTies.across``)."""

    def __init__(self, ties: Sequence[Tie], local: LocalTies, topology: Topology, *, backend: str,
                 timeout: timedelta, comm_device: torch.device, placement: str = "loop") -> None:
        self.comm_device = comm_device
        self.rank = topology.rank
        mine = {tie: params for tie, params in local.entries}
        #: per tie shared with other processes: this process's uses (first one first), the group, the owner's rank
        self.items: List[Tuple[List[nn.Parameter], Any, int]] = []
        self._groups: Dict[Tie, Any] = {}
        #: this process's uses as they were at the last broadcast
        self.synced = Synced()
        #: whether the next ``refresh`` broadcasts: set from every rank's ``changed`` by the check before a forward
        self.due = True
        rows = topology.stages
        for tie in ties:
            for r in range(topology.replicas):
                ranks = sorted({topology.rank_of(r, row_of(s, rows, placement)) for s in tie.stages})
                if len(ranks) < 2:
                    continue
                group = subgroup(topology, ranks, backend, timeout)
                if topology.rank in ranks:
                    self.items.append((mine[tie], group, topology.rank_of(r, row_of(tie.owner, rows, placement))))
                    self._groups[tie] = group

    def copies(self) -> List[nn.Parameter]:
        """This process's uses of ties whose first stage is in another process (refreshed from there)."""
        return [params[0] for params, _, src in self.items if src != self.rank]

    def shares(self, tie: Tie) -> bool:
        """Whether other processes hold uses of ``tie``."""
        return tie in self._groups

    def changed(self) -> bool:
        """Whether this process's uses may have changed since the last broadcast (as ``LocalTies.changed``)."""
        return bool(self.items) and self.synced.changed(self._uses())

    def _uses(self) -> List[nn.Parameter]:
        return [p for params, _, _ in self.items for p in params]

    def sum(self, tie: Tie, gain: torch.Tensor) -> torch.Tensor:
        """``gain`` (this process's uses' gradient gains) summed over the processes that use ``tie``."""
        self.synced.forget()  # an optimizer step may follow, maybe through .data
        buf = gain.detach().to(self.comm_device, copy=True)
        dist.all_reduce(buf, group=self._groups[tie])
        return buf.to(gain.device)

    @torch.no_grad()
    def refresh(self) -> None:
        """Every use of a tie takes the value of its first stage's copy, where one is ``due`` (a collective of
        each tie's group, entered alike by its ranks)."""
        if not self.due:
            return
        for params, group, src in self.items:
            buf = local(params[0].detach()).to(self.comm_device, copy=True)  # with shard=: the replica's shard
            dist.broadcast(buf, src=src, group=group)
            for p in params:
                local(p).copy_(buf)
        self.due = False  # until a check finds a change: the passes of a step broadcast once
        self.synced.mark(self._uses())
