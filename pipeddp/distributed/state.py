"""The whole model's state, and checkpoints, when its stages live in several processes.

Each process registers only its own layers, under their names in the plain
model, so its ``state_dict`` is its share with the plain keys. The whole
model is the union of the shares of replica 0's processes::

    stage mode, 2 x 2:  rank 0 {"0.weight", ...}  +  rank 1 {"4.weight", ...}  =  the plain model's state dict
                        (ranks 2, 3 hold copies of the same shares)

Optimizer state is gathered the same way, keyed by parameter name. A
checkpoint (``checkpoint.py`` for the file itself) holds both, every rank's
random generator states and the layout that wrote it; any other layout
loads it, each process taking the entries of its own parameters.

Every function here is a collective where the job has several processes:
call it on every rank.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Protocol

import torch

from . import checkpoint as files
from .agreement import Agreement
from .topology import Topology

__all__ = ["Engine", "gather_state_dict", "own_entries", "save", "save_checkpoint", "load", "resume"]


class Engine(Protocol):
    """What these functions need of the engine whose state they handle."""

    topology: Topology
    balance: List[int]

    def state_dict(self) -> Dict[str, Any]: ...

    def local_state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> Any: ...

    def named_parameters(self) -> Any: ...

    @property
    def agreement(self) -> Agreement: ...


def gather_state_dict(local: Dict[str, Any], topology: Topology, agreement: Agreement) -> Dict[str, Any]:
    """The whole model's state dict from each process's ``local`` share (replica 0's shares, on CPU)."""
    if topology.mode == "replica" or topology.world_size == 1:
        return local
    mine = {k: v.detach().cpu() for k, v in local.items()} if topology.replica == 0 else None
    full: Dict[str, Any] = {}
    for part in agreement.gather_to_all(mine):
        if part:
            full.update(part)
    return full


def own_entries(state_dict: Dict[str, Any], own: List[str], *, strict: bool, rank: int) -> Dict[str, Any]:
    """The entries of a full (or partial) state dict that belong to this process (``own``: its keys)."""
    if strict:
        missing = sorted(set(own) - set(state_dict))
        if missing:
            raise KeyError(f"rank {rank}: the state dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    keep = set(own)
    return {k: v for k, v in state_dict.items() if k in keep}


def _optimizer_state(engine: Engine, optimizer: Optional[torch.optim.Optimizer]) -> Optional[Dict[str, Any]]:
    if optimizer is None:
        return None
    topo = engine.topology
    local = files.named_optimizer_state(engine, optimizer)  # type: ignore[arg-type]
    if topo.mode == "replica" or topo.world_size == 1:
        return local
    return files.merge_optimizer_states(engine.agreement.gather_to_all(local if topo.replica == 0 else None))


def _payload(engine: Engine, optimizer: Optional[torch.optim.Optimizer], extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Everything a checkpoint holds (complete on rank 0)."""
    files.check_plain(extra or {}, "extra")  # on every rank, before any collective: all raise alike
    topo = engine.topology
    return {"format": files.FORMAT, "model": engine.state_dict(), "optimizer": _optimizer_state(engine, optimizer),
            "extra": extra or {}, "rng": engine.agreement.gather_to_all(files.rng_state()),
            "meta": {"stages": topo.stages, "replicas": topo.replicas, "world_size": topo.world_size,
                     "balance": list(engine.balance), "mode": topo.mode}}


def _barrier(engine: Engine) -> None:
    if engine.topology.world_size > 1:
        torch.distributed.barrier()


def save(engine: Engine, path: str, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[Dict[str, Any]] = None) -> None:
    """One consolidated checkpoint at ``path`` (rank 0 writes, atomically; every rank waits for it)."""
    payload = _payload(engine, optimizer, extra)
    if engine.topology.rank == 0:
        files.atomic_save(payload, path)
    _barrier(engine)


def save_checkpoint(engine: Engine, directory: str, step: int, optimizer: Optional[torch.optim.Optimizer] = None,
                    *, keep: int = 3, extra: Optional[Dict[str, Any]] = None) -> str:
    """``directory/step-<step>.pt`` (atomic), keeping the newest ``keep``; ``extra`` gains ``step``."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    payload = _payload(engine, optimizer, dict(extra or {}, step=step))
    path = files.step_path(directory, step)
    if engine.topology.rank == 0:
        os.makedirs(directory, exist_ok=True)
        files.atomic_save(payload, path)
        files.prune(directory, keep)
    _barrier(engine)
    return path


def _apply(engine: Engine, payload: Dict[str, Any], path: str, optimizer: Optional[torch.optim.Optimizer]) -> None:
    engine.load_state_dict(payload["model"])
    if optimizer is not None:
        if payload.get("optimizer") is None:
            raise ValueError(f"{path} holds no optimizer state (it was saved without optimizer=)")
        files.load_named_optimizer_state(engine, optimizer, payload["optimizer"])  # type: ignore[arg-type]


def load(engine: Engine, path: str, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
    """Load a checkpoint written by ``save`` (any layout) into this process's share; returns its ``extra``."""
    payload = files.load(path)
    _apply(engine, payload, path, optimizer)
    return payload.get("extra", {})


def resume(engine: Engine, directory: str, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[Dict[str, Any]]:
    """Load the newest complete checkpoint of ``directory``; its ``extra`` (with ``step``), or None if none.

    Rank 0 picks the file (a damaged or half-written one is skipped; one the
    safe loader refuses raises on every rank) and every rank loads the same
    one. Random generator states are restored when the job has as many ranks
    as the one that saved.
    """
    topo = engine.topology
    read: Dict[str, Any] = {}  # rank 0 has read the file while choosing it: no second read there

    def choose() -> List[Any]:
        try:
            found = files.newest(directory) if os.path.isdir(directory) else None
        except ValueError as exc:  # an unsafe file: every rank must raise, none may wait for rank 0
            return [None, str(exc)]
        if found is None:
            return [None, ""]
        read[found[0]] = found[1]
        return [found[0], ""]

    path, error = engine.agreement.from_rank0(choose)
    if error:
        raise files.UnsafeCheckpointError(f"rank {topo.rank}: {error}")
    if path is None:
        return None
    payload = read.get(path) or files.load(path)
    _apply(engine, payload, path, optimizer)
    rngs = payload.get("rng") or []
    if len(rngs) == topo.world_size:
        files.set_rng_state(rngs[topo.rank])
    return payload.get("extra", {})

