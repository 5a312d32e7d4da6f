"""How much a 2-stage CPU pipeline speeds up one training step, against accumulation and the whole batch.

Per (model, m): the plain model, accumulation over the same m micro-batches and the pipeline under each
schedule, interleaved; one traced step per pipeline shows where its time goes. ``--precision``: the plain model
and the pipeline in float32 and under bfloat16 autocast, and the pipeline with ``compile=True`` (compiled during
the check step), interleaved. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
from benchmarks import baselines
from benchmarks.baselines import mb_text
from benchmarks.common import Run, here, interleaved, median_ms, median_ratio, parser, timed_call
from benchmarks.workloads import WORKLOADS, Workload, add_round_flags, check_rounds, mlp_workload, names
from pipeddp.runtime.schedule import get_schedule, play
from pipeddp.tools.simulate import bubble_bound

SCRIPT = "pipeline_cpu"
STAGES = 2


def trace_step(step: baselines.Step, m: int, accum_ms: float) -> Dict[str, Any]:
    """One traced pipeline step, split per stage into forward, backward and idle time. ``predicted_ms`` replays the
    schedule with the measured action durations and free transfers: the gap to the traced makespan is the
    executor's own cost (thread hand-offs, waking the peer)."""
    wall: List[float] = []
    spans = baselines.record(step.module, lambda: wall.append(timed_call(step, step.name)[0]))
    spans = [s for s in spans if s.lane == "compute"]
    makespan = (max(s.end for s in spans) - min(s.start for s in spans)) * 1e3
    stages = list(baselines.stage_breakdown(spans).values())
    durations = {(s.stage, s.kind, s.mb): s.duration for s in spans}
    plan = get_schedule(step.info["schedule"], STAGES, m)
    predicted = play(plan, duration=lambda st, a: durations[(st, a.kind, a.mb)]).makespan * 1e3
    return {"step_ms": wall[0] * 1e3, "makespan_ms": makespan, "stages": stages, "predicted_ms": predicted,
            "busy_over_accum": sum(s["F_ms"] + s["B_ms"] for s in stages) / accum_ms,
            "makespan_over_predicted": makespan / predicted, "cells": baselines.split_cells(stages, makespan, accum_ms)}


def build_steps(model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, work: Workload, m: int,
                schedules: Sequence[str], run: Run) -> Dict[str, baselines.Step]:
    """whole, accum and one pipeline per schedule; the first pipeline profiles and cuts (balance="time"),
    the others reuse its cut, so that profiling noise cannot tell the schedules apart."""
    steps = {"whole": baselines.whole(model, x, y, work.loss_fn),
             "accum": baselines.accumulate(model, x, y, work.loss_fn, m)}
    balance: Any = "time"
    for sched in schedules:
        t0 = time.perf_counter()
        steps[sched] = baselines.pipeline(model, x, y, work.loss_fn, chunks=m, balance=balance, sample=x,
                                          schedule=sched, name=sched)
        steps[sched].info["build_s"] = time.perf_counter() - t0
        balance = steps[sched].info["balance"]
    first = steps[schedules[0]]
    stage_ms = [round(c * 1e3, 1) for c in first.module.partition.stage_costs]
    run.console.print(f"  {work.name} m={m}: micro-batches {mb_text(steps['accum'].info['microbatch_sizes'])}, balance "
                      f"{balance} (profiled stage ms {stage_ms}), build {first.info['build_s']:.1f} s")
    return steps


def run_m(work: Workload, model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int,
          schedules: Sequence[str], rounds: int, warmup: int, args: argparse.Namespace, run: Run) -> Dict[str, Any]:
    """Everything measured for one (model, m); the pipelines are built and closed here."""
    steps = build_steps(model, x, y, work, m, schedules, run)
    try:
        # BatchNorm sees micro-batches: only the pipelines must match accumulation, not the whole batch
        checked = baselines.check_grads(list(steps.values()), "accum", "accum", exempt=["whole"])
        fns: Dict[str, Callable[[], Any]] = dict(steps)
        if not args.no_probe:
            fns["host_solo"], fns["host_both"] = baselines.parallel_probe(STAGES)
        times = interleaved(fns, rounds=rounds, warmup=warmup)
        medians = {k: median_ms(v) for k, v in times.items()}
        trace = {} if args.no_trace else {s: trace_step(steps[s], m, medians["accum"]) for s in schedules}
    finally:
        for step in steps.values():
            step.close()
    bound = bubble_bound(STAGES, m)
    vs_accum = {s: median_ratio(times["accum"], times[s]) for s in schedules}
    first = steps[schedules[0]]
    return {"m": m, "microbatch_sizes": steps["accum"].info["microbatch_sizes"], "balance": first.info["balance"],
            "profiled_stage_ms": [c * 1e3 for c in first.module.partition.stage_costs],
            "build_s": {s: steps[s].info["build_s"] for s in schedules}, "median_ms": medians,
            "accum_over_whole": median_ratio(times["accum"], times["whole"]),
            "speedup_vs_whole": {s: median_ratio(times["whole"], times[s]) for s in schedules},
            "speedup_vs_accum": vs_accum, "bound": bound, "efficiency": {s: vs_accum[s] / bound for s in schedules},
            "host_parallel_speedup": None if args.no_probe else baselines.probe_speedup(times["host_solo"],
                                                                                        times["host_both"]),
            "check": checked, "trace": trace, "times_s": times}


def report(work: Workload, n: int, rows: List[Dict[str, Any]], schedules: Sequence[str], rounds: int,
           run: Run) -> Dict[str, Any]:
    """Print the speedup table and the traced breakdown; return the best m against the whole batch."""
    table: List[List[Any]] = []
    for r in rows:
        for i, s in enumerate(schedules):
            host = r["host_parallel_speedup"]
            head = [r["m"], r["microbatch_sizes"][0], str(r["balance"]), f"{r['median_ms']['whole']:.1f}",
                    f"{r['median_ms']['accum']:.1f}", f"{r['accum_over_whole']:.2f}x"] if i == 0 else [""] * 6
            table.append(head + [s, f"{r['median_ms'][s]:.1f}", f"{r['speedup_vs_whole'][s]:.2f}x",
                                 f"{r['speedup_vs_accum'][s]:.2f}x", f"{r['bound']:.2f}x", f"{r['efficiency'][s]:.0%}",
                                 (f"{host:.2f}x" if host is not None else "-") if i == 0 else ""])
    run.table(f"{work.name}: 2-stage CPU pipeline, 1 thread per stage; medians of {rounds} interleaved rounds",
              ["m", "mb", "balance", "whole ms", "accum ms", "accum/whole", "schedule", "pipe ms", "vs whole",
               "vs accum", "bound", "efficiency", "host 2-core"], table,
              caption=f"{work.describe(n)}. vs whole/accum: median per-round speedup of the pipeline; bound = "
                      "2m/(m+1); efficiency = (vs accum) / bound; host 2-core = a 1-thread matmul kernel on both cores "
                      "at once over one (ideal 2.00x)")
    traced = [(r, s, r["trace"][s]) for r in rows for s in schedules if s in r["trace"]]
    if traced:
        run.table(f"{work.name}: where the pipeline's time goes (one traced step per row)",
                  ["m", "schedule", "step ms"] + baselines.SPLIT_COLUMNS + ["replayed ms", "makespan / replayed"],
                  [[r["m"], s, t["step_ms"]] + t["cells"] + [t["predicted_ms"], t["makespan_over_predicted"]]
                   for r, s, t in traced],
                  caption="idle = 1 - busy / makespan; imbalance = max stage busy / mean; replayed = the schedule "
                          "replayed with these action durations and free hand-offs")
    r, s = max(((r, s) for r in rows for s in schedules), key=lambda rs: rs[0]["speedup_vs_whole"][rs[1]])
    best = {"m": r["m"], "schedule": s, "speedup_vs_whole": r["speedup_vs_whole"][s],
            "speedup_vs_accum": r["speedup_vs_accum"][s]}
    run.console.print(f"[bold]{work.name}[/bold]: best against the plain whole-batch model: m={best['m']} ({s}), "
                      f"{best['speedup_vs_whole']:.2f}x vs whole, {best['speedup_vs_accum']:.2f}x vs accumulation\n")
    return best


def autocast(step: baselines.Step, dtype: torch.dtype = torch.bfloat16) -> baselines.Step:
    """The same step, run under autocast on the benchmark's device type."""
    inner = step.run

    def run() -> Any:
        with torch.autocast(here().type, dtype=dtype):
            return inner()

    step.run = run
    return step


def precision(args: argparse.Namespace, run: Run) -> Dict[str, Any]:
    """``--precision``: float32, bfloat16 autocast and compiled stages, each checked against the plain model in its
    precision (bf16 only to bf16's tolerance: not warned about), then interleaved."""
    work, n = (mlp_workload(4, 256), 64) if args.quick else (WORKLOADS["mlp"], 256)
    m, rounds = args.ms[0], args.rounds or (2 if args.quick else 8)
    model, x, y = work.seeded(n, args.seed)
    pipe = dict(chunks=m, balance="time", sample=x)
    steps = {"plain fp32": baselines.whole(model, x, y, work.loss_fn),
             "plain bf16": autocast(baselines.whole(model, x, y, work.loss_fn)),
             "pipeline fp32": baselines.pipeline(model, x, y, work.loss_fn, **pipe),
             "pipeline bf16": autocast(baselines.pipeline(model, x, y, work.loss_fn, **pipe)),
             "pipeline compiled": baselines.pipeline(model, x, y, work.loss_fn, compile=True, **pipe)}
    check: Dict[str, Dict[str, float]] = {}
    for name, step in steps.items():
        step.name, ref = name, "plain " + name.split()[-1].replace("compiled", "fp32")
        check.update(baselines.check_grads([step], lambda s, ref=ref: steps[ref].grads(), ref,
                                           exempt=[name] if "bf16" in name else []))
    times = interleaved({k: s.run for k, s in steps.items()}, rounds, warmup=1)
    for s in steps.values():
        s.close()
    pairs = [("pipeline bf16", "pipeline fp32", "bf16 autocast vs float32, same pipeline"),
             ("pipeline bf16", "plain bf16", "pipeline vs plain model, both bf16"),
             ("plain bf16", "plain fp32", "bf16 vs float32, plain model"),
             ("pipeline compiled", "pipeline fp32", "compiled vs eager stages"),
             ("pipeline fp32", "plain fp32", "pipeline vs plain model, both float32")]
    ratios = [{"faster": a, "than": b, "what": what, "speedup": median_ratio(times[b], times[a])}
              for a, b, what in pairs]
    run.table(f"{work.describe(n)}, {m} micro-batches, {rounds} rounds: median step ms",
              ["configuration", "step ms"], [[k, median_ms(v)] for k, v in times.items()])
    run.table("speedups (median of per-round ratios; > 1: the first is faster)", ["comparison", "speedup"],
              [[r["what"], f"{r['speedup']:.2f}x"] for r in ratios])
    return {"model": work.describe(n), "rounds": rounds, "check": check, "ratios": ratios,
            "median_ms": {k: median_ms(v) for k, v in times.items()}, "times_s": times}


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    choices = names(SCRIPT)
    p = parser(__doc__, "1 round, no warm-up round, m = 1 4 (--precision: a small MLP, 2 rounds)")
    p.add_argument("--models", nargs="+", default=choices, choices=choices)
    p.add_argument("--ms", nargs="+", type=int, default=None,
                   help="numbers of micro-batches (default 1 2 4 8 16; 1 4 with --quick; --precision: 8)")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"], choices=["1f1b", "gpipe"])
    add_round_flags(p, SCRIPT)
    p.add_argument("--no-trace", action="store_true", help="skip the traced step per pipeline")
    p.add_argument("--no-probe", action="store_true", help="skip the host parallelism probe (~50 ms per round)")
    p.add_argument("--precision", action="store_true", help="float32 against bfloat16 autocast and compile=True "
                   "(the MLP, batch 256; --rounds default 8) -> results/precision_cpu.json")
    args = p.parse_args(argv)
    args.ms = args.ms or ([8] if args.precision else [1, 4] if args.quick else [1, 2, 4, 8, 16])
    if any(m < 1 for m in args.ms):
        p.error("--ms values must be >= 1")
    check_rounds(p, args)
    args.schedules = list(dict.fromkeys(args.schedules))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)  # the plain model's thread; each pipeline stage gets threads=1 as well
    if args.precision:
        run = Run("precision_cpu", args)
        run.finish(**precision(args, run))
        return 0
    run = Run(SCRIPT, args)
    results: Dict[str, Any] = {}
    for name in args.models:
        work = WORKLOADS[name]
        rounds, warmup = work.rounds_of(SCRIPT, args)
        model, x, y = work.seeded(work.batch[SCRIPT], args.seed)
        run.console.print(f"[bold]{name}[/bold]: {work.describe(x.shape[0])}; {rounds} rounds (+{warmup} warm-up), "
                          f"schedules {args.schedules}")
        t0 = time.perf_counter()
        rows = [run_m(work, model, x, y, m, args.schedules, rounds, warmup, args, run) for m in args.ms]
        best = report(work, x.shape[0], rows, args.schedules, rounds, run)
        results[name] = {"workload": work.describe(x.shape[0]), "input_shape": list(x.shape), "rounds": rounds,
                         "warmup": warmup, "elapsed_s": time.perf_counter() - t0, "best_vs_whole": best, "by_m": rows}
    run.finish({"stages": STAGES, "threads_per_stage": 1, "main_threads": torch.get_num_threads()}, models=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
