"""What the engine itself costs per action: extra time over accumulation on a model too small to hide it.

A model of 4 x (Linear(64, 64) + ReLU), batch 64 in 8 micro-batches: the compute per micro-batch is tens of
microseconds, so whatever an engine adds per action (one forward or backward of one micro-batch on one stage)
shows. In one process, interleaved round by round:

* ``accum``: the plain model accumulating over the same 8 micro-batches (the yardstick);
* ``pipeddp-1``: ``Pipeline`` with one stage (no hand-off between stages);
* ``pipeddp-2``: ``Pipeline`` with two stages (every dependency between them a hand-off between two threads);
* ``torch-1``: ``torch.distributed.pipelining``'s ``Schedule1F1B`` with one stage (a one-rank gloo group);
* ``queue round trip``: one message there and back between two Python threads (``queue.SimpleQueue``), the
  cost of the hand-off itself.

Extra time per action = (step - accum) / actions, where a step has 2 m actions per stage (F and B of every
micro-batch), as a median of per-round values.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
from benchmarks import baselines
from benchmarks.common import Run, parser
from pipeddp.tools.models import mlp

MESSAGES = 200  # round trips per round of the queue measurement


def round_trip(messages: int) -> float:
    """Seconds per round trip of one message between two threads (``queue.SimpleQueue``, C-level hand-off)."""
    there: "queue.SimpleQueue[int]" = queue.SimpleQueue()
    back: "queue.SimpleQueue[int]" = queue.SimpleQueue()

    def echo() -> None:
        for _ in range(messages):
            back.put(there.get())

    t = threading.Thread(target=echo, name="round-trip")
    t.start()
    t0 = time.perf_counter()
    for i in range(messages):
        there.put(i)
        back.get()
    elapsed = time.perf_counter() - t0
    t.join()
    return elapsed / messages


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = mlp(4, 64, 64, 64)
    x, y = torch.randn(args.batch, 64), torch.randn(args.batch, 64)
    loss, m = nn.functional.mse_loss, args.chunks
    # torch's schedules need a process group: one rank, in this process
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1), rank=0,
                            world_size=1)
    steps = [baselines.accumulate(model, x, y, loss, m),
             baselines.pipeline(model, x, y, loss, stages=1, chunks=m, name="pipeddp-1"),
             baselines.pipeline(model, x, y, loss, stages=2, chunks=m, balance=[4, 4], name="pipeddp-2"),
             baselines.torch_pipelining(model, x, y, loss, balance=[len(model)], schedule="1f1b", chunks=m,
                                        name="torch-1")]
    try:
        check = baselines.check_grads(steps, "accum", "accum")  # nothing wrong is timed
        times: Dict[str, List[float]] = {s.name: [] for s in steps}
        times["queue round trip"] = []
        for r in range(args.warmup + args.rounds):
            k = r % len(steps)
            for s in steps[k:] + steps[:k]:
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    s.run()
                if r >= args.warmup:
                    times[s.name].append((time.perf_counter() - t0) / args.calls)
            rtt = round_trip(MESSAGES)
            if r >= args.warmup:
                times["queue round trip"].append(rtt)
    finally:
        for s in steps:
            s.close()
        dist.destroy_process_group()
    actions = {"pipeddp-1": 2 * m, "pipeddp-2": 4 * m, "torch-1": 2 * m}
    extra = {name: [(t - a) / n for t, a in zip(times[name], times["accum"])] for name, n in actions.items()}

    def ratio(a: str, b: Sequence[float]) -> float:
        return statistics.median(x / y for x, y in zip(extra[a], b))

    return {"step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items() if k != "queue round trip"},
            "extra_per_action_us": {name: statistics.median(v) * 1e6 for name, v in extra.items()},
            "queue_round_trip_us": statistics.median(times["queue round trip"]) * 1e6,
            "one_stage_vs_torch": ratio("pipeddp-1", extra["torch-1"]),
            "two_stages_vs_round_trip": ratio("pipeddp-2", times["queue round trip"]),
            "check": check, "times_s": times, "actions_per_step": actions}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser(__doc__, "3 rounds of 2 calls")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 40; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds before them")
    p.add_argument("--calls", type=int, default=None, help="steps per configuration per round (default 10)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per step")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 40)
    args.calls = args.calls or (2 if args.quick else 10)
    if args.device != "cpu":
        p.error("overhead.py measures the CPU engine (--device cpu)")
    run = Run("overhead", args)
    res = measure(args)
    per = res["extra_per_action_us"]
    run.table(f"Extra time per action over accumulation (tiny MLP 4 x Linear(64,64)+ReLU, batch {args.batch}, "
              f"{args.chunks} micro-batches, medians of {args.rounds} rounds)",
              ["configuration", "step ms", "extra us / action"],
              [["accum", res["step_ms"]["accum"], None]] + [[k, res["step_ms"][k], v] for k, v in per.items()]
              + [["queue round trip (us)", None, res["queue_round_trip_us"]]])
    targets = run.targets([["pipeddp 1 stage / torch 1 stage, per action", res["one_stage_vs_torch"], "<= 0.60",
                            res["one_stage_vs_torch"] <= 0.60],
                           ["pipeddp 2 stages per action / a queue round trip", res["two_stages_vs_round_trip"],
                            "<= 0.75", res["two_stages_vs_round_trip"] <= 0.75]])
    run.finish(targets=targets, **res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
