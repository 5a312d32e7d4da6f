"""An optimizer's state by parameter *name*, in the two forms checkpoints hold, and which class it belongs to.

Positions (``state[0]``) mean nothing to another partition of the model, so
every checkpoint keys the optimizer state by the names of the parameters
(``torch.distributed.checkpoint.state_dict`` does the naming; a flattened
model's names are turned into the original model's by ``runtime.names``)::

    named (the one-file format)                  flat (the sharded format, PyTorch's per-parameter form)
    {"state": {"0.weight": {"exp_avg": ...}},    {"state.0.weight.exp_avg": ...,
     "param_groups": [{"lr": 0.1, ...,             "param_groups.0.weight.lr": 0.1, ...}
                       "params": ["0.weight"]}]}

In the flat form every entry belongs to one parameter, so the processes of
different stages never write the same key and replicas write equal ones.
A process loads either form by taking the entries of the parameters it
holds. A checkpoint records the optimizer's class too: an SGD would take
Adam's hyper-parameters without complaint and fail later in ``step()``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch
from torch import nn

from ..distributed.shard import shard_like
from ..runtime.dtensors import is_dtensor
from ..runtime.names import names_of

__all__ = ["named_optimizer_state", "merge_optimizer_states", "load_named_optimizer_state", "flat_optimizer_state",
           "load_flat_optimizer_state", "unflatten_optimizer_state", "optimizer_class", "check_optimizer",
           "check_named_state"]


def _dcp() -> Any:
    """torch's ``torch.distributed.checkpoint.state_dict``, imported when an optimizer's state is first read or
    written: importing DCP costs every process that imports pipeddp about 0.7 s of CPU otherwise."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


def _flat_options() -> Any:
    """The flat form (one key per parameter and state entry), as DCP reads and writes it."""
    return _dcp().StateDictOptions(flatten_optimizer_state_dict=True)


def _whole_options(module: nn.Module) -> Any:
    """Where ``module``'s parameters are FSDP2 shards (DTensors), the named form gathered whole to save and cut to
    each rank's shards to load (``full_state_dict``); else None (the default form)."""
    sharded = any(is_dtensor(p) for p in module.parameters())
    return _dcp().StateDictOptions(full_state_dict=True) if sharded else None


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def named_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's state keyed by the original model's names of ``module``'s parameters, on CPU."""
    # a collective with shard=
    whole = _dcp().get_optimizer_state_dict(module, optimizer, options=_whole_options(module))
    return names_of(module).named_optimizer_to_original(_to_cpu(whole))


def merge_optimizer_states(parts: Iterable[Optional[Dict[str, Any]]]) -> Optional[Dict[str, Any]]:
    """Join the named optimizer states of several stages into one (group by group)."""
    merged: Optional[Dict[str, Any]] = None
    for part in parts:
        if part is None:
            continue
        if merged is None:
            merged = {"state": dict(part["state"]), "param_groups": [dict(g, params=list(g["params"]))
                                                                     for g in part["param_groups"]]}
            continue
        merged["state"].update(part["state"])
        if len(part["param_groups"]) != len(merged["param_groups"]):
            raise ValueError("the stages' optimizers have different numbers of param groups")
        for into, group in zip(merged["param_groups"], part["param_groups"]):
            into["params"] += [p for p in group["params"] if p not in into["params"]]
    return merged


def load_named_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
    """Load the entries of ``state`` that belong to ``module``'s parameters into ``optimizer``."""
    params = [n for n, _ in module.named_parameters()]
    state = names_of(module).named_optimizer_to_own(state, params)
    names = set(params)
    groups = []
    for g in state["param_groups"]:
        groups.append(dict(g, params=[p for p in g["params"] if p in names]))
    own: Dict[str, Any] = {"state": {k: v for k, v in state["state"].items() if k in names}, "param_groups": groups}
    held = dict(module.named_parameters())
    # mypy: is_dtensor checks for a DTensor, which mypy cannot narrow through a helper
    if any(is_dtensor(p) and p.device_mesh.ndim > 1 for p in held.values()):  # type: ignore[attr-defined]
        # FSDP2 over tensor-parallel shards (2-D DTensors): DCP's whole-state load scatters each tensor from rank 0,
        # which torch 2.14 fails with an AssertionError in _StridedShard's scatter (an MLP's 10-wide head, dp2 x
        # tp2); every rank holds the whole state here, so each cuts its own piece (no communication)
        own["state"] = {k: {s: shard_like(v, held[k]) if isinstance(v, torch.Tensor) and v.dim() else v
                            for s, v in entries.items()} for k, entries in own["state"].items()}
        _dcp().set_optimizer_state_dict(module, optimizer, own)
        return
    _dcp().set_optimizer_state_dict(module, optimizer, own, options=_whole_options(module))


def flat_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The optimizer's state in the flat form, keyed by the original names of ``module``'s parameters.

    The tensors are the optimizer's own, not copies. An optimizer that has not
    stepped yet first gets its state created (by PyTorch, with a zero-gradient,
    zero-learning-rate step), so that a loader has tensors to read into.
    """
    flat = _dcp().get_optimizer_state_dict(module, optimizer, options=_flat_options())
    return names_of(module).flat_optimizer_to_original(flat)


def load_flat_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
    """Load a flat state (``flat_optimizer_state``'s keys, values read back) into ``optimizer``."""
    names = names_of(module)
    if not names.identity:
        own = _dcp().get_optimizer_state_dict(module, optimizer, options=_flat_options())
        state = names.flat_optimizer_to_own(state, own)
    _dcp().set_optimizer_state_dict(module, optimizer, state, options=_flat_options())


def unflatten_optimizer_state(flat: Dict[str, Any]) -> Dict[str, Any]:
    """The named form of a flat optimizer state (for the one-file format).

    State keys and hyper-parameter names hold no dots (``exp_avg``, ``lr``),
    so a parameter's name is what lies between the section and the last dot.
    Parameters with equal hyper-parameters form one group, in order of first
    appearance: a loader matches groups by the names they hold.
    """
    state: Dict[str, Dict[str, Any]] = {}
    hyper: Dict[str, Dict[str, Any]] = {}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        name, _, field = rest.rpartition(".")
        if section == "state":
            state.setdefault(name, {})[field] = value
        elif section == "param_groups":
            hyper.setdefault(name, {})[field] = value
    groups: List[Dict[str, Any]] = []
    for name, values in hyper.items():
        group = next((g for g in groups if _same(g, values)), None)
        if group is None:
            group = dict(values, params=[])
            groups.append(group)
        group["params"].append(name)
    return {"state": state, "param_groups": groups}


def _same(group: Dict[str, Any], values: Dict[str, Any]) -> bool:
    """Whether a group's hyper-parameters are ``values`` (tensors compared by value)."""
    if set(group) - {"params"} != set(values):
        return False
    for k, v in values.items():
        g = group[k]
        if isinstance(v, torch.Tensor) or isinstance(g, torch.Tensor):
            if not (isinstance(v, torch.Tensor) and isinstance(g, torch.Tensor) and torch.equal(v, g)):
                return False
        elif g != v:
            return False
    return True


def optimizer_class(optimizer: Optional[torch.optim.Optimizer]) -> Optional[str]:
    """What a checkpoint records of the optimizer whose state it holds, e.g. ``"torch.optim.adam.Adam"``."""
    return None if optimizer is None else f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def check_optimizer(path: str, saved_class: Optional[str], has_state: bool,
                    optimizer: torch.optim.Optimizer) -> None:
    """Refuse ``path``'s optimizer state for ``optimizer`` when it holds none, or another class's.

    Checked before anything is loaded. Files written before the class was
    recorded (``saved_class`` None) are not compared.
    """
    if not has_state:
        raise ValueError(f"{path} holds no optimizer state (it was saved without optimizer=); load it without "
                         "optimizer= to take the model's weights only")
    given = optimizer_class(optimizer)
    if saved_class is not None and saved_class != given:
        short = saved_class.rsplit(".", 1)[-1]
        raise ValueError(f"{path} holds the state of a {saved_class} optimizer, but the optimizer given is a "
                         f"{given}; resume with the optimizer it was saved with ({short}, the same parameter "
                         "groups), or load without optimizer= to take the model's weights only")


def check_named_state(path: str, state: Dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse a named optimizer state that ``optimizer`` would take only in part, before anything is loaded.

    torch's ``Optimizer.load_state_dict`` refuses other parameter groups, but
    only after the model's weights were loaded; and it takes state tensors of
    any shape, which fail later in ``step()``. So the groups (which of
    ``module``'s parameters each holds) and the shape of every state tensor the
    optimizer already has are compared here first.
    """
    named = list(module.named_parameters())
    by_id = {id(p): n for n, p in named}
    own = names_of(module).named_optimizer_to_own(state, [n for n, _ in named])
    mine = [[by_id.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    if any(n is None for g in mine for n in g):
        return  # an optimizer over parameters the module does not hold: torch decides
    held = {n for g in mine for n in g}
    saved = [[n for n in g["params"] if n in held] for g in own["param_groups"]]
    saved = [g for g in saved if g] if len(saved) != len(mine) else saved
    if len(saved) != len(mine) or any(set(a) != set(b) for a, b in zip(saved, mine)):
        raise ValueError(f"{path} holds optimizer state of other parameter groups than the optimizer's (saved: "
                         f"{[len(g) for g in saved]} parameters per group, given: {[len(g) for g in mine]}); build "
                         "the optimizer with the groups it was saved with, or load without optimizer=")
    params = dict(named)
    wrong = []
    for name, fields in own["state"].items():
        have = optimizer.state.get(params[name], {}) if name in params else {}
        for field, value in fields.items():
            now = have.get(field)
            if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) and value.shape != now.shape:
                wrong.append(f"{name}.{field}: checkpoint {list(value.shape)}, optimizer {list(now.shape)}")
    if wrong:
        raise ValueError(f"{path} holds optimizer state of other shapes than the optimizer's: {wrong[:5]}. Nothing "
                         "was loaded")
