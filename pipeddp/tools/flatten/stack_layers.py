"""The layers of an opened block stack: the model's own code up to its first block, and each block.

``StackInput`` is the first layer. It runs the model's own ``forward`` on the
batch (embeddings, positions, the rotary table, the attention mask: whatever
the model computes before its blocks, decorators and branches included) and
stops it where the model calls its first block, returning what that call was
given (``carry.take``)::

    StackInput(batch) = model.forward(**batch) up to  model.layers[0](h, attention_mask=m, ...)  -> (h, m, ...)

The stop is a forward pre-hook on the first block that raises only in the
thread that armed it (``_ARMED``), so the same block called as a layer of a
stage in another thread runs as usual. It derives from ``BaseException`` so
that a model's ``except Exception`` does not swallow it. The layer owns the
modules the model calls before its first block (and the model's own
parameters such as a ViT's ``cls_token``); the model object itself is held
without being registered, so a stage holds, moves and saves only what it
runs.

``BlockCall`` calls one block as the model called it (``carry.fill``) and
passes the extras on, with those it computes for later blocks (T5's first
block returns the position bias every later block is given) in their places.
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .carry import Template, fill, take

__all__ = ["StackInput", "BlockCall", "install_stop", "split_call", "model_frame", "find_source", "resolve",
           "Source", "hidden_and_last"]

_ARMED = threading.local()


class _Reached(BaseException):
    """The model reached its first block: the call's arguments, the values found where the model holds them for
    later blocks (``sources``), and the end of ``StackInput``'s run."""

    def __init__(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], found: List[Any]) -> None:
        super().__init__()
        self.call = (args, kwargs)
        self.found = found


_SKIP = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def model_frame(depth: int = 1) -> Optional[FrameType]:
    """The frame of the model's code that is calling a module: the first one outside torch and pipeddp, and not a
    ``__call__`` (transformers' checkpointing layers wrap the call in one)."""
    frame: Optional[FrameType] = sys._getframe(depth + 1)
    while frame is not None and (frame.f_code.co_filename.startswith(_SKIP) or frame.f_code.co_name == "__call__"):
        frame = frame.f_back
    return frame


Source = Tuple[Any, ...]


def find_source(scope: Dict[str, Any], target: Any, depth: int = 3) -> Optional[Source]:
    """Where ``target`` sits among a frame's locals: a path of a name, then keys and indices through dicts, lists
    and tuples (``("causal_mask_mapping", "sliding_attention")``); None where it is not held there."""
    def search(value: Any, path: Source, left: int) -> Optional[Source]:
        if value is target:
            return path
        if left == 0:
            return None
        if isinstance(value, dict):
            items: Any = value.items()
        elif isinstance(value, (list, tuple)) and not isinstance(value, torch.Tensor):
            items = enumerate(value)
        else:
            return None
        for key, v in items:
            hit = search(v, path + (key,), left - 1)
            if hit is not None:
                return hit
        return None

    for name, value in scope.items():
        if name != "self":
            hit = search(value, (name,), depth)
            if hit is not None:
                return hit
    return None


#: what ``resolve`` gives where the model's forward no longer holds a value where it did for the sample
MISSING = object()


def resolve(scope: Dict[str, Any], source: Source) -> Any:
    """The value at ``source`` (from ``find_source``) among a frame's locals; ``MISSING`` where there is none."""
    value: Any = scope
    for key in source:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return MISSING
    return value


def _stop_at_first_block(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Forward pre-hook of a stack's first block: ends the model's forward there in a thread that armed it,
    taking along the values later blocks need that the model holds in its forward's locals."""
    if getattr(_ARMED, "block", None) is module:
        sources: List[Source] = getattr(_ARMED, "sources", [])
        frame = model_frame() if sources else None
        scope = dict(frame.f_locals) if frame is not None else {}
        raise _Reached(args, kwargs, [resolve(scope, source) for source in sources])


def install_stop(block: nn.Module) -> None:
    """Put the stop on ``block`` once (flattening the same model twice adds no second hook)."""
    if not any(h is _stop_at_first_block for h in block._forward_pre_hooks.values()):
        block.register_forward_pre_hook(_stop_at_first_block, with_kwargs=True)


def split_call(batch: Any, fixed: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The model's arguments for a batch: a dict is keywords, a tuple or list positional, anything else one input."""
    if isinstance(batch, dict):
        args: Tuple[Any, ...] = ()
        kwargs = dict(batch)
    elif isinstance(batch, (tuple, list)):
        args, kwargs = tuple(batch), {}
    else:
        args, kwargs = (batch,), {}
    for k, v in fixed.items():
        kwargs.setdefault(k, v)
    return args, kwargs


class StackInput(nn.Module):
    """The model's forward up to its first block, as a layer that returns what that block is given.

    ``owned``: the modules the model calls before its first block and those
    it never calls (their state keeps the model's keys), by their path with
    ``_`` for ``.``; ``kept``: the model's own parameters and buffers that sit
    on the modules around the blocks (``cls_token``, ``pos_embed``).
    """

    _model: nn.Module
    _first: nn.Module
    _around: List[nn.Module]
    _kept_owners: List[nn.Module]

    def __init__(self, model: nn.Module, first: nn.Module, first_path: str, around: Sequence[nn.Module],
                 owned: Dict[str, nn.Module], kept: List[Tuple[str, nn.Module, str, bool, bool]],
                 template: Template, count: int, fixed: Dict[str, Any],
                 sources: Optional[Dict[int, Source]] = None, inputs: Optional[List[Source]] = None) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)  # not registered: its blocks and head are other layers'
        object.__setattr__(self, "_first", first)
        object.__setattr__(self, "_around", list(around))
        self.first_path = first_path
        self.owned = nn.ModuleDict(owned)
        self.kept = nn.Module()
        #: (name here, module around the blocks, its attribute, is a parameter, persistent)
        self.kept_from = [(name, attr) for name, _, attr, _, _ in kept]
        object.__setattr__(self, "_kept_owners", [owner for _, owner, _, _, _ in kept])
        for name, owner, attr, is_param, persistent in kept:
            value = getattr(owner, attr)
            if is_param:
                self.kept.register_parameter(name, value)
            else:
                self.kept.register_buffer(name, value, persistent=persistent)
        self.template = template
        self.count = count
        self.fixed = dict(fixed)
        #: extras that later blocks take and the first does not: where the model's forward holds them
        self.sources = dict(sources or {})
        #: the batch's tensors that a head after the last block reads (``head``): passed on after the extras
        self.inputs = list(inputs or [])

    def take_kept(self) -> None:
        """Register again what the modules around the blocks hold now (after a meta model's run: its meta tensors,
        not the values lent to it while it ran)."""
        for (name, attr), owner in zip(self.kept_from, self._kept_owners):
            value = getattr(owner, attr)
            table = self.kept._parameters if name in self.kept._parameters else self.kept._buffers
            table[name] = value

    # mypy: nn.Module.forward is variadic; a stage layer takes its one carried value
    def forward(self, batch: Any) -> Any:  # type: ignore[override]
        for m in self._around:
            m.training = self.training  # the model's forward may read its own flag (dropout, checkpointing)
        for (name, attr), owner in zip(self.kept_from, self._kept_owners):
            if name in self.kept._buffers:  # a buffer moved with this layer (.to) is a new tensor: hand it over
                owner._buffers[attr] = self.kept._buffers[name]
            elif owner._parameters.get(attr) is not self.kept._parameters[name]:
                owner._parameters[attr] = self.kept._parameters[name]  # materialized here from the meta device
        args, kwargs = split_call(batch, self.fixed)
        before = getattr(_ARMED, "block", None), getattr(_ARMED, "sources", [])
        _ARMED.block, _ARMED.sources = self._first, list(self.sources.values())
        try:
            self._model(*args, **kwargs)
        except _Reached as stop:
            call, found = stop.call, dict(zip(self.sources, stop.found))
            lost = [self.sources[i] for i, v in found.items() if v is MISSING]
            if lost:
                raise ValueError(f"{type(self._model).__name__}.forward no longer holds {lost[0]!r} when it calls "
                                 f"{self.first_path} for this batch, as it did for the sample it was flattened "
                                 "with (a later block's value, a mask per layer type): flatten with a sample like "
                                 "this batch") from None
        else:
            raise RuntimeError(f"{type(self._model).__name__}.forward returned without calling {self.first_path} "
                               "for this batch, though it did for the sample it was flattened with")
        finally:
            _ARMED.block, _ARMED.sources = before
        result = take(self.template, call, self.count, found)
        if not self.inputs:
            return result
        read = [resolve({"args": args, "kwargs": kwargs}, source) for source in self.inputs]
        lost = [source for source, v in zip(self.inputs, read) if not isinstance(v, torch.Tensor)]
        if lost:
            raise ValueError(f"this batch has no tensor at {lost[0]!r}, which the head of "
                             f"{type(self._model).__name__} after its last block reads, as it did in the sample it "
                             "was flattened with: pass batches like the sample")
        return (*(result if self.count else (result,)), *read)

    def extra_repr(self) -> str:
        return (f"{type(self._model).__name__}.forward up to {self.first_path}, passing on "
                f"{1 + self.count + len(self.inputs)} value(s)")


class BlockCall(nn.Module):
    """One block of the stack called as the model called it; it passes the carried values on.

    ``pick``: where the block's output holds the hidden state (None: it is
    the output); ``last``: the last block passes the hidden state alone, with
    the last ``keep`` carried values (the inputs a head reads).
    """

    def __init__(self, block: nn.Module, template: Template, count: int, pick: Optional[int], last: bool,
                 makes: Optional[Dict[int, int]] = None, keep: int = 0) -> None:
        super().__init__()
        self.block = block
        self.template = template
        self.count = count
        self.pick = pick
        self.last = last
        #: carried values this block computes for later blocks: extra index -> index in the block's output
        self.makes = dict(makes or {})
        self.keep = keep

    # mypy: nn.Module.forward is variadic; a stage layer takes its one carried value
    def forward(self, carried: Any) -> Any:  # type: ignore[override]
        if self.count:
            hidden, extras = carried[0], tuple(carried[1:])
        else:
            hidden, extras = carried, ()
        args, kwargs = fill(self.template, hidden, extras)
        out = self.block(*args, **kwargs)
        if self.makes:
            made = list(extras)
            for e, k in self.makes.items():
                made[e] = out[k]
            extras = tuple(made)
        if self.pick is not None:
            out = out[self.pick]
        if self.last:
            return (out, *extras[len(extras) - self.keep:]) if self.keep else out
        return (out, *extras) if self.count else out

    def extra_repr(self) -> str:
        return f"carries {self.count} value(s) besides the hidden state" + (", the last" if self.last else "")


def hidden_and_last(carried: Tuple[Any, ...], keep: int) -> Any:
    """What follows one block called at several places: the hidden state, with the last ``keep`` carried values."""
    return (carried[0], *carried[len(carried) - keep:])
