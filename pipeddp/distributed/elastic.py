"""A fixed global batch across replica counts, and where in an epoch the job stands.

An elastic job may restart with fewer (or more) replicas, after losing a host.
If every replica kept its batch, the optimizer would see fewer samples per step
and the training math would change silently. So the job fixes the *global*
batch (``HybridParallel(..., global_batch=N)``) and the engine derives the rest
from the replica count R it finds at start::

    global_batch N = R replicas x replica_batch (N / R, what train_step takes)
    replica_batch  = accumulation passes x batch_size (the memory knob)

    N = 16, batch_size = 4:   R = 2: each replica 8 samples a step, 2 passes of 4
                              R = 1: the replica 16 samples a step, 4 passes of 4

One ``train_step`` is one optimizer step at every replica count: the caller's
loop, the GradScaler, ``skip_nonfinite`` and checkpoints (always between
steps) stay as they are; only the loader's batch follows R, and
``pipeddp.data.loader(dataset, engine=engine)`` picks it.

``DataPosition`` is the job's place in its data: the epoch and how many
samples of that epoch's one permutation the job has consumed. Checkpoints
record it, ``resume`` restores it, and ``data.ElasticSampler`` shards what is
left of the epoch by the replica count of the restarted job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

__all__ = ["GlobalBatch", "plan_global_batch", "DataPosition", "POSITION_KEY"]

#: The key under which a checkpoint's ``extra`` holds the data position (beside ``step``).
POSITION_KEY = "data_position"


@dataclass(frozen=True)
class GlobalBatch:
    """How the samples of one optimizer step divide over replicas and accumulation passes."""

    total: int        # samples per optimizer step, all replicas together
    replicas: int
    batch_size: int   # samples per pass of one replica

    @property
    def replica_batch(self) -> int:
        """Samples one replica takes per optimizer step: what ``train_step`` takes."""
        return self.total // self.replicas

    @property
    def accumulation(self) -> int:
        """Passes (forward + backward, gradients accumulating) per optimizer step on each replica."""
        return self.replica_batch // self.batch_size

    def check(self, samples: int, rank: int) -> None:
        """Refuse a ``train_step`` batch of ``samples`` on a replica unless it is ``replica_batch``."""
        if samples != self.replica_batch:
            raise ValueError(f"rank {rank}: train_step got {samples} samples per replica, but "
                             f"global_batch={self.total} over {self.replicas} replica(s) makes "
                             f"{self.replica_batch} per replica (engine.replica_batch); "
                             "pipeddp.data.loader(dataset, engine=engine) yields batches of that size")


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shown(values: List[int], limit: int = 6) -> str:
    return ", ".join(map(str, values[:limit])) + (", ..." if len(values) > limit else "")


def plan_global_batch(global_batch: Optional[int], batch_size: Optional[int], replicas: int) -> Optional[GlobalBatch]:
    """Check ``global_batch``/``batch_size`` against ``replicas``; None when no global batch is fixed.

    Runs before any thread or process starts, on every rank alike (the
    replica count comes from the environment), so a mistake raises everywhere
    at once, naming the values that work.
    """
    if global_batch is None:
        if batch_size is not None:
            raise ValueError(f"batch_size={batch_size!r} needs global_batch=: batch_size is the samples per "
                             "accumulation pass within a fixed global batch; without global_batch, each train_step "
                             "call is one pass of whatever batch it is given")
        return None
    for name, value in (("global_batch", global_batch), ("batch_size", batch_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be an int >= 1 (samples), got {value!r}")
    if global_batch % replicas:
        works = [replicas * k for k in range(1, 7)]
        raise ValueError(f"global_batch={global_batch} does not divide over the {replicas} replicas of this job; "
                         f"with {replicas} replicas it must be a multiple of {replicas} ({_shown(works)}). For a job "
                         "that may restart with another replica count, pick one that every count divides (e.g. a "
                         "multiple of 12 for 1 to 4 replicas)")
    share = global_batch // replicas
    size = share if batch_size is None else batch_size
    if share % size:
        works = [replicas * size * k for k in range(1, 7)]
        raise ValueError(f"global_batch={global_batch} gives each of the {replicas} replicas {share} samples per step, "
                         f"which passes of batch_size={size} do not divide: with {replicas} replicas and "
                         f"batch_size={size}, global_batch may be {_shown(works)}; or keep global_batch={global_batch} "
                         f"and pick a batch_size that divides {share} ({_shown(_divisors(share))})")
    return GlobalBatch(global_batch, replicas, size)


@dataclass
class DataPosition:
    """The epoch and the samples of it consumed (all replicas together), as of the last batch handed out.

    One object per engine, shared with the loaders made for it; it moves as
    they hand out batches and is set back by ``resume``.
    """

    epoch: int = 0
    consumed: int = 0

    def state(self) -> Dict[str, int]:
        """Plain values for a checkpoint."""
        return {"epoch": int(self.epoch), "consumed": int(self.consumed)}

    def restore(self, saved: Any, where: str = "the checkpoint") -> None:
        """Take the position ``state`` recorded; a malformed entry is refused, naming ``where``."""
        ok = isinstance(saved, dict) and all(isinstance(saved.get(k), int) and not isinstance(saved.get(k), bool)
                                             and saved[k] >= 0 for k in ("epoch", "consumed"))
        if not ok:
            raise ValueError(f"{where} holds a malformed {POSITION_KEY!r} entry ({saved!r}); expected "
                             "{'epoch': int >= 0, 'consumed': int >= 0}")
        self.epoch, self.consumed = saved["epoch"], saved["consumed"]
