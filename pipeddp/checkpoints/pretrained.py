"""Pretrained weights from a Hugging Face directory, read per stage: each process reads only its own tensors.

``save_pretrained`` writes ``model.safetensors``, or shards with an index
(``model.safetensors.index.json``: each tensor's file). safetensors reads one
tensor from a file without reading the rest, and a file's header alone gives
every tensor's shape and dtype. So loading one into an engine is the same two
rounds as any pipeddp load (``state._load_any``), without any process holding
the whole model::

    every rank:   the index and the headers -> the whole model's keys, shapes and dtypes checked
                  (the same error on every rank, before anything changes)
    every rank:   its own tensors read from their files, then copied into its stages

With tensor parallelism a process holds a block of a tensor (``slices``):
it reads that block alone (safetensors' ``get_slice``), never the whole.

The names are the model's own: a model opened by ``flatten_sequential`` keeps
them. Hugging Face leaves out the later uses of a tied weight (the output
head tied to the embedding); those places take the first use's value at every
step (``runtime.tied``), or are one tensor with it in one stage, so they are
not asked of the directory. Where it names the weight by a place that is a
later one to the engine (BART's ``model.shared.weight``), the first place is
read from that name (``state``).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional

import torch

from ..runtime.progress import shown
from .checkpoint import Spec
from .slices import CODES, Block

__all__ = ["is_pretrained", "tensor_files", "read_specs", "read_tensors", "SINGLE", "INDEX"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_DTYPES = {code: dtype for dtype, code in CODES.items()}


def is_pretrained(path: str) -> bool:
    """Whether ``path`` is a directory of Hugging Face safetensors weights (one file, or shards and an index)."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, SINGLE))
                                    or os.path.isfile(os.path.join(path, INDEX)))


def _safe_open(file: str):  # type: ignore[no-untyped-def]  # safetensors' handle has no type information
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ImportError("reading Hugging Face weights needs safetensors: pip install 'pipeddp[hf]'") from exc
    return safe_open(file, framework="pt", device="cpu")


def tensor_files(path: str) -> Dict[str, str]:
    """Every tensor's name in the directory ``path``, and the file that holds it."""
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map: it is not an index of safetensors shards")
        missing = sorted({v for v in weight_map.values() if not os.path.isfile(os.path.join(path, v))})
        if missing:
            raise ValueError(f"{index} names shard file(s) that {path} does not hold: {missing}")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SINGLE)
    with _safe_open(single) as f:
        return {k: single for k in f.keys()}


def read_specs(where: Dict[str, str]) -> Dict[str, Spec]:
    """The shape and dtype of every tensor, from the files' headers alone (no tensor is read)."""
    out: Dict[str, Spec] = {}
    for file in sorted(set(where.values())):
        with _safe_open(file) as f:
            for key in f.keys():
                if where.get(key) == file:
                    piece = f.get_slice(key)
                    dtype = piece.get_dtype()
                    if dtype not in _DTYPES:
                        raise ValueError(f"{file}: {key} has dtype {dtype}, which pipeddp does not load")
                    out[key] = (tuple(piece.get_shape()), _DTYPES[dtype])
    return out


def read_tensors(where: Dict[str, str], keys: Iterable[str],
                 blocks: Optional[Dict[str, Block]] = None) -> Dict[str, torch.Tensor]:
    """The tensors ``keys`` (and nothing else), each file opened once; a bar on rank 0's terminal meanwhile.
    ``blocks``: of the keys this process holds a block of (tensor parallelism), that block alone is read."""
    by_file: Dict[str, List[str]] = {}
    for key in keys:
        by_file.setdefault(where[key], []).append(key)
    out: Dict[str, torch.Tensor] = {}
    total = sum(len(names) for names in by_file.values())
    with shown(f"reading {total} tensors") as report:
        for file, names in sorted(by_file.items()):
            with _safe_open(file) as f:
                for key in names:
                    part = (blocks or {}).get(key)
                    if part is None:
                        out[key] = f.get_tensor(key)
                    else:
                        out[key] = f.get_slice(key)[tuple(slice(o, o + n) for o, n in zip(*part))]
                    report(len(out), total)
    return out
