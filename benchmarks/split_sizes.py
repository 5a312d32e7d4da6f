"""Step time of a 2-stage CPU pipeline against the micro-batch size ``split_size``.

Per split size k, a pipeline cut at micro-batch k, interleaved with the plain model and naive model
parallelism (``chunks=1``); a table, JSON and a PNG plot. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
from benchmarks import baselines
from benchmarks.baselines import mb_text
from benchmarks.common import Run, interleaved, median_ms, median_ratio, parser
from benchmarks.workloads import WORKLOADS, add_round_flags, check_rounds, names
from pipeddp.runtime.microbatch import split_sizes

SCRIPT = "split_sizes"
SPLITS = [8, 12, 16, 20, 24, 32, 48, 64, 96, 120]


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


def build(model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: Any, splits: Sequence[int],
          run: Run) -> Dict[str, baselines.Step]:
    """plain, naive-mp (cut at the whole batch) and one pipeline per split size, cut at that micro-batch: the
    sample is ``x[:k]`` (given the batch pipeddp would profile at n / ceil(n / k) rows: 60 for k=96 of 120)."""
    steps = {"plain": baselines.whole(model, x, y, loss_fn, name="plain")}
    for name, kw, sample in [("naive-mp", {"chunks": 1}, x)] + [(f"split={k}", {"split_size": k}, x[:k])
                                                              for k in splits]:
        step = steps[name] = baselines.pipeline(model, x, y, loss_fn, balance="time", sample=sample, name=name, **kw)
        pipe = step.module
        part = pipe.partition
        step.info.update(microbatch_sizes=split_sizes(x.shape[0], pipe.chunks, pipe.split_size),
                         profiled_at_microbatch=int(sample.shape[0]),
                         profiled_stage_ms=[c * 1e3 for c in part.stage_costs],
                         profiled_ratio=part.bottleneck / part.ideal if part.ideal else None)
        run.console.print(f"  {name}: {mb_text(step.info['microbatch_sizes'])} micro-batches, cut at micro-batch "
                          f"{sample.shape[0]} -> balance {pipe.balance} (profiled stage ms "
                          f"{[round(c * 1e3, 1) for c in part.stage_costs]})")
    return steps


def table(args: argparse.Namespace, rows: List[Dict[str, Any]], steps: Dict[str, baselines.Step], plain_ms: float,
          naive: Dict[str, Any], best: Dict[str, Any], run: Run) -> None:
    info, batch = steps["naive-mp"].info, args.batch
    out = [["plain", "-", f"1 x {batch}", "-", "-", f"{plain_ms:.0f}", "1.00x",
            f"{1 / naive['speedup_vs_plain']:.2f}x", "-", ""],
           ["naive MP", "-", mb_text(info["microbatch_sizes"]), str(info["balance"]),
            "/".join(f"{v:.0f}" for v in info["profiled_stage_ms"]), f"{naive['median_ms']:.0f}",
            f"{naive['speedup_vs_plain']:.2f}x", "1.00x", "-", ""]]
    out += [[r["config"], r["split_size"], mb_text(r["microbatch_sizes"]), str(r["balance"]),
             "/".join(f"{v:.0f}" for v in r["profiled_stage_ms"]), f"{r['median_ms']:.0f}",
             f"{r['speedup_vs_plain']:.2f}x", f"{r['speedup_vs_naive']:.2f}x",
             "32" if r["split_size"] % 32 == 0 else "16" if r["split_size"] % 16 == 0 else "-",
             "<- best" if r["split_size"] == best["split_size"] else ""] for r in rows]
    run.table(f"{args.model}: 2-stage CPU pipeline (1F1B, 1 thread per stage) vs split_size; medians of {args.rounds} "
              "interleaved rounds", ["config", "split", "micro-batches", "balance", "profiled stage ms", "step ms",
                                     "vs plain", "vs naive MP", "multiple of", "best"], out,
              caption=f"{WORKLOADS[args.model].describe(batch)}. Each cut profiled at its micro-batch size (naive MP: "
                      "the whole batch); vs plain / vs naive MP: median per-round speedup (> 1: faster)")


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    choices = names(SCRIPT)
    p = parser(__doc__, "split sizes 16 48, 1 round", None, "results/split_sizes[_<model>][_quick].json")
    p.add_argument("--model", default="resnet50", choices=choices)
    p.add_argument("--splits", nargs="+", type=int, default=None, help=f"split sizes (default "
                   f"{' '.join(map(str, SPLITS))}; 16 48 with --quick); sizes > batch are skipped")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: "
                   + ", ".join(f"{k} {WORKLOADS[k].batch[SCRIPT]}" for k in choices) + ")")
    add_round_flags(p, SCRIPT, "timed rounds", warmup=False)
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed rounds before them (default 0: a check step already runs every configuration once)")
    p.add_argument("--png", default=None, help="plot path (default: the JSON path with .png)")
    args = p.parse_args(argv)
    work = WORKLOADS[args.model]
    args.batch = args.batch or work.batch[SCRIPT]
    splits = args.splits or ([16, 48] if args.quick else SPLITS)
    if any(k < 1 for k in splits):
        p.error("split sizes must be >= 1")
    args.skipped = sorted(k for k in splits if k > args.batch)
    args.splits = sorted({k for k in splits if k <= args.batch})
    if not args.splits:
        p.error(f"no split size <= batch {args.batch}")
    check_rounds(p, args)
    args.rounds = work.rounds_of(SCRIPT, args)[0]
    suffix = "" if args.model == "resnet50" else f"_{args.model}"
    args.out = args.out or f"results/split_sizes{suffix}{'_quick' if args.quick else ''}.json"
    args.png = args.png or os.path.splitext(args.out)[0] + ".png"
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    work, batch, rounds = WORKLOADS[args.model], args.batch, args.rounds
    torch.set_num_threads(1)  # the plain model's thread; every pipeline stage gets threads=1
    run = Run(SCRIPT, args)
    model, x, y = work.seeded(batch, args.seed)
    run.console.print(f"[bold]{args.model}[/bold]: {work.describe(batch)}; split sizes {args.splits}"
                      f"{f' (skipped > batch: {args.skipped})' if args.skipped else ''}; {rounds} rounds "
                      f"(+{args.warmup} warm-up)")
    steps = build(model, x, y, work.loss_fn, args.splits, run)
    try:
        # under BatchNorm the pipelines' micro-batches give other gradients than the whole batch: no warning then
        bn = any(isinstance(m, (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d)) for m in model.modules())
        checked = baselines.check_grads(list(steps.values()), "plain", "plain", exempt=list(steps) if bn else [])
        run.console.print(f"  built and checked in {run.elapsed:.0f} s; {len(steps)} configurations x {rounds} rounds")
        t0 = run.elapsed
        times = interleaved(steps, rounds=rounds, warmup=args.warmup)
        timing_s = run.elapsed - t0
    finally:
        for step in steps.values():
            step.close()
    rows: List[Dict[str, Any]] = []
    for k in args.splits:
        name, t = f"split={k}", times[f"split={k}"]
        q = statistics.quantiles(t, n=4) if len(t) > 1 else [t[0]] * 3
        info = {key: v for key, v in steps[name].info.items() if key != "schedule"}
        rows.append({"split_size": k, "config": name, **info, "median_ms": median_ms(t), "q1_ms": q[0] * 1e3,
                     "q3_ms": q[2] * 1e3, "speedup_vs_plain": median_ratio(times["plain"], t),
                     "speedup_vs_naive": median_ratio(times["naive-mp"], t)})
    best = max(rows, key=lambda r: r["speedup_vs_plain"])
    plain_ms = median_ms(times["plain"])
    naive = {**steps["naive-mp"].info, "median_ms": median_ms(times["naive-mp"]),
             "speedup_vs_plain": median_ratio(times["plain"], times["naive-mp"])}
    table(args, rows, steps, plain_ms, naive, best, run)
    run.console.print(f"[bold]best split_size: {best['split_size']}[/bold] ({mb_text(best['microbatch_sizes'])} "
                      f"micro-batches): {best['median_ms']:.0f} ms, {best['speedup_vs_plain']:.2f}x vs plain, "
                      f"{best['speedup_vs_naive']:.2f}x vs naive MP; naive MP {naive['speedup_vs_plain']:.2f}x")
    png = plot(args.png, args.model, rows, plain_ms, naive["median_ms"], best["split_size"], rounds)
    run.finish({"workload": work.describe(batch), "input_shape": list(x.shape), "stages": 2, "threads_per_stage": 1,
                "plain_threads": 1, "schedule": "1f1b"}, timing_s=timing_s, plain_ms=plain_ms, naive_mp=naive,
               best={k: best[k] for k in ("split_size", "microbatch_sizes", "median_ms", "speedup_vs_plain",
                                          "speedup_vs_naive")},
               by_split=rows, check=checked, plot=png, times_s=times)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
