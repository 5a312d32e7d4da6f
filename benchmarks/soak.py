"""Soak test: 2,000 training steps of a small 2 x 2 hybrid job on CPU; does memory, threads or fds grow?

    python benchmarks/soak.py                  # 2,000 steps (~2-4 min)
    python benchmarks/soak.py --quick          # 200 steps
    python benchmarks/soak.py --steps 10000 --samples 40

The job: ``pipeddp.spawn`` of 2 processes (gloo, 1 intra-op thread each), each a replica of
``HybridParallel(mode="replica", stages=2)``: 2 replicas x 2 stages, every process driving its 2 stages
with stage threads, DDP per stage across the replicas. Replica mode (not 4 processes in stage mode):
it exercises the stage threads, the local channels and the per-stage DDP groups, the long-lived
machinery most likely to leak, on 2 processes that fit 2 cores. The model is the small benchmark
MLP (8 x Linear(256,256)+ReLU), a fresh random local batch of 64 every step, 4 micro-batches, 1F1B,
SGD with momentum (a real training loop: zero_grad, train_step, optimizer.step).

Every process records, after ``gc.collect()``: resident memory (``VmRSS`` of ``/proc/self/status``),
OS threads (``Threads``), Python threads (``threading.active_count()``) and open file descriptors
(``len(os.listdir('/proc/self/fd'))``), at the start (after a warm-up of 50 steps), at a few evenly
spaced steps in between, and at the end. Reported per rank: start / end / max and the growth, plus
the RSS trend (least-squares slope over the samples, MB per 1,000 steps). Verdict: no leak if RSS grew
by less than ``--rss-tolerance-mb`` (5 MB) and the thread and fd counts did not grow at all.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

import pipeddp
from pipeddp.tools.models import mlp

try:  # run as a script (benchmarks/ is sys.path[0]) or as python -m benchmarks.soak
    from benchmarks.common import print_table, write_json
except ImportError:  # pragma: no cover - depends on how the script is started
    from common import print_table, write_json

PROCS = 2
STAGES = 2


def _status() -> Dict[str, int]:
    out: Dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                out[key] = int(value.split()[0])
    return out


def sample(step: int, t0: float) -> Dict[str, Any]:
    gc.collect()
    st = _status()
    return {"step": step, "t": time.perf_counter() - t0, "rss_kb": st["VmRSS"], "hwm_kb": st.get("VmHWM"),
            "os_threads": st["Threads"], "py_threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd"))}


def job(settings: Dict[str, Any]) -> Dict[str, Any]:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=settings["timeout"]))
    torch.set_num_threads(1)
    torch.manual_seed(settings["seed"])
    model = mlp(settings["layers"], settings["width"], settings["width"], settings["width"])
    engine = pipeddp.HybridParallel(model, stages=STAGES, chunks=settings["chunks"], mode="replica",
                                    devices=["cpu"] * STAGES, backend="gloo", threads=1)
    opt = torch.optim.SGD(engine.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(settings["seed"] * 1000 + rank)
    n, w = settings["batch"], settings["width"]
    loss_fn = nn.functional.mse_loss
    steps, warmup = settings["steps"], settings["warmup"]
    marks = set(round(warmup + i * (steps - warmup) / (settings["samples"] - 1)) for i in range(settings["samples"]))
    samples: List[Dict[str, Any]] = []
    losses: List[float] = []
    t0 = time.perf_counter()
    t_mark = t0
    last_mark = 0
    for step in range(1, steps + 1):
        x = torch.randn(n, w, generator=gen)
        y = torch.randn(n, w, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = engine.train_step(x, y, loss_fn)
        opt.step()
        if step % 50 == 0 or step == steps:
            losses.append(float(loss))
        if step in marks:
            now = time.perf_counter()
            s = sample(step, t0)
            s["ms_per_step"] = (now - t_mark) * 1e3 / (step - last_mark)  # since the previous sample
            samples.append(s)
            t_mark, last_mark = time.perf_counter(), step
    engine.check_replicas()  # the replicas still agree bit for bit
    balance = list(engine.balance)
    engine.close()
    dist.barrier()
    return {"rank": rank, "samples": samples, "losses": losses, "balance": balance,
            "elapsed_s": time.perf_counter() - t0}


def verdict(samples: List[Dict[str, Any]], tol_mb: float) -> Dict[str, Any]:
    s0, s1 = samples[0], samples[-1]
    rss = [s["rss_kb"] / 1024 for s in samples]
    steps = [s["step"] for s in samples]
    slope = 0.0
    if len(samples) > 2:
        ms, mr = statistics.mean(steps), statistics.mean(rss)
        den = sum((a - ms) ** 2 for a in steps)
        slope = sum((a - ms) * (b - mr) for a, b in zip(steps, rss)) / den * 1000 if den else 0.0
    growth = {"rss_mb": rss[-1] - rss[0], "os_threads": s1["os_threads"] - s0["os_threads"],
              "py_threads": s1["py_threads"] - s0["py_threads"], "fds": s1["fds"] - s0["fds"]}
    ok = growth["rss_mb"] < tol_mb and growth["os_threads"] <= 0 and growth["py_threads"] <= 0 and growth["fds"] <= 0
    return {"start": s0, "end": s1,
            "max": {k: max(s[k] for s in samples) for k in ("rss_kb", "os_threads", "py_threads", "fds")},
            "growth": growth, "rss_slope_mb_per_1000_steps": slope, "no_leak": ok}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="training steps (default 2000; 200 with --quick)")
    p.add_argument("--warmup", type=int, default=50, help="steps before the first (start) sample")
    p.add_argument("--samples", type=int, default=11, help="samples from start to end, evenly spaced (default 11)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="local batch per replica")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--rss-tolerance-mb", type=float, default=5.0)
    p.add_argument("--quick", action="store_true", help="200 steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--out", default=None, help="JSON path (default results/soak[_quick].json)")
    args = p.parse_args(argv)
    steps = args.steps or (200 if args.quick else 2000)
    if args.warmup < 1 or steps <= args.warmup:
        p.error("need --warmup >= 1 and --steps > --warmup")
    if args.samples < 2:
        p.error("--samples must be >= 2")
    out_path = args.out or f"results/soak{'_quick' if args.quick else ''}.json"
    settings = {"steps": steps, "warmup": args.warmup, "samples": args.samples, "layers": args.layers,
                "width": args.width, "batch": args.batch, "chunks": args.chunks, "seed": args.seed,
                "timeout": args.timeout}
    console = Console(width=max(160, Console().width))
    console.print(f"soak: {steps} steps of HybridParallel(mode='replica') {PROCS} replicas x {STAGES} stages, "
                  f"MLP {args.layers} x {args.width}, local batch {args.batch}, {args.chunks} micro-batches, 1 thread "
                  f"per stage thread, gloo; samples at steps {args.warmup}..{steps}")
    started = time.perf_counter()
    res = pipeddp.spawn(job, PROCS, args=(settings,), timeout=args.timeout, threads=1)
    elapsed = time.perf_counter() - started

    per_rank = []
    rows = []
    for r in res:
        v = verdict(r["samples"], args.rss_tolerance_mb)
        per_rank.append({**r, **v})
        s0, s1, mx, g = v["start"], v["end"], v["max"], v["growth"]
        rows.append([f"rank {r['rank']}",
                     f"{s0['rss_kb'] / 1024:.1f} / {s1['rss_kb'] / 1024:.1f} / {mx['rss_kb'] / 1024:.1f}",
                     f"{g['rss_mb']:+.2f}", f"{v['rss_slope_mb_per_1000_steps']:+.2f}",
                     f"{s0['os_threads']} / {s1['os_threads']} / {mx['os_threads']}",
                     f"{s0['py_threads']} / {s1['py_threads']} / {mx['py_threads']}",
                     f"{s0['fds']} / {s1['fds']} / {mx['fds']}",
                     f"{s0['ms_per_step']:.1f} / {s1['ms_per_step']:.1f}",
                     "no leak" if v["no_leak"] else "GROWTH"])
    print_table(
        f"soak: {steps} steps, 2 x 2 hybrid (replica mode), start (step {args.warmup}) / end (step {steps}) / max",
        ["rank", "RSS MB", "RSS growth MB", "RSS trend MB/1k steps", "OS threads", "Python threads", "open fds",
         "ms/step start / end", "verdict"],
        rows, console=console,
        caption=f"{args.samples} samples per rank after gc.collect(); verdict: no leak if RSS grew < "
                f"{args.rss_tolerance_mb:g} MB and thread / fd counts did not grow; trend = least-squares slope of RSS "
                "over the samples. ms/step = mean over the interval before the sample.",
    )
    srows = []
    for r in per_rank:
        for s in r["samples"]:
            srows.append([f"rank {r['rank']}", s["step"], f"{s['rss_kb'] / 1024:.1f}", s["os_threads"], s["py_threads"],
                          s["fds"], f"{s['ms_per_step']:.1f}"])
    print_table("soak samples", ["rank", "step", "RSS MB", "OS threads", "Python threads", "fds", "ms/step"], srows,
                console=console)
    losses = per_rank[0]["losses"]
    console.print(f"loss (global mean, every 50 steps): first {losses[0]:.4f}, last {losses[-1]:.4f}; replicas checked "
                  f"identical (check_replicas) at the end; balance {per_rank[0]['balance']}")
    ok = all(r["no_leak"] for r in per_rank)
    console.print(f"[bold]verdict: {'no leak' if ok else 'GROWTH beyond tolerance'}[/bold] ({elapsed / 60:.1f} min)")
    out = write_json(out_path, {
        "benchmark": "soak",
        "settings": {**settings, "processes": PROCS, "stages": STAGES, "mode": "replica", "threads": 1,
                     "optimizer": "SGD(lr=0.01, momentum=0.9)", "rss_tolerance_mb": args.rss_tolerance_mb,
                     "quick": args.quick},
        "elapsed_s": elapsed,
        "no_leak": ok,
        "ranks": per_rank,
    })
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
