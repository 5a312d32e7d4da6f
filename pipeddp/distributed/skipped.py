"""A step skipped for a non-finite loss or gradients stays skipped until the optimizer steps (``skip_nonfinite``).

With gradient accumulation over calls (``train_step`` twice, then
``optimizer.step()``), dropping the gradients of the bad call alone would let
the other calls' gradients through, and ``optimizer.step()`` would apply part
of a step whenever the bad call was not the last::

    call 1: NaN  -> skipped, .grad = None          call 1: ok   -> .grad = g1
    call 2: ok   -> .grad = g2   (g2 applied!)     call 2: NaN  -> skipped, .grad = None

So a skip stays open here, and every call until the next step of an optimizer
that holds the engine's parameters drops its gradients too, on every rank
alike (``Agreement.finish_step`` carries the flag in the loss's gathering).
The optimizer's step is the one event that ends a step: after a skip, the
weights and gradients look the same whether the next call continues the step
or begins another, so a loop must call ``optimizer.step()`` after a skipped
step as after any other (it changes nothing then).
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, Iterable, Optional, Tuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

__all__ = ["OpenSkip"]


class OpenSkip:
    """Whether a skipped step is still open: from a skip until an optimizer over the engine's parameters steps.

    The hook on every optimizer's step exists only while a skip is open, so an engine that never skips adds
    nothing to any optimizer's step.
    """

    def __init__(self) -> None:
        self._ids: FrozenSet[int] = frozenset()
        self._handle: Optional[RemovableHandle] = None

    @property
    def open(self) -> bool:
        """Whether a call of the current optimizer step was skipped (its later calls are dropped too)."""
        return self._handle is not None

    def begin(self, params: Iterable[nn.Parameter]) -> None:
        """A call of this step was skipped: keep the step skipped until an optimizer over ``params`` steps."""
        self._ids = frozenset(id(p) for p in params)
        if self._handle is None:
            self._handle = register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        if any(id(p) in self._ids for group in optimizer.param_groups for p in group["params"]):
            self.end()

    def end(self) -> None:
        """Close the skip (the optimizer stepped, or the engine closes)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
