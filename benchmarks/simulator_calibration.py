"""What benchmarks/simulator_accuracy.py predicts from: calibration of compute, contention and links.

Nothing here runs a configuration being predicted: per-layer costs and the loss at each micro-batch size,
how much slower compute runs while both cores compute (contention, fitted to a real 2-stage pipeline step that
is not among the configurations), and the links (gloo ping-pong, thread hand-off, DDP's bucket all-reduce,
``HybridParallel``'s per-step collectives).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy
import torch
import torch.distributed as dist
from torch import nn

from benchmarks.baselines import record
from benchmarks.common import barrier_timed
from benchmarks.workloads import WORKLOADS
from pipeddp.partitioning.profile import LayerCost, profile_layers
from pipeddp.runtime.channels import Inbox
from pipeddp.tools.simulate import Link, StageCost, simulate
from pipeddp.tools.timeline import WORK as KINDS

WORK = WORKLOADS["mlp"]  # mlp(16, 1024): 32 layers
BATCH = WORK.batch["simulator_accuracy"]
DDP_BUCKET = 25 * 2**20  # DDP's default bucket_cap_mb=25


SHAPES = {"1x1": (1, 1, 1), "1x2": (1, 2, 1), "2x1": (2, 1, 2), "1x2-stage": (1, 2, 2)}  # replicas, stages, procs


@dataclass(frozen=True)
class Spec:
    """One configuration: ``layout`` (replicas x stages; "-stage": one process per stage), m, schedule, and the
    stages per device (``virtual``: 2 for the interleaved schedule); ``cut``: how many stages the model is cut into."""

    layout: str
    m: int
    schedule: str = "1f1b"
    virtual: int = 1
    replicas = property(lambda self: SHAPES[self.layout][0])
    stages = property(lambda self: SHAPES[self.layout][1])
    procs = property(lambda self: SHAPES[self.layout][2])
    cut = property(lambda self: self.stages * self.virtual)
    micro_batch = property(lambda self: BATCH // self.replicas // self.m)

    @property
    def name(self) -> str:
        sched = "" if self.layout in ("1x1", "2x1") else f" {self.schedule}"
        return f"{self.layout}{sched}{f' v={self.virtual}' if self.virtual > 1 else ''} m={self.m}"


SPECS: List[Spec] = [Spec("1x1", 1), Spec("1x1", 4), Spec("1x1", 16), Spec("1x2", 2, "gpipe"), Spec("1x2", 4),
                     Spec("1x2", 8), Spec("1x2", 16, "gpipe"), Spec("1x2", 4, "zb"), Spec("1x2", 4, "interleaved", 2),
                     Spec("2x1", 1), Spec("2x1", 4), Spec("1x2-stage", 2), Spec("1x2-stage", 4, "gpipe"),
                     Spec("1x2-stage", 8, "gpipe"), Spec("1x2-stage", 16), Spec("1x2-stage", 8, "zb"),
                     Spec("1x2-stage", 8, "interleaved", 2)]


def _fitted(sizes: List[int], ops: Sequence[Callable[[], Any]], reps: int, per_op: float = 1.0) -> Dict[str, Any]:
    """Median seconds of each op (times ``per_op``), one per size, fitted by least squares to latency + bytes /
    bandwidth (both clipped at >= 0)."""
    secs = [_median_time(op, reps) * per_op for op in ops]
    c = max(float(numpy.polyfit(sizes, secs, 1)[0]), 1e-15)
    latency = max(statistics.fmean(secs) - c * statistics.fmean(sizes), 0.0)
    return {"sizes": sizes, "seconds": secs, "latency_s": latency, "bandwidth_Bps": 1 / c}


def _median_time(op: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``op`` over ``reps`` runs after one untimed run, every run between two barriers."""
    return statistics.median([barrier_timed(op)[0].own for _ in range(reps + 1)][1:])


def calibrate_p2p(rank: int, reps: int) -> Dict[str, Any]:
    """gloo send/recv ping-pong: one-way seconds per size, fitted to latency + bytes / bandwidth."""
    sizes = [256, 16 * 2**10, 64 * 2**10, 256 * 2**10, 2**20, 4 * 2**20]

    def ping_pong(buf: torch.Tensor) -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    bufs = [torch.zeros(n // 4) for n in sizes]  # allocated before the clock runs
    return _fitted(sizes, [lambda buf=buf: ping_pong(buf) for buf in bufs], reps, per_op=0.5)


def calibrate_allreduce(reps: int) -> Dict[str, Any]:
    """A bucket reduced the way DDP does it (copy in, divide, gloo all-reduce, copy out) between the 2 ranks,
    at several sizes; fitted to the ring of 2: t = 2 latency + bytes / bandwidth."""
    sizes = [4 * 2**10, 2**20, 4 * 2**20, 16 * 2**20, DDP_BUCKET]

    def reduce(grads: torch.Tensor, bucket: torch.Tensor) -> None:
        bucket.copy_(grads)
        bucket.div_(dist.get_world_size())
        dist.all_reduce(bucket)
        grads.copy_(bucket)

    bufs = [(torch.ones(n // 4), torch.empty(n // 4)) for n in sizes]  # allocated before the clock runs
    fit = _fitted(sizes, [lambda g=g, bk=bk: reduce(g, bk) for g, bk in bufs], reps)
    return dict(fit, latency_s=fit["latency_s"] / 2)  # a ring of 2 pays the latency twice


def calibrate_engine_collectives(reps: int) -> float:
    """What ``HybridParallel.train_step`` adds per step: all_gather_object of sizes + all_gather of the loss."""
    world = dist.get_world_size()

    def collectives() -> None:
        dist.all_gather_object([None] * world, (128, 128, ""))
        mine = torch.tensor([0.5, 0.0], dtype=torch.float64)
        dist.all_gather([torch.zeros_like(mine) for _ in range(world)], mine)

    return _median_time(collectives, reps)


def calibrate_threads(reps: int) -> float:
    """One-way hand-off between two threads through pipeddp's ``Inbox`` (the threaded pipeline's channel)."""
    a, b = Inbox(0), Inbox(1)

    def echo() -> None:
        for i in range(reps + 1):
            b.put(("B", i), a.take(("F", i), 10.0, 0))

    t = threading.Thread(target=echo)
    t.start()
    got = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        a.put(("F", i), None)
        b.take(("B", i), 10.0, 1)
        if i:
            got.append((time.perf_counter() - t0) / 2)
    t.join()
    return statistics.median(got)


def time_loss(b: int, width: int, reps: int) -> Tuple[float, float]:
    """Forward and backward seconds of the loss on one micro-batch of ``b`` samples."""
    out = torch.randn(b, width, requires_grad=True)
    y = torch.randn(b, width)
    fs, bs = [], []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        loss = WORK.loss_fn(out, y) * 0.5
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        out.grad = None
        if i:
            fs.append(t1 - t0)
            bs.append(t2 - t1)
    return statistics.median(fs), statistics.median(bs)


def compute_sample(rank: int, model: nn.Sequential, x: torch.Tensor, b: int, repeat: int, loss_reps: int,
                   pipeline: Any = None) -> Optional[Dict[str, Any]]:
    """One calibration sample at micro-batch ``b`` (on rank 0, while rank 1 waits): the layer profile, the loss's
    seconds and, with ``pipeline`` (a calibration pipeline at this size), the contention fitted to its real step."""
    dist.barrier()
    solo = profile_layers(model, x[:b], repeat=repeat) if rank == 0 else None
    loss = time_loss(b, x.shape[1], loss_reps) if rank == 0 else None
    fitted = None
    if rank == 0 and pipeline is not None:
        costs = _costs(_layer_dicts(solo), loss, pipeline.info["balance"])
        fitted = pipeline_contention(pipeline.run, pipeline.module, costs, pipeline.module.chunks)
    dist.barrier()
    return {"solo": solo, "loss": loss, "pipeline": fitted} if rank == 0 else None


def _layer_dicts(costs: Sequence[LayerCost]) -> List[Dict[str, float]]:
    return [{"name": c.name, "forward": c.forward, "backward": c.backward, "activation_bytes": c.activation_bytes,
             "param_bytes": c.param_bytes} for c in costs]


def pipeline_contention(step: Callable[[], Any], engine: Any, costs: Sequence[StageCost], chunks: int) -> float:
    """How much slower compute runs while both stages compute: the ``sigma`` (by bisection) under which the simulator,
    played with the solo costs of the same stages and contention ``[1, sigma]`` (alone in the fill and the drain),
    matches the sum of the actions' durations in one traced step of a real 2-stage GPipe ``Pipeline``."""
    busy = sum(sp.duration for sp in record(engine, step) if sp.kind in KINDS)

    def simulated(sigma: float) -> float:
        pred = simulate(list(costs), "gpipe", chunks=chunks, contention=[1.0, sigma])
        return sum(pred.played.busy(r) for r in range(len(costs)))

    lo, hi = 0.5, 4.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulated(mid) < busy else (lo, mid)
    return (lo + hi) / 2


@dataclass
class Calib:
    """Calibration samples collected so far (rank 0); compute samples by micro-batch size."""

    samples: Dict[int, List[Dict[str, Any]]] = field(default_factory=dict)
    p2p: Dict[str, Any] = field(default_factory=dict)
    allreduce: Dict[str, Any] = field(default_factory=dict)
    thread_latency: float = 0.0
    engine_collectives: float = 0.0

    def add(self, b: int, sample: Dict[str, Any]) -> None:
        self.samples.setdefault(b, []).append(sample)

    def only(self, b: int, sample: Dict[str, Any]) -> "Calib":
        """The same links, with ``sample`` as the only compute sample at ``b``."""
        return Calib({b: [sample]}, self.p2p, self.allreduce, self.thread_latency, self.engine_collectives)

    def layers(self, b: int) -> List[Dict[str, float]]:
        """Per layer: median forward / backward seconds over the samples, and sizes."""
        samples: List[List[LayerCost]] = [c["solo"] for c in self.samples[b]]
        return [{"name": first.name, "forward": statistics.median(s[i].forward for s in samples),
                 "backward": statistics.median(s[i].backward for s in samples),
                 "activation_bytes": first.activation_bytes, "param_bytes": first.param_bytes}
                for i, first in enumerate(samples[0])]

    def loss(self, b: int) -> Tuple[float, float]:
        return (statistics.median(c["loss"][0] for c in self.samples[b]),
                statistics.median(c["loss"][1] for c in self.samples[b]))

    def pipeline_ratios(self, b: int) -> List[float]:
        """Per sample: the contention fitted to a real 2-stage pipeline step at micro-batch ``b``."""
        return [c["pipeline"] for c in self.samples[b] if c.get("pipeline") is not None]

    def contention(self, b: int) -> float:
        return statistics.median(self.pipeline_ratios(b))


def layer_costs(calib: Calib, b: int) -> List[float]:
    """Forward + backward per layer at micro-batch ``b``, the loss counted on the last layer (what the cut balances)."""
    layers = calib.layers(b)
    costs = [v["forward"] + v["backward"] for v in layers]
    costs[-1] += sum(calib.loss(b))
    return costs


def _costs(layers: Sequence[Dict[str, float]], loss: Tuple[float, float], balance: Sequence[int]) -> List[StageCost]:
    """The simulator's per-stage costs of ``balance`` (the loss on the last stage)."""
    lf, lb = loss
    out, start = [], 0
    for s, count in enumerate(balance):
        chunk, last = layers[start:start + count], s == len(balance) - 1
        out.append(StageCost(forward=sum(v["forward"] for v in chunk) + (lf if last else 0.0),
                             backward=sum(v["backward"] for v in chunk) + (lb if last else 0.0),
                             activation_bytes=int(chunk[-1]["activation_bytes"]),
                             param_bytes=int(sum(v["param_bytes"] for v in chunk))))
        start += count
    return out


def predict(spec: Spec, calib: Calib, balance: Sequence[int], *, plain: bool = False) -> Dict[str, Any]:
    """Simulate ``spec`` from ``calib``. ``plain``: the simulator's own model alone (no contention, no DDP
    buckets, the all-reduce beside the compute for free, free thread hand-offs, no engine collectives)."""
    b = spec.micro_batch
    costs, sigma = _costs(calib.layers(b), calib.loss(b), balance), calib.contention(b)
    links = {"1x2": None if plain else Link(math.inf, calib.thread_latency),
             "1x2-stage": Link(calib.p2p["bandwidth_Bps"], calib.p2p["latency_s"])}
    extra: Dict[str, Any] = {} if plain else {"contention": [1.0, sigma]}
    if not plain and spec.replicas > 1:
        extra.update(bucket_bytes=DDP_BUCKET, collectives_share_cores=True)
    if not plain and spec.procs > 1:
        extra["step_overhead"] = calib.engine_collectives
    pred = simulate(costs, spec.schedule, stages=spec.stages, chunks=spec.m, replicas=spec.replicas,
                    links=links.get(spec.layout), virtual_stages=spec.virtual,
                    allreduce_link=Link(calib.allreduce["bandwidth_Bps"], calib.allreduce["latency_s"])
                    if spec.layout == "2x1" else None, **extra)
    return {"step_s": pred.step_time, "bubble": pred.bubble, "exposed_allreduce_s": pred.exposed_allreduce,
            "allreduce_s": max(pred.allreduce_time), "contention": None if plain else sigma,
            "stage_ms": [round((c.forward + c.backward) * 1e3, 3) for c in costs]}
