"""How good is pipeddp's cut? Measured bottleneck stage time against uniform, params and block-move cuts.

    python benchmarks/partition_quality.py                  # resnet50, resnet18, mlp at 2 3 4 stages (~5 min)
    python benchmarks/partition_quality.py --quick          # smoke run: resnet18 + mlp, 2 and 4 stages, 2 rounds
    python benchmarks/partition_quality.py --models mlp --stages 2 3 4 5 6 --rounds 20

For every model and number of stages S four cuts are computed:

* ``pipeddp``: ``partition(model, S, method="time", sample=micro-batch)``: profile forward+backward of
  every layer at micro-batch size, optimal contiguous min-max cut (dynamic program);
* ``uniform``: the same number of layers per stage (``method="uniform"``);
* ``params``: balanced parameter counts (``method="params"``, DeepSpeed's default ``partition_method``);
* ``block-move``: ``partition.block_move`` (torchgpipe's heuristic) on the *same* measured per-layer
  times as pipeddp's cut.

Then every stage of every cut is MEASURED: the stage (``pipeddp.stage.Stage``, as in a pipeline: the
input becomes a leaf that receives a gradient except on stage 0, the last stage computes the loss) runs
forward+backward on the real activation at its cut (1 intra-op thread). Stage measurements of all cuts
(and the whole model as one stage, for the ideal) are interleaved round by round in a rotating order;
each stage's time is the median over rounds. Stages that several cuts share are measured once.

Reported per cut: measured bottleneck / ideal, where bottleneck = the largest median stage time and
ideal = the whole model's median forward+backward time / S (1.00 = a perfect split); the profile's
prediction of the same ratio (the cut's stage costs from the per-layer profile / (total / S)); and the
median per-round ratio of this cut's bottleneck to pipeddp's (> 1: pipeddp's cut is faster).

Micro-batches: 32 x 3x64x64 for the ResNets, 64 x 1024 for the MLP (16 x Linear(1024,1024)+ReLU).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from rich.console import Console
from torch import nn

from pipeddp.tools.models import mlp, resnet
from pipeddp.partitioning.report import partition
from pipeddp.partitioning.solve import block_move
from pipeddp.runtime.stage import Stage, StepSpec

try:  # run as a script (benchmarks/ is sys.path[0]) or as python -m benchmarks.partition_quality
    from benchmarks.common import LossFn, Workload, median_ratio, print_table, write_json
except ImportError:  # pragma: no cover - depends on how the script is started
    from common import LossFn, Workload, median_ratio, print_table, write_json

METHODS = ["pipeddp", "uniform", "params", "block-move"]


WORKLOADS: Dict[str, Workload] = {
    # ~1.3 s for the whole model: ~20 s per round of all distinct stages (28 of them).
    "resnet50": Workload("resnet50 (flattened, 23 layers), micro-batch 32 x 3x64x64, cross-entropy",
                         lambda: resnet("resnet50"),
                         lambda: (torch.randn(32, 3, 64, 64), torch.randint(0, 1000, (32,))),
                         nn.functional.cross_entropy, rounds=8),
    "resnet18": Workload("resnet18 (flattened, 15 layers), micro-batch 32 x 3x64x64, cross-entropy",
                         lambda: resnet("resnet18"),
                         lambda: (torch.randn(32, 3, 64, 64), torch.randint(0, 1000, (32,))),
                         nn.functional.cross_entropy, rounds=11),
    "mlp": Workload("MLP 16 x (Linear(1024,1024)+ReLU) (32 layers), micro-batch 64 x 1024, MSE",
                    lambda: mlp(16, 1024),
                    lambda: (torch.randn(64, 1024), torch.randn(64, 1024)),
                    nn.functional.mse_loss, rounds=25),
}


def ranges(balance: Sequence[int]) -> List[Tuple[int, int]]:
    out, a = [], 0
    for b in balance:
        out.append((a, a + b))
        a += b
    return out


def predicted_ratio(balance: Sequence[int], costs: Sequence[float]) -> float:
    stage = [sum(costs[a:b]) for a, b in ranges(balance)]
    return max(stage) / (sum(costs) / len(balance))


class Segment:
    """Layers a..b-1 as a pipeline stage, timed forward+backward on the activation at layer a."""

    def __init__(self, model: nn.Sequential, a: int, b: int, acts: List[torch.Tensor], y: torch.Tensor,
                 loss_fn: LossFn) -> None:
        named = list(model.named_children())
        self.a, self.b = a, b
        self.last = b == len(named)
        self.stage = Stage(0 if a == 0 else 1, nn.Sequential(OrderedDict(named[a:b])), torch.device("cpu"),
                           last=self.last)
        self.x = acts[a]
        self.y = y
        self.loss_fn = loss_fn
        self.grad = None if self.last else torch.randn_like(acts[b])

    def __call__(self) -> None:
        for p in self.stage.module.parameters():
            p.grad = None  # as zero_grad(set_to_none=True) before each step: the first backward allocates
        spec = StepSpec(grad=True, loss_fn=self.loss_fn if self.last else None, targets=[self.y], weights=[1.0])
        t0 = time.perf_counter()
        self.stage.forward(0, self.x, spec)
        self.stage.backward(0, None if self.last else [self.grad], spec)
        return time.perf_counter() - t0  # type: ignore[return-value]


def run_model(name: str, work: Workload, stage_counts: Sequence[int], rounds: int, console: Console) -> Dict[str, Any]:
    model = work.build()
    model.train()
    x, y = work.batch()
    n = len(model)
    stage_counts = [s for s in stage_counts if s <= n]

    # The cuts.
    cuts: Dict[int, Dict[str, Dict[str, Any]]] = {}
    t_prof = time.perf_counter()
    for s in stage_counts:
        part = partition(model, s, method="time", sample=x, chunks=1)
        costs = list(part.layer_costs)
        cuts[s] = {
            "pipeddp": {"balance": list(part.balance)},
            "uniform": {"balance": list(partition(model, s, method="uniform").balance)},
            "params": {"balance": list(partition(model, s, method="params").balance)},
            "block-move": {"balance": block_move(costs, s)},
        }
        for c in cuts[s].values():
            c["predicted_ratio"] = predicted_ratio(c["balance"], costs)
            c["predicted_stage_ms"] = [sum(costs[a:b]) * 1e3 for a, b in ranges(c["balance"])]
        cuts[s]["_profile_layer_ms"] = [c * 1e3 for c in costs]  # type: ignore[assignment]
    profile_s = time.perf_counter() - t_prof

    # Every distinct stage, plus the whole model (the ideal's numerator).
    with torch.no_grad():
        acts = [x]
        h = x
        for layer in model:
            h = layer(h.clone())
            acts.append(h)
    keys = {(0, n)}
    for s in stage_counts:
        for meth in METHODS:
            keys.update(ranges(cuts[s][meth]["balance"]))
    segs = {k: Segment(model, k[0], k[1], acts, y, work.loss_fn) for k in sorted(keys)}
    for seg in segs.values():  # warm-up: every stage once
        seg()
    console.print(f"  [{name}] {n} layers; cuts profiled in {profile_s:.0f} s"
                  "; "
                  f"{len(segs)} distinct stages x {rounds} rounds")

    times: Dict[Tuple[int, int], List[float]] = {k: [] for k in segs}
    order = list(segs)
    t_meas = time.perf_counter()
    for r in range(rounds):
        k = (r * 7) % len(order)  # rotate (by a stride, so neighbours change too)
        for key in order[k:] + order[:k]:
            times[key].append(segs[key]())
    measure_s = time.perf_counter() - t_meas
    med = {k: statistics.median(v) for k, v in times.items()}
    whole = med[(0, n)]

    rows: List[Dict[str, Any]] = []
    for s in stage_counts:
        ref_keys = ranges(cuts[s]["pipeddp"]["balance"])
        ref_bott = [max(times[kk][r] for kk in ref_keys) for r in range(rounds)]
        for meth in METHODS:
            c = cuts[s][meth]
            keys_c = ranges(c["balance"])
            stage_ms = [med[kk] * 1e3 for kk in keys_c]
            bott = [max(times[kk][r] for kk in keys_c) for r in range(rounds)]
            rows.append({
                "model": name, "stages": s, "method": meth, "balance": c["balance"],
                "measured_stage_ms": stage_ms,
                "measured_bottleneck_ms": max(stage_ms),
                "ideal_ms": whole * 1e3 / s,
                "measured_ratio": max(stage_ms) / (whole * 1e3 / s),
                "measured_ratio_vs_own_sum": max(stage_ms) / (sum(stage_ms) / s),
                "measured_ratio_per_round_median": statistics.median(
                    bb / (times[(0, n)][r] / s) for r, bb in enumerate(bott)),
                "predicted_ratio": c["predicted_ratio"],
                "predicted_stage_ms": c["predicted_stage_ms"],
                "bottleneck_vs_pipeddp": median_ratio(bott, ref_bott),
            })
    return {"workload": work.describe, "layers": n, "input_shape": list(x.shape), "rounds": rounds,
            "profile_s": profile_s, "measure_s": measure_s,
            "whole_ms": whole * 1e3, "profile_layer_ms": {s: cuts[s]["_profile_layer_ms"] for s in stage_counts},
            "rows": rows, "stage_times_s": {f"{a}-{b}": v for (a, b), v in times.items()}}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=None, choices=list(WORKLOADS),
                   help="default: resnet50 resnet18 mlp (resnet18 mlp with --quick)")
    p.add_argument("--stages", nargs="+", type=int, default=None, help="stage counts (default 2 3 4; 2 4 with --quick)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measurement rounds; default per model: " + ", ".join(f"{k} {w.rounds}" for k, w in WORKLOADS.items())
                        + "; 2 with --quick")
    p.add_argument("--quick", action="store_true", help="smoke run: resnet18 + mlp, 2 and 4 stages, 2 rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default results/partition_quality[_quick].json)")
    args = p.parse_args(argv)
    models = args.models or (["resnet18", "mlp"] if args.quick else ["resnet50", "resnet18", "mlp"])
    stage_counts = sorted(set(args.stages or ([2, 4] if args.quick else [2, 3, 4])))
    if any(s < 1 for s in stage_counts):
        p.error("--stages must be >= 1")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    out_path = args.out or f"results/partition_quality{'_quick' if args.quick else ''}.json"

    torch.set_num_threads(1)
    console = Console(width=max(170, Console().width))
    started = time.perf_counter()
    results: Dict[str, Any] = {}
    for name in models:
        torch.manual_seed(args.seed)
        rounds = args.rounds if args.rounds is not None else (2 if args.quick else WORKLOADS[name].rounds)
        results[name] = run_model(name, WORKLOADS[name], stage_counts, rounds, console)

    table: List[List[Any]] = []
    for name, res in results.items():
        by_s: Dict[int, List[Dict[str, Any]]] = {}
        for r in res["rows"]:
            by_s.setdefault(r["stages"], []).append(r)
        for s, rows in by_s.items():
            best = min(r["measured_ratio"] for r in rows)
            for i, r in enumerate(rows):
                table.append([
                    name if i == 0 and s == min(by_s) else "", s if i == 0 else "", r["method"], str(r["balance"]),
                    f"{r['predicted_ratio']:.2f}", f"{r['measured_ratio']:.2f}" + (" *" if r["measured_ratio"] == best else ""),
                    f"{r['measured_ratio_vs_own_sum']:.2f}",
                    " / ".join(f"{v:.0f}" for v in r["measured_stage_ms"]), f"{r['ideal_ms']:.0f}",
                    "-" if r["method"] == "pipeddp" else f"{r['bottleneck_vs_pipeddp']:.2f}x",
                ])
    print_table(
        "partition quality: bottleneck stage / ideal (1.00 = perfect split), measured vs predicted",
        ["model", "stages", "cut", "balance", "predicted", "measured", "max / mean", "measured stage ms (fwd+bwd)",
         "ideal ms",
         "bottleneck vs pipeddp"],
        table, console=console,
        caption="measured = largest median stage time / (whole model's median fwd+bwd / stages), stages timed on "
                "their real activations, 1 thread, interleaved round by round; predicted = the same ratio from the "
                "per-layer profile pipeddp cut with; * = best measured cut for that model and stage count; max / mean = "
                "bottleneck over the mean of the cut's own measured stages (the whole model in one piece can be "
                "slower than its stages summed, e.g. a larger working set, so measured can drop below 1.00); "
                "bottleneck vs pipeddp = median per-round ratio of this cut's bottleneck to pipeddp's (> 1: pipeddp "
                "faster). params = DeepSpeed's default, block-move = torchgpipe's heuristic on the same profile. "
                + "; ".join(f"{k}: {v['workload']}, {v['rounds']} rounds" for k, v in results.items()),
    )
    elapsed = time.perf_counter() - started
    out = write_json(out_path, {
        "benchmark": "partition_quality",
        "settings": {"models": models, "stages": stage_counts, "threads": 1, "quick": args.quick, "seed": args.seed,
                     "measure": "each cut's stages timed forward+backward on their real activations (pipeddp Stage), "
                                "interleaved round by round with all other stages and the whole model; median per stage",
                     "ideal": "median whole-model forward+backward / stages"},
        "elapsed_s": elapsed,
        "models": results,
    })
    console.print(f"wrote {out} ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
