"""The classic table: time per training iteration, split into forward and backward, per kind of parallelism.

    python benchmarks/iteration_table.py                    # resnet50 3x64x64, batch 128 (~7 min)
    python benchmarks/iteration_table.py --quick            # smoke run: 3x32x32, 1 round
    python benchmarks/iteration_table.py --side 32 --rounds 8 --chunks 4

Rows (one forward+backward step on a global batch of 128, gradients zeroed, no optimizer step):

* ``one device``: the plain model, 1 process x 1 thread;
* ``DDP N=2``: ``DistributedDataParallel``, 2 processes x 1 thread (gloo), half the batch each;
* ``naive MP``: a 2-stage pipeddp ``Pipeline`` with ``chunks=1`` (stage threads, 1 thread each);
* ``pipeline``: the same with ``chunks=m`` (default 8: micro-batches of 16);
* ``hybrid 2x2``: ``HybridParallel(mode="replica")``: 2 processes (replicas, 64 samples each), each driving
  2 stage threads, DDP per stage over gloo; ``chunks=m/2`` so its micro-batches are as large as the
  pipeline's. 4 compute threads on 2 cores: oversubscribed on this machine, and reported as measured.

Pipelines (and the hybrid) run the GPipe schedule for the table, so forward and backward are separable
by timestamps (trace spans): forward = first F span start to last F span end (over all stages; on the
hybrid, the slower replica), backward = from there to the end of the step (it includes the hand-over
to the first backward, the backward itself and, for DDP and the hybrid, the gradient all-reduce and
the wait for the slower rank), other = before the first F starts (zero_grad, splitting, the hybrid's
batch-size check). For the plain model and DDP, forward (model + loss) and backward are timed
directly. fwd + bwd + other = step, the wall time from a common barrier to the barrier after the step.
With ``--schedules gpipe 1f1b`` (the default) the 1F1B pipeline and hybrid are timed too: under 1F1B
forwards and backwards interleave, so only the step time and the busy time inside the F and B spans
(summed per stage) are reported for them.

Cuts: the 2-stage cut is pipeddp's (``partition(method="time")``) measured on rank 0 at the micro-batch
size each configuration really runs: the whole batch for naive MP, 16 samples for the pipeline and the
hybrid (the same cut, passed to both as a balance list).

Timing: one spawned 2-process gloo job runs everything (like ``benchmarks/hybrid_cpu.py``). Each round
visits every configuration once, in an order rotated by one per round; around each step both ranks
meet in a barrier and rank 0 reads the clock. Single-process rows run on rank 0 while rank 1 waits in
the barrier. Ratios are medians of per-round ratios (the host's speed drifts).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn

import pipeddp
from pipeddp.runtime.microbatch import split_sizes
from pipeddp.tools.models import mlp, resnet
from pipeddp.partitioning.report import Partition, partition
from pipeddp.pipeline import Pipeline

try:  # run as a script (benchmarks/ is sys.path[0]) or as python -m benchmarks.iteration_table
    from benchmarks.common import median_ratio, print_table, write_json
except ImportError:  # pragma: no cover - depends on how the script is started
    from common import median_ratio, print_table, write_json

STAGES = 2
PROCS = 2
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------------
# cuts
# ---------------------------------------------------------------------------------------------------


def time_partition(model: nn.Sequential, sample: torch.Tensor) -> Partition:
    """pipeddp's ``partition(method="time")`` profiled on ``sample`` (one micro-batch)."""
    return partition(model, STAGES, method="time", sample=sample, chunks=1)


# ---------------------------------------------------------------------------------------------------
# configurations (built inside the spawned processes)
# ---------------------------------------------------------------------------------------------------


@dataclass
class Config:
    """One row. ``procs`` 1: rank 0 alone; 2: both ranks. ``run(t0)`` does one step on this rank and returns
    its measurements (seconds relative to ``t0``); None where the rank sits out."""

    name: str
    procs: int
    run: Optional[Callable[[float], Dict[str, Any]]]
    close: Callable[[], None] = lambda: None
    info: Dict[str, Any] = field(default_factory=dict)


def _phases(spans: List[Any], t0: float, stages: int) -> Dict[str, Any]:
    """Forward / backward phases and per-stage busy time from one step's compute spans."""
    comp = [s for s in spans if s.lane == "compute" and s.kind in ("F", "B")]
    fs = [s for s in comp if s.kind == "F"]
    comm = [s for s in spans if s.kind == "allreduce"]
    return {
        "lead": min(s.start for s in fs) - t0,
        "fwd": max(s.end for s in fs) - min(s.start for s in fs),
        "last_f_end": max(s.end for s in fs) - t0,
        "last_b_end": max(s.end for s in comp if s.kind == "B") - t0,
        "F": [sum(s.duration for s in fs if s.stage == st) for st in range(stages)],
        "B": [sum(s.duration for s in comp if s.kind == "B" and s.stage == st) for st in range(stages)],
        "allreduce": sum(s.duration for s in comm),
    }


def _direct_step(mod: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 loss_fn: LossFn) -> Callable[[float], Dict[str, Any]]:
    """A step of a module whose forward (model + loss) and backward are timed directly (plain model, DDP)."""

    def run(t0: float) -> Dict[str, Any]:
        mod.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss = loss_fn(mod(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        return {"lead": t1 - t0, "fwd": t2 - t1, "F": [t2 - t1], "B": [t3 - t2], "loss": loss.item()}

    return run


def plain_config(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> Config:
    run = _direct_step(copy.deepcopy(model), x, y, loss_fn)
    return Config("one device", 1, run, info={"procs_x_threads": "1 x 1", "batch_per_process": x.shape[0]})


def ddp_config(rank: int, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> Config:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(copy.deepcopy(model))
    half = x.shape[0] // PROCS
    xl, yl = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
    run = _direct_step(ddp, xl, yl, loss_fn)
    return Config("DDP N=2", 2, run, lambda: None,
                  {"procs_x_threads": f"{PROCS} x 1", "batch_per_process": half, "backend": "gloo"})


def pipeline_config(name: str, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
                    chunks: int, balance: List[int], schedule: str) -> Config:
    pipe = Pipeline(copy.deepcopy(model), ["cpu"] * STAGES, chunks=chunks, balance=balance, schedule=schedule,
                    threads=1, trace=True)
    assert pipe.trace is not None

    def run(t0: float) -> Dict[str, Any]:
        pipe.trace.clear()
        pipe.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, loss_fn)
        return {**_phases(pipe.trace.spans, t0, STAGES), "loss": loss.item()}

    return Config(name, 1, run, pipe.close,
                  {"procs_x_threads": f"1 x {STAGES} stage thr", "batch_per_process": x.shape[0],
                   "microbatches": split_sizes(x.shape[0], chunks=chunks), "balance": list(pipe.balance),
                   "schedule": schedule})


def hybrid_config(name: str, rank: int, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
                  chunks: int, balance: List[int], schedule: str) -> Config:
    engine = pipeddp.HybridParallel(copy.deepcopy(model), stages=STAGES, chunks=chunks, balance=balance,
                                    schedule=schedule, mode="replica", devices=["cpu"] * STAGES, backend="gloo",
                                    threads=1, trace=True)
    assert engine.trace is not None
    local = x.shape[0] // PROCS
    xl, yl = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]

    def run(t0: float) -> Dict[str, Any]:
        engine.trace.clear()
        engine.zero_grad(set_to_none=True)
        loss = engine.train_step(xl, yl, loss_fn)
        return {**_phases(engine.trace.spans, t0, STAGES), "loss": float(loss)}

    return Config(name, 2, run, engine.close,
                  {"procs_x_threads": f"{PROCS} x {STAGES} stage thr ({PROCS * STAGES} on {os.cpu_count()} cores)",
                   "batch_per_process": local, "microbatches": split_sizes(local, chunks=chunks),
                   "balance": list(engine.balance), "schedule": schedule, "mode": "replica"})


# ---------------------------------------------------------------------------------------------------
# the spawned job
# ---------------------------------------------------------------------------------------------------


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def build_model(settings: Dict[str, Any]) -> Tuple[nn.Sequential, torch.Tensor, torch.Tensor, LossFn, str]:
    n, side = settings["batch"], settings["side"]
    if settings["model"] == "mlp":
        return (mlp(16, 1024), torch.randn(n, 1024), torch.randn(n, 1024), nn.functional.mse_loss,
                f"MLP 16 x (Linear(1024,1024)+ReLU), batch {n}, MSE vs random targets")
    return (resnet(settings["model"]), torch.randn(n, 3, side, side), torch.randint(0, 1000, (n,)),
            nn.functional.cross_entropy,
            f"{settings['model']} (flattened), 3x{side}x{side}, batch {n}, cross-entropy vs random labels (1000 classes)")


def job(settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=settings["timeout"]))
    torch.set_num_threads(1)
    torch.manual_seed(settings["seed"])
    model, x, y, loss_fn, describe = build_model(settings)
    model.train()
    m = settings["chunks"]
    n = x.shape[0]
    mb = split_sizes(n, chunks=m)[0]
    hybrid_chunks = max(1, len(split_sizes(n // PROCS, split_size=mb)))

    # The cuts, measured on rank 0 at each configuration's micro-batch size and sent to rank 1.
    plan: List[Any] = [None]
    if rank == 0:
        t0 = time.perf_counter()
        naive = time_partition(model, x)
        piped = time_partition(model, x[:mb])
        plan = [{"naive": list(naive.balance), "naive_stage_ms": [c * 1e3 for c in naive.stage_costs],
                 "pipeline": list(piped.balance), "pipeline_stage_ms": [c * 1e3 for c in piped.stage_costs],
                 "profiled_at": {"naive": n, "pipeline": mb},
                 "profile_s": time.perf_counter() - t0}]
    dist.broadcast_object_list(plan, src=0)
    cuts = plan[0]
    _log(rank, f"  cuts: naive MP {cuts['naive']} at micro-batch {n} (profiled stage ms "
               f"{[round(v) for v in cuts['naive_stage_ms']]}), pipeline/hybrid {cuts['pipeline']} at micro-batch "
               f"{mb} (profiled {[round(v) for v in cuts['pipeline_stage_ms']]}), {cuts['profile_s']:.0f} s")

    configs: List[Config] = []
    if rank == 0:
        configs.append(plain_config(model, x, y, loss_fn))
    else:
        configs.append(Config("one device", 1, None))
    configs.append(ddp_config(rank, model, x, y, loss_fn))
    for sched in settings["schedules"]:
        tag = "" if sched == "gpipe" else f" ({sched})"
        if rank == 0:
            if sched == "gpipe":
                configs.append(pipeline_config("naive MP", model, x, y, loss_fn, 1, cuts["naive"], sched))
            configs.append(pipeline_config(f"pipeline{tag}", model, x, y, loss_fn, m, cuts["pipeline"], sched))
        else:
            if sched == "gpipe":
                configs.append(Config("naive MP", 1, None))
            configs.append(Config(f"pipeline{tag}", 1, None))
        configs.append(hybrid_config(f"hybrid 2x2{tag}", rank, model, x, y, loss_fn, hybrid_chunks,
                                     cuts["pipeline"], sched))

    def timed(cfg: Config) -> Tuple[float, Optional[Dict[str, Any]]]:
        dist.barrier()
        t0 = time.perf_counter()
        rec = cfg.run(t0) if cfg.run is not None else None
        if rec is not None:
            rec["end"] = time.perf_counter() - t0
        dist.barrier()
        return time.perf_counter() - t0, rec

    # Every configuration once, untimed (warm-up: allocator growth, DDP's first-iteration set-up).
    first_loss: Dict[str, Any] = {}
    t_warm = time.perf_counter()
    for cfg in configs:
        _, rec = timed(cfg)
        if rec is not None:
            first_loss[cfg.name] = rec.get("loss")
    _log(rank, f"  warm-up step of {len(configs)} configurations: {time.perf_counter() - t_warm:.0f} s")

    walls: Dict[str, List[float]] = {c.name: [] for c in configs}
    recs: Dict[str, List[Optional[Dict[str, Any]]]] = {c.name: [] for c in configs}
    total = settings["warmup"] + settings["rounds"]
    t_start = time.perf_counter()
    for r in range(total):
        k = r % len(configs)
        for cfg in configs[k:] + configs[:k]:
            wall, rec = timed(cfg)
            if r >= settings["warmup"]:
                walls[cfg.name].append(wall)
                recs[cfg.name].append(rec)
        _log(rank, f"    round {r + 1}/{total} done ({time.perf_counter() - t_start:.0f} s)")
    for cfg in configs:
        cfg.close()
    everyone: List[Any] = [None] * PROCS
    dist.all_gather_object(everyone, {"recs": recs, "first_loss": first_loss})
    dist.barrier()
    if rank != 0:
        return None
    return {"describe": describe, "input_shape": list(x.shape), "cuts": cuts, "chunks": m, "microbatch": mb,
            "hybrid_chunks": hybrid_chunks, "walls": walls, "ranks": everyone,
            "configs": [{"name": c.name, "procs": c.procs, **c.info} for c in configs]}


# ---------------------------------------------------------------------------------------------------
# analysis and report
# ---------------------------------------------------------------------------------------------------


def analyse(res: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per configuration: median fwd / bwd / other / step (ms) and per-stage busy times, from every round."""
    walls = res["walls"]
    base = walls["one device"]
    rows = []
    for cfg in res["configs"]:
        name = cfg["name"]
        per_round = []
        for i, wall in enumerate(walls[name]):
            recs = [rk["recs"][name][i] for rk in res["ranks"] if rk["recs"][name][i] is not None]
            lead = max(r["lead"] for r in recs)
            fwd = max(r["fwd"] for r in recs)
            per_round.append({
                "wall": wall, "lead": lead, "fwd": fwd, "bwd": wall - lead - fwd,
                # busy time per stage, averaged over the ranks that ran it (replicas / DDP ranks)
                "F": [statistics.mean(r["F"][s] for r in recs) for s in range(len(recs[0]["F"]))],
                "B": [statistics.mean(r["B"][s] for r in recs) for s in range(len(recs[0]["B"]))],
                "allreduce": statistics.mean(r.get("allreduce", 0.0) for r in recs),
            })
        separable = cfg.get("schedule", "gpipe") == "gpipe"

        def med(key: str, idx: Optional[int] = None) -> float:
            vals = [pr[key] if idx is None else pr[key][idx] for pr in per_round]
            return statistics.median(vals) * 1e3

        n_st = len(per_round[0]["F"])
        rows.append({
            **cfg,
            "separable": separable,
            "step_ms": med("wall"),
            "fwd_ms": med("fwd") if separable else None,
            "bwd_ms": med("bwd") if separable else None,
            "other_ms": med("lead") if separable else None,
            "F_busy_ms": [med("F", s) for s in range(n_st)],
            "B_busy_ms": [med("B", s) for s in range(n_st)],
            "allreduce_span_ms": med("allreduce"),
            "speedup_vs_one_device": median_ratio(base, walls[name]),
            "speedup_per_round": [b / w for b, w in zip(base, walls[name])],
            "rounds": len(walls[name]),
        })
    return rows


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.0f}"


def report(res: Dict[str, Any], rows: List[Dict[str, Any]], rounds: int, console: Console) -> None:
    table = []
    for r in rows:
        mbs = r.get("microbatches")
        mb_text = f"{len(mbs)} x {mbs[0]}" if mbs and len(set(mbs)) == 1 else (str(mbs) if mbs else
                                                                              f"1 x {r['batch_per_process']}")
        per_proc = f"{r['batch_per_process']}/proc" if r["procs"] > 1 else str(r["batch_per_process"])
        table.append([
            r["name"], r["procs_x_threads"], per_proc, mb_text, str(r.get("balance", "-")),
            _ms(r["fwd_ms"]), _ms(r["bwd_ms"]), _ms(r["other_ms"]), _ms(r["step_ms"]),
            f"{r['speedup_vs_one_device']:.2f}x",
            f"{min(r['speedup_per_round']):.2f}-{max(r['speedup_per_round']):.2f}",
            " / ".join(f"{v:.0f}" for v in r["F_busy_ms"]), " / ".join(f"{v:.0f}" for v in r["B_busy_ms"]),
        ])
    print_table(
        f"ms per iteration (forward + backward), median of {rounds} interleaved rounds",
        ["config", "processes x threads", "batch", "micro-batches", "balance", "fwd ms", "bwd ms", "other ms",
         "step ms", "vs one device", "range", "F busy ms (per stage)", "B busy ms (per stage)"],
        table, console=console,
        caption=f"{res['describe']}; global batch {res['input_shape'][0]}, gloo, 1 intra-op thread per process / stage "
                "thread. fwd/bwd: plain and DDP timed directly (forward incl. loss | backward incl. DDP all-reduce); "
                "pipelines (GPipe) from trace spans: fwd = first F start to last F end, bwd = the rest of the step "
                "(incl. all-reduce and waiting for the slower rank), other = before the first F (zero_grad, split, "
                "batch check). 1F1B rows interleave F and B: only step time and busy time. Busy = time inside F / B "
                "(per stage; mean over ranks). vs one device = median per-round speedup (range: lowest-highest "
                "round). Hybrid 2x2 runs 4 compute threads on 2 cores (oversubscribed).",
    )
    walls = res["walls"]
    print_table("per-round step time (s), rounds in time order (the host drifts; ratios are taken within a round)",
                ["config"] + [f"r{i + 1}" for i in range(rounds)],
                [[r["name"]] + [f"{v:.2f}" for v in walls[r["name"]]] for r in rows], console=console)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", choices=["resnet50", "resnet18", "mlp"])
    p.add_argument("--side", type=int, default=None, help="image side (default 64; 32 with --quick)")
    p.add_argument("--batch", type=int, default=128, help="global batch (default 128; must be even)")
    p.add_argument("--chunks", type=int, default=8, help="pipeline micro-batches m (default 8: 16 samples each); "
                                                         "the hybrid uses micro-batches of the same size")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"],
                   help="gpipe gives the table's fwd/bwd split; 1f1b adds step-time-only rows (default both)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 8; 1 with --quick)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed rounds before them (default 1; 0 with --quick); one warm-up step of every "
                        "configuration always runs first")
    p.add_argument("--quick", action="store_true", help="smoke run: 3x32x32, 1 round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole spawned job")
    p.add_argument("--out", default=None, help="JSON path (default results/iteration_table[_quick].json)")
    args = p.parse_args(argv)
    if args.batch < 2 or args.batch % PROCS:
        p.error("--batch must be even")
    if args.chunks < 1:
        p.error("--chunks must be >= 1")
    schedules = ["gpipe"] + [s for s in dict.fromkeys(args.schedules) if s != "gpipe"]
    side = args.side or (32 if args.quick else 64)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 8)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    if rounds < 1 or warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    out_path = args.out or f"results/iteration_table{'_quick' if args.quick else ''}.json"
    settings = {"model": args.model, "side": side, "batch": args.batch, "chunks": args.chunks, "schedules": schedules,
                "rounds": rounds, "warmup": warmup, "seed": args.seed, "timeout": args.timeout}
    console = Console(width=max(220, Console().width))
    console.print(f"iteration table: {args.model}, 3x{side}x{side}, global batch {args.batch}, m={args.chunks}, "
                  f"schedules {schedules}, {rounds} rounds (+{warmup} warm-up); one spawned job of {PROCS} "
                  "processes x 1 thread (gloo)")
    started = time.perf_counter()
    res = pipeddp.spawn(job, PROCS, args=(settings,), timeout=args.timeout, threads=1)[0]
    rows = analyse(res)
    report(res, rows, rounds, console)
    elapsed = time.perf_counter() - started
    out = write_json(out_path, {
        "benchmark": "iteration_table",
        "settings": {**settings, "processes": PROCS, "stages": STAGES, "threads": 1, "hybrid_mode": "replica",
                     "hybrid": f"{PROCS} replicas x {STAGES} stages, mode='replica': {PROCS} processes each driving "
                               f"{STAGES} stage threads (1 intra-op thread each) = {PROCS * STAGES} compute threads on "
                               f"{os.cpu_count()} cores",
                     "attribution": "plain/DDP: forward (model+loss) and backward timed directly; GPipe pipelines: "
                                    "fwd = first F span start .. last F span end, bwd = rest of the step, other = "
                                    "before the first F; 1F1B: step and busy only",
                     "timing": "one spawned 2-process gloo job; barrier-to-barrier wall on rank 0; every configuration "
                               "once per round in rotating order; ratios are medians of per-round ratios",
                     "quick": args.quick},
        "elapsed_s": elapsed,
        "rows": rows,
        "cuts": res["cuts"],
        "raw": res,
    })
    console.print(f"wrote {out} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
