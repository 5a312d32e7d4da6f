"""``save_pretrained``: the model as a Hugging Face directory, written by every process, each its own tensors.

::

    tuned/
        model-00001-of-00004.safetensors   one file per writing process: whole tensors under the original names
        ...                                (each tensor written once, by a process that holds it)
        config.json                        the transformers model's configuration (and generation_config.json
                                           where it generates), written by rank 0; none for other models
        model.safetensors.index.json       written last, by rank 0, once every file is on disk: the weight_map

Every rank, together (a collective, opened by the engine's call check; with
tensor parallelism everyone: the job and its tp peers' jobs, ``peers``)::

    1. each lists what it holds (names, global shapes, dtypes): gathered, so that all plan alike and raise alike
    2. the root makes the directory (refusing one that holds other files) and writes the configuration
    3. each tensor goes to the file of one of the processes that hold it, the bytes spread over a stage's
       replicas and tp peers; each such process makes its file at its full size (the header says where
       every tensor lies: ``slices.Layout``)
    4. every process writes its bytes in place: a whole tensor by its file's maker; a sharded one
       (tensor parallelism, shard=) block by block, by every holder of a block in the maker's mesh,
       nothing gathered; each syncs what it wrote, then each maker renames its file into place
    5. once every rank has, the root writes the index atomically: the directory is complete

So no process holds more than its own tensors (one tensor on its way to the
CPU, or, for a layout of no single block such as FSDP2's strided shards over
``tp``, one gathered tensor). transformers' ``from_pretrained``
and pipeddp's ``load`` open a sharded directory through its index, which comes
last: a directory whose writer was killed has none and does not look complete.
An earlier export in the directory loses its index (or its single file) first.

Tied weights are written once, as ``load`` reads them (``pretrained``): the
later places of a tied weight are left out, and the weight takes the name
transformers keeps (``all_tied_weights_keys``: the embedding, not the head).

Why not DCP's ``HuggingFaceStorageWriter`` (torch 2.14): distributed
(``save_distributed=True``) it writes each rank's pieces of tensors to
``shard-*`` files and no index, which ``from_pretrained`` does not open; with
``enable_consolidation`` DCP's finish step makes ``from_pretrained``'s shards,
but on rank 0 alone, reading every rank's files and writing every tensor again
(beside a ``sharded/`` copy). Writing each tensor's bytes once, in place, from
the processes that hold them, needs no second pass and no gather.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch
from torch import nn

from ..distributed.agreement import Agreement
from ..distributed.topology import Topology
from ..runtime.dtensors import is_dtensor, local
from ..runtime.materialize import recorded_init
from ..runtime.names import recorded_source
from . import catalog, slices
from .checkpoint import first_line
from .peers import peers_of
from .pretrained import INDEX, SINGLE
from .saving import Saver

__all__ = ["Source", "source_of", "save_pretrained", "CONFIG", "GENERATION"]

CONFIG, GENERATION = "config.json", "generation_config.json"
#: what an export (or transformers' save_pretrained of the weights) leaves in a directory: replaced, not refused
_OWN = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json|"
                  r"generation_config\.json)(\.tmp)?$")


class Exporter(Protocol):
    """What an export needs of the engine (``Pipeline`` or ``HybridParallel``)."""

    topology: Topology
    agreement: Agreement

    def local_state_dict(self) -> Dict[str, Any]: ...

    def tied_keys(self) -> List[str]: ...

    def model_keys(self) -> List[str]: ...


@dataclass
class Source:
    """What an export needs of the transformers model an engine's layers came from (not the model itself: in
    stage mode its other stages' tensors would stay alive in every process)."""

    architecture: str            # the class's name, for config.architectures
    config: Any                  # its PretrainedConfig (the object: what is changed on it before the export is kept)
    generation_config: Any       # its GenerationConfig where the model generates, else None
    tied: Dict[str, str]         # transformers' tied weights: each later place -> the name it keeps
    ignore: Tuple[str, ...]      # keys transformers does not save (_keys_to_ignore_on_save)


def source_of(model: nn.Module) -> Optional[Source]:
    """The transformers model ``model`` (an engine's ``nn.Sequential``) was flattened from, else None.

    ``flatten_sequential`` records it (``runtime.names``); a model flattened on the
    meta device also records its ``_init_weights``, bound to it.
    """
    found = recorded_source(model)
    if found is None:
        found = getattr(recorded_init(model), "__self__", None)
    hf = sys.modules.get("transformers")  # a transformers model means transformers is imported
    if hf is None or not isinstance(found, hf.PreTrainedModel):
        return None
    generation = found.generation_config if found.can_generate() else None
    tied = {str(k): str(v) for k, v in (getattr(found, "all_tied_weights_keys", None) or {}).items()}
    return Source(type(found).__name__, found.config, generation, tied,
                  tuple(getattr(found, "_keys_to_ignore_on_save", None) or ()))


# -- what each process holds -------------------------------------------------------------------------------------

#: a tensor's (shape, dtype name, bytes)
Spec = Tuple[Tuple[int, ...], str, int]


def _identity(key: str, t: torch.Tensor) -> Tuple[Any, ...]:
    """Equal for two keys of one tensor (a tied weight both of whose places this process holds)."""
    own = local(t)
    if own.numel() == 0:  # no memory to share: its address says nothing
        return (key,)
    return (own.device, own.data_ptr(), own.dtype, tuple(own.shape), tuple(own.stride()))


def _held(engine: Exporter, source: Optional[Source]) -> Tuple[Dict[str, torch.Tensor], List[str], str]:
    """This process's tensors to write (each tensor once, at its first place), the later places of tied weights it
    leaves out, and what it cannot write ("" when nothing)."""
    later = set(engine.tied_keys())
    ignore = set(source.ignore if source is not None else ())
    out: Dict[str, torch.Tensor] = {}
    first: Dict[Tuple[Any, ...], str] = {}
    bad: List[str] = []
    odd: List[str] = []
    for key, value in engine.local_state_dict().items():
        if key in later or key in ignore:
            continue
        if not isinstance(value, torch.Tensor):
            bad.append(key)
            continue
        if value.dtype not in slices.CODES:
            odd.append(f"{key} ({value.dtype})")
            continue
        if first.setdefault(_identity(key, value), key) == key:
            out[key] = value
        else:  # a later place of a tied weight whose first this process holds too (one tensor: one stage holds both)
            later.add(key)
    error = (f"rank {engine.topology.rank}: {bad[:5]} are not tensors, which safetensors cannot hold; drop them from "
             "the model's state dict, or save with save()") if bad else ""
    if odd and not error:
        error = (f"rank {engine.topology.rank}: {odd[:5]} have dtypes safetensors has no code for; convert them, or "
                 "save with save()")
    return out, sorted(later), error


def _spec(t: torch.Tensor) -> Spec:
    return tuple(int(n) for n in t.shape), str(t.dtype).rpartition(".")[2], t.numel() * t.element_size()


# -- the plan, alike on every rank ---------------------------------------------------------------------------------


@dataclass
class _Plan:
    writer: Dict[str, int]       # each key's writing rank
    names: Dict[str, str]        # a key written under another name: a tied weight, under the one transformers keeps
    files: Dict[int, str]        # each writing rank's file
    specs: Dict[str, Spec]

    def weight_map(self) -> Dict[str, str]:
        return {self.names.get(k, k): self.files[r] for k, r in sorted(self.writer.items())}

    def layouts(self) -> Dict[str, slices.Layout]:
        """Each file's layout (its tensors under the names written, their places in it), alike on every rank."""
        specs: Dict[str, Dict[str, Tuple[torch.dtype, Tuple[int, ...]]]] = {name: {} for name in self.files.values()}
        for key, rank in self.writer.items():
            shape, dtype, _ = self.specs[key]
            specs[self.files[rank]][self.names.get(key, key)] = (getattr(torch, dtype), shape)
        return {name: slices.Layout.of(tensors) for name, tensors in specs.items()}


def _plan(parts: List[Tuple[int, Dict[str, Spec], List[str]]], tied: Dict[str, str]) -> _Plan:
    """Who writes what: each key by the holder with the fewest bytes so far (largest tensors first)."""
    holders: Dict[str, List[int]] = {}
    specs: Dict[str, Spec] = {}
    later = set()
    for rank, held, places in parts:
        later.update(places)
        for key, spec in held.items():
            holders.setdefault(key, []).append(rank)
            specs.setdefault(key, spec)
    # the engine's first place of a tied weight is one transformers calls a later place: written under the other
    names = {k: tied[k] for k in holders if k in tied and tied[k] not in holders and tied[k] in later}
    load: Dict[int, int] = {}
    writer: Dict[str, int] = {}
    for key in sorted(holders, key=lambda k: (-specs[k][2], k)):
        rank = min(holders[key], key=lambda r: (load.get(r, 0), r))
        writer[key] = rank
        load[rank] = load.get(rank, 0) + specs[key][2]
    ranks = sorted(set(writer.values()))
    files = {r: f"model-{i + 1:05d}-of-{len(ranks):05d}.safetensors" for i, r in enumerate(ranks)}
    return _Plan(writer, names, files, specs)


# -- the directory and the files -------------------------------------------------------------------------------------


def _prepare(directory: str, source: Optional[Source], dtype: Optional[str]) -> None:
    """On rank 0: an empty directory (an earlier export in it removed, its index first), then the configuration."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"{directory} exists and is not a directory; save_pretrained writes a directory: choose "
                         "another path")
    if os.path.isdir(directory):
        present = os.listdir(directory)
        foreign = sorted(n for n in present if not _OWN.match(n) or not os.path.isfile(os.path.join(directory, n)))
        if foreign:
            raise ValueError(f"{directory} holds files that are not a Hugging Face export's ({foreign[:5]}); "
                             "choose an empty or a new directory (nothing was written)")
        for name in sorted(present, key=lambda n: n not in (INDEX, SINGLE)):  # no longer complete, first
            os.unlink(os.path.join(directory, name))
            if name in (INDEX, SINGLE):
                catalog.sync_directory(directory)
    os.makedirs(directory, exist_ok=True)
    if source is not None:
        config = copy.deepcopy(source.config)
        config.architectures = [source.architecture]
        if dtype is not None:
            config.dtype = dtype  # as transformers' save_pretrained records the model's dtype
        config.save_pretrained(directory)
        if source.generation_config is not None:
            source.generation_config.save_pretrained(directory)


def _create_file(path: str, layout: slices.Layout) -> None:
    """``path.tmp`` with the header of ``layout`` and room for its tensors, which their holders write in place."""
    slices.create_file(path + ".tmp", layout)


def _write_blocks(directory: str, plan: _Plan, held: Dict[str, torch.Tensor], rank: int) -> str:
    """This process's bytes of every file: the whole tensors it writes (``plan.writer``), and its block of every
    sharded tensor written by a rank in its mesh; synced. Returns its error ("" when none). A sharded tensor
    with no block (strided shards) is gathered by all its holders, in the same order on each, for its writer."""
    layouts = plan.layouts()
    fds: Dict[str, int] = {}
    error = ""
    try:
        for key in sorted(held):
            value, owner = held[key], plan.writer[key]
            block = slices.block(value)
            if is_dtensor(value) and block is None:
                value = value.full_tensor()  # type: ignore[attr-defined]  # a DTensor (is_dtensor)
                mine = owner == rank
            elif is_dtensor(value):
                mine = slices.writes_block(value, owner)
                value = value.to_local()  # type: ignore[attr-defined]  # a DTensor (is_dtensor)
            else:
                mine = owner == rank
            if not mine or error:
                continue
            name = plan.files[owner]
            try:
                if name not in fds:
                    fds[name] = os.open(os.path.join(directory, name + ".tmp"), os.O_WRONLY)
                slices.write_block(fds[name], layouts[name], plan.names.get(key, key), value, block)
            except Exception as exc:  # noqa: BLE001 - every rank raises after the others are told
                error = f"rank {rank}: writing {name} failed: {first_line(exc)}"
        for fd in fds.values():
            if not error:
                os.fsync(fd)
    except Exception as exc:  # noqa: BLE001 - every rank raises after the others are told
        error = error or f"rank {rank}: writing failed: {first_line(exc)}"
    finally:
        for fd in fds.values():
            os.close(fd)
    return error


def _finish_file(path: str) -> None:
    """``path.tmp``, every block in it, synced and renamed into place."""
    fd = os.open(path + ".tmp", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(path + ".tmp", path)


def _write_index(directory: str, plan: _Plan) -> None:
    """On rank 0, once every file is on disk: the index, atomically (written aside, synced, renamed)."""
    index = {"metadata": {"total_size": sum(spec[2] for spec in plan.specs.values())},
             "weight_map": plan.weight_map()}
    path = os.path.join(directory, INDEX)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    catalog.sync_directory(directory)  # every file's name before the index that names it
    os.replace(path + ".tmp", path)
    catalog.sync_directory(directory)


def _raise_any(rank: int, mine: str, errors: List[str]) -> None:
    """Raise on every rank when any rank failed (``mine``: this rank's error, ``errors``: every rank's; "" is none)."""
    if mine:
        raise RuntimeError(mine)
    first = next((e for e in errors if e), "")
    if first:
        raise RuntimeError(f"rank {rank}: save_pretrained failed on another rank (no index was written): {first}")


def _dtype(engine: Exporter, specs: Dict[str, Spec]) -> Optional[str]:
    """The model's dtype as transformers records it: its first floating-point tensor's."""
    for key in engine.model_keys():
        if key in specs and getattr(torch, specs[key][1]).is_floating_point:
            return specs[key][1]
    return None


def save_pretrained(engine: Exporter, directory: str, source: Optional[Source], *,
                    saver: Optional[Saver] = None) -> None:
    """Write the engine's model to ``directory`` as a Hugging Face directory (see the module's docstring)."""
    engine.agreement.enter("save_pretrained")
    directory = os.fspath(directory)
    if saver is not None:
        saver.wait()
    peers = saver.peers(engine) if saver is not None else peers_of(engine, None)
    rank = engine.topology.rank
    held, places, error = _held(engine, source)
    parts = peers.gather((rank, {k: _spec(v) for k, v in held.items()}, places, error))
    _raise_any(rank, error, [p[3] for p in parts])
    plan = _plan([p[:3] for p in parts], source.tied if source is not None else {})
    dtype = _dtype(engine, plan.specs)
    peers.from_root(lambda: _prepare(directory, source, dtype))
    mine = plan.files.get(rank)
    error = ""
    if mine is not None:  # this process's file, at its full size, before anyone writes into it
        try:
            _create_file(os.path.join(directory, mine), plan.layouts()[mine])
        except Exception as exc:  # noqa: BLE001 - every rank raises below, and none writes the index
            error = f"rank {rank}: writing {mine} failed: {first_line(exc)}"
    _raise_any(rank, error, peers.gather(error))
    error = _write_blocks(directory, plan, held, rank)
    _raise_any(rank, error, peers.gather(error))
    if mine is not None:
        try:
            _finish_file(os.path.join(directory, mine))
        except Exception as exc:  # noqa: BLE001 - every rank raises below, and none writes the index
            error = f"rank {rank}: writing {mine} failed: {first_line(exc)}"
    _raise_any(rank, error, peers.gather(error))
    peers.from_root(lambda: _write_index(directory, plan))
