"""One run of a block-stack model on the sample, recorded: what each block is given and returns, and what the
model computes after its last block.

``Run`` is a ``TorchFunctionMode`` plus forward hooks on every module: the
block calls are numbered in the order they come (a block shared by several
places is called several times), the modules called before the first block
are listed, and after the last block every module call and torch function at
the top level of the forward is an ``Event`` (the tail's steps). What the
model computes from its own input after the last block is marked too: a head
that reads the input is replayed as one layer (``head``).
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .carry import leaves
from .stack_layers import model_frame, split_call

__all__ = ["NotAStack", "Event", "Run", "record", "count_calls", "call_model", "fixed_args", "caller"]

_SKIP = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


class NotAStack(Exception):
    """A model with a block stack that cannot be opened; the message names the construct and where it is."""


def fixed_args(model: nn.Module) -> Dict[str, Any]:
    """Arguments always passed: no key-value cache in training (``use_cache=False``), where the forward takes it."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def call_model(model: nn.Module, sample: Any) -> Any:
    """``model`` called on a sample as its ``StackInput`` calls it (a dict as keywords, a tuple as arguments)."""
    args, kwargs = split_call(sample, fixed_args(model))
    return model(*args, **kwargs)


def caller() -> str:
    """``file:line in function`` of the model's code that made the current call (outside torch and pipeddp)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_SKIP) or frame.f_code.co_name == "__call__"):
        # mypy: the loop stops at a None frame; mypy does not narrow the reassignment
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class Event:
    """A module call or a torch function at the top level of the model's forward, after its last block."""

    def __init__(self, what: Any, path: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], where: str) -> None:
        self.what, self.path, self.args, self.kwargs, self.where = what, path, args, kwargs, where
        self.out: Any = None


class Run(TorchFunctionMode):
    """One run of the model on the sample, recorded by module hooks and a torch function mode."""

    def __init__(self, model: nn.Module, blocks: List[nn.Module], around: Set[int], total: int) -> None:
        super().__init__()
        #: each module's first name (a module at several places, T5's shared embedding, goes by the name the model's
        #: own ``named_modules`` gives it, which is also what it is seeded by when the whole model is materialized)
        self.paths: Dict[int, str] = {}
        for p, m in model.named_modules(remove_duplicate=False):
            self.paths.setdefault(id(m), p)
        self.index = {id(b): i for i, b in enumerate(blocks)}
        #: how many block calls the forward makes (more than the blocks where one block is called several times)
        self.total = total
        self._block_calls: List[Optional[int]] = []
        self.around = around
        self.phase = "before"
        self.stack: List[nn.Module] = []
        self.before: List[str] = []
        self.calls: Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any], str]] = {}
        self.order: List[int] = []
        self.outs: Dict[int, Any] = {}
        self.between: List[str] = []
        self.tail: List[Event] = []
        self._open: List[Optional[Event]] = []
        #: the locals of the model's code where it calls the first block (where later blocks' values may wait)
        self.first_scope: Dict[str, Any] = {}
        #: the model's input tensors, and what the steps after the last block compute from them
        self.from_input: Set[int] = set()

    def _top(self) -> bool:
        return all(id(m) in self.around for m in self.stack)

    def pre(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        event = None
        call: Optional[int] = None
        if id(module) in self.index and self._top():
            call = len(self.order)  # the block calls are numbered in the order they come
            self.calls[call] = (args, kwargs, caller())
            self.order.append(self.index[id(module)])
            self.phase = "blocks"
            if call == 0:
                frame = model_frame()
                self.first_scope = dict(frame.f_locals) if frame is not None else {}
        elif self._top() and id(module) not in self.around:
            path = self.paths[id(module)]
            if self.phase == "before":
                self.before.append(path)
            elif self.phase == "blocks":
                self.between.append(f"{path} ({caller()})")
            else:
                event = Event(module, path, args, kwargs, caller())
                self.tail.append(event)
        self.stack.append(module)
        self._open.append(event)
        self._block_calls.append(call)

    def post(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        self.stack.pop()
        event = self._open.pop()
        if event is not None:
            event.out = out
        call = self._block_calls.pop()
        if call is not None:
            self.outs[call] = out
            if call == self.total - 1:
                self.phase = "after"

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.phase != "after" or not self._top():
            return out
        given = {id(v) for _, v in leaves(list(args), "") + leaves(dict(kwargs or {}), "")}
        if given & self.from_input:  # computed from the model's input after the last block (a head's pooling)
            self.from_input.update(id(v) for _, v in leaves(out, "") if isinstance(v, torch.Tensor))
        if any(isinstance(v, torch.Tensor) and id(v) not in given for _, v in leaves(out, "")):  # not x.to(x.device)
            event = Event(func, getattr(func, "__name__", str(func)), tuple(args), dict(kwargs or {}), caller())
            event.out = out
            self.tail.append(event)
        return out


def count_calls(model: nn.Module, blocks: List[nn.Module], sample: Any) -> int:
    """How many times the model's forward calls its blocks on ``sample`` (a block shared by several places counts
    each call)."""
    count = [0]
    ids = {id(b) for b in blocks}
    depth = [0]

    def pre(module: nn.Module, args: Any) -> None:
        if id(module) in ids:
            count[0] += depth[0] == 0
            depth[0] += 1

    def post(module: nn.Module, args: Any, out: Any) -> None:
        if id(module) in ids:
            depth[0] -= 1

    hooks = [h for b in {id(b): b for b in blocks}.values()
             for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post, always_call=True))]
    try:
        call_model(model, sample)
    finally:
        for h in hooks:
            h.remove()
    return count[0]


def record(model: nn.Module, blocks: List[nn.Module], around: Set[int], sample: Any,
            total: int) -> Tuple[Run, Any]:
    run = Run(model, blocks, around, total)
    run.from_input = {id(v) for _, v in leaves(sample, "") if isinstance(v, torch.Tensor)}
    hooks = []
    for m in {id(m): m for m in model.modules()}.values():
        hooks.append(m.register_forward_pre_hook(run.pre, with_kwargs=True))
        hooks.append(m.register_forward_hook(run.post, with_kwargs=True))
    try:
        with run:
            out = call_model(model, sample)
    finally:
        for h in hooks:
            h.remove()
    return run, out
