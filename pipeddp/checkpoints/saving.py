"""Saving an engine's state: one file gathered on rank 0, or sharded, every process writing its share.

::

    one file (checkpoint.py)      the shares are gathered on rank 0, which writes one file atomically
    sharded (sharded.py)          every process writes its own share, in parallel, with DCP;
                                  nothing is gathered; async_save writes in the background

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
from ..distributed.shard import whole_tensors
from ..distributed.topology import Topology
from . import catalog, optim_state, sharded
from . import checkpoint as files

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


class Saver:
    """The asynchronous save in flight (at most one), and the process group DCP saves through.

    DCP's background thread runs collectives of its own while training runs
    those of the step, so sharded saves use a gloo group of their own (made
    on first use, on every rank alike). ``wait`` finishes the save in flight:
    the next save, a load, ``resume`` and ``close`` call it first.
    """

    def __init__(self, topology: Topology, timeout: timedelta) -> None:
        self.topology, self.timeout = topology, timeout
        self._group: Any = None
        self._pending: Optional[_Pending] = None

    def group(self) -> Any:
        """The saving group (None in a one-process job): a collective the first time."""
        if self.topology.world_size > 1 and self._group is None:
            self._group = subgroup(self.topology, None, "gloo", self.timeout)
        return self._group

    def track(self, future: Future, path: str, directory: Optional[str], keep: int) -> None:
        self._pending = _Pending(future, path, directory, keep)

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
        if self.topology.is_root:
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


def _meta(engine: Engine, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
    topo = engine.topology
    return {"stages": topo.stages, "replicas": topo.replicas, "world_size": topo.world_size,
            "balance": list(engine.balance), "mode": topo.mode, "optimizer": optim_state.optimizer_class(optimizer)}


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


def _payload(engine: Engine, optimizer: Optional[torch.optim.Optimizer],
             extra: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Everything a one-file checkpoint holds, on rank 0 (None on the other ranks)."""
    local = {k: v.detach().cpu() for k, v in whole_tensors(engine.local_state_dict()).items()}  # shards gathered
    model = _whole_on_rank0(engine, local, _merge_dicts)
    del local
    opt = None
    if optimizer is not None:
        # mypy: an Engine is an nn.Module at run time; the protocol cannot say so without a base class
        opt = _whole_on_rank0(engine, optim_state.named_optimizer_state(engine, optimizer),  # type: ignore[arg-type]
                              optim_state.merge_optimizer_states)
    rngs = engine.agreement.gather_to_all(files.rng_state())
    if not engine.topology.is_root:
        return None
    return {"format": files.FORMAT, "model": model, "optimizer": opt, "extra": extra, "rng": rngs,
            "meta": _meta(engine, optimizer)}


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
    group = saver.group() if saver is not None else None
    engine.agreement.from_rank0(lambda: sharded.clear(path))  # every rank waits, and raises if rank 0 did
    state: Dict[str, Any] = {"model": engine.local_state_dict(), "rng": {str(topo.rank): (files.rng_state(),)}}
    if optimizer is not None:
        # mypy: an Engine is an nn.Module at run time; the protocol cannot say so without a base class
        state["optimizer"] = optim_state.flat_optimizer_state(engine, optimizer)  # type: ignore[arg-type]
    if topo.is_root:
        state["pipeddp"] = ({"format": files.FORMAT, "extra": extra, "meta": _meta(engine, optimizer)},)
    future = sharded.write(state, path, group=group, async_save=async_save)
    if future is not None and saver is not None:
        saver.track(future, path, directory, keep)
    elif topo.is_root:
        _finished(path, directory, keep)


def save(engine: Engine, path: str, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[Dict[str, Any]] = None, *, sharded: bool = False, async_save: bool = False,
         saver: Optional[Saver] = None) -> None:
    """One checkpoint at ``path``: a file rank 0 writes atomically, or (``sharded``) a directory all ranks write."""
    engine.agreement.enter("save")
    extra = _check_save(engine, extra, sharded, async_save, saver)
    if sharded:
        _save_sharded(engine, path, optimizer, extra, async_save=async_save, saver=saver, directory=None, keep=0)
        return
    payload = _payload(engine, optimizer, extra)
    # written on rank 0; every rank returns once it is, or raises with rank 0's error at once (not at the timeout)
    engine.agreement.from_rank0(lambda: files.atomic_save(payload, path) if payload is not None else None)


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
    payload = _payload(engine, optimizer, extra)

    def write() -> None:  # on rank 0; the others wait for it and raise with its error, if any
        if payload is not None:
            os.makedirs(directory, exist_ok=True)
            files.atomic_save(payload, path)
            catalog.prune(directory, keep)

    engine.agreement.from_rank0(write)
    return path
