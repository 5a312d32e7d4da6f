"""Where a training step's time goes: per kind of parallelism, split into forward and backward (the classic
table, one spawned 2-process gloo job), and (``--cuts``, one process) per stage of pipeddp's cut and of uniform,
params and block-move cuts, every stage timed on its real activation. See benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks import baselines, common
from benchmarks.baselines import layers, mb_text
from benchmarks.common import LossFn, Run, fmt, gather, here, log0, median_ms, median_ratio, on_rank0, timed_call
from benchmarks.workloads import WORKLOADS, Workload, add_round_flags, names
from pipeddp.partitioning.solve import block_move
from pipeddp.runtime.microbatch import split_sizes

SCRIPT, CUTS = "iteration_table", "partition_quality"
STAGES = 2
PROCS = 2
METHODS = ["pipeddp", "uniform", "params", "block-move"]
Key = Tuple[int, int]  # layers a..b-1


def recorded(step: baselines.Step, chunks: int, layout: str, batch: int) -> baselines.Step:
    """``step``, returning its phases: timed directly for the plain model and DDP, from the trace for pipeddp.
    ``chunks``: micro-batches per process (the row is checked against accumulation over ``chunks * procs``)."""
    per_proc = step.info.get("batch_per_process", batch)
    step.info.update(equivalent_chunks=chunks * step.procs, procs_x_threads=layout, batch_per_process=per_proc,
                     microbatch_sizes=split_sizes(per_proc, chunks=chunks))
    if step.run is None:
        return step
    inner = step.run

    def run() -> Dict[str, float]:
        """The lead (before the first forward) and the forward span, traced (pipeddp) or timed directly."""
        trace = getattr(step.module, "trace", None)
        if trace is not None:
            trace.clear()
        t0 = time.perf_counter()
        inner()
        if trace is None:
            return {"lead": step.info["phases"]["lead"], "fwd": step.info["phases"]["fwd"]}
        fs = [s for s in trace.spans if s.lane == "compute" and s.kind == "F"]
        return {"lead": min(s.start for s in fs) - t0, "fwd": max(s.end for s in fs) - min(s.start for s in fs)}

    return dataclasses.replace(step, run=run)


def build(rank: int, model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: Any,
          cuts: Dict[str, Any], settings: Dict[str, Any]) -> List[baselines.Step]:
    """The rows; 1-process ones run on rank 0 while rank 1 stands by."""
    m, hc, piped = settings["chunks"], cuts["hybrid_chunks"], f"1 x {STAGES} stage thr"
    n = x.shape[0]
    steps = [recorded(baselines.whole(model, x, y, loss_fn, name="one device") if rank == 0
                      else baselines.idle("one device"), 1, "1 x 1", n),
             recorded(baselines.ddp(model, x, y, loss_fn, name="DDP N=2"), 1, f"{PROCS} x 1", n)]
    for sched in settings["schedules"]:
        tag = "" if sched == "gpipe" else f" ({sched})"
        local = [("naive MP", 1, cuts["naive"])] if sched == "gpipe" else []
        for name, chunks, balance in local + [(f"pipeline{tag}", m, cuts["pipeline"])]:
            steps.append(recorded(baselines.pipeline(model, x, y, loss_fn, chunks=chunks, balance=balance,
                                                     schedule=sched, trace=True, name=name) if rank == 0
                                  else baselines.idle(name), chunks, piped, n))
        hybrid = baselines.hybrid(model, x, y, loss_fn, chunks=hc, balance=cuts["pipeline"], schedule=sched,
                                  trace=True, name=f"hybrid 2x2{tag}")
        steps.append(recorded(hybrid, hc,
                              f"{PROCS} x {STAGES} stage thr ({PROCS * STAGES} on {os.cpu_count()} cores)", n))
    return steps


def profiled_cuts(model: torch.nn.Sequential, x: torch.Tensor, m: int) -> Dict[str, Any]:
    """pipeddp's cuts, profiled at the micro-batch each configuration runs (on rank 0; ``on_rank0`` sends them)."""
    n, mb, t0 = x.shape[0], split_sizes(x.shape[0], chunks=m)[0], time.perf_counter()
    naive = pipeddp.partition(model, STAGES, method="time", sample=x, chunks=1)
    piped = pipeddp.partition(model, STAGES, method="time", sample=x[:mb], chunks=1)
    c = {"naive": list(naive.balance), "naive_stage_ms": [c * 1e3 for c in naive.stage_costs],
         "pipeline": list(piped.balance), "pipeline_stage_ms": [c * 1e3 for c in piped.stage_costs],
         "profiled_at": {"naive": n, "pipeline": mb}, "profile_s": time.perf_counter() - t0,
         "microbatch": mb, "hybrid_chunks": max(1, len(split_sizes(n // PROCS, split_size=mb)))}
    log0(f"  cuts: naive MP {c['naive']} at micro-batch {n} (stage ms {[round(v) for v in c['naive_stage_ms']]}), "
         f"pipeline/hybrid {c['pipeline']} at micro-batch {mb} ({[round(v) for v in c['pipeline_stage_ms']]}), "
         f"{c['profile_s']:.0f} s")
    return c


def job(settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    rank = common.init_job(settings["timeout"], settings["device"])
    work = WORKLOADS[settings["model"]]
    model, x, y = work.seeded(settings["batch"], settings["seed"], settings["side"])
    common.check_same(model, x, y)
    cuts = on_rank0(lambda: profiled_cuts(model, x, settings["chunks"]))
    steps = build(rank, model, x, y, work.loss_fn, cuts, settings)

    @functools.lru_cache(maxsize=None)
    def accumulation(k: int) -> Any:  # a row's reference: accumulation over its equivalent micro-batches (rank 0)
        ref = baselines.accumulate(model, x, y, work.loss_fn, k)
        ref()
        return ref.grads()

    checked = baselines.check_grads(steps, lambda step: accumulation(step.info["equivalent_chunks"]), "accum")
    times, recs = common.barrier_rounds({s.name: s.run for s in steps}, settings["rounds"], settings["warmup"])
    for step in steps:
        step.close()
    everyone = gather({"recs": recs})
    dist.barrier()
    if rank != 0:
        return None
    return {"describe": work.describe(x.shape[0], settings["side"]), "input_shape": list(x.shape), "cuts": cuts,
            "chunks": settings["chunks"], "microbatch": cuts["microbatch"], "hybrid_chunks": cuts["hybrid_chunks"],
            "walls": {k: [t.wall for t in v] for k, v in times.items()}, "ranks": everyone, "check": checked,
            "configs": [{"name": s.name, "procs": s.procs, **{k: v for k, v in s.info.items() if k != "phases"}}
                        for s in steps]}


def analyse(res: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per configuration: median fwd / bwd / other / step (ms) over the rounds."""
    walls, base = res["walls"], res["walls"]["one device"]
    rows = []
    for cfg in res["configs"]:
        name = cfg["name"]
        lead, fwd, bwd = [], [], []  # per round: the slowest rank's (replicas and DDP ranks run alike)
        for i, wall in enumerate(walls[name]):
            recs = [rk["recs"][name][i] for rk in res["ranks"] if rk["recs"][name][i] is not None]
            lead.append(max(r["lead"] for r in recs))
            fwd.append(max(r["fwd"] for r in recs))
            bwd.append(wall - lead[-1] - fwd[-1])
        separable = cfg.get("schedule", "gpipe") == "gpipe"
        rows.append({**cfg, "separable": separable, "step_ms": median_ms(walls[name]),
                     **{f"{k}_ms": median_ms(v) if separable else None
                        for k, v in (("fwd", fwd), ("bwd", bwd), ("other", lead))},
                     "speedup_vs_one_device": median_ratio(base, walls[name]),
                     "speedup_per_round": [b / w for b, w in zip(base, walls[name])], "rounds": len(walls[name])})
    return rows


def report(res: Dict[str, Any], rows: List[Dict[str, Any]], rounds: int, run: Run) -> None:
    table = [[r["name"], r["procs_x_threads"], f"{r['batch_per_process']}{'/proc' if r['procs'] > 1 else ''}",
              mb_text(r["microbatch_sizes"]), str(r.get("balance", "-")), fmt(r["fwd_ms"]), fmt(r["bwd_ms"]),
              fmt(r["other_ms"]), fmt(r["step_ms"]), f"{r['speedup_vs_one_device']:.2f}x",
              f"{min(r['speedup_per_round']):.2f}-{max(r['speedup_per_round']):.2f}"] for r in rows]
    run.table(f"ms per iteration (forward + backward), median of {rounds} interleaved rounds",
              ["config", "processes x threads", "batch", "micro-batches", "balance", "fwd ms", "bwd ms", "other ms",
               "step ms", "vs one device", "range"], table,
              caption=f"{res['describe']}. GPipe rows: fwd = first F start to last F end, bwd = the rest (all-reduce "
                      "and waiting included), other = before the first F; range: lowest-highest per-round speedup")


def ranges(balance: Sequence[int]) -> List[Key]:
    """The (first, end) layers of every stage of a cut."""
    return [(sum(balance[:i]), sum(balance[:i + 1])) for i in range(len(balance))]


class Segment:
    """Layers a..b-1 timed as a pipeline stage runs them: forward from the activation at layer a (on stage
    0 a copy, elsewhere a leaf that receives a gradient, copied first if the first layer works in place),
    then backward from the loss on the last stage, else from a fixed gradient of the stage's output."""

    def __init__(self, model: torch.nn.Sequential, key: Key, acts: List[torch.Tensor], y: torch.Tensor,
                 loss_fn: LossFn) -> None:
        a, b = key
        self.module = layers(model, a, b)
        self.leaf = acts[a].detach().requires_grad_(a != 0)
        self.copy = a == 0 or getattr(self.module[0], "inplace", False)
        self.y, self.loss_fn = y, loss_fn
        self.grad = None if b == len(model) else torch.randn_like(acts[b])

    def __call__(self) -> float:
        self.module.zero_grad(set_to_none=True)  # as each step does: the first backward allocates
        self.leaf.grad = None
        return timed_call(self._step)[0]

    def _step(self) -> None:
        out = self.module(self.leaf.clone() if self.copy else self.leaf)
        if self.grad is None:
            self.loss_fn(out, self.y).backward()
        else:
            out.backward(self.grad)


def cut_options(model: torch.nn.Sequential, x: torch.Tensor, stages: int) -> Tuple[Dict[str, Any], List[float]]:
    """The four cuts at ``stages``, each with the ratio its own profile predicts (bottleneck / ideal)."""
    part = pipeddp.partition(model, stages, method="time", sample=x, chunks=1)
    costs = list(part.layer_costs)
    out = {"pipeddp": {"balance": list(part.balance)},
           "uniform": {"balance": list(pipeddp.partition(model, stages, method="uniform").balance)},
           "params": {"balance": list(pipeddp.partition(model, stages, method="params").balance)},
           "block-move": {"balance": block_move(costs, stages)}}
    for c in out.values():
        stage = [sum(costs[a:b]) for a, b in ranges(c["balance"])]
        c["predicted_ratio"] = max(stage) / (sum(costs) / stages)
        c["predicted_stage_ms"] = [v * 1e3 for v in stage]
    return out, costs


def measure(model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, keys: List[Key], loss_fn: LossFn,
            rounds: int) -> Dict[Key, List[float]]:
    """Seconds per round of every stage in ``keys``, interleaved (rotated by a stride, so neighbours change)."""
    with torch.no_grad():
        acts, h = [x], x
        for layer in model:
            h = layer(h.clone())
            acts.append(h)
    segs = {k: Segment(model, k, acts, y, loss_fn) for k in keys}
    for seg in segs.values():
        seg()  # warm-up: every stage once
    times: Dict[Key, List[float]] = {k: [] for k in keys}
    for r in range(rounds):
        s = (r * 7) % len(keys)
        for key in keys[s:] + keys[:s]:
            times[key].append(segs[key]())
    return times


def run_model(work: Workload, stage_counts: Sequence[int], rounds: int, seed: int, run: Run) -> Dict[str, Any]:
    """Cut, then measure every distinct stage of every cut (and the whole model) round by round."""
    model, x, y = work.seeded(work.batch[CUTS], seed)
    model, x, y = model.to(here()), x.to(here()), y.to(here())  # profiled and timed on the benchmark's device
    n = len(model)
    stage_counts = [s for s in stage_counts if s <= n]
    by_s = {s: cut_options(model, x, s) for s in stage_counts}
    keys = sorted({(0, n)} | {k for s in stage_counts for c in by_s[s][0].values() for k in ranges(c["balance"])})
    times = measure(model, x, y, keys, work.loss_fn, rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    whole = med[(0, n)]
    rows: List[Dict[str, Any]] = []
    for s in stage_counts:
        for meth in METHODS:
            c = by_s[s][0][meth]
            stage_ms = [med[k] * 1e3 for k in ranges(c["balance"])]
            rows.append({"model": work.name, "stages": s, "method": meth, "balance": c["balance"],
                         "measured_stage_ms": stage_ms, "measured_bottleneck_ms": max(stage_ms),
                         "ideal_ms": whole * 1e3 / s, "measured_ratio": max(stage_ms) / (whole * 1e3 / s),
                         "predicted_ratio": c["predicted_ratio"], "predicted_stage_ms": c["predicted_stage_ms"]})
    return {"workload": work.describe(x.shape[0]), "layers": n, "input_shape": list(x.shape), "rounds": rounds,
            "whole_ms": whole * 1e3,
            "profile_layer_ms": {s: [c * 1e3 for c in by_s[s][1]] for s in stage_counts},
            "rows": rows, "stage_times_s": {f"{a}-{b}": v for (a, b), v in times.items()}}


def cuts_report(results: Dict[str, Any], run: Run) -> None:
    table: List[List[Any]] = []
    for name, res in results.items():
        counts = sorted({r["stages"] for r in res["rows"]})
        for s in counts:
            rows = [r for r in res["rows"] if r["stages"] == s]
            best = min(r["measured_ratio"] for r in rows)
            table += [[name if i == 0 and s == counts[0] else "", s if i == 0 else "", r["method"], str(r["balance"]),
                       f"{r['predicted_ratio']:.2f}",
                       f"{r['measured_ratio']:.2f}" + (" *" if r["measured_ratio"] == best else ""),
                       " / ".join(f"{v:.0f}" for v in r["measured_stage_ms"]), f"{r['ideal_ms']:.0f}"]
                      for i, r in enumerate(rows)]
    run.table("partition quality: bottleneck stage / ideal (1.00 = perfect split), measured vs predicted",
              ["model", "stages", "cut", "balance", "predicted", "measured", "measured stage ms (fwd+bwd)", "ideal ms"],
              table,
              caption="measured = largest median stage time / (whole model's / stages); predicted: the same from the "
                      "profile pipeddp cut with; * = best measured. "
                      + "; ".join(f"{k}: {v['workload']}, {v['rounds']} rounds" for k, v in results.items()))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = common.parser(__doc__, "3x32x32, 1 round (--cuts: resnet18 + mlp, 2 and 4 stages, 2 rounds)", spawns=True)
    p.add_argument("--cuts", action="store_true", help="the cuts' stage times against each other (one process)")
    p.add_argument("--models", nargs="+", default=None, choices=names(CUTS),
                   help="default resnet50 (--cuts: resnet50 resnet18 mlp; resnet18 mlp with --quick)")
    p.add_argument("--stages", nargs="+", type=common.at_least(1), default=None,
                   help="--cuts: stage counts (default 2 3 4; 2 4 with --quick)")
    p.add_argument("--side", type=int, default=None, help="image side (default 64; 32 with --quick)")
    p.add_argument("--batch", type=int, default=128, help="global batch (default 128; must be even)")
    p.add_argument("--chunks", type=int, default=8, help="pipeline micro-batches m (default 8: 16 samples each); "
                                                         "the hybrid uses micro-batches of the same size")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"],
                   help="gpipe gives the table's fwd/bwd split; 1f1b adds step-time-only rows (default both)")
    p.add_argument("--classic", action="store_true", help="the classic DDP layout: resnet50, 3x224x224, batch 128 "
                   "per replica (a GPU's workload: a full run takes hours on a small CPU)")
    add_round_flags(p, SCRIPT, "timed rounds (--cuts: measurement rounds, " + ", ".join(
        f"{k} {WORKLOADS[k].rounds[CUTS]}" for k in names(CUTS)) + "; 2 with --quick)", warmup=False)
    p.add_argument("--warmup", type=common.at_least(0), default=None, help="untimed rounds (default 1; 0 with "
                   "--quick); the checked step of every configuration always runs first")
    args = p.parse_args(argv)
    if args.cuts:
        torch.set_num_threads(1)
        models = args.models or (["resnet18", "mlp"] if args.quick else ["resnet50", "resnet18", "mlp"])
        stage_counts = sorted(set(args.stages or ([2, 4] if args.quick else [2, 3, 4])))
        run = Run(CUTS, args)
        results = {name: run_model(WORKLOADS[name], stage_counts, WORKLOADS[name].rounds_of(CUTS, args, 2)[0],
                                   args.seed, run) for name in models}
        cuts_report(results, run)
        run.finish({"models": models, "stages": stage_counts, "threads": 1}, models=results)
        return 0
    args.model = (args.models or ["resnet50"])[0]
    args.schedules = ["gpipe"] + [s for s in dict.fromkeys(args.schedules) if s != "gpipe"]  # gpipe: fwd/bwd split
    if args.classic:
        args.model, args.batch = "resnet50", (8 if args.quick else 128) * PROCS
        args.side = args.side or (32 if args.quick else 224)
    args.side = args.side or (32 if args.quick else 64)
    args.rounds = WORKLOADS[args.model].rounds_of(SCRIPT, args)[0]
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    if args.batch < 2 or args.batch % PROCS or args.chunks < 1:
        p.error("need an even --batch and --chunks >= 1")
    run = Run(SCRIPT, args, common.BARRIER)
    res = pipeddp.spawn(job, PROCS, args=(vars(args),), timeout=args.timeout, threads=1)[0]
    rows = analyse(res)
    report(res, rows, args.rounds, run)
    run.finish({"processes": PROCS, "stages": STAGES, "threads": 1, "hybrid_mode": "replica"}, rows=rows,
               cuts=res["cuts"], check=res["check"], raw=res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
