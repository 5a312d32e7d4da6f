"""Whether pipeddp's groups made on first use (``PIPEDDP_LAZY_GROUPS=1``) slow a step: an interleaved A/B in one job.

One spawned gloo job of 2 processes (2 stages; ``--nprocs 4``: 2 stages x 2 replicas, DDP over each stage's group),
one intra-op thread each, builds the same 1F1B stage-mode engine twice on ``schedules.py``'s ``tiny`` workload
(m = 4): its groups made as full meshes (``eager``) and on first use (``lazy``); then times blocks of consecutive
steps round by round between barriers, the order reversed every other round, and reports the median of the
per-round ratios eager / lazy (above 1: the lazy engine's step is quicker). The job's own group (which carries the
pipeline's messages and the agreements) is the script's, a full mesh for both: the engines differ in their stage
and pipeline groups. docs/scale.md quotes it.
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any, Dict, Optional, Sequence

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks import baselines, common
from benchmarks.common import BARRIER, Run, at_least, barrier_rounds, log0, median_ratio
from benchmarks.workloads import WORKLOADS

ARMS = {"eager": "0", "lazy": "1"}


def job(settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    rank = common.init_job(settings["timeout"], "cpu")
    work = WORKLOADS["tiny"]
    model, x, y = work.seeded(work.batch["schedules"], settings["seed"])
    steps = []
    for name, value in ARMS.items():  # the setting is read when the engine makes its groups
        os.environ["PIPEDDP_LAZY_GROUPS"] = value
        steps.append(baselines.hybrid(model, x, y, work.loss_fn, stages=2, mode="stage", chunks=settings["m"],
                                      name=name, schedule="1f1b", balance="uniform"))
    del os.environ["PIPEDDP_LAZY_GROUPS"]
    block = settings["block"]

    def blocked(run: Any) -> Any:
        def go() -> Any:
            for _ in range(block - 1):
                run()
            return run()
        return go

    runs = {s.name: blocked(s.run) for s in steps}
    barrier_rounds(runs, 0, settings["warmup"])
    rounds = [barrier_rounds(dict(reversed(runs.items())) if r % 2 else runs, 1)[0] for r in range(settings["rounds"])]
    for s in steps:
        s.close()
    dist.barrier()
    if rank != 0:
        return None
    walls = {k: [t.wall / block for got in rounds for t in got[k]] for k in runs}
    log0(f"  eager / lazy: {median_ratio(walls['eager'], walls['lazy']):.3f}")
    return {"eager_over_lazy": median_ratio(walls["eager"], walls["lazy"]),
            "median_ms": {k: 1e3 * statistics.median(v) for k, v in walls.items()}, "times_s": walls}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = common.parser(__doc__, "2 rounds of 2 steps", spawns=True, device=False)
    p.add_argument("--nprocs", type=int, choices=[2, 4], default=2, help="2 stages x 1 or 2 replicas")
    p.add_argument("--m", type=at_least(2), default=4, help="micro-batches per step")
    p.add_argument("--rounds", type=at_least(1), default=20)
    p.add_argument("--warmup", type=at_least(0), default=3)
    p.add_argument("--block", type=at_least(1), default=10, help="consecutive steps per timed reading")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.block = 2, 1, 2
    run = Run("lazy_groups", args, BARRIER)
    res = pipeddp.spawn(job, args.nprocs, args=(vars(args),), timeout=args.timeout, threads=1)[0]
    run.table(f"1F1B, tiny, m = {args.m}, {args.nprocs} processes", ["arm", "median ms per step"],
              [[k, v] for k, v in res["median_ms"].items()],
              caption=f"eager / lazy, median of per-round ratios: {res['eager_over_lazy']:.3f}")
    run.finish({"nprocs": args.nprocs}, **res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
