"""Which layer object each stage holds, and the owner that registers them all under the model's names.

A module used at several positions of the model is one object in the plain model; cut into stages it is one
object within a stage and a copy in each later stage that uses it (``tied`` keeps the copies one weight). The
engine that owns the stages registers every stage's layers under their names in the model, so its state dict
and parameters read as the plain model's.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Protocol, Sequence, Tuple

from torch import nn

from .tied import layers_of, stage_of_layers

__all__ = ["own_layers", "register_layers"]


class _Holder(Protocol):
    """What ``register_layers`` reads of a stage: its layers."""

    @property
    def module(self) -> nn.Sequential: ...


def own_layers(model: nn.Sequential, balance: Sequence[int]) -> List[Tuple[str, nn.Module]]:
    """Every position's layer, with a module object that several stages use copied for each later stage.

    A module used at several positions of one stage stays one object. Used by
    several stages, each later stage gets a copy (its parameters are then tied
    to the first stage's, see ``tied``). A module with buffers (BatchNorm's
    running statistics) cannot be split that way: the copies would update
    their statistics apart, so that is refused, naming the positions.
    """
    where = stage_of_layers(balance)
    first: Dict[int, Tuple[int, int]] = {}  # id(layer) -> (first position, its stage)
    out = []
    for pos, ((name, layer), stage) in enumerate(zip(layers_of(model), where)):
        seen = first.setdefault(id(layer), (pos, stage))
        if seen[1] != stage:
            if any(True for _ in layer.buffers()):
                raise ValueError(
                    f"the module at positions {seen[0]} and {pos} of the model is one object "
                    f"({type(layer).__name__}, with buffers) used by stages {seen[1]} and {stage}; its buffers "
                    "would be updated apart on each stage. Give each position a module of its own, or choose a "
                    f"balance that puts positions {seen[0]}..{pos} in one stage"
                )
            layer = copy.deepcopy(layer)
        out.append((name, layer))
    return out


def register_layers(owner: nn.Module, stages: Sequence[_Holder]) -> None:
    """Register the stages' layers on ``owner`` under their names in the model.

    So ``owner.state_dict()`` has the plain model's keys (``"0.weight"``) and
    ``owner.parameters()`` come in the model's order, whatever the cut. (For a
    flattened model the owner renames the keys to the original model's: ``names``.)
    """
    for st in stages:
        for name, layer in layers_of(st.module):
            owner.add_module(name, layer)
