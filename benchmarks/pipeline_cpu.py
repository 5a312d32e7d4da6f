"""How much a 2-stage CPU pipeline speeds up one training step, against accumulation and the whole batch.

Per (model, m), interleaved: the plain model, accumulation over the same m micro-batches and the pipeline under
each schedule; one traced step per pipeline shows where its time goes. ``--splits``: step time against the
micro-batch size, with a plot; ``--precision``: float32, bfloat16 autocast and compiled stages. See
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
from benchmarks import baselines
from benchmarks.baselines import Step, mb_text
from benchmarks.common import Run, at_least, here, interleaved, median_ms, median_ratio, parser, timed_call
from benchmarks.workloads import WORKLOADS, Workload, add_round_flags, mlp_workload, names
from pipeddp.runtime.microbatch import split_sizes
from pipeddp.runtime.schedule import get_schedule, play
from pipeddp.tools.simulate import bubble_bound

SCRIPT = "pipeline_cpu"
STAGES = 2
SPLITS = [8, 12, 16, 20, 24, 32, 48, 64, 96, 120]


def timed(steps: Dict[str, Step], reference: Any, label: str, rounds: int, warmup: int,
          exempt: Sequence[str] = ()) -> Tuple[Dict[str, List[float]], Dict[str, Any]]:
    """Check the steps' gradients (``baselines.check_grads``), time them interleaved, close them."""
    try:
        checked = baselines.check_grads(list(steps.values()), reference, label, exempt)
        return interleaved({k: s.run for k, s in steps.items()}, rounds, warmup), checked
    finally:
        for step in steps.values():
            step.close()


def trace_step(step: Step, m: int, accum_ms: float) -> Dict[str, Any]:
    """One traced pipeline step, split per stage into forward, backward and idle time. ``predicted_ms`` replays the
    schedule with the measured action durations and free transfers: the gap to the traced makespan is the
    executor's own cost (thread hand-offs, waking the peer)."""
    wall: List[float] = []
    spans = baselines.record(step.module, lambda: wall.append(timed_call(step, step.name)[0]))
    spans = [s for s in spans if s.lane == "compute"]
    makespan = (max(s.end for s in spans) - min(s.start for s in spans)) * 1e3
    stages = list(baselines.stage_breakdown(spans).values())
    busy = [s["F_ms"] + s["B_ms"] for s in stages]
    durations = {(s.stage, s.kind, s.mb): s.duration for s in spans}
    plan = get_schedule(step.info["schedule"], STAGES, m)
    predicted = play(plan, duration=lambda st, a: durations[(st, a.kind, a.mb)]).makespan * 1e3
    return {"step_ms": wall[0] * 1e3, "makespan_ms": makespan, "stages": stages, "predicted_ms": predicted,
            "idle_frac": [1 - b / makespan for b in busy], "busy_over_accum": sum(busy) / accum_ms,
            "imbalance": max(busy) / (sum(busy) / len(busy)), "makespan_over_predicted": makespan / predicted}


def run_m(work: Workload, model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int, rounds: int,
          warmup: int, args: argparse.Namespace, run: Run) -> Dict[str, Any]:
    """whole, accum and one pipeline per schedule at ``m``; the first pipeline profiles and cuts (balance="time"),
    the others reuse its cut, so that profiling noise cannot tell the schedules apart."""
    steps = {"whole": baselines.whole(model, x, y, work.loss_fn),
             "accum": baselines.accumulate(model, x, y, work.loss_fn, m)}
    balance: Any = "time"
    for sched in args.schedules:
        steps[sched] = baselines.pipeline(model, x, y, work.loss_fn, chunks=m, balance=balance, sample=x,
                                          schedule=sched, name=sched)
        balance = steps[sched].info["balance"]
    first, sizes = steps[args.schedules[0]], steps["accum"].info["microbatch_sizes"]
    stage_ms = [c * 1e3 for c in first.module.partition.stage_costs]
    run.console.print(f"  {work.name} m={m}: micro-batches {mb_text(sizes)}, balance {balance} (profiled stage ms "
                      f"{[round(v, 1) for v in stage_ms]})")
    try:
        # BatchNorm sees micro-batches: only the pipelines must match accumulation, not the whole batch
        checked = baselines.check_grads(list(steps.values()), "accum", "accum", ["whole"])
        times = interleaved({k: s.run for k, s in steps.items()}, rounds, warmup)
        medians = {k: median_ms(v) for k, v in times.items()}
        trace = {s: trace_step(steps[s], m, medians["accum"]) for s in args.schedules}
    finally:
        for step in steps.values():
            step.close()
    bound, vs_accum = bubble_bound(STAGES, m), {s: median_ratio(times["accum"], times[s]) for s in args.schedules}
    return {"m": m, "microbatch_sizes": sizes, "balance": first.info["balance"], "profiled_stage_ms": stage_ms,
            "median_ms": medians,
            "accum_over_whole": median_ratio(times["accum"], times["whole"]),
            "speedup_vs_whole": {s: median_ratio(times["whole"], times[s]) for s in args.schedules},
            "speedup_vs_accum": vs_accum, "bound": bound, "efficiency": {s: v / bound for s, v in vs_accum.items()},
            "check": checked, "trace": trace, "times_s": times}


def report(work: Workload, n: int, rows: List[Dict[str, Any]], schedules: Sequence[str], rounds: int,
           run: Run) -> Dict[str, Any]:
    """Print the speedup table and the traced breakdown; return the best m against the whole batch."""
    table: List[List[Any]] = []
    for r in rows:
        for i, s in enumerate(schedules):
            head = [r["m"], r["microbatch_sizes"][0], str(r["balance"]), f"{r['median_ms']['whole']:.1f}",
                    f"{r['median_ms']['accum']:.1f}", f"{r['accum_over_whole']:.2f}x"] if i == 0 else [""] * 6
            table.append(head + [s, f"{r['median_ms'][s]:.1f}", f"{r['speedup_vs_whole'][s]:.2f}x",
                                 f"{r['speedup_vs_accum'][s]:.2f}x", f"{r['bound']:.2f}x", f"{r['efficiency'][s]:.0%}"])
    run.table(f"{work.name}: 2-stage CPU pipeline, 1 thread per stage; medians of {rounds} interleaved rounds",
              ["m", "mb", "balance", "whole ms", "accum ms", "accum/whole", "schedule", "pipe ms", "vs whole",
               "vs accum", "bound", "efficiency"], table,
              caption=f"{work.describe(n)}. vs whole/accum: median per-round speedup of the pipeline; bound = "
                      "2m/(m+1); efficiency = (vs accum) / bound")
    run.table(f"{work.name}: where the pipeline's time goes (one traced step per row)",
              ["m", "schedule", "step ms", "stage0 / stage1 F+B ms", "idle s0 / s1", "busy / accum", "imbalance",
               "replayed ms", "makespan / replayed"],
              [[r["m"], s, t["step_ms"], " / ".join(f"{v['F_ms']:.0f}+{v['B_ms']:.0f}" for v in t["stages"]),
                " / ".join(f"{v:.0%}" for v in t["idle_frac"]), t["busy_over_accum"], t["imbalance"],
                t["predicted_ms"], t["makespan_over_predicted"]] for r in rows for s, t in r["trace"].items()],
              caption="busy / accum > 1: the same work ran slower on two cores at once; replayed: the schedule "
                      "played with these action durations and free hand-offs")
    r, s = max(((r, s) for r in rows for s in schedules), key=lambda rs: rs[0]["speedup_vs_whole"][rs[1]])
    best = {"m": r["m"], "schedule": s, "speedup_vs_whole": r["speedup_vs_whole"][s],
            "speedup_vs_accum": r["speedup_vs_accum"][s]}
    run.console.print(f"[bold]{work.name}[/bold]: best against the plain whole-batch model: m={best['m']} ({s}), "
                      f"{best['speedup_vs_whole']:.2f}x vs whole, {best['speedup_vs_accum']:.2f}x vs accumulation\n")
    return best


def plot(path: str, name: str, rows: List[Dict[str, Any]], plain_ms: float, naive_ms: float, best: int,
         rounds: int) -> Optional[str]:
    """Step time against split size (median and IQR), plain and naive MP as lines; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is optional
        return None
    ks, ms = [r["split_size"] for r in rows], [r["median_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 5))
    iqr = [[r["median_ms"] - r["q1_ms"] for r in rows], [r["q3_ms"] - r["median_ms"] for r in rows]]
    ax.errorbar(ks, ms, yerr=iqr, fmt="-", color="#4C72B0", ecolor="#9DB3D8", capsize=3, zorder=2,
                label="pipeline, 2 stages (median, IQR)")
    for mult, face, label in ((True, "#4C72B0", "split = multiple of 16"), (False, "white", "not a multiple of 16")):
        pts = [(k, v) for k, v in zip(ks, ms) if (k % 16 == 0) == mult]
        if pts:
            ax.scatter(*zip(*pts), facecolors=face, edgecolors="#4C72B0", zorder=3, label=label)
    ax.scatter([best], [ms[ks.index(best)]], marker="*", s=260, color="#C44E52", zorder=4, label=f"best: split {best}")
    ax.axhline(plain_ms, color="#55A868", linestyle="--", label=f"plain model, 1 thread ({plain_ms:.0f} ms)")
    ax.axhline(naive_ms, color="#DD8452", linestyle=":", label=f"naive MP, chunks=1 ({naive_ms:.0f} ms)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("split_size (samples per micro-batch)")
    ax.set_ylabel("step time, forward + backward (ms)")
    ax.set_title(f"{name}: 2-stage CPU pipeline step time vs micro-batch size\n"
                 f"median of {rounds} interleaved rounds, 1 thread per stage")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def splits(args: argparse.Namespace, run: Run) -> Dict[str, Any]:
    """``--splits``: plain, naive-mp (cut at the whole batch) and one 1F1B pipeline per split size k, cut at
    ``x[:k]`` (given the batch pipeddp would profile at n / ceil(n / k) rows: 60 for k=96 of 120)."""
    work, n = WORKLOADS[args.models[0]], args.batch
    rounds = work.rounds_of("split_sizes", args)[0]
    model, x, y = work.seeded(n, args.seed)
    run.console.print(f"[bold]{work.name}[/bold]: {work.describe(n)}; split sizes {args.splits}; {rounds} rounds")
    steps = {"plain": baselines.whole(model, x, y, work.loss_fn, name="plain")}
    for name, kw, sample in [("naive-mp", {"chunks": 1}, x)] + [(f"split={k}", {"split_size": k}, x[:k])
                                                              for k in args.splits]:
        step = steps[name] = baselines.pipeline(model, x, y, work.loss_fn, balance="time", sample=sample, name=name,
                                                **kw)
        part = step.module.partition
        step.info.update(microbatch_sizes=split_sizes(n, step.module.chunks, step.module.split_size),
                         profiled_at_microbatch=int(sample.shape[0]),
                         profiled_stage_ms=[c * 1e3 for c in part.stage_costs],
                         profiled_ratio=part.bottleneck / part.ideal if part.ideal else None)
    bn = any(isinstance(m, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)) for m in model.modules())
    times, checked = timed(steps, "plain", "plain", rounds, args.warmup or 0, list(steps) if bn else [])
    rows: List[Dict[str, Any]] = []
    for k in args.splits:
        t = times[f"split={k}"]
        q = statistics.quantiles(t, n=4) if len(t) > 1 else [t[0]] * 3
        info = {key: v for key, v in steps[f"split={k}"].info.items() if key != "schedule"}
        rows.append({"split_size": k, "config": f"split={k}", **info, "median_ms": median_ms(t), "q1_ms": q[0] * 1e3,
                     "q3_ms": q[2] * 1e3, "speedup_vs_plain": median_ratio(times["plain"], t),
                     "speedup_vs_naive": median_ratio(times["naive-mp"], t)})
    best, plain_ms = max(rows, key=lambda r: r["speedup_vs_plain"]), median_ms(times["plain"])
    naive = {**steps["naive-mp"].info, "median_ms": median_ms(times["naive-mp"]),
             "speedup_vs_plain": median_ratio(times["plain"], times["naive-mp"])}
    cells = [["plain", "-", f"1 x {n}", "-", "-", plain_ms, "1.00x", f"{1 / naive['speedup_vs_plain']:.2f}x", ""],
             ["naive MP", "-", mb_text(naive["microbatch_sizes"]), str(naive["balance"]),
              "/".join(f"{v:.0f}" for v in naive["profiled_stage_ms"]), naive["median_ms"],
              f"{naive['speedup_vs_plain']:.2f}x", "1.00x", ""]]
    cells += [[r["config"], r["split_size"], mb_text(r["microbatch_sizes"]), str(r["balance"]),
               "/".join(f"{v:.0f}" for v in r["profiled_stage_ms"]), r["median_ms"], f"{r['speedup_vs_plain']:.2f}x",
               f"{r['speedup_vs_naive']:.2f}x", "<- best" if r is best else ""] for r in rows]
    run.table(f"{work.name}: 2-stage CPU pipeline (1F1B, 1 thread per stage) vs split_size; medians of {rounds} "
              "interleaved rounds", ["config", "split", "micro-batches", "balance", "profiled stage ms", "step ms",
                                     "vs plain", "vs naive MP", "best"], cells,
              caption=f"{work.describe(n)}. Each cut profiled at its micro-batch size (naive MP: the whole batch); "
                      "vs plain / vs naive MP: median per-round speedup (> 1: faster)")
    png = plot(os.path.splitext(args.out)[0] + ".png", work.name, rows, plain_ms, naive["median_ms"],
               best["split_size"], rounds)
    return {"workload": work.describe(n), "input_shape": list(x.shape), "plain_ms": plain_ms, "naive_mp": naive,
            "best": {k: best[k] for k in ("split_size", "microbatch_sizes", "median_ms", "speedup_vs_plain",
                                          "speedup_vs_naive")},
            "by_split": rows, "check": checked, "plot": png, "times_s": times}


def autocast(step: Step, dtype: torch.dtype = torch.bfloat16) -> Step:
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
    for name, step in steps.items():
        step.name = name
    ref = {name: "plain " + name.split()[-1].replace("compiled", "fp32") for name in steps}
    times, check = timed(steps, lambda s: steps[ref[s.name]].grads(), "plain (same precision)", rounds, 1,
                         [k for k in steps if "bf16" in k])
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    choices = names(SCRIPT)
    p = parser(__doc__, "1 round, no warm-up round, m = 1 4 (--splits: 16 48; --precision: a small MLP, 2 rounds)",
               out_help="results/pipeline_cpu.json, split_sizes[_<model>].json, precision_cpu.json")
    p.add_argument("--models", nargs="+", default=None, choices=choices, help="default: all (--splits: resnet50)")
    p.add_argument("--ms", nargs="+", type=at_least(1), default=None,
                   help="numbers of micro-batches (default 1 2 4 8 16; 1 4 with --quick; --precision: 8)")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe"], choices=["1f1b", "gpipe"])
    add_round_flags(p, SCRIPT)
    p.add_argument("--splits", nargs="*", type=at_least(1), default=None, help="step time per split size (default "
                   f"{' '.join(map(str, SPLITS))}; sizes > batch are skipped) -> results/split_sizes[_<model>].json")
    p.add_argument("--batch", type=int, default=None, help="--splits: the batch (default: resnet50 120, mlp 240)")
    p.add_argument("--precision", action="store_true", help="float32 against bfloat16 autocast and compile=True "
                   "(the MLP, batch 256; --rounds default 8) -> results/precision_cpu.json")
    args = p.parse_args(argv)
    args.models = args.models or (["resnet50"] if args.splits is not None else choices)
    args.ms = args.ms or ([8] if args.precision else [1, 4] if args.quick else [1, 2, 4, 8, 16])
    args.schedules = list(dict.fromkeys(args.schedules))
    if args.splits is not None:
        args.batch = args.batch or WORKLOADS[args.models[0]].batch["split_sizes"]
        args.splits = sorted({k for k in args.splits or ([16, 48] if args.quick else SPLITS) if k <= args.batch})
        if not args.splits:
            p.error(f"no split size <= batch {args.batch}")
        suffix = "" if args.models[0] == "resnet50" else f"_{args.models[0]}"
        args.out = args.out or f"results/split_sizes{suffix}{'_quick' if args.quick else ''}.json"
    torch.set_num_threads(1)  # the plain model's thread; each pipeline stage gets threads=1 as well
    if args.precision or args.splits is not None:
        run = Run("precision_cpu" if args.precision else "split_sizes", args)
        run.finish(**(precision if args.precision else splits)(args, run))
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
        rows = [run_m(work, model, x, y, m, rounds, warmup, args, run) for m in args.ms]
        best = report(work, x.shape[0], rows, args.schedules, rounds, run)
        results[name] = {"workload": work.describe(x.shape[0]), "input_shape": list(x.shape), "rounds": rounds,
                         "warmup": warmup, "elapsed_s": time.perf_counter() - t0, "best_vs_whole": best, "by_m": rows}
    run.finish({"stages": STAGES, "threads_per_stage": 1, "main_threads": torch.get_num_threads()}, models=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
