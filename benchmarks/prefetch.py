"""The input path: a step with ``data.loader(..., prefetch=k)`` against the same loop loading on demand.

A dataset whose loading costs about half a step (``--load-share``; each batch waits ``load``, as a read from a
slow disk or the network does: the waiting holds no core, so on this 2-core host loading can hide
behind compute, which a core-bound decode could not) feeds ``HybridParallel`` (one process, 2 CPU stage
threads, 1F1B, an MLP). One process, interleaved A/B: every round trains ``--steps`` batches without prefetch and
with ``prefetch=2``, the order alternating each round; per-round ratios, medians.

Targets: with prefetch a step takes <= 1.10x the larger of loading and computing; without, about their sum.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks.common import Run, median_ratio, parser
from pipeddp.tools.models import mlp

#: steps of an epoch left out of its time (the first batch's wait, and what prefetch=2 banks meanwhile)
SKIP = 2


class SlowDataset(torch.utils.data.Dataset):
    """``n`` random samples, each ready ``delay`` seconds after it is asked for; a batch is read in one request
    (``__getitems__``, as from a shard on storage), so the reading thread wakes once per batch: a thread woken
    per sample waits for the GIL each time while the stage threads dispatch (up to the 5 ms switch interval)."""

    def __init__(self, n: int, width: int, delay: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.delay)
        return self.x[i], self.y[i]

    def __getitems__(self, indices: List[int]) -> List[Any]:
        time.sleep(self.delay * len(indices))
        return [(self.x[i], self.y[i]) for i in indices]


def epoch(engine: Any, data: SlowDataset, batch: int, prefetch: int, steps: int) -> float:
    """Seconds per step of ``steps`` training steps fed by the loader, in the steady state: the clock starts
    with the third batch in hand (nothing hides the wait for an epoch's first batch, and the batches the
    thread banked meanwhile would flatter prefetch), in both configurations alike."""
    loader = pipeddp.data.loader(data, batch, engine=engine, prefetch=prefetch, seed=1)
    loss_fn = nn.MSELoss()
    start = 0.0
    for k, (x, y) in enumerate(loader):
        if k == SKIP:
            start = time.perf_counter()
        engine.zero_grad(set_to_none=True)
        engine.train_step(x, y, loss_fn)
        if k + 1 == SKIP + steps:
            break
    elapsed = time.perf_counter() - start
    loader.close()
    return elapsed / steps


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    torch.set_num_threads(1)
    width, batch = (256, 64) if args.quick else (1024, 128)
    torch.manual_seed(0)
    engine = pipeddp.HybridParallel(mlp(8, width, width, width), stages=2, devices=["cpu", "cpu"], chunks=4, threads=1)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    loss_fn = nn.MSELoss()

    def computing() -> float:
        """Seconds per step on a batch already in memory (the compute alone, in this round's conditions)."""
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            engine.zero_grad(set_to_none=True)
            engine.train_step(x, y, loss_fn)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    computing()
    compute = computing()
    load = args.load_share / (1 - args.load_share) * compute  # loading's share of the serial step
    data = SlowDataset(batch * (args.steps + SKIP + 1), width, load / batch)
    loads = []
    t0 = time.perf_counter()
    for _ in pipeddp.data.loader(data, batch, replicas=1, replica=0, seed=1):
        loads.append(time.perf_counter() - t0)
        if len(loads) == 5:
            break
        t0 = time.perf_counter()
    load_measured = statistics.median(loads)
    times: Dict[str, List[float]] = {"no prefetch": [], "prefetch=2": [], "compute": []}
    for r in range(args.rounds):
        times["compute"].append(computing())
        order = [0, 2] if r % 2 == 0 else [2, 0]  # alternating: on this host the second of a pair runs slower
        for k in order:
            times["prefetch=2" if k else "no prefetch"].append(epoch(engine, data, batch, k, args.steps))
    engine.close()
    slow, fast, comp = times["no prefetch"], times["prefetch=2"], times["compute"]
    return {"compute_s": statistics.median(comp), "load_s": load_measured, "times_s": times,
            "step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "speedup": median_ratio(slow, fast),  # per round: the compute of the same round is the yardstick
            "prefetch_over_max": median_ratio(fast, [max(load_measured, c) for c in comp]),
            "no_prefetch_over_sum": median_ratio(slow, [load_measured + c for c in comp])}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser(__doc__, "a smaller MLP, 4 rounds of 8 steps")
    p.add_argument("--rounds", type=int, default=None, help="A/B rounds (default 8; --quick 4)")
    p.add_argument("--steps", type=int, default=None, help="training steps per epoch of a round (default 12)")
    p.add_argument("--load-share", type=float, default=0.5, help="loading's share of a step without prefetch")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (4 if args.quick else 8)
    args.steps = args.steps or (8 if args.quick else 12)
    if not 0 < args.load_share < 1:
        p.error(f"--load-share must be between 0 and 1, got {args.load_share}")
    run = Run("prefetch", args)
    res = measure(args)
    run.table("the input path: loading about half of a step, HybridParallel 2 CPU stages (medians)",
              ["", "ms per step", "over max(load, compute)", "over load + compute"],
              [["compute alone", res["compute_s"] * 1e3, None, None], ["load alone", res["load_s"] * 1e3, None, None],
               ["no prefetch", res["step_ms"]["no prefetch"], None, res["no_prefetch_over_sum"]],
               ["prefetch=2", res["step_ms"]["prefetch=2"], res["prefetch_over_max"], None]])
    targets = run.targets([
        ["step with prefetch / max(load, compute)", res["prefetch_over_max"], "<= 1.10",
         res["prefetch_over_max"] <= 1.10],
        ["step without prefetch / (load + compute)", res["no_prefetch_over_sum"], "~ 1.00"],
        ["speedup of prefetch (median of per-round ratios)", res["speedup"], "~ (L + C) / max(L, C)"]])
    run.finish({"threads_per_stage": 1}, targets=targets, result=res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
