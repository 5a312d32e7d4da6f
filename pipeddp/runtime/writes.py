"""What an initialisation writes: every fresh tensor it sets, its random draws, and nothing already materialized.

A layer materialized from the meta device gets fresh memory, then its
initialisation runs. ``Writes`` is a ``TorchFunctionMode`` active meanwhile:

* it notes each fresh tensor that an in-place operation, a ``torch.nn.init``
  function or an ``out=`` writes (a view counts: it shares the storage), so a
  tensor no operation wrote is found whatever its type (a bool mask and an
  8-bit table included, where no value is free to mark fresh memory with);
* where ``seeds`` gives a fresh tensor a seed, a random draw into it without a
  generator of its own comes from a generator seeded so, started again for
  every initialiser: its values depend only on its name and the operation,
  not on which other tensors the initialiser met before it (a parent's
  ``_init_weights`` that sets its children's weights, with some of them in
  other processes' stages, on the meta device, drawing nothing);
* a write into a tensor in ``protected`` (another layer's, materialized
  already: it has its values, and may sit on another device) is skipped.

Fresh memory is filled first (``mark_unwritten``: NaN, a wide integer type's
least value), so a tensor set only in part is found too; ``unwritten`` tells
what is left.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Set, Tuple, Union

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Writes", "storage_key", "mark_unwritten", "unwritten"]

Key = Tuple[str, int]

#: Tensor methods that draw random numbers and take ``generator=``
_DRAWS = frozenset({"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_",
                    "cauchy_"})
#: in-place by name, writing no values
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad_"})
_IN_PLACE_OPERATORS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                                 "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                                 "__irshift__"})

#: integer types whose least value no initialisation writes (index buffers: positions, token types)
_WIDE_INTS = (torch.int16, torch.int32, torch.int64)


def _fill(t: torch.Tensor) -> Optional[Union[bool, int, float]]:
    """What fresh memory of ``t``'s type is filled with before the initialisation: NaN, a wide integer type's least
    value (which no initialisation writes); else (bool, 8-bit and unsigned types, where every value may be meant)
    True or the type's greatest value, read only where no write into the tensor was seen (None: a type without
    one, told by the writes alone)."""
    if t.is_floating_point() or t.is_complex():
        return float("nan")
    if t.dtype == torch.bool:
        return True
    try:
        return int(torch.iinfo(t.dtype).min if t.dtype in _WIDE_INTS else torch.iinfo(t.dtype).max)
    except TypeError:
        return None


def mark_unwritten(t: torch.Tensor) -> None:
    """Fill freshly allocated memory (``_fill``), so that a tensor the initialisation never sets is found instead
    of training from whatever the memory held."""
    fill = _fill(t)
    if t.numel() and fill is not None:
        t.fill_(fill)


def unwritten(t: torch.Tensor, written: bool) -> bool:
    """Whether ``t`` still holds fresh memory (some of it): NaN or a wide integer type's least value anywhere;
    for the other types, no write seen (``writes``) and every value still the fill."""
    fill = _fill(t)
    if not t.numel():
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    if t.dtype in _WIDE_INTS:
        return bool((t == torch.iinfo(t.dtype).min).any())
    return not written and (fill is None or bool((t == fill).all()))


def storage_key(t: torch.Tensor) -> Key:
    """Where ``t``'s values live: the same for a tensor and every view of it (a tensor without one storage, a
    sparse one: the tensor itself)."""
    try:
        return (str(t.device), t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return (str(t.device), -id(t))


def _target(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """The tensor a call writes into, else None: ``t.op_(...)``, ``t[i] = v``, ``torch.nn.init.op_(tensor=t)``
    (dispatched with its arguments by keyword), ``out=t``."""
    if name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("__") and name not in _NOT_WRITES):
        first = args[0] if args else kwargs.get("tensor")
        return first if isinstance(first, torch.Tensor) else None
    out = kwargs.get("out")
    return out if isinstance(out, torch.Tensor) else None


class Writes(TorchFunctionMode):
    """While active, notes the fresh tensors written (``written``), draws into each seeded one from its own
    generator, and skips writes into ``protected`` tensors (see the module docstring)."""

    def __init__(self, fresh: Set[Key], seeds: Optional[Dict[Key, int]] = None,
                 protected: Optional[Set[Key]] = None) -> None:
        super().__init__()
        self.fresh = fresh
        self.seeds = dict(seeds or {})
        self.protected = set(protected or ())
        self.written: Set[Key] = set()
        self._generators: Dict[Key, torch.Generator] = {}

    def run(self, initialiser: Callable[[], None]) -> None:
        """Run one initialiser: every seeded tensor's draws start again from its seed."""
        self._generators.clear()
        initialiser()

    def _generator(self, key: Key) -> torch.Generator:
        if key not in self._generators:
            self._generators[key] = torch.Generator().manual_seed(self.seeds[key])
        return self._generators[key]

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        target = _target(name, args, kwargs)
        if target is not None and not target.is_meta:
            key = storage_key(target)
            if key in self.protected:
                return None if name == "__setitem__" else target
            if key in self.fresh:
                self.written.add(key)
                if key in self.seeds and kwargs.get("generator") is None and (
                        "generator" in kwargs or name in _DRAWS):
                    kwargs["generator"] = self._generator(key)
        return func(*args, **kwargs)
