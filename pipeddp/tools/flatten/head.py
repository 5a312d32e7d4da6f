"""A head that is no chain: the steps after the last block replayed as one layer.

Most heads are a chain (``norm``, ``lm_head``) and become layers of their own
(``tail``). A classifier of a causal language model is not: after its last
block it finds each row's last non-padding token from ``input_ids`` and picks
that row's logits::

    logits = score(norm(h))
    last = (arange(T) * (input_ids != pad)).argmax(-1)
    out = logits[arange(batch_size), last]

Nor is BART's, which adds a buffer of the model itself to the logits
(``lm_head(h) + final_logits_bias``). Such a tail becomes a ``TailProgram``:
the recorded steps that the output depends on, replayed in order on the last
block's output, on the model's input tensors that it reads, which the first
layer passes on through every block (``StackInput.inputs``), and on the
model's parameters and buffers that it reads, which the layer holds
(``Kept``). What a step was given is a template: a value of the program
(``Ref``), the batch's size (``BATCH``: an int that was the sample's batch
size, and the size of a smaller sample in a second run), the sequence length
(``LENGTH``: likewise, in a run on the sample one position shorter), the
hidden state's device (``DEVICE``), or a constant. An int that changes
otherwise between the runs is refused; where the length cannot be followed,
an input's sizes that a step took as constants are checked against each
batch (``TailProgram.dims``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from ...runtime.microbatch import tree_map
from .carry import leaves
from .record import Event, NotAStack, Run
from .stack_layers import Source, find_source

__all__ = ["TailProgram", "program_of", "reads_input", "smaller_sample", "shorter_sample", "Ref", "Kept", "BATCH",
           "LENGTH", "DEVICE"]

_VIEWS = {"view", "reshape", "__getitem__", "contiguous", "to", "flatten", "squeeze", "unsqueeze", "expand",
          "type_as", "float", "double"}


class Ref:
    """A value of the program: ``slot`` 0 the hidden state, 1..k the inputs read, then each step's output; ``keys``
    index into a step's output (a module that returns a tuple)."""

    def __init__(self, slot: int, keys: Tuple[Any, ...] = ()) -> None:
        self.slot, self.keys = slot, keys

    def __repr__(self) -> str:
        return f"v{self.slot}" + "".join(f"[{k!r}]" for k in self.keys)


class _Marker:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


BATCH = _Marker("batch_size")
LENGTH = _Marker("length")
DEVICE = _Marker("hidden.device")


class Kept:
    """A parameter or buffer of the model that a step reads directly (BART's ``final_logits_bias``), held by the
    program under ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"self.kept.{self.name}"


def _fill(value: Any, values: List[Any], env: Dict[str, Any], kept: nn.Module) -> Any:
    """``value`` with the program's values, the markers' (``env``, by text) and the held state in place."""
    if isinstance(value, Ref):
        out = values[value.slot]
        for k in value.keys:
            out = out[k]
        return out
    if isinstance(value, Kept):
        return getattr(kept, value.name)
    if isinstance(value, _Marker):
        return env[value.text]
    if isinstance(value, (tuple, list)):
        return type(value)([_fill(v, values, env, kept) for v in value])
    if isinstance(value, dict):
        return {k: _fill(v, values, env, kept) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(*(_fill(v, values, env, kept) for v in (value.start, value.stop, value.step)))
    return value


class TailProgram(nn.Module):
    """The steps after the last block that compute the output, replayed on ``(hidden, *inputs read)``.

    ``mods``: the model's modules among the steps (by path, ``_`` for ``.``);
    ``steps``: ``(module key or function, args, kwargs)`` templates;
    ``length``: the input whose second dimension is the sequence length
    (``LENGTH``; None where no step takes it); ``dims``: ``(input, first
    dimension, sizes)``, the sample's sizes of the inputs' other dimensions
    that some step was given as a constant (a batch of other sizes there is
    refused, not computed with the sample's).
    """

    _kept_from: List[Tuple[str, nn.Module, str]]

    def __init__(self, mods: Dict[str, nn.Module], steps: List[Tuple[Any, Any, Any]], result: Ref,
                 inputs: int, dims: List[Tuple[int, int, Tuple[int, ...]]],
                 kept: Optional[Dict[str, Tuple[torch.Tensor, bool]]] = None, length: Optional[int] = None,
                 owners: Optional[Dict[str, Tuple[nn.Module, str]]] = None) -> None:
        super().__init__()
        self.mods = nn.ModuleDict(mods)
        #: the model's own parameters and buffers that a step reads (by name here; ``(tensor, persistent)``)
        self.kept = nn.Module()
        for name, (t, persistent) in (kept or {}).items():
            if isinstance(t, nn.Parameter):
                self.kept.register_parameter(name, t)
            else:
                self.kept.register_buffer(name, t, persistent=persistent)
        #: where the model holds each of them: (name here, its module, its attribute); not registered
        object.__setattr__(self, "_kept_from", [(n, m, attr) for n, (m, attr) in (owners or {}).items()])
        self.steps = steps
        self.result = result
        self.inputs = inputs
        self.dims = dims
        self.length = length

    def take_kept(self) -> None:
        """Register again what the model holds now at the places it reads (after a meta model's run: its meta
        tensors, not the values lent to it while it ran, which would be a second tensor under one key)."""
        for name, owner, attr in self._kept_from:
            table = self.kept._parameters if name in self.kept._parameters else self.kept._buffers
            table[name] = getattr(owner, attr)

    # mypy: nn.Module.forward is variadic; a stage layer takes its one carried value
    def forward(self, carried: Any) -> Any:  # type: ignore[override]
        values: List[Any] = [carried[0], *carried[1:]] if self.inputs else [carried]
        for slot, first, dims in self.dims:
            if tuple(values[slot].shape[first:]) != dims:
                raise ValueError(f"the head after the last block was recorded for an input of shape "
                                 f"{tuple(values[slot].shape[:first])} + {dims} and computes with those sizes; this "
                                 f"batch's is {tuple(values[slot].shape)}: flatten with a sample shaped like the "
                                 "batches (or pad every batch to the sample's length)")
        hidden = values[0]
        env = {BATCH.text: values[1].shape[0] if self.inputs else hidden.shape[0], DEVICE.text: hidden.device,
               LENGTH.text: values[self.length].shape[1] if self.length is not None else None}
        for what, args, kwargs in self.steps:
            fn = self.mods[what] if isinstance(what, str) else what
            values.append(fn(*_fill(args, values, env, self.kept), **_fill(kwargs, values, env, self.kept)))
        return _fill(self.result, values, env, self.kept)

    def extra_repr(self) -> str:
        names = [w if isinstance(w, str) else getattr(w, "__name__", str(w)) for w, _, _ in self.steps]
        return f"{len(self.steps)} steps ({', '.join(names)}) on the hidden state and {self.inputs} input(s)"


def _tensor_paths(value: Any, keys: Tuple[Any, ...] = ()) -> List[Tuple[Tuple[Any, ...], torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(keys, value)]
    if isinstance(value, (tuple, list)):
        return [x for i, v in enumerate(value) for x in _tensor_paths(v, keys + (i,))]
    if isinstance(value, dict):
        return [x for k, v in value.items() for x in _tensor_paths(v, keys + (k,))]
    return []


class _Builder:
    """Turns the recorded steps (two runs: the sample, and its first rows) into a program's templates."""

    def __init__(self, model: nn.Module, start: torch.Tensor, variations: List[Tuple[Tuple[int, int], _Marker]],
                 scope: Dict[str, Any]) -> None:
        self.where: Dict[int, Any] = {id(start): Ref(0)}
        #: the model's parameters and buffers by tensor: (key in the model, persistent, module, attribute)
        self.state: Dict[int, Tuple[str, torch.Tensor, bool, nn.Module, str]] = {}
        for path, m in model.named_modules():
            for attr, t in list(m._parameters.items()) + list(m._buffers.items()):
                if t is not None:
                    key = f"{path}.{attr}" if path else attr
                    self.state.setdefault(id(t), (key, t, attr not in m._non_persistent_buffers_set, m, attr))
        #: what the program holds of them: name here -> (tensor, persistent), the original keys, and the owners
        self.kept: Dict[str, Tuple[torch.Tensor, bool]] = {}
        self.kept_keys: Dict[str, str] = {}
        self.owners: Dict[str, Tuple[nn.Module, str]] = {}
        #: per other run: (the sizes in the sample's run and in that one, the marker of an int that moves so)
        self.variations = variations
        self.device = start.device
        self.scope = scope
        self.inputs: List[Tuple[Source, torch.Tensor]] = []
        #: the constant ints the steps are given (an input's other dimension among them is checked per batch)
        self.ints: Set[int] = set()

    def ref(self, t: torch.Tensor, at: str) -> Any:
        found = self.where.get(id(t))
        if found is not None:
            return found
        if id(t) in self.state:  # the model's own state, read by a step (a bias added to the logits)
            key, tensor, persistent, owner, attr = self.state[id(t)]
            name = key.replace(".", "_")
            self.kept[name], self.kept_keys[f"kept.{name}"] = (tensor, persistent), key
            self.owners[name] = (owner, attr)
            self.where[id(t)] = Kept(name)
            return self.where[id(t)]
        source = find_source(self.scope, t)
        if source is None:
            raise NotAStack(f"{at} after the last block takes a tensor that is neither the last block's output, nor "
                            "the model's input or state, nor computed from them by the steps after the last block")
        self.inputs.append((source, t))
        self.where[id(t)] = Ref(len(self.inputs))  # renumbered with the steps once all inputs are known
        return self.where[id(t)]

    def mark(self, vals: List[Any], at: str) -> Any:
        """The template of what a step was given: ``vals[0]`` in the sample's run, ``vals[i]`` in the ``i``-th
        variation's."""
        v1, others = vals[0], vals[1:]
        if isinstance(v1, torch.Tensor):
            return self.ref(v1, at)
        if isinstance(v1, bool) or v1 is None:
            return v1
        if isinstance(v1, int):
            moved = [i for i, v in enumerate(others) if isinstance(v, int) and not isinstance(v, bool) and v != v1]
            if not moved:
                self.ints.add(v1)
                return v1
            if len(moved) == 1 and (v1, others[moved[0]]) == self.variations[moved[0]][0]:
                return self.variations[moved[0]][1]
            raise NotAStack(f"{at} after the last block is given {v1} for the sample and "
                            f"{', '.join(str(v) for v in others)} for a smaller one: an int the head computes from "
                            "its input other than the batch size or the sequence length")
        if isinstance(v1, torch.device) and v1 == self.device:
            return DEVICE
        if isinstance(v1, (tuple, list)):
            if any(not isinstance(v, (tuple, list)) or len(v) != len(v1) for v in others):
                raise NotAStack(f"{at} after the last block is given {type(v1).__name__}s of other lengths for the "
                                "sample and a smaller one")
            marked = [self.mark(list(column), at) for column in zip(v1, *others)]
            if isinstance(v1, torch.Size):  # a shape: a tuple where it holds a size that follows the batch's
                return tuple(marked) if any(isinstance(m, _Marker) for m in marked) else v1
            return type(v1)(marked)
        if isinstance(v1, dict):
            if any(not isinstance(v, dict) or set(v) != set(v1) for v in others):
                raise NotAStack(f"{at} after the last block is given other keys for the sample and a smaller one")
            return {k: self.mark([v1[k]] + [v[k] for v in others], at) for k in v1}
        if isinstance(v1, slice):
            if any(not isinstance(v, slice) for v in others):
                raise NotAStack(f"{at} after the last block is given a slice only for the sample")
            parts = [[getattr(v, f) for v in vals] for f in ("start", "stop", "step")]
            return slice(*(self.mark(part, at) for part in parts))
        return v1


def _needed(tail: List[Event], final: Any) -> List[int]:
    """The positions of the recorded steps that the output depends on, in order."""
    want = {id(final)}
    keep: List[int] = []
    for pos in range(len(tail) - 1, -1, -1):
        event = tail[pos]
        if any(id(t) in want for _, t in _tensor_paths(event.out)):
            keep.append(pos)
            want.update(id(v) for _, v in leaves(list(event.args), "") + leaves(dict(event.kwargs), "")
                        if isinstance(v, torch.Tensor))
    return keep[::-1]


def program_of(model: nn.Module, run: Run, others: List[Tuple[Run, Tuple[int, int], _Marker]], start: torch.Tensor,
               final: Any, scope: Dict[str, Any]) -> Tuple[TailProgram, List[Source], Dict[str, str]]:
    """The tail of ``run`` as a ``TailProgram``; the places of the inputs it reads in the model's call (``scope``:
    ``{"args": ..., "kwargs": ...}``) and ``{suffix: original prefix}`` of its modules and of the model's state it
    holds.

    ``others``: the same model recorded on smaller samples, each with the
    sizes that differ from the sample's (the batch size, the sequence length)
    and the marker an int that moves so becomes; any other int is a constant.
    """
    name = type(model).__name__
    for other, _, _ in others:
        if len(other.tail) != len(run.tail) or any(a.path != b.path for a, b in zip(run.tail, other.tail)):
            raise NotAStack(f"{name}.forward takes other steps after its last block for a smaller sample")
    if not isinstance(final, torch.Tensor):
        raise NotAStack(f"the output of {name} is not a tensor computed after its last block")
    build = _Builder(model, start, [(sizes, marker) for _, sizes, marker in others], scope)
    mods: Dict[str, nn.Module] = {}
    origins: Dict[str, str] = {}
    raw: List[Tuple[Any, Any, Any, Event]] = []
    for pos in _needed(run.tail, final):
        event = run.tail[pos]
        at = f"{event.path} ({event.where})"
        if "dropout" in event.path and not isinstance(event.what, nn.Module):
            raise NotAStack(f"{at} after the last block: functional dropout there would keep the sample run's "
                            "training flag; use an nn.Dropout module")
        args = build.mark([tuple(event.args)] + [tuple(o.tail[pos].args) for o, _, _ in others], at)
        kwargs = build.mark([dict(event.kwargs)] + [dict(o.tail[pos].kwargs) for o, _, _ in others], at)
        tensors = [t for _, t in leaves(list(event.args), "") if isinstance(t, torch.Tensor)]
        out = event.out
        if event.path in _VIEWS and len(tensors) == 1 and isinstance(out, torch.Tensor) and \
                out.shape == tensors[0].shape and out.dtype == tensors[0].dtype and torch.equal(out, tensors[0]):
            build.where[id(out)] = build.where[id(tensors[0])]  # a reshape that leaves the value as it is
            continue
        if isinstance(event.what, nn.Module):
            key = event.path.replace(".", "_")
            mods[key] = event.what
            origins[f"mods.{key}"] = event.path
            what: Any = key
        else:
            what = event.what
        raw.append((what, args, kwargs, event))
        for keys, t in _tensor_paths(out):
            build.where.setdefault(id(t), Ref(-len(raw), keys))  # a step's output; numbered below
    if id(final) not in build.where:
        raise NotAStack(f"the output of {name} is not computed after its last block")
    k = len(build.inputs)

    def number(value: Any) -> Any:
        if isinstance(value, Ref):
            return Ref(k + (-value.slot), value.keys) if value.slot < 0 else value
        if isinstance(value, torch.Size):
            return value
        if isinstance(value, (tuple, list)):
            return type(value)(number(v) for v in value)
        if isinstance(value, dict):
            return {key: number(v) for key, v in value.items()}
        if isinstance(value, slice):
            return slice(number(value.start), number(value.stop), number(value.step))
        return value

    steps = [(what, number(args), number(kwargs)) for what, args, kwargs, _ in raw]
    varied = {marker.text: sizes[0] for _, sizes, marker in others}
    length = next((i + 1 for i, (_, t) in enumerate(build.inputs)
                   if LENGTH.text in varied and t.dim() > 1 and t.shape[1] == varied[LENGTH.text]), None)
    dims = []
    for i, (_, t) in enumerate(build.inputs):
        # the sizes a step may have taken as constants: after the batch's, and after the length where it is followed
        first = 2 if length is not None and t.dim() > 1 and t.shape[1] == varied[LENGTH.text] else 1
        if set(t.shape[first:]) & build.ints:
            dims.append((i + 1, first, tuple(t.shape[first:])))
    program = TailProgram(mods, steps, number(build.where[id(final)]), k, dims, build.kept, length, build.owners)
    return program, [source for source, _ in build.inputs], {**origins, **build.kept_keys}


def reads_input(run: Run) -> bool:
    """Whether a step after the last block takes a value computed from the model's input."""
    return any(id(v) in run.from_input for e in run.tail
               for _, v in leaves(list(e.args), "") + leaves(dict(e.kwargs), ""))


def smaller_sample(sample: Any, rows: int) -> Any:
    """The sample's first ``rows`` rows (every tensor cut along dim 0)."""
    return tree_map(lambda t: t[:rows], sample)


def shorter_sample(sample: Any, length: int) -> Any:
    """The sample with every tensor whose second dimension is ``length`` cut to ``length - 1`` there (the token
    inputs and their mask)."""
    return tree_map(lambda t: t[:, :length - 1] if t.dim() > 1 and t.shape[1] == length else t, sample)
