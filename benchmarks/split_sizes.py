"""Step time of a 2-stage CPU pipeline against the micro-batch size ``split_size``.

    python benchmarks/split_sizes.py                    # resnet50 3x64x64, batch 120 (~15 min on an idle host)
    python benchmarks/split_sizes.py --model mlp        # MLP 16 x 1024, batch 240 (~3 min)
    python benchmarks/split_sizes.py --quick            # smoke run: split sizes 16 48, 1 round

Two stages on two cores, one intra-op thread per stage
(``Pipeline(model, ["cpu", "cpu"], split_size=k, balance="time", sample=..., threads=1)``).
For every split size k (8 12 16 20 24 32 48 64 96 120 by default: some multiples
of 16/32, some not; sizes above the batch are skipped) one forward+backward
training step (1F1B, gradients zeroed, no optimizer step) is timed next to

* ``plain``: the plain model on the whole batch, 1 thread;
* ``naive-mp``: naive model parallelism, the same 2 stages with ``chunks=1``
  (the whole batch goes through stage 0, then stage 1: no overlap).

The cut: computed once per split size, at that micro-batch size (the
partitioner profiles the layers on a sample of exactly k rows). The sample
handed to the pipeline is ``x[:k]``, not the batch: given a whole batch,
pipeddp profiles at n / ceil(n / k) rows, which is not k when k does not
divide n (60 for ``split_size=96`` of 120). ``naive-mp`` is cut at the whole
batch (its micro-batch).

All configurations are interleaved step by step (rotating order) and compared
by the median of per-round ratios (the host's speed drifts). The best split is
the one with the highest median speedup over ``plain``. Output: a rich table,
JSON (``results/split_sizes[_mlp].json``) and a PNG plot (step time against
split size, horizontal lines for plain and naive MP).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from rich.console import Console
from torch import nn

from pipeddp.runtime.microbatch import split_sizes
from pipeddp.tools.models import mlp, resnet
from pipeddp.partitioning.report import Partition
from pipeddp.pipeline import Pipeline

try:  # run as a script (benchmarks/ is sys.path[0]) or as python -m benchmarks.split_sizes
    from benchmarks.common import (
        Workload, grad_rel_diff, interleaved, median_ms, median_ratio, print_table, write_json,
    )
except ImportError:  # pragma: no cover - depends on how the script is started
    from common import Workload, grad_rel_diff, interleaved, median_ms, median_ratio, print_table, write_json

STAGES = 2
SPLITS = [8, 12, 16, 20, 24, 32, 48, 64, 96, 120]


WORKLOADS: Dict[str, Workload] = {
    # ~11 s per plain step at 1 thread; 12 configurations: ~90 s per round.
    "resnet50": Workload(
        "resnet50 (flattened, 23 layers), 3x64x64, batch 120, cross-entropy vs random labels (1000 classes)",
        lambda: resnet("resnet50"),
        lambda n: (torch.randn(n, 3, 64, 64), torch.randint(0, 1000, (n,))),
        nn.functional.cross_entropy, batch_size=120, rounds=5,
    ),
    # ~0.7 s per plain step: cheap, many rounds.
    "mlp": Workload(
        "MLP 16 x (Linear(1024,1024)+ReLU), batch 240, MSE vs random targets",
        lambda: mlp(16, 1024),
        lambda n: (torch.randn(n, 1024), torch.randn(n, 1024)),
        nn.functional.mse_loss, batch_size=240, rounds=12,
    ),
}


def build_pipeline(model: nn.Sequential, sample: torch.Tensor, **kwargs: Any) -> Pipeline:
    """``Pipeline(model, ["cpu"]*2, balance="time", sample=sample, threads=1, **kwargs)``."""
    return Pipeline(model, ["cpu"] * STAGES, balance="time", sample=sample, threads=1, **kwargs)


def _mb_text(sizes: Sequence[int]) -> str:
    """Micro-batch sizes in short: ``15 x 8``, ``7 x 16 + 8``."""
    groups: List[List[int]] = []
    for k in sizes:
        if groups and groups[-1][1] == k:
            groups[-1][0] += 1
        else:
            groups.append([1, k])
    if len(groups) == 1:
        return f"{groups[0][0]} x {groups[0][1]}"  # "1 x 120", not "120": a count, then a size
    return " + ".join(f"{n} x {k}" if n > 1 else str(k) for n, k in groups)


def _multiple(k: int) -> str:
    return "32" if k % 32 == 0 else "16" if k % 16 == 0 else "-"


def plot(path: str, name: str, rows: List[Dict[str, Any]], plain_ms: float, naive_ms: float, best: int,
         rounds: int) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is optional
        return None
    ks = [r["split_size"] for r in rows]
    ms = [r["median_ms"] for r in rows]
    lo = [r["median_ms"] - r["q1_ms"] for r in rows]
    hi = [r["q3_ms"] - r["median_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.errorbar(ks, ms, yerr=[lo, hi], fmt="-", color="#4C72B0", ecolor="#9DB3D8", capsize=3, zorder=2,
                label="pipeline, 2 stages (median, IQR)")
    m16 = [(k, v) for k, v in zip(ks, ms) if k % 16 == 0]
    other = [(k, v) for k, v in zip(ks, ms) if k % 16]
    if m16:
        ax.scatter(*zip(*m16), color="#4C72B0", zorder=3, label="split = multiple of 16")
    if other:
        ax.scatter(*zip(*other), facecolors="white", edgecolors="#4C72B0", zorder=3, label="split not a multiple of 16")
    b = next(r for r in rows if r["split_size"] == best)
    ax.scatter([best], [b["median_ms"]], marker="*", s=260, color="#C44E52", zorder=4, label=f"best: split {best}")
    ax.axhline(plain_ms, color="#55A868", linestyle="--", label=f"plain model, 1 thread ({plain_ms:.0f} ms)")
    ax.axhline(naive_ms, color="#DD8452", linestyle=":", label=f"naive MP, chunks=1 ({naive_ms:.0f} ms)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", choices=list(WORKLOADS))
    p.add_argument("--splits", nargs="+", type=int, default=None,
                   help=f"split sizes (default {' '.join(map(str, SPLITS))}; 16 48 with --quick); sizes > batch are skipped")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: resnet50 120, mlp 240)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds; default per model: " + ", ".join(f"{k} {w.rounds}" for k, w in WORKLOADS.items())
                        + "; 1 with --quick")
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed rounds before them (default 0: a check step already runs every configuration once)")
    p.add_argument("--quick", action="store_true", help="smoke run: split sizes 16 48, 1 round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default results/split_sizes[_<model>].json)")
    p.add_argument("--png", default=None, help="plot path (default: the JSON path with .png)")
    args = p.parse_args(argv)
    work = WORKLOADS[args.model]
    batch = args.batch or work.batch_size
    splits = args.splits or ([16, 48] if args.quick else SPLITS)
    if any(k < 1 for k in splits):
        p.error("split sizes must be >= 1")
    skipped = sorted(k for k in splits if k > batch)
    splits = sorted({k for k in splits if k <= batch})
    if not splits:
        p.error(f"no split size <= batch {batch}")
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else work.rounds)
    if rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    suffix = "" if args.model == "resnet50" else f"_{args.model}"
    out_path = args.out or f"results/split_sizes{suffix}{'_quick' if args.quick else ''}.json"
    png_path = args.png or os.path.splitext(out_path)[0] + ".png"

    torch.set_num_threads(1)  # the plain model's thread; every pipeline stage gets threads=1
    console = Console(width=max(160, Console().width))
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    model = work.build()
    model.train()
    x, y = work.batch(batch)
    loss_fn = work.loss_fn
    console.print(f"[bold]{args.model}[/bold]: {work.describe.replace('batch ' + str(work.batch_size), f'batch {batch}')}; "
                  f"split sizes {splits}{f' (skipped > batch: {skipped})' if skipped else ''}; {rounds} rounds "
                  f"(+{args.warmup} warm-up)")

    def plain() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.detach()

    pipes: Dict[str, Pipeline] = {}
    info: Dict[str, Dict[str, Any]] = {}
    fns: Dict[str, Callable[[], Any]] = {"plain": plain}
    try:
        builds = [("naive-mp", {"chunks": 1}, x)] + [(f"split={k}", {"split_size": k}, x[:k]) for k in splits]
        for name, kw, sample in builds:
            t0 = time.perf_counter()
            pipe = build_pipeline(copy.deepcopy(model), sample, **kw)
            pipes[name] = pipe
            sizes = split_sizes(batch, pipe.chunks, pipe.split_size)
            part: Partition = pipe.partition
            info[name] = {"microbatch_sizes": sizes, "balance": list(pipe.balance),
                          "profiled_at_microbatch": int(sample.shape[0]),
                          "profiled_stage_ms": [c * 1e3 for c in part.stage_costs],
                          "profiled_ratio": part.bottleneck / part.ideal if part.ideal else None,
                          "build_s": time.perf_counter() - t0}
            console.print(f"  {name}: {_mb_text(sizes)} micro-batches, cut at micro-batch {sample.shape[0]} -> "
                          f"balance {pipe.balance} (profiled stage ms {[round(c * 1e3, 1) for c in part.stage_costs]}), "
                          f"{info[name]['build_s']:.1f} s")

            def step(pipe: Pipeline = pipe) -> torch.Tensor:
                pipe.zero_grad(set_to_none=True)
                return pipe.train_step(x, y, loss_fn)

            fns[name] = step

        # One untimed step of every configuration (warm-up; gradients compared with the plain model's).
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        loss_plain = plain().item()
        ref = [None if q.grad is None else q.grad.detach().clone() for q in model.parameters()]
        check: Dict[str, Any] = {"plain_loss": loss_plain}
        for name, pipe in pipes.items():
            loss = fns[name]().item()
            check[name] = {"loss": loss, "grad_rel_diff_vs_plain": grad_rel_diff(ref, pipe)}
            if not has_bn and check[name]["grad_rel_diff_vs_plain"] > 1e-4:
                console.print(f"  [red]warning[/red]: {name} gradients differ from the plain model's by "
                              f"{check[name]['grad_rel_diff_vs_plain']:.2e} (relative)")
        del ref
        console.print(f"  built and checked in {time.perf_counter() - started:.0f} s; timing {len(fns)} configurations "
                      f"x {rounds} rounds")
        t_time = time.perf_counter()
        times = interleaved(fns, rounds=rounds, warmup=args.warmup)
        timing_s = time.perf_counter() - t_time
    finally:
        for pipe in pipes.values():
            pipe.close()

    rows: List[Dict[str, Any]] = []
    for k in splits:
        name = f"split={k}"
        t = times[name]
        q = statistics.quantiles(t, n=4) if len(t) > 1 else [t[0]] * 3
        rows.append({"split_size": k, "config": name, **info[name], "median_ms": median_ms(t),
                     "q1_ms": q[0] * 1e3, "q3_ms": q[2] * 1e3,
                     "speedup_vs_plain": median_ratio(times["plain"], t),
                     "speedup_vs_naive": median_ratio(times["naive-mp"], t)})
    best = max(rows, key=lambda r: r["speedup_vs_plain"])
    plain_ms = median_ms(times["plain"])
    naive_ms = median_ms(times["naive-mp"])
    naive_vs_plain = median_ratio(times["plain"], times["naive-mp"])

    table = [["plain", "-", f"1 x {batch}", "-", "-", f"{plain_ms:.0f}", "1.00x", f"{1 / naive_vs_plain:.2f}x", "-", ""],
             ["naive MP", "-", _mb_text(info["naive-mp"]["microbatch_sizes"]), str(info["naive-mp"]["balance"]),
              "/".join(f"{v:.0f}" for v in info["naive-mp"]["profiled_stage_ms"]), f"{naive_ms:.0f}",
              f"{naive_vs_plain:.2f}x", "1.00x", "-", ""]]
    for r in rows:
        table.append([r["config"], r["split_size"], _mb_text(r["microbatch_sizes"]), str(r["balance"]),
                      "/".join(f"{v:.0f}" for v in r["profiled_stage_ms"]), f"{r['median_ms']:.0f}",
                      f"{r['speedup_vs_plain']:.2f}x", f"{r['speedup_vs_naive']:.2f}x", _multiple(r["split_size"]),
                      "<- best" if r is best else ""])
    print_table(
        f"{args.model}: 2-stage CPU pipeline (1F1B, 1 thread per stage) vs split_size; medians of {rounds} "
        "interleaved rounds",
        ["config", "split", "micro-batches", "balance", "profiled stage ms", "step ms", "vs plain", "vs naive MP",
         "multiple of", "best"],
        table, console=console,
        caption=f"{work.describe.replace('batch ' + str(work.batch_size), f'batch {batch}')}. Partition: computed once "
                "per split size, at that micro-batch size (naive MP: at the whole batch) by partition(method='time'). "
                "vs plain / vs naive MP = median per-round speedup (> 1: faster). "
                "Best = highest speedup over plain.",
    )
    console.print(f"[bold]best split_size: {best['split_size']}[/bold] ({_mb_text(best['microbatch_sizes'])} "
                  f"micro-batches): {best['median_ms']:.0f} ms, {best['speedup_vs_plain']:.2f}x vs plain, "
                  f"{best['speedup_vs_naive']:.2f}x vs naive MP; naive MP is {naive_vs_plain:.2f}x vs plain")
    png = plot(png_path, args.model, rows, plain_ms, naive_ms, best["split_size"], rounds)
    elapsed = time.perf_counter() - started
    out = write_json(out_path, {
        "benchmark": "split_sizes",
        "settings": {"model": args.model, "workload": work.describe, "batch": batch, "input_shape": list(x.shape),
                     "splits": splits, "skipped_splits": skipped, "rounds": rounds, "warmup": args.warmup,
                     "stages": STAGES, "threads_per_stage": 1, "plain_threads": 1, "schedule": "1f1b",
                     "quick": args.quick, "seed": args.seed,
                     "partition": "computed once per split size at that micro-batch size (sample = x[:split]); "
                                  "naive MP at the whole batch",
                     "timing": "interleaved per step, rotating order; speedups are medians of per-round ratios"},
        "elapsed_s": elapsed,
        "timing_s": timing_s,
        "plain_ms": plain_ms,
        "naive_mp": {**info["naive-mp"], "median_ms": naive_ms, "speedup_vs_plain": naive_vs_plain},
        "best": {k: best[k] for k in ("split_size", "microbatch_sizes", "median_ms", "speedup_vs_plain",
                                      "speedup_vs_naive")},
        "by_split": rows,
        "check": check,
        "plot": png,
        "times_s": times,
    })
    console.print(f"wrote {out}{f' and {png}' if png else ''} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
