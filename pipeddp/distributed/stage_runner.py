"""``ProcessRunner``: the process that owns one stage runs its action list on its main thread.

It is the runner of ``mode="stage"``: the same ``run_actions`` as the stage
threads of one process, with ``P2PChannel``s to the neighbouring stages'
processes instead of ``LocalChannel``s::

    rank 0 (stage 0): run_actions(F0 F1 F2 B0 ...) --P2PChannel--> rank 1 (stage 1): run_actions(F0 B0 F1 ...)

After a step every send still in flight is awaited (``flush``); after a
failed step the channels forget what they knew of it (``reset``), so the
next step starts clean.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, List, Optional, Sequence

import torch

from ..runtime.executor import StageResults, run_actions
from ..runtime.schedule import Action
from ..runtime.stage import Grads, Stage, StepSpec
from ..runtime.trace import Trace
from .p2p import P2PChannel
from .topology import Topology

__all__ = ["ProcessRunner"]


class ProcessRunner:
    """Runs ``stage``'s actions in this process; ``prev``/``next`` reach the neighbouring stages' processes."""

    def __init__(self, stage: Stage, prev: Optional[P2PChannel], next: Optional[P2PChannel], *, rank: int) -> None:
        self.stage = stage
        self.channels = [c for c in (prev, next) if c is not None]
        self.prev = prev
        self.next = next
        self.rank = rank

    @classmethod
    def connect(cls, stage: Stage, topology: Topology, *, comm_device: torch.device,
                timeout: timedelta) -> "ProcessRunner":
        """The runner of this process's stage in ``topology``, with channels to its replica's neighbours."""

        def channel(peer_stage: int) -> Optional[P2PChannel]:
            if not 0 <= peer_stage < topology.stages:
                return None
            return P2PChannel(topology.rank_of(topology.replica, peer_stage), rank=topology.rank,
                              stage=stage.index, peer_stage=peer_stage, device=stage.device,
                              comm_device=comm_device, timeout=timeout)

        return cls(stage, channel(stage.index - 1), channel(stage.index + 1), rank=topology.rank)

    def run(self, rows: Sequence[Sequence[Action]], spec: StepSpec, *, inputs: Optional[Sequence[Any]] = None,
            output_grads: Optional[Sequence[Optional[Grads]]] = None, grad_event: Any = None,
            trace: Optional[Trace] = None) -> List[StageResults]:
        (actions,) = rows
        self.stage.streams.enter()
        try:
            return [run_actions(self.stage, actions, spec, prev=self.prev, next=self.next, inputs=inputs,
                                output_grads=output_grads, trace=trace, rank=self.rank)]
        except BaseException:
            for ch in self.channels:
                ch.reset()
            raise
        finally:
            for ch in self.channels:
                ch.flush()
            self.stage.streams.leave()

    def close(self) -> None:
        """Nothing to stop: the stage runs on the caller's thread."""
