"""Sharded (``DTensor``) parameters, recognised without importing ``torch.distributed.tensor``.

FSDP2 (``shard=``) and tensor parallelism (``tp_plan=``) make a stage's
parameters DTensors; everything else holds plain tensors. Importing
``torch.distributed.tensor`` takes about 0.7 s of CPU, paid by every process
that imports pipeddp (every torchrun worker) though most never shard. No
DTensor can exist before that module is imported, so while it is absent from
``sys.modules`` the answer is "plain" without loading it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["is_dtensor", "local"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (without importing that module)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (``DTensor``) parameter's or gradient's own shard; a plain tensor as it is."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]  # a DTensor, checked by name
