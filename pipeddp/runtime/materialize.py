"""Models built on the meta device: each process allocates only the layers it holds, the same weights in every layout.

A model too big for one process is built under ``torch.device("meta")``: its
parameters have shapes and dtypes but no memory. An engine cuts it like any
model and each process materializes only its own stages: memory on the CPU,
the model's own initialisation, then its device::

    model = build()  under torch.device("meta")       no memory
    rank 0: stage 0 -> memory, init, .to(cuda:0)       only its layers
    rank 1: stage 1 -> memory, init, .to(cuda:1)

Random initialisation under a pipeline would otherwise depend on the layout
(which layers a process builds, in which order, drawing from which
generator). So every draw is seeded by a name: 2 stages, 4 stages, any
replica count, and ``materialize(model, seed=s)`` (the plain model on one
device, for reference or single-device runs) start from the same weights, and
a restarted job with another layout starts the same too. The initialisation
runs on the CPU, so the values do not depend on the device either. It is

* an ``init=`` (a Hugging Face model's ``_init_weights``, which
  ``flatten_sequential`` records and ``materialize`` takes by default):
  applied to every module, children first, over the whole original model, as
  transformers applies it (a parent's case sets its children: GPT-2's scaled
  ``c_proj``, T5's projections), each tensor drawn from a generator seeded by
  ``(seed, its name)`` (``init_order``);
* else each module's ``reset_parameters()`` (``_reset_parameters()`` where
  torch names it so, as ``nn.MultiheadAttention`` does), for every module that
  owns tensors, from a generator seeded by ``(seed, its name in the model)``.

Limits: a buffer that a module computes in ``__init__`` and never in its
initialisation (a rotary embedding's frequencies, a causal mask) has no
values on the meta device to restore; such a module, and one that owns
parameters but has nothing to initialise them, is refused by name. Fresh
memory is filled with NaN (a wide integer type's least value) and the
initialisation's writes are watched (``writes``: a bool or 8-bit tensor has
no value free to mark it with), so an unset tensor of any type is found.
Set them in ``reset_parameters()`` or an ``init=``, or build those on a real
device.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple, Union

import torch
from torch import nn

from .init_order import Place, initialise, places
from .names import Names, recorded, recorded_source
from .writes import Key, Writes, mark_unwritten, storage_key, unwritten

__all__ = ["materialize", "materialize_layer", "check_init", "is_meta", "layer_seed", "SharedPlaces", "Init",
           "initialiser", "record_init", "recorded_init", "transformers_init", "original_names", "record_first_names"]

_CPU = torch.device("cpu")
_INIT_ATTR = "_pipeddp_init"
_FIRST_ATTR = "_pipeddp_first_names"


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` lives on the meta device (has no memory yet)."""
    return any(t.is_meta for t in _tensors(module, recurse=True))


def layer_seed(seed: int, name: str) -> int:
    """The seed of the module named ``name`` (its qualified name in the model): the same in every layout."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _tensors(module: nn.Module, *, recurse: bool) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)


Init = Callable[[nn.Module], None]


def record_init(model: nn.Module, init: Optional[Init]) -> None:
    """Remember on ``model`` (a flattened model) how the model it came from initialises its modules (a Hugging Face
    model's ``_init_weights``): the engines and ``materialize`` use it where no ``init=`` is given."""
    if init is not None:
        object.__setattr__(model, _INIT_ATTR, init)


def transformers_init(model: nn.Module) -> Optional[Init]:
    """A Hugging Face transformers model's own initialisation (``_init_weights``, applied to every module as
    ``init_order`` does), else None. timm's models have an ``_init_weights`` too, which is no such function: a
    transformers model is told by its ``post_init``."""
    found = getattr(model, "_init_weights", None) if hasattr(model, "post_init") else None
    return found if callable(found) else None


def recorded_init(model: nn.Module) -> Optional[Init]:
    """What ``record_init`` remembered on ``model``, else None."""
    found = getattr(model, _INIT_ATTR, None)
    return found if callable(found) else None


def record_first_names(model: nn.Module, original: nn.Module) -> None:
    """Remember on ``model`` (flattened from ``original``) the first name of each parameter ``original`` holds at
    several places (T5's embedding is ``shared.weight``, ``encoder.embed_tokens.weight``, ...): whichever place a
    stage holds is seeded by that first one, as ``materialize(original)`` seeds it, in every layout."""
    first: Dict[int, str] = {}
    later: Dict[str, str] = {}
    for name, p in original.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        if first[id(p)] != name:
            later[name] = first[id(p)]
    object.__setattr__(model, _FIRST_ATTR, later)


class _Original:
    """A key of a flattened model to its name in the model it was flattened from; ``first``: the later names of a
    parameter that model holds at several places, each to its first (``record_first_names``); ``tree``: the model
    whose modules an ``init=`` is applied to (``init_order``): the one it was flattened from, else itself."""

    def __init__(self, names: Callable[[str], str], first: Dict[str, str], tree: Optional[nn.Module] = None) -> None:
        self.names, self.first, self.tree = names, first, tree

    def __call__(self, key: str) -> str:
        return self.names(key)


def original_names(model: nn.Module) -> Callable[[str], str]:
    """A key of ``model`` to its name in the model it was flattened from (the name its seed comes from)."""
    return _Original(Names(recorded(model)).original, dict(getattr(model, _FIRST_ATTR, {})),
                     recorded_source(model) or model)


def materialize_layer(layer: nn.Module, name: str, *, seed: int, device: Union[str, torch.device] = _CPU,
                      init: Optional[Init] = None, rename: Optional[Callable[[str], str]] = None) -> nn.Module:
    """Give every meta tensor of ``layer`` (the model's module called ``name``) memory and its initial values.

    With ``init`` (a Hugging Face model's ``_init_weights``, say), it is applied as the model applies it, to
    every module, children first (``init_order``: over the model ``rename`` belongs to, a flattened model's
    original one), each tensor's draws seeded by its first name in that model. Without, each module that owns
    meta tensors runs its own ``reset_parameters()``, the global generator seeded by ``layer_seed(seed, its
    qualified name)`` (the name ``rename`` gives it: a flattened model's layers are seeded by their names in the
    original model). A tensor that nothing sets is refused by name (``_refuse_unset``). The layer is then moved
    to ``device``. Returns ``layer`` (changed in place).
    """
    owners = _owners(layer, name, init)  # every module checked before any is changed
    tree: Optional[nn.Module] = getattr(rename, "tree", None) if init is not None else None
    where = (places(tree, "") if tree is not None else {}, places(layer, name) if init is not None else {})
    fresh = _allocate(owners)
    if init is None:
        writes = Writes({storage_key(f.new) for f in fresh})
        with writes, torch.no_grad():
            for qualified, m, run in owners:
                with torch.random.fork_rng(devices=[]):
                    torch.default_generator.manual_seed(layer_seed(seed, _seed_name(qualified, m, rename)))
                    writes.run(run)
        written = writes.written
    else:
        written = _initialise(layer, name, fresh, tree, where, seed=seed, init=init)
    _refuse_unset(layer, fresh, written, init, where[0])
    return layer.to(device)


class _Fresh:
    """A meta tensor of the layer given memory: its owner (qualified name, module), its table and key there, the
    meta tensor it was and the fresh one."""

    def __init__(self, qualified: str, module: nn.Module, attr: str, key: str, old: torch.Tensor,
                 new: torch.Tensor) -> None:
        self.qualified, self.module, self.attr, self.key, self.old, self.new = qualified, module, attr, key, old, new

    def table(self) -> Dict[str, Optional[torch.Tensor]]:
        table: Dict[str, Optional[torch.Tensor]] = getattr(self.module, self.attr)
        return table


def _allocate(owners: List[Tuple[str, nn.Module, Callable[[], None]]]) -> List[_Fresh]:
    """Memory on the CPU for every meta tensor of ``owners`` (only those: a tensor with values keeps them), marked
    unwritten; a tensor held at several places of the layer stays one."""
    fresh: List[_Fresh] = []
    made: Dict[int, torch.Tensor] = {}
    for qualified, m, _ in owners:
        for attr in ("_parameters", "_buffers"):
            table = getattr(m, attr)
            for key, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    new = torch.empty_like(t, device=_CPU)
                    made[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if attr == "_parameters" else new
                    with torch.no_grad():
                        mark_unwritten(made[id(t)])
                table[key] = made[id(t)]
                fresh.append(_Fresh(qualified, m, attr, key, t, made[id(t)]))
    return fresh


def _initialise(layer: nn.Module, name: str, fresh: List[_Fresh], tree: Optional[nn.Module],
                where: Tuple[Dict[int, List[Place]], Dict[int, List[Place]]], *, seed: int, init: Init) -> Set[Key]:
    """``init`` over ``tree`` (``init_order``) for the fresh tensors it holds, over the layer itself for the others
    (a copy of a layer that several stages use, a layer profiled alone); ``where``: the places of the tensors of
    both, taken before the layer was given memory."""
    in_tree = list({id(f.new): (f.old, f.new) for f in fresh if id(f.old) in where[0]}.values())
    rest = list({id(f.new): (f.old, f.new) for f in fresh if id(f.old) not in where[0]}.values())
    ids = {id(f.new) for f in fresh}
    protected = {storage_key(t) for t in _tensors(layer, recurse=True) if not t.is_meta and id(t) not in ids}
    written: Set[Key] = set()
    replaced: Dict[int, torch.Tensor] = {}
    for root, prefix, found, pairs in ((tree, "", where[0], in_tree), (layer, name, where[1], rest)):
        if root is not None and pairs:
            done, swapped = initialise(root, prefix, found, pairs, init=init, seed_of=lambda n: layer_seed(seed, n),
                                       protected=protected)
            written |= done
            replaced.update(swapped)
    for f in fresh:  # an initialiser that put another tensor in its place: the layer takes that one
        if id(f.new) in replaced:
            f.table()[f.key] = replaced[id(f.new)]
    return written


def _refuse_unset(layer: nn.Module, fresh: List[_Fresh], written: Set[Key], init: Optional[Init],
                  where: Dict[int, List[Place]]) -> None:
    """Refuse, naming the module and the tensors (with their names in the original model, from ``where``, where
    they differ), a layer whose initialisation left a fresh tensor unset; the layer goes back to the meta device."""
    left: Dict[str, Tuple[nn.Module, List[str], List[str]]] = {}
    for f in fresh:
        now = f.table().get(f.key)
        if now is f.new and unwritten(now, storage_key(now) in written):
            _, keys, originals = left.setdefault(f.qualified, (f.module, [], []))
            if f.key not in keys:
                keys.append(f.key)
                original = where[id(f.old)][0][2] if id(f.old) in where else ""
                originals.extend([original] if original and original != f"{f.qualified}.{f.key}" else [])
    if not left:
        return
    layer.to("meta")  # no half-initialised layer stays behind
    qualified, (m, keys, originals) = next(iter(left.items()))
    what = "init(module), for it and every module around it," if init is not None else "its reset_parameters()"
    known = f"; in the original model {', '.join(originals)}" if originals else ""
    raise ValueError(
        f"cannot materialize {qualified} ({type(m).__name__}) from the meta device: {what} left "
        f"{', '.join(keys)} without values ({', '.join(str(getattr(m, k).dtype) for k in keys)}{known}: a tensor "
        "computed in __init__ and never set again, a mask or a table, has no values on the meta device); compute "
        "it in the module's reset_parameters() or in an init= that sets it, or build the model on a real device"
    )


def _seed_name(qualified: str, module: nn.Module, rename: Optional[Callable[[str], str]]) -> str:
    """The name a module is seeded by: its own, or where ``rename`` maps a flattened model's names back, the original
    name of the module owning its tensors (a flattened vision transformer's ``embed.kept``, which holds the model's
    ``cls_token`` and ``pos_embed``, is seeded as the model itself, ``""``). A module whose every parameter is a
    later place of parameters the original model first holds in one other module (T5's ``decoder.embed_tokens``,
    a place of ``shared``) is seeded as that one, as materializing the original model seeds them."""
    if rename is None:
        return qualified
    keys = [key for key, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))]
    first: Dict[str, str] = getattr(rename, "first", {})
    owners = set()
    for key in keys:
        got = first.get(rename(f"{qualified}.{key}" if qualified else key), "")
        owners.add(got[:-len(key) - 1] if got.endswith("." + key) else None)
    if keys and len(owners) == 1 and None not in owners:
        return str(owners.pop())
    for key in keys:
        original = rename(f"{qualified}.{key}" if qualified else key)
        if original == key:
            return ""
        if original.endswith("." + key):
            return original[:-len(key) - 1]
    return rename(qualified)


def initialiser(module: nn.Module, init: Optional[Init]) -> Optional[Callable[[], None]]:
    """What initialises ``module``'s own tensors: ``init(module)`` where given, else its ``reset_parameters()``
    (``_reset_parameters()`` where torch names it so); None where nothing can."""
    if init is not None:
        return lambda: init(module)
    own: Optional[Callable[[], None]] = getattr(module, "reset_parameters", None) or \
        getattr(module, "_reset_parameters", None)
    return own


def _owners(layer: nn.Module, name: str, init: Optional[Init]) -> List[Tuple[str, nn.Module, Callable[[], None]]]:
    """The modules of ``layer`` that own meta tensors, with what initialises each; refuses one that nothing can."""
    out = []
    for qualified, m in layer.named_modules(prefix=name):
        if not any(t.is_meta for t in _tensors(m, recurse=False)):
            continue
        run = initialiser(m, init)
        if run is None:
            raise ValueError(
                f"cannot materialize {qualified} ({type(m).__name__}) from the meta device: it has no "
                "reset_parameters() to initialise its parameters and buffers; give it one, pass init=, or build "
                "the model on a real device"
            )
        out.append((qualified, m, run))
    return out


def check_init(layer: nn.Module, name: str, init: Optional[Init] = None) -> None:
    """Refuse, changing nothing, a layer of which some module owning meta tensors has nothing to initialise it."""
    _owners(layer, name, init)


def materialize(model: nn.Module, device: Union[str, torch.device] = _CPU, *, seed: int = 0,
                init: Optional[Init] = None) -> nn.Module:
    """``model`` (built on the meta device) with memory and initial values on ``device``, in place.

    The same weights an engine gives each of its stages from the same
    ``seed`` (see the module docstring): the plain model for reference, or to
    train on one device (``init`` as in ``materialize_layer``; a flattened model's default is the one its original
    model has, and its modules are seeded by their original names; a transformers model's, its ``_init_weights``).
    A module used at several places is initialised once, and a parameter held at several places (an embedding tied
    to the output head) stays one parameter, with the values of its first place.
    """
    init = init if init is not None else recorded_init(model) or transformers_init(model)
    rename = original_names(model)
    for name, child in model.named_children():  # refused before anything changes
        check_init(child, name, init)
    shared = SharedPlaces(model)
    for name, child in model.named_children():
        materialize_layer(child, name, seed=seed, device=device, init=init, rename=rename)
        shared.join()
    if any(t.is_meta for t in _tensors(model, recurse=False)):
        materialize_layer(model, "", seed=seed, device=device, init=init, rename=rename)
        shared.join()
    return model.to(device)


class SharedPlaces:
    """The places of every meta parameter or buffer held at several places of ``model`` (a tied embedding and head;
    BART's ``final_logits_bias``, which a flattened model keeps in several layers).

    Materializing a place gives it a *new* tensor; ``join`` then gives every
    other place of that tensor the same one, so a tie stays one parameter (what
    finds ties by identity still finds it) and a buffer one buffer, with the
    values of the place materialized first.
    """

    def __init__(self, model: nn.Module) -> None:
        places: Dict[int, List[Tuple[Dict[str, Optional[torch.Tensor]], str]]] = {}
        for module in model.modules():
            for attr in ("_parameters", "_buffers"):
                table: Dict[str, Optional[torch.Tensor]] = getattr(module, attr)
                for key, t in table.items():
                    if t is not None and t.is_meta:
                        places.setdefault(id(t), []).append((table, key))
        self.places = [where for where in places.values() if len(where) > 1]

    def join(self) -> None:
        for where in self.places:
            done = next((table[key] for table, key in where if not _is_meta(table[key])), None)
            if done is not None:
                for table, key in where:
                    table[key] = done


def _is_meta(t: Optional[torch.Tensor]) -> bool:
    return t is None or t.is_meta
