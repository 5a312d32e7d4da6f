"""The whole model's state, and checkpoints, when its stages live in several processes.

Each process registers only its own layers, under their names in the plain
model, so its ``state_dict`` is its share with the plain keys. The whole
model is the union of the shares of replica 0's processes::

    stage mode, 2 x 2:  rank 0 {"0.weight", ...}  +  rank 1 {"4.weight", ...}  =  the plain model's state dict
                        (ranks 2, 3 hold copies of the same shares)

A checkpoint holds the model, the optimizer state keyed by parameter name,
every rank's random generator states and the layout that wrote it, in one
of two formats; any other layout loads either, each process taking the
entries of its own parameters::

    one file (checkpoint.py)      the shares are gathered on rank 0, which writes one file
    sharded (sharded.py)          every process writes its own share, in parallel, with DCP;
                                  nothing is gathered; async_save writes in the background

Every function here is a collective where the job has several processes:
call it on every rank. What is checked against a checkpoint (its keys, the
optimizer's class) is checked before anything changes, alike on every
rank, so that all ranks raise the same error instead of some waiting.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Protocol, Set

import torch
import torch.distributed as dist
from torch import nn

from . import catalog
from . import checkpoint as files
from . import optim_state, sharded
from .agreement import Agreement
from .shard import whole_tensors
from ..runtime.warn import warn
from .topology import Topology

__all__ = ["Engine", "Saver", "gather_state_dict", "own_entries", "save", "save_checkpoint", "load", "resume",
           "load_into"]


class Engine(Protocol):
    """What these functions need of the engine whose state they handle (an ``nn.Module``)."""

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
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
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
        if self.topology.rank == 0:
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
    parts: Optional[List[Any]] = [None] * topo.world_size if topo.rank == 0 else None
    dist.gather_object(local if topo.replica == 0 else None, parts, dst=0)
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
        opt = _whole_on_rank0(engine, optim_state.named_optimizer_state(engine, optimizer),  # type: ignore[arg-type]
                              optim_state.merge_optimizer_states)
    rngs = engine.agreement.gather_to_all(files.rng_state())
    if engine.topology.rank != 0:
        return None
    return {"format": files.FORMAT, "model": model, "optimizer": opt, "extra": extra, "rng": rngs,
            "meta": _meta(engine, optimizer)}


def _barrier(engine: Engine) -> None:
    if engine.topology.world_size > 1:
        dist.barrier()


def _check_save(engine: Engine, extra: Optional[Dict[str, Any]], sharded_format: bool, async_save: bool,
                saver: Optional[Saver]) -> Dict[str, Any]:
    """Arguments checked on every rank before any collective, so that all raise alike."""
    if async_save and not sharded_format:
        raise ValueError("async_save=True needs sharded=True: a one-file checkpoint is gathered on rank 0 and "
                         "written there, which is not done in the background")
    if async_save and saver is None:
        raise ValueError("async_save=True needs an engine that tracks its saves (HybridParallel)")
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
        state["optimizer"] = optim_state.flat_optimizer_state(engine, optimizer)  # type: ignore[arg-type]
    if topo.rank == 0:
        state["pipeddp"] = ({"format": files.FORMAT, "extra": extra, "meta": _meta(engine, optimizer)},)
    future = sharded.write(state, path, group=group, async_save=async_save)
    if future is not None and saver is not None:
        saver.track(future, path, directory, keep)
    elif topo.rank == 0:
        _finished(path, directory, keep)


def save(engine: Engine, path: str, optimizer: Optional[torch.optim.Optimizer] = None,
         extra: Optional[Dict[str, Any]] = None, *, sharded: bool = False, async_save: bool = False,
         saver: Optional[Saver] = None) -> None:
    """One checkpoint at ``path``: a file rank 0 writes atomically, or (``sharded``) a directory all ranks write."""
    extra = _check_save(engine, extra, sharded, async_save, saver)
    if sharded:
        _save_sharded(engine, path, optimizer, extra, async_save=async_save, saver=saver, directory=None, keep=0)
        return
    payload = _payload(engine, optimizer, extra)
    if payload is not None:
        files.atomic_save(payload, path)
    _barrier(engine)


def save_checkpoint(engine: Engine, directory: str, step: int, optimizer: Optional[torch.optim.Optimizer] = None,
                    *, keep: int = 3, extra: Optional[Dict[str, Any]] = None, sharded: bool = False,
                    async_save: bool = False, saver: Optional[Saver] = None) -> str:
    """``directory/step-<step>.pt`` (or the directory ``step-<step>``), keeping the newest ``keep`` complete ones.

    ``extra`` gains ``step``. With ``async_save`` the older checkpoints are
    pruned once this one is complete (at the next save, load or ``close``).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    extra = _check_save(engine, dict(extra or {}, step=step), sharded, async_save, saver)
    path = catalog.step_path(directory, step, sharded)
    if sharded:
        _save_sharded(engine, path, optimizer, extra, async_save=async_save, saver=saver, directory=directory,
                      keep=keep)
        return path
    payload = _payload(engine, optimizer, extra)
    if payload is not None:
        os.makedirs(directory, exist_ok=True)
        files.atomic_save(payload, path)
        catalog.prune(directory, keep)
    _barrier(engine)
    return path


# -- loading ---------------------------------------------------------------------------------------------------


@dataclass
class _Scope:
    """What one process loads into: its share of the model and, for the checks, the whole model's keys."""

    module: nn.Module                                # names the optimizer's parameters
    own: Dict[str, torch.Tensor]                     # this process's share, under the model's keys
    keys: Set[str]                                   # the whole model's keys (every process's share)
    load: Callable[[Dict[str, Any]], Any]            # loads entries of this share
    rank: int
    world_size: int


def _scope(engine: Engine) -> _Scope:
    own = engine.local_state_dict()
    keys: Set[str] = set(own)
    if engine.topology.world_size > 1 and engine.topology.mode == "stage":
        for part in engine.agreement.gather_to_all(sorted(own)):
            keys.update(part)
    return _Scope(engine, own, keys, engine.load_state_dict, engine.topology.rank,  # type: ignore[arg-type]
                  engine.topology.world_size)


def _together(engine: Optional[Engine], fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank; if it raised anywhere, every rank raises (the first error), none waits."""
    if engine is None or engine.topology.world_size == 1:
        return fn()
    error: Optional[BaseException] = None
    result = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the others are told
        error = exc
    errors = engine.agreement.gather_to_all(f"{type(error).__name__}: {error}" if error is not None else "")
    if error is not None:
        raise error
    first = next(((r, e) for r, e in enumerate(errors) if e), None)
    if first is not None:
        raise RuntimeError(f"rank {engine.topology.rank}: loading failed on rank {first[0]}: {first[1]}")
    return result


def _load_file(scope: _Scope, payload: Dict[str, Any], path: str, optimizer: Optional[torch.optim.Optimizer]) -> None:
    files.check_model_keys(path, payload["model"], scope.keys)
    if optimizer is not None:
        optim_state.check_optimizer(path, payload.get("meta", {}).get("optimizer"),
                                    payload.get("optimizer") is not None, optimizer)
    scope.load({k: v for k, v in payload["model"].items() if k in scope.own})
    if optimizer is not None:
        optim_state.load_named_optimizer_state(scope.module, optimizer, payload["optimizer"])


def _load_sharded(scope: _Scope, path: str, optimizer: Optional[torch.optim.Optimizer], rng: bool) -> Dict[str, Any]:
    """Read this process's share of a sharded checkpoint; returns its ``extra``.

    The checks (keys, shapes, the optimizer's class) use the metadata alone,
    before anything changes; then each process reads its own keys only.
    """
    metadata = sharded.read_metadata(path)
    head = sharded.header(path, metadata)
    shapes = sharded.model_shapes(metadata)
    files.check_model_keys(path, shapes, scope.keys)
    if optimizer is not None:
        optim_state.check_optimizer(path, head["meta"].get("optimizer"), sharded.has_optimizer(metadata), optimizer)
    wrong = [f"{k}: checkpoint {list(shapes[k])}, model {list(v.shape)}" for k, v in scope.own.items()
             if tuple(shapes[k]) != tuple(v.shape)]
    if wrong:
        raise ValueError(f"{path} holds tensors of other shapes than the model's: {wrong[:5]}")
    target: Dict[str, Any] = {"model": dict(scope.own)}
    if optimizer is not None:
        target["optimizer"] = optim_state.flat_optimizer_state(scope.module, optimizer)
        missing = sorted(set(target["optimizer"]) - set(sharded.optimizer_keys(metadata)))
        if missing:
            raise ValueError(f"{path} lacks optimizer state the optimizer has ({missing[:5]}): was it saved with "
                             "other parameter groups, or before every parameter had a gradient?")
    rng = rng and int(head["meta"].get("world_size", -1)) == scope.world_size
    if rng:
        target["rng"] = {str(scope.rank): None}
    sharded.read(path, target)
    scope.load(target["model"])
    if optimizer is not None:
        optim_state.load_flat_optimizer_state(scope.module, optimizer, target["optimizer"])
    if rng:
        files.set_rng_state(target["rng"][str(scope.rank)][0])
    return head["extra"]


def _load_any(engine: Optional[Engine], scope: _Scope, path: str, optimizer: Optional[torch.optim.Optimizer], *,
              rng: bool, payload: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Load ``path`` (either format) into ``scope`` on every rank; any rank's failure is every rank's."""

    def load_here() -> Dict[str, Any]:
        if os.path.isdir(path):
            return _load_sharded(scope, path, optimizer, rng)
        contents = payload if payload is not None else files.load(path)
        _load_file(scope, contents, path, optimizer)
        rngs = contents.get("rng") or []
        if rng and len(rngs) == scope.world_size:
            files.set_rng_state(rngs[scope.rank])
        return contents.get("extra", {})

    return _together(engine, load_here)


def load(engine: Engine, path: str, optimizer: Optional[torch.optim.Optimizer] = None, *,
         saver: Optional[Saver] = None) -> Dict[str, Any]:
    """Load a checkpoint (a file or a sharded directory, any layout) into this process's share; its ``extra``."""
    if saver is not None:
        saver.wait()
    return _load_any(engine, _scope(engine), path, optimizer, rng=False)


def load_into(module: nn.Module, path: str, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
    """``load`` for a module that holds the whole model in this process (``Pipeline``); returns ``extra``."""
    own = module.state_dict()
    return _load_any(None, _Scope(module, own, set(own), module.load_state_dict, 0, 1), path, optimizer, rng=False)


def _warn(message: str) -> None:
    warn(f"pipeddp: {message}", RuntimeWarning)


def resume(engine: Engine, directory: str, optimizer: Optional[torch.optim.Optimizer] = None, *,
           saver: Optional[Saver] = None) -> Optional[Dict[str, Any]]:
    """Load the newest complete checkpoint of ``directory``; its ``extra`` (with ``step``), or None if none.

    Rank 0 picks it, files and sharded directories alike, and warns naming
    every one it skips and why, or, finding none, that training starts from
    scratch. A file the safe loader refuses as unsafe raises on every rank.
    Every rank then loads the chosen one. Random generator states are
    restored when the job has as many ranks as the one that saved.
    """
    if saver is not None:
        saver.wait()
    topo = engine.topology
    read: Dict[str, Any] = {}  # rank 0 has read a file while choosing it: no second read there

    def choose() -> List[Any]:
        if not os.path.isdir(directory):
            why = "does not exist" if not os.path.exists(directory) else "is not a directory"
            _warn(f"no checkpoint to resume from: {directory} {why}; training starts from scratch")
            return [None, ""]
        skipped: List[str] = []

        def skip(path: str, why: str) -> None:
            skipped.append(path)
            why = why[len(path):].lstrip() if why.startswith(path) else why
            _warn(f"resume skips {path}, which {why}" if why.startswith("is ") else f"resume skips {path}: {why}")

        try:
            found = catalog.newest(directory, skip)
        except files.UnsafeCheckpointError as exc:  # every rank must raise; none may wait for rank 0
            return [None, str(exc)]
        if found is None:
            what = (f"none of the {len(skipped)} checkpoint(s) there is complete and readable" if skipped else
                    "it is empty" if not os.listdir(directory) else "it holds no step-* checkpoint")
            _warn(f"no checkpoint to resume from in {directory}: {what}; training starts from scratch")
            return [None, ""]
        if found[1] is not None:
            read[found[0]] = found[1]
        return [found[0], ""]

    path, error = engine.agreement.from_rank0(choose)
    if error:
        raise files.UnsafeCheckpointError(f"rank {topo.rank}: {error}")
    if path is None:
        return None
    return _load_any(engine, _scope(engine), path, optimizer, rng=True, payload=read.get(path))
