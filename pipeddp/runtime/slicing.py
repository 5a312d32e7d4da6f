"""Cut the model into its stages: each slice of ``balance`` layers, placed on its device, built only where this
process runs it (layers left on the meta device are made here, one at a time, and sharded where asked)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch
from torch import nn

from .materialize import Init, SharedPlaces, check_init, is_meta, materialize_layer, original_names, recorded_init
from .owned import own_layers
from .stage import Stage
from .tied import layers_of

__all__ = ["build_stages"]


def build_stages(model: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device],
                 indices: Optional[Sequence[int]] = None, *,
                 compile: Optional[Dict[str, Any]] = None, seed: int = 0, init: Optional[Init] = None,
                 distribute: Optional[Callable[[str, nn.Module], None]] = None) -> List[Stage]:
    """Cut ``model`` by ``balance`` and place stage ``indices[k]`` on ``devices[k]`` (default: every stage).

    A process that owns one stage of a longer pipeline builds only that one;
    the layers of the others are left where they are. ``compile``: options
    for ``torch.compile`` of each stage's module (None: eager). Layers on the
    meta device are materialized here, only those of the stages built, each
    from ``seed`` and its name (a copy of a module used by several stages from
    the name of its first place), as ``materialize`` would the whole model.
    ``distribute(name, layer)`` then shards each layer built (tensor parallelism), once it has its values and
    before the next one is materialized, so no more than one layer is ever held whole.
    """
    indices = list(range(len(balance))) if indices is None else list(indices)
    if len(indices) != len(devices):
        raise ValueError(f"{len(indices)} stages to place but {len(devices)} devices")
    shared = SharedPlaces(model) if is_meta(model) else None  # before any copy: a tie stays one parameter
    init = init if init is not None else recorded_init(model)
    rename = original_names(model)
    named = own_layers(model, balance)
    first: Dict[int, str] = {}
    origin = [first.setdefault(id(layer), name) for name, layer in layers_of(model)]  # per place: first name
    starts = [sum(balance[:s]) for s in range(len(balance))]
    stages = []
    done: Set[int] = set()  # the layers distributed (a layer at several positions, once)
    for s in indices if shared is not None else ():  # a layer nothing can initialise: refused before any changes
        for pos in range(starts[s], starts[s] + balance[s]):
            check_init(named[pos][1], origin[pos], init)
    for s, device in zip(indices, devices):
        for pos in range(starts[s], starts[s] + balance[s]):
            if shared is not None and is_meta(named[pos][1]):
                materialize_layer(named[pos][1], origin[pos], seed=seed, init=init, rename=rename)
                shared.join()
            if distribute is not None and id(named[pos][1]) not in done:
                done.add(id(named[pos][1]))
                distribute(named[pos][0], named[pos][1])
        part = nn.Sequential(OrderedDict(named[starts[s]:starts[s] + balance[s]])).to(device)
        stages.append(Stage(s, part, device, last=s == len(balance) - 1, compile=compile))
    return stages
