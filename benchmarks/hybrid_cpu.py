"""pipeddp on 2 CPU cores against the plain model, DDP and torch.distributed.pipelining.

    python benchmarks/hybrid_cpu.py                         # mlp + resnet50, m = 2 4 8 16 (13 min quiet, <= ~22 busy)
    python benchmarks/hybrid_cpu.py --quick                 # smoke run: mlp, m = 2 8, 1 round (~30 s)
    python benchmarks/hybrid_cpu.py --models resnet50 --ms 8 16 --rounds 5

Every configuration runs with one intra-op thread per process (per stage
thread for the threaded pipeline). For every number of micro-batches m one
training step (forward + backward, gradients zeroed each step, no optimizer
step) is timed for

* ``whole-1t`` / ``whole-2t``: the plain model on the whole batch, 1 and 2 threads;
* ``accum``: the plain model accumulating over the same m micro-batches (1 thread),
  the yardstick a 2-stage pipeline has to beat by up to 2x;
* ``ddp``: plain DDP, 2 processes x 1 thread, half the batch each (gloo);
* ``pipeddp-replica``: pipeddp, 1 replica x 2 stages in one process (a ``Pipeline``
  with two stage threads), cut by pipeddp's partitioner (``"time"`` at micro-batch size);
* ``pipeddp-stage``: ``HybridParallel(mode="stage")``, 2 processes (gloo), same cut;
* ``torch-gpipe`` / ``torch-1f1b``: ``torch.distributed.pipelining`` (``PipelineStage`` on
  each rank's ``nn.Sequential`` slice, ``ScheduleGPipe`` / ``Schedule1F1B``), given
  pipeddp's cut (``@cut``) and the naive half-way cut ``len(model)//2`` (``@naive``).

How it is timed: one spawned job of 2 processes runs everything. Each round
visits every configuration once, in an order rotated by one per round; before
and after each configuration both ranks meet in a gloo barrier and rank 0
reads the clock, so a 2-process step is timed from the common start to the
moment the slower rank is done. Single-process configurations run on rank 0
alone while rank 1 waits in the barrier (a blocking wait: its CPU use is
recorded per round and reported, so a spinning waiter would show). Speedups
are medians of per-round ratios (the host's speed drifts). Other processes on
the machine are watched too: a step during which they used more than
``--max-foreign`` cores (machine busy time from /proc/stat minus both
benchmark processes' CPU time) is left out of every median and ratio it
touches, and rounds are added (up to ``--max-retries``) until every
pipeddp-vs-baseline pair has ``--rounds`` undisturbed rounds. Before timing every
configuration runs once and its gradients are compared with ``accum``'s
(BatchNorm sees micro-batches, so the whole batch and DDP's half batches are
only expected to match ``accum`` on the MLP). Every timed round also records,
for every pipeline, the time each stage spent in its forward and backward calls
(where the time goes; medians over the undisturbed rounds are reported).

pipeddp's cut comes from ``pipeddp.partition(model, 2, method="time", sample=x,
chunks=m)`` on rank 0, sent to rank 1.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

import pipeddp
from pipeddp.runtime.microbatch import split, split_sizes
from pipeddp.tools.models import mlp, resnet
from pipeddp.partitioning.report import partition
from pipeddp.pipeline import Pipeline
from pipeddp.runtime.trace import Trace

try:  # run as a script (benchmarks/ is sys.path[0]) or as python -m benchmarks.hybrid_cpu
    from benchmarks.common import (
        LossFn, Workload, bubble_bound, host_cpu_seconds, median_ms, median_ratio, parallel_probe, print_table,
        write_json,
    )
except ImportError:  # pragma: no cover - depends on how the script is started
    from common import (
        LossFn, Workload, bubble_bound, host_cpu_seconds, median_ms, median_ratio, parallel_probe, print_table,
        write_json,
    )

STAGES = 2
Grads = Dict[str, torch.Tensor]


def _mlp_batch() -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(256, 1024), torch.randn(256, 1024)


def _resnet_batch() -> Tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(64, 3, 64, 64), torch.randint(0, 1000, (64,))


def _mlp() -> nn.Sequential:
    return mlp(16, 1024)


def _resnet50() -> nn.Sequential:
    return resnet("resnet50")


WORKLOADS: Dict[str, Workload] = {
    # ~0.2-0.5 s per step: ~4-5 s per round of all configurations.
    "mlp": Workload("MLP 16 x (Linear(1024,1024)+ReLU), batch 256, MSE vs random targets",
                    _mlp, _mlp_batch, nn.functional.mse_loss, rounds=8, warmup=1, max_retries=6),
    # ~1-4 s per step: ~20-35 s per round of all configurations.
    "resnet50": Workload("resnet50 (flattened, 23 layers), 3x64x64, batch 64, cross-entropy vs random labels "
                         "(1000 classes)", _resnet50, _resnet_batch, nn.functional.cross_entropy, rounds=4, warmup=0,
                         max_retries=3),
}


# ---------------------------------------------------------------------------------------------------
# configurations (built inside the spawned processes)
# ---------------------------------------------------------------------------------------------------


@dataclass
class Config:
    """One thing to time. ``procs`` 1: rank 0 alone; 2: both ranks. ``step`` is None where a rank sits out."""

    name: str
    procs: int
    step: Optional[Callable[[], Any]]
    grads: Callable[[], Grads] = lambda: {}
    instrument: Optional[Callable[[Callable[[], Any]], Dict[str, Any]]] = None
    close: Callable[[], None] = lambda: None
    info: Dict[str, Any] = field(default_factory=dict)


def _grads_of(module: nn.Module, prefix: str = "") -> Grads:
    """Gradients by the plain model's parameter names (``prefix`` stripped)."""
    out: Grads = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            out[name[len(prefix):] if name.startswith(prefix) else name] = p.grad.detach().clone()
    return out


def _slice(model: nn.Sequential, a: int, b: int) -> nn.Sequential:
    """Own copies of layers a..b-1, under their original names (so parameter names match the model's)."""
    named = list(model.named_children())[a:b]
    return nn.Sequential(OrderedDict((n, copy.deepcopy(layer)) for n, layer in named))


def _spans_breakdown(spans: List[Any], stage: int) -> Dict[str, float]:
    comp = [s for s in spans if s.lane == "compute" and s.stage == stage]
    recv = [s for s in spans if s.lane == "comm" and s.stage == stage]
    return {"F_ms": sum(s.duration for s in comp if s.kind == "F") * 1e3,
            "B_ms": sum(s.duration for s in comp if s.kind == "B") * 1e3,
            "recv_wait_ms": sum(s.duration for s in recv) * 1e3}


def plain_configs(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int, loss_fn: LossFn) -> List[Config]:
    """whole-1t, whole-2t, accum (rank 0 only); each on its own copy of the weights."""
    n = x.shape[0]
    sizes = split_sizes(n, chunks=m)
    xs, ys = split(x, sizes), split(y, sizes)
    weights = [k / n for k in sizes]
    m1, m2, ma = (copy.deepcopy(model) for _ in range(3))

    def whole(mod: nn.Module) -> torch.Tensor:
        mod.zero_grad(set_to_none=True)
        loss = loss_fn(mod(x), y)
        loss.backward()
        return loss.detach()

    def whole2() -> torch.Tensor:
        torch.set_num_threads(2)
        try:
            return whole(m2)
        finally:
            torch.set_num_threads(1)

    def accum() -> torch.Tensor:
        ma.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for xi, yi, w in zip(xs, ys, weights):
            loss = loss_fn(ma(xi), yi) * w  # the pipeline's weighting: sum of weighted means = batch mean
            loss.backward()
            total += loss.detach()
        return total

    return [
        Config("whole-1t", 1, lambda: whole(m1), lambda: _grads_of(m1)),
        Config("whole-2t", 1, whole2, lambda: _grads_of(m2)),
        Config("accum", 1, accum, lambda: _grads_of(ma)),
    ]


def replica_config(name: str, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int, balance: List[int],
                   schedule: str, loss_fn: LossFn) -> Config:
    """pipeddp 1 replica x 2 stages in this process (what HybridParallel's replica mode runs per replica)."""
    pipe = Pipeline(copy.deepcopy(model), ["cpu"] * STAGES, chunks=m, balance=balance, schedule=schedule, threads=1)

    def step() -> torch.Tensor:
        pipe.zero_grad(set_to_none=True)
        return pipe.train_step(x, y, loss_fn)

    def instrument(run: Callable[[], Any]) -> Dict[str, Any]:
        pipe.trace = Trace()
        try:
            run()
            spans = pipe.trace.spans
        finally:
            pipe.trace = None
        return {"stages": [_spans_breakdown(spans, s) for s in range(STAGES)]}

    return Config(name, 1, step, lambda: _grads_of(pipe), instrument, pipe.close,
                  {"balance": list(pipe.balance), "schedule": schedule})


def stage_config(name: str, rank: int, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int,
                 balance: List[int], schedule: str, loss_fn: LossFn) -> Config:
    """pipeddp HybridParallel(mode="stage"): stage 0 on rank 0, stage 1 on rank 1."""
    engine = pipeddp.HybridParallel(copy.deepcopy(model), stages=STAGES, mode="stage", balance=balance, chunks=m,
                                    schedule=schedule, devices=["cpu"], backend="gloo")
    xin = x if rank == 0 else None
    yin = y if rank == STAGES - 1 else None

    def step() -> torch.Tensor:
        engine.zero_grad(set_to_none=True)
        return engine.train_step(xin, yin, loss_fn)

    def instrument(run: Callable[[], Any]) -> Dict[str, Any]:
        engine.trace = Trace(rank)
        try:
            run()
            spans = engine.trace.spans
        finally:
            engine.trace = None
        return {"stage": rank, **_spans_breakdown(spans, rank)}

    return Config(name, 2, step, lambda: _grads_of(engine), instrument, engine.close,
                  {"balance": list(engine.balance), "schedule": schedule})


def ddp_config(rank: int, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> Config:
    """Plain DDP: 2 processes, half the batch each."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(copy.deepcopy(model))
    half = x.shape[0] // 2
    xl, yl = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]

    def step() -> torch.Tensor:
        ddp.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(xl), yl)
        loss.backward()
        return loss.detach()

    return Config("ddp", 2, step, lambda: _grads_of(ddp.module))


def torch_config(name: str, rank: int, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int, cut: int,
                 schedule: str, loss_fn: LossFn, group: Any) -> Config:
    """torch.distributed.pipelining: this rank's nn.Sequential slice as a PipelineStage under ScheduleGPipe/1F1B."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    a, b = (0, cut) if rank == 0 else (cut, len(model))
    sub = _slice(model, a, b)
    sub.train()
    # No input_args: this torch infers shapes at the first step (dynamic metadata), which the check step pays.
    stage = PipelineStage(sub, rank, STAGES, torch.device("cpu"), group=group)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=m, loss_fn=loss_fn)  # scale_grads=True: mean of micro-batch mean losses
    losses: List[torch.Tensor] = []

    def step() -> Any:
        sub.zero_grad(set_to_none=True)
        if rank == 0:
            return sched.step(x)
        return sched.step(target=y, losses=losses)

    def instrument(run: Callable[[], Any]) -> Dict[str, Any]:
        acc = {"F": 0.0, "B": 0.0}
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

        def timed(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    acc[kind] += time.perf_counter() - t0
            return wrapper

        stage.forward_one_chunk = timed("F", fwd)  # type: ignore[method-assign]
        stage.backward_one_chunk = timed("B", bwd)  # type: ignore[method-assign]
        try:
            run()
        finally:
            del stage.forward_one_chunk, stage.backward_one_chunk
        return {"stage": rank, "F_ms": acc["F"] * 1e3, "B_ms": acc["B"] * 1e3}

    return Config(name, 2, step, lambda: _grads_of(sub), instrument, info={"cut": cut, "schedule": schedule})


# ---------------------------------------------------------------------------------------------------
# the spawned job
# ---------------------------------------------------------------------------------------------------


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def _timed(cfg: Config) -> Tuple[float, float, float, float]:
    """One step between barriers: (wall seconds from the common start to both ranks done, this rank's CPU
    seconds, the machine's busy CPU seconds, its steal seconds) over that stretch."""
    dist.barrier()
    h0, s0 = host_cpu_seconds()
    c0 = time.process_time()
    t0 = time.perf_counter()
    if cfg.step is not None:
        cfg.step()
    dist.barrier()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    h1, s1 = host_cpu_seconds()
    return wall, cpu, h1 - h0, s1 - s0


def _agree(rank: int, ok: bool, err: str) -> Tuple[bool, str]:
    """Every rank learns whether every rank succeeded (and the first error)."""
    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (ok, err))
    errs = [e for o, e in parts if not o]
    # A rank whose peer failed usually times out waiting; list the real error (not a timeout) first.
    errs.sort(key=lambda e: "Timed out" in e or "timed out" in e)
    return not errs, " | ".join(errs)


def _guarded(rank: int, fn: Callable[[], Any], group: Any = None) -> Tuple[Any, str]:
    """Run ``fn`` on this rank; if it fails here, tear down ``group`` so the peer's waits fail fast too."""
    try:
        return fn(), ""
    except Exception as exc:  # noqa: BLE001 - recorded, the benchmark goes on
        msg = f"rank {rank}: {type(exc).__name__}: {str(exc).strip()[-1500:]}"
        if group is not None:
            for teardown in (lambda: group.abort(), lambda: dist.destroy_process_group(group)):
                try:
                    teardown()
                except Exception:  # noqa: BLE001
                    pass
        return None, msg


def _rel_diff(ref: Grads, got: Grads) -> float:
    """max |g - g_ref| / max |g_ref| over all parameters; inf if the parameter sets differ."""
    if set(ref) != set(got):
        return float("inf")
    diff = scale = 0.0
    for k, r in ref.items():
        diff = max(diff, (got[k] - r).abs().max().item())
        scale = max(scale, r.abs().max().item())
    return diff / (scale or 1.0)


def _gather(rank: int, obj: Any) -> Optional[List[Any]]:
    out: Optional[List[Any]] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def build_torch_configs(rank: int, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int,
                        cuts: Dict[str, int], loss_fn: LossFn, warm: Callable[[Config], Any],
                        group_timeout: float) -> Tuple[List[Config], Dict[str, Any]]:
    """torch pipelining configurations for each named cut that works; failures recorded, next cut tried.

    Each configuration gets a process group of its own with a short timeout, so that a rank that fails
    (e.g. an in-place first op on the received activation) can tear it down and the peer's pending
    receive fails instead of hanging.
    """
    configs: List[Config] = []
    report: Dict[str, Any] = {}
    done: Dict[Tuple[int, str], str] = {}
    n = len(model)
    for label, cut0 in cuts.items():
        for sched in ("gpipe", "1f1b"):
            name = f"torch-{sched}@{label}"
            attempts = []
            cut = cut0
            while 0 < cut < n:
                if (cut, sched) in done:  # same cut as another label: same configuration, time it once
                    attempts.append({"cut": cut, "ok": True, "alias_of": done[(cut, sched)]})
                    break
                group = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=group_timeout))
                cfg, err = _guarded(rank, lambda: torch_config(name, rank, model, x, y, m, cut, sched, loss_fn,
                                                                group), group)
                ok, err = _agree(rank, cfg is not None, err)
                if ok:
                    _, err = _guarded(rank, lambda: warm(cfg), group)
                    dist.barrier()  # a failed peer needs up to the group timeout to notice
                    ok, err = _agree(rank, not err, err)
                attempts.append({"cut": cut, "ok": ok, **({} if ok else {"error": err})})
                if ok:
                    configs.append(cfg)
                    done[(cut, sched)] = name
                    break
                _log(rank, f"    {name}: cut {cut} failed ({err.splitlines()[0][:200]}); trying cut {cut + 1}")
                cut += 1
            report[name] = {"requested_cut": cut0, "attempts": attempts,
                            "used_cut": attempts[-1]["cut"] if attempts and attempts[-1]["ok"] else None,
                            "alias_of": attempts[-1].get("alias_of") if attempts else None}
    return configs, report


def run_m(rank: int, name: str, work: Workload, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int,
          opts: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    loss_fn = work.loss_fn
    n_layers = len(model)
    # pipeddp's cut: measured on rank 0 at micro-batch size, sent to rank 1 (what HybridParallel does).
    plan: List[Any] = [None]
    if rank == 0:
        t0 = time.perf_counter()
        part = partition(model, STAGES, method="time", sample=x, chunks=m)
        plan = [{"balance": list(part.balance), "stage_ms": [c * 1e3 for c in part.stage_costs],
                 "layer_ms": [c * 1e3 for c in part.layer_costs], "profile_s": time.perf_counter() - t0}]
    dist.broadcast_object_list(plan, src=0)
    cut_info = plan[0]
    balance = cut_info["balance"]
    naive = [n_layers // 2, n_layers - n_layers // 2]
    _log(rank, f"  [{name}] m={m}: pipeddp balance {balance} (profiled stage ms "
               f"{[round(v, 1) for v in cut_info['stage_ms']]}), naive {naive}")

    configs: List[Config] = []
    if rank == 0:
        configs += plain_configs(model, x, y, m, loss_fn)
        for sched in opts["schedules"]:
            configs.append(replica_config(f"pipeddp-replica{'' if sched == '1f1b' else '-' + sched}", model, x, y, m,
                                          balance, sched, loss_fn))
    else:
        configs += [Config(nm, 1, None) for nm in ("whole-1t", "whole-2t", "accum")]
        configs += [Config(f"pipeddp-replica{'' if s == '1f1b' else '-' + s}", 1, None) for s in opts["schedules"]]
    configs.append(ddp_config(rank, model, x, y, loss_fn))
    for sched in opts["schedules"]:
        configs.append(stage_config(f"pipeddp-stage{'' if sched == '1f1b' else '-' + sched}", rank, model, x, y, m,
                                    balance, sched, loss_fn))

    # Correctness + warm-up: every configuration runs once; gradients are compared with accum's on rank 0.
    grads_ref: Dict[str, Grads] = {}
    check: Dict[str, Any] = {}

    def warm(cfg: Config) -> Dict[str, Any]:
        wall = _timed(cfg)[0]
        mine = cfg.grads() if cfg.step is not None else {}
        parts = _gather(rank, mine)
        if rank == 0:
            merged: Grads = {}
            for p in parts:
                merged.update(p or {})
            if cfg.name in ("accum", "whole-1t"):
                grads_ref[cfg.name] = merged
            entry = {"first_step_s": wall}
            for ref_name, ref in grads_ref.items():
                entry[f"grad_rel_diff_vs_{ref_name}"] = _rel_diff(ref, merged)
            check[cfg.name] = entry
        return {}

    for cfg in sorted(configs, key=lambda c: c.name != "accum"):  # accum first: the reference
        warm(cfg)
    tconfigs, torch_report = build_torch_configs(
        rank, model, x, y, m, {"cut": balance[0], "naive": naive[0]}, loss_fn, warm, opts["group_timeout"])
    configs += tconfigs
    if opts["probe"]:
        if rank == 0:
            solo, both = parallel_probe(STAGES)
        else:
            solo = both = None
        configs += [Config("host_solo", 1, solo), Config("host_both", 1, both)]
    if rank == 0:
        for cname, entry in check.items():
            d = entry.get("grad_rel_diff_vs_accum")
            if d is not None and d > 1e-4 and (cname not in ("whole-1t", "whole-2t", "ddp") or not opts["has_bn"]):
                print(f"  warning: {cname} gradients differ from accum by {d:.2e} (relative)", flush=True)
    del grads_ref

    names = [c.name for c in configs]
    # Rounds go on until every comparison that matters (each pipeddp configuration against accum, whole-1t and
    # each torch configuration) has `rounds` rounds in which both of its steps ran undisturbed, or the retry
    # budget is spent. A step is disturbed when other processes used more than max_foreign cores during it.
    pairs = [(pn, bn) for pn in names if pn.startswith("pipeddp")
             for bn in names if bn in ("accum", "whole-1t") or bn.startswith("torch-")]
    judged = [n for n in names if not n.startswith("host_")]  # the probe is too short for a CPU-time reading
    times: Dict[str, List[float]] = {n: [] for n in names}
    clean: Dict[str, List[bool]] = {n: [] for n in names}
    foreign_log: Dict[str, List[float]] = {n: [] for n in names}
    steal_log: Dict[str, List[float]] = {n: [] for n in names}
    idle_cpu: List[float] = []  # rank 1's CPU seconds per wall second while rank 0 ran a 1-process config
    # Every timed round records where each pipeline's time goes (a clock reading around every forward/backward
    # action: microseconds against steps of 100s of ms, paid by pipeddp and torch alike, in every round).
    infos: Dict[str, List[Any]] = {n: [] for n in names}
    t_start = time.perf_counter()
    warmup, rounds = opts["warmup"], opts["rounds"]
    limit = warmup + rounds + opts["max_retries"]
    attempt = 0
    while attempt < limit:
        k = attempt % len(configs)
        timed_round = attempt >= warmup
        got: Dict[str, Tuple[float, float, float, float]] = {}
        for cfg in configs[k:] + configs[:k]:
            if opts["trace"] and timed_round and cfg.instrument is not None:
                holder: Dict[str, Any] = {}

                def run(c: Config = cfg) -> None:
                    holder["t"] = _timed(c)

                infos[cfg.name].append(cfg.instrument(run))
                got[cfg.name] = holder["t"]
            else:
                got[cfg.name] = _timed(cfg)
        peer = _gather(rank, {n: v[1] for n, v in got.items()})
        verdict: List[Any] = [False]
        if rank == 0:
            for n in names:
                wall = max(got[n][0], 1e-9)
                # Foreign load: the machine's busy CPU minus what the two benchmark processes used.
                f = max(0.0, got[n][2] - got[n][1] - peer[1][n]) / wall
                if timed_round:
                    times[n].append(got[n][0])
                    foreign_log[n].append(f)
                    steal_log[n].append(got[n][3] / wall)
                    clean[n].append(f <= opts["max_foreign"])
            if timed_round:
                common = {pq: sum(1 for x, y in zip(clean[pq[0]], clean[pq[1]]) if x and y) for pq in pairs}
                enough = min(common.values(), default=len(times[names[0]])) >= rounds
                verdict = [enough]
                bad = [n for n in judged if not clean[n][-1]]
                tag = (f"{len(bad)} step(s) disturbed (other processes used up to "
                       f"{max(foreign_log[n][-1] for n in bad):.2f} cores)") if bad else "undisturbed"
                least = min(common.values(), default=0)
                print(f"    round {attempt + 1}: {tag}; fewest undisturbed pairs {least}/{rounds} "
                      f"({time.perf_counter() - t_start:.0f} s)", flush=True)
            else:
                print(f"    round {attempt + 1}: warm-up ({time.perf_counter() - t_start:.0f} s)", flush=True)
        if timed_round and rank == 1:
            idle_cpu += [got[c.name][1] / max(got[c.name][0], 1e-9) for c in configs if c.procs == 1]
        dist.broadcast_object_list(verdict, src=0)
        attempt += 1
        if verdict[0]:
            break
    idle = _gather(rank, idle_cpu)

    breakdown: Dict[str, Any] = {}
    if opts["trace"]:
        parts = _gather(rank, infos)
        if rank == 0:
            for cfg in configs:
                rounds_info = infos[cfg.name]
                if not rounds_info:
                    continue
                per_round = []
                for i, info in enumerate(rounds_info):
                    if cfg.procs == 2:
                        sts = sorted((p[cfg.name][i] for p in parts), key=lambda p: p["stage"])
                        sts = [{k: v for k, v in st.items() if k != "stage"} for st in sts]
                    else:
                        sts = info["stages"]
                    per_round.append(sts)
                use = [i for i, ok in enumerate(clean[cfg.name]) if ok] or list(range(len(per_round)))
                med = [{k: statistics.median(per_round[i][s][k] for i in use) for k in per_round[0][s]}
                       for s in range(len(per_round[0]))]
                breakdown[cfg.name] = {"step_ms": statistics.median(times[cfg.name][i] for i in use) * 1e3,
                                       "stages": med, "rounds": len(use)}

    for cfg in configs:
        cfg.close()
    dist.barrier()
    if rank != 0:
        return None
    return {
        "m": m,
        "microbatch_sizes": split_sizes(x.shape[0], chunks=m),
        "balance": balance,
        "naive_balance": naive,
        "profiled_stage_ms": cut_info["stage_ms"],
        "profiled_layer_ms": cut_info["layer_ms"],
        "profile_s": cut_info["profile_s"],
        "torch_pipelining": torch_report,
        "check": check,
        "rank1_idle_cpu_frac": statistics.median(idle[1]) if idle and idle[1] else None,
        "rounds_run": attempt - warmup if attempt > warmup else 0,
        "pairs_undisturbed": ({f"{a} / {b}": sum(1 for x, y in zip(clean[a], clean[b]) if x and y) for a, b in pairs}
                              if rank == 0 else {}),
        "undisturbed": clean,
        "foreign_cores": foreign_log,
        "steal_cores": steal_log,
        "breakdown": breakdown,
        "times_s": times,
        "max_foreign_cores": opts["max_foreign"],
    }


def job(settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The body of each of the 2 spawned processes."""
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=settings["timeout"]))
    torch.set_num_threads(1)
    out: Dict[str, Any] = {}
    for name in settings["models"]:
        work = WORKLOADS[name]
        torch.manual_seed(settings["seed"])
        model = work.build()
        model.train()
        x, y = work.batch()
        # Same weights and data on both ranks (same seed); verify by a checksum.
        with torch.no_grad():
            sig = (sum(float(p.double().sum()) for p in model.parameters()), float(x.double().sum()),
                   float(y.double().sum()))
        sigs: List[Any] = [None, None]
        dist.all_gather_object(sigs, sig)
        if sigs[0] != sigs[1]:
            raise RuntimeError(f"ranks built different models or data: {sigs}")
        rounds = settings["rounds"] if settings["rounds"] is not None else (1 if settings["quick"] else work.rounds)
        warmup = settings["warmup"] if settings["warmup"] is not None else (0 if settings["quick"] else work.warmup)
        retries = settings["max_retries"] if settings["max_retries"] is not None else (
            0 if settings["quick"] else work.max_retries)
        opts = {"rounds": rounds, "warmup": warmup, "schedules": settings["schedules"], "probe": settings["probe"],
                "max_retries": retries, "max_foreign": settings["max_foreign"],
                "trace": settings["trace"], "group_timeout": settings["group_timeout"],
                "has_bn": any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in model.modules())}
        _log(rank, f"{name}: {work.describe}; {rounds} rounds (+{warmup} warm-up)")
        t0 = time.perf_counter()
        rows = [run_m(rank, name, work, model, x, y, m, opts) for m in settings["ms"]]
        if rank == 0:
            out[name] = {"workload": work.describe, "input_shape": list(x.shape), "layers": len(model),
                         "rounds": rounds, "warmup": warmup, "elapsed_s": time.perf_counter() - t0, "by_m": rows}
        del model
    dist.barrier()
    return out if rank == 0 else None


# ---------------------------------------------------------------------------------------------------
# analysis and report (parent process)
# ---------------------------------------------------------------------------------------------------

PIPEDDP = ("pipeddp-replica", "pipeddp-stage")
TORCH = ("torch-gpipe@cut", "torch-1f1b@cut", "torch-gpipe@naive", "torch-1f1b@naive")


def _series(row: Dict[str, Any], name: str) -> Optional[str]:
    """The configuration whose times stand for ``name`` (following aliases: naive cut == pipeddp's cut)."""
    if name in row["times_s"]:
        return name
    rep = row["torch_pipelining"].get(name)
    if rep and rep.get("alias_of") and rep["alias_of"] in row["times_s"]:
        return rep["alias_of"]
    return None


def _clean_median_ms(row: Dict[str, Any], name: str) -> Optional[float]:
    """Median over the undisturbed steps of ``name`` (all steps if none was undisturbed)."""
    src = _series(row, name)
    if src is None:
        return None
    t = row["times_s"][src]
    ok = [v for v, c in zip(t, row["undisturbed"][src]) if c]
    return median_ms(ok or t)


def _pair_ratio(row: Dict[str, Any], base: str, other: str) -> Tuple[Optional[float], int]:
    """Median of base/other over the rounds where both steps were undisturbed (all rounds if there is none)."""
    b, o = _series(row, base), _series(row, other)
    if b is None or o is None:
        return None, 0
    tb, to = row["times_s"][b], row["times_s"][o]
    both = [i for i, (x, y) in enumerate(zip(row["undisturbed"][b], row["undisturbed"][o])) if x and y]
    use = both or list(range(len(tb)))
    return median_ratio([tb[i] for i in use], [to[i] for i in use]), len(both)


def analyse(row: Dict[str, Any]) -> Dict[str, Any]:
    """Medians (undisturbed steps) and per-round ratios (rounds where both steps were undisturbed)."""
    names = list(row["times_s"]) + [t for t in TORCH if t not in row["times_s"]]
    med = {n: _clean_median_ms(row, n) for n in names}
    bound = bubble_bound(len(row["microbatch_sizes"]), STAGES)
    speed: Dict[str, Dict[str, Any]] = {}
    for p in [n for n in row["times_s"] if n.startswith("pipeddp")]:
        entry: Dict[str, Any] = {"rounds": {}}
        for base in ("accum", "whole-1t", "whole-2t", "ddp") + TORCH:
            entry[base], entry["rounds"][base] = _pair_ratio(row, base, p)
        entry["bound"] = bound
        entry["efficiency"] = entry["accum"] / bound if entry["accum"] is not None else None
        speed[p] = entry
    torch_vs_accum = {t: _pair_ratio(row, "accum", t)[0] for t in TORCH}
    host = None
    if "host_solo" in row["times_s"]:  # too short for the CPU-time reading: every round counts
        host = median_ratio([STAGES * t for t in row["times_s"]["host_solo"]], row["times_s"]["host_both"])
    return {"median_ms": med, "bound": bound, "speedup": speed, "torch_speedup_vs_accum": torch_vs_accum,
            "accum_over_whole": _pair_ratio(row, "accum", "whole-1t")[0], "host_parallel_speedup": host}


def targets(model: str, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The issue's targets, per pipeddp mode: met / not met, with the numbers they were judged on."""
    out: List[Dict[str, Any]] = []
    for p in PIPEDDP:
        if not all(p in r["analysis"]["speedup"] for r in rows):
            continue
        effs = {r["m"]: r["analysis"]["speedup"][p]["efficiency"] for r in rows}
        out.append({"model": model, "mode": p, "target": ">= 95% of the bubble bound vs accumulation at every m",
                    "values": effs, "met": all(v is not None and v >= 0.95 for v in effs.values())})
        same = {r["m"]: {t: r["analysis"]["speedup"][p][t] for t in TORCH[:2]} for r in rows}
        never = all(v is not None and v >= 1.0 for d in same.values() for v in d.values())
        out.append({"model": model, "mode": p, "target": "never slower than torch pipelining with the same cut",
                    "values": same, "met": never})
        if 16 in same:
            v16 = same[16]
            out.append({"model": model, "mode": p, "target": ">= 1.1x faster than torch pipelining (same cut) at m=16",
                        "values": v16, "met": all(v is not None and v >= 1.1 for v in v16.values())})
        if model == "resnet50":
            naive = {r["m"]: {t: r["analysis"]["speedup"][p][t] for t in TORCH[2:]} for r in rows if r["m"] in (8, 16)}
            if naive:
                out.append({"model": model, "mode": p,
                            "target": ">= 1.2x faster than torch pipelining with the naive cut at m=8 and m=16",
                            "values": naive,
                            "met": all(v is not None and v >= 1.2 for d in naive.values() for v in d.values())})
    return out


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


SHORT = {"whole-1t": "whole 1t", "whole-2t": "whole 2t", "pipeddp-replica": "pdp replica", "pipeddp-stage": "pdp stage",
         "torch-gpipe@cut": "tGPipe @cut", "torch-1f1b@cut": "t1F1B @cut", "torch-gpipe@naive": "tGPipe @naive",
         "torch-1f1b@naive": "t1F1B @naive"}


def _short(name: str) -> str:
    return SHORT.get(name, name.replace("pipeddp-", "pdp "))


def report(name: str, res: Dict[str, Any], console: Console) -> None:
    rows = res["by_m"]
    cols = ["whole-1t", "whole-2t", "accum", "ddp", "pipeddp-replica", "pipeddp-stage"] + list(TORCH)
    extra = sorted({n for r in rows for n in r["times_s"] if n.startswith("pipeddp") and n not in cols})
    cols = cols[:6] + extra + cols[6:]
    print_table(
        f"{name}: ms per training step (median over undisturbed steps of the interleaved rounds)",
        ["m", "pipeddp cut", "naive cut", "rounds"] + [_short(c) for c in cols],
        [[r["m"], str(r["balance"]), str(r["naive_balance"]),
          f"{min(r['pairs_undisturbed'].values(), default=0)}/{r['rounds_run']}"]
         + [_ms(r["analysis"]["median_ms"].get(c)) for c in cols] for r in rows],
        console=console,
        caption=f"{res['workload']}. whole = plain model on the whole batch; accum = plain model over the m "
                "micro-batches (1 thread); ddp = 2 processes x half batch; pdp replica = pipeddp Pipeline with 2 stage "
                "threads in one process; pdp stage = pipeddp HybridParallel(mode='stage'), 2 processes; tGPipe / "
                "t1F1B = torch.distributed.pipelining ScheduleGPipe / Schedule1F1B given pipeddp's cut (@cut) or "
                "len(model)//2 (@naive). 1 intra-op thread everywhere except whole 2t. rounds = fewest undisturbed rounds of any "
                "pipeddp-vs-baseline pair / rounds run (a step during which other processes used more than "
                f"{rows[0]['max_foreign_cores']:.2f} cores is left out).",
    )
    srows = []
    for r in rows:
        a = r["analysis"]
        for i, p in enumerate(sorted(a["speedup"], key=lambda s: (s.replace("replica", "a"), s))):
            s = a["speedup"][p]
            srows.append([r["m"] if i == 0 else "", _short(p), _x(s["accum"]), _x(s["bound"]), f"{s['efficiency']:.0%}",
                          _x(s["whole-1t"]), _x(s["whole-2t"]), _x(s["ddp"])] + [_x(s[t]) for t in TORCH]
                         + [_x(a["host_parallel_speedup"]) if i == 0 else ""])
    print_table(
        f"{name}: pipeddp speedups (median of per-round ratios; > 1 = pipeddp faster)",
        ["m", "pipeddp", "vs accum", "bound", "efficiency", "vs whole 1t", "vs whole 2t", "vs ddp"]
        + [f"vs {_short(t)}" for t in TORCH] + ["host 2-core"],
        srows, console=console,
        caption="bound = 2m/(m+1) (fill/drain bubble, 2 stages); efficiency = (vs accum) / bound; host 2-core = "
                "a 1-thread matmul kernel on both cores at once vs alone, interleaved with the steps (ideal 2.00x)",
    )
    trows = []
    for r in rows:
        accum_ms = r["analysis"]["median_ms"]["accum"]
        for cname, b in r["breakdown"].items():
            st = b["stages"]
            busy = [s["F_ms"] + s["B_ms"] for s in st]
            trows.append([r["m"], _short(cname), f"{b['step_ms']:.0f}",
                          " / ".join(f"{s['F_ms']:.0f}+{s['B_ms']:.0f}" for s in st),
                          " / ".join(f"{max(0.0, 1 - v / b['step_ms']):.0%}" for v in busy),
                          f"{sum(busy) / accum_ms:.2f}", f"{max(busy) / (sum(busy) / len(busy)):.2f}"])
    if trows:
        print_table(
            f"{name}: where the pipelines' time goes (medians over the undisturbed rounds)",
            ["m", "config", "step ms", "stage0 / stage1 F+B ms", "idle s0 / s1", "busy / accum", "imbalance"],
            trows, console=console,
            caption="F/B = time inside each stage's forward/backward calls (torch: forward_one_chunk / "
                    "backward_one_chunk, incl. its bookkeeping; pipeddp: its traced F/B actions); idle = 1 - busy / "
                    "step; busy / accum = compute of both stages over the 1-thread accumulation (> 1: the same work "
                    "got slower, or extra work); imbalance = max stage busy / mean",
        )


def _source_state() -> Dict[str, Any]:
    """The git commit of the code measured, and whether pipeddp/ had uncommitted changes."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "pipeddp"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.split("\n")
        return {"commit": commit, "uncommitted_in_pipeddp": [ln[3:] for ln in dirty if ln.strip()]}
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": str(exc)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=None, choices=list(WORKLOADS),
                   help="default: mlp resnet50 (mlp with --quick)")
    p.add_argument("--ms", nargs="+", type=int, default=None,
                   help="numbers of micro-batches (default 2 4 8 16; 2 8 with --quick); must divide the batch")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per (model, m); default per model: "
                        + ", ".join(f"{k} {w.rounds}" for k, w in WORKLOADS.items()) + "; 1 with --quick")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed rounds before them; default per model: "
                        + ", ".join(f"{k} {w.warmup}" for k, w in WORKLOADS.items())
                        + "; 0 with --quick (the correctness step already runs every config once)")
    p.add_argument("--schedules", nargs="+", default=["1f1b"], choices=["1f1b", "gpipe"],
                   help="pipeddp schedules to time (default 1f1b, pipeddp's default); the first one is judged "
                        "against the targets")
    p.add_argument("--quick", action="store_true", help="smoke run: mlp, m = 2 8, 1 round, no warm-up round")
    p.add_argument("--no-trace", action="store_true", help="do not record the per-stage forward/backward breakdown")
    p.add_argument("--no-probe", action="store_true", help="skip the host parallelism probe (~50 ms per round)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole spawned job")
    p.add_argument("--group-timeout", type=float, default=60.0,
                   help="seconds a torch-pipelining rank waits for its peer before giving up (failure detection)")
    p.add_argument("--max-foreign", type=float, default=0.15,
                   help="a round in which other processes used more than this many cores (averaged over any one "
                        "step) is dropped and run again (default 0.15)")
    p.add_argument("--max-retries", type=int, default=None,
                   help="extra rounds allowed per (model, m) to replace dropped ones; default per model: "
                        + ", ".join(f"{k} {w.max_retries}" for k, w in WORKLOADS.items()) + "; 0 with --quick")
    p.add_argument("--out", default="results/hybrid_cpu.json")
    args = p.parse_args(argv)
    if args.models is None:
        args.models = ["mlp"] if args.quick else list(WORKLOADS)
    if args.ms is None:
        args.ms = [2, 8] if args.quick else [2, 4, 8, 16]
    if any(m < STAGES for m in args.ms):
        p.error(f"--ms values must be >= {STAGES} (torch's Schedule1F1B needs at least one micro-batch per stage)")
    for name in args.models:
        n = WORKLOADS[name].batch()[0].shape[0]
        bad = [m for m in args.ms if n % m]
        if bad:
            p.error(f"{name}: batch {n} is not divisible by m={bad} (torch pipelining needs equal micro-batches)")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be >= 0")
    schedules = list(dict.fromkeys(args.schedules))
    if schedules[0] != "1f1b" and "1f1b" in schedules:
        schedules.remove("1f1b")
        schedules.insert(0, "1f1b")

    console = Console(width=max(190, Console().width))
    settings = {"models": args.models, "ms": args.ms, "rounds": args.rounds, "warmup": args.warmup,
                "schedules": schedules, "quick": args.quick, "trace": not args.no_trace, "probe": not args.no_probe,
                "seed": args.seed, "timeout": args.timeout, "group_timeout": args.group_timeout,
                "max_foreign": args.max_foreign, "max_retries": args.max_retries}
    started = time.perf_counter()
    source = _source_state()  # the code the spawned job imports now
    results = pipeddp.spawn(job, STAGES, args=(settings,), timeout=args.timeout, threads=1)
    res = results[0]
    all_targets: List[Dict[str, Any]] = []
    for name in args.models:
        for row in res[name]["by_m"]:
            row["analysis"] = analyse(row)
        report(name, res[name], console)
        tg = targets(name, res[name]["by_m"])
        res[name]["targets"] = tg
        all_targets += tg
        fails = {k: v for r in res[name]["by_m"] for k, v in r["torch_pipelining"].items()
                 if any(not a["ok"] for a in v["attempts"])}
        for k, v in fails.items():
            console.print(f"[yellow]{name}: {k} failed on cut(s) "
                          f"{[a['cut'] for a in v['attempts'] if not a['ok']]}, used cut {v['used_cut']}[/yellow]")
        for r in res[name]["by_m"]:
            used = [f for n, fl in r["foreign_cores"].items() if not n.startswith("host_")
                    for f, ok in zip(fl, r["undisturbed"][n]) if ok]
            steal = [v for n, sl in r["steal_cores"].items() if not n.startswith("host_") for v in sl]
            left = sum(1 for n, fl in r["undisturbed"].items() if not n.startswith("host_") for ok in fl if not ok)
            console.print(f"{name} m={r['m']}: {r['rounds_run']} timed rounds, {left} disturbed step(s) left out; "
                          f"other processes used at most {max(used, default=0):.2f} cores during the steps kept; "
                          f"hypervisor steal median {statistics.median(steal) if steal else 0:.2f}, "
                          f"max {max(steal, default=0):.2f} cores")
        idle = [r["rank1_idle_cpu_frac"] for r in res[name]["by_m"] if r["rank1_idle_cpu_frac"] is not None]
        if idle:
            console.print(f"{name}: rank 1 used {max(idle):.1%} of a core (worst median over an m) while waiting in "
                          "the barrier during rank 0's single-process steps")
    if all_targets:
        def fmt_values(v: Any) -> str:
            if isinstance(v, dict):
                return ", ".join(f"{k}: {fmt_values(x)}" for k, x in v.items())
            return "-" if v is None else f"{v:.2f}"

        print_table("targets from the issue (pipeddp's default 1F1B schedule)", ["model", "pipeddp", "target", "met", "values"],
                    [[t["model"], t["mode"], t["target"], "met" if t["met"] else "NOT met", fmt_values(t["values"])]
                     for t in all_targets], console=console)
    elapsed = time.perf_counter() - started
    out = write_json(args.out, {
        "pipeddp_source": source,
        "benchmark": "hybrid_cpu",
        "settings": {"stages": STAGES, "threads_per_process_or_stage": 1, "models": args.models, "ms": args.ms,
                     "pipeddp_schedules": schedules, "quick": args.quick, "seed": args.seed,
                     "timing": "one spawned 2-process gloo job; every configuration once per round in a rotating "
                               "order, timed on rank 0 between barriers; speedups are medians of per-round ratios",
                     "optimizer_step": False, "zero_grad": "set_to_none each step"},
        "elapsed_s": elapsed,
        "targets": all_targets,
        "models": res,
    })
    console.print(f"wrote {out} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
