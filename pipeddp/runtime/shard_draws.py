"""A random op on one rank's part of a tensor split over tensor-parallel ranks: the whole tensor's numbers, its part.

Under tensor parallelism an activation between a column-wise layer and the
row-wise layer after it is split over the tp ranks (an MLP's hidden
features, an attention's heads). A dropout there, drawn on the rank's part
alone from the stage's generator (seeded alike on every tp rank), would give
each part the same mask and leave the generator where the plain model's is
not, so every draw after it would differ from the plain model's too.

So the op runs on the whole tensor: each tensor argument of the part's shape
is repeated ``parts`` times along the split dimension, the op draws for the
whole (the numbers the plain model draws for the whole tensor, and the
generator moves as far), and the rank keeps its part of each result; an
argument the op writes (``bernoulli_``'s tensor, an ``out=``) takes its part
back. DTensor's own tracker (``OffsetBasedRNGTracker``) reaches the same end
on CUDA by moving the Philox offset to the part's block of the stream, which
is the whole tensor's slice only where the split is on the first dimension;
the CPU's Mersenne Twister has no offset to move, so the whole is drawn.
This holds for the ops that draw element by element (dropout's
``bernoulli_``, ``rand_like``, ``normal_``, ...); ``multinomial`` draws on
the part as it is, and so does a factory draw (``torch.rand(shape)``: no
tensor to read the part from), the same numbers on every tp rank. A fused
CUDA attention kernel's dropout (sdpa's flash and efficient kernels) takes
no generator and is not reached here at all.

The split dimension is not carried by a plain tensor: it is read from the
shape, as transformers and a column-wise Linear lay the parts out: the heads
(dimension 1) of a 4-D tensor (the attention probabilities, batch x heads x
queries x keys), else the last (a column-wise layer's output features). A
part split otherwise still draws a valid mask, each rank another part of one
whole draw, but not the plain model's.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

__all__ = ["split_dim", "whole_then_part"]


#: random ops whose numbers are not drawn element by element (a row of probabilities samples an index): drawn on
#: the part as it is
_ROWS = frozenset({"aten::multinomial"})


def split_dim(t: torch.Tensor) -> int:
    """The dimension ``t`` (a rank's part) is taken to be split on: the heads of a 4-D tensor, else the last."""
    return 1 if t.dim() == 4 else t.dim() - 1


def whole_then_part(call: Callable[[Any, Dict[str, Any]], Any], op: Any, args: Any, kwargs: Dict[str, Any],
                    parts: int, index: int) -> Any:
    """``call(args, kwargs)`` (the random op ``op``) run on the whole tensor of which ``args[0]`` is part ``index``
    of ``parts``: each tensor argument of its shape repeated along the split dimension, each result cut back."""
    if op._schema.name in _ROWS:
        return call(args, kwargs)
    first: torch.Tensor = args[0]
    shape, dim = first.shape, split_dim(first)
    size = shape[dim]
    repeats = [parts if d == dim else 1 for d in range(first.dim())]
    names = [a.name for a in op._schema.arguments]
    written = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (the part, its whole) of each argument the op writes

    def widen(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.shape != shape:
            return value
        wide = value.repeat(repeats)
        if name in written:
            pairs.append((value, wide))
        return wide

    wide_args = tuple(widen(names[i] if i < len(names) else "", a) for i, a in enumerate(args))
    out = call(wide_args, {k: widen(k, v) for k, v in kwargs.items()})
    for part, wide in pairs:
        part.copy_(wide.narrow(dim, index * size, size))
    back = {id(wide): part for part, wide in pairs}

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) in back:
                return back[id(value)]
            if value.dim() == first.dim() and value.shape[dim] == size * parts:  # a copy: the whole is let go
                return value.narrow(dim, index * size, size).clone(memory_format=torch.contiguous_format)
        return value

    return tuple(cut(v) for v in out) if isinstance(out, (tuple, list)) else cut(out)
