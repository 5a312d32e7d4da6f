"""Saving an engine's state: one file gathered on rank 0, or sharded, every process writing its share.

::

    one file (checkpoint.py)      the shares are gathered on rank 0, which writes one file atomically
    sharded (sharded.py)          every process writes its own share, in parallel, with DCP;
                                  nothing is gathered; async_save writes in the background

With tensor parallelism (a ``tp`` mesh dimension) every tp coordinate runs
a job of its own, and a checkpoint is still written once: the one file by
job t=0's root (the others take part in gathering the sharded tensors), the
sharded one by everyone through one DCP group, each its own blocks
(``peers.py``).

Every function here is a collective where the job has several processes:
call it on every rank. The arguments are checked on every rank before any
collective, so that all ranks raise alike. ``state.py`` loads what these write;
``checkpointable.py`` gives both public classes the methods that call them.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Protocol

import torch
import torch.distributed as dist

from ..distributed.agreement import Agreement
from ..distributed.groups import subgroup
from ..distributed.topology import Topology
from ..runtime.dtensors import is_dtensor
from . import catalog, optim_state, sharded
from . import checkpoint as files
from .peers import Peers, peers_of

__all__ = ["Engine", "Saver", "save", "save_checkpoint"]


class Engine(Protocol):
    """What saving and loading need of the engine whose state they handle (an ``nn.Module``)."""

    topology: Topology
    balance: List[int]

    def state_dict(self) -> Dict[str, Any]: ...

    def local_state_dict(self) -> Dict[str, Any]: ...

    def tied_keys(self) -> List[str]: ...

    def tied_places(self) -> Dict[str, str]: ...

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> Any: ...

    def named_parameters(self) -> Any: ...

    @property
    def agreement(self) -> Agreement: ...


# -- saving in the background ----------------------------------------------------------------------------------


@dataclass
class _Pending:
    future: Future
    path: str
    directory: Optional[str]
    keep: int
    root: bool  # whether this process finishes it (makes its name durable, prunes the directory)


class Saver:
    """The asynchronous save in flight (at most one), and the process group DCP saves through.

    DCP's background thread runs collectives of its own while training runs
    those of the step, so sharded saves use a gloo group of their own (made
    on first use, on every rank alike: the job's, or with tensor parallelism
    everyone's, ``peers``). ``wait`` finishes the save in flight: the next
    save, a load, ``resume`` and ``close`` call it first.
    """

    def __init__(self, topology: Topology, timeout: timedelta) -> None:
        self.topology, self.timeout = topology, timeout
        self._group: Any = None
        self._pending: Optional[_Pending] = None
        self._peers: Optional[Peers] = None

    def group(self, ranks: Optional[List[int]] = None) -> Any:
        """The saving group of ``ranks`` (None: the job's; None in a one-process job): a collective of its
        members the first time; later calls return it, whatever ``ranks``."""
        if self._group is None and (self.topology.world_size > 1 or (ranks is not None and len(ranks) > 1)):
            self._group = subgroup(self.topology, ranks, "gloo", self.timeout)
        return self._group

    def peers(self, engine: Any) -> Peers:
        """Everyone ``engine``'s checkpoints involve (``peers.py``), found once."""
        if self._peers is None:
            self._peers = peers_of(engine, self)
        return self._peers

    def track(self, future: Future, path: str, directory: Optional[str], keep: int, root: bool) -> None:
        self._pending = _Pending(future, path, directory, keep, root)

    def wait(self) -> Optional[str]:
        """Wait for the save in flight; returns its (now complete) path, or None when there was none."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            pending.future.result()
        except BaseException as exc:  # DCP raises CheckpointException, a BaseException
            raise RuntimeError(f"rank {self.topology.rank}: the asynchronous save of {pending.path} failed: "
                               f"{files.first_line(exc)}") from exc
        if pending.root:
            _finished(pending.path, pending.directory, pending.keep)
        return pending.path

    def close(self) -> None:
        """Wait for the save in flight and give the saving group back."""
        try:
            self.wait()
        finally:
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
            self._group = None


def _finished(path: str, directory: Optional[str], keep: int) -> None:
    """On rank 0, once a sharded checkpoint is complete: make its name durable, prune its directory."""
    catalog.sync_directory(os.path.dirname(os.path.abspath(path)))
    if directory is not None:
        catalog.prune(directory, keep)


# -- saving ----------------------------------------------------------------------------------------------------


def _meta(engine: Engine, optimizer: Optional[torch.optim.Optimizer], peers: Peers) -> Dict[str, Any]:
    topo = engine.topology
    return {"stages": topo.stages, "replicas": topo.replicas, "world_size": topo.world_size,
            "balance": list(engine.balance), "mode": topo.mode, "optimizer": optim_state.optimizer_class(optimizer),
            "tp": peers.tp_size}


def _whole_on_rank0(engine: Engine, local: Any, merge: Callable[[List[Any]], Any]) -> Any:
    """Replica 0's shares of something, merged on rank 0 (None elsewhere); no rank but 0 receives anything."""
    topo = engine.topology
    if topo.mode == "replica" or topo.world_size == 1:
        return local
    parts: Optional[List[Any]] = [None] * topo.world_size if topo.is_root else None
    dist.gather_object(local if topo.replica == 0 else None, parts, dst=topo.root, group=engine.agreement.host_group)
    return merge([p for p in parts if p is not None]) if parts is not None else None


def _merge_dicts(parts: List[Dict[str, Any]]) -> Dict[str, Any]:
    whole: Dict[str, Any] = {}
    for part in parts:
        whole.update(part)
    return whole


def _whole_share(engine: Engine, keep: bool) -> Dict[str, Any]:
    """This process's share of the model, whole tensors on CPU, where it is one the file takes (``keep``), else
    empty. A sharded tensor (a ``DTensor``: over ``tp``, or the replicas with ``shard=``) is gathered by every
    process that holds part of it, one tensor at a time in the share's order, and dropped where not kept."""
    local: Dict[str, Any] = {}
    for key, value in engine.local_state_dict().items():
        whole = value.full_tensor() if is_dtensor(value) else value  # a collective over the tensor's mesh
        if keep:
            local[key] = whole.detach().cpu()
        del whole
    return local


def _payload(engine: Engine, optimizer: Optional[torch.optim.Optimizer], extra: Dict[str, Any],
             peers: Peers) -> Optional[Dict[str, Any]]:
    """Everything a one-file checkpoint holds, on the root (None elsewhere). The jobs of tp > 0 take part in
    gathering the sharded tensors (and optimizer state) and keep nothing: job t=0 holds the same model whole.
    Their random states are not kept: a resumed job gives each tp peer its t=0 peer's (``state``)."""
    topo = engine.topology
    keep = peers.tp_rank == 0 and (topo.replica == 0 if topo.mode == "stage" else topo.is_root)
    local = _whole_share(engine, keep)
    opt_local = None
    if optimizer is not None:
        # mypy: an Engine is an nn.Module at run time; the protocol cannot say so without a base class
        opt_local = optim_state.named_optimizer_state(engine, optimizer)  # type: ignore[arg-type]
    if peers.tp_rank != 0:
        return None
    model = _whole_on_rank0(engine, local, _merge_dicts)
    del local
    opt = _whole_on_rank0(engine, opt_local, optim_state.merge_optimizer_states) if optimizer is not None else None
    rngs = engine.agreement.gather_to_all(files.rng_state())
    if not peers.is_root:
        return None
    return {"format": files.FORMAT, "model": model, "optimizer": opt, "extra": extra, "rng": rngs,
            "meta": _meta(engine, optimizer, peers)}


def _check_save(engine: Engine, extra: Optional[Dict[str, Any]], sharded_format: bool, async_save: bool,
                saver: Optional[Saver]) -> Dict[str, Any]:
    """Arguments checked on every rank before any collective, so that all raise alike."""
    if async_save and not sharded_format:
        raise ValueError("async_save=True needs sharded=True: a one-file checkpoint is gathered on rank 0 and "
                         "written there, which is not done in the background")
    if async_save and saver is None:
        raise ValueError("async_save=True needs an engine that tracks its saves (Pipeline or HybridParallel)")
    files.check_plain(extra or {}, "extra")
    if saver is not None:
        saver.wait()
    return dict(extra or {})


def _save_sharded(engine: Engine, path: str, optimizer: Optional[torch.optim.Optimizer], extra: Dict[str, Any],
                  *, async_save: bool, saver: Optional[Saver], directory: Optional[str], keep: int) -> None:
    """Every process writes its share of ``path`` (DCP); rank 0 also writes the header."""
    topo = engine.topology
    if topo.world_size > 1 and saver is None:
        raise ValueError("a sharded save of a multi-process job needs the engine's Saver")
    peers = _peers(engine, saver)
    group = saver.group(None if peers.tp_size == 1 else peers.ranks) if saver is not None else None
    peers.from_root(lambda: sharded.clear(path))  # everyone waits, and raises if the root did
    state: Dict[str, Any] = {"model": engine.local_state_dict(), "rng": {str(topo.rank): (files.rng_state(),)}}
    if optimizer is not None:
        # mypy: an Engine is an nn.Module at run time; the protocol cannot say so without a base class
        state["optimizer"] = optim_state.flat_optimizer_state(engine, optimizer)  # type: ignore[arg-type]
    if peers.is_root:
        state["pipeddp"] = ({"format": files.FORMAT, "extra": extra, "meta": _meta(engine, optimizer, peers)},)
    future = sharded.write(state, path, group=group, async_save=async_save)
    if future is not None and saver is not None:
        saver.track(future, path, directory, keep, peers.is_root)
    elif peers.is_root:
        _finished(path, directory, keep)


def _peers(engine: Engine, saver: Optional[Saver]) -> Peers:
    return saver.peers(engine) if saver is not None else peers_of(engine, None)


def save(engine: Engine, path: str, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[Dict[str, Any]] = None, *, sharded: bool = False, async_save: bool = False,
         saver: Optional[Saver] = None) -> None:
    """One checkpoint at ``path``: a file rank 0 writes atomically, or (``sharded``) a directory all ranks write."""
    engine.agreement.enter("save")
    extra = _check_save(engine, extra, sharded, async_save, saver)
    if sharded:
        _save_sharded(engine, path, optimizer, extra, async_save=async_save, saver=saver, directory=None, keep=0)
        return
    peers = _peers(engine, saver)
    payload = _payload(engine, optimizer, extra, peers)
    # written on the root; everyone returns once it is, or raises with the root's error at once (not at the timeout)
    peers.from_root(lambda: files.atomic_save(payload, path) if payload is not None else None)


def save_checkpoint(engine: Engine, directory: str, step: int, optimizer: Optional[torch.optim.Optimizer] = None,
                    *, keep: int = 3, extra: Optional[Dict[str, Any]] = None, sharded: bool = False,
                    async_save: bool = False, saver: Optional[Saver] = None) -> str:
    """``directory/step-<step>.pt`` (or the directory ``step-<step>``), keeping the newest ``keep`` complete ones.

    ``extra`` gains ``step``. With ``async_save`` the older checkpoints are
    pruned once this one is complete (at the next save, load or ``close``).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    engine.agreement.enter("save_checkpoint")
    extra = _check_save(engine, dict(extra or {}, step=step), sharded, async_save, saver)
    path = catalog.step_path(directory, step, sharded)
    if sharded:
        _save_sharded(engine, path, optimizer, extra, async_save=async_save, saver=saver, directory=directory,
                      keep=keep)
        return path
    peers = _peers(engine, saver)
    payload = _payload(engine, optimizer, extra, peers)

    def write() -> None:  # on the root; the others wait for it and raise with its error, if any
        if payload is not None:
            os.makedirs(directory, exist_ok=True)
            files.atomic_save(payload, path)
            catalog.prune(directory, keep)

    peers.from_root(write)
    return path
