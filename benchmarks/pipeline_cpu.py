"""How much a 2-stage CPU pipeline speeds up one training step, and against what.

    python benchmarks/pipeline_cpu.py                      # mlp + resnet50, m = 1 2 4 8 16 (~8 min on an idle host)
    python benchmarks/pipeline_cpu.py --quick              # smoke run: 1 round, m = 1 4 (~2 min)
    python benchmarks/pipeline_cpu.py --models mlp --ms 4 8 --rounds 20 --schedules 1f1b gpipe

Two stages on two cores, one intra-op thread each. For every number of
micro-batches m it times one forward+backward step of

* ``whole``: the plain model on the whole batch (1 thread);
* ``accum``: the plain model accumulating gradients over the same m
  micro-batches, each loss weighted by n_i/N as the pipeline does (1 thread).
  This is the yardstick the pipeline has to beat 2x: on a CPU a small
  micro-batch costs more per sample, and the pipeline pays that too;
* the pipeline under each schedule (``1f1b``, ``gpipe``).

The configurations of one (model, m) are interleaved step by step and compared
by the median of per-round ratios (the host's speed drifts). The pipeline's
speedup over ``accum`` is set against the bubble bound m*p/(m+p-1) (p=2
stages); efficiency = speedup / bound. Before timing, every configuration runs
once and the pipeline's gradients are checked against ``accum``'s; after
timing, one traced pipeline step splits the time into per-stage forward,
backward and idle time (``--no-trace`` skips it).

A small matmul kernel run alone and on both cores at once is interleaved with
the steps too (``--no-probe`` skips it): its speedup is what the host's two
vCPUs really delivered in those rounds, the ceiling of the pipeline's speedup
besides the bubble bound.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from rich.console import Console
from torch import nn

from pipeddp.runtime.microbatch import split, split_sizes
from pipeddp.tools.models import mlp, resnet
from pipeddp.pipeline import Pipeline
from pipeddp.runtime.schedule import get_schedule, play
from pipeddp.runtime.trace import Trace

try:  # run as a script (benchmarks/ is sys.path[0]) or as python -m benchmarks.pipeline_cpu
    from benchmarks.common import (
        Workload, bubble_bound, grad_rel_diff, grad_snapshot, interleaved, median_ms, median_ratio,
        parallel_probe, print_table, write_json,
    )
except ImportError:  # pragma: no cover - depends on how the script is started
    from common import (
        Workload, bubble_bound, grad_rel_diff, grad_snapshot, interleaved, median_ms, median_ratio,
        parallel_probe, print_table, write_json,
    )

STAGES = 2


WORKLOADS: Dict[str, Workload] = {
    # ~0.3-0.9 s per step at 1 thread: cheap, so enough rounds for a tight median.
    "mlp": Workload(
        "MLP 16 x (Linear(1024,1024)+ReLU), batch 256, MSE vs random targets",
        lambda: mlp(16, 1024),
        lambda: (torch.randn(256, 1024), torch.randn(256, 1024)),
        nn.functional.mse_loss,
        rounds=10, warmup=1,
    ),
    # ~2-6 s per step at 1 thread: few rounds; the pre-timing check step already warms every config up.
    "resnet50": Workload(
        "resnet50 (flattened, 23 layers), 3x64x64, batch 64, cross-entropy vs random labels (1000 classes)",
        lambda: resnet("resnet50"),
        lambda: (torch.randn(64, 3, 64, 64), torch.randint(0, 1000, (64,))),
        nn.functional.cross_entropy,
        rounds=4, warmup=0,
    ),
}


def trace_step(pipe: Pipeline, step: Callable[[], Any], schedule: str, m: int, accum_ms: float) -> Dict[str, Any]:
    """One traced pipeline step, split into per-stage forward/backward/idle time.

    ``predicted_ms`` replays the schedule on paper with the measured action
    durations and free transfers: the gap between it and the traced makespan
    is the executor's own cost (thread hand-offs, waking the peer).
    ``busy_over_accum`` compares all stage compute with the 1-thread
    accumulation: above 1 means the same work got slower when both cores run
    at once (shared L3 / memory bandwidth, GIL hand-offs).
    """
    pipe.trace = Trace()
    try:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
        spans = [s for s in pipe.trace.spans if s.lane == "compute"]
    finally:
        pipe.trace = None
    t0 = min(s.start for s in spans)
    t1 = max(s.end for s in spans)
    makespan = t1 - t0
    fwd = [sum(s.duration for s in spans if s.stage == st and s.kind == "F") for st in range(STAGES)]
    bwd = [sum(s.duration for s in spans if s.stage == st and s.kind == "B") for st in range(STAGES)]
    busy = [f + b for f, b in zip(fwd, bwd)]
    durations = {(s.stage, s.kind, s.mb): s.duration for s in spans}
    predicted = play(get_schedule(schedule, STAGES, m), duration=lambda st, a: durations[(st, a.kind, a.mb)]).makespan
    return {
        "step_ms": wall * 1e3,
        "makespan_ms": makespan * 1e3,
        "forward_ms": [v * 1e3 for v in fwd],
        "backward_ms": [v * 1e3 for v in bwd],
        "busy_ms": [v * 1e3 for v in busy],
        "idle_frac": [1 - b / makespan for b in busy],
        "imbalance": max(busy) / (sum(busy) / len(busy)),
        "busy_over_accum": sum(busy) * 1e3 / accum_ms,
        "predicted_ms": predicted * 1e3,
        "makespan_over_predicted": makespan / predicted,
    }


def run_m(
    name: str, work: Workload, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int,
    schedules: Sequence[str], rounds: int, warmup: int, traced: bool, probe: bool, console: Console,
) -> Dict[str, Any]:
    """Everything measured for one (model, m); the pipelines are built and closed here."""
    loss_fn = work.loss_fn
    n = x.shape[0]
    sizes = split_sizes(n, chunks=m)
    xs, ys = split(x, sizes), split(y, sizes)
    weights = [k / n for k in sizes]

    def whole() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()

    def accum() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for xi, yi, w in zip(xs, ys, weights):
            loss = loss_fn(model(xi), yi) * w  # the pipeline's weighting: sum of weighted means = batch mean
            loss.backward()
            total += loss.detach()
        return total

    pipes: Dict[str, Pipeline] = {}
    build_s: Dict[str, float] = {}
    fns: Dict[str, Callable[[], Any]] = {"whole": whole, "accum": accum}
    try:
        for sched in schedules:
            start = time.perf_counter()
            # The first pipeline profiles and cuts (balance="time"); the others reuse its cut, so the
            # schedules are compared on the same stages and profiling noise cannot tell them apart.
            balance: Any = "time" if not pipes else list(next(iter(pipes.values())).balance)
            pipes[sched] = Pipeline(copy.deepcopy(model), ["cpu"] * STAGES, chunks=m, balance=balance,
                                    sample=x, schedule=sched, threads=1)
            build_s[sched] = time.perf_counter() - start

            def step(pipe: Pipeline = pipes[sched]) -> torch.Tensor:
                pipe.zero_grad(set_to_none=True)
                return pipe.train_step(x, y, loss_fn)

            fns[sched] = step
        first = pipes[schedules[0]]
        console.print(f"  [{name}] m={m}: micro-batches {sizes[0]}{'' if len(set(sizes)) == 1 else '/' + str(sizes[-1])} "
                      f"samples, balance {first.balance} (profiled stage ms "
                      f"{[round(c * 1e3, 1) for c in first.partition.stage_costs]}), build {build_s[schedules[0]]:.1f} s")

        # Correctness first (and a warm-up of every config): the pipeline must produce accum's gradients.
        loss_whole = whole().item()
        loss_accum = accum().item()
        ref = grad_snapshot(model)
        check: Dict[str, Any] = {"loss_whole": loss_whole, "loss_accum": loss_accum}
        for sched in schedules:
            loss_pipe = fns[sched]().item()
            check[sched] = {"loss": loss_pipe, "loss_abs_diff_vs_accum": abs(loss_pipe - loss_accum),
                            "grad_max_rel_diff_vs_accum": grad_rel_diff(ref, pipes[sched])}
            if check[sched]["grad_max_rel_diff_vs_accum"] > 1e-4:
                console.print(f"  [red]warning[/red]: {sched} gradients differ from accumulation by "
                              f"{check[sched]['grad_max_rel_diff_vs_accum']:.2e} (relative)")
        del ref

        if probe:
            fns["host_solo"], fns["host_both"] = parallel_probe(STAGES)
        times = interleaved(fns, rounds=rounds, warmup=warmup)
        medians = {k: median_ms(v) for k, v in times.items()}
        accum_ms = medians["accum"]
        trace = {s: trace_step(pipes[s], fns[s], s, len(sizes), accum_ms) for s in schedules} if traced else {}
    finally:
        for pipe in pipes.values():
            pipe.close()

    bound = bubble_bound(len(sizes), STAGES)
    vs_whole = {s: median_ratio(times["whole"], times[s]) for s in schedules}
    vs_accum = {s: median_ratio(times["accum"], times[s]) for s in schedules}
    host = median_ratio([STAGES * t for t in times["host_solo"]], times["host_both"]) if probe else None
    return {
        "m": m,
        "microbatch_sizes": sizes,
        "balance": first.balance,
        "profiled_stage_ms": [c * 1e3 for c in first.partition.stage_costs],
        "build_s": build_s,
        "median_ms": medians,
        "accum_over_whole": median_ratio(times["accum"], times["whole"]),
        "speedup_vs_whole": vs_whole,
        "speedup_vs_accum": vs_accum,
        "bound": bound,
        "efficiency": {s: vs_accum[s] / bound for s in schedules},
        "host_parallel_speedup": host,
        "check": check,
        "trace": trace,
        "times_s": times,
    }


def report(name: str, work: Workload, rows: List[Dict[str, Any]], schedules: Sequence[str], rounds: int,
           console: Console) -> Dict[str, Any]:
    """Print the speedup table (and the traced breakdown); return the best m against the whole batch."""
    table_rows: List[List[Any]] = []
    for r in rows:
        for i, s in enumerate(schedules):
            host = r["host_parallel_speedup"]
            head = [r["m"], r["microbatch_sizes"][0], str(r["balance"]), f"{r['median_ms']['whole']:.1f}",
                    f"{r['median_ms']['accum']:.1f}", f"{r['accum_over_whole']:.2f}x"] if i == 0 else [""] * 6
            table_rows.append(head + [
                s, f"{r['median_ms'][s]:.1f}", f"{r['speedup_vs_whole'][s]:.2f}x", f"{r['speedup_vs_accum'][s]:.2f}x",
                f"{r['bound']:.2f}x", f"{r['efficiency'][s]:.0%}",
                (f"{host:.2f}x" if host is not None else "-") if i == 0 else "",
            ])
    print_table(
        f"{name}: 2-stage CPU pipeline, 1 thread per stage; medians of {rounds} interleaved rounds",
        ["m", "mb", "balance", "whole ms", "accum ms", "accum/whole", "schedule", "pipe ms", "vs whole",
         "vs accum", "bound", "efficiency", "host 2-core"],
        table_rows, console=console,
        caption=f"{work.describe}. vs whole/accum: median per-round speedup of the pipeline; "
                "bound = 2m/(m+1); efficiency = (vs accum) / bound; host 2-core = speedup of a 1-thread "
                "matmul kernel on both cores at once over one (ideal 2.00x), interleaved with the steps",
    )
    if any(r["trace"] for r in rows):
        trows = []
        for r in rows:
            for s in schedules:
                t = r["trace"].get(s)
                if not t:
                    continue
                trows.append([
                    r["m"], s, f"{t['step_ms']:.1f}",
                    " / ".join(f"{f:.0f}+{b:.0f}" for f, b in zip(t["forward_ms"], t["backward_ms"])),
                    " / ".join(f"{v:.0%}" for v in t["idle_frac"]), f"{t['imbalance']:.2f}",
                    f"{t['busy_over_accum']:.2f}", f"{t['predicted_ms']:.1f}", f"{t['makespan_over_predicted']:.2f}",
                ])
        print_table(
            f"{name}: where the pipeline's time goes (one traced step per row)",
            ["m", "schedule", "step ms", "stage0 / stage1 F+B ms", "idle s0 / s1", "imbalance", "busy / accum",
             "replayed ms", "makespan / replayed"],
            trows, console=console,
            caption="imbalance = max stage busy / mean; busy / accum = all stage compute over 1-thread accumulation "
                    "(>1: the same work runs slower on two cores at once); replayed = schedule replayed with these "
                    "action durations and free hand-offs",
        )
    best_m, best_s = max(((r, s) for r in rows for s in schedules), key=lambda rs: rs[0]["speedup_vs_whole"][rs[1]])
    best = {"m": best_m["m"], "schedule": best_s, "speedup_vs_whole": best_m["speedup_vs_whole"][best_s],
            "speedup_vs_accum": best_m["speedup_vs_accum"][best_s]}
    console.print(f"[bold]{name}[/bold]: best against the plain whole-batch model: m={best['m']} ({best_s}), "
                  f"{best['speedup_vs_whole']:.2f}x vs whole, {best['speedup_vs_accum']:.2f}x vs accumulation\n")
    return best


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--ms", nargs="+", type=int, default=None,
                   help="numbers of micro-batches (default 1 2 4 8 16; 1 4 with --quick)")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"], choices=["1f1b", "gpipe"])
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per (model, m); default per model: "
                        + ", ".join(f"{k} {w.rounds}" for k, w in WORKLOADS.items()))
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed rounds before them; default per model: "
                        + ", ".join(f"{k} {w.warmup}" for k, w in WORKLOADS.items())
                        + " (the correctness check already runs every config once)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 round, no warm-up round, m = 1 4 unless --ms/--rounds say otherwise")
    p.add_argument("--no-trace", action="store_true", help="skip the traced step per pipeline")
    p.add_argument("--no-probe", action="store_true", help="skip the host parallelism probe (~50 ms per round)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/pipeline_cpu.json")
    args = p.parse_args(argv)
    if args.ms is None:
        args.ms = [1, 4] if args.quick else [1, 2, 4, 8, 16]
    if any(m < 1 for m in args.ms):
        p.error("--ms values must be >= 1")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be >= 0")
    schedules = list(dict.fromkeys(args.schedules))

    torch.set_num_threads(1)  # the plain model's thread; each pipeline stage gets threads=1 as well
    console = Console(width=max(160, Console().width))
    started = time.perf_counter()
    results: Dict[str, Any] = {}
    for name in args.models:
        work = WORKLOADS[name]
        rounds = args.rounds if args.rounds is not None else (1 if args.quick else work.rounds)
        warmup = args.warmup if args.warmup is not None else (0 if args.quick else work.warmup)
        torch.manual_seed(args.seed)
        model = work.build()
        model.train()
        x, y = work.batch()
        console.print(f"[bold]{name}[/bold]: {work.describe}; {rounds} rounds (+{warmup} warm-up), "
                      f"schedules {schedules}")
        t_model = time.perf_counter()
        rows = [run_m(name, work, model, x, y, m, schedules, rounds, warmup, not args.no_trace, not args.no_probe, console)
                for m in args.ms]
        best = report(name, work, rows, schedules, rounds, console)
        results[name] = {"workload": work.describe, "input_shape": list(x.shape), "rounds": rounds,
                         "warmup": warmup, "elapsed_s": time.perf_counter() - t_model, "best_vs_whole": best,
                         "by_m": rows}
        del model
    elapsed = time.perf_counter() - started
    out = write_json(args.out, {
        "benchmark": "pipeline_cpu",
        "settings": {"stages": STAGES, "threads_per_stage": 1, "main_threads": torch.get_num_threads(),
                     "schedules": schedules, "ms": args.ms, "quick": args.quick, "seed": args.seed,
                     "timing": "interleaved per step, rotating order; speedups are medians of per-round ratios"},
        "elapsed_s": elapsed,
        "models": results,
    })
    console.print(f"wrote {out} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
