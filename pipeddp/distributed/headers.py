"""What crosses ahead of an activation between processes: its container, dtypes and shapes, in one int64 header.

The receiver sizes its receives from it (``decode``), so batch sizes may
change from step to step; the sender refuses what cannot cross (``flatten``,
``encode``) before anything of it is posted. A member of a tuple may be None (a
mask that a micro-batch without padding does not have): it crosses as its place
in the header alone, and is None again at the receiver. ``P2PChannel`` sends a
header where the shapes are not predicted (``predicted``).
"""

from __future__ import annotations

import functools
from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = ["DTYPES", "HEADER", "Meta", "Spec", "decode", "encode", "flatten", "meta_of", "specs", "wants_grad"]

#: the dtypes an activation may have, by their code in a header
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64]
#: int64 fields per header: (container, count, then per member: dtype, ndim, *shape), zero-padded
HEADER = 64
CONTAINERS = {torch.Tensor: 0, tuple: 1, list: 2}
_NONE = -1  # a member's dtype code where it is None

#: a member's (dtype, shape); (None, ()) where the member is None
Spec = Tuple[Optional[torch.dtype], Tuple[int, ...]]
#: (container code, a spec per member); hashable, so what depends on it alone is worked out once (``predicted.plan``)
Meta = Tuple[int, Tuple[Spec, ...]]


def flatten(value: Any) -> Tuple[int, List[Optional[torch.Tensor]]]:
    """(container code, members) of a stage's output; refuses what a header cannot describe."""
    if isinstance(value, torch.Tensor):
        return 0, [value]
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, torch.Tensor) for v in value):
        return CONTAINERS[type(value)] if type(value) in CONTAINERS else 1, list(value)
    raise TypeError(
        "between processes a stage must output a tensor or a flat tuple/list of tensors, got "
        f"{type(value).__name__}; restructure the layer at the cut, or cut elsewhere (a member may also be None)"
    )


def meta_of(container: int, members: Sequence[Optional[torch.Tensor]]) -> Meta:
    """The ``Meta`` of a flattened activation (what ``decode(encode(...))`` gives back)."""
    return container, tuple((None, ()) if t is None else (t.dtype, tuple(t.shape)) for t in members)


@functools.lru_cache(maxsize=1024)
def specs(meta: Meta) -> Tuple[Tuple[torch.dtype, Tuple[int, ...]], ...]:
    """The (dtype, shape) of each tensor that crosses, in order (the members that are not None); cached, as shapes
    that repeat ask it of the same ``Meta`` at every message."""
    return tuple((d, s) for d, s in meta[1] if d is not None)


def encode(container: int, members: Sequence[Optional[torch.Tensor]]) -> torch.Tensor:
    """The header of an activation (a fixed size, so the receiver can post its receive before knowing more)."""
    fields = [container, len(members)]
    for t in members:
        if t is None:
            fields += [_NONE, 0]
            continue
        if t.dtype not in DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages")
        fields += [DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(fields) > HEADER:
        raise TypeError("the activation at this cut has too many tensors or dimensions to send between processes")
    return torch.tensor(fields + [0] * (HEADER - len(fields)), dtype=torch.int64)


def decode(header: torch.Tensor) -> Meta:
    """What ``encode`` packed: the container and every member's dtype and shape."""
    f = header.tolist()
    container, n, pos = f[0], f[1], 2
    metas: List[Spec] = []
    for _ in range(n):
        code, ndim = f[pos], f[pos + 1]
        metas.append((None if code == _NONE else DTYPES[code], tuple(f[pos + 2:pos + 2 + ndim])))
        pos += 2 + ndim
    return container, tuple(metas)


def wants_grad(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` gets a gradient back (integer and boolean activations do not)."""
    return dtype.is_floating_point or dtype.is_complex
