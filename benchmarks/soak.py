"""Soak test: 2,000 training steps of a small 2 x 2 hybrid job on CPU; does memory, threads or fds grow?

Replica mode's stage threads, local channels and per-stage DDP groups are the long-lived machinery most
likely to leak. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks.common import Run, init_job, parser, proc_status
from benchmarks.workloads import mlp_workload

PROCS = 2
STAGES = 2


def sample(step: int, t0: float) -> Dict[str, Any]:
    """Resident memory (kB), threads and open fds, after a garbage collection: only memory still held counts."""
    gc.collect()
    st = proc_status()
    return {"step": step, "t": time.perf_counter() - t0, "rss_kb": st["VmRSS"], "hwm_kb": st.get("VmHWM"),
            "os_threads": st["Threads"], "py_threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd"))}


def job(settings: Dict[str, Any]) -> Dict[str, Any]:
    """One replica: a real training loop (zero_grad, train_step, optimizer step), sampled at ``marks``."""
    rank = init_job(settings["timeout"])
    torch.manual_seed(settings["seed"])
    work = mlp_workload(settings["layers"], settings["width"])
    engine = pipeddp.HybridParallel(work.build(), stages=STAGES, chunks=settings["chunks"], mode="replica",
                                    devices=["cpu"] * STAGES, backend="gloo", threads=1)
    opt = torch.optim.SGD(engine.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(settings["seed"] * 1000 + rank)  # a fresh local batch every step
    n, w = settings["batch"], settings["width"]
    steps, warmup = settings["steps"], settings["warmup"]
    marks = set(round(warmup + i * (steps - warmup) / (settings["samples"] - 1)) for i in range(settings["samples"]))
    samples: List[Dict[str, Any]] = []
    losses: List[float] = []
    t0 = t_mark = time.perf_counter()
    last_mark = 0
    for step in range(1, steps + 1):
        x, y = torch.randn(n, w, generator=gen), torch.randn(n, w, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = engine.train_step(x, y, work.loss_fn)
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
    out = {"rank": rank, "samples": samples, "losses": losses, "balance": list(engine.balance),
           "elapsed_s": time.perf_counter() - t0}
    engine.close()
    dist.barrier()
    return out


def verdict(samples: List[Dict[str, Any]], tol_mb: float) -> Dict[str, Any]:
    """Growth from the first sample to the last, and the RSS trend (least squares, MB per 1,000 steps)."""
    s0, s1 = samples[0], samples[-1]
    rss = [s["rss_kb"] / 1024 for s in samples]
    steps = [s["step"] for s in samples]
    slope = float(numpy.polyfit(steps, rss, 1)[0]) * 1000 if len(samples) > 2 else 0.0
    growth = {"rss_mb": rss[-1] - rss[0], "os_threads": s1["os_threads"] - s0["os_threads"],
              "py_threads": s1["py_threads"] - s0["py_threads"], "fds": s1["fds"] - s0["fds"]}
    ok = growth["rss_mb"] < tol_mb and growth["os_threads"] <= 0 and growth["py_threads"] <= 0 and growth["fds"] <= 0
    return {"start": s0, "end": s1,
            "max": {k: max(s[k] for s in samples) for k in ("rss_kb", "os_threads", "py_threads", "fds")},
            "growth": growth, "rss_slope_mb_per_1000_steps": slope, "no_leak": ok}


def report(per_rank: List[Dict[str, Any]], args: argparse.Namespace, run: Run) -> None:
    """Start / end / max per rank (every sample is in the JSON), and the loss: training really happened."""
    rows = []
    for v in per_rank:
        s0, s1, mx = v["start"], v["end"], v["max"]
        rows.append([f"rank {v['rank']}", " / ".join(f"{s['rss_kb'] / 1024:.1f}" for s in (s0, s1, mx)),
                     f"{v['growth']['rss_mb']:+.2f}", f"{v['rss_slope_mb_per_1000_steps']:+.2f}"]
                    + [" / ".join(str(s[k]) for s in (s0, s1, mx)) for k in ("os_threads", "py_threads", "fds")]
                    + [f"{s0['ms_per_step']:.1f} / {s1['ms_per_step']:.1f}", "no leak" if v["no_leak"] else "GROWTH"])
    run.table(f"soak: {args.steps} steps, 2 x 2 hybrid (replica mode), start (step {args.warmup}) / end / max",
              ["rank", "RSS MB", "RSS growth MB", "RSS trend MB/1k steps", "OS threads", "Python threads", "open fds",
               "ms/step start / end", "verdict"], rows,
              caption=f"{args.samples} samples per rank after gc.collect(); no leak: RSS grew < "
                      f"{args.rss_tolerance_mb:g} MB, threads and fds did not; trend: least-squares slope of RSS")
    losses = per_rank[0]["losses"]
    run.console.print(f"loss (global mean, every 50 steps): first {losses[0]:.4f}, last {losses[-1]:.4f}; replicas "
                      f"checked identical (check_replicas) at the end; balance {per_rank[0]['balance']}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser(__doc__, "200 steps", spawns=True)
    p.add_argument("--steps", type=int, default=None, help="training steps (default 2000; 200 with --quick)")
    p.add_argument("--warmup", type=int, default=50, help="steps before the first (start) sample")
    p.add_argument("--samples", type=int, default=11, help="samples from start to end, evenly spaced (default 11)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="local batch per replica")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--rss-tolerance-mb", type=float, default=5.0)
    args = p.parse_args(argv)
    if args.device != "cpu":
        p.error("runs on the CPU only: it watches the resident memory of CPU processes")
    args.steps = steps = args.steps or (200 if args.quick else 2000)
    if args.warmup < 1 or steps <= args.warmup or args.samples < 2:
        p.error("need --warmup >= 1, --steps > --warmup and --samples >= 2")
    settings = vars(args)
    run = Run("soak", args, "one spawned gloo job of 2 replicas; samples after gc.collect()")
    run.console.print(f"soak: {steps} steps of HybridParallel(mode='replica') {PROCS} replicas x {STAGES} stages, "
                      f"{mlp_workload(args.layers, args.width).model_text}, local batch {args.batch}, {args.chunks} "
                      f"micro-batches, 1 thread per stage thread, gloo; samples at steps {args.warmup}..{steps}")
    res = pipeddp.spawn(job, PROCS, args=(settings,), timeout=args.timeout, threads=1)
    per_rank = [{**r, **verdict(r["samples"], args.rss_tolerance_mb)} for r in res]
    report(per_rank, args, run)
    ok = all(r["no_leak"] for r in per_rank)
    run.console.print(f"[bold]verdict: {'no leak' if ok else 'GROWTH beyond tolerance'}[/bold]")
    run.finish({"processes": PROCS, "stages": STAGES, "mode": "replica", "threads": 1,
                "optimizer": "SGD(lr=0.01, momentum=0.9)"}, no_leak=ok, ranks=per_rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
