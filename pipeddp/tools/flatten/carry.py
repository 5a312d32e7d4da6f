"""What a block stack's layers pass on: the hidden state and the values every block needs besides it.

A transformer's blocks are not called on one tensor. A Llama decoder layer
is called as ``layer(h, attention_mask=m, position_embeddings=(cos, sin),
position_ids=p, cache=None, use_cache=False)``, where only ``h`` changes
from block to block; ``m``, ``cos``, ``sin`` and ``p`` are computed once,
before the first block. An ``nn.Sequential`` passes one value from layer to
layer, so the opened stack passes a tuple, as pipeddp's skip connections do::

    embed            -> (h, m, cos, sin, p)
    model_layers_0   (h, m, cos, sin, p) -> (h', m, cos, sin, p)
    ...
    model_layers_3   (h, m, cos, sin, p) -> h''         (the last block passes the hidden state alone)

A ``Template`` is the recorded call of one block with markers in place of
the values that travel: ``HIDDEN`` and ``Carried(i)`` (the i-th extra);
everything else (``None``, ``False``, a layer index) is a constant of that
block's call. The extras are the tensors the model gave its first block, in
the order of the call, then those that only later blocks take but that the
model computed before its first block (Gemma2's sliding-window mask beside the
full one its first block takes): where the model's forward holds them when it
calls its first block (a local, or a key or index within one) is recorded,
and the first layer takes them from there. An extra that is a tensor for the sample may be None
for another batch (transformers builds no mask for a batch without padding):
it then travels as an empty ``int64`` tensor, so that a stage's output stays a
flat tuple of tensors that processes can exchange, and is None again for the
block.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["HIDDEN", "Carried", "Template", "template_of", "take", "fill", "leaves"]

Call = Tuple[Tuple[Any, ...], Dict[str, Any]]


class _Hidden:
    """The marker of the hidden state in a block's call."""

    def __repr__(self) -> str:
        return "hidden"

    def __reduce__(self) -> str:
        return "HIDDEN"


HIDDEN = _Hidden()


class Carried:
    """The marker of the ``index``-th value carried from block to block besides the hidden state."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"extra[{self.index}]"


Template = Call


def leaves(value: Any, where: str) -> List[Tuple[str, Any]]:
    """``(where, leaf)`` of a call's value, through tuples, lists and dicts (``position_embeddings[0]``)."""
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Tensor):
        return [x for i, v in enumerate(value) for x in leaves(v, f"{where}[{i}]")]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in leaves(v, f"{where}[{k!r}]")]
    return [(where, value)]


def _map(value: Any, fn: Any) -> Any:
    """``value`` with every leaf replaced by ``fn(leaf)`` (tuples, lists and dicts rebuilt as they were)."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return fn(value)


def template_of(call: Call, hidden: torch.Tensor, extras: Dict[int, int]) -> Template:
    """A block's recorded ``(args, kwargs)`` with ``HIDDEN`` and ``Carried(i)`` (by object, ``extras[id] = i``)."""
    def mark(leaf: Any) -> Any:
        if leaf is hidden:
            return HIDDEN
        if isinstance(leaf, torch.Tensor):
            return Carried(extras[id(leaf)])
        return leaf
    args, kwargs = call
    return tuple(_map(list(args), mark)), _map(dict(kwargs), mark)


def _walk(template: Any, value: Any, where: str, out: Dict[Any, Any]) -> None:
    """Collect, by marker, the values of ``value`` at the template's markers; refuse another structure."""
    if template is HIDDEN or isinstance(template, Carried):
        key = template.index if isinstance(template, Carried) else "hidden"
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(f"the model gave its first block {type(value).__name__} at {where}, where it gave a "
                             "tensor for the sample it was flattened with")
        out[key] = value
        return
    if isinstance(template, (tuple, list)) and not isinstance(template, torch.Tensor):
        if not isinstance(value, (tuple, list)) or len(value) != len(template):
            raise ValueError(f"the model gave its first block {_kind(value)} at {where}, where it gave "
                             f"{_kind(template)} for the sample it was flattened with")
        for i, (t, v) in enumerate(zip(template, value)):
            _walk(t, v, f"{where}[{i}]", out)
        return
    if isinstance(template, dict):
        if not isinstance(value, dict) or set(value) != set(template):
            got = sorted(value) if isinstance(value, dict) else value
            raise ValueError(f"the model gave its first block the arguments {got} at {where}, not "
                             f"{sorted(template)} as for the sample it was flattened with")
        for k in template:
            _walk(template[k], value[k], f"{where}[{k!r}]", out)
        return
    if isinstance(value, torch.Tensor):
        raise ValueError(f"the model gave its first block a tensor at {where}, where it gave {template!r} for the "
                         "sample it was flattened with: flatten with a sample like this batch (e.g. a padded batch "
                         "with its attention_mask, if the model builds a mask only for padding)")
    if isinstance(template, (bool, int, float, str)) and type(value) is type(template) and value != template:
        raise ValueError(f"the model gave its first block {value!r} at {where}, where it gave {template!r} for the "
                         "sample it was flattened with; each block would be called with the sample's value")


def _kind(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else type(value).__name__


def take(template: Template, call: Call, count: int, elsewhere: Optional[Dict[int, Any]] = None) -> Any:
    """What the first layer passes on from the first block's call: ``hidden`` or ``(hidden, *extras)``;
    ``elsewhere``: the extras that the first block is not given (later blocks' masks), found beside its call."""
    found: Dict[Any, Any] = dict(elsewhere or {})
    _walk(template[0], tuple(call[0]), "args", found)
    _walk(template[1], dict(call[1]), "kwargs", found)
    hidden = found["hidden"]
    if not count:
        return hidden
    extras = []
    for i in range(count):
        v = found.get(i)  # None too for a value a later block computes: its place travels empty until then
        extras.append(v if v is not None else torch.empty(0, dtype=torch.int64, device=hidden.device))
    return (hidden, *extras)


def fill(template: Template, hidden: torch.Tensor, extras: Tuple[Any, ...]) -> Call:
    """A block's ``(args, kwargs)`` from its template, the hidden state and the carried values."""
    def put(leaf: Any) -> Any:
        if leaf is HIDDEN:
            return hidden
        if isinstance(leaf, Carried):
            v = extras[leaf.index]
            empty = isinstance(v, torch.Tensor) and v.dtype == torch.int64 and v.dim() == 1 and v.numel() == 0
            return None if empty else v
        return leaf
    args, kwargs = template
    return tuple(_map(list(args), put)), _map(dict(kwargs), put)
