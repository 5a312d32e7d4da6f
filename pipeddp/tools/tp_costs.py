"""What tensor parallelism does to each layer in ``plan``: the parameters it splits, the collectives it adds.

A tensor-parallel plan ``{pattern: style}`` (the model's own, or the user's)
splits some modules of each layer over ``tp`` ranks, as torch's
``parallelize_module`` applies the styles; per module and micro-batch:

    style                   split over tp              forward                    backward
    colwise                 weight, bias (out dim)     -                          all-reduce of the input's grad
    rowwise                 weight (in dim)            all-reduce of the output   -
    colwise_gather_output   weight, bias (out dim)     all-gather of the output   all-reduce of the input's grad
    embedding_rowwise       weight (vocabulary)        all-reduce of the output   -
    rowwise_split_input     weight (in dim)            all-reduce of the output   all-gather of the input's grad

(the last: torch's ``RowwiseParallel(input_layouts=Replicate())`` on a
Linear; by name a plan gives the first four, as ``HybridParallel``'s does,
whose reading of the plan, ``resolve_plan``, this one is).
A Llama or Qwen2 block (q, k, v, gate, up colwise; o, down rowwise) thus
all-reduces its hidden state twice forward and five times backward: torch
reduces each colwise module's input gradient itself, where Megatron's fused
QKV and gate-up projections make it two and two. The sizes are measured, not
assumed: one forward of the sample with hooks on the planned modules. Each
collective is a ring over the tp ranks (``tp_link``): an all-reduce of n
bytes is 2 (t-1) steps of n/t, an all-gather t-1; the layer waits for it.

What the split changes (``LayerModel.tensor_parallel``): the layer's
parameter bytes lose (1 - 1/t) of the split tensors; the per-sample part of
its measured time runs on the split share of its parameters divided by t,
the fixed part (launch overhead) and its output (replicated over tp, so what
crosses a cut and what the schedule keeps) stay as they are.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from ..distributed.tensor_parallel import PlanArg, check_tp_plan_arg, resolve_plan
from ..runtime.names import Names, recorded, recorded_source
from .costs import Link

__all__ = ["Collective", "ShardedLayer", "STYLES", "model_tp_plan", "sharded_layers", "tp_refusals", "check_tp",
           "collectives_note"]

#: the styles plan can cost: (what is split, forward collective, backward collective); "in"/"out" say whose bytes
STYLES: Dict[str, Tuple[str, Optional[str], Optional[str]]] = {
    "colwise": ("out", None, "all_reduce:in"),
    "rowwise": ("in", "all_reduce:out", None),
    "colwise_gather_output": ("out", "all_gather:out", "all_reduce:in"),
    "embedding_rowwise": ("in", "all_reduce:out", None),
    "rowwise_split_input": ("in", "all_reduce:out", "all_gather:in"),
}


@dataclass(frozen=True)
class Collective:
    """One collective over the tp ranks per micro-batch: ``all_reduce`` or ``all_gather`` of the whole tensor."""

    kind: str
    bytes_per_sample: float

    def cost(self, tp: int, link: Link) -> Tuple[float, float]:
        """``(fixed seconds, seconds per sample)`` of this collective as a ring over ``tp`` ranks on ``link``."""
        if tp <= 1:
            return 0.0, 0.0
        steps = (2 if self.kind == "all_reduce" else 1) * (tp - 1)
        per_sample = 0.0 if math.isinf(link.bandwidth) else steps / tp * self.bytes_per_sample / link.bandwidth
        return steps * link.latency, per_sample


@dataclass(frozen=True)
class ShardedLayer:
    """What a plan does to one layer: its parameter bytes, how many of them are split, its collectives, and the
    sizes ``tp`` must divide (``(what, size)``: a split dimension, the attention heads)."""

    name: str
    param_bytes: int
    split_bytes: int
    forward: Tuple[Collective, ...] = ()
    backward: Tuple[Collective, ...] = ()
    divides: Tuple[Tuple[str, int], ...] = ()

    def costs(self, tp: int, link: Link) -> Tuple[float, float, float, float]:
        """``(forward fixed, forward per sample, backward fixed, backward per sample)`` seconds of the collectives."""
        fwd = [c.cost(tp, link) for c in self.forward]
        bwd = [c.cost(tp, link) for c in self.backward]
        return (sum(f for f, _ in fwd), sum(p for _, p in fwd), sum(f for f, _ in bwd), sum(p for _, p in bwd))

    def kept(self, tp: int) -> float:
        """The share of the layer's per-sample work one tp rank still does: its parameters' share."""
        share = self.split_bytes / self.param_bytes if self.param_bytes else 0.0
        return 1.0 - share + share / tp


def model_tp_plan(model: nn.Module) -> Optional[Dict[str, Any]]:
    """The tensor-parallel plan a transformers model carries (``config.base_model_tp_plan`` and its head's
    ``_tp_plan``, as ``model.tp_plan`` joins them, in the model's own names), for the model or the one it was
    flattened from; None for a model without one."""
    source = recorded_source(model) or model
    found = getattr(source, "tp_plan", None)
    return dict(found) if isinstance(found, Mapping) and found else None


def _generic(name: str) -> str:
    """A module's name with its numbered parts as ``*`` (``model.layers.*.mlp.up_proj``): one line for every block."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def style_name(style: Any, module: nn.Module) -> str:
    """What torch's ``ParallelStyle`` ``style`` amounts to on ``module``, as one of ``STYLES``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    outputs = tuple(getattr(style, "output_layouts", ()) or ())
    inputs = tuple(getattr(style, "input_layouts", ()) or ())
    if isinstance(style, ColwiseParallel):
        return "colwise_gather_output" if outputs and isinstance(outputs[0], Replicate) else "colwise"
    if isinstance(style, RowwiseParallel) and outputs and isinstance(outputs[0], Replicate):
        if isinstance(module, nn.Embedding):  # its input is token ids: nothing to reduce or gather backward
            return "embedding_rowwise"
        return "rowwise_split_input" if inputs and isinstance(inputs[0], Replicate) else "rowwise"
    raise ValueError(f"plan cannot cost the tensor-parallel style {style!r}; it costs {', '.join(STYLES)} and "
                     "torch's ColwiseParallel and RowwiseParallel with a replicated output")


def _split(module: nn.Module, name: str, pattern: str, style: str) -> Tuple[int, Tuple[str, int]]:
    """Bytes the style splits in ``module`` and the size tp must divide; refuses a module it does not apply to."""
    side = STYLES[style][0]
    if isinstance(module, nn.Linear):
        weight = module.weight.numel() * module.weight.element_size()
        bias = 0 if module.bias is None or side == "in" else module.bias.numel() * module.bias.element_size()
        size = module.out_features if side == "out" else module.in_features
        return weight + bias, (f"{'output' if side == 'out' else 'input'} features of {pattern}", size)
    if isinstance(module, nn.Embedding):
        size = module.embedding_dim if side == "out" else module.num_embeddings
        what = "embedding width" if side == "out" else "vocabulary"
        return module.weight.numel() * module.weight.element_size(), (f"{what} of {pattern}", size)
    raise ValueError(f"the tensor-parallel plan gives {name} ({type(module).__name__}) the style {style!r} "
                     f"through {pattern!r}: plan costs styles on nn.Linear and nn.Embedding only")


def _heads(model: nn.Module) -> List[Tuple[str, int]]:
    """The attention heads a transformers model's config names (each tp rank must hold whole heads)."""
    config = getattr(recorded_source(model) or model, "config", None)
    out = []
    for attr, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "key-value heads")):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            out.append((what, value))
    return out


def _bytes(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.numel() * value.element_size())
    if isinstance(value, (tuple, list)) and value:
        return _bytes(value[0])
    return 0.0


@contextlib.contextmanager
def _watched(modules: Mapping[str, nn.Module], seen: Dict[str, List[Tuple[float, float]]]) -> Iterator[None]:
    """Record ``(input bytes, output bytes)`` of every call of ``modules`` while the block runs."""

    def hook(name: str) -> Any:
        def record(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
            first = args[0] if args else next(iter(kwargs.values()), None)
            seen.setdefault(name, []).append((_bytes(first), _bytes(output)))
        return record

    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in modules.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def sharded_layers(model: nn.Sequential, tp_plan: PlanArg, sample: torch.Tensor) -> List[ShardedLayer]:
    """What ``tp_plan`` (``"auto"`` or ``{pattern: style}``, as ``HybridParallel`` takes it) does to each layer of
    ``model`` (see module docstring), measured on ``sample``.

    The plan is read by the engine's own ``resolve_plan``, so whatever ``HybridParallel`` would refuse before
    building (a pattern that matches no module, a style it does not know or on a module it cannot split, a split
    weight tied to another place and split otherwise there, dropout) is refused here alike; what ``tp`` must
    divide is ``tp_refusals``'.
    """
    check_tp_plan_arg(tp_plan, has_tp=True, mode="stage")
    names = Names(recorded(model))
    planned: Dict[str, Tuple[nn.Module, str, str]] = {}
    for path, style in resolve_plan(model, tp_plan, 1).items():
        module = model.get_submodule(path)
        planned[path] = (module, _generic(names.original(path)), style_name(style, module))
    seen: Dict[str, List[Tuple[float, float]]] = {}
    with _watched({p: m for p, (m, _, _) in planned.items()}, seen), torch.no_grad():
        model(sample)
    batch = len(sample)
    heads = tuple(_heads(model))
    out = []
    for layer_name, layer in model.named_children():
        param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        split = 0
        divides: List[Tuple[str, int]] = []
        fwd: List[Collective] = []
        bwd: List[Collective] = []
        for path, (module, pattern, style) in planned.items():
            if path.split(".")[0] != layer_name:
                continue
            nbytes, dim = _split(module, path, pattern, style)
            split += nbytes
            divides.append(dim)
            for size_in, size_out in seen.get(path, []):
                for spec, into in ((STYLES[style][1], fwd), (STYLES[style][2], bwd)):
                    if spec is not None:
                        kind, _, whose = spec.partition(":")
                        into.append(Collective(kind, (size_in if whose == "in" else size_out) / batch))
        # its attention split (a planned module named so, as the engine reads it): whole heads on each rank
        mine = [pattern for path, (_, pattern, _) in planned.items() if path.split(".")[0] == layer_name]
        attention = heads if any("attn" in n or "attention" in n for n in mine) else ()
        out.append(ShardedLayer(layer_name, param_bytes, split, tuple(fwd), tuple(bwd),
                                tuple(dict.fromkeys(list(attention) + divides))))
    return out


def tp_refusals(layers: Sequence[ShardedLayer], tp: int) -> List[str]:
    """What ``tp`` does not divide, as ``"what (size)"`` (empty: every split dimension and head count divides)."""
    found = dict.fromkeys(f"{what} ({size})" for layer in layers for what, size in layer.divides if size % tp)
    return list(found)


def check_tp(layers: Sequence[ShardedLayer], tp: int) -> None:
    """Refuse a ``tp`` that does not divide a split dimension or the heads, naming them and the degrees that fit."""
    bad = tp_refusals(layers, tp)
    if bad:
        sizes = [size for layer in layers for _, size in layer.divides]
        fits = [t for t in range(1, max(sizes, default=1) + 1) if all(s % t == 0 for s in sizes)]
        raise ValueError(f"tp={tp} does not divide the model's {', '.join(bad[:4])}"
                         + (" ..." if len(bad) > 4 else "") + f": each tp rank must hold an equal part; choose tp "
                         f"from {fits}")


def collectives_note(layers: Sequence[ShardedLayer], tp: int, link: Link, b: int) -> str:
    """What the tp collectives of one micro-batch of ``b`` samples cost, for a candidate's explanation."""
    count = sum(len(layer.forward) + len(layer.backward) for layer in layers)
    seconds = sum(f + p * b for layer in layers for f, p in (c.cost(tp, link) for c in layer.forward + layer.backward))
    return f"tp={tp}: {count} collectives a micro-batch over the stages' tp devices, {seconds * 1e3:.2f} ms in all"
