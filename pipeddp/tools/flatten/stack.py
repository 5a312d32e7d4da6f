"""The block-stack family: transformers' language models and encoders, timm's vision transformers.

Such a model is an input part, a stack of identical blocks (an
``nn.ModuleList`` or ``nn.Sequential`` of one class: GPT-2's
``transformer.h``, Llama's ``model.layers``, BERT's ``encoder.layer``, a
ViT's ``blocks``) and an output part. ``torch.fx`` cannot read their forwards
(decorators, ``**kwargs``, masks built with branches on the data), so they
are read by running the model once on the sample with hooks:

* every block's call: what it was given (the hidden state, and the mask,
  ``(cos, sin)``, positions computed once before the first block) and what it
  returned; the next block must be called on that output;
* the modules called before the first block (they go to the first layer, a
  ``StackInput`` that runs the model's own forward up to its first block);
* the modules and the torch functions (through a ``TorchFunctionMode``) that
  compute the output from the last block's output: they become layers of their
  own (``model_norm``, ``lm_head``; ``x[:, 0]`` as a ``Functional``), the model's
  modules themselves. Reshapes that leave the sample as it is (GPT-2's
  ``view(output_shape)``, ``hidden[:, slice(0, None)]``) are left out.

The output is the model's ``logits`` (or, for a model without a head,
``last_hidden_state``; a tensor is taken as it is).
"""

from __future__ import annotations

import inspect
import operator
import os
import sys
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..functional import INPUT, Functional
from .carry import HIDDEN, leaves, template_of
from .stack_layers import BlockCall, Source, StackInput, find_source, install_stop, model_frame, split_call

__all__ = ["NotAStack", "find_stack", "stack_layers", "model_output", "call_model"]

_VIEWS = {"view", "reshape", "__getitem__", "contiguous", "to", "flatten", "squeeze", "unsqueeze", "expand",
          "type_as", "float", "double"}
_SKIP = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


class NotAStack(Exception):
    """A model with a block stack that cannot be opened; the message names the construct and where it is."""


def find_stack(model: nn.Module) -> Optional[Tuple[str, nn.Module]]:
    """The model's repeated blocks: the ``ModuleList``/``Sequential`` of >= 2 blocks of one class with most weights;
    else one of a single block with most weights, which the forward may call several times (ALBERT's one layer
    group, shared by all its blocks; ``stack_layers`` counts the calls)."""
    best: Optional[Tuple[str, nn.Module, int]] = None
    single: Optional[Tuple[str, nn.Module, int]] = None
    for path, m in model.named_modules():
        if type(m) not in (nn.ModuleList, nn.Sequential) or len(m) < 1:
            continue
        kinds = {type(c) for c in m}
        if len(kinds) != 1 or next(iter(kinds)) in (nn.ModuleList, nn.Sequential):
            continue
        size = sum(p.numel() for p in m.parameters())
        if len(m) >= 2 and size and (best is None or size > best[2]):
            best = (path, m, size)
        if len(m) == 1 and size and (single is None or size > single[2]):
            single = (path, m, size)
    found = best or single
    return None if found is None else (found[0], found[1])


def model_output(out: Any) -> Any:
    """What the flat model computes of the model's output: its ``logits``, else ``last_hidden_state``, else itself."""
    if isinstance(out, dict):
        for key in ("logits", "last_hidden_state"):
            if isinstance(out.get(key), torch.Tensor):
                return out[key]
        return next((v for v in out.values() if isinstance(v, torch.Tensor)), out)
    return out


def _fixed(model: nn.Module) -> Dict[str, Any]:
    """Arguments always passed: no key-value cache in training (``use_cache=False``), where the forward takes it."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def call_model(model: nn.Module, sample: Any) -> Any:
    """``model`` called on a sample as its ``StackInput`` calls it (a dict as keywords, a tuple as arguments)."""
    args, kwargs = split_call(sample, _fixed(model))
    return model(*args, **kwargs)


def _caller() -> str:
    """``file:line in function`` of the model's code that made the current call (outside torch and pipeddp)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_SKIP) or frame.f_code.co_name == "__call__"):
        # mypy: the loop stops at a None frame; mypy does not narrow the reassignment
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


class _Event:
    """A module call or a torch function at the top level of the model's forward, after its last block."""

    def __init__(self, what: Any, path: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], where: str) -> None:
        self.what, self.path, self.args, self.kwargs, self.where = what, path, args, kwargs, where
        self.out: Any = None


class _Run(TorchFunctionMode):
    """One run of the model on the sample, recorded by module hooks and a torch function mode."""

    def __init__(self, model: nn.Module, blocks: List[nn.Module], around: Set[int], total: int) -> None:
        super().__init__()
        self.paths = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
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
        self.tail: List[_Event] = []
        self._open: List[Optional[_Event]] = []
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
            self.calls[call] = (args, kwargs, _caller())
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
                self.between.append(f"{path} ({_caller()})")
            else:
                event = _Event(module, path, args, kwargs, _caller())
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
            event = _Event(func, getattr(func, "__name__", str(func)), tuple(args), dict(kwargs or {}), _caller())
            event.out = out
            self.tail.append(event)
        return out


def _count_calls(model: nn.Module, blocks: List[nn.Module], sample: Any) -> int:
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


def _record(model: nn.Module, blocks: List[nn.Module], around: Set[int], sample: Any,
            total: int) -> Tuple[_Run, Any]:
    run = _Run(model, blocks, around, total)
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


def _hidden_place(call: Tuple[Tuple[Any, ...], Dict[str, Any]], hidden: Any) -> Optional[str]:
    for where, leaf in leaves(list(call[0]), "args") + leaves(dict(call[1]), "kwargs"):
        if leaf is hidden:
            return where
    return None


def _pick(out: Any, nxt: Any) -> Optional[int]:
    """Where a block's output holds the next block's hidden state (None: the output itself); -1: nowhere."""
    if out is nxt:
        return None
    if isinstance(out, (tuple, list)):
        for k, v in enumerate(out):
            if v is nxt:
                return k
    return -1


def _blocks(run: _Run, path: str, count: int, name: str) -> Tuple[List[Tuple[Tuple[Any, ...], Dict[str, Any]]],
                                                                  List[Any], Dict[int, int], Optional[int],
                                                                  Dict[int, Source], Dict[int, Tuple[int, int]]]:
    """Check the blocks were called one after another on each other's output (``count`` calls: each block once in
    order, or one block ``count`` times); the templates' inputs, and where the model holds the extras that only
    later blocks take (by extra index)."""
    shared = len(run.index) == 1
    if run.order != ([0] * count if shared else list(range(count))):
        raise NotAStack(f"{name}.forward calls the blocks of {path} in the order {run.order}, not each once in "
                        "order")
    if run.between:
        raise NotAStack(f"{name}.forward calls {', '.join(run.between[:2])} between the blocks of {path}")
    args0, kwargs0, _ = run.calls[0]
    firsts = [v for _, v in leaves(list(args0), "args") + leaves(dict(kwargs0), "kwargs")
              if isinstance(v, torch.Tensor)]
    if not firsts:
        raise NotAStack(f"{path}.0 is called with no tensor ({run.calls[0][2]})")
    hidden = firsts[0]
    place = _hidden_place((args0, kwargs0), hidden)
    extras: Dict[int, int] = {}
    sources: Dict[int, Source] = {}
    produced: Dict[int, Tuple[int, int]] = {}  # extra index -> (block call, index in its output)
    for t in firsts[1:]:
        if t is not hidden:
            extras.setdefault(id(t), len(extras))
    pick: Optional[int] = None
    hiddens = [hidden]
    for i in range(1, count):
        args, kwargs, where = run.calls[i]
        candidates = [run.outs[i - 1]] + (list(run.outs[i - 1]) if isinstance(run.outs[i - 1], (tuple, list)) else [])
        got = next((c for c in candidates if isinstance(c, torch.Tensor) and _hidden_place((args, kwargs), c)), None)
        if got is None or _hidden_place((args, kwargs), got) != place:
            raise NotAStack(f"{path}.{i} is not called on the output of {path}.{i - 1} at {place} ({where}): the model "
                            "does more between its blocks than pass the hidden state on")
        pick = _pick(run.outs[i - 1], got)
        hiddens.append(got)
        for at, leaf in leaves(list(args), "args") + leaves(dict(kwargs), "kwargs"):
            if isinstance(leaf, torch.Tensor) and leaf is not got and id(leaf) not in extras:
                source = find_source(run.first_scope, leaf)
                made = _made_by(run, leaf, i)
                if source is None and made is None:
                    raise NotAStack(f"{path}.{i} is given a tensor at {at} ({where}) that the model neither gave its "
                                    "first block nor held when it called it, and no earlier block returned: each "
                                    "block may take only the previous block's output, what the model computed for "
                                    "all of them before the first, and what an earlier block returned")
                index = extras.setdefault(id(leaf), len(extras))
                if source is not None:
                    sources[index] = source
                else:
                    assert made is not None
                    produced[index] = made
    calls = [(run.calls[i][0], run.calls[i][1]) for i in range(count)]
    return calls, hiddens, extras, pick, sources, produced


def _made_by(run: _Run, leaf: torch.Tensor, before: int) -> Optional[Tuple[int, int]]:
    """``(block call, index in its output)`` of the earliest block before ``before`` that returned ``leaf`` beside
    its hidden state (T5's first block computes the position bias that every later block is given)."""
    for j in range(before):
        out = run.outs[j]
        if isinstance(out, (tuple, list)):
            for k, v in enumerate(out):
                if v is leaf:
                    return j, k
    return None


def _tail(run: _Run, start: Any, final: Any, name: str) -> List[Tuple[str, nn.Module, Dict[str, str]]]:
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

    steps: List[Tuple[_Event, Optional[int], Any]] = []
    value, pos = final, len(run.tail)
    while value is not start:
        pos, k = producer(value, pos)
        if pos < 0:
            raise NotAStack(f"the output of {name} is not computed from its last block's output by its modules and "
                            "torch functions alone")
        event = run.tail[pos]
        inputs = [(w, v) for w, v in leaves(list(event.args), "args") + leaves(dict(event.kwargs), "kwargs")
                  if isinstance(v, torch.Tensor)]
        distinct = {id(v): v for _, v in inputs}
        if len(distinct) > 1 and any(id(v) in run.from_input for v in distinct.values()):
            raise NotAStack(f"{event.path} ({event.where}) after the last block combines the last block's output "
                            "with a value computed from the model's input (as the *ForSequenceClassification heads "
                            "pick each row's last non-padding token from input_ids), which is not opened: write the "
                            "head as a layer by hand, carrying what it needs through the blocks (docs/models.md)")
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


def _with_input(fn: Any, event: _Event, inp: torch.Tensor) -> Functional:
    def slot(value: Any) -> Any:
        if value is inp:
            return INPUT
        if isinstance(value, torch.Tensor):
            raise NotAStack(f"{event.path} ({event.where}) after the last block takes a second tensor")
        return value
    args = tuple(slot(v) if not isinstance(v, (tuple, list)) else type(v)(slot(x) for x in v) for v in event.args)
    kwargs = {key: slot(v) for key, v in event.kwargs.items()}
    return Functional.template(fn, args, kwargs)


Layer = Tuple[str, nn.Module, Dict[str, str]]


def stack_layers(model: nn.Module, sample: Any, path: str, stack: nn.Module) -> List[Layer]:
    """``(name, layer, {suffix: original prefix})`` of the opened stack; ``NotAStack`` naming what stops it.

    The suffixes are relative to the layer's name in the flat model (``""``:
    the layer itself is the model's module at that prefix).
    """
    name = type(model).__name__
    owner_paths = [""] + [path[:i] for i in range(len(path)) if path[i] == "."] + [path]
    around_mods = [model.get_submodule(p) for p in owner_paths]
    around = {id(m) for m in around_mods}
    # mypy: nn.Module._modules is typed Optional for deleted children; a block list has none
    blocks: List[nn.Module] = list(stack._modules.values())  # type: ignore[arg-type]
    with torch.no_grad():
        count = len(blocks) if len(blocks) > 1 else _count_calls(model, blocks, sample)
        run, out = _record(model, blocks, around, sample, count)
    if 0 not in run.calls:
        raise NotAStack(f"{name}.forward did not call {path}.0 on the sample")
    calls, hiddens, extras, pick, sources, produced = _blocks(run, path, count, name)
    last = run.outs[count - 1]
    start = last if pick is None else last[pick]
    if not isinstance(start, torch.Tensor):
        raise NotAStack(f"{path}.{count - 1} returns {type(last).__name__}, not the hidden state")
    tail = _tail(run, start, model_output(out), name)
    used = set(run.before) | {p for p, _, _ in tail} | {f"{path}.{i}" for i in range(count)}
    owned = _owned(model, run.before, used, around)
    kept, names = [], {f"owned.{p.replace('.', '_')}": p for p in owned}
    for p, m in zip(owner_paths, around_mods):
        for attr, value in list(m._parameters.items()) + list(m._buffers.items()):
            if value is not None:
                key = f"{p}.{attr}" if p else attr
                kept.append((key.replace(".", "_"), m, attr, attr in m._parameters,
                             attr not in m._non_persistent_buffers_set))
                names[f"kept.{key.replace('.', '_')}"] = key
    install_stop(blocks[0])
    first = StackInput(model, blocks[0], f"{path}.0", around_mods,
                       {p.replace(".", "_"): model.get_submodule(p) for p in owned}, kept,
                       template_of(calls[0], hiddens[0], extras), len(extras), _fixed(model), sources)
    layers: List[Layer] = [("embed", first, names)]
    if len(blocks) == 1:
        if produced:
            raise NotAStack(f"{path}.0 is called {count} times and gives a later call what an earlier one returned: "
                            "one layer at several places runs one call")
        return layers + _shared(path, blocks[0], count, calls, hiddens, extras, pick) + tail
    for i, block in enumerate(blocks):
        template = template_of(calls[i], hiddens[i], extras)
        makes = {e: k for e, (j, k) in produced.items() if j == i}
        if not extras and pick is None and template == ((HIDDEN,), {}):
            layers.append((f"{path}.{i}", block, {"": f"{path}.{i}"}))
        else:
            layers.append((f"{path}.{i}", BlockCall(block, template, len(extras), pick, i == count - 1, makes),
                           {"block": f"{path}.{i}"}))
    return layers + tail


def _shared(path: str, block: nn.Module, count: int, calls: List[Tuple[Tuple[Any, ...], Dict[str, Any]]],
            hiddens: List[Any], extras: Dict[int, int], pick: Optional[int]) -> List[Layer]:
    """One block called ``count`` times: the same layer at ``count`` places (a module used at several places, as
    pipeddp runs any: tied copies where the places fall in different stages), then the hidden state alone."""
    templates = [template_of(calls[i], hiddens[i], extras) for i in range(count)]
    if any(repr(t) != repr(templates[0]) for t in templates[1:]):
        raise NotAStack(f"{path}.0 is called {count} times with other arguments besides the hidden state each time "
                        f"({templates[0]!r}, then {next(t for t in templates if repr(t) != repr(templates[0]))!r}): "
                        "one layer at several places runs one call")
    if not extras and pick is None and templates[0] == ((HIDDEN,), {}):
        return [(f"{path}.0", block, {"": f"{path}.0"})] * count
    layer = BlockCall(block, templates[0], len(extras), pick, last=False)
    places: List[Layer] = [(f"{path}.0", layer, {"block": f"{path}.0"})] * count
    return places + ([("hidden", Functional(operator.getitem, INPUT, 0), {})] if extras else [])


def _owned(model: nn.Module, before: List[str], used: Set[str], around: Set[int]) -> List[str]:
    """The first layer's modules: those called before the first block, and those never called (their state)."""
    owned = list(dict.fromkeys(before))
    covered = set(used)
    for p, m in model.named_modules():
        if not p or id(m) in around or p in covered or any(p.startswith(c + ".") for c in covered):
            continue
        if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
            owned.append(p)
        covered.add(p)
    return owned
