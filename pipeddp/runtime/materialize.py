"""Models built on the meta device: each process allocates only the layers it holds, the same weights in every layout.

A model too big for one process is built under ``torch.device("meta")``: its
parameters have shapes and dtypes but no memory. An engine cuts it like any
model and each process materializes only its own stages: ``to_empty`` on the
CPU, each module's own initialisation, then its device::

    model = build()  under torch.device("meta")       no memory
    rank 0: stage 0 -> to_empty, init, .to(cuda:0)     only its layers
    rank 1: stage 1 -> to_empty, init, .to(cuda:1)

Random initialisation under a pipeline would otherwise depend on the layout
(which layers a process builds, in which order, drawing from which
generator). So every module that owns parameters or buffers is initialised
from a generator seeded by ``(seed, its name in the model)``: 2 stages, 4
stages, any replica count, and ``materialize(model, seed=s)`` (the plain model
on one device, for reference or single-device runs) start from the same
weights, and a restarted job with another layout starts the same too. The
initialisation is the module's ``reset_parameters()`` (``_reset_parameters()``
where torch names it so, as ``nn.MultiheadAttention`` does), on the CPU, so
the values do not depend on the device either.

Limits: a buffer that a module computes in ``__init__`` and never in
``reset_parameters`` (a rotary embedding's frequencies, say) has no values on
the meta device to restore; such a module (found by filling fresh memory with
NaN before the initialisation and looking for any left), and one that owns
parameters but has no ``reset_parameters``, is refused by name. Pass an
``init=`` that sets them (a Hugging Face model's ``_init_weights`` does, and
``flatten_sequential`` records it), or build those on a real device.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from .names import Names, recorded

__all__ = ["materialize", "materialize_layer", "check_init", "is_meta", "layer_seed", "SharedPlaces", "Init",
           "initialiser", "record_init", "recorded_init", "original_names", "record_first_names"]

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
    parameter that model holds at several places, each to its first (``record_first_names``)."""

    def __init__(self, names: Callable[[str], str], first: Dict[str, str]) -> None:
        self.names, self.first = names, first

    def __call__(self, key: str) -> str:
        return self.names(key)


def original_names(model: nn.Module) -> Callable[[str], str]:
    """A key of ``model`` to its name in the model it was flattened from (the name its seed comes from)."""
    return _Original(Names(recorded(model)).original, dict(getattr(model, _FIRST_ATTR, {})))


def materialize_layer(layer: nn.Module, name: str, *, seed: int, device: Union[str, torch.device] = _CPU,
                      init: Optional[Init] = None, rename: Optional[Callable[[str], str]] = None) -> nn.Module:
    """Give every meta tensor of ``layer`` (the model's module called ``name``) memory and its initial values.

    Each module that owns meta tensors is initialised from ``layer_seed(seed, its qualified name)`` (the name
    ``rename`` gives it: a flattened model's layers are seeded by their names in the original model), by
    ``init(module)`` where given (a Hugging Face model's ``_init_weights``, say), else by its own
    ``reset_parameters()``; the layer is then moved to ``device``. Returns ``layer`` (changed in place).
    """
    owners = _owners(layer, name, init)  # every module checked before any is changed
    for _, m, _ in owners:  # memory first: an initialisation may touch a child's tensors too
        m.to_empty(device=_CPU, recurse=False)
        with torch.no_grad():
            for t in _tensors(m, recurse=False):
                _mark_unwritten(t)
    for qualified, m, run in owners:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(seed, _seed_name(qualified, m, rename)))
            with torch.no_grad():
                run()
    for qualified, m, _ in owners:
        left = [key for key, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
                if _unwritten(t)]
        if left:
            layer.to("meta")  # no half-initialised layer stays behind
            what = "init(module)" if init is not None else "its reset_parameters()"
            raise ValueError(
                f"cannot materialize {qualified} ({type(m).__name__}) from the meta device: {what} left "
                f"{', '.join(left)} without values (a tensor computed in __init__ and never set again); "
                "pass an init= that sets it, or build the model on a real device"
            )
    return layer.to(device)


#: integer types whose least value no initialisation writes (index buffers: positions, token types); 8-bit and
#: unsigned types, like bool, may hold any value and are not checked
_WIDE_INTS = (torch.int16, torch.int32, torch.int64)


def _mark_unwritten(t: torch.Tensor) -> None:
    """Fill freshly allocated memory with a value no initialisation writes (NaN; a wide integer type's least
    value), so that a tensor the initialisation never sets is found instead of training from whatever the memory
    held."""
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype in _WIDE_INTS:
        t.fill_(torch.iinfo(t.dtype).min)


def _unwritten(t: torch.Tensor) -> bool:
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return t.dtype in _WIDE_INTS and bool((t == torch.iinfo(t.dtype).min).any())


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
    model has, and its modules are seeded by their original names). A module used at several places is initialised
    once, and a parameter held at several places (an embedding tied to the output head) stays one parameter, with
    the values of its first place.
    """
    init = init if init is not None else recorded_init(model)
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
    """The places of every meta parameter held at several places of ``model`` (a tied embedding and head).

    ``to_empty`` gives the place it materializes a *new* parameter; ``join``
    then gives every other place of that parameter the same one, so a tie stays
    one parameter (what finds ties by identity still finds it), with the values
    of the place materialized first.
    """

    def __init__(self, model: nn.Module) -> None:
        places: Dict[int, List[Tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for pname, p in module.named_parameters(recurse=False):
                if p.is_meta:
                    places.setdefault(id(p), []).append((module, pname))
        self.places = [where for where in places.values() if len(where) > 1]

    def join(self) -> None:
        for where in self.places:
            done = next((getattr(m, n) for m, n in where if not getattr(m, n).is_meta), None)
            if done is not None:
                for m, n in where:
                    if getattr(m, n) is not done:
                        setattr(m, n, done)
