"""The classic table: time per training iteration, split into forward and backward, per kind of parallelism.

One device, DDP, naive MP, the pipeline and a 2x2 hybrid, under GPipe (forward and backward separable) and
1F1B, in one spawned 2-process gloo job timed between barriers. See benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks import baselines, common
from benchmarks.baselines import WORKLOADS, mb_text, names
from benchmarks.common import Run, fmt, gather, log0, median_ms, median_ratio, on_rank0
from pipeddp.runtime.microbatch import split_sizes

SCRIPT = "iteration_table"
STAGES = 2
PROCS = 2


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
        """The step's lead (before the first forward) and forward span (first forward start to last forward end),
        from pipeddp's trace, or timed directly for the plain model and DDP."""
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = common.parser(__doc__, "3x32x32, 1 round", spawns=True)
    p.add_argument("--model", default="resnet50", choices=names(SCRIPT))
    p.add_argument("--side", type=int, default=None, help="image side (default 64; 32 with --quick)")
    p.add_argument("--batch", type=int, default=128, help="global batch (default 128; must be even)")
    p.add_argument("--chunks", type=int, default=8, help="pipeline micro-batches m (default 8: 16 samples each); "
                                                         "the hybrid uses micro-batches of the same size")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"],
                   help="gpipe gives the table's fwd/bwd split; 1f1b adds step-time-only rows (default both)")
    p.add_argument("--classic", action="store_true", help="the classic DDP layout: resnet50, 3x224x224, batch 128 "
                   "per replica (a GPU's workload: a full run takes hours on a small CPU)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 8; 1 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds before them (default 1; 0 with --quick); "
                   "the checked step of every configuration always runs first")
    args = p.parse_args(argv)
    args.schedules = ["gpipe"] + [s for s in dict.fromkeys(args.schedules) if s != "gpipe"]  # gpipe: fwd/bwd split
    if args.classic:
        args.model, args.batch = "resnet50", (8 if args.quick else 128) * PROCS
        args.side = args.side or (32 if args.quick else 224)
    args.side = args.side or (32 if args.quick else 64)
    args.rounds = args.rounds if args.rounds is not None else 1 if args.quick else WORKLOADS[args.model].rounds[SCRIPT]
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    if args.batch < 2 or args.batch % PROCS or args.chunks < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("need an even --batch, --chunks >= 1, --rounds >= 1 and --warmup >= 0")
    run = Run(SCRIPT, args, common.BARRIER)
    res = pipeddp.spawn(job, PROCS, args=(vars(args),), timeout=args.timeout, threads=1)[0]
    rows = analyse(res)
    report(res, rows, args.rounds, run)
    run.finish({"processes": PROCS, "stages": STAGES, "threads": 1, "hybrid_mode": "replica"}, rows=rows,
               cuts=res["cuts"], check=res["check"], raw=res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
