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
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from .topology import Topology

__all__ = ["loader", "ShardSampler", "ReplicaLoader"]


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


class ReplicaLoader(DataLoader):
    """A ``DataLoader`` whose ``set_epoch`` reaches its sampler."""

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call at the start of every epoch, on every rank, with the same value)."""
        setter = getattr(self.sampler, "set_epoch", None)
        if setter is not None:
            setter(epoch)


def loader(
    dataset: Dataset,
    batch_size: int,
    *,
    engine: Optional[Any] = None,
    replicas: Optional[int] = None,
    replica: Optional[int] = None,
    train: bool = True,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    **dataloader_kwargs: Any,
) -> ReplicaLoader:
    """A loader of this replica's share of ``dataset`` with local batches of ``batch_size``.

    The replica count and index come from ``engine`` (a ``HybridParallel``), or
    are given as ``replicas``/``replica``. ``train=True``: a shuffled
    ``DistributedSampler`` (call ``loader.set_epoch(epoch)`` every epoch);
    ``train=False``: ``ShardSampler``, in order and without duplicates.
    """
    if engine is not None:
        topo: Topology = engine.topology
        replicas, replica = topo.replicas, topo.replica
    if replicas is None or replica is None:
        raise ValueError("pass engine=<HybridParallel> or both replicas= and replica=")
    sampler: Sampler[int]
    if train:
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=replica, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last)
    else:
        sampler = ShardSampler(dataset, replicas, replica)
    generator = dataloader_kwargs.pop("generator", None) or torch.Generator().manual_seed(seed)
    return ReplicaLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last and train,
                         generator=generator, **dataloader_kwargs)
