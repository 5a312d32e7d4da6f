"""What crosses ahead of an activation between processes: its container, dtypes and shapes, in one int64 header.

The receiver sizes its receives from it (``decode``), so batch sizes may
change from step to step; the sender refuses what cannot cross (``flatten``,
``encode``) before anything of it is posted. ``P2PChannel`` sends one where the
shapes do not repeat those of the step before.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch

__all__ = ["DTYPES", "HEADER", "Meta", "decode", "encode", "flatten", "wants_grad"]

#: the dtypes an activation may have, by their code in a header
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64]
#: int64 fields per header: (container, count, then per tensor: dtype, ndim, *shape), zero-padded
HEADER = 64
CONTAINERS = {torch.Tensor: 0, tuple: 1, list: 2}

#: (container code, [(dtype, shape) per tensor])
Meta = Tuple[int, List[Tuple[torch.dtype, Tuple[int, ...]]]]


def flatten(value: Any) -> Tuple[int, List[torch.Tensor]]:
    """(container code, tensors) of a stage's output; refuses what a header cannot describe."""
    if isinstance(value, torch.Tensor):
        return 0, [value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return CONTAINERS[type(value)] if type(value) in CONTAINERS else 1, list(value)
    raise TypeError(
        "between processes a stage must output a tensor or a flat tuple/list of tensors, got "
        f"{type(value).__name__}; restructure the layer at the cut, or cut elsewhere"
    )


def encode(container: int, tensors: List[torch.Tensor]) -> torch.Tensor:
    """The header of an activation (a fixed size, so the receiver can post its receive before knowing more)."""
    fields = [container, len(tensors)]
    for t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages")
        fields += [DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(fields) > HEADER:
        raise TypeError("the activation at this cut has too many tensors or dimensions to send between processes")
    return torch.tensor(fields + [0] * (HEADER - len(fields)), dtype=torch.int64)


def decode(header: torch.Tensor) -> Meta:
    """What ``encode`` packed: the container and every tensor's dtype and shape."""
    f = header.tolist()
    container, n, pos = f[0], f[1], 2
    metas = []
    for _ in range(n):
        dtype, ndim = DTYPES[f[pos]], f[pos + 1]
        metas.append((dtype, tuple(f[pos + 2:pos + 2 + ndim])))
        pos += 2 + ndim
    return container, metas


def wants_grad(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` gets a gradient back (integer and boolean activations do not)."""
    return dtype.is_floating_point or dtype.is_complex
