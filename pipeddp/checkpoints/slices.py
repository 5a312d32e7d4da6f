"""The part of a tensor that this process holds, as a block of the whole: read alone, or written in place.

A tensor-parallel parameter (and one sharded over the replicas, ``shard=``) is
a ``DTensor``: each process holds one block of the whole tensor, a range of
rows for ``Shard(0)``, of columns for ``Shard(1)``, all of it for
``Replicate``. A whole tensor in a checkpoint is read and written per block::

    whole [8, 6], Shard(1) over tp=2         reading: rank t takes columns [3t, 3t+3) alone
      t=0: [:, 0:3]   t=1: [:, 3:6]          (safetensors ``get_slice``, or a memory-mapped file)
                                             writing: rank t writes its 8 runs of 3 values into the
                                             file at their places (safetensors is row-major)

A layout whose local tensor is no one block of the whole (FSDP2's strided
shards over a ``tp`` shard, a partial sum) has no ``block``: it is gathered
or cut whole instead.

``Layout`` is one safetensors file planned before any tensor is in it: its
header (every tensor's name, dtype, shape and byte range) is known from the
shapes alone, so the file is made at its full size first and every holder of
a block then writes its bytes into it, whole tensors never gathered.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..distributed.shard import shard_like
from ..runtime.dtensors import is_dtensor

__all__ = ["Block", "block", "writes_block", "local_part", "from_block", "Layout", "create_file", "write_block",
           "CODES"]

#: ``(offsets, sizes)`` of a block of a whole tensor
Block = Tuple[Tuple[int, ...], Tuple[int, ...]]

#: safetensors' dtype codes (as its torch reader names them)
CODES: Dict[torch.dtype, str] = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                                 torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
                                 torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
                     ("float8_e5m2fnuz", "F8_E5M2FNUZ"), ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):  # newer dtypes, where this torch has them
        CODES[getattr(torch, _name)] = _code


def block(t: Any) -> Optional[Block]:
    """The block of the whole tensor that the ``DTensor`` ``t``'s local tensor is; None for a plain tensor, and
    for a layout whose local tensor is no single block (strided shards, partial sums)."""
    if not is_dtensor(t):
        return None
    from torch.distributed.tensor import Shard

    if any(type(p) is not Shard and not p.is_replicate() for p in t.placements):
        return None
    chunks = t.__create_chunk_list__()  # the offsets and sizes DCP writes a DTensor's local tensor by
    if len(chunks) != 1:
        return None
    return tuple(int(o) for o in chunks[0].offsets), tuple(int(s) for s in chunks[0].sizes)


def writes_block(t: Any, owner: int) -> bool:
    """Whether this process writes its block of the ``DTensor`` ``t`` into the file of rank ``owner``: the holders
    in ``owner``'s mesh, one of each block (coordinate 0 along every dimension the tensor is replicated over);
    the copies other replicas hold (DDP beside ``tp``) are not written again."""
    mesh = t.device_mesh
    if owner not in [int(r) for r in mesh.mesh.flatten().tolist()]:
        return False
    coordinate = mesh.get_coordinate()
    return coordinate is not None and all(c == 0 for c, p in zip(coordinate, t.placements) if p.is_replicate())


def _index(b: Block) -> Tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(*b))


def from_block(local: torch.Tensor, target: Any) -> Any:
    """``local`` (the values of ``target``'s block) as a ``DTensor`` laid out like ``target``; no communication."""
    from torch.distributed.tensor import DTensor

    local = local.to(target.to_local().device).contiguous()
    return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False, shape=target.shape,
                              stride=target.stride())


def local_part(whole: torch.Tensor, target: Any) -> Any:
    """``whole`` as ``target`` holds it: its block copied (from a memory-mapped file only its bytes are read), as a
    ``DTensor`` like it; cut like it where it has no block; ``whole`` itself for a plain ``target``."""
    b = block(target)
    if b is not None:
        return from_block(whole[_index(b)].clone(), target)
    return shard_like(whole, target) if is_dtensor(target) else whole


# -- a safetensors file written in place, block by block ------------------------------------------------------------


@dataclass
class Layout:
    """One safetensors file's tensors: each name's dtype, shape and byte offset; ``header`` is the file's start."""

    entries: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int]]  # name -> (dtype, shape, offset from data start)
    header: bytes
    size: int  # the whole file's

    @staticmethod
    def of(specs: Mapping[str, Tuple[torch.dtype, Sequence[int]]]) -> "Layout":
        """The layout safetensors' own writer gives ``specs`` (name -> dtype, shape): the widest dtypes first, then
        by name, so that every tensor starts aligned to its element size."""
        entries: Dict[str, Tuple[torch.dtype, Tuple[int, ...], int]] = {}
        described: Dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in sorted(specs, key=lambda n: (-specs[n][0].itemsize, n)):
            dtype, shape = specs[name][0], tuple(int(n) for n in specs[name][1])
            nbytes = dtype.itemsize * _numel(shape)
            entries[name] = (dtype, shape, offset)
            described[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(described, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # the data starts aligned to 8 bytes, as safetensors writes it
        header = len(text).to_bytes(8, "little") + text
        return Layout(entries, header, len(header) + offset)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def create_file(path: str, layout: Layout) -> None:
    """``path``: the header of ``layout``, and room for every tensor (zeros until written)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        os.write(fd, layout.header)
        os.ftruncate(fd, layout.size)
    finally:
        os.close(fd)


def _runs(shape: Tuple[int, ...], b: Block) -> Tuple[List[int], int]:
    """The element offsets in the whole tensor (row-major) of the block's contiguous runs, and a run's length."""
    offsets, sizes = b
    cut = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if not cut:
        return [0], _numel(shape)
    k = cut[-1]  # the dimensions after k are whole: a run is sizes[k:] of the block
    strides = [_numel(shape[d + 1:]) for d in range(len(shape))]
    length = _numel(sizes[k:])
    starts = [offsets[k] * strides[k]]
    for d in range(k - 1, -1, -1):  # every index of the dimensions before k, the last fastest
        starts = [(offsets[d] + i) * strides[d] + s for i in range(sizes[d]) for s in starts]
    return starts, length


def _pwrite(fd: int, data: memoryview, position: int) -> None:
    """All of ``data`` at ``position`` (one ``pwrite`` may write less: Linux at most 2 GiB)."""
    while len(data):
        done = os.pwrite(fd, data, position)
        data, position = data[done:], position + done


def write_block(fd: int, layout: Layout, name: str, local: torch.Tensor, b: Optional[Block]) -> None:
    """Write ``local`` (the block ``b`` of tensor ``name``; None: the whole tensor) into the file open as ``fd``."""
    dtype, shape, offset = layout.entries[name]
    data = local.detach().to("cpu", dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(data.data)  # the array's buffer: its bytes, not a copy
    base = len(layout.header) + offset
    if b is None:
        _pwrite(fd, view, base)
        return
    starts, length = _runs(shape, b)
    run = length * dtype.itemsize
    for i, start in enumerate(starts):
        _pwrite(fd, view[i * run:(i + 1) * run], base + start * dtype.itemsize)
