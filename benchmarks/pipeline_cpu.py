"""How much a 2-stage CPU pipeline speeds up one training step, against accumulation and the whole batch.

Per (model, m): the plain model, accumulation over the same m micro-batches and the pipeline under each
schedule, interleaved; one traced step per pipeline shows where its time goes. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
from benchmarks import baselines  # noqa: E402
from benchmarks.baselines import mb_text  # noqa: E402
from benchmarks.common import (  # noqa: E402
    Run, interleaved, median_ms, median_ratio, parallel_probe, parser, probe_speedup, timed_call,
)
from benchmarks.workloads import WORKLOADS, Workload, add_round_flags, check_rounds, names  # noqa: E402
from pipeddp.runtime.schedule import get_schedule, play  # noqa: E402
from pipeddp.tools.simulate import bubble_bound  # noqa: E402

SCRIPT = "pipeline_cpu"
STAGES = 2


def trace_step(step: baselines.Step, m: int, accum_ms: float) -> Dict[str, Any]:
    """One traced pipeline step, split into per-stage forward/backward/idle time. ``predicted_ms`` replays the
    schedule with the measured action durations and free transfers: the gap to the traced makespan is the
    executor's own cost (thread hand-offs, waking the peer)."""
    wall: List[float] = []
    schedule = step.info["schedule"]
    spans = baselines.record(step.module, lambda: wall.append(timed_call(step, step.name)[0]))
    spans = [s for s in spans if s.lane == "compute"]
    makespan = max(s.end for s in spans) - min(s.start for s in spans)
    fwd = [sum(s.duration for s in spans if s.stage == st and s.kind == "F") for st in range(STAGES)]
    bwd = [sum(s.duration for s in spans if s.stage == st and s.kind == "B") for st in range(STAGES)]
    busy = [f + b for f, b in zip(fwd, bwd)]
    durations = {(s.stage, s.kind, s.mb): s.duration for s in spans}
    predicted = play(get_schedule(schedule, STAGES, m), duration=lambda st, a: durations[(st, a.kind, a.mb)]).makespan
    return {"step_ms": wall[0] * 1e3, "makespan_ms": makespan * 1e3, "forward_ms": [v * 1e3 for v in fwd],
            "backward_ms": [v * 1e3 for v in bwd], "busy_ms": [v * 1e3 for v in busy],
            "idle_frac": [1 - b / makespan for b in busy], "imbalance": max(busy) / (sum(busy) / len(busy)),
            "busy_over_accum": sum(busy) * 1e3 / accum_ms, "predicted_ms": predicted * 1e3,
            "makespan_over_predicted": makespan / predicted}


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
            fns["host_solo"], fns["host_both"] = parallel_probe(STAGES)
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
            "host_parallel_speedup": None if args.no_probe else probe_speedup(times["host_solo"], times["host_both"]),
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
                  ["m", "schedule", "step ms", "stage0 / stage1 F+B ms", "idle s0 / s1", "imbalance", "busy / accum",
                   "replayed ms", "makespan / replayed"],
                  [[r["m"], s, f"{t['step_ms']:.1f}",
                    " / ".join(f"{f:.0f}+{b:.0f}" for f, b in zip(t["forward_ms"], t["backward_ms"])),
                    " / ".join(f"{v:.0%}" for v in t["idle_frac"]), f"{t['imbalance']:.2f}",
                    f"{t['busy_over_accum']:.2f}", f"{t['predicted_ms']:.1f}", f"{t['makespan_over_predicted']:.2f}"]
                   for r, s, t in traced],
                  caption="imbalance = max stage busy / mean; busy / accum = all stage compute over 1-thread "
                          "accumulation (>1: the same work runs slower on two cores at once); replayed = schedule "
                          "replayed with these action durations and free hand-offs")
    r, s = max(((r, s) for r in rows for s in schedules), key=lambda rs: rs[0]["speedup_vs_whole"][rs[1]])
    best = {"m": r["m"], "schedule": s, "speedup_vs_whole": r["speedup_vs_whole"][s],
            "speedup_vs_accum": r["speedup_vs_accum"][s]}
    run.console.print(f"[bold]{work.name}[/bold]: best against the plain whole-batch model: m={best['m']} ({s}), "
                      f"{best['speedup_vs_whole']:.2f}x vs whole, {best['speedup_vs_accum']:.2f}x vs accumulation\n")
    return best


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    choices = names(SCRIPT)
    p = parser(__doc__, "1 round, no warm-up round, m = 1 4", "results/pipeline_cpu.json")
    p.add_argument("--models", nargs="+", default=choices, choices=choices)
    p.add_argument("--ms", nargs="+", type=int, default=None,
                   help="numbers of micro-batches (default 1 2 4 8 16; 1 4 with --quick)")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"], choices=["1f1b", "gpipe"])
    add_round_flags(p, SCRIPT)
    p.add_argument("--no-trace", action="store_true", help="skip the traced step per pipeline")
    p.add_argument("--no-probe", action="store_true", help="skip the host parallelism probe (~50 ms per round)")
    args = p.parse_args(argv)
    args.ms = args.ms or ([1, 4] if args.quick else [1, 2, 4, 8, 16])
    if any(m < 1 for m in args.ms):
        p.error("--ms values must be >= 1")
    check_rounds(p, args)
    args.schedules = list(dict.fromkeys(args.schedules))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    torch.set_num_threads(1)  # the plain model's thread; each pipeline stage gets threads=1 as well
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
