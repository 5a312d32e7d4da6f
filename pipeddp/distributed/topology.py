"""Who is who in a job: the replicas x stages grid, read from torchrun's environment.

Two ways to map the grid onto processes::

    mode="replica" (the 8-GPU fusion scheme): one process per replica drives
    all `stages` devices of its pipeline with threads.
        rank 0: cuda:0 -> cuda:1      stage 0 on GPUs 0,2,4,6
        rank 1: cuda:2 -> cuda:3      stage 1 on GPUs 1,3,5,7
        rank 2: cuda:4 -> cuda:5
        rank 3: cuda:6 -> cuda:7

    mode="stage": one process per stage, neighbours talk by send/recv.
        layout="pipeline": ranks {0,1} are replica 0, {2,3} replica 1, ...
        layout="data":     ranks {0,1} hold stage 0 (replicas 0,1), {2,3} stage 1
                           (identical stages side by side: their all-reduce
                           stays inside a node)

Without torchrun's variables the job is one process (world size 1), so the
same script runs as ``python train.py`` and ``torchrun ... train.py``.

    mesh=: a job placed on a 2-D ``DeviceMesh`` of the user's (``mesh.py``):
        the mesh says which global rank holds each (replica, stage) (``table``),
        and the job's collectives run on a group of its own ranks (``group``), so
        other ranks of the world (another parallelism's) are never waited for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["Topology", "env_world"]

MODES = ("replica", "stage")
LAYOUTS = ("pipeline", "data")


def env_world() -> tuple:
    """``(rank, world_size, local_rank, local_world_size)`` from the environment (torchrun's names)."""

    def get(name: str, default: int) -> int:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None

    world = get("WORLD_SIZE", 1)
    rank = get("RANK", 0)
    local_world = get("LOCAL_WORLD_SIZE", world)
    local_rank = get("LOCAL_RANK", rank % max(local_world, 1))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return rank, world, local_rank, local_world


def _nearest_multiples(world: int, stages: int) -> str:
    """``"2 or 4"`` around a world size of 3 for 2 stages; ``"2"`` when the world is smaller than one pipeline."""
    below, above = stages * (world // stages), stages * (world // stages + 1)
    return f"{below} or {above}" if below else f"{above}"


@dataclass(frozen=True)
class Topology:
    """The grid of ``replicas`` x ``stages`` and this process's place in it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    stages: int
    mode: str = "replica"
    layout: str = "pipeline"
    #: placed on a mesh (stage mode): ``table[replica][stage]`` is the global rank holding it; None: by ``layout``
    table: Optional[Tuple[Tuple[int, ...], ...]] = None
    #: the process group of the job's ranks for its own collectives; None: the whole world
    group: Any = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 1:
            raise ValueError(f"stages must be an int >= 1, got {self.stages!r}")
        if self.mode == "stage" and self.world_size % self.stages:
            raise ValueError(
                f"rank {self.rank}: mode='stage' runs one process per stage, so the world size must be a multiple "
                f"of stages, but world size {self.world_size} is not divisible by stages={self.stages}; start "
                f"{_nearest_multiples(self.world_size, self.stages)} processes, or use mode='replica'"
            )

    @property
    def replicas(self) -> int:
        return self.world_size if self.mode == "replica" else self.world_size // self.stages

    @property
    def _places(self) -> Dict[int, Tuple[int, int]]:
        """A mesh job's ``{global rank: (replica, stage)}``."""
        assert self.table is not None
        return {rank: (r, s) for r, row in enumerate(self.table) for s, rank in enumerate(row)}

    @property
    def job_ranks(self) -> List[int]:
        """The global ranks of the job, in the order of its collectives' results (a group orders its ranks)."""
        if self.table is None:
            return list(range(self.world_size))
        return sorted(rank for row in self.table for rank in row)

    @property
    def root(self) -> int:
        """The global rank that speaks for the job (profiles, writes headers): the first of ``job_ranks``."""
        return self.job_ranks[0]

    @property
    def is_root(self) -> bool:
        return self.rank == self.root

    def rank_of(self, replica: int, stage: int) -> int:
        """The process holding ``stage`` of ``replica``."""
        if self.table is not None:
            return self.table[replica][stage]
        if self.mode == "replica":
            return replica
        if self.layout == "pipeline":
            return replica * self.stages + stage
        return stage * self.replicas + replica

    def replica_of(self, rank: int) -> int:
        """The replica that ``rank`` belongs to."""
        if self.mode == "replica":
            return rank
        if self.table is not None:
            return self._places[rank][0]
        return rank // self.stages if self.layout == "pipeline" else rank % self.replicas

    def stage_of(self, rank: int) -> int:
        """The stage ``rank`` holds (stage mode only; in replica mode every process holds all stages)."""
        if self.mode == "replica":
            raise AttributeError("in mode='replica' every process holds all stages")
        if self.table is not None:
            return self._places[rank][1]
        return rank % self.stages if self.layout == "pipeline" else rank // self.replicas

    @property
    def replica(self) -> int:
        """This process's replica index (what the data sampler shards by)."""
        return self.replica_of(self.rank)

    @property
    def stage(self) -> int:
        """This process's stage (stage mode only)."""
        return self.stage_of(self.rank)

    def stage_ranks(self, stage: int) -> List[int]:
        """The ranks holding a copy of ``stage``: the members of its DDP group."""
        return [self.rank_of(r, stage) for r in range(self.replicas)]

    def pipeline_ranks(self, replica: int) -> List[int]:
        """The ranks making up one replica's pipeline."""
        return sorted({self.rank_of(replica, s) for s in range(self.stages)})
