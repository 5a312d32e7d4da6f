"""The whole model's state when its stages live in several processes, and loading checkpoints into it.

Each process registers only its own layers, under their names in the plain
model, so its ``state_dict`` is its share with the plain keys. The whole
model is the union of the shares of replica 0's processes::

    stage mode, 2 x 2:  rank 0 {"0.weight", ...}  +  rank 1 {"4.weight", ...}  =  the plain model's state dict
                        (ranks 2, 3 hold copies of the same shares)

A checkpoint (``saving.py`` writes it, in one file or sharded) holds the
model, the optimizer state keyed by parameter name, every rank's random
generator states and the layout that wrote it; any other layout loads
either format, each process taking the entries of its own parameters.

Loading is all or nothing. Everything that can be checked (the keys, each
tensor's shape and dtype, the optimizer's class and parameter groups) is
checked before anything changes, alike on every rank, so that all ranks
raise the same error instead of some waiting; a sharded checkpoint is read
into buffers of its own first, so a damaged shard leaves the model as it
was. Only then are the optimizer state and the weights copied in. With
tensor parallelism a process reads only its blocks of each tensor (a
memory-mapped file, safetensors' ``get_slice``: ``slices``), and a refusal
anywhere is everyone's, every tp slice's job alike (``peers``).
Every function here is a collective where the job has several processes:
call it on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ..distributed.agreement import Agreement
from ..distributed.topology import Topology
from ..runtime.dtensors import is_dtensor
from ..runtime.warn import warn
from . import catalog, optim_state, pretrained, sharded, slices
from . import checkpoint as files
from .peers import Peers, peers_of
from .saving import Engine, Saver

__all__ = ["gather_state_dict", "own_entries", "load", "resume"]


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


# -- loading ---------------------------------------------------------------------------------------------------


@dataclass
class _Scope:
    """What one process loads into: its share of the model and, for the checks, the whole model's keys."""

    module: nn.Module                                # names the optimizer's parameters
    own: Dict[str, Any]                              # this process's share, under the model's keys
    keys: Set[str]                                   # the whole model's keys (every process's share)
    whole: Dict[str, Any]                            # every process's entries as meta tensors (shape and dtype)
    tied: Dict[str, str]                             # the whole model's later uses of tied weights -> first uses
    load: Callable[..., Any]                         # loads entries of this share (load_state_dict)
    rank: int
    world_size: int
    position: int                                    # this process's place in the job's order (its RNG state's)
    tp: int                                          # the tp dimension's size (1 without tensor parallelism)


def _scope(engine: Engine, peers: Peers) -> _Scope:
    """What this process loads into, and the whole model's entries (gathered in stage mode), so that a refused
    load names the same misfits, counted over the whole model, on every rank."""
    own = engine.local_state_dict()
    mine = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for k, v in own.items()}
    specs, tied = dict(mine), engine.tied_places()
    if engine.topology.world_size > 1 and engine.topology.mode == "stage":
        specs = {}  # in rank order: every rank lists the misfits alike
        for part, ties in engine.agreement.gather_to_all((mine, sorted(tied.items()))):
            specs.update(part)
            tied.update(ties)
    whole = {k: torch.empty(spec[0], dtype=spec[1], device="meta") for k, spec in specs.items() if spec is not None}
    keys: Set[str] = set(specs)
    # mypy: an Engine is an nn.Module at run time; the protocol cannot say so without a base class
    topo = engine.topology
    return _Scope(engine, own, keys, whole, tied, engine.load_state_dict, topo.rank,  # type: ignore[arg-type]
                  topo.world_size, topo.job_ranks.index(topo.rank), peers.tp_size)


def _same_layout(scope: _Scope, meta: Dict[str, Any]) -> bool:
    """Whether the checkpoint was saved by a job like this one (its RNG states then restore, place by place)."""
    return int(meta.get("world_size", -1)) == scope.world_size and int(meta.get("tp", 1)) == scope.tp


def _together(peers: Peers, fn: Callable[[], Any]) -> Any:
    """``fn()`` on everyone (the job, and with tensor parallelism its tp peers' jobs); if it raised anywhere,
    everyone raises (the first error), none waits."""
    if not peers.distributed:
        return fn()
    error: Optional[BaseException] = None
    result = None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the others are told
        error = exc
    errors = peers.gather(f"{type(error).__name__}: {error}" if error is not None else "")
    if error is not None:
        raise error
    first = next(((r, e) for r, e in zip(peers.ranks, errors) if e), None)
    if first is not None:
        raise RuntimeError(f"rank {peers.rank}: loading failed on rank {first[0]}: {first[1]}")
    return result


def _load_file(scope: _Scope, payload: Dict[str, Any], path: str,
               optimizer: Optional[torch.optim.Optimizer]) -> Callable[[], None]:
    """Check ``payload`` whole against this process's share; returns what loads the optimizer state and weights."""
    files.check_model_keys(path, payload["model"], scope.keys)
    files.check_model_tensors(path, files.specs(payload["model"]), scope.whole)
    if optimizer is not None:
        optim_state.check_optimizer(path, payload.get("meta", {}).get("optimizer"),
                                    payload.get("optimizer") is not None, optimizer)
        optim_state.check_named_state(path, payload["optimizer"], scope.module, optimizer)

    # this process's values, read now (from a memory-mapped file only its blocks' bytes), so that apply only copies
    values = {k: _own_value(v, scope.own[k]) for k, v in payload["model"].items() if k in scope.own}
    named = None
    if optimizer is not None:
        named = dict(payload["optimizer"], state={k: _cloned(v) for k, v in payload["optimizer"]["state"].items()
                                                  if k in scope.own})

    def apply() -> None:
        if named is not None:
            optim_state.load_named_optimizer_state(scope.module, optimizer, named)  # type: ignore[arg-type]
        scope.load(values)

    return apply


def _own_value(whole: Any, own: Any) -> Any:
    """A saved whole tensor as this process holds it: its block (a ``DTensor``), or a copy of the whole."""
    if not isinstance(whole, torch.Tensor) or not isinstance(own, torch.Tensor):
        return whole
    return slices.local_part(whole, own) if is_dtensor(own) else whole.clone()


def _cloned(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    return value


def _load_pretrained(scope: _Scope, path: str, optimizer: Optional[torch.optim.Optimizer]) -> Callable[[], None]:
    """A Hugging Face directory (``pretrained``): checked whole from its index and headers, then only this
    process's tensors are read; returns what copies them in."""
    if optimizer is not None:
        raise ValueError(f"{path} holds a model's weights only (Hugging Face safetensors); load it without an "
                         "optimizer, which starts fresh")
    where = pretrained.tensor_files(path)
    named = _first_places(where, scope.tied)
    files.check_model_keys(path, set(where) | set(scope.tied) | set(named), scope.keys)
    files.check_model_tensors(path, pretrained.read_specs(where), scope.whole)
    wanted = {k: k if k in where else named[k] for k in scope.own if k in where or k in named}
    blocks = _blocks(wanted, scope.own)
    read = pretrained.read_tensors(where, sorted(set(wanted.values())), blocks)
    values = {k: slices.from_block(read[source], scope.own[k]) if source in blocks else read[source]
              for k, source in wanted.items()}

    def apply() -> None:
        scope.load(values, strict=False)  # every key was checked above; tied places take their first use's value

    return apply


def _blocks(wanted: Dict[str, str], own: Dict[str, Any]) -> Dict[str, slices.Block]:
    """The block of each tensor to read that this process holds a block of (tensor parallelism); a tensor two
    places read with different blocks (tied, laid out apart) is read whole."""
    found: Dict[str, Optional[slices.Block]] = {}
    for key, source in wanted.items():
        b = slices.block(own[key])
        found[source] = b if found.get(source, b) == b else None
    return {source: b for source, b in found.items() if b is not None}


def _first_places(where: Dict[str, str], tied: Dict[str, str]) -> Dict[str, str]:
    """The first places of tied weights that the directory holds under a later place's name only, and that name
    (transformers keeps BART's ``model.shared.weight``, the engine's first place is the encoder's embedding)."""
    named: Dict[str, str] = {}
    for later, first in sorted(tied.items()):
        if first not in where and later in where:
            named.setdefault(first, later)
    return named


def _buffer(own: torch.Tensor, saved: Tuple[Any, torch.dtype]) -> torch.Tensor:
    """A new tensor to read a saved entry into: the saved shape and dtype, cut like ``own`` where that is a shard
    (``shard=``: DCP then reads only this rank's rows, nothing whole)."""
    if is_dtensor(own):
        return torch.empty_like(own, dtype=saved[1])
    return torch.empty(tuple(saved[0]), dtype=saved[1])


def _load_sharded(scope: _Scope, path: str, optimizer: Optional[torch.optim.Optimizer],
                  rng: bool) -> Tuple[Callable[[], None], Dict[str, Any]]:
    """Read this process's share of a sharded checkpoint; returns what loads it, and its ``extra``.

    The checks (keys, shapes, dtypes, the optimizer's class and state) use the
    metadata alone. Then each process reads its own keys into new buffers; only
    the returned function copies them into the model and the optimizer.
    """
    metadata = sharded.read_metadata(path)
    head = sharded.header(path, metadata)
    saved = sharded.entry_specs(metadata, "model")
    files.check_model_keys(path, sharded.model_shapes(metadata), scope.keys)
    files.check_model_tensors(path, saved, scope.whole)
    target: Dict[str, Any] = {"model": {k: _buffer(v, saved[k]) if isinstance(v, torch.Tensor) and k in saved else v
                                        for k, v in scope.own.items()}}
    if optimizer is not None:
        optim_state.check_optimizer(path, head["meta"].get("optimizer"), sharded.has_optimizer(metadata), optimizer)
        flat = optim_state.flat_optimizer_state(scope.module, optimizer)
        saved_opt = sharded.entry_specs(metadata, "optimizer")
        missing = sorted(set(flat) - set(sharded.optimizer_keys(metadata)))
        if missing:
            raise ValueError(f"{path} lacks optimizer state the optimizer has ({missing[:5]}): was it saved with "
                             "other parameter groups, or before every parameter had a gradient?")
        files.check_model_tensors(f"{path} (its optimizer state)", saved_opt, flat)
        target["optimizer"] = {k: _buffer(v, saved_opt[k]) if isinstance(v, torch.Tensor) else v
                               for k, v in flat.items()}
    rng = rng and _same_layout(scope, head["meta"])
    if rng:
        target["rng"] = {str(scope.rank): None}
    sharded.read(path, target)

    def apply() -> None:
        if optimizer is not None:
            optim_state.load_flat_optimizer_state(scope.module, optimizer, target["optimizer"])
        scope.load(target["model"])
        if rng:
            files.set_rng_state(target["rng"][str(scope.rank)][0])

    return apply, head["extra"]


def _load_any(peers: Peers, scope: _Scope, path: str, optimizer: Optional[torch.optim.Optimizer], *,
              rng: bool, payload: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Load ``path`` (either format) into ``scope`` on every rank; any rank's failure is every rank's.

    Two rounds: every rank checks (and reads) what it will load, and only when
    no rank refused does any rank change anything.
    """

    def prepare() -> Tuple[Callable[[], None], Dict[str, Any]]:
        if pretrained.is_pretrained(path):
            return _load_pretrained(scope, path, optimizer), {}
        if os.path.isdir(path):
            return _load_sharded(scope, path, optimizer, rng)
        contents = payload if payload is not None else files.load(path, mmap=True)
        load_model = _load_file(scope, contents, path, optimizer)
        rngs = contents.get("rng") or []
        restore = rng and len(rngs) == scope.world_size and _same_layout(scope, contents.get("meta", {}))

        def apply() -> None:
            load_model()
            if restore:  # a tp peer takes its t=0 peer's (saved alone): the peers draw alike, as tensor parallelism
                files.set_rng_state(rngs[scope.position])  # needs of them

        return apply, contents.get("extra", {})

    apply, extra = _together(peers, prepare)
    _together(peers, apply)
    return extra


def load(engine: Engine, path: str, optimizer: Optional[torch.optim.Optimizer] = None, *,
         saver: Optional[Saver] = None) -> Dict[str, Any]:
    """Load a checkpoint (a file or a sharded directory, any layout) into this process's share; its ``extra``."""
    engine.agreement.enter("load")
    if saver is not None:
        saver.wait()
    peers = _peers(engine, saver)
    return _load_any(peers, _scope(engine, peers), path, optimizer, rng=False)


def _peers(engine: Engine, saver: Optional[Saver]) -> Peers:
    return saver.peers(engine) if saver is not None else peers_of(engine, None)


def _warn(message: str) -> None:
    warn(f"pipeddp: {message}", RuntimeWarning)


def resume(engine: Engine, directory: str, optimizer: Optional[torch.optim.Optimizer] = None, *,
           saver: Optional[Saver] = None) -> Optional[Dict[str, Any]]:
    """Load the newest complete checkpoint of ``directory``; its ``extra`` (with ``step``), or None if none.

    Rank 0 picks it, files and sharded directories alike, and warns naming
    every one it skips and why. A directory that does not exist yet, or is
    empty, is a first run: None, quietly (``save_checkpoint`` fills it). One
    that holds files but no checkpoint that reads warns that training starts
    from scratch: it may be the wrong directory, or its checkpoints were lost.
    A file the safe loader refuses as unsafe raises on every rank. Every rank
    then loads the chosen one. Random generator states are restored when the
    job has as many ranks (and as many tensor-parallel peers) as the one that
    saved. With tensor parallelism the root of job t=0 chooses for everyone.
    """
    engine.agreement.enter("resume")
    if saver is not None:
        saver.wait()
    topo = engine.topology
    peers = _peers(engine, saver)
    read: Dict[str, Any] = {}  # rank 0 has read a file while choosing it: no second read there

    def choose() -> List[Any]:
        if not os.path.exists(directory):
            return [None, ""]
        if not os.path.isdir(directory):
            raise ValueError(f"cannot resume from {directory}: it is a file, not a directory of checkpoints; "
                             "to load one checkpoint file use load()")
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
            if skipped or os.listdir(directory):  # an empty one is a first run in a directory made beforehand
                what = (f"none of the {len(skipped)} checkpoint(s) there is complete and readable" if skipped else
                        "it holds no step-* checkpoint")
                _warn(f"no checkpoint to resume from in {directory}: {what}; training starts from scratch")
            return [None, ""]
        if found[1] is not None:
            read[found[0]] = found[1]
        return [found[0], ""]

    path, error = peers.from_root(choose)
    if error:
        raise files.UnsafeCheckpointError(f"rank {topo.rank}: {error}")
    if path is None:
        return None
    return _load_any(peers, _scope(engine, peers), path, optimizer, rng=True, payload=read.get(path))
