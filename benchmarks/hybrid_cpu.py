"""pipeddp on 2 CPU cores against the plain model, accumulation, DDP and torch.distributed.pipelining.

One spawned 2-process gloo job times every configuration between barriers; steps disturbed by other processes are
left out and replaced (``--max-foreign``, ``--max-retries``). See benchmarks/README.md.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks import baselines, common
from benchmarks.common import LossFn, Run, StepTime, at_least, fmt, gather, log0, median_ms, median_ratio
from benchmarks.workloads import WORKLOADS, add_round_flags, names
from pipeddp.runtime.microbatch import split_sizes
from pipeddp.tools.simulate import bubble_bound

SCRIPT = "hybrid_cpu"
STAGES = 2
RETRIES = {"mlp": 6, "resnet50": 3}  # extra rounds a full run may spend replacing disturbed ones
PIPEDDP = ("pipeddp-replica", "pipeddp-stage")
TORCH = ("torch-gpipe@cut", "torch-1f1b@cut", "torch-gpipe@naive", "torch-1f1b@naive")


def local_steps(rank: int, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int, balance: List[int],
                loss_fn: LossFn) -> List[baselines.Step]:
    """The baselines and pipeddp's two modes (1F1B); 1-process ones run on rank 0 while rank 1 stands by."""
    if rank == 0:
        steps = [baselines.whole(model, x, y, loss_fn, name="whole-1t"),
                 baselines.whole(model, x, y, loss_fn, name="whole-2t", threads=2),
                 baselines.accumulate(model, x, y, loss_fn, m),
                 baselines.pipeline(model, x, y, loss_fn, chunks=m, balance=balance, name="pipeddp-replica")]
    else:
        steps = [baselines.idle(n) for n in ["whole-1t", "whole-2t", "accum", "pipeddp-replica"]]
    return steps + [baselines.ddp(model, x, y, loss_fn),
                    baselines.hybrid(model, x, y, loss_fn, mode="stage", chunks=m, balance=balance,
                                     name="pipeddp-stage")]


def torch_steps(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int, cuts: Dict[str, int],
                loss_fn: LossFn, group_timeout: float) -> Tuple[List[baselines.Step], Dict[str, Any]]:
    """torch pipelining at each named cut on a group of its own (``baselines.guarded_torch``: a failing one is
    recorded and left out); a cut equal to an earlier label's is timed once (``alias_of``)."""
    steps: List[baselines.Step] = []
    report: Dict[str, Any] = {}
    done: Dict[Tuple[int, str], str] = {}
    for label, cut in cuts.items():
        for sched in ("gpipe", "1f1b"):
            name = f"torch-{sched}@{label}"
            if (cut, sched) in done:
                report[name] = {"cut": cut, "alias_of": done[(cut, sched)]}
                continue
            step, err = baselines.guarded_torch(model, x, y, loss_fn, group_timeout, name=name, chunks=m,
                                                balance=[cut, len(model) - cut], schedule=sched)
            report[name] = {"cut": cut, **({"error": err} if step is None else {})}
            if step is None:
                log0(f"    {name}: failed ({err.splitlines()[0][:200]})")
                continue
            steps.append(step)
            done[(cut, sched)] = name
    return steps, report


class Judge:
    """After every timed round: which steps were disturbed (other processes, machine busy time minus both benchmark
    processes' CPU time, used more than ``max_foreign`` cores), and whether every pipeddp-vs-baseline pair has
    ``rounds`` rounds in which both ran undisturbed."""

    def __init__(self, steps: Sequence[baselines.Step], rounds: int, max_foreign: float) -> None:
        self.rounds, self.max_foreign = rounds, max_foreign
        self.names = [s.name for s in steps]
        self.pairs = [(p, b) for p in self.names if p.startswith("pipeddp")
                      for b in self.names if b in ("accum", "whole-1t") or b.startswith("torch-")]
        self.clean: Dict[str, List[bool]] = {n: [] for n in self.names}
        self.foreign: Dict[str, List[float]] = {n: [] for n in self.names}

    def undisturbed_pairs(self) -> Dict[str, int]:
        return {f"{a} / {b}": sum(1 for u, v in zip(self.clean[a], self.clean[b]) if u and v) for a, b in self.pairs}

    def __call__(self, got: Dict[str, StepTime]) -> bool:
        cpu = gather({n: t.cpu for n, t in got.items()})
        verdict: List[Any] = [False]
        if cpu is not None:
            for n, t in got.items():
                f = max(0.0, t.busy - sum(c[n] for c in cpu)) / max(t.wall, 1e-9)
                self.foreign[n].append(f)
                self.clean[n].append(f <= self.max_foreign)
            least = min(self.undisturbed_pairs().values(), default=len(self.clean[self.names[0]]))
            verdict = [least >= self.rounds]
            log0(f"      fewest undisturbed pairs {least}/{self.rounds}; disturbed: "
                 f"{[n for n in self.names if not self.clean[n][-1]] or 'none'}")
        dist.broadcast_object_list(verdict, src=0)
        return bool(verdict[0])


def profiled_cut(model: nn.Sequential, x: torch.Tensor, m: int) -> Dict[str, Any]:
    """pipeddp's cut, profiled at micro-batch size (on rank 0, then sent to rank 1: what HybridParallel does)."""
    t0 = time.perf_counter()
    part = pipeddp.partition(model, STAGES, method="time", sample=x, chunks=m)
    return {"balance": list(part.balance), "stage_ms": [c * 1e3 for c in part.stage_costs],
            "layer_ms": [c * 1e3 for c in part.layer_costs], "profile_s": time.perf_counter() - t0}


def run_m(rank: int, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int, loss_fn: LossFn,
          opts: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Build, check and time every configuration at ``m`` micro-batches; the row (rank 0)."""
    cut = common.on_rank0(lambda: profiled_cut(model, x, m))
    balance, n = cut["balance"], len(model)
    naive = [n // 2, n - n // 2]
    log0(f"  m={m}: pipeddp balance {balance} (profiled stage ms {[round(v, 1) for v in cut['stage_ms']]}), "
         f"naive {naive}")
    steps = local_steps(rank, model, x, y, m, balance, loss_fn)
    more, torch_report = torch_steps(model, x, y, m, {"cut": balance[0], "naive": naive[0]}, loss_fn,
                                     opts["group_timeout"])
    steps += more
    # BatchNorm sees micro-batches, so the whole batch and DDP's halves match accum only on the MLP
    checked = baselines.check_grads(steps, "accum", "accum",
                                    exempt=["whole-1t", "whole-2t", "ddp"] if opts["has_bn"] else [])
    judge = Judge(steps, opts["rounds"], opts["max_foreign"])
    times, _ = common.barrier_rounds({s.name: s.run for s in steps}, opts["rounds"], opts["warmup"],
                                     extra=opts["max_retries"], after_round=judge)
    walls = {k: [t.wall for t in v] for k, v in times.items()}
    for step in steps:
        step.close()
    dist.barrier()
    if rank != 0:
        return None
    return {"m": m, "microbatch_sizes": split_sizes(x.shape[0], chunks=m), "balance": balance, "naive_balance": naive,
            "profiled_stage_ms": cut["stage_ms"], "profiled_layer_ms": cut["layer_ms"], "profile_s": cut["profile_s"],
            "torch_pipelining": torch_report, "check": checked,
            "rounds_run": len(walls[steps[0].name]), "pairs_undisturbed": judge.undisturbed_pairs(),
            "undisturbed": judge.clean, "foreign_cores": judge.foreign,
            "times_s": walls, "max_foreign_cores": opts["max_foreign"]}


def job(settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The body of each of the 2 spawned processes: every model, every m."""
    rank = common.init_job(settings["timeout"], settings["device"])
    out: Dict[str, Any] = {}
    for name in settings["models"]:
        work = WORKLOADS[name]
        model, x, y = work.seeded(work.batch[SCRIPT], settings["seed"])
        common.check_same(model, x, y)
        opts = {**settings, **settings["per_model"][name],
                "has_bn": any(isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)) for mod in model.modules())}
        log0(f"{name}: {work.describe(x.shape[0])}; {opts['rounds']} rounds (+{opts['warmup']} warm-up)")
        t0 = time.perf_counter()
        rows = [run_m(rank, model, x, y, m, work.loss_fn, opts) for m in settings["ms"]]
        if rank == 0:
            out[name] = {"workload": work.describe(x.shape[0]), "input_shape": list(x.shape), "layers": len(model),
                         "rounds": opts["rounds"], "warmup": opts["warmup"], "elapsed_s": time.perf_counter() - t0,
                         "by_m": rows}
    dist.barrier()
    return out if rank == 0 else None


def _series(row: Dict[str, Any], name: str) -> Optional[Tuple[List[float], List[bool]]]:
    """The times and undisturbed flags that stand for ``name`` (following aliases: naive cut == pipeddp's cut)."""
    src = name if name in row["times_s"] else (row["torch_pipelining"].get(name) or {}).get("alias_of")
    return (row["times_s"][src], row["undisturbed"][src]) if src in row["times_s"] else None


def _pair_ratio(row: Dict[str, Any], base: str, other: str) -> Tuple[Optional[float], int]:
    """Median of base/other over the rounds where both steps were undisturbed (all rounds if there is none)."""
    b, o = _series(row, base), _series(row, other)
    if b is None or o is None:
        return None, 0
    both = [i for i, (u, v) in enumerate(zip(b[1], o[1])) if u and v]
    use = both or range(len(b[0]))
    return median_ratio([b[0][i] for i in use], [o[0][i] for i in use]), len(both)


def analyse(row: Dict[str, Any]) -> Dict[str, Any]:
    """Medians (undisturbed steps) and per-round speedups of every pipeddp configuration over each baseline."""
    bound = bubble_bound(STAGES, len(row["microbatch_sizes"]))
    speed: Dict[str, Dict[str, Any]] = {}
    for p in [n for n in row["times_s"] if n.startswith("pipeddp")]:
        entry: Dict[str, Any] = {"rounds": {}, "bound": bound}
        for base in ("accum", "whole-1t", "whole-2t", "ddp") + TORCH:
            entry[base], entry["rounds"][base] = _pair_ratio(row, base, p)
        entry["efficiency"] = entry["accum"] / bound if entry["accum"] is not None else None
        speed[p] = entry
    medians = {}
    for name in list(row["times_s"]) + [t for t in TORCH if t not in row["times_s"]]:
        got = _series(row, name)
        medians[name] = None if got is None else median_ms([v for v, ok in zip(*got) if ok] or got[0])
    return {"median_ms": medians, "bound": bound, "speedup": speed,
            "accum_over_whole": _pair_ratio(row, "accum", "whole-1t")[0]}


def targets(model: str, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The targets, per pipeddp mode: met / not met, with the numbers they were judged on."""
    out: List[Dict[str, Any]] = []
    for p in PIPEDDP:
        if not all(p in r["analysis"]["speedup"] for r in rows):
            continue
        sp = {r["m"]: r["analysis"]["speedup"][p] for r in rows}
        same = {m: {t: s[t] for t in TORCH[:2]} for m, s in sp.items()}
        checks = [(">= 95% of the bubble bound vs accumulation at every m", {m: s["efficiency"] for m, s in sp.items()},
                   0.95), ("never slower than torch pipelining with the same cut", same, 1.0)]
        if 16 in sp:
            checks.append((">= 1.1x faster than torch pipelining (same cut) at m=16", same[16], 1.1))
        naive = {m: {t: s[t] for t in TORCH[2:]} for m, s in sp.items() if m in (8, 16)}
        if model == "resnet50" and naive:
            checks.append((">= 1.2x faster than torch pipelining with the naive cut at m=8 and m=16", naive, 1.2))
        for t, v, floor in checks:
            flat = [x for d in v.values() for x in (d.values() if isinstance(d, dict) else [d])]
            out.append({"model": model, "mode": p, "target": t, "values": v, "goal": floor,
                        "met": all(x is not None and x >= floor for x in flat)})
    return out


def _short(name: str) -> str:
    """A column name: "pdp replica", "tGPipe @cut", "whole 1t"."""
    for long, short in (("pipeddp-", "pdp "), ("torch-gpipe", "tGPipe "), ("torch-1f1b", "t1F1B "), ("-", " ")):
        name = name.replace(long, short)
    return name


def tables(name: str, res: Dict[str, Any], run: Run) -> None:
    """Step times, pipeddp's speedups, where the pipelines' time goes; failed torch cuts and disturbed steps."""
    rows = res["by_m"]
    cols = ["whole-1t", "whole-2t", "accum", "ddp", *PIPEDDP, *TORCH]
    run.table(f"{name}: ms per training step (median over undisturbed steps of the interleaved rounds)",
              ["m", "pipeddp cut", "naive cut", "rounds"] + [_short(c) for c in cols],
              [[r["m"], str(r["balance"]), str(r["naive_balance"]),
                f"{min(r['pairs_undisturbed'].values(), default=0)}/{r['rounds_run']}"]
               + [fmt(v, ".0f" if v is not None and v >= 100 else ".1f") for v in
                  (r["analysis"]["median_ms"].get(c) for c in cols)] for r in rows],
              caption=f"{res['workload']}; rounds: fewest undisturbed rounds of a pipeddp-vs-baseline pair / run")
    out = []
    for r in rows:
        a = r["analysis"]
        for i, p in enumerate(sorted(a["speedup"], key=lambda s: (s.replace("replica", "a"), s))):
            s = a["speedup"][p]
            x = {k: fmt(v, ".2f", "x") for k, v in s.items() if not isinstance(v, dict)}
            out.append([r["m"] if i == 0 else "", _short(p), x["accum"], x["bound"], f"{s['efficiency']:.0%}",
                        x["whole-1t"], x["whole-2t"], x["ddp"]] + [x[t] for t in TORCH])
    run.table(f"{name}: pipeddp speedups (median of per-round ratios; > 1 = pipeddp faster)",
              ["m", "pipeddp", "vs accum", "bound", "efficiency", "vs whole 1t", "vs whole 2t", "vs ddp"]
              + [f"vs {_short(t)}" for t in TORCH], out, caption="bound = 2m/(m+1); efficiency = (vs accum) / bound")
    for r in rows:
        failed = [k for k, v in r["torch_pipelining"].items() if "error" in v]
        kept = [f for n in r["undisturbed"] for f, ok in zip(r["foreign_cores"][n], r["undisturbed"][n]) if ok]
        left = sum(not ok for n in r["undisturbed"] for ok in r["undisturbed"][n])
        run.console.print(f"{name} m={r['m']}: {r['rounds_run']} timed rounds, {left} disturbed step(s) left out; "
                          f"other processes used at most {max(kept, default=0):.2f} cores during the steps kept; "
                          f"torch failed: {failed or 'none'}")


def report(models: Dict[str, Any], run: Run) -> List[Dict[str, Any]]:
    """Analyse every row (adds ``analysis``), print the tables, judge the targets; returns them all."""
    def values(v: Any) -> str:
        return ", ".join(f"{k}: {values(x)}" for k, x in v.items()) if isinstance(v, dict) else fmt(v, ".2f")

    found: List[Dict[str, Any]] = []
    for name, res in models.items():
        for row in res["by_m"]:
            row["analysis"] = analyse(row)
        tables(name, res, run)
        res["targets"] = targets(name, res["by_m"])
        found += res["targets"]
    if found:
        run.targets([(f"{t['model']} {t['mode']}: {t['target']}", values(t["values"]), f">= {t['goal']}", t["met"])
                     for t in found], "the targets (pipeddp's default 1F1B)")
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    choices = names(SCRIPT)
    p = common.parser(__doc__, "mlp, m = 2 8, 1 round, no warm-up round", "results/hybrid_cpu.json", spawns=True)
    p.add_argument("--models", nargs="+", default=None, choices=choices, help="default: all (mlp with --quick)")
    p.add_argument("--ms", nargs="+", type=at_least(STAGES), default=None,
                   help="numbers of micro-batches (default 2 4 8 16; 2 8 with --quick); must divide the batch")
    add_round_flags(p, SCRIPT)
    p.add_argument("--group-timeout", type=float, default=60.0, help="seconds a torch pipelining rank awaits its peer")
    p.add_argument("--max-foreign", type=float, default=0.15,
                   help="a step during which other processes used more than this many cores is left out (0.15)")
    p.add_argument("--max-retries", type=int, default=None, help="extra rounds to replace disturbed ones; default "
                   + ", ".join(f"{k} {v}" for k, v in RETRIES.items()) + "; 0 with --quick")
    args = p.parse_args(argv)
    args.models = args.models or (["mlp"] if args.quick else choices)
    args.ms = args.ms or ([2, 8] if args.quick else [2, 4, 8, 16])
    batches = {k: WORKLOADS[k].batch[SCRIPT] for k in args.models}
    if any(n % m for m in args.ms for n in batches.values()):  # torch's schedules need equal micro-batches
        p.error(f"every m must divide the batch {batches}")
    run = Run(SCRIPT, args, common.BARRIER)
    per_model = {name: {
        **dict(zip(("rounds", "warmup"), WORKLOADS[name].rounds_of(SCRIPT, args))),
        "max_retries": args.max_retries if args.max_retries is not None else (0 if args.quick else RETRIES[name]),
    } for name in args.models}
    settings = {**vars(args), "per_model": per_model}
    res = pipeddp.spawn(job, STAGES, args=(settings,), timeout=args.timeout, threads=1)[0]
    targets = report(res, run)
    run.finish({"stages": STAGES, "threads_per_process_or_stage": 1, "per_model": per_model}, targets=targets,
               models=res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
