"""Checkpoint files: one consolidated file with the plain model's keys.

A checkpoint is a ``torch.save`` of plain values only (tensors, numbers,
strings, lists, tuples, dicts), so PyTorch's safe loader opens it and
nothing in it can run code when it is read::

    {"format": "pipeddp/2",
     "model": {"0.weight": ..., ...},        # loads into the plain nn.Sequential
     "optimizer": {"state": {"0.weight": {...}}, "param_groups": [...]} or None,
     "extra": {...},                         # the caller's own values (step, epoch, ...)
     "rng": [{"torch": ..., "python": ..., "numpy": {...}, "cuda": [...]}, ...],   # one per rank
     "meta": {"stages": 2, "replicas": 2, "world_size": 4, "balance": [...], "mode": "replica"}}

    ck = torch.load("ckpt.pt")               # weights_only=True, PyTorch's default
    plain_model.load_state_dict(ck["model"])

pipeddp reads checkpoints only with ``weights_only=True`` (``load``): a file
that needs anything else (a pickled object that would run code, or a file
written by another program) is refused with an error naming it.

Optimizer state is keyed by parameter *name* (via
``torch.distributed.checkpoint.state_dict``), not by position, so it can be
loaded by any partition of the model: each process takes the entries of the
parameters it holds.

Writes are atomic: the file is written under a temporary name in the same
directory, flushed to disk (``fsync``), and renamed over the target, so a
crash leaves either the old checkpoint or the new one, never half a file.

A checkpoint *directory* holds ``step-000000123.pt`` files, newest kept last
K. Temporary files start with ``.tmp-`` and never match that pattern, so a
writer killed mid-save leaves debris that is never taken for a checkpoint
(and is swept up by the next save). ``newest`` returns the newest file that
loads completely, skipping any that do not.
"""

from __future__ import annotations

import glob
import numbers
import os
import pickle
import random
import re
import tempfile
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

__all__ = ["atomic_save", "named_optimizer_state", "load_named_optimizer_state", "merge_optimizer_states", "FORMAT",
           "step_path", "list_checkpoints", "newest", "prune", "rng_state", "set_rng_state", "load", "check_plain",
           "UnsafeCheckpointError"]

#: ``pipeddp/1`` files held NumPy objects in their RNG states; see the README for a one-time conversion.
FORMAT = "pipeddp/2"
_STEP = re.compile(r"^step-(\d+)\.pt$")


def _open_for_write(fd: int) -> Any:
    """The file object a save writes through (one place, so tests can inject faults)."""
    return os.fdopen(fd, "wb")


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` so that readers see the old file or the whole new one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with _open_for_write(fd) as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class UnsafeCheckpointError(ValueError):
    """A file that PyTorch's safe loader refuses: it would need to run pickled code to be read."""


def load(path: str) -> Dict[str, Any]:
    """Read a pipeddp checkpoint with ``torch.load(weights_only=True)``, onto the CPU.

    Raises ``UnsafeCheckpointError`` (nothing from the file is run) when the
    file holds anything but plain values, and ``ValueError`` when it is a safe
    file but not a pipeddp checkpoint. Other errors (a truncated file) pass
    through unchanged.
    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(
            f"{path} was refused by PyTorch's safe loader (weights_only=True): it holds pickled objects that "
            "would run code when loaded, so it is not a pipeddp checkpoint of this version and nothing in it was "
            "run. If you wrote it yourself with an older pipeddp and trust it, convert it once as the README's "
            f"'Checkpoints' section shows. ({str(exc).splitlines()[0]})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "model" not in payload:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{path} is not a pipeddp checkpoint of format {FORMAT!r} (found {found!r}); "
                         "write one with HybridParallel.save or save_checkpoint")
    return payload


_PLAIN = (str, bytes, bool, numbers.Number, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size)


def check_plain(value: Any, where: str) -> None:
    """Raise ``TypeError`` naming the entry of ``value`` that the safe loader could not read back.

    Checked before a checkpoint is written, so that a save never produces a
    file that ``load`` (or a plain ``torch.load``) then refuses.
    """
    if isinstance(value, _PLAIN) and not isinstance(value, (np.generic, np.ndarray)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            check_plain(k, f"{where} key {k!r}")
            check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint holds plain "
                    "values only (tensors, numbers, strings, lists, tuples, dicts), so that it loads with "
                    "torch.load(weights_only=True): convert it (e.g. int(x), x.tolist(), torch.as_tensor(x))")


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def named_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's state keyed by ``module``'s parameter names, on CPU."""
    return _to_cpu(get_optimizer_state_dict(module, optimizer))


def merge_optimizer_states(parts: Iterable[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """Join the named optimizer states of several stages into one (group by group)."""
    merged: Optional[Dict[str, Any]] = None
    for part in parts:
        if part is None:
            continue
        if merged is None:
            merged = {"state": dict(part["state"]), "param_groups": [dict(g, params=list(g["params"]))
                                                                     for g in part["param_groups"]]}
            continue
        merged["state"].update(part["state"])
        if len(part["param_groups"]) != len(merged["param_groups"]):
            raise ValueError("the stages' optimizers have different numbers of param groups")
        for into, group in zip(merged["param_groups"], part["param_groups"]):
            into["params"] += [p for p in group["params"] if p not in into["params"]]
    return merged


def load_named_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
    """Load the entries of ``state`` that belong to ``module``'s parameters into ``optimizer``."""
    names = {n for n, _ in module.named_parameters()}
    groups = []
    for g in state["param_groups"]:
        groups.append(dict(g, params=[p for p in g["params"] if p in names]))
    own = {"state": {k: v for k, v in state["state"].items() if k in names}, "param_groups": groups}
    set_optimizer_state_dict(module, optimizer, own)


def step_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:09d}.pt")


def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``(step, path)`` of every checkpoint file in ``directory``, newest first."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "step-*.pt")):
        m = _STEP.match(os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path))
    return sorted(found, reverse=True)


def newest(directory: str) -> Optional[Tuple[str, Dict[str, Any]]]:
    """The newest checkpoint of ``directory`` that loads completely, with its contents (or None)."""
    for _, path in list_checkpoints(directory):
        try:
            return path, load(path)
        except UnsafeCheckpointError:
            raise  # not damaged but refused: resuming from an older file instead would hide it
        except Exception:  # noqa: BLE001 - a damaged file is skipped, an older one is used
            continue
    return None


def prune(directory: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, and temporary files left by killed writers."""
    for _, path in list_checkpoints(directory)[keep:]:
        os.unlink(path)
    for path in glob.glob(os.path.join(glob.escape(directory), ".tmp-*")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def rng_state() -> Dict[str, Any]:
    """Every random generator this process uses: torch (CPU and CUDA), Python, NumPy, as plain values.

    NumPy's legacy state is a tuple holding an ndarray, which the safe loader
    refuses; it is stored as its parts, the 624 key words as an int64 tensor.
    """
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what ``rng_state`` recorded."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
