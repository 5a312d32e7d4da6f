"""``ProcessRunner``: the process that owns one device of a pipeline runs its action list on its main thread.

It is the runner of ``mode="stage"``: the same ``run_actions`` as the device
threads of one process, with ``P2PChannel``s to the other devices' processes
instead of ``LocalChannel``s::

    rank 0 (device 0): run_actions(F0 F1 F2 B0 ...) --P2PChannel--> rank 1 (device 1): run_actions(F0 B0 F1 ...)

With virtual stages the process holds stages ``row, row + p, ...`` and the
last device feeds the first device's next stage: the channels form a ring,
one per other process it exchanges data with (both ways on one channel).

After a step every send still in flight is awaited (``flush``, a span of
the trace's communication lane); after a failed step the channels forget
what they knew of it (``reset``), so the next step starts clean.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..runtime.channels import Channel, Inbox, LocalChannel
from ..runtime.executor import Device, StageResults, group_rows, run_actions
from ..runtime.schedule.actions import Action, Kind, row_of
from ..runtime.spec import Grads, StepSpec
from ..runtime.stage import Stage
from ..runtime.trace import Trace, timed
from .p2p import P2PChannel
from .topology import Topology

__all__ = ["ProcessRunner"]


class ProcessRunner:
    """Runs ``device``'s actions in this process; ``links[r]`` reaches device row r (a process, or itself)."""

    def __init__(self, device: Device, links: Dict[int, Channel], *, rank: int) -> None:
        self.device = device
        self.links = links
        self.channels: List[P2PChannel] = [c for c in links.values() if isinstance(c, P2PChannel)]
        self._own: Optional[Inbox] = None
        self.rank = rank

    @classmethod
    def connect(cls, stages: Sequence[Stage], topology: Topology, *, n_stages: int, comm_device: torch.device,
                timeout: timedelta) -> "ProcessRunner":
        """The runner of this process's stages (one device row of ``topology``), with channels to the others."""
        rows = topology.stages
        (device,) = group_rows(stages, rows, n_stages)
        peers = set()
        for s in device.stages:
            for t in (s - 1, s + 1):
                if 0 <= t < n_stages:
                    peers.add(row_of(t, rows))
        links: Dict[int, Channel] = {}
        own: Optional[Inbox] = None
        for r in sorted(peers):
            if r == device.row:  # consecutive stages on this one device: a mailbox of its own
                own = Inbox(r)
                streams = device.first.streams
                links[r] = LocalChannel(streams, streams, own, own, timeout.total_seconds())
            else:
                links[r] = P2PChannel(topology.rank_of(topology.replica, r), rank=topology.rank, stage=device.row,
                                      peer_stage=r, device=device.first.device, comm_device=comm_device,
                                      timeout=timeout)
        runner = cls(device, links, rank=topology.rank)
        runner._own = own
        return runner

    def run(self, rows: Sequence[Sequence[Action]], spec: StepSpec, *, inputs: Optional[Sequence[Any]] = None,
            output_grads: Optional[Sequence[Optional[Grads]]] = None, grad_event: Any = None,
            trace: Optional[Trace] = None) -> List[StageResults]:
        (actions,) = rows
        streams = self.device.first.streams
        if self._own is not None:
            self._own.reset()
        self._expect(actions)
        streams.enter()
        try:
            return [run_actions(self.device, actions, spec, links=self.links, inputs=inputs,
                                output_grads=output_grads, trace=trace, rank=self.rank)]
        except BaseException:
            for ch in self.channels:
                ch.reset()
            raise
        finally:
            with timed(trace, self.device.first.index, "flush", 0, row=self.device.row, lane="comm"):
                for ch in self.channels:
                    ch.flush()
            streams.leave()

    def _expect(self, actions: Sequence[Action]) -> None:
        """Tell each channel, before the step, which messages this device will take from it (received ahead)."""
        rows, last = self.device.rows, self.device.n_stages - 1
        for a in actions:
            kind = Kind(a.kind)
            if kind is Kind.F and a.at > 0:
                link, what = self.links[row_of(a.at - 1, rows)], "F"
            elif (kind is Kind.B or kind is Kind.I) and a.at < last:
                link, what = self.links[row_of(a.at + 1, rows)], "B"
            else:
                continue
            if isinstance(link, P2PChannel):  # another process (a stage of this device comes by its own inbox)
                link.expect(what, a.at, a.mb)

    def close(self) -> None:
        """Nothing to stop: the stages run on the caller's thread."""

    @property
    def stages(self) -> List[Stage]:
        return list(self.device.stages.values())

