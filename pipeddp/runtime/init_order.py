"""An ``init=`` applied to one layer's fresh tensors as the whole model applies it: every module, children first.

transformers initialises a model by ``_init_weights(module)`` for every
module, children before their parent (``PreTrainedModel.initialize_weights``,
its ``smart_apply``: a sub-model's modules by the sub-model's own
``_init_weights``), and a parent's case may set its children's tensors:
GPT-2's attention scales its ``c_proj``, T5's attention sets ``q``/``k``/``v``/
``o`` from the model's sizes, BART's model zeroes its ``final_logits_bias``.
A tensor tied to another (an output head to the embedding) is tied *after*
that, so it keeps the values of its source, its first place.

Materializing one layer (of a pipeline's stage, or one child of the model)
replays that order over the model the layer belongs to (``tree``: the
model a flattened ``nn.Sequential`` was opened from, else the model itself):
each fresh tensor is put at its first place in the tree (its other places
hold a meta tensor meanwhile), and ``init`` runs on every module whose subtree
holds one, in that order, under ``Writes``: each tensor's random draws come
from a generator seeded by ``(seed, the tensor's first name)``, started again
for every module, and the global generator is seeded by ``(seed, the module's
name)``. So a tensor's values depend on its name and on the last case that set
it, not on which other tensors sit in the same process: every layout, and
``materialize`` of the whole model, give it the same values. Writes into
tensors already materialized (other layers) are skipped.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from .writes import Key, Writes, storage_key

__all__ = ["places", "initialise", "Init", "Place"]

Init = Callable[[nn.Module], None]
Table = Dict[str, Optional[torch.Tensor]]
#: a module's table (``_parameters`` or ``_buffers``), the key in it, the qualified name
Place = Tuple[Table, str, str]


def places(root: nn.Module, prefix: str) -> Dict[int, List[Place]]:
    """Every place of every tensor of ``root`` by the tensor's id, its first place first (parameters in
    ``named_parameters(remove_duplicate=False)``'s order, then buffers)."""
    found: Dict[int, List[Place]] = {}
    for attr in ("_parameters", "_buffers"):
        for mname, m in root.named_modules(prefix=prefix, remove_duplicate=False):
            table: Table = getattr(m, attr)
            for key, t in table.items():
                if t is not None:
                    found.setdefault(id(t), []).append((table, key, f"{mname}.{key}" if mname else key))
    return found


def _order(root: nn.Module, prefix: str, init: Init, holds: Set[int]) -> List[Tuple[str, nn.Module, Init]]:
    """The modules whose subtree holds a tensor in ``holds`` (by id), children first, each module once (at its
    first path), with what initialises each: ``init``, or where ``init`` is ``root._init_weights`` (transformers),
    the ``_init_weights`` of the nearest transformers model around the module, as ``smart_apply`` dispatches."""
    dispatch = getattr(init, "__self__", None) is root and getattr(init, "__name__", "") == "_init_weights"
    seen: Dict[int, bool] = {}
    out: List[Tuple[str, nn.Module, Init]] = []

    def walk(module: nn.Module, name: str, fn: Init) -> bool:
        if id(module) in seen:
            return seen[id(module)]
        seen[id(module)] = False
        own = getattr(module, "_init_weights", None)
        if dispatch and module is not root and callable(own) and hasattr(module, "post_init"):
            fn = own  # a transformers sub-model: its own _init_weights for its modules, as smart_apply does
        held = any(t is not None and id(t) in holds
                   for t in list(module._parameters.values()) + list(module._buffers.values()))
        for cname, child in module._modules.items():
            if child is not None:
                held = walk(child, f"{name}.{cname}" if name else cname, fn) or held
        seen[id(module)] = held
        if held:
            out.append((name, module, fn))
        return held

    walk(root, prefix, init)
    return out


def _meta_twin(t: torch.Tensor) -> torch.Tensor:
    twin = torch.empty_like(t, device="meta")
    return nn.Parameter(twin, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else twin


def initialise(root: nn.Module, prefix: str, where: Dict[int, List[Place]],
               fresh: List[Tuple[torch.Tensor, torch.Tensor]], *, init: Init, seed_of: Callable[[str], int],
               protected: Set[Key]) -> Tuple[Set[Key], Dict[int, torch.Tensor]]:
    """Set ``fresh`` (pairs: the meta tensor the layer held, its places in ``where``, ``places(root, prefix)``
    taken before the layer was given memory; the fresh tensor) by ``init`` over ``root``, as the module docstring
    says; ``protected``: the layer's tensors that are not fresh. Returns the fresh tensors written
    (``storage_key``), and those that an initialiser replaced by another tensor at the first place (by the fresh
    tensor's id). ``root`` holds what it held before when this returns (the layer's own places: the fresh
    tensors)."""
    saved: List[Tuple[Table, str, Optional[torch.Tensor]]] = []
    seeds: Dict[Key, int] = {}
    firsts: List[Tuple[Table, str, torch.Tensor]] = []
    replaced: Dict[int, torch.Tensor] = {}
    writes = Writes(set())
    try:
        for known, new in fresh:
            inert = known if known.is_meta else _meta_twin(new)
            for i, (table, key, _) in enumerate(where[id(known)]):
                saved.append((table, key, table[key]))
                table[key] = new if i == 0 else inert
            table, key, first_name = where[id(known)][0]
            firsts.append((table, key, new))
            seeds[storage_key(new)] = seed_of(first_name)
        ids = {id(new) for _, new in fresh}
        others = {storage_key(t) for ps in where.values() for table, key, _ in ps
                  for t in [table[key]] if t is not None and not t.is_meta and id(t) not in ids}
        writes = Writes(set(seeds), seeds, protected | others)
        with writes, torch.no_grad():
            for name, module, fn in _order(root, prefix, init, ids):
                with torch.random.fork_rng(devices=[]):
                    torch.default_generator.manual_seed(seed_of(name))  # the CPU's alone, as fork_rng keeps
                    writes.run(functools.partial(fn, module))
        for table, key, new in firsts:
            now = table[key]
            if now is not new and now is not None and not now.is_meta:
                replaced[id(new)] = now
    finally:
        for table, key, before in reversed(saved):
            table[key] = before
    return writes.written, replaced
