"""How good is pipeddp's cut? Measured bottleneck stage time against uniform, params and block-move cuts.

Every stage of every cut is timed forward+backward on its real activation, interleaved round by round with
the others and the whole model. See benchmarks/README.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
from benchmarks.baselines import WORKLOADS, Workload, add_round_flags, layers, names
from benchmarks.common import LossFn, Run, at_least, here, parser, timed_call
from pipeddp import partition
from pipeddp.partitioning.solve import block_move

SCRIPT = "partition_quality"
METHODS = ["pipeddp", "uniform", "params", "block-move"]
Key = Tuple[int, int]  # layers a..b-1


def ranges(balance: Sequence[int]) -> List[Key]:
    """The (first, end) layers of every stage of a cut."""
    return [(sum(balance[:i]), sum(balance[:i + 1])) for i in range(len(balance))]


class Segment:
    """Layers a..b-1 timed as a pipeline stage runs them: forward from the activation at layer a (on stage
    0 a copy, elsewhere a leaf that receives a gradient, copied first if the first layer works in place),
    then backward from the loss on the last stage, else from a fixed gradient of the stage's output."""

    def __init__(self, model: torch.nn.Sequential, key: Key, acts: List[torch.Tensor], y: torch.Tensor,
                 loss_fn: LossFn) -> None:
        a, b = key
        self.module = layers(model, a, b)
        self.leaf = acts[a].detach().requires_grad_(a != 0)
        self.copy = a == 0 or getattr(self.module[0], "inplace", False)
        self.y, self.loss_fn = y, loss_fn
        self.grad = None if b == len(model) else torch.randn_like(acts[b])

    def __call__(self) -> float:
        self.module.zero_grad(set_to_none=True)  # as each step does: the first backward allocates
        self.leaf.grad = None
        return timed_call(self._step)[0]

    def _step(self) -> None:
        out = self.module(self.leaf.clone() if self.copy else self.leaf)
        if self.grad is None:
            self.loss_fn(out, self.y).backward()
        else:
            out.backward(self.grad)


def cuts(model: torch.nn.Sequential, x: torch.Tensor, stages: int) -> Tuple[Dict[str, Dict[str, Any]], List[float]]:
    """The four cuts at ``stages``, each with the ratio its own profile predicts (bottleneck / ideal)."""
    part = partition(model, stages, method="time", sample=x, chunks=1)
    costs = list(part.layer_costs)
    out = {"pipeddp": {"balance": list(part.balance)},
           "uniform": {"balance": list(partition(model, stages, method="uniform").balance)},
           "params": {"balance": list(partition(model, stages, method="params").balance)},
           "block-move": {"balance": block_move(costs, stages)}}
    for c in out.values():
        stage = [sum(costs[a:b]) for a, b in ranges(c["balance"])]
        c["predicted_ratio"] = max(stage) / (sum(costs) / stages)
        c["predicted_stage_ms"] = [v * 1e3 for v in stage]
    return out, costs


def measure(model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, keys: List[Key], loss_fn: LossFn,
            rounds: int) -> Dict[Key, List[float]]:
    """Seconds per round of every stage in ``keys``, interleaved (rotated by a stride, so neighbours change)."""
    with torch.no_grad():
        acts, h = [x], x
        for layer in model:
            h = layer(h.clone())
            acts.append(h)
    segs = {k: Segment(model, k, acts, y, loss_fn) for k in keys}
    for seg in segs.values():
        seg()  # warm-up: every stage once
    times: Dict[Key, List[float]] = {k: [] for k in keys}
    for r in range(rounds):
        s = (r * 7) % len(keys)
        for key in keys[s:] + keys[:s]:
            times[key].append(segs[key]())
    return times


def run_model(work: Workload, stage_counts: Sequence[int], rounds: int, seed: int, run: Run) -> Dict[str, Any]:
    """Cut, then measure every distinct stage of every cut (and the whole model) round by round."""
    model, x, y = work.seeded(work.batch[SCRIPT], seed)
    model, x, y = model.to(here()), x.to(here()), y.to(here())  # profiled and timed on the benchmark's device
    n = len(model)
    stage_counts = [s for s in stage_counts if s <= n]
    t0 = time.perf_counter()
    by_s = {s: cuts(model, x, s) for s in stage_counts}
    profile_s = time.perf_counter() - t0
    keys = sorted({(0, n)} | {k for s in stage_counts for c in by_s[s][0].values() for k in ranges(c["balance"])})
    t0 = time.perf_counter()
    times = measure(model, x, y, keys, work.loss_fn, rounds)
    measure_s, med = time.perf_counter() - t0, {k: statistics.median(v) for k, v in times.items()}
    whole = med[(0, n)]
    rows: List[Dict[str, Any]] = []
    for s in stage_counts:
        for meth in METHODS:
            c = by_s[s][0][meth]
            stage_ms = [med[k] * 1e3 for k in ranges(c["balance"])]
            rows.append({"model": work.name, "stages": s, "method": meth, "balance": c["balance"],
                         "measured_stage_ms": stage_ms, "measured_bottleneck_ms": max(stage_ms),
                         "ideal_ms": whole * 1e3 / s, "measured_ratio": max(stage_ms) / (whole * 1e3 / s),
                         "measured_ratio_vs_own_sum": max(stage_ms) / (sum(stage_ms) / s),
                         "predicted_ratio": c["predicted_ratio"], "predicted_stage_ms": c["predicted_stage_ms"]})
    return {"workload": work.describe(x.shape[0]), "layers": n, "input_shape": list(x.shape), "rounds": rounds,
            "profile_s": profile_s, "measure_s": measure_s, "whole_ms": whole * 1e3,
            "profile_layer_ms": {s: [c * 1e3 for c in by_s[s][1]] for s in stage_counts},
            "rows": rows, "stage_times_s": {f"{a}-{b}": v for (a, b), v in times.items()}}


def report(results: Dict[str, Any], run: Run) -> None:
    table: List[List[Any]] = []
    for name, res in results.items():
        counts = sorted({r["stages"] for r in res["rows"]})
        for s in counts:
            rows = [r for r in res["rows"] if r["stages"] == s]
            best = min(r["measured_ratio"] for r in rows)
            table += [[name if i == 0 and s == counts[0] else "", s if i == 0 else "", r["method"], str(r["balance"]),
                       f"{r['predicted_ratio']:.2f}",
                       f"{r['measured_ratio']:.2f}" + (" *" if r["measured_ratio"] == best else ""),
                       f"{r['measured_ratio_vs_own_sum']:.2f}", " / ".join(f"{v:.0f}" for v in r["measured_stage_ms"]),
                       f"{r['ideal_ms']:.0f}"] for i, r in enumerate(rows)]
    run.table("partition quality: bottleneck stage / ideal (1.00 = perfect split), measured vs predicted",
              ["model", "stages", "cut", "balance", "predicted", "measured", "max / mean",
               "measured stage ms (fwd+bwd)", "ideal ms"], table,
              caption="measured = largest median stage time / (whole model's / stages); predicted: the same from the "
                      "profile pipeddp cut with; * = best measured. "
                      + "; ".join(f"{k}: {v['workload']}, {v['rounds']} rounds" for k, v in results.items()))


def main(argv: Optional[Sequence[str]] = None) -> int:
    choices = names(SCRIPT)
    p = parser(__doc__, "resnet18 + mlp, 2 and 4 stages, 2 rounds")
    p.add_argument("--models", nargs="+", default=None, choices=choices,
                   help="default: resnet50 resnet18 mlp (resnet18 mlp with --quick)")
    p.add_argument("--stages", nargs="+", type=at_least(1), default=None,
                   help="stage counts (default 2 3 4; 2 4 with --quick)")
    add_round_flags(p, SCRIPT, "measurement rounds", warmup=False, quick_rounds=2)
    args = p.parse_args(argv)
    models = args.models or (["resnet18", "mlp"] if args.quick else ["resnet50", "resnet18", "mlp"])
    stage_counts = sorted(set(args.stages or ([2, 4] if args.quick else [2, 3, 4])))
    torch.set_num_threads(1)
    run = Run(SCRIPT, args)
    results: Dict[str, Any] = {}
    for name in models:
        rounds = WORKLOADS[name].rounds_of(SCRIPT, args, quick_rounds=2)[0]
        results[name] = run_model(WORKLOADS[name], stage_counts, rounds, args.seed, run)
    report(results, run)
    run.finish({"models": models, "stages": stage_counts, "threads": 1}, models=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
