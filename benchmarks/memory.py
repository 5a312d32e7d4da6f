"""What shard= saves per rank, and what it costs in step time: DDP against FSDP2 over each stage's replicas.

A model of 16 x Linear(2048, 2048) with AdamW, cut into 2 stages, R = 1, 2 and 4 replicas, replica and stage mode,
each ``shard=`` setting (with one replica there is nothing to shard: only ``"none"`` runs). Every configuration is
its own spawned gloo job (fresh processes, so the peak RSS is its own); the configurations of one (mode, R) run
round by round in rotating order, and each step time is set beside ``shard="none"`` of the same rounds.

Per rank (the largest over the ranks), in MB of tensor storage:

* at rest (after ``optimizer.step()``): the parameters, their gradients and the optimizer state this rank holds
  (a shard's local storage for DTensors);
* at the step's peak: the parameters (shards plus the whole parameters FSDP has gathered) and gradients (the
  sharded ``.grad`` plus the whole gradients accumulating over the micro-batches), sampled whenever FSDP finishes
  a gather, before each stage's reduction and at every layer's forward;
* the process's RSS sampled at the same moments, and its peak RSS (``ru_maxrss``, model construction included);
  CUDA's max allocated where the stages run on a GPU.

Targets (docs/sharding.md): optimizer state <= 1.05/R of unsharded; with "optimizer" parameters and gradients at
rest <= 1.05/R; with "full" the peak parameter memory <= 1/R of the stage plus its largest layer; "optimizer"
step time >= 0.95x DDP's at R = 2.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from typing import Any, Dict, Iterable, List, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks.common import Run, barrier_timed, gather, init_job, parser

MB = 1 << 20
SHARDS = ("none", "optimizer", "full")
#: the per-rank figures of a row (the largest rank's): row key -> (the job's key, its field)
COLUMNS = {"params_rest": ("rest", "params"), "grads_rest": ("rest", "grads"), "state_rest": ("rest", "state"),
           "params_peak": ("peak", "params"), "grads_peak": ("peak", "grads"), "rss_peak_sampled": ("peak", "rss"),
           "maxrss": ("maxrss", ""), "stage_bytes": ("stage_bytes", ""), "full_peak_bound": ("full_bound", "")}


def build(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


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


def _fsdp_params(engine: pipeddp.HybridParallel) -> List[Any]:
    """The FSDP2 parameters of this process's stages (the benchmark reads FSDP's own records to see gathers)."""
    from torch.distributed.fsdp import fully_shard

    out = []
    for st in engine.stages:
        state = fully_shard.state(st.module)  # type: ignore[attr-defined]
        for s in state._state_ctx.all_states if state is not None else ():
            for group in s._fsdp_param_groups:
                out.extend(group.fsdp_params)
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Probe:
    """Samples the parameters', gradients' and RSS bytes at the moments memory peaks in a step."""

    def __init__(self, engine: pipeddp.HybridParallel) -> None:
        self.engine = engine
        self.sharded = engine.shard != "none"
        self.fsdp = _fsdp_params(engine) if self.sharded else []
        self.peak = {"params": 0, "grads": 0, "rss": 0}

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
        params, grads = self.params_grads()
        for key, value in (("params", params), ("grads", grads), ("rss", _rss())):
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
    engine = pipeddp.HybridParallel(build(args.width, args.layers), stages=2, mode=mode, chunks=args.chunks,
                                    balance="uniform", schedule="1f1b", shard=shard)
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


def main() -> None:
    p = parser(__doc__, "Linear(256) x 4, 1 timed step, 1 round, R = 1 and 2", spawns=True)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="samples per replica per step")
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=2, help="timed steps per configuration and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["replica", "stage"], choices=["replica", "stage"])
    args = p.parse_args()
    if args.quick:
        args.width, args.layers, args.steps, args.rounds, args.replicas = 256, 4, 1, 1, [1, 2]
    run = Run("memory", args)
    rows = []
    for mode in args.modes:
        for replicas in args.replicas:
            rows.extend(run_config(mode, replicas, args))
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
                           f"<= {r['full_peak_bound'] / MB:.0f}", r["params_peak"] <= r["full_peak_bound"] * 1.0001])
    run.finish(rows=rows, targets=run.targets(checks))


if __name__ == "__main__":
    main()
