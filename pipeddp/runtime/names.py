"""The model's own names for its weights, when the pipeline's layers carry others.

A pipeline registers its layers under their names in the ``nn.Sequential``
it was given. For a model flattened by ``flatten_sequential`` those are not
the original model's names, so ``flatten_sequential`` records, per layer,
where its state came from::

    flattened name                       original name
    layer1_0.conv1.weight        <-      layer1.0.conv1.weight          (prefix "layer1_0" -> "layer1.0")
    encoder_layers_0.layer.linear1.bias  encoder.layers.0.linear1.bias  (a wrapped layer: its child)

Every key a pipeline shows the outside (``state_dict``, ``load_state_dict``,
the optimizer state of checkpoints, both checkpoint formats) goes through one
``Names``: out with ``original``, in with ``to_own``. A plain ``nn.Sequential``
has nothing recorded and keeps its keys (``Names()`` is the identity).

Several of the pipeline's keys may map to one original key: a layer placed
twice, or a tied weight's copies on later stages. They hold one tensor in
the model, so ``to_original`` keeps one entry and ``to_own`` gives its value
to each. Two *different* tensors mapping to one key would lose one of them:
``Names.of`` refuses that, naming both.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Mapping, Optional, TypeVar

from torch import nn

__all__ = ["Names", "record", "recorded", "recorded_source", "names_of", "key_mismatch"]

V = TypeVar("V")

_ATTR = "_pipeddp_original_names"  # on a flattened nn.Sequential: {flattened prefix: original prefix}
_SOURCE = "_pipeddp_source"  # on a flattened nn.Sequential: the model it was opened from


def record(flat: nn.Module, prefixes: Mapping[str, str], source: Optional[nn.Module] = None) -> None:
    """Remember on ``flat`` that the state under each flattened prefix came from the original prefix, and which
    model ``source`` the names are of (an export writes that model's configuration beside the weights)."""
    object.__setattr__(flat, _ATTR, dict(prefixes))
    if source is not None:
        object.__setattr__(flat, _SOURCE, source)  # not registered: its modules are the layers of ``flat``


def recorded(model: nn.Module) -> Optional[Dict[str, str]]:
    """What ``record`` remembered on ``model`` (None for a model that was not flattened)."""
    found = getattr(model, _ATTR, None)
    return dict(found) if isinstance(found, dict) else None


def recorded_source(model: nn.Module) -> Optional[nn.Module]:
    """The model ``model`` was flattened from (``record``'s ``source``), else None."""
    found = getattr(model, _SOURCE, None)
    return found if isinstance(found, nn.Module) else None


class Names:
    """Keys of the pipeline (its layers' names) to and from the original model's keys.

    ``prefixes`` maps a module path in the pipeline to its path in the
    original model; a key is renamed by its longest matching prefix, and a key
    under none stays as it is.
    """

    def __init__(self, prefixes: Optional[Mapping[str, str]] = None) -> None:
        self.prefixes: Dict[str, str] = {k: v for k, v in (prefixes or {}).items() if k != v}
        self._cache: Dict[str, str] = {}

    @classmethod
    def of(cls, model: nn.Module) -> "Names":
        """The names recorded on ``model``; ``ValueError`` if two different tensors would share an original key."""
        names = cls(recorded(model))
        if names.identity:
            return names
        holders: Dict[str, List[str]] = {}
        tensors: Dict[str, Any] = {}
        for key, value in model.state_dict(keep_vars=True).items():
            original = names.original(key)
            holders.setdefault(original, []).append(key)
            first = tensors.setdefault(original, value)
            if first is not value:
                raise ValueError(
                    f"the layers' keys {holders[original]} would all be saved as {original!r} of the original model, "
                    "but they hold different tensors, so one of them would be lost. Give the layers distinct names "
                    "(flatten_sequential records the names it gives; a model changed after flattening may not match)")
        return names

    @property
    def identity(self) -> bool:
        """Nothing to rename (a plain ``nn.Sequential``)."""
        return not self.prefixes

    def original(self, key: str) -> str:
        """The original model's name for the pipeline's ``key`` (a parameter, buffer or module path)."""
        if self.identity:
            return key
        hit = self._cache.get(key)
        if hit is None:
            hit = key
            head = key
            while head:
                if head in self.prefixes:
                    hit = self.prefixes[head] + key[len(head):]
                    break
                head = head.rpartition(".")[0]
            self._cache[key] = hit
        return hit

    def to_original(self, entries: Mapping[str, V]) -> "OrderedDict[str, V]":
        """``entries`` keyed by the original names; where several keys map to one, the first is kept."""
        if self.identity and isinstance(entries, OrderedDict):
            return entries  # as it is, with the ``_metadata`` a state dict carries
        out: "OrderedDict[str, V]" = OrderedDict()
        for key, value in entries.items():
            out.setdefault(self.original(key), value)
        return out

    def to_own(self, entries: Mapping[str, V], own: Iterable[str]) -> Dict[str, V]:
        """``entries`` (original names, or the pipeline's own) keyed by the pipeline's keys ``own``.

        Each original key's value goes to every own key that maps to it. Keys
        that are neither (another model's) are kept, so a strict load still
        names them.
        """
        if self.identity:
            return dict(entries)
        targets: Dict[str, List[str]] = {}
        own = list(own)
        for key in own:
            targets.setdefault(self.original(key), []).append(key)
        out: Dict[str, V] = {}
        for key, value in entries.items():
            for target in targets.get(key, [key]):
                out.setdefault(target, value)
        return out

    # -- optimizer state, keyed by parameter name -------------------------------------------------------------

    def named_optimizer_to_original(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """``{"state": {name: ...}, "param_groups": [{"params": [name, ...]}]}`` under the original names."""
        if self.identity:
            return state
        groups = []
        for g in state["param_groups"]:
            params = list(OrderedDict.fromkeys(self.original(p) for p in g["params"]))
            groups.append(dict(g, params=params))
        return {"state": self.to_original(state["state"]), "param_groups": groups}

    def named_optimizer_to_own(self, state: Dict[str, Any], own: Iterable[str]) -> Dict[str, Any]:
        """The named optimizer state of ``named_optimizer_to_original``, back under the pipeline's names ``own``."""
        if self.identity:
            return state
        targets: Dict[str, List[str]] = {}
        for key in own:
            targets.setdefault(self.original(key), []).append(key)
        groups = []
        for g in state["param_groups"]:
            groups.append(dict(g, params=[t for p in g["params"] for t in targets.get(p, [p])]))
        return {"state": self.to_own(state["state"], own), "param_groups": groups}

    def flat_key_to_original(self, key: str) -> str:
        """``state.<param>.<field>`` / ``param_groups.<param>.<field>`` (fields hold no dots) renamed."""
        section, _, rest = key.partition(".")
        param, _, field = rest.rpartition(".")
        return f"{section}.{self.original(param)}.{field}" if param else key

    def flat_optimizer_to_original(self, flat: Mapping[str, V]) -> "OrderedDict[str, V]":
        out: "OrderedDict[str, V]" = OrderedDict()
        for key, value in flat.items():
            out.setdefault(self.flat_key_to_original(key), value)
        return out

    def flat_optimizer_to_own(self, flat: Mapping[str, V], own: Iterable[str]) -> Dict[str, V]:
        """Values keyed by original flat keys, given to each of the pipeline's flat keys ``own`` mapping there."""
        out: Dict[str, V] = {}
        for key in own:
            original = self.flat_key_to_original(key)
            if original in flat:
                out[key] = flat[original]
        return out


def names_of(module: nn.Module) -> Names:
    """The ``Names`` of an engine (``Pipeline``, ``HybridParallel``), or the identity for any other module."""
    found = getattr(module, "key_names", None)
    return found if isinstance(found, Names) else Names()


def key_mismatch(owner: str, missing: Iterable[str], unexpected: Iterable[str], note: str = "") -> str:
    """``nn.Module.load_state_dict``'s message for keys that do not match (so code that reads torch's reads
    ours), ``note`` after the owner's name."""
    parts = []
    unexpected, missing = list(unexpected), list(missing)
    if unexpected:
        parts.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ". ")
    if missing:
        parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". ")
    return f"Error(s) in loading state_dict for {owner}{note}:\n\t" + "\n\t".join(parts)
