"""What the engine itself costs: per action, on a model too small to hide it, and (``--prefetch``) on the input path.

Per action: 4 x (Linear(64, 64) + ReLU), batch 64 in 8 micro-batches, so the compute per micro-batch is tens of
microseconds and whatever an engine adds per action (one forward or backward of one micro-batch on one stage)
shows; the hand-off itself is timed as one message there and back between two Python threads, and the
floor of two stages on threads as the same 1F1B with nothing but its hand-offs (``BareThreads``). --prefetch: each
batch waits, as a read from a slow disk or the network does: the waiting holds no core, so on this 2-core host
loading can hide behind compute, which a core-bound decode could not. See benchmarks/README.md.
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
import pipeddp
from benchmarks import baselines
from benchmarks.common import Run, median_ratio, parser
from pipeddp.tools.models import mlp

MESSAGES = 200  # round trips per round of the queue measurement
#: steps of an epoch left out of its time (the first batch's wait, and what prefetch=2 banks meanwhile)
SKIP = 2


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


class BareThreads:
    """The floor of two stages on threads: the model's two halves in 1F1B, the first on the caller's thread and the
    second on a thread of its own, activations and gradients handed over by ``queue.SimpleQueue`` and nothing else
    (no engine: what two Python threads and their hand-offs cost on this host)."""

    def __init__(self, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss: Any, m: int) -> None:
        import copy

        half = len(model) // 2
        self.first, self.second = copy.deepcopy(model[:half]), copy.deepcopy(model[half:])
        self.xs, self.ys, self.loss, self.m = list(x.tensor_split(m)), list(y.tensor_split(m)), loss, m
        self.acts: "queue.SimpleQueue[torch.Tensor]" = queue.SimpleQueue()
        self.grads: "queue.SimpleQueue[torch.Tensor]" = queue.SimpleQueue()
        self.jobs: "queue.SimpleQueue[bool]" = queue.SimpleQueue()
        self.done: "queue.SimpleQueue[bool]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="bare-stage1", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.jobs.get():
            for i in range(self.m):  # the last stage: F i, B i
                inp = self.acts.get().requires_grad_()
                (self.loss(self.second(inp), self.ys[i]) / self.m).backward()
                self.grads.put(inp.grad)
            self.done.put(True)

    def run(self) -> None:
        for p in (*self.first.parameters(), *self.second.parameters()):
            p.grad = None
        self.jobs.put(True)
        outs = {}
        order = [("F", 0), ("F", 1)] + [a for i in range(self.m - 2) for a in (("B", i), ("F", i + 2))] \
            + [("B", self.m - 2), ("B", self.m - 1)]
        for kind, i in order:  # the first stage's 1F1B row (two stages)
            if kind == "F":
                outs[i] = self.first(self.xs[i])
                self.acts.put(outs[i].detach())
            else:
                torch.autograd.backward([outs.pop(i)], [self.grads.get()])
        self.done.get()

    def close(self) -> None:
        self.jobs.put(False)
        self.thread.join()


def measure(args: argparse.Namespace, run: Run) -> Dict[str, Any]:
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
    bare = BareThreads(model, x, y, loss, m)
    steps.append(baselines.Step("bare-2", bare.run, close=bare.close))
    try:
        check = baselines.check_grads(steps[:-1], "accum", "accum")  # nothing wrong is timed
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
    actions = {"pipeddp-1": 2 * m, "pipeddp-2": 4 * m, "torch-1": 2 * m, "bare-2": 4 * m}
    extra = {name: [(t - a) / n for t, a in zip(times[name], times["accum"])] for name, n in actions.items()}

    def ratio(a: str, b: Sequence[float]) -> float:
        return statistics.median(x / y for x, y in zip(extra[a], b))

    res = {"step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items() if k != "queue round trip"},
           "extra_per_action_us": {name: statistics.median(v) * 1e6 for name, v in extra.items()},
           "queue_round_trip_us": statistics.median(times["queue round trip"]) * 1e6,
           "one_stage_vs_torch": ratio("pipeddp-1", extra["torch-1"]),
           "two_stages_vs_round_trip": ratio("pipeddp-2", times["queue round trip"]),
           "bare_threads_vs_round_trip": ratio("bare-2", times["queue round trip"]),
           # the engine's own share on two threads: what it adds to the bare hand-offs, both in the same round
           "two_stages_over_bare_us": statistics.median(
               (a - b) / actions["bare-2"] for a, b in zip(times["pipeddp-2"], times["bare-2"])) * 1e6,
           "check": check, "times_s": times, "actions_per_step": actions}
    run.table(f"Extra time per action over accumulation (tiny MLP 4 x Linear(64,64)+ReLU, batch {args.batch}, "
              f"{m} micro-batches, medians of {args.rounds} rounds)", ["configuration", "step ms", "extra us / action"],
              [["accum", res["step_ms"]["accum"], None]]
              + [[k, res["step_ms"][k], v] for k, v in res["extra_per_action_us"].items()]
              + [["queue round trip (us)", None, res["queue_round_trip_us"]],
                 ["pipeddp-2 over bare-2 (us per action)", None, res["two_stages_over_bare_us"]]])
    res["targets"] = run.targets([
        ["pipeddp 1 stage / torch 1 stage, per action", res["one_stage_vs_torch"], "<= 0.50",
         res["one_stage_vs_torch"] <= 0.50],
        ["pipeddp 2 stages per action / a queue round trip", res["two_stages_vs_round_trip"], "<= 1.00",
         res["two_stages_vs_round_trip"] <= 1.00],
        ["the bare two threads per action / a queue round trip (the floor)", res["bare_threads_vs_round_trip"],
         "-"]])
    return res


class SlowDataset(torch.utils.data.Dataset):
    """``n`` random samples, each ready ``delay`` seconds after it is asked for; a batch is read in one request
    (``__getitems__``, which the loader calls, as from a shard on storage), so the reading thread wakes once per
    batch: woken per sample it would wait for the GIL each time while the stage threads dispatch."""

    def __init__(self, n: int, width: int, delay: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitems__(self, indices: List[int]) -> List[Any]:
        time.sleep(self.delay * len(indices))
        return [(self.x[i], self.y[i]) for i in indices]


def epoch(engine: Any, data: SlowDataset, batch: int, prefetch: int, steps: int) -> float:
    """Seconds per step fed by the loader in the steady state: the clock starts with the third batch in hand (nothing
    hides the wait for the first, and what prefetch banked meanwhile would flatter it), in both alike."""
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


def prefetch(args: argparse.Namespace, run: Run) -> Dict[str, Any]:
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
    res = {"compute_s": statistics.median(comp), "load_s": load_measured, "times_s": times,
           "step_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
           "speedup": median_ratio(slow, fast),  # per round: the compute of the same round is the yardstick
           "prefetch_over_max": median_ratio(fast, [max(load_measured, c) for c in comp]),
           "no_prefetch_over_sum": median_ratio(slow, [load_measured + c for c in comp])}
    run.table("the input path: loading about half of a step, HybridParallel 2 CPU stages (medians)",
              ["", "ms per step", "over max(load, compute)", "over load + compute"],
              [["compute alone", res["compute_s"] * 1e3, None, None], ["load alone", load_measured * 1e3, None, None],
               ["no prefetch", res["step_ms"]["no prefetch"], None, res["no_prefetch_over_sum"]],
               ["prefetch=2", res["step_ms"]["prefetch=2"], res["prefetch_over_max"], None]])
    targets = run.targets([
        ["step with prefetch / max(load, compute)", res["prefetch_over_max"], "<= 1.10",
         res["prefetch_over_max"] <= 1.10],
        ["step without prefetch / (load + compute)", res["no_prefetch_over_sum"], "~ 1.00"],
        ["speedup of prefetch (median of per-round ratios)", res["speedup"], "~ (L + C) / max(L, C)"]])
    return {"settings": {"threads_per_stage": 1}, "targets": targets, "result": res}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser(__doc__, "3 rounds of 2 calls (--prefetch: a smaller MLP, 4 rounds of 8 steps)", device=False)
    p.add_argument("--prefetch", action="store_true", help="the input path: prefetch=2 against loading on demand")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 40; 3 with --quick; --prefetch: "
                   "A/B rounds, default 8; 4 with --quick)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds before them")
    p.add_argument("--calls", type=int, default=None, help="steps per configuration per round (default 10)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=None, help="--prefetch: training steps per epoch of a round "
                   "(default 12; 8 with --quick)")
    p.add_argument("--load-share", type=float, default=0.5, help="--prefetch: loading's share of a step without it")
    args = p.parse_args(argv)
    args.rounds = args.rounds or ((4 if args.quick else 8) if args.prefetch else (3 if args.quick else 40))
    args.calls = args.calls or (2 if args.quick else 10)
    args.steps = args.steps or (8 if args.quick else 12)
    if not 0 < args.load_share < 1:
        p.error(f"--load-share must be between 0 and 1, got {args.load_share}")
    run = Run("prefetch" if args.prefetch else "overhead", args)
    run.finish(**(prefetch if args.prefetch else measure)(args, run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
