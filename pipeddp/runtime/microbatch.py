"""Split a batch into micro-batches and merge the results back.

A batch is a tensor, or a tuple/list/dict whose tensor leaves share dim 0
(the batch dimension). Non-tensor leaves (flags, strings) are handed to every
micro-batch unchanged.

    batch of 10, chunks=4          sizes [3, 3, 2, 2]
    batch of 10, split_size=4      sizes [4, 4, 2]
    batch of 3,  chunks=8          sizes [1, 1, 1]   (never an empty piece)

Sizes are computed once and applied to every leaf with ``torch.split``; this is
what ``tensor_split`` does, minus its empty pieces. ``torch.chunk`` is never
used: it silently returns fewer pieces than asked (``chunk(10, 4)`` gives
4+4+2), which changes the number of micro-batches under the schedule's feet.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["split_sizes", "split", "Pieces", "merge", "batch_size", "tree_map", "tree_tensors"]


def tree_map(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of a tensor/tuple/list/dict tree."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(tree_map(fn, v) for v in value)
    if isinstance(value, list):
        return [tree_map(fn, v) for v in value]
    if isinstance(value, dict):
        return {k: tree_map(fn, v) for k, v in value.items()}
    return value


def tree_tensors(value: Any) -> List[torch.Tensor]:
    """The tensor leaves of a tree, in a fixed (depth-first) order."""
    out: List[torch.Tensor] = []
    tree_map(out.append, value)
    return out


def batch_size(batch: Any, *, name: str = "input") -> int:
    """The common dim-0 size of every tensor leaf of ``batch``.

    Raises ``ValueError`` when leaves disagree (a classic mistake: passing
    ``(x, mask)`` where ``mask`` was built for another batch), when there is no
    tensor at all, or when a leaf is a 0-dim tensor that cannot be split.
    """
    if type(batch) is torch.Tensor and batch.dim() > 0 and batch.shape[0] > 0:  # the rule: one tensor, no walk
        return batch.shape[0]
    leaves = tree_tensors(batch)
    if not leaves:
        raise ValueError(f"{name} holds no tensor: pass a tensor, or a tuple/list/dict of tensors")
    sizes = []
    for t in leaves:
        if t.dim() == 0:
            raise ValueError(
                f"{name} has a 0-dim tensor; every tensor must have a batch dimension (dim 0) to be split"
            )
        sizes.append(t.shape[0])
    if len(set(sizes)) != 1:
        raise ValueError(
            f"the tensors of {name} disagree on the batch size (dim 0): {sizes}; "
            "every tensor in one batch must have the same number of samples"
        )
    if sizes[0] == 0:
        raise ValueError(f"{name} is an empty batch (0 samples); skip empty batches before calling the pipeline")
    return sizes[0]


def split_sizes(total: int, chunks: Optional[int] = None, split_size: Optional[int] = None) -> List[int]:
    """Micro-batch sizes for a batch of ``total`` samples.

    Exactly one of ``chunks`` (how many pieces) or ``split_size`` (how many
    samples per piece) is given. With ``chunks`` the pieces differ by at most
    one sample and the larger ones come first, like ``torch.tensor_split``.
    """
    if (chunks is None) == (split_size is None):
        raise ValueError("give exactly one of chunks= (number of micro-batches) or split_size= (samples per "
                         "micro-batch)")
    if total < 1:
        raise ValueError(f"cannot split an empty batch (batch size {total})")
    if chunks is not None:
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
        n = min(chunks, total)
        base, extra = divmod(total, n)
        return [base + 1 if i < extra else base for i in range(n)]
    if not isinstance(split_size, int) or isinstance(split_size, bool) or split_size < 1:
        raise ValueError(f"split_size must be an int >= 1, got {split_size!r}")
    full, rest = divmod(total, split_size)
    return [split_size] * full + ([rest] if rest else [])


def split(batch: Any, sizes: Sequence[int]) -> List[Any]:
    """Cut every tensor leaf of ``batch`` into pieces of ``sizes`` along dim 0.

    The pieces are views (no copy). The structure of the batch is kept.
    """
    sizes = list(sizes)
    if type(batch) is torch.Tensor:  # the rule: one plain tensor, cut by the method torch.split calls
        return list(batch.split_with_sizes(sizes))

    def cut(t: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        return torch.split(t, sizes, dim=0)

    pieces = _tree_split(batch, cut, len(sizes))
    return pieces


class Pieces:
    """``split(batch, sizes)``, cut when a piece is first read: a step's targets are cut by the thread of the last
    stage that reads them, not by the caller before the step (on a worker thread, while the caller's stages run).
    Two threads reading at once would cut twice, to the same views."""

    __slots__ = ("_batch", "_sizes", "_pieces")

    def __init__(self, batch: Any, sizes: Sequence[int]) -> None:
        self._batch, self._sizes = batch, sizes
        self._pieces: Optional[List[Any]] = None

    def __getitem__(self, i: int) -> Any:
        pieces = self._pieces
        if pieces is None:
            pieces = self._pieces = split(self._batch, self._sizes)
        return pieces[i]

    def __len__(self) -> int:
        return len(self._sizes)


def _tree_split(value: Any, cut: Callable[[torch.Tensor], Tuple[torch.Tensor, ...]], n: int) -> List[Any]:
    if isinstance(value, torch.Tensor):
        return list(cut(value))
    if isinstance(value, (tuple, list)):
        columns = [_tree_split(v, cut, n) for v in value]
        rows = [[col[i] for col in columns] for i in range(n)]
        return [tuple(r) if isinstance(value, tuple) else list(r) for r in rows]
    if isinstance(value, dict):
        columns_d: Dict[Any, List[Any]] = {k: _tree_split(v, cut, n) for k, v in value.items()}
        return [{k: col[i] for k, col in columns_d.items()} for i in range(n)]
    return [value] * n


def merge(pieces: Sequence[Any]) -> Any:
    """Concatenate micro-batch results back into one batch (inverse of ``split``)."""
    if not pieces:
        raise ValueError("nothing to merge")
    first = pieces[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            raise ValueError(
                "a stage output is a 0-dim tensor, which cannot be concatenated over micro-batches; "
                "return per-sample values (dim 0 = batch) from the model"
            )
        return torch.cat(list(pieces), dim=0)
    if isinstance(first, (tuple, list)):
        merged = [merge([p[i] for p in pieces]) for i in range(len(first))]
        return tuple(merged) if isinstance(first, tuple) else merged
    if isinstance(first, dict):
        return {k: merge([p[k] for p in pieces]) for k in first}
    return first
