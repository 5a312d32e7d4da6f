"""Everyone a checkpoint involves: the job's processes, and with tensor parallelism their peers over ``tp``.

With a ``tp`` dimension every tensor-parallel coordinate t runs a job of its
own (its replicas x stages, its own group and agreement), and the jobs hold
the same layers cut into slices::

    tp=2, 2 stages:   job t=0: ranks 0 (stage 0), 2 (stage 1)     rank 0's tp peers: {0, 1}
                      job t=1: ranks 1 (stage 0), 3 (stage 1)     rank 2's tp peers: {2, 3}
                      everyone: {0, 1, 2, 3}; root: rank 0 (the root of job t=0)

One checkpoint is written once, not once per job: its directory is prepared,
its header, index or file written, and a failure told, by everyone together,
through a gloo group of everyone (the ``Saver``'s) and the root of job t=0
alone speaks. Without tensor parallelism everyone is the job, and every call
here is the job's agreement's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Protocol, TypeVar

import torch.distributed as dist

from ..distributed.agreement import Agreement
from ..distributed.topology import Topology

__all__ = ["Peers", "peers_of", "tensor_mesh"]

T = TypeVar("T")


class _Engine(Protocol):
    topology: Topology

    @property
    def agreement(self) -> Agreement: ...


class _Groups(Protocol):
    def group(self, ranks: Optional[List[int]] = None) -> Any: ...


def tensor_mesh(engine: Any) -> Any:
    """The engine's 1-D ``tp`` ``DeviceMesh`` (its tensor-parallel peers), or None without tensor parallelism."""
    mesh = getattr(engine, "tp_mesh", None)
    return mesh if mesh is not None and mesh.size() > 1 else None


@dataclass
class Peers:
    """This process's place among everyone (see the module's docstring)."""

    agreement: Agreement
    rank: int                    # this process's global rank
    tp_rank: int                 # its coordinate t on ``tp`` (0 without tensor parallelism)
    tp_size: int                 # the ``tp`` dimension's size (1 without)
    ranks: List[int]             # everyone's global ranks, sorted (the job's, without tensor parallelism)
    root: int                    # the rank that speaks: the root of job t=0
    group: Any = None            # everyone's gloo group (None: the job's agreement is used)

    @property
    def is_root(self) -> bool:
        return self.rank == self.root

    @property
    def distributed(self) -> bool:
        return len(self.ranks) > 1

    def gather(self, value: Any) -> List[Any]:
        """Everyone's ``value``, on everyone (in the order of ``ranks``)."""
        if self.group is None:
            return self.agreement.gather_to_all(value)
        parts: List[Any] = [None] * len(self.ranks)
        dist.all_gather_object(parts, value, group=self.group)
        return parts

    def from_root(self, make: Callable[[], T]) -> T:
        """``make()`` on the root, its result on everyone; if it raised there, everyone raises (the root its own
        error), none waits."""
        if self.group is None:
            return self.agreement.from_rank0(make)
        box: List[Any] = [None, ""]
        error: Optional[BaseException] = None
        if self.is_root:
            try:
                box[0] = make()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the others are told
                error, box[1] = exc, f"{type(exc).__name__}: {exc}"
        dist.broadcast_object_list(box, src=self.root, group=self.group)
        if error is not None:
            raise error
        if box[1]:
            raise RuntimeError(f"rank {self.rank}: rank {self.root} failed: {box[1]}")
        return box[0]


def peers_of(engine: _Engine, saver: Optional[_Groups]) -> Peers:
    """Everyone ``engine``'s checkpoints involve (a collective of the job the first time, with tensor parallelism:
    every rank learns its job's tp peers; a ``Saver`` keeps the answer)."""
    topo, agreement = engine.topology, engine.agreement
    mesh = tensor_mesh(engine)
    if mesh is None:
        return Peers(agreement, topo.rank, 0, 1, topo.job_ranks, topo.root)
    if saver is None:
        raise ValueError("a checkpoint of a tensor-parallel engine needs the engine's Saver (engine._saver)")
    mine = [int(r) for r in mesh.mesh.flatten().tolist()]  # this process's tp peers, t=0 first
    rows = agreement.gather_to_all(mine) if topo.world_size > 1 else [mine]
    ranks = sorted({r for row in rows for r in row})
    root = min(row[0] for row in rows)  # job t=0's ranks are every row's first; its root is the least
    return Peers(agreement, topo.rank, int(mesh.get_local_rank()), int(mesh.size()), ranks, root,
                 saver.group(ranks))
