"""Memory of a HybridParallel job on CPU: what shard= saves per rank and costs in step time, and (``--soak``)
whether a long run leaks memory, threads or file descriptors. See benchmarks/README.md.

shard=: every configuration is its own spawned gloo job (fresh processes, so the peak RSS is its own); the
configurations of one (mode, R) run round by round in rotating order, and each step time is set beside
``shard="none"`` of the same rounds. The step's peak is sampled whenever FSDP finishes a gather, before each
stage's reduction and at every layer's forward. --soak: replica mode's stage threads, local channels and
per-stage DDP groups are the long-lived machinery most likely to leak; samples are taken after gc.collect().
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks.common import Run, barrier_timed, gather, init_job, parser, proc_status
from benchmarks.workloads import mlp_workload

MB = 1 << 20
SHARDS = ("none", "optimizer", "full")
#: the per-rank figures of a row (the largest rank's): row key -> (the job's key, its field)
COLUMNS = {"params_rest": ("rest", "params"), "grads_rest": ("rest", "grads"), "state_rest": ("rest", "state"),
           "params_peak": ("peak", "params"), "grads_peak": ("peak", "grads"), "rss_peak_sampled": ("peak", "rss"),
           "maxrss": ("maxrss", ""), "stage_bytes": ("stage_bytes", ""), "full_peak_bound": ("full_bound", "")}


def _bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard; views of one buffer count once)."""
    seen: Dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if type(t).__name__ == "DTensor":
            t = t.to_local()  # type: ignore[attr-defined]
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class Probe:
    """Samples the parameters', gradients' and RSS bytes at the moments memory peaks in a step; under shard= it
    reads FSDP2's own records of this process's stages (``fsdp``: their parameters) to see the gathers."""

    def __init__(self, engine: pipeddp.HybridParallel) -> None:
        from torch.distributed.fsdp import fully_shard

        self.engine, self.sharded, self.fsdp = engine, engine.shard != "none", []
        self.peak = {"params": 0, "grads": 0, "rss": 0}
        for st in engine.stages if self.sharded else ():
            state = fully_shard.state(st.module)  # type: ignore[attr-defined]
            for s in state._state_ctx.all_states if state is not None else ():
                for group in s._fsdp_param_groups:
                    self.fsdp.extend(group.fsdp_params)

    def params_grads(self) -> tuple:
        if not self.sharded:
            ps = list(self.engine.parameters())
            return _bytes(ps), _bytes(p.grad for p in ps)
        params: List[Optional[torch.Tensor]] = []
        grads: List[Optional[torch.Tensor]] = []
        for fp in self.fsdp:
            params.append(fp.sharded_param)
            grads.append(fp.sharded_param.grad)
            whole = getattr(fp, "_unsharded_param", None)
            if whole is not None:  # its storage has 0 bytes while freed
                params.append(whole)
                grads += [whole.grad, getattr(fp, "unsharded_accumulated_grad", None)]
        return _bytes(params), _bytes(grads)

    def sample(self, *_: Any) -> None:
        with open("/proc/self/statm") as f:  # cheaper than /proc/self/status at every layer's forward
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        for key, value in zip(("params", "grads", "rss"), (*self.params_grads(), rss)):
            self.peak[key] = max(self.peak[key], value)

    def install(self) -> List[Any]:
        """Sample at every layer's forward, before each stage's reduction, and after every FSDP gather."""
        handles = [layer.register_forward_hook(self.sample) for st in self.engine.stages for layer in st.module]
        for st in self.engine.stages:
            reduce = st.after_sync
            if reduce is not None:
                def before(reduce: Any = reduce) -> None:
                    self.sample()
                    reduce()
                    self.sample()
                st.after_sync = before
        if self.sharded:
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

            wait = FSDPParamGroup.wait_for_unshard

            def waited(group: Any) -> None:
                wait(group)
                self.sample()

            FSDPParamGroup.wait_for_unshard = waited  # type: ignore[method-assign, assignment]
            handles.append(lambda: setattr(FSDPParamGroup, "wait_for_unshard", wait))  # type: ignore[arg-type]
        return handles


def job(mode: str, shard: str, args: Any) -> Dict[str, Any]:
    """Build one engine, warm it up with one step, then time ``args.steps`` steps with the probe on."""
    rank = init_job(args.timeout)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    engine = pipeddp.HybridParallel(model, stages=2, mode=mode, chunks=args.chunks, balance="uniform", schedule="1f1b",
                                    shard=shard)
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randn(args.batch, args.width, generator=g)
    loss = nn.functional.mse_loss

    def step() -> None:
        opt.zero_grad()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, loss)
        opt.step()

    for _ in range(2):  # warm-up: the optimizer state is created, DDP and FSDP set up their buffers
        step()
    params = list(engine.parameters())
    rest = {"params": _bytes(params), "grads": _bytes(p.grad for p in params),
            "state": _bytes(t for s in opt.state.values() for t in s.values()
                            if isinstance(t, torch.Tensor) and t.dim() > 0)}
    stage_bytes = sum(p.numel() * p.element_size() for p in params)  # whole (unsharded) parameters of the stages

    def whole(module: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    # "full" holds 1/R of each stage plus the layer being gathered (one per stage: replica mode runs them at once)
    bound = sum(whole(st.module) / engine.topology.replicas + max(whole(layer) for layer in st.module)
                for st in engine.stages)
    probe = Probe(engine)
    handles = probe.install()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for _ in range(args.steps):
            t, _ = barrier_timed(step)
            times.append(t.wall)
    finally:
        for h in handles:
            h() if callable(h) else h.remove()
    out = {"rank": rank, "rest": rest, "peak": dict(probe.peak), "stage_bytes": stage_bytes, "full_bound": bound,
           "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "times": times,
           "cuda_max_allocated": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None}
    engine.close()
    got = gather(out)
    return {"ranks": got} if got is not None else {}


def run_config(mode: str, replicas: int, args: Any) -> List[Dict[str, Any]]:
    """Every ``shard=`` setting of (mode, R), each its own job, once per round in rotating order; per setting the
    largest rank's figures and the step time against ``shard="none"`` of the same rounds."""
    nprocs = replicas * (2 if mode == "stage" else 1)
    shards = list(SHARDS) if replicas > 1 else ["none"]
    per: Dict[str, List[List[Dict[str, Any]]]] = {s: [] for s in shards}  # per shard, per round: every rank's
    for r in range(args.rounds):
        k = r % len(shards)
        for shard in shards[k:] + shards[:k]:
            start = time.perf_counter()
            per[shard].append(pipeddp.spawn(job, nprocs, args=(mode, shard, args), timeout=args.timeout)[0]["ranks"])
            print(f"  {mode} R={replicas} shard={shard} round {r + 1}: {time.perf_counter() - start:.0f} s", flush=True)
    # steps are barrier-timed: every rank reads the same wall time, so rank 0's stand for the job
    per_round = {s: [statistics.median(ranks[0]["times"]) for ranks in per[s]] for s in shards}
    rows = []
    for shard in shards:
        last = per[shard][-1]
        row = {"mode": mode, "replicas": replicas, "shard": shard, "processes": nprocs,
               "step_s": statistics.median(per_round[shard]),
               "speed_vs_none": statistics.median(b / t for b, t in zip(per_round["none"], per_round[shard])),
               "cuda_max_allocated": last[0]["cuda_max_allocated"]}
        for key, (group, field) in COLUMNS.items():
            row[key] = float(max(rank[group][field] if field else rank[group] for rank in last))
        rows.append(row)
    for row in rows:
        for key in ("params_rest", "grads_rest", "state_rest", "params_peak"):
            row[f"{key}_vs_none"] = row[key] / rows[0][key] if rows[0][key] else None
    return rows


def soak_job(settings: Dict[str, Any]) -> Dict[str, Any]:
    """One replica: a real training loop (zero_grad, train_step, optimizer step), sampled at ``marks``."""
    rank = init_job(settings["timeout"])
    torch.manual_seed(settings["seed"])
    work = mlp_workload(settings["layers"], settings["width"])
    engine = pipeddp.HybridParallel(work.build(), stages=2, chunks=settings["chunks"], mode="replica",
                                    devices=["cpu"] * 2, backend="gloo", threads=1)
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
        if step in marks:  # resident memory (kB), threads and fds after gc: only memory still held counts
            now = time.perf_counter()
            gc.collect()
            st = proc_status()
            samples.append({"step": step, "t": now - t0, "rss_kb": st["VmRSS"], "hwm_kb": st.get("VmHWM"),
                            "os_threads": st["Threads"], "py_threads": threading.active_count(),
                            "fds": len(os.listdir("/proc/self/fd")),
                            "ms_per_step": (now - t_mark) * 1e3 / (step - last_mark)})  # since the previous one
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


def soak_report(per_rank: List[Dict[str, Any]], args: argparse.Namespace, run: Run) -> None:
    """Start / end / max per rank (every sample is in the JSON), and the loss: training really happened."""
    rows = []
    for v in per_rank:
        s0, s1, mx = v["start"], v["end"], v["max"]
        rows.append([f"rank {v['rank']}", " / ".join(f"{s['rss_kb'] / 1024:.1f}" for s in (s0, s1, mx)),
                     f"{v['growth']['rss_mb']:+.2f}", f"{v['rss_slope_mb_per_1000_steps']:+.2f}"]
                    + [" / ".join(str(s[k]) for s in (s0, s1, mx)) for k in ("os_threads", "py_threads", "fds")]
                    + [f"{s0['ms_per_step']:.1f} / {s1['ms_per_step']:.1f}", "no leak" if v["no_leak"] else "GROWTH"])
    run.table(f"soak: {args.steps} steps, 2 x 2 hybrid (replica mode), "
              f"{mlp_workload(args.layers, args.width).model_text}, local batch {args.batch}, {args.chunks} "
              f"micro-batches; start (step {args.warmup}) / end / max",
              ["rank", "RSS MB", "RSS growth MB", "RSS trend MB/1k steps", "OS threads", "Python threads", "open fds",
               "ms/step start / end", "verdict"], rows,
              caption=f"{args.samples} samples per rank after gc.collect(); no leak: RSS grew < "
                      f"{args.rss_tolerance_mb:g} MB, threads and fds did not; trend: least-squares slope of RSS")
    losses = per_rank[0]["losses"]
    run.console.print(f"loss (global mean, every 50 steps): first {losses[0]:.4f}, last {losses[-1]:.4f}; replicas "
                      f"checked identical (check_replicas) at the end; verdict: "
                      f"{'no leak' if all(r['no_leak'] for r in per_rank) else 'GROWTH beyond tolerance'}")


def soak(args: argparse.Namespace, run: Run) -> Dict[str, Any]:
    """--soak: 2 processes, each a replica of 2 stage threads, train ``args.steps`` steps; samples per rank."""
    if args.warmup < 1 or args.steps <= args.warmup or args.samples < 2:
        raise SystemExit("--soak needs --warmup >= 1, --steps > --warmup and --samples >= 2")
    res = pipeddp.spawn(soak_job, 2, args=(vars(args),), timeout=args.timeout, threads=1)
    per_rank = [{**r, **verdict(r["samples"], args.rss_tolerance_mb)} for r in res]
    soak_report(per_rank, args, run)
    return {"settings": {"processes": 2, "stages": 2, "mode": "replica", "optimizer": "SGD(lr=0.01, momentum=0.9)"},
            "no_leak": all(r["no_leak"] for r in per_rank), "ranks": per_rank}


def shards(args: argparse.Namespace, run: Run) -> Dict[str, Any]:
    """Every (mode, R) and shard= setting: the per-rank table and the targets (docs/sharding.md)."""
    rows = [row for mode in args.modes for replicas in args.replicas for row in run_config(mode, replicas, args)]
    run.table("per rank, MB (the largest rank); speed: step time of shard='none' / this one, same rounds",
              ["mode", "R", "shard", "params rest", "grads rest", "Adam state", "params peak", "grads peak",
               "RSS peak", "maxrss", "speed vs none"],
              [[r["mode"], r["replicas"], r["shard"], r["params_rest"] / MB, r["grads_rest"] / MB,
                r["state_rest"] / MB, r["params_peak"] / MB, r["grads_peak"] / MB, r["rss_peak_sampled"] / MB,
                r["maxrss"] / MB, r["speed_vs_none"]] for r in rows])
    checks = []
    for r in rows:
        R, name = r["replicas"], f"{r['mode']} R={r['replicas']} shard={r['shard']}: "
        if r["shard"] != "none":
            checks.append([name + "state / unsharded", r["state_rest_vs_none"], f"<= {1.05 / R:.3f}",
                           r["state_rest_vs_none"] <= 1.05 / R])
        if r["shard"] == "optimizer":
            checks.append([name + "params, grads at rest / unsharded", r["params_rest_vs_none"], f"<= {1.05 / R:.3f}",
                           r["params_rest_vs_none"] <= 1.05 / R and r["grads_rest"] <= 1.05 / R * r["stage_bytes"]])
            if R == 2:
                checks.append([name + "speed vs DDP", r["speed_vs_none"], ">= 0.95", r["speed_vs_none"] >= 0.95])
        if r["shard"] == "full":
            checks.append([name + "params peak MB (stage/R + largest layer)", r["params_peak"] / MB,
                           f"<= {r['full_peak_bound'] / MB:.1f}", r["params_peak"] <= r["full_peak_bound"] * 1.0001])
    return {"rows": rows, "targets": run.targets(checks)}


def build_job(meta: bool, args: Any) -> Dict[str, Any]:
    """Stage mode, one stage per process: the model built whole, or on the meta device; one SGD step. The peak RSS
    over what the process held before building, against its own parameters and gradients."""
    rank, before = init_job(args.timeout), proc_status()["VmRSS"] * 1024
    with torch.device("meta" if meta else "cpu"):
        model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    engine = pipeddp.HybridParallel(model, stages=args.processes, mode="stage", chunks=2, balance="uniform")
    opt = torch.optim.SGD(engine.parameters(), lr=1e-4)
    x = y = torch.randn(args.batch, args.width)
    engine.train_step(x if engine.is_first else None, y if engine.is_last else None, nn.functional.mse_loss)
    opt.step()
    own = 2 * sum(p.numel() * p.element_size() for p in engine.parameters())  # parameters and gradients
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    engine.close()
    return {"rank": rank, "own": own, "peak_growth": peak}


def builds(args: argparse.Namespace, run: Run) -> Dict[str, Any]:
    """Whole-model building against meta building (issue: each process holds only its stages)."""
    rows, checks = [], []
    for meta in (False, True):
        per_rank = pipeddp.spawn(build_job, args.processes, args=(meta, args), timeout=args.timeout)
        for r in per_rank:
            bound = 1.25 * r["own"] + 200 * MB
            rows.append(["meta" if meta else "whole", r["rank"], r["own"] / MB, r["peak_growth"] / MB, bound / MB])
            if meta:
                checks.append([f"rank {r['rank']}: peak growth MB (meta)", r["peak_growth"] / MB,
                               f"<= {bound / MB:.0f}", r["peak_growth"] <= bound])
    run.table(f"stage mode, {args.processes} processes, {args.layers} x Linear({args.width}) float32: MB per rank",
              ["built", "rank", "params + grads", "peak RSS growth", "1.25 x own + 200"], rows)
    return {"rows": rows, "targets": run.targets(checks)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser(__doc__, "Linear(256) x 4, 1 timed step, 1 round, R = 1 and 2 (--soak: 200 steps)", spawns=True,
               device=False)  # HybridParallel picks its devices
    p.add_argument("--soak", action="store_true", help="the leak check: train --steps, sample memory, threads, fds")
    p.add_argument("--width", type=int, default=None, help="default 2048 (--quick 256; --soak 256)")
    p.add_argument("--layers", type=int, default=None, help="default 16 (--quick 4; --soak 8)")
    p.add_argument("--batch", type=int, default=None, help="samples per replica per step (default 8; --soak 64)")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration and round (default 2; "
                   "--quick 1); --soak: training steps (default 2000; --quick 200)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["replica", "stage"], choices=["replica", "stage"])
    p.add_argument("--warmup", type=int, default=50, help="--soak: steps before the first (start) sample")
    p.add_argument("--samples", type=int, default=11, help="--soak: samples from start to end, evenly spaced")
    p.add_argument("--rss-tolerance-mb", type=float, default=5.0, help="--soak: RSS growth that is no leak")
    p.add_argument("--build", action="store_true", help="building whole against on the meta device, stage mode "
                   "(default 32 x Linear(4096) on --processes 4; --quick 8 x Linear(512))")
    p.add_argument("--processes", type=int, default=4, help="--build: processes (one stage each)")
    args = p.parse_args(argv)
    if args.build:
        args.width, args.layers, args.batch = (512, 8, 4) if args.quick else (args.width or 4096, args.layers or 32, 4)
        run = Run("memory_build", args, "each build its own spawned gloo job; RSS from /proc and getrusage")
        run.finish(**builds(args, run))
        return 0
    defaults = ((256, 8, 64, 200 if args.quick else 2000) if args.soak  # width, layers, batch, steps
                else (256, 4, 8, 1) if args.quick else (2048, 16, 8, 2))
    for key, value in zip(("width", "layers", "batch", "steps"), defaults):
        setattr(args, key, getattr(args, key) or value)
    if args.quick and not args.soak:
        args.rounds, args.replicas = 1, [1, 2]
    run = Run("soak" if args.soak else "memory", args, "one spawned gloo job of 2 replicas; samples after "
              "gc.collect()" if args.soak else "each configuration its own spawned gloo job, rounds in rotating order")
    run.finish(**(soak if args.soak else shards)(args, run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
