"""Checkpoint files: one consolidated file with the plain model's keys.

A checkpoint is a ``torch.save`` of::

    {"format": "pipeddp/1",
     "model": {"0.weight": ..., ...},        # loads into the plain nn.Sequential
     "optimizer": {"state": {"0.weight": {...}}, "param_groups": [...]} or None,
     "meta": {...}, "extra": {...}}

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
import os
import random
import re
import tempfile
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

__all__ = ["atomic_save", "named_optimizer_state", "load_named_optimizer_state", "merge_optimizer_states", "FORMAT",
           "step_path", "list_checkpoints", "newest", "prune", "rng_state", "set_rng_state"]

FORMAT = "pipeddp/1"
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
            payload = torch.load(path, map_location="cpu", weights_only=False)
        except Exception:  # noqa: BLE001 - a damaged file is skipped, an older one is used
            continue
        if isinstance(payload, dict) and payload.get("format") == FORMAT and "model" in payload:
            return path, payload
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
    """Every random generator this process uses: torch (CPU and CUDA), Python, NumPy."""
    state: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
