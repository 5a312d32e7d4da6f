"""Mixed precision in stage threads: the caller's autocast, re-entered where the stages compute.

``torch.autocast`` is thread-local. A user who writes::

    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = pipe.train_step(x, y, loss_fn)

expects every layer to compute in bfloat16, as the plain model would; but the
stages run on threads of their own, where autocast is off. So a step
captures the caller's state (per device type: enabled, dtype, weight cache)
in its ``StepSpec`` and every stage re-enters it around each forward, the
loss and every recompute::

    caller thread                 stage threads
    autocast(cpu, bf16) --capture--> Autocast((cpu, bf16, cache)) --enter--> F0 F1 ... (and recompute in B)

Backward runs outside autocast, as PyTorch recommends (it follows the dtypes
of the forward). Between processes each rank captures its own caller's state.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager, Tuple

import torch

__all__ = ["Autocast"]

_DEVICE_TYPES = ("cpu", "cuda")
#: whether autocast is on for any device type (torch's own checkpoint asks so); a torch without it asks per type
_any_enabled = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_OFF = contextlib.nullcontext()  # reusable: entered around every action of a step without autocast


@dataclass(frozen=True)
class Autocast:
    """The autocast regions enabled in the thread that captured it: ``(device type, dtype, weight cache)``."""

    regions: Tuple[Tuple[str, torch.dtype, bool], ...] = ()

    @classmethod
    def capture(cls) -> "Autocast":
        """The calling thread's autocast state."""
        if not _any_enabled():  # the rule: none on, one C call (not one per device type)
            return _NONE
        on = [dt for dt in _DEVICE_TYPES if torch.is_autocast_enabled(dt)]
        if not on:
            return _NONE
        cache = torch.is_autocast_cache_enabled()
        return cls(tuple((dt, torch.get_autocast_dtype(dt), cache) for dt in on))

    def __call__(self) -> ContextManager[Any]:
        """Enter the captured regions (nothing when none was enabled)."""
        if not self.regions:
            return _OFF
        stack = contextlib.ExitStack()
        for device_type, dtype, cache in self.regions:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
        return stack


_NONE = Autocast()  # what a step without autocast captures (captured every step: one object for all of them)
