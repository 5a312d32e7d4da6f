"""Sharded checkpoints: a directory written by ``torch.distributed.checkpoint`` (DCP), every process its share.

::

    step-000000042/
        __0_0.distcp  __1_0.distcp  ...   one file per rank, written by all ranks in parallel
        .metadata                         written last, by rank 0, once every rank's file is on disk

The entries (DCP flattens the nested dict below, joining keys with dots)::

    "model.<key>"            each tensor under the plain model's key; replicas hold equal copies and
                             DCP's planner keeps each key once, spreading the writes over the replicas
    "optimizer.<flat key>"   the optimizer state in PyTorch's per-parameter form (``optim_state.py``)
    "rng.<rank>"             (that rank's generator states,)
    "pipeddp"                (header,): format, extra, meta -- written by rank 0

The header and the RNG states are 1-tuples because DCP stores a tuple
whole (one ``torch.save``), while it would open a dict into entries of its
own, dropping an empty one and turning int keys into strings: ``extra``
must come back exactly as it went in.

*Complete* means DCP's ``.metadata`` is there: DCP renames it into place
after every rank has written and synced its file, so a directory being
written, or left by a killed writer, never looks complete. ``read_metadata``
also checks that every file it names is there and long enough.

Safe to open: DCP's own reader unpickles ``.metadata`` with ``pickle`` and
non-tensor entries with ``torch.load(weights_only=False)``, either of which
runs whatever code a crafted file holds. ``SafeReader`` reads the metadata
with an unpickler that builds DCP's metadata classes and nothing else, and
``SafeLoadPlanner`` reads non-tensor entries with ``weights_only=True``
(tensors DCP already reads that way).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import warnings
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Tuple, TypeGuard

import torch

from . import checkpoint as files
from .checkpoint import DamagedCheckpointError, UnsafeCheckpointError, first_line
from .optim_state import unflatten_optimizer_state

if TYPE_CHECKING:  # DCP is imported where it is used: it costs every process importing pipeddp 0.7 s otherwise
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
__all__ = ["METADATA", "is_complete", "clear", "write", "read_metadata", "read", "header", "model_shapes",
           "entry_specs", "optimizer_keys", "has_optimizer", "template", "to_file"]

METADATA = files.DCP_METADATA
#: What DCP's file system writer leaves in a checkpoint directory (data files, metadata, their temporaries).
_OWN_FILES = re.compile(r"^(__\d+_\d+\.distcp|__\d+\.metadata|\.metadata)(\.tmp)?$")

def _is_tensor(md: Any) -> TypeGuard[TensorStorageMetadata]:
    """Whether an entry of DCP's metadata is a tensor's (imported here: DCP is loaded once there is metadata)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return isinstance(md, TensorStorageMetadata)


def is_complete(path: str) -> bool:
    """Whether ``path`` is a directory in which DCP finished a checkpoint (its metadata is there)."""
    return os.path.isfile(os.path.join(path, METADATA))


def clear(path: str) -> None:
    """Make ``path`` an empty directory for a new checkpoint, removing an old checkpoint there.

    A directory holding anything but a sharded checkpoint's files is refused:
    a typo must not delete the user's files.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path} exists and is not a directory; a sharded checkpoint is a directory: "
                         "choose another path (or sharded=False for one file)")
    if os.path.isdir(path):
        foreign = sorted(n for n in os.listdir(path) if not _OWN_FILES.match(n))
        if foreign:
            raise ValueError(f"{path} holds files that are not a sharded checkpoint's ({foreign[:5]}); choose an "
                             "empty or a new directory for the checkpoint")
        shutil.rmtree(path)
    os.makedirs(path)


def _storage_writer(path: str) -> FileSystemWriter:
    """The writer of one checkpoint (one place, so tests can inject faults): one file per rank, fsynced."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(path, single_file_per_rank=True, sync_files=True)


#: what DCP warns when it saves or loads in one process, even when told so (``no_dist=True``)
_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"
#: where the warning of a one-process async save points (DCP's logging wrapper), from DCP's own thread, where no
#: ``catch_warnings`` of the caller's thread reaches; so a filter for this message and module stays, once set
_ASYNC_THREAD = r"torch\.distributed\.checkpoint\.utils"


@contextlib.contextmanager
def _told_one_process() -> Iterator[None]:
    """DCP warns that it assumes one process even when told so (``no_dist=True``); here it was told."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        yield


def write(state: Dict[str, Any], path: str, *, group: Any, async_save: bool) -> Optional[Future]:
    """Write ``state`` (this rank's share) to ``path`` with DCP: all ranks of ``group`` together.

    ``group`` None: this process alone. With ``async_save`` the tensors are
    copied (staged) now and written by DCP's background thread; the returned
    future completes on every rank once the checkpoint is complete.
    """
    import torch.distributed.checkpoint as dcp

    writer = _storage_writer(path)
    if async_save and group is None:  # DCP's thread warns again, later, outside any catch_warnings of this one
        warnings.filterwarnings("ignore", message=_ONE_PROCESS + ", assuming the intent is to save",
                                module=_ASYNC_THREAD)
    with _told_one_process():
        if async_save:
            pending: Any = dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=group is None)
            # newer torch may answer with a staging and an upload future: the checkpoint is complete at the upload
            return getattr(pending, "upload_completion", pending)
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
    return None


def read_metadata(path: str) -> Metadata:
    """The metadata of the sharded checkpoint ``path``, read safely, after checking that it is complete.

    Raises ``DamagedCheckpointError`` when the directory is incomplete (no
    metadata: being written, or its writer was killed), when the metadata
    cannot be read, or when a file it names is missing or shorter than the
    data in it; ``UnsafeCheckpointError`` when the metadata references
    anything but DCP's metadata classes (nothing from it was run).
    """
    if not is_complete(path):
        raise DamagedCheckpointError(f"{path} is an incomplete sharded checkpoint: it has no {METADATA} (DCP writes "
                                     "it last, so the checkpoint is being written or its writer was killed)")
    from .dcp_safe import SafeReader

    try:
        metadata = SafeReader(path).read_metadata()
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(f"{path}/{METADATA} was refused: it {exc}, which DCP's metadata never does, and "
                                    "building it could run code; nothing in it was run") from None
    except DamagedCheckpointError as exc:
        raise DamagedCheckpointError(f"{path} is damaged: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign metadata file
        raise DamagedCheckpointError(f"{path} is damaged: its {METADATA} cannot be read ({first_line(exc)})") from None
    if not isinstance(metadata.planner_data, dict) or not isinstance(metadata.storage_data, dict):
        raise DamagedCheckpointError(f"{path} is not a pipeddp sharded checkpoint: its {METADATA} lacks the key "
                                     "mapping pipeddp's writer records")
    needed: Dict[str, int] = {}
    try:
        for info in metadata.storage_data.values():
            name, end = info.relative_path, int(info.offset) + int(info.length)
            if not isinstance(name, str) or os.path.basename(name) != name or not _OWN_FILES.match(name):
                raise ValueError(f"a data file named {name!r}")  # only files of the directory itself are read
            needed[name] = max(needed.get(name, 0), end)
    except Exception as exc:  # noqa: BLE001 - a crafted or damaged index
        raise DamagedCheckpointError(f"{path} is damaged: its {METADATA} indexes {first_line(exc)}") from None
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.isfile(file) else -1
        if have < size:
            why = "is missing" if have < 0 else f"holds {have} bytes of the {size} its metadata names"
            raise DamagedCheckpointError(f"{path} is damaged: its shard file {name} {why}")
    return metadata


def _path_of(metadata: Metadata, fqn: str) -> Tuple[Any, ...]:
    return tuple(metadata.planner_data.get(fqn, (fqn,)))


def template(metadata: Metadata, tops: Iterable[str]) -> Dict[str, Any]:
    """An empty state dict to read the entries under the top-level keys ``tops`` into (all with ``"*"``).

    Tensors are allocated with their saved size and dtype; other entries are
    placeholders that reading replaces.
    """
    wanted = set(tops)
    root: Dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        path = _path_of(metadata, fqn)
        if "*" not in wanted and str(path[0]) not in wanted:
            continue
        where = root
        for key in path[:-1]:
            where = where.setdefault(str(key), {})
        if _is_tensor(md):
            where[str(path[-1])] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            where[str(path[-1])] = None
    return root


def read(path: str, target: Dict[str, Any]) -> None:
    """Fill ``target`` (a nested state dict, tensors pre-allocated) from ``path``, in this process alone.

    Every key of ``target`` must be in the checkpoint; keys of the checkpoint
    that ``target`` lacks are not read (each process reads its own share).
    """
    import torch.distributed.checkpoint as dcp

    from .dcp_safe import SafeLoadPlanner, SafeReader

    try:
        with _told_one_process():
            dcp.load(target, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=True)
    except (dcp.CheckpointException, Exception) as exc:  # DCP wraps each failure in a CheckpointException
        failures = getattr(exc, "failures", None) or {}
        causes = [e for e, _ in failures.values()] or [exc]
        for cause in causes:
            if isinstance(cause, pickle.UnpicklingError):
                raise UnsafeCheckpointError(f"{path}: an entry was refused by PyTorch's safe loader ("
                                            f"{first_line(cause)}); nothing in it was run") from None
        raise DamagedCheckpointError(f"{path} is damaged: reading it failed ({first_line(causes[0])})") from None


def header(path: str, metadata: Metadata) -> Dict[str, Any]:
    """The checkpoint's ``{"format", "extra", "meta"}``, checked to be pipeddp's."""
    if "pipeddp" not in metadata.state_dict_metadata:
        raise DamagedCheckpointError(f"{path} is a DCP checkpoint but not a pipeddp one (it has no 'pipeddp' "
                                     "entry); write one with HybridParallel.save(..., sharded=True)")
    box: Dict[str, Any] = {"pipeddp": None}
    read(path, box)
    head = box["pipeddp"][0] if isinstance(box["pipeddp"], tuple) and box["pipeddp"] else None
    if not isinstance(head, dict) or head.get("format") != files.FORMAT:
        found = head.get("format") if isinstance(head, dict) else type(head).__name__
        raise DamagedCheckpointError(f"{path} is not a pipeddp checkpoint of format {files.FORMAT!r} "
                                     f"(found {found!r})")
    return head


def model_shapes(metadata: Metadata) -> Dict[str, torch.Size]:
    """The model's keys in the checkpoint, with each tensor's size."""
    shapes = {}
    for fqn, md in metadata.state_dict_metadata.items():
        path = _path_of(metadata, fqn)
        if len(path) == 2 and path[0] == "model":
            shapes[str(path[1])] = md.size if _is_tensor(md) else torch.Size()
    return shapes


def entry_specs(metadata: Metadata, top: str) -> Dict[str, Tuple[torch.Size, torch.dtype]]:
    """``(size, dtype)`` of every tensor under the top-level key ``top`` (``"model"``, ``"optimizer"``)."""
    found = {}
    for fqn, md in metadata.state_dict_metadata.items():
        path = _path_of(metadata, fqn)
        if len(path) == 2 and path[0] == top and _is_tensor(md):
            found[str(path[1])] = (md.size, md.properties.dtype)
    return found


def optimizer_keys(metadata: Metadata) -> List[str]:
    """The optimizer's flat keys in the checkpoint (``state.<name>.<field>``, ``param_groups.<name>.<field>``)."""
    return [str(p[1]) for p in (_path_of(metadata, f) for f in metadata.state_dict_metadata)
            if len(p) == 2 and p[0] == "optimizer"]


def has_optimizer(metadata: Metadata) -> bool:
    return bool(optimizer_keys(metadata))


def to_file(path: str, out: str) -> Dict[str, Any]:
    """Write the sharded checkpoint ``path`` as one ``pipeddp/2`` file at ``out``; returns its meta.

    DCP's own ``format_utils.dcp_to_torch_save`` does the same reading (the
    whole checkpoint into one process, keys and nesting from the metadata) but
    unpickles with ``weights_only=False``; this reads it with ``SafeReader``
    and ``SafeLoadPlanner`` and reshapes it into the one-file format, which a
    plain model opens with ``torch.load`` (weights_only) and any engine loads.
    """
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist; give a sharded checkpoint, a directory written with sharded=True "
                         "(e.g. run/step-000000042)")
    if not os.path.isdir(path):
        raise ValueError(f"{path} is a file, not a sharded checkpoint (a directory written with sharded=True); a "
                         "one-file checkpoint needs no converting: torch.load opens it")
    steps = sorted(n for n in os.listdir(path) if n.startswith("step-"))
    if not is_complete(path) and steps:
        shards = [n for n in steps if os.path.isdir(os.path.join(path, n))]
        if shards:
            raise ValueError(f"{path} is a directory of checkpoints; convert one of them, e.g. "
                             f"{os.path.join(path, shards[-1])}")
        raise ValueError(f"{path} is a directory of one-file checkpoints ({steps[-1]}, ...), which need no "
                         "converting: torch.load opens them, and their 'model' loads into the plain model")
    metadata = read_metadata(path)
    head = header(path, metadata)
    state = template(metadata, ["*"])
    read(path, state)
    world = int(head["meta"].get("world_size", 0))
    rngs = state.get("rng", {})
    payload = {"format": files.FORMAT, "model": state.get("model", {}),
               "optimizer": unflatten_optimizer_state(state["optimizer"]) if "optimizer" in state else None,
               "extra": head["extra"], "rng": [rngs[str(r)][0] for r in range(world) if str(r) in rngs],
               "meta": head["meta"]}
    files.check_plain(payload, "the converted checkpoint")
    files.atomic_save(payload, out)
    return head["meta"]
