"""Rank stages x replicas x micro-batches x schedule for a number of devices, by simulation.

The model is profiled once, layer by layer, at two micro-batch sizes; each
layer's forward and backward time is then taken as linear in the micro-batch
size (a fixed overhead plus a per-sample cost), which is what makes small
micro-batches expensive. For every configuration the planner cuts the model
with the exact partitioner at that configuration's micro-batch size,
simulates one step (``simulate``), estimates memory per device, drops what
does not fit, and sorts by predicted step time::

    devices = replicas x stages x tp   global batch = replicas x local batch
    local batch = chunks x micro-batch

Memory per device is an estimate: parameters x (weights + gradients +
optimizer slots) + the activations the schedule keeps alive (peak in-flight
micro-batches x the outputs of the stage's layers for one micro-batch).
Where that does not fit and there are replicas, the first ``shard=`` setting
that fits is chosen ("optimizer", then "full": ``shard_memory``) and printed
in the ``HybridParallel`` call.
Configurations are written replicas x stages, as everywhere in pipeddp; one
stage per replica is plain data parallelism and is named so. The first
choice comes with the ``HybridParallel`` arguments and ``torchrun`` command
that run it (``Candidate.arguments``, ``Candidate.command``).

With ``tp`` degrees (tensor parallelism, the mesh's innermost dimension),
every layer is first put on one of its tp devices (``tp_costs``: the
parameters the plan splits, their share of the work, the all-reduces of the
split modules on ``tp_link``), and the same sweep runs on what is left of
the devices; what a stage sends and keeps is its whole output (replicated
over tp), its replicas reduce its split gradients only. The estimates of
tensor-parallel layouts assume whole copies on their replicas (no
``shard=``) and a backward in one action: zero-bubble schedules, which the
engine runs with tp too, are not estimated there (where their tp
collectives fall between the input and weight halves is not modelled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Union

import torch
from torch import nn

from ..distributed.shard import split_backward
from ..partitioning.profile import profile_layers
from ..partitioning.solve import solve
from ..runtime.schedule.actions import PLACEMENTS, row_of
from .candidate import Candidate
from .simulate import Link, Prediction, StageCost, resolve_link, simulate
from .tp_costs import ShardedLayer, check_tp, collectives_note

__all__ = ["LayerModel", "fit_layers", "Candidate", "plan", "parse_bytes", "SCHEDULES", "optimizer_slots",
           "shard_memory"]

#: The schedules ``plan`` ranks by default (interleaved with ``virtual_stages`` stages per device).
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb", "auto")


@dataclass(frozen=True)
class LayerModel:
    """One layer's cost as a function of the micro-batch size ``b``: ``a + c * b`` seconds."""

    name: str
    fwd_fixed: float
    fwd_per_sample: float
    bwd_fixed: float
    bwd_per_sample: float
    activation_bytes_per_sample: float
    param_bytes: int

    def forward(self, b: int) -> float:
        return max(self.fwd_fixed + self.fwd_per_sample * b, 0.0)

    def backward(self, b: int) -> float:
        return max(self.bwd_fixed + self.bwd_per_sample * b, 0.0)

    def tensor_parallel(self, shard: ShardedLayer, tp: int, link: Link) -> "LayerModel":
        """This layer on one of ``tp`` ranks (``tp_costs``): its share of the parameters and of the per-sample
        work, and the collectives of its split modules added to its forward and backward."""
        if tp == 1:
            return self
        ff, fp, bf, bp = shard.costs(tp, link)
        kept = shard.kept(tp)
        split = min(shard.split_bytes, self.param_bytes)
        return LayerModel(self.name, self.fwd_fixed + ff, self.fwd_per_sample * kept + fp,
                          self.bwd_fixed + bf, self.bwd_per_sample * kept + bp, self.activation_bytes_per_sample,
                          self.param_bytes - split + math.ceil(split / tp))


def _line(t1: float, t2: float, b1: int, b2: int) -> tuple:
    slope = max((t2 - t1) / (b2 - b1), 0.0)
    return max(t1 - slope * b1, 0.0), slope


def fit_layers(model: nn.Sequential, make_sample: Callable[[int], Any], sizes: Sequence[int] = (4, 16),
               device: Optional[torch.device] = None, repeat: int = 3,
               progress: Optional[Callable[[int, int], None]] = None) -> List[LayerModel]:
    """Profile ``model`` at two micro-batch sizes and fit ``a + c b`` per layer (forward, backward).

    ``progress(done, total)`` covers both profiles.
    """
    b1, b2 = sizes
    if not 0 < b1 < b2:
        raise ValueError(f"sizes must be two increasing micro-batch sizes, got {sizes}")

    def half(offset: int) -> Optional[Callable[[int, int], None]]:
        return None if progress is None else (lambda done, total: progress(offset * total + done, 2 * total))

    small = profile_layers(model, make_sample(b1), device=device, repeat=repeat, progress=half(0))
    large = profile_layers(model, make_sample(b2), device=device, repeat=repeat, progress=half(1))
    out = []
    for s, big in zip(small, large):
        fa, fc = _line(s.forward, big.forward, b1, b2)
        ba, bc = _line(s.backward, big.backward, b1, b2)
        out.append(LayerModel(s.name, fa, fc, ba, bc, big.activation_bytes / b2, s.param_bytes))
    return out


def parse_bytes(text: Union[str, float, int, None]) -> Optional[float]:
    """``"80GB"``, ``"512MiB"``, ``1e9`` -> bytes (None stays None)."""
    if text is None or isinstance(text, (int, float)):
        return None if text is None else float(text)
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    if unit not in units or not number:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GB or 512MiB")
    return float(number) * units[unit]


#: optimizer state per parameter, in parameter sizes (``pipeddp plan --optimizer``)
OPTIMIZER_SLOTS = {"adam": 2, "sgd": 1}


def optimizer_slots(optimizer: str, slots: Optional[int] = None) -> int:
    """The optimizer state per parameter for ``optimizer`` ("adam": 2 moments, "sgd": 1 momentum); ``slots`` wins."""
    if slots is not None:
        if slots < 0:
            raise ValueError(f"optimizer slots must be >= 0, got {slots}")
        return slots
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_SLOTS)}")
    return OPTIMIZER_SLOTS[optimizer]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(
    layers: Sequence[LayerModel],
    devices: int,
    batch: int,
    *,
    link: Union[str, Link] = "pcie",
    allreduce_link: Union[None, str, Link] = None,
    memory: Optional[float] = None,
    optimizer_slots: int = 2,
    chunks: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    schedules: Sequence[str] = SCHEDULES,
    virtual_stages: int = 2,
    top: Optional[int] = None,
    tp: Union[int, Sequence[int]] = 1,
    sharded: Optional[Sequence[ShardedLayer]] = None,
    tp_link: Union[str, Link] = "nvlink",
    progress: Optional[Callable[[int, int], None]] = None,
) -> List[Candidate]:
    """Every configuration of ``devices`` that fits ``memory`` bytes per device, fastest first.

    ``batch`` is the global batch. ``link`` joins neighbouring stages and,
    unless ``allreduce_link`` says otherwise, replicas. ``optimizer_slots`` is
    the optimizer state per parameter in parameter sizes (2 for Adam, 1 for
    SGD with momentum, 0 for plain SGD). The interleaved schedule is tried with
    ``virtual_stages`` stages per device, placed round robin and in the V; one stage per device (plain data
    parallelism, or the plain model) is one configuration, whatever the schedule.

    ``tp``: the tensor-parallel degrees to try (each layer split over ``tp`` devices joined by ``tp_link``, as
    ``sharded`` says: ``tp_costs.sharded_layers``), so ``devices = replicas x stages x tp``; a degree that does
    not divide ``devices``, a split dimension or the heads is refused. ``progress(done, total)`` is called as the
    sweep goes, per (tp, stages, micro-batches).
    """
    if devices < 1 or batch < 1:
        raise ValueError("devices and batch must be >= 1")
    degrees = sorted({tp} if isinstance(tp, int) else set(tp))
    for t in degrees:
        if t < 1 or devices % t:
            raise ValueError(f"tp={t} must be >= 1 and divide devices={devices}")
        if t > 1 and sharded is None:
            raise ValueError(f"tp={t} needs what tensor parallelism splits in each layer: pass sharded= "
                             "(pipeddp.tools.tp_costs.sharded_layers(model, tp_plan, sample))")
        if t > 1 and sharded is not None:
            if len(sharded) != len(layers):
                raise ValueError(f"sharded= describes {len(sharded)} layers, the model has {len(layers)}")
            check_tp(sharded, t)
    stage_link = resolve_link(link)
    ar_link = resolve_link(allreduce_link) if allreduce_link is not None else stage_link
    inner = resolve_link(tp_link)
    runs = [(t, stages, m) for t in degrees for stages in _divisors(devices // t)
            if stages <= len(layers) and batch % (devices // t // stages) == 0
            for m in sorted({c for c in chunks if c <= batch // (devices // t // stages)})]
    found: List[Candidate] = []
    for done, (t, stages, m) in enumerate(runs):
        split = layers if t == 1 else [x.tensor_parallel(s, t, inner) for x, s in zip(layers, sharded or ())]
        replicas = devices // t // stages
        note = "" if t == 1 else collectives_note(sharded or (), t, inner, math.ceil(batch // replicas / m))
        found += _configurations(split, stages, replicas, m, batch, t, stage_link, ar_link, memory,
                                 optimizer_slots, schedules, virtual_stages, note)
        if progress is not None:
            progress(done + 1, len(runs))
    found.sort(key=lambda c: (c.step_time, max(c.memory)))
    return found[:top] if top else found


def _configurations(layers: Sequence[LayerModel], stages: int, replicas: int, m: int, batch: int, tp: int,
                    stage_link: Link, ar_link: Link, memory: Optional[float], optimizer_slots: int,
                    schedules: Sequence[str], virtual_stages: int, tp_note: str = "") -> List[Candidate]:
    """The candidates of one (stages, replicas, micro-batches, tp): each schedule and placement that fits."""
    found: List[Candidate] = []
    b = math.ceil(batch // replicas / m)
    cost = [layer.forward(b) + layer.backward(b) for layer in layers]
    comm = [stage_link.time(layer.activation_bytes_per_sample * b) for layer in layers] if stages > 1 else None
    # one micro-batch, or one stage per replica: every schedule runs the same step
    for schedule in (schedules[:1] if m == 1 or stages == 1 else schedules):
        v = virtual_stages if schedule == "interleaved" else 1
        if stages * v > len(layers) or (tp > 1 and stages > 1 and split_backward(schedule, stages, v)):
            continue  # zero-bubble with tp: where its collectives fall between I and W is not modelled
        balance = solve(cost, stages * v, comm)
        stage_costs, saved = _stages(layers, balance, b)
        for placement in PLACEMENTS if v > 1 else ("loop",):  # the V: first and last stage on device 0
            pred = simulate(stage_costs, schedule, stages=stages, chunks=m, replicas=replicas,
                            links=stage_link, allreduce_link=ar_link, virtual_stages=v, placement=placement)
            chosen = _choose_shard(layers, balance, stages, v, replicas if tp == 1 else 1, m, optimizer_slots,
                                   pred, saved, memory, ar_link, placement)  # tp: the replicas keep whole copies
            if chosen is None:
                continue
            shard, mem, extra = chosen
            why = _why(stage_costs, pred, balance, stages, replicas, tp)
            if tp_note:
                why += "; " + tp_note
            if shard != "none":
                why += f"; shard={shard!r}: " + ("optimizer state and gradients split over the replicas"
                                                 if shard == "optimizer" else "parameters split too")
            found.append(Candidate(stages, replicas, m, b, schedule, balance, pred, mem, why, v, shard,
                                   extra, placement, tp))
    return found


def shard_memory(params: float, largest: float, slots: int, replicas: int, shard: str) -> float:
    """Bytes of a device's weights, gradients and optimizer state at the step's peak under ``shard=``.

    ``"none"``: everything whole. ``"optimizer"``: the parameters are gathered whole for the step and the
    gradients accumulate whole until the one reduce-scatter, beside their 1/R shards; the optimizer state is
    1/R. ``"full"``: 1/R of the parameters plus the layer being gathered, gradients as with ``"optimizer"``.
    """
    if shard == "none" or replicas == 1:
        return params * (2 + slots)
    part = params / replicas
    grads = params + part
    if shard == "optimizer":
        return params + part + grads + slots * part
    return part + largest + grads + slots * part


def _choose_shard(layers: Sequence[LayerModel], balance: Sequence[int], stages: int, v: int, replicas: int,
                  m: int, slots: int, pred: Prediction, saved: Sequence[float], memory: Optional[float],
                  link: Link, placement: str = "loop") -> Optional[tuple]:
    """The first shard= setting ("none", then "optimizer", then "full") whose memory fits: (shard, memory, time)."""
    starts = [sum(balance[:k]) for k in range(len(balance))]
    per_stage = [[layers[i].param_bytes for i in range(starts[k], starts[k] + balance[k])] for k in range(len(balance))]
    held = [[k for k in range(stages * v) if row_of(k, stages, placement) == r] for r in range(stages)]
    for shard in ("none", "optimizer", "full") if replicas > 1 else ("none",):
        mem = []
        for r, mine in enumerate(held):  # a device holds its stages' state and its peak of stage activations
            params = sum(sum(per_stage[k]) for k in mine)
            largest = max(max(per_stage[k], default=0) for k in mine)
            mem.append(shard_memory(params, largest, slots, replicas, shard)
                       + pred.peak_activations[r] * max(saved[k] for k in mine))
        if memory is None or max(mem) <= memory:
            extra = 0.0
            if shard == "full":  # gathered again for every micro-batch's forward and backward (the first is DDP's)
                gather = max(sum(sum(per_stage[k]) for k in mine) for mine in held) * (replicas - 1) / replicas
                extra = (2 * m - 1) * link.time(gather)
            return shard, mem, extra
    return None


def _stages(layers: Sequence[LayerModel], balance: Sequence[int], b: int) -> tuple:
    costs, saved, start = [], [], 0
    for count in balance:
        chunk = layers[start:start + count]
        costs.append(StageCost(
            forward=sum(layer.forward(b) for layer in chunk),
            backward=sum(layer.backward(b) for layer in chunk),
            activation_bytes=int(chunk[-1].activation_bytes_per_sample * b),
            param_bytes=sum(layer.param_bytes for layer in chunk),
        ))
        saved.append(sum(layer.activation_bytes_per_sample * b for layer in chunk))
        start += count
    return costs, saved


def _why(costs: Sequence[StageCost], pred: Prediction, balance: Sequence[int], stages: int, replicas: int,
         tp: int = 1) -> str:
    slowest = max(range(len(costs)), key=lambda s: costs[s].forward + costs[s].backward)
    parts = []
    if stages == 1 and replicas > 1:
        parts.append("plain data parallelism: the whole model on every device, no pipeline" if tp == 1 else
                     f"no pipeline: each replica's model split over {tp} devices")
    if len(costs) > 1:
        c = costs[slowest]
        parts.append(f"bottleneck stage {slowest} ({balance[slowest]} layers, "
                     f"{(c.forward + c.backward) * 1e3:.1f} ms/micro-batch)")
        parts.append(f"bubble {pred.bubble:.0%}")
    if max(pred.allreduce_time) > 0:
        hidden = max(pred.allreduce_time) - pred.exposed_allreduce
        parts.append(f"all-reduce {max(pred.allreduce_time) * 1e3:.1f} ms, "
                     f"{max(hidden, 0.0) * 1e3:.1f} ms of it hidden")
    return "; ".join(parts) if parts else ("no pipeline, no replicas: the plain model" if tp == 1 else
                                          f"no pipeline, no replicas: the model split over {tp} devices")

