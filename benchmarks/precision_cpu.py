"""Mixed precision and torch.compile on a 2-stage CPU pipeline: what they buy, as ratios from one run.

The plain model and a 2-stage ``Pipeline`` in float32 and under bfloat16 autocast, and the pipeline with
``compile=True`` (compiled during the check step), interleaved. See benchmarks/README.md.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
from benchmarks import baselines  # noqa: E402
from benchmarks.common import Run, here, interleaved, median_ms, median_ratio, parser  # noqa: E402
from benchmarks.workloads import mlp_workload  # noqa: E402

SCRIPT = "precision_cpu"


def autocast(step: baselines.Step, dtype: torch.dtype = torch.bfloat16) -> baselines.Step:
    """The same step, run under autocast on the benchmark's device type."""
    inner = step.run

    def run() -> Any:
        with torch.autocast(here().type, dtype=dtype):
            return inner()

    step.run = run
    return step


def main(argv: Any = None) -> None:
    p = parser(__doc__, "a small MLP, 2 rounds", f"results/{SCRIPT}.json")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--chunks", type=int, default=8)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    work = mlp_workload(4, 256) if args.quick else mlp_workload()
    n = 64 if args.quick else 256
    rounds = args.rounds or (2 if args.quick else 8)
    run = Run(SCRIPT, args)
    model, x, y = work.seeded(n, args.seed)
    pipe = dict(chunks=args.chunks, balance="time", sample=x)
    steps: Dict[str, baselines.Step] = {
        "plain fp32": baselines.whole(model, x, y, work.loss_fn, name="plain fp32"),
        "plain bf16": autocast(baselines.whole(model, x, y, work.loss_fn, name="plain bf16")),
        "pipeline fp32": baselines.pipeline(model, x, y, work.loss_fn, name="pipeline fp32", **pipe),
        "pipeline bf16": autocast(baselines.pipeline(model, x, y, work.loss_fn, name="pipeline bf16", **pipe)),
        "pipeline compiled": baselines.pipeline(model, x, y, work.loss_fn, name="pipeline compiled", compile=True,
                                                **pipe),
    }
    # each against the plain model in its precision (bf16 only to bf16's tolerance: not warned about)
    check: Dict[str, Dict[str, float]] = {}
    for name, ref in (("plain fp32", "plain fp32"), ("plain bf16", "plain bf16"), ("pipeline fp32", "plain fp32"),
                      ("pipeline compiled", "plain fp32"), ("pipeline bf16", "plain bf16")):
        check.update(baselines.check_grads([steps[name]], lambda s, ref=ref: steps[ref].grads(), ref,
                                           exempt=[name] if "bf16" in name else []))
    times = interleaved({k: s.run for k, s in steps.items()}, rounds, warmup=1)
    pairs = [("pipeline bf16", "pipeline fp32", "bf16 autocast vs float32, same pipeline"),
             ("pipeline bf16", "plain bf16", "pipeline vs plain model, both bf16"),
             ("plain bf16", "plain fp32", "bf16 vs float32, plain model"),
             ("pipeline compiled", "pipeline fp32", "compiled vs eager stages"),
             ("pipeline fp32", "plain fp32", "pipeline vs plain model, both float32")]
    ratios = [{"faster": a, "than": b, "what": what, "speedup": median_ratio(times[b], times[a])}
              for a, b, what in pairs]
    run.table(f"{work.describe(n)}, {args.chunks} micro-batches, {rounds} rounds: median step ms",
              ["configuration", "step ms"], [[k, median_ms(v)] for k, v in times.items()])
    run.table("speedups (median of per-round ratios; > 1: the first is faster)", ["comparison", "speedup"],
              [[r["what"], f"{r['speedup']:.2f}x"] for r in ratios])
    for s in steps.values():
        s.close()
    run.finish(settings={"model": work.describe(n), "rounds": rounds}, check=check, ratios=ratios,
               median_ms={k: median_ms(v) for k, v in times.items()}, times_s=times)


if __name__ == "__main__":
    main()
