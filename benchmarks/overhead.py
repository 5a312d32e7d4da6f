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
import copy
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
from benchmarks import baselines
from benchmarks.common import Run, grad_rel_diff, grad_snapshot, parser
from pipeddp.tools.models import mlp

SCRIPT = "overhead"


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


def one_rank_group() -> Callable[[], None]:
    """A gloo process group of one rank in this process (torch's schedules need one); returns its teardown."""
    store_dir = tempfile.mkdtemp(prefix="pipeddp-overhead-")
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)

    def close() -> None:
        dist.destroy_process_group()

    return close


def torch_one_stage(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, chunks: int) -> baselines.Step:
    """``Schedule1F1B`` over one ``PipelineStage`` holding the whole model (torch averages the micro-batch losses,
    as pipeddp and ``accum`` do with equal micro-batches)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    sub = copy.deepcopy(model)
    stage = PipelineStage(sub, 0, 1, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=chunks, loss_fn=nn.functional.mse_loss)
    losses: List[torch.Tensor] = []

    def run() -> Any:
        sub.zero_grad(set_to_none=True)
        losses.clear()
        return sched.step(x, target=y, losses=losses)

    return baselines.Step("torch-1", run, sub)


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = mlp(4, 64, 64, 64)
    x, y = torch.randn(args.batch, 64), torch.randn(args.batch, 64)
    loss = nn.functional.mse_loss
    close_group = one_rank_group()
    steps = [baselines.accumulate(model, x, y, loss, args.chunks),
             baselines.pipeline(model, x, y, loss, stages=1, chunks=args.chunks, name="pipeddp-1"),
             baselines.pipeline(model, x, y, loss, stages=2, chunks=args.chunks, balance=[4, 4], name="pipeddp-2"),
             torch_one_stage(model, x, y, args.chunks)]
    try:
        # nothing wrong is timed: every configuration's gradients against accumulation's
        for s in steps:
            s.run()
        ref = grad_snapshot(steps[0].module)
        check = {s.name: grad_rel_diff(ref, s.module) for s in steps}
        for name, diff in check.items():
            if diff > 1e-5:
                print(f"  warning: {name} gradients differ from accum's by {diff:.2e} (relative)", flush=True)
        actions = {"pipeddp-1": 2 * args.chunks, "pipeddp-2": 4 * args.chunks, "torch-1": 2 * args.chunks}
        times: Dict[str, List[float]] = {s.name: [] for s in steps}
        times["queue round trip"] = []
        for r in range(args.warmup + args.rounds):
            k = r % len(steps)
            for s in steps[k:] + steps[:k]:
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    s.run()
                elapsed = (time.perf_counter() - t0) / args.calls
                if r >= args.warmup:
                    times[s.name].append(elapsed)
            rtt = round_trip(args.messages)
            if r >= args.warmup:
                times["queue round trip"].append(rtt)
    finally:
        for s in steps:
            s.close()
        close_group()
    extra = {name: [(t - a) / n for t, a in zip(times[name], times["accum"])] for name, n in actions.items()}
    per_action_us = {name: statistics.median(v) * 1e6 for name, v in extra.items()}
    rtt_us = statistics.median(times["queue round trip"]) * 1e6

    def ratio(a: str, b: Sequence[float]) -> float:
        return statistics.median(x / y for x, y in zip(extra[a], b))

    return {
        "step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items() if k != "queue round trip"},
        "extra_per_action_us": per_action_us, "queue_round_trip_us": rtt_us,
        "one_stage_vs_torch": ratio("pipeddp-1", extra["torch-1"]),
        "two_stages_vs_round_trip": ratio("pipeddp-2", times["queue round trip"]),
        "check": check, "times_s": times, "actions_per_step": actions,
    }


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = parser(__doc__, "3 rounds of 2 calls", "results/overhead.json")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 40; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds before them")
    p.add_argument("--calls", type=int, default=None, help="steps per configuration per round (default 10)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per step")
    p.add_argument("--messages", type=int, default=200, help="round trips per round of the queue measurement")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 40)
    args.calls = args.calls or (2 if args.quick else 10)
    if args.device != "cpu":
        p.error("overhead.py measures the CPU engine (--device cpu)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    run = Run(SCRIPT, args)
    res = measure(args)
    per = res["extra_per_action_us"]
    run.table(f"Extra time per action over accumulation (tiny MLP 4 x Linear(64,64)+ReLU, batch {args.batch}, "
              f"{args.chunks} micro-batches, medians of {args.rounds} rounds)",
              ["configuration", "step ms", "extra us / action"],
              [["accum", res["step_ms"]["accum"], None]]
              + [[k, res["step_ms"][k], per[k]] for k in ("pipeddp-1", "pipeddp-2", "torch-1")]
              + [["queue round trip (us)", None, res["queue_round_trip_us"]]])
    run.table("Against the targets", ["ratio", "measured", "target"],
              [["pipeddp 1 stage / torch 1 stage, per action", res["one_stage_vs_torch"], "<= 0.60"],
               ["pipeddp 2 stages per action / a queue round trip", res["two_stages_vs_round_trip"], "<= 0.75"]])
    run.finish(**res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
