"""The layers after a block stack's last block: the recorded chain of steps from its output to the model's.

Each step is a module of the model (``model_norm``, ``lm_head``) or a torch
function (``x[:, 0]`` as a ``Functional``) taken from the recorded run
(``record.Run``); reshapes that leave the sample as it is are left out. A step
must take only the previous step's output; a head that combines it with what
it computed from the model's input (a classifier picking each row's last
non-padding token) is replayed as one layer instead (``head``).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..functional import INPUT, Functional
from .carry import leaves
from .record import Event, NotAStack, Run

__all__ = ["tail_layers"]

_VIEWS = {"view", "reshape", "__getitem__", "contiguous", "to", "flatten", "squeeze", "unsqueeze", "expand",
          "type_as", "float", "double"}


def tail_layers(run: Run, start: Any, final: Any, name: str) -> List[Tuple[str, nn.Module, Dict[str, str]]]:
    """The layers after the last block: the chain of recorded steps from ``start`` to ``final``."""
    def producer(value: Any, before: int) -> Tuple[int, Optional[int]]:
        """The last event before position ``before`` whose output is (or holds at [k]) ``value``."""
        for pos in range(before - 1, -1, -1):
            out = run.tail[pos].out
            if out is value:
                return pos, None
            if isinstance(out, (tuple, list)):
                for k, v in enumerate(out):
                    if v is value:
                        return pos, k
        return -1, None

    steps: List[Tuple[Event, Optional[int], Any]] = []
    value, pos = final, len(run.tail)
    while True:
        found, k = producer(value, pos)
        if value is start and found < 0:  # not before: a module that gave the block's output back as it was
            break                         # (dropout, identity in eval mode) runs on it in training
        pos = found
        if pos < 0:
            raise NotAStack(f"the output of {name} is not computed from its last block's output by its modules and "
                            "torch functions alone")
        event = run.tail[pos]
        inputs = [(w, v) for w, v in leaves(list(event.args), "args") + leaves(dict(event.kwargs), "kwargs")
                  if isinstance(v, torch.Tensor)]
        distinct = {id(v): v for _, v in inputs}
        if len(distinct) != 1:
            what = "no tensor" if not distinct else " and ".join(w for w, _ in inputs)
            raise NotAStack(f"{event.path} ({event.where}) after the last block takes {what}: each step after the "
                            "blocks may take only the previous step's output")
        steps.append((event, k, next(iter(distinct.values()))))
        value = next(iter(distinct.values()))
    layers: List[Tuple[str, nn.Module, Dict[str, str]]] = []
    for event, k, inp in reversed(steps):
        if isinstance(event.what, nn.Module):
            if len(event.args) == 1 and not event.kwargs:
                layers.append((event.path, event.what, {"": event.path}))
            else:
                layers.append((event.path, _with_input(event.what, event, inp), {"fn": event.path}))
            if k is not None:
                layers.append(("getitem", Functional(operator.getitem, INPUT, k), {}))
            continue
        out = event.out if k is None else event.out[k]
        if event.path in _VIEWS and isinstance(out, torch.Tensor) and out.shape == inp.shape and \
                out.dtype == inp.dtype and out.device == inp.device and torch.equal(out, inp):
            continue  # a reshape that leaves the sample as it is
        if "dropout" in event.path:
            raise NotAStack(f"{event.path} ({event.where}) after the last block: functional dropout there would "
                            "keep the sample run's training flag; use an nn.Dropout module")
        layers.append((event.path.strip("_"), _with_input(event.what, event, inp), {}))
        if k is not None:
            layers.append(("getitem", Functional(operator.getitem, INPUT, k), {}))
    return layers


def _with_input(fn: Any, event: Event, inp: torch.Tensor) -> Functional:
    def slot(value: Any) -> Any:
        if value is inp:
            return INPUT
        if isinstance(value, torch.Tensor):
            raise NotAStack(f"{event.path} ({event.where}) after the last block takes a second tensor")
        return value
    args = tuple(slot(v) if not isinstance(v, (tuple, list)) else type(v)(slot(x) for x in v) for v in event.args)
    kwargs = {key: slot(v) for key, v in event.kwargs.items()}
    return Functional.template(fn, args, kwargs)
