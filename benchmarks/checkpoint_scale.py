"""Checkpoints at scale: one file gathered on rank 0, against sharded (every rank its own share), sync and async.

A model of 16 x Linear(4096, 4096) (1.07 GB of float32 parameters, 2.15 GB more of Adam state) in 4 stages, one
CPU process each (``mode="stage"``, gloo). See benchmarks/README.md.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import statistics
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks.common import Run, gather, init_job, log0, median_ratio, parser, proc_status
from benchmarks.workloads import mlp_workload

STAGES = 4
CONFIGS = ("consolidated", "sharded", "sharded-async")
#: the targets: the sharded save's peak resident memory above what the rank held before it, as a share of the
#: rank's own shard (parameters + optimizer state); the async save's blocking time against the one file's
PEAK_TARGET, BLOCK_TARGET = 0.25, 0.25


@contextlib.contextmanager
def peak_rss(out: Dict[str, Any], interval: float = 0.002) -> Iterator[None]:
    """This process's peak RSS over a ``with`` block in ``out["peak"]``: the kernel's high-water mark, reset through
    /proc/self/clear_refs where allowed, and RSS sampled in a thread (all there is without; it can miss a peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        out["hwm_reset"] = True
    except OSError:
        out["hwm_reset"] = False
    stop, peak = threading.Event(), [0]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc_status()["VmRSS"] * 1024)
            time.sleep(interval)

    sampler = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    sampler.start()
    try:
        yield
    finally:
        stop.set()
        sampler.join()
        st = proc_status()
        out["peak"] = max(peak[0], st["VmRSS"] * 1024, st["VmHWM"] * 1024 if out["hwm_reset"] else 0)


def _bytes(values: Any) -> int:
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    if isinstance(values, (dict, list, tuple)):
        return sum(_bytes(v) for v in (values.values() if isinstance(values, dict) else values))
    return 0


def job(settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Every rank: train one step (Adam state exists), then each configuration once per round, rotating order."""
    rank = init_job(settings["timeout"])
    work = mlp_workload(settings["layers"], settings["width"])
    model, x, y = work.seeded(settings["batch"], settings["seed"])
    engine = pipeddp.HybridParallel(model, stages=STAGES, mode="stage", chunks=2, devices=["cpu"], backend="gloo")
    del model
    gc.collect()
    opt = torch.optim.Adam(engine.parameters(), lr=1e-4)

    def step() -> float:
        t0 = time.perf_counter()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, work.loss_fn)
        opt.step()
        opt.zero_grad(set_to_none=True)  # a loop's gradients are gone by the time it saves
        return time.perf_counter() - t0

    step_s = step()
    shard = _bytes(engine.local_state_dict()) + _bytes(opt.state_dict()["state"])
    out_dir = settings["dir"]
    rows: Dict[str, List[Dict[str, float]]] = {name: [] for name in CONFIGS}
    sizes: Dict[str, int] = {}
    for r in range(settings["rounds"]):
        k = r % len(CONFIGS)
        for name in CONFIGS[k:] + CONFIGS[:k]:
            path = os.path.join(out_dir, "one.pt" if name == "consolidated" else name)
            gc.collect()
            dist.barrier()
            before, peak = proc_status()["VmRSS"] * 1024, {}
            with peak_rss(peak):
                t0 = time.perf_counter()
                if name == "consolidated":
                    engine.save(path, optimizer=opt)
                else:
                    engine.save(path, optimizer=opt, sharded=True, async_save=name == "sharded-async")
                blocked = time.perf_counter() - t0
                engine.wait_for_save()
                durable = time.perf_counter() - t0
            dist.barrier()
            rows[name].append({"blocked_s": blocked, "durable_s": durable, "rss_before": before,
                               "rss_peak": peak["peak"], "hwm_reset": peak["hwm_reset"]})
            if rank == 0:
                files = [os.path.join(path, f) for f in os.listdir(path)] if os.path.isdir(path) else [path]
                sizes[name] = sum(os.path.getsize(f) for f in files)
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            dist.barrier()
        log0(f"    round {r + 1}/{settings['rounds']} done")
    result = {"rank": rank, "shard_bytes": shard, "rows": rows, "step_s": step_s, "sizes": sizes,
              "balance": list(engine.balance)}
    engine.close()
    everyone = gather(result)
    dist.barrier()
    return {"ranks": everyone} if rank == 0 else None


def analyse(ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per save: blocking and durable time (slowest rank), each rank's peak above what it held before; targets."""
    c: Dict[str, Any] = {}
    for name in CONFIGS:
        slowest = {k: [max(rows) for rows in zip(*([row[k] for row in r["rows"][name]] for r in ranks))]
                   for k in ("blocked_s", "durable_s")}
        c[name] = {**slowest, "blocked_median_s": statistics.median(slowest["blocked_s"]),
                   "durable_median_s": statistics.median(slowest["durable_s"]),
                   "disk_mb": ranks[0]["sizes"].get(name, 0) / 2**20, "ranks": []}
        for r in ranks:
            rows, extra = r["rows"][name], max(row["rss_peak"] - row["rss_before"] for row in r["rows"][name])
            c[name]["ranks"].append({"rank": r["rank"], "shard_mb": r["shard_bytes"] / 2**20,
                                     "rss_before_mb": max(row["rss_before"] for row in rows) / 2**20,
                                     "rss_peak_mb": max(row["rss_peak"] for row in rows) / 2**20,
                                     "peak_above_before_mb": extra / 2**20,
                                     "peak_above_before_share": extra / r["shard_bytes"]})
    worst_share = max(p["peak_above_before_share"] for p in c["sharded"]["ranks"])
    block_ratio = median_ratio(c["sharded-async"]["blocked_s"], c["consolidated"]["blocked_s"])
    targets = {
        "sharded_peak_above_before_share_worst_rank": worst_share, "sharded_peak_target": PEAK_TARGET,
        "sharded_peak_met": worst_share <= PEAK_TARGET,
        "async_blocked_over_consolidated": block_ratio, "blocked_target": BLOCK_TARGET,
        "blocked_met": block_ratio <= BLOCK_TARGET,
        "sharded_sync_blocked_over_consolidated": median_ratio(c["sharded"]["blocked_s"],
                                                               c["consolidated"]["blocked_s"]),
        "hwm_reset": all(row["hwm_reset"] for r in ranks for rows in r["rows"].values() for row in rows),
    }
    return {"configs": c, "targets": targets}


def report(res: Dict[str, Any], run: Run, settings: Dict[str, Any]) -> None:
    c, t = res["configs"], res["targets"]
    rows = [[name, f"{c[name]['blocked_median_s']:.2f}", f"{c[name]['durable_median_s']:.2f}",
             f"{c[name]['disk_mb']:.0f}"]
            + [f"{p['peak_above_before_mb']:.0f} ({p['peak_above_before_share']:.0%})" for p in c[name]["ranks"]]
            for name in CONFIGS]
    shards = " / ".join(f"{p['shard_mb']:.0f}" for p in c["consolidated"]["ranks"])
    run.table(f"checkpoint of {settings['model_text']} + Adam, {STAGES} stages x 1 replica (stage mode, gloo), "
              f"{settings['rounds']} round(s)",
              ["save", "loop blocked s", "durable s", "on disk MB"]
              + [f"rank {p['rank']} peak above before MB (of shard)" for p in c["consolidated"]["ranks"]], rows,
              caption=f"medians over rounds of the slowest rank; shard (parameters + Adam state) per rank MB: "
                      f"{shards}; peak: VmHWM reset by clear_refs {'yes' if t['hwm_reset'] else 'no (RSS sampled)'}")
    run.targets([["sharded save's peak above what a rank held before / its shard, worst rank",
                  t["sharded_peak_above_before_share_worst_rank"], f"<= {PEAK_TARGET}", t["sharded_peak_met"]],
                 ["loop blocked by the async save / by the one file", t["async_blocked_over_consolidated"],
                  f"<= {BLOCK_TARGET}", t["blocked_met"]],
                 ["loop blocked by the sharded sync save / by the one file",
                  t["sharded_sync_blocked_over_consolidated"], "-"]])


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser(__doc__, "4 x Linear(256, 256), 1 round", spawns=True, device=False)  # resident memory of CPU processes
    p.add_argument("--layers", type=int, default=None, help="Linear layers (default 16; 4 with --quick)")
    p.add_argument("--width", type=int, default=None, help="their width (default 4096; 256 with --quick)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of the 3 saves (default 3; 1 with --quick)")
    p.add_argument("--batch", type=int, default=4, help="batch of the one training step that creates Adam's state")
    p.add_argument("--dir", default=None, help="where the checkpoints are written (and removed); default "
                                               "results/checkpoint_scale.tmp")
    args = p.parse_args(argv)
    args.layers = args.layers or (4 if args.quick else 16)
    args.width = args.width or (256 if args.quick else 4096)
    args.rounds = args.rounds or (1 if args.quick else 3)
    run = Run("checkpoint_scale", args, "one spawned gloo job of 4 stage processes; the 3 saves once per round, "
                                        "rotating order; blocked/durable: the slowest rank")
    args.dir = args.dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "checkpoint_scale.tmp")
    os.makedirs(args.dir, exist_ok=True)
    work = mlp_workload(args.layers, args.width)
    settings = {**vars(args), "model_text": work.model_text}
    params = args.layers * (args.width * args.width + args.width) * 4
    try:
        res = pipeddp.spawn(job, STAGES, args=(settings,), timeout=args.timeout, threads=1)[0]
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    analysed = analyse(res["ranks"])
    report(analysed, run, settings)
    run.finish({"stages": STAGES, "mode": "stage", "optimizer": "Adam", "parameter_bytes": params, "dir": args.dir},
               targets=analysed["targets"], configs=analysed["configs"], ranks=res["ranks"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
