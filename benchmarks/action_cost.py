"""Where the engine's cost per action goes: a ladder from the plain model up to the public call, and its pieces.

An action is one forward or one backward of one micro-batch on one stage. On a model too small to hide it (4 x
(Linear(64, 64) + ReLU), batch 64 in 8 micro-batches, as ``overhead.py``), each rung of the ladder adds one layer of
the engine to the one below, all interleaved round by round, so the difference between neighbours is what that
layer costs per action::

    raw      the plain model, micro-batch by micro-batch (each loss weighted), .grad set to None first
    stage    Stage.forward / Stage.backward called directly (leaves, saved state, weighted loss, seeded draws)
    actions  run_actions over the schedule's row (schedule bookkeeping, dispatch, the results)
    step     Step.train (split, the step's spec and seed, the plan, before/after hooks)
    engine   Pipeline.train_step (argument checks, the step's figures, zero_grad)

The pieces that each action enters are then timed alone, a call at a time, against an empty call: what each
one costs on this host, whatever the compute around it; and a training step's own time on the caller's
thread, before its runner starts and after it returns, with one stage and with two. Two stages on threads and two
processes are measured by ``overhead.py`` and ``schedules.py --models tiny`` (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks.common import Run, interleaved, parser
from pipeddp.runtime.amp import Autocast
from pipeddp.runtime.channels import Inbox, LocalChannel
from pipeddp.runtime.counted import parameters_of
from pipeddp.runtime.executor import run_actions
from pipeddp.runtime.spec import StepSpec
from pipeddp.runtime.stage import Stage
from pipeddp.runtime.trace import Trace, timed
from pipeddp.tools.models import mlp

RUNGS = ("raw", "stage", "actions", "step", "engine")


def ladder(args: argparse.Namespace) -> Dict[str, Any]:
    """Seconds per step of every rung, interleaved; and per action, what each adds to the one below."""
    torch.manual_seed(args.seed)
    model = mlp(4, 64, 64, 64)
    x, y = torch.randn(args.batch, 64), torch.randn(args.batch, 64)
    loss, m = nn.functional.mse_loss, args.chunks
    pipe = pipeddp.Pipeline(model, ["cpu"], chunks=m, threads=1)
    step = pipe._step  # noqa: SLF001 - the rungs below the public call are what is measured
    st, dev = step.stages[0], step.runner.devices[0]  # type: ignore[attr-defined]
    rows, _ = step._plan("train", m)  # noqa: SLF001
    sizes = step.sizes(args.batch)
    xs, ys = list(x.split(sizes)), list(y.split(sizes))
    weights = [k / args.batch for k in sizes]
    params = list(model.parameters())

    def cleared() -> None:
        for p in params:
            p.grad = None

    def spec() -> StepSpec:
        return StepSpec(grad=True, **step._read(loss), loss_fn=loss, targets=ys, weights=weights,  # noqa: SLF001
                        autocast=Autocast.capture())

    def raw() -> None:
        cleared()
        for xi, yi, w in zip(xs, ys, weights):
            (loss(model(xi), yi) * w).backward()

    def stage() -> None:
        cleared()
        s = spec()
        for i in range(m):
            st.forward(i, xs[i], s)
            st.backward(i, None, s)

    def actions() -> None:
        cleared()
        run_actions(dev, rows[0], spec(), links={}, inputs=xs)

    def train() -> None:
        cleared()
        step.train(x, y, loss, args.batch)

    def engine() -> None:
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, y, loss)

    fns: Dict[str, Callable[[], Any]] = dict(zip(RUNGS, (raw, stage, actions, train, engine)))

    def block(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(args.calls):
                fn()
        return run

    times = interleaved({k: block(f) for k, f in fns.items()}, args.rounds, args.warmup)
    pipe.close()
    n = 2 * m * args.calls  # actions per timed call
    added = {RUNGS[k]: statistics.median((a - b) / n for a, b in zip(times[RUNGS[k]], times[RUNGS[k - 1]])) * 1e6
             for k in range(1, len(RUNGS))}
    total = statistics.median((a - b) / n for a, b in zip(times["engine"], times["raw"])) * 1e6
    return {"step_us": {k: statistics.median(v) / args.calls * 1e6 for k, v in times.items()},
            "added_per_action_us": added, "engine_over_raw_per_action_us": total, "times_s": times}


def _per_call(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Microseconds per call of ``fn``, the median of ``repeats`` runs of ``calls`` calls."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out) * 1e6


def pieces(args: argparse.Namespace) -> Dict[str, float]:
    """What each piece an action enters costs alone (us per call, an empty call's cost taken off)."""
    torch.manual_seed(args.seed)
    pipe = pipeddp.Pipeline(mlp(4, 64, 64, 64), ["cpu"], chunks=args.chunks, threads=1)
    step = pipe._step  # noqa: SLF001
    st = step.stages[0]
    mid = Stage(1, nn.Sequential(nn.Linear(64, 64)), torch.device("cpu"), last=False)  # one that receives its input
    s = StepSpec(grad=True, seed=3, autocast=Autocast.capture())  # seeded, as a stage that may draw is
    t = torch.randn(8, 64)
    inbox = Inbox(0)
    chan = LocalChannel(st.streams, st.streams, inbox, inbox, 60.0)
    trace = Trace()
    clock = step.stats.clock
    assert clock is not None
    clock.inner = None

    def enter(make: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            with make():
                pass
        return run

    def seeded() -> Any:
        return st._seeded(s, 3)  # noqa: SLF001

    def send_recv() -> None:
        chan.send("F", 1, 0, t)
        chan.recv("F", 1, 0)

    calls = {
        "empty call": lambda: None,
        "seeded-random context (a CPU stage's own generator; a stage that may draw)": enter(seeded),
        "the stage's layers read (may they draw, what calls them: Stage.read_step, once a step)":
            lambda: st.read_step(nn.functional.mse_loss),
        "stage's training flags (Stage._mode)": st._mode,  # noqa: SLF001
        "backward's generator guard": enter(lambda: st.replay.backward_guard(st._mode())),  # noqa: SLF001
        "autocast context (none on)": enter(s.autocast),
        "stream context (CPU)": enter(st.streams.computing),
        "untraced span (timed(None))": enter(lambda: timed(None, 0, "F", 0)),
        "the step's clock, per span (a timing step)": enter(lambda: clock.span(0, "F", 0, row=0)),
        "a user's trace, per span": enter(lambda: trace.span(0, "F", 0, row=0)),
        "local channel: send + recv of one message (one thread)": send_recv,
        "a received activation made a leaf (Stage._leaves: requires_grad)":
            lambda: mid._leaves(t.requires_grad_(False), s),  # noqa: SLF001
        "StepSpec built": lambda: StepSpec(grad=True),
        "the caller's autocast captured": Autocast.capture,
        "a base seed drawn (per step)": pipeddp.runtime.rng.draw_base_seed,
        "the parameters listed at a step's start (parameters_of)": lambda: parameters_of([st.module]),
        "the same through Module.parameters()": lambda: list(st.module.parameters()),
        "an inbox emptied at a step's start (Inbox.reset)": inbox.reset,
    }
    got = {k: _per_call(f, args.piece_calls, args.piece_repeats) for k, f in calls.items()}
    pipe.close()
    base = got.pop("empty call")
    return {k: max(v - base, 0.0) for k, v in got.items()}


def outside(args: argparse.Namespace) -> Dict[str, Dict[str, float]]:
    """A training step's own time on the caller's thread: ``Pipeline.train_step`` before its runner starts and after
    it returns (us, medians over steps), with one stage and with two on threads; what the step costs beside its
    actions, timed inside real steps (its Python runs slower there than alone: the compute has evicted it)."""
    out: Dict[str, Dict[str, float]] = {}
    x, y = torch.randn(args.batch, 64), torch.randn(args.batch, 64)
    for stages in (1, 2):
        torch.manual_seed(args.seed)
        pipe = pipeddp.Pipeline(mlp(4, 64, 64, 64), ["cpu"] * stages, chunks=args.chunks, threads=1,
                                **({"balance": [4, 4]} if stages == 2 else {}))
        runner = pipe._step.runner  # noqa: SLF001 - what is timed is the step around it
        inner = runner.run
        marks: List[Any] = []

        def run(*a: Any, inner: Any = inner, marks: List[Any] = marks, **k: Any) -> Any:
            t0 = time.perf_counter()
            res = inner(*a, **k)
            marks.append((t0, time.perf_counter()))
            return res

        runner.run = run  # type: ignore[method-assign]
        before, after = [], []
        for k in range(args.outside_steps + 50):
            pipe.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            pipe.train_step(x, y, nn.functional.mse_loss)
            t1 = time.perf_counter()
            if k >= 50:
                before.append(marks[-1][0] - t0)
                after.append(t1 - marks[-1][1])
        pipe.close()
        out[f"{stages} stage{'s' if stages > 1 else ''}"] = {"before_runner_us": statistics.median(before) * 1e6,
                                                             "after_runner_us": statistics.median(after) * 1e6}
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser(__doc__, "3 rounds of 2 calls, the pieces 2000 calls each", device=False)
    p.add_argument("--rounds", type=int, default=None, help="timed rounds of the ladder (default 40; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds before them")
    p.add_argument("--calls", type=int, default=None, help="steps per rung per round (default 10; 2 with --quick)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per step")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.quick else 40)
    args.calls = args.calls or (2 if args.quick else 10)
    args.piece_calls, args.piece_repeats = (2000, 3) if args.quick else (20000, 9)
    args.outside_steps = 100 if args.quick else 1200
    torch.set_num_threads(1)
    run = Run("action_cost", args)
    res: Dict[str, Any] = {"ladder": ladder(args), "pieces_us": pieces(args), "outside_runner": outside(args)}
    lad = res["ladder"]
    rows: List[List[Any]] = [["raw (the plain model)", lad["step_us"]["raw"], None]]
    rows += [[k, lad["step_us"][k], v] for k, v in lad["added_per_action_us"].items()]
    rows += [["engine over raw", None, lad["engine_over_raw_per_action_us"]]]
    run.table(f"The ladder: what each layer adds per action (4 x Linear(64)+ReLU, batch {args.batch}, {args.chunks} "
              f"micro-batches, 1 stage, medians of {args.rounds} rounds)", ["rung", "us per step", "added us / action"],
              rows)
    run.table("The pieces, each alone (us per call, an empty call's cost taken off)", ["piece", "us"],
              [[k, v] for k, v in res["pieces_us"].items()])
    run.table("A training step's own time on the caller's thread (us, medians)", ["", "before its runner",
              "after it"], [[k, v["before_runner_us"], v["after_runner_us"]] for k, v in res["outside_runner"].items()])
    run.finish(**res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
