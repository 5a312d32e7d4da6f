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
``last_hidden_state``; a tensor is taken as it is). The run is recorded by
``record``; the steps after the last block become layers in ``tail``.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ...runtime.microbatch import batch_size
from ..functional import INPUT, Functional
from .carry import HIDDEN, leaves, template_of
from .head import BATCH, LENGTH, program_of, reads_input, shorter_sample, smaller_sample
from .record import NotAStack, Run, call_model, count_calls, fixed_args, record
from .stack_layers import BlockCall, Source, StackInput, find_source, hidden_and_last, install_stop, resolve, split_call
from .tail import tail_layers

__all__ = ["NotAStack", "find_stack", "stack_layers", "model_output", "call_model"]


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


def _blocks(run: Run, path: str, count: int, name: str) -> Tuple[List[Tuple[Tuple[Any, ...], Dict[str, Any]]],
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


def _made_by(run: Run, leaf: torch.Tensor, before: int) -> Optional[Tuple[int, int]]:
    """``(block call, index in its output)`` of the earliest block before ``before`` that returned ``leaf`` beside
    its hidden state (T5's first block computes the position bias that every later block is given)."""
    for j in range(before):
        out = run.outs[j]
        if isinstance(out, (tuple, list)):
            for k, v in enumerate(out):
                if v is leaf:
                    return j, k
    return None


Layer = Tuple[str, nn.Module, Dict[str, str]]


class Recorded:
    """One block stack of the model, recorded on a sample: its blocks' calls, the extras they take and where the
    last one leaves the hidden state (``start``); ``layers`` builds the first layer and one per block."""

    def __init__(self, model: nn.Module, sample: Any, path: str, stack: nn.Module) -> None:
        self.model, self.path, self.name = model, path, type(model).__name__
        self.owner_paths = [""] + [path[:i] for i in range(len(path)) if path[i] == "."] + [path]
        self.around_mods = [model.get_submodule(p) for p in self.owner_paths]
        self.around = {id(m) for m in self.around_mods}
        # mypy: nn.Module._modules is typed Optional for deleted children; a block list has none
        self.blocks: List[nn.Module] = list(stack._modules.values())  # type: ignore[arg-type]
        with torch.no_grad():
            self.count = len(self.blocks) if len(self.blocks) > 1 else count_calls(model, self.blocks, sample)
            self.run, self.out = record(model, self.blocks, self.around, sample, self.count)
        if 0 not in self.run.calls:
            raise NotAStack(f"{self.name}.forward did not call {path}.0 on the sample")
        self.calls, self.hiddens, self.extras, self.pick, self.sources, self.produced = \
            _blocks(self.run, path, self.count, self.name)
        last = self.run.outs[self.count - 1]
        self.start = last if self.pick is None else last[self.pick]
        if not isinstance(self.start, torch.Tensor):
            raise NotAStack(f"{path}.{self.count - 1} returns {type(last).__name__}, not the hidden state")
        #: the modules the blocks' layers take
        self.used = set(self.run.before) | {f"{path}.{i}" for i in range(self.count)}

    def layers(self, used: Set[str], inputs: List[Source]) -> List[Layer]:
        """The first layer (owning the modules called before the first block, and those nobody in ``used`` takes)
        and one layer per block; ``inputs``: the batch's tensors passed on after the extras, to the last block."""
        model, path, blocks, count, extras = self.model, self.path, self.blocks, self.count, self.extras
        owned = _owned(model, self.run.before, used, self.around)
        kept, names = [], {f"owned.{p.replace('.', '_')}": p for p in owned}
        for p, m in zip(self.owner_paths, self.around_mods):
            for attr, value in list(m._parameters.items()) + list(m._buffers.items()):
                if value is not None:
                    key = f"{p}.{attr}" if p else attr
                    kept.append((key.replace(".", "_"), m, attr, attr in m._parameters,
                                 attr not in m._non_persistent_buffers_set))
                    names[f"kept.{key.replace('.', '_')}"] = key
        install_stop(blocks[0])
        first = StackInput(model, blocks[0], f"{path}.0", self.around_mods,
                           {p.replace(".", "_"): model.get_submodule(p) for p in owned}, kept,
                           template_of(self.calls[0], self.hiddens[0], extras), len(extras), fixed_args(model),
                           self.sources, inputs)
        layers: List[Layer] = [("embed", first, names)]
        if len(blocks) == 1:
            if self.produced:
                raise NotAStack(f"{path}.0 is called {count} times and gives a later call what an earlier one "
                                "returned: one layer at several places runs one call")
            return layers + _shared(path, blocks[0], count, self.calls, self.hiddens, extras, self.pick, len(inputs))
        carried = len(extras) + len(inputs)  # the inputs a head reads travel after the blocks' extras
        for i, block in enumerate(blocks):
            template = template_of(self.calls[i], self.hiddens[i], extras)
            makes = {e: k for e, (j, k) in self.produced.items() if j == i}
            if not carried and self.pick is None and template == ((HIDDEN,), {}):
                layers.append((f"{path}.{i}", block, {"": f"{path}.{i}"}))
            else:
                layers.append((f"{path}.{i}", BlockCall(block, template, carried, self.pick, i == count - 1, makes,
                                                        keep=len(inputs)), {"block": f"{path}.{i}"}))
        return layers


def stack_layers(model: nn.Module, sample: Any, path: str, stack: nn.Module,
                 skip: Sequence[str] = ()) -> List[Layer]:
    """``(name, layer, {suffix: original prefix})`` of the opened stack; ``NotAStack`` naming what stops it.

    The suffixes are relative to the layer's name in the flat model (``""``:
    the layer itself is the model's module at that prefix). ``skip``: modules
    other layers take (an encoder opened before this stack).
    """
    found = Recorded(model, sample, path, stack)
    final = model_output(found.out)
    inputs: List[Source] = []
    try:
        tail = tail_layers(found.run, found.start, final, found.name)
        tail_paths = [p for p, _, _ in tail]
    except NotAStack as chain:  # no chain of steps: one layer replaying them (a head reading the input or state)
        try:
            tail, inputs = _head(found, sample, final)
        except NotAStack:
            if reads_input(found.run):
                raise
            raise chain from None
        tail_paths = [v for k, v in tail[0][2].items() if k.startswith("mods.")]
    return found.layers(found.used | set(tail_paths) | set(skip), inputs) + tail


def _head(found: Recorded, sample: Any, final: Any) -> Tuple[List[Layer], List[Source]]:
    """The steps after the last block as one layer replaying them (``head``: a head that reads the model's input or
    its own state, as BART adds ``final_logits_bias`` to the logits), recorded again on the sample's first rows to
    tell the batch size from constants, and where it reads an input's length, on the sample one position shorter;
    and where the inputs it reads are."""
    model, name = found.model, found.name
    rows = batch_size(sample, name="sample")
    if rows < 2:
        raise NotAStack(f"the steps of {name} after its last block are no chain (a head that reads the model's input "
                        "or state) and are replayed as one layer, recorded on two batch sizes to tell the batch size "
                        f"from its constants: flatten with a sample of 2 or more rows (this one has {rows})")
    args, kwargs = split_call(sample, fixed_args(model))
    scope = {"args": args, "kwargs": kwargs}
    others = [(_again(found, smaller_sample(sample, rows - 1)), (rows, rows - 1), BATCH)]
    program, inputs, origins = program_of(model, found.run, others, found.start, final, scope)
    read = [resolve(scope, source) for source in inputs]
    lengths = sorted({t.shape[1] for t in read if isinstance(t, torch.Tensor) and t.dim() > 1 and t.shape[1] > 1})
    if not lengths:
        return [("head", program, origins)], inputs
    try:  # the inputs it reads have a length: recorded once more, one position shorter
        shorter = _again(found, shorter_sample(sample, lengths[0]))
    except Exception:  # noqa: BLE001 - a model that cannot run shorter: the sizes a step took are checked per batch
        return [("head", program, origins)], inputs
    try:  # the length followed as the batch size is
        followed = program_of(model, found.run, others + [(shorter, (lengths[0], lengths[0] - 1), LENGTH)],
                              found.start, final, scope)
    except NotAStack:  # it computes with the length otherwise: every batch must have the sample's
        program.dims = [(i + 1, 1, tuple(t.shape[1:])) for i, t in enumerate(read) if t.dim() > 1]
        return [("head", program, origins)], inputs
    return [("head", followed[0], followed[2])], followed[1]


def _again(found: Recorded, sample: Any) -> Run:
    """The model recorded once more, on another sample."""
    with torch.no_grad():
        return record(found.model, found.blocks, found.around, sample, found.count)[0]


def _shared(path: str, block: nn.Module, count: int, calls: List[Tuple[Tuple[Any, ...], Dict[str, Any]]],
            hiddens: List[Any], extras: Dict[int, int], pick: Optional[int], keep: int) -> List[Layer]:
    """One block called ``count`` times: the same layer at ``count`` places (a module used at several places, as
    pipeddp runs any: tied copies where the places fall in different stages), then the hidden state alone (with the
    last ``keep`` carried values: the inputs a head reads)."""
    templates = [template_of(calls[i], hiddens[i], extras) for i in range(count)]
    if any(repr(t) != repr(templates[0]) for t in templates[1:]):
        raise NotAStack(f"{path}.0 is called {count} times with other arguments besides the hidden state each time "
                        f"({templates[0]!r}, then {next(t for t in templates if repr(t) != repr(templates[0]))!r}): "
                        "one layer at several places runs one call")
    if not extras and not keep and pick is None and templates[0] == ((HIDDEN,), {}):
        return [(f"{path}.0", block, {"": f"{path}.0"})] * count
    layer = BlockCall(block, templates[0], len(extras) + keep, pick, last=False)
    places: List[Layer] = [(f"{path}.0", layer, {"block": f"{path}.0"})] * count
    if keep:
        return places + [("hidden", Functional(hidden_and_last, INPUT, keep), {})]
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
