"""``ProcessRunner``: the process that owns one device of a pipeline runs its action list on its main thread.

It is the runner of ``mode="stage"``: the same ``run_actions`` as the device
threads of one process, with ``P2PChannel``s to the other devices' processes
instead of ``LocalChannel``s::

    rank 0 (device 0): run_actions(F0 F1 F2 B0 ...) --P2PChannel--> rank 1 (device 1): run_actions(F0 B0 F1 ...)

With virtual stages the process holds stages ``row, row + p, ...`` and the
last device feeds the first device's next stage: the channels form a ring,
one per other process it exchanges data with (both ways on one channel). In
the V (``placement="v"``) the last device's two stages meet on it, through a
mailbox of its own, and the way back runs the ring the other way.

Before a step each channel is given the order of its link's messages, which
both of its ends compute from the whole schedule (``crossings``): messages
between processes are paired by order, as NCCL pairs them. Every send,
receive and wait runs with the stage's compute stream current, so NCCL's
operations are ordered after the kernels that produce what they send, and the
kernels that read what they receive wait for them. After a step every send
still in flight is awaited (``flush``, a span of the trace's communication
lane); a failed step leaves receives posted that no later message may meet,
so the channels refuse the next step with the reason (``P2PChannel.fail``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..runtime.channels import Channel, Inbox, LocalChannel
from ..runtime.executor import Device, StageResults, group_rows, run_actions
from ..runtime.schedule.actions import Action, Schedule
from ..runtime.schedule.messages import Message, crossings, in_order
from ..runtime.spec import Grads, StepSpec
from ..runtime.stage import Stage
from ..runtime.trace import Trace, timed
from .p2p import Ordering, P2PChannel
from .topology import Topology

__all__ = ["ProcessRunner"]


class ProcessRunner:
    """Runs ``device``'s actions in this process; ``links[r]`` reaches device row r (a process, or itself)."""

    def __init__(self, device: Device, links: Dict[int, Channel], *, rank: int) -> None:
        self.device = device
        self.links = links
        #: the channel to each other process's device row
        self._p2p: Dict[int, P2PChannel] = {r: c for r, c in links.items() if isinstance(c, P2PChannel)}
        self.channels: List[P2PChannel] = list(self._p2p.values())
        self._own: Optional[Inbox] = None
        self.rank = rank
        self._plan: Optional[Schedule] = None
        self._crossings: Dict[Tuple[int, int], List[Message]] = {}
        self._sequence: List[Tuple[P2PChannel, int]] = []
        self._call, self._repeat, self._pass = "", False, 0

    @classmethod
    def connect(cls, stages: Sequence[Stage], topology: Topology, *, n_stages: int, comm_device: torch.device,
                timeout: timedelta, placement: str = "loop", header_group: Any = None,
                side_group: Any = None) -> "ProcessRunner":
        """The runner of this process's stages (one device row of ``topology``), with channels to the others
        (``header_group``: the pipeline's gloo twin on an nccl job, for the activations' headers; ``side_group``: on
        a gloo job a gloo group of the pipeline other than the tensors', for what a changed activation adds; see
        ``p2p``)."""
        (device,) = group_rows(stages, topology.stages, n_stages, placement)
        peers = set()
        for s in device.stages:
            for t in (s - 1, s + 1):
                if 0 <= t < n_stages:
                    peers.add(device.row_of(t))
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
                                      timeout=timeout, header_group=header_group, side_group=side_group)
        runner = cls(device, links, rank=topology.rank)
        runner._own = own
        return runner

    def agreed(self, call: str, repeated: bool) -> None:
        """The batch check of a ``call`` (``"train_step"``, ``"forward"``) passed, and found every rank's batch
        shaped as in its call before (``Agreement.repeated``): the runs until the next check may send activations
        without headers, each run (an accumulation's passes are several) taking the shapes of its counterpart."""
        self._call, self._repeat, self._pass = call, repeated, 0

    def run(self, rows: Sequence[Sequence[Action]], spec: StepSpec, *, plan: Optional[Schedule] = None,
            inputs: Optional[Sequence[Any]] = None, output_grads: Optional[Sequence[Optional[Grads]]] = None,
            grad_event: Any = None, trace: Optional[Trace] = None) -> List[StageResults]:
        """Run this device's row of ``plan`` (the whole schedule, which orders the messages of every link)."""
        (actions,) = rows
        if plan is None:
            raise ValueError("a stage-mode step needs the whole schedule (plan=): both ends of every link between "
                             "processes derive the order of their messages from it")
        orders, sequence = self._orders(plan)
        streams = self.device.first.streams
        if self._own is not None:
            self._own.reset()
        streams.enter()
        try:
            key = f"{self._call}/{self._pass}" if self._call else ""  # no check since the last: headers
            self._pass += 1
            with streams.computing():  # receives posted here are ordered after the stage's compute stream
                ordering = Ordering(sequence)
                for peer_row, ch in self._p2p.items():
                    ch.begin(orders.get(self._link(peer_row), ()), ordering, key, self._repeat)
                ordering.advance()
            results = [run_actions(self.device, actions, spec, links=self.links, inputs=inputs,
                                   output_grads=output_grads, trace=trace, rank=self.rank)]
            with timed(trace, self.device.first.index, "flush", 0, row=self.device.row, lane="comm"):
                for ch in self.channels:
                    ch.flush()
                    ch.finish()
            return results
        except BaseException as exc:
            for ch in self.channels:
                ch.fail(exc)
            raise
        finally:
            streams.leave()

    def _link(self, peer_row: int) -> Tuple[int, int]:
        return min(self.device.row, peer_row), max(self.device.row, peer_row)

    def _orders(self, plan: Schedule) -> Tuple[Dict[Tuple[int, int], List[Message]], List[Tuple[P2PChannel, int]]]:
        """The messages of every link in ``plan``, in the order both ends issue them, and this process's
        operations on all its links in one order: (the channel to the peer, index in that link's order). Once per
        plan."""
        if self._plan is not plan:  # (a process with every stage, the only one to run backward-only steps, has none)
            links = crossings(plan) if self._p2p else {}
            seen: Dict[int, int] = {}
            sequence = []
            for m in in_order(plan) if self._p2p else []:
                if self.device.row in (m.src, m.dst):
                    peer = m.dst if m.src == self.device.row else m.src
                    sequence.append((self._p2p[peer], seen.get(peer, 0)))
                    seen[peer] = seen.get(peer, 0) + 1
            self._plan, self._crossings, self._sequence = plan, links, sequence
        return self._crossings, self._sequence

    def close(self) -> None:
        """Nothing to stop: the stages run on the caller's thread."""

    @property
    def stages(self) -> List[Stage]:
        return list(self.device.stages.values())

