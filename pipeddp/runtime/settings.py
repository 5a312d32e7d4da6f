"""What a pipeline was asked for, checked: plain data that every layer may read.

The public classes check their arguments once (``pipeddp._settings``) and
hand this record down: to the ``Step`` they build, and in ``HybridParallel``
to the distributed builder (``pipeddp.distributed.build``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Union

from .schedule.actions import ScheduleFn

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    """What was asked for, checked: micro-batching, schedule, recompute, and the timeout in seconds."""

    chunks: Optional[int]
    split_size: Optional[int]
    schedule: Union[str, ScheduleFn]
    checkpoint: str
    timeout: float
    #: options for ``torch.compile`` of each stage's module, or None for eager stages
    compile: Optional[Dict[str, Any]] = None
    #: stages per device: the model is cut into ``devices x virtual_stages`` stages
    virtual_stages: int = 1
    #: ``virtual_stages="auto"``: ``virtual_stages`` (1 until then) is chosen from the profile when the engine is
    #: built, one of ``VIRTUAL_CHOICES`` (``schedule.placing.choose_layout``)
    choose_virtual: bool = False
    #: ``schedule="auto"``: the most micro-batches a device may hold at once (None: 1F1B's)
    max_activations: Optional[int] = None
    #: how the stages sit on the devices: ``"loop"`` (round robin) or ``"v"`` (``schedule.actions.PLACEMENTS``), or
    #: ``"auto"``: one of them, chosen from the profile when the engine is built (``schedule.placing``)
    placement: str = "loop"
    #: the seed a model built on the meta device is initialised from, layer by layer (see ``materialize``)
    seed: int = 0
    #: how such a model's modules are initialised (None: their own ``reset_parameters``)
    init: Optional[Callable[[Any], None]] = None

    @property
    def timeout_delta(self) -> timedelta:
        return timedelta(seconds=self.timeout)
