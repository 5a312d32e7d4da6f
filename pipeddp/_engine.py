"""What ``Pipeline`` and ``HybridParallel`` both are: an ``nn.Module`` that holds the layers and runs a ``Step``.

The two classes differ in how they build their stages and runner; what they
expose of the step they run is the same, so it is written here once.
"""

from __future__ import annotations

from typing import Any, List, Optional, TypeVar

from torch import nn

from .runtime.stage import Stage
from .runtime.step import Step
from .runtime.trace import Trace

__all__ = ["StepModule"]

Self = TypeVar("Self", bound="StepModule")


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

    def close(self) -> None:  # pragma: no cover - each class says what it stops
        raise NotImplementedError

    def __enter__(self: Self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
