"""What ``Pipeline`` and ``HybridParallel`` both are: an ``nn.Module`` that holds the layers and runs a ``Step``.

The two classes differ in how they build their stages and runner; what they
expose of the step they run is the same, so it is written here once.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, TypeVar

import torch
from torch import nn

from .runtime.clip import clip_grad_norm
from .runtime.stage import Stage
from .runtime.step import Step
from .runtime.trace import Trace

__all__ = ["StepModule"]

Self = TypeVar("Self", bound="StepModule")

#: ``combine(part, is_max)``: the shares of a norm held by the processes of one pipeline, joined
Combine = Callable[[torch.Tensor, bool], torch.Tensor]


class StepModule(nn.Module):
    """An ``nn.Module`` running ``self._step``; a context manager that closes itself."""

    _step: Step

    @property
    def trace(self) -> Optional[Trace]:
        """The timeline being recorded (None when off); assign a ``Trace`` to start recording."""
        return self._step.trace

    @trace.setter
    def trace(self, value: Optional[Trace]) -> None:
        self._step.trace = value

    @property
    def stages(self) -> List[Stage]:
        """The stages this process runs, in order (each has ``.module``, ``.device``, ``.index``)."""
        return list(self._step.stages)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip gradients as ``torch.nn.utils.clip_grad_norm_`` on the plain model would; returns the total norm.

        Call it where you would clip the plain model: after ``train_step`` (or
        ``backward``), after ``scaler.unscale_(optimizer)`` when scaling, before
        ``optimizer.step()``; in ``HybridParallel`` on every rank (in stage mode
        it is a collective of each pipeline's processes). The norm counts every
        weight of the plain model once: a tied weight's copies are left out, and
        in stage mode the other stages' gradients are counted too, so every
        process clips by the plain model's factor. ``clip_grad_norm_`` over
        ``engine.parameters()`` would count tied copies twice and, in stage mode,
        see one stage only. Returns the norm as a float64 scalar tensor.
        """
        copies, device, combine = self._norm_scope()
        return clip_grad_norm(list(self.parameters()), self._step.ties.copies() + copies, max_norm, norm_type,
                              device=device, combine=combine, error_if_nonfinite=error_if_nonfinite)

    def _norm_scope(self) -> Tuple[List[nn.Parameter], torch.device, Optional[Combine]]:
        """For ``clip_grad_norm_``: copies of ties held for other processes, where the norm is summed, and
        how other processes' shares join it (None: this process holds every stage)."""
        return [], self._step.stages[0].device, None

    def close(self) -> None:  # pragma: no cover - each class says what it stops
        raise NotImplementedError

    def __enter__(self: Self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
