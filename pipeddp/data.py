"""Data loading sharded by *replica*, not by rank.

In a hybrid job the processes of one pipeline must see the same samples
(stage 0 takes the inputs, the last stage the targets of the *same* batch),
while different replicas must see different samples. So the sampler's
``num_replicas``/``rank`` are the replica count and index, never the global
world size and rank::

    mode="stage", 2 replicas x 2 stages:
      rank 0 (replica 0, stage 0)  \\ samples 0, 2, 4, ...
      rank 1 (replica 0, stage 1)  /
      rank 2 (replica 1, stage 0)  \\ samples 1, 3, 5, ...
      rank 3 (replica 1, stage 1)  /

Training uses ``DistributedSampler`` (shuffling with ``set_epoch``, padding so
every replica gets the same number of samples, which keeps replicas' batch
sizes equal). Evaluation uses ``ShardSampler``, which does not pad, so every
sample is counted exactly once.

With a fixed global batch (``HybridParallel(..., global_batch=N)``) training
uses ``ElasticSampler``: an elastic job may restart mid-epoch with another
replica count, so the epoch is one permutation (seed, epoch) of the whole
dataset that every layout shares, the job's position in it is a count of
samples consumed, and what is left is sharded by the replica count *now*::

    epoch permutation:  p0 p1 p2 p3 | p4 p5 p6 p7 | p8 p9 p10 p11 | ...   (N = 4 a step)
    2 replicas:         r0: p0 p2   r1: p1 p3     (step 0), r0: p4 p6, r1: p5 p7 (step 1)
    checkpoint after step 1: consumed = 8; restart with 1 replica:
    1 replica:          r0: p8 p9 p10 p11 (step 2), ...

Strided sharding of the rest gives each step exactly the next N samples of the
permutation whatever the replica count, so the global batches, and the
training, are the same; no sample is skipped or seen twice. torch's
``ElasticDistributedSampler(start_index=k)`` instead reshuffles the samples
left, which after a shuffled partial epoch repeats some and drops others. An
epoch ends at its last whole global batch: the ``len(dataset) % N`` samples
past it wait for another epoch's permutation (as ``drop_last``).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator, List, Optional, cast

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from .distributed.elastic import DataPosition
from .distributed.topology import Topology
from .runtime.prefetch import Placement, Prefetcher, check_prefetch

__all__ = ["loader", "ShardSampler", "ReplicaLoader", "ElasticSampler", "ElasticLoader"]


class ShardSampler(Sampler[int]):
    """Indices ``replica, replica + replicas, ...`` of the dataset, without padding or shuffling."""

    def __init__(self, dataset: Any, replicas: int, replica: int) -> None:
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} is outside 0..{replicas - 1}")
        self.n = len(dataset)
        self.replicas = replicas
        self.replica = replica

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.replica, self.n, self.replicas))

    def __len__(self) -> int:
        return len(range(self.replica, self.n, self.replicas))

    def set_epoch(self, epoch: int) -> None:
        """Evaluation order does not change with the epoch (kept for a uniform interface)."""


class ElasticSampler(Sampler[int]):
    """This replica's share of what is left of the epoch, from ``position`` on, in whole global batches.

    ``position`` (an engine's ``DataPosition``) says the epoch and the samples
    of it consumed by the whole job; iterating does not move it (the loader
    does, as it hands batches out, so prefetching does not count).
    """

    def __init__(self, dataset: Any, replicas: int, replica: int, global_batch: int, *, position: DataPosition,
                 shuffle: bool = True, seed: int = 0) -> None:
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} is outside 0..{replicas - 1}")
        if global_batch % replicas:
            raise ValueError(f"global_batch={global_batch} does not divide over {replicas} replicas")
        self.n = len(dataset)
        if self.n < global_batch:
            raise ValueError(f"the dataset has {self.n} samples, fewer than one global batch ({global_batch}): an "
                             "epoch would be empty; use a smaller global_batch")
        self.replicas, self.replica, self.global_batch = replicas, replica, global_batch
        self.position, self.shuffle, self.seed = position, shuffle, seed

    def order(self, epoch: int) -> List[int]:
        """The epoch's one permutation of the dataset (the same in every layout): seed + epoch."""
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def remaining(self) -> int:
        """Samples the job will still consume this epoch (all replicas, whole global batches)."""
        left = max(self.n - self.position.consumed, 0)
        return left - left % self.global_batch

    def __iter__(self) -> Iterator[int]:
        start = self.position.consumed
        rest = self.order(self.position.epoch)[start:start + self.remaining()]
        return iter(rest[self.replica::self.replicas])

    def __len__(self) -> int:
        return self.remaining() // self.replicas

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its beginning; the current epoch keeps its position (a resumed one goes on)."""
        if epoch != self.position.epoch:
            self.position.epoch, self.position.consumed = epoch, 0


class ReplicaLoader(DataLoader):
    """A ``DataLoader`` whose ``set_epoch`` reaches its sampler, and which may prepare batches ahead.

    With ``prefetch = k > 0`` each iteration runs on a daemon thread that keeps
    up to k batches ready (see ``runtime.prefetch``); ``close`` stops the
    threads of iterations not run to their end (a dropped iterator stops its own).
    """

    #: batches prepared ahead of the caller (0: none, the caller's thread loads each when it asks)
    prefetch: int = 0
    #: where a prepared batch's inputs and targets go (CUDA only), or None
    placement: Optional[Placement] = None

    # mypy: DataLoader types __iter__ as its private iterator class; this yields the same batches
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if not self.prefetch:
            return super().__iter__()
        ahead = Prefetcher(lambda: DataLoader.__iter__(self), self.prefetch, self.placement)
        live = self.__dict__.setdefault("_live", weakref.WeakSet())
        live.add(ahead)
        return ahead

    def close(self) -> None:
        """Stop and join the prefetch threads of iterations still open (nothing to do without prefetch)."""
        for ahead in list(self.__dict__.get("_live", ())):
            ahead.close()

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call at the start of every epoch, on every rank, with the same value)."""
        setter = getattr(self.sampler, "set_epoch", None)
        if setter is not None:
            setter(epoch)


class ElasticLoader(ReplicaLoader):
    """A loader over an ``ElasticSampler``: every batch it hands out is one global batch consumed.

    The position moves when a batch reaches the caller (workers prefetching
    ahead do not count); once the epoch is exhausted it moves to the next
    epoch's beginning, so a loop without ``set_epoch`` still reshuffles.
    """

    sampler: ElasticSampler

    @property
    def position(self) -> DataPosition:
        return self.sampler.position

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.position.epoch

    # mypy: DataLoader types __iter__ as its private iterator class; this yields the same batches
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        position, step = self.sampler.position, self.sampler.global_batch
        epoch = position.epoch
        batches = super().__iter__()
        try:
            for batch in batches:  # counted here, as it reaches the caller: a batch prepared ahead is not consumed
                position.consumed += step
                yield batch
        finally:
            if isinstance(batches, Prefetcher):
                batches.close()
        if position.epoch == epoch:
            position.epoch, position.consumed = epoch + 1, 0


def loader(
    dataset: Dataset,
    batch_size: Optional[int] = None,
    *,
    engine: Optional[Any] = None,
    replicas: Optional[int] = None,
    replica: Optional[int] = None,
    train: bool = True,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    prefetch: int = 0,
    **dataloader_kwargs: Any,
) -> ReplicaLoader:
    """A loader of this replica's share of ``dataset`` with local batches of ``batch_size``.

    The replica count and index come from ``engine`` (a ``HybridParallel``), or
    are given as ``replicas``/``replica``. ``train=True``: a shuffled
    ``DistributedSampler`` (call ``loader.set_epoch(epoch)`` every epoch);
    ``train=False``: ``ShardSampler``, in order and without duplicates.

    For training with an engine that fixes ``global_batch``: an ``ElasticLoader``
    whose batches are ``engine.replica_batch`` (``batch_size`` may be left out)
    and whose place in the epoch is ``engine.position``, which checkpoints
    record and ``resume`` restores: after a restart, with any replica count,
    iterating goes on where the job stopped (do not skip batches yourself).

    ``prefetch=k``: a background thread prepares the next k batches while the
    step runs; on CUDA, with an engine, it also pins them and copies the inputs
    to the first stage's device and the targets to the last stage's on a side
    stream. A batch prepared but not handed out is not counted as consumed.
    Call ``close()`` on the loader (or drop the iterator) to stop an iteration
    early; exhausting it stops its thread too.
    """
    ahead = check_prefetch(prefetch)
    plan = getattr(engine, "global_batch_plan", None)
    if engine is not None:
        topo: Topology = engine.topology
        replicas, replica = topo.replicas, topo.replica
    if replicas is None or replica is None:
        raise ValueError("pass engine=<HybridParallel> or both replicas= and replica=")
    generator = dataloader_kwargs.pop("generator", None) or torch.Generator().manual_seed(seed)
    if train and plan is not None and engine is not None:
        if batch_size is not None and batch_size != plan.replica_batch:
            raise ValueError(f"batch_size={batch_size}, but the engine fixes global_batch={plan.total} over "
                             f"{plan.replicas} replica(s): each replica's batch is {plan.replica_batch}; leave "
                             "batch_size out (the engine's batch_size= sets the samples per accumulation pass)")
        elastic = ElasticSampler(dataset, replicas, replica, plan.total, position=cast(Any, engine).position,
                                 shuffle=shuffle, seed=seed)
        return _ahead(ElasticLoader(dataset, batch_size=plan.replica_batch, sampler=elastic, drop_last=True,
                                    generator=generator, **dataloader_kwargs), ahead, engine)
    if batch_size is None:
        raise ValueError("pass batch_size= (samples per local batch); it may be left out only for training with an "
                         "engine that fixes global_batch")
    sampler: Sampler[int]
    if train:
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=replica, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last)
    else:
        sampler = ShardSampler(dataset, replicas, replica)
    return _ahead(ReplicaLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last and train,
                                generator=generator, **dataloader_kwargs), ahead, engine)


def _ahead(made: ReplicaLoader, prefetch: int, engine: Optional[Any]) -> ReplicaLoader:
    """``made`` preparing ``prefetch`` batches ahead; inputs bound for the engine's first stage, targets its last."""
    made.prefetch = prefetch
    stages = list(getattr(engine, "stages", None) or [])
    if prefetch and stages:
        made.placement = Placement(stages[0].device if getattr(engine, "is_first", True) else None,
                                   stages[-1].device if getattr(engine, "is_last", True) else None)
    return made
