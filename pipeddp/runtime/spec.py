"""What one step asks of every stage, and what a stage keeps of a micro-batch between its forward and backward.

::

    StepSpec (one per step)  grad, recompute, seed, loss_fn / targets / weights, sync, autocast, loss_scale
       saved[stage][mb] -> Saved   inputs (leaves), roots (outputs or weighted loss; None: recompute),
                                   target, weight, weight_grads (after an I, for its W)

The saved state lives in the step, not in the stage, so several outstanding
``pipe(x)`` calls on one pipeline never mix their micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Protocol, Sequence, Tuple, Union

import torch

from .amp import Autocast
from .split import WeightGrads

__all__ = ["StepSpec", "Saved", "Grads"]

#: Gradients aligned with a value's tensor leaves (None where a leaf has none).
Grads = List[Optional[torch.Tensor]]


class ByMicroBatch(Protocol):
    """What holds a value per micro-batch: a list, or ``microbatch.Pieces`` (a batch cut where it is first read)."""

    def __getitem__(self, mb: int) -> Any: ...


@dataclass
class StepSpec:
    """What one step asks of every stage.

    ``grad``: keep what backward needs. ``recompute(i)``: drop activations of
    micro-batch i and recompute them in backward. ``seed``: base seed for random
    stages (None: no random stage). ``loss_fn``/``targets``/``weights``: the last
    stage turns outputs into weighted losses (or, for a loss_fn returning ``(total, count)``, totals and
    ``counts``). ``sync``: this step's last backward
    on each stage must trigger the data-parallel gradient all-reduce.
    ``autocast``/``loss_scale``: mixed precision (see ``amp``).
    """

    grad: bool
    recompute: Callable[[int], bool] = lambda i: False
    seed: Optional[int] = None
    loss_fn: Optional[Callable[[Any, Any], Any]] = None
    targets: Optional[ByMicroBatch] = None
    weights: Optional[Sequence[float]] = None
    sync: bool = False
    #: the caller's autocast state, re-entered around every forward and recompute
    autocast: Autocast = field(default_factory=Autocast)
    #: scales the loss before backward (a GradScaler's ``scale``); the returned loss stays unscaled
    loss_scale: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    #: per stage, what forward kept for backward, by micro-batch. It lives in the
    #: step (not the stage) so several outstanding ``pipe(x)`` calls never mix.
    saved: List[Dict[int, "Saved"]] = field(default_factory=list)
    #: per micro-batch, the count its loss_fn returned with its total (empty for mean losses)
    counts: Dict[int, Union[int, float, torch.Tensor]] = field(default_factory=dict)
    #: which kind of loss the step's loss_fn returns: a mean (False) or (total, count) (True); None before the first
    counted: Optional[bool] = None
    #: per stage, the training flags of its layers in this step (``Stage._step_mode``: read once, at its first action)
    modes: Dict[int, Tuple[bool, ...]] = field(default_factory=dict)
    #: the stages that may draw random numbers this step (``Stage.read_step``; None: every stage may)
    drawing: Optional[FrozenSet[int]] = None
    #: per stage, what runs its layers this step (``Stage._layers``: found once, at its first forward)
    calls: Dict[int, Callable[[Any], Any]] = field(default_factory=dict)
    #: the stages whose layers may write their input in place this step (``Stage.read_step``; None: any may)
    writing: Optional[FrozenSet[int]] = None

    def count(self, mb: int, count: Optional[Union[int, float, torch.Tensor]]) -> None:
        """Record the kind of loss micro-batch ``mb`` returned (and its count): one kind for the whole step."""
        kind = count is not None
        if self.counted is not None and self.counted != kind:
            raise ValueError("loss_fn returned a mean for some micro-batches and (total, count) for others; return "
                             "one kind for every micro-batch")
        self.counted = kind
        if count is not None:
            if isinstance(count, torch.Tensor) and count.numel() != 1:
                raise ValueError(f"loss_fn's count must be a number, got a tensor of shape {tuple(count.shape)}")
            self.counts[mb] = count

    def store(self, stage: int) -> Dict[int, "Saved"]:
        while len(self.saved) <= stage:
            self.saved.append({})
        return self.saved[stage]


@dataclass
class Saved:
    """What forward keeps of one micro-batch for its backward."""

    inputs: Any
    #: what backward starts from (the outputs, or the weighted loss); None: recompute it first
    roots: Optional[Any]
    target: Any = None
    weight: float = 1.0
    #: after an input-gradient backward (I): what its weight half (W) needs
    weight_grads: Optional[WeightGrads] = None
