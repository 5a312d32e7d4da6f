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
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Writes", "storage_key"]

Key = Tuple[str, int]

#: Tensor methods that draw random numbers and take ``generator=``
_DRAWS = frozenset({"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_",
                    "cauchy_"})
#: in-place by name, writing no values
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad_"})
_IN_PLACE_OPERATORS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                                 "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                                 "__irshift__"})


def storage_key(t: torch.Tensor) -> Key:
    """Where ``t``'s values live: the same for a tensor and every view of it."""
    return (str(t.device), t.untyped_storage().data_ptr())


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
