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
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Dict, Iterable, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

__all__ = ["atomic_save", "named_optimizer_state", "load_named_optimizer_state", "merge_optimizer_states", "FORMAT"]

FORMAT = "pipeddp/1"


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` so that readers see the old file or the whole new one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
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
