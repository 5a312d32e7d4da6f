"""pipeddp's schedules against each other, accumulation and torch.distributed.pipelining, on 2 CPU processes.

One spawned 2-process gloo job (mode="stage", 1 intra-op thread each) times per model and m, round by round between
barriers, the order reversed every other round, every gradient first checked against accumulation: ``accum`` (the
plain model over the same m micro-batches); pipeddp's ``gpipe``, ``1f1b``, ``zb``, ``auto`` on its 2-stage cut,
``interleaved``, ``zb-v2``, ``auto-v2`` with 2 virtual stages on its 4-stage cut, ``zbv``, ``auto-v`` on that cut in
the V (``placement="v"``), and ``auto-layout``, ``auto`` with ``virtual_stages="auto"`` and ``placement="auto"`` on
the engine's own profile (its choice printed); torch's ScheduleGPipe and Schedule1F1B on the 2-stage cut,
ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble on the 4-stage cut (placed as pipeddp places them) and
ScheduleZBVZeroBubble on it in its V; ``1f1b`` and ``interleaved`` in replica mode (``--torch-cut equal``: torch's
stages at equal layers per stage instead, pipeddp keeping its measured cut).
Then one traced step of each pipeddp configuration: its bubble beside the schedule's with equal stages, replayed
with the step's measured action times, and the best order ``auto``'s builder finds for those times with any memory,
and for ``auto`` how its trial went; and one step of each pair with torch split by category (``baselines.COLUMNS``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks import baselines, common
from benchmarks.common import BARRIER, LossFn, Run, at_least, barrier_rounds, barrier_timed, gather, log0, median_ratio
from benchmarks.workloads import WORKLOADS, add_round_flags, names
from pipeddp.runtime.refine import Refiner, action_samples, quickest
from pipeddp.runtime.schedule import get_schedule, play
from pipeddp.runtime.schedule.costed import Costs, build, fixed_schedules
from pipeddp.tools.simulate import StageCost, simulate
from pipeddp.tools.timeline import WORK, measured_bubble

SCRIPT = "schedules"
DEVICES = 2
#: pipeddp configurations in stage mode: name -> (schedule, virtual stages, placement); ``auto-layout`` leaves
#: both to the engine's own profile (``virtual_stages="auto"``, ``placement="auto"``: its own cut, measured on rank 0)
PIPEDDP: Dict[str, Tuple[str, Union[int, str], str]] = {
    "gpipe": ("gpipe", 1, "loop"), "1f1b": ("1f1b", 1, "loop"), "zb": ("zb", 1, "loop"),
    "interleaved": ("interleaved", 2, "loop"), "zb-v2": ("zb", 2, "loop"), "zbv": ("zb", 2, "v"),
    "auto": ("auto", 1, "loop"), "auto-v2": ("auto", 2, "loop"), "auto-v": ("auto", 2, "v"),
    "auto-layout": ("auto", "auto", "auto")}
#: the ``auto`` configurations, each the best order for its virtual stages and placement
AUTOS = ("auto", "auto-v2", "auto-v", "auto-layout")
#: torch configurations: name -> (pipeddp's name for the schedule, stages per rank)
TORCH = {"torch-gpipe": ("gpipe", 1), "torch-1f1b": ("1f1b", 1), "torch-interleaved": ("interleaved", 2),
         "torch-zb-v2": ("zb", 2), "torch-zbv": ("zbv", 2)}
#: replica-mode twins of stage-mode configurations
REPLICA = {"1f1b-replica": ("1f1b", 1, "loop"), "interleaved-replica": ("interleaved", 2, "loop")}
#: (pipeddp, torch) pairs on the same cut and schedule
SAME = [("gpipe", "torch-gpipe"), ("1f1b", "torch-1f1b"), ("interleaved", "torch-interleaved"),
        ("zb-v2", "torch-zb-v2"), ("zbv", "torch-zbv")]


def cuts(rank: int, model: nn.Sequential, x: torch.Tensor, m: int) -> Dict[int, List[int]]:
    """pipeddp's cuts into 2 and 4 stages, profiled on rank 0 at micro-batch size and sent to rank 1."""
    return common.on_rank0(lambda: {n: list(pipeddp.partition(model, n, method="time", sample=x, chunks=m).balance)
                                    for n in (DEVICES, 2 * DEVICES)})


def equal_layers(n_layers: int, stages: int) -> List[int]:
    """As many layers in every stage as can be (the first ones one more): the cut of splitting by layer count."""
    return [n_layers // stages + (1 if k < n_layers % stages else 0) for k in range(stages)]


def steps_at(rank: int, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int, loss_fn: LossFn,
             balance: Dict[int, List[int]], torch_balance: Dict[int, List[int]],
             torch_timeout: float) -> Tuple[List[baselines.Step], Dict[str, str]]:
    steps = [baselines.accumulate(model, x, y, loss_fn, m) if rank == 0 else baselines.idle("accum")]
    for name, (schedule, v, placement) in PIPEDDP.items():
        cut = {"balance": "time", "sample": x} if isinstance(v, str) else {"balance": balance[DEVICES * v]}
        steps.append(baselines.hybrid(model, x, y, loss_fn, stages=DEVICES, mode="stage", chunks=m, name=name,
                                      schedule=schedule, virtual_stages=v, placement=placement, **cut))
    for name, (schedule, v, placement) in REPLICA.items():
        steps.append(baselines.pipeline(model, x, y, loss_fn, stages=DEVICES, chunks=m, name=name, schedule=schedule,
                                        virtual_stages=v, balance=balance[DEVICES * v], placement=placement)
                     if rank == 0
                     else baselines.idle(name))
    failed: Dict[str, str] = {}
    for name, (schedule, v) in TORCH.items():
        step, err = baselines.guarded_torch(model, x, y, loss_fn, torch_timeout, name=name, chunks=m,
                                            balance=torch_balance[DEVICES * v], schedule=schedule)
        if step is None:
            failed[name] = err
            log0(f"    {name}: failed ({err.splitlines()[0][:200]})")
        else:
            steps.append(step)
    return steps, failed


def best_order(spans: Sequence[Any], m: int, v: int, placement: str) -> Optional[float]:
    """The bubble of the best order ``auto``'s builder finds for this step's measured F, I and W times with no cap on
    activations: what reordering alone could reach on this cut (None where the step ran whole backwards)."""
    samples = action_samples(spans)
    if not any(k == "W" for _, k in samples):
        return None
    costs = Costs.unit(DEVICES * v).measured(samples)
    return play(build(DEVICES, m, v, costs, max_activations=m * v, placement=placement),
                lambda row, a: costs.of(a.kind, a.stage)).bubble


def refiner_of(step: baselines.Step) -> Optional[Refiner]:
    """The ``auto`` engine's refiner (None for a fixed schedule, or where this rank sits the step out)."""
    if step.run is None or step.module is None:
        return None
    return next((h for h in step.module._step.after_backward if isinstance(h, Refiner)), None)


def trial_left(steps: Sequence[baselines.Step]) -> int:
    """The most steps any ``auto`` engine's trial still runs, on any rank (the same number on every rank)."""
    left = [len(r.trial) + (r.running is not None) for r in map(refiner_of, steps) if r is not None]
    most = torch.tensor([max(left, default=0)])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def trial_of(step: baselines.Step) -> Dict[str, Any]:
    """For ``auto``: how its trial went on this rank (the candidate kept, the timed steps each ran, and each one's
    quickest step in ms; the fixed schedules are the last candidates); nothing for a fixed schedule."""
    r = refiner_of(step)
    if r is None:
        return {}
    key = r.auto.last
    names = [] if key is None else names_of(r.auto.close(key), *key, r.auto.placement)
    return {"trial": {"chosen": r.chosen, "samples": r.samples, "candidates": names,
                      "quickest_ms": {k: quickest([v]) * 1e3 for k, v in r.times.items()}}}


def names_of(plans: Sequence[Any], p: int, m: int, v: int, placement: str = "loop") -> List[str]:
    """Which of auto's fixed schedules (``costed.fixed_schedules``: 1F1B and zero-bubble, or their interleaved
    forms) each of ``plans`` is, else ``"own"`` (an order of auto's own)."""
    suffix = "" if placement == "loop" else " in the V"
    names = ["1f1b", "zb"] if v == 1 else [f"interleaved{suffix}", f"zb-v{v}{suffix}"]
    fixed = list(zip(names, fixed_schedules(p, m, v, placement)))
    return [next((name for name, base in fixed if base == plan), "own") for plan in plans]


def traced_bubbles(steps: Sequence[baselines.Step], rank: int) -> Dict[str, Dict[str, Any]]:
    """One traced step per pipeddp configuration: its bubbles (see the module docstring; rank 0's result)."""
    out: Dict[str, Dict[str, Any]] = {}
    for step in steps:
        base = step.name.replace("-replica", "")
        if base not in PIPEDDP:
            continue
        run = step.run
        # every rank meets in the barriers, also the one that sits a single-process configuration out
        _, spans = barrier_timed(None if run is None else (lambda s=step, r=run: baselines.record(s.module, r, rank)))
        parts = gather(spans or [])
        if parts is None:
            continue
        every = [s for p in parts for s in p]
        bubble, makespan = measured_bubble(every)
        schedule = PIPEDDP[base][0]
        v, placement = step.module.virtual_stages, step.module.placement  # as built ("auto": as chosen)
        m = max(s.mb for s in every if s.kind in WORK) + 1
        plan = get_schedule(step.module._step.schedule, DEVICES, m, v,  # "auto": the engine's own order
                            placement=placement)
        work = {(s.stage, s.kind, s.mb): s.duration for s in every if s.kind in WORK}
        replayed = play(plan, lambda row, a, w=work: w.get((a.stage, a.kind.value, a.mb), 0.0))
        equal = simulate([StageCost(1.0, 2.0)] * (DEVICES * v), schedule, stages=DEVICES, chunks=m, virtual_stages=v,
                         placement=placement)
        out[step.name] = {"measured_bubble": bubble, "traced_ms": makespan * 1e3, "equal_stages_bubble": equal.bubble,
                          "replayed_bubble": replayed.bubble, "best_order_bubble": best_order(every, m, v, placement),
                          "layout": {"virtual_stages": v, "placement": placement, "balance": list(step.module.balance)},
                          **trial_of(step)}
    return out


def breakdown(steps: Sequence[baselines.Step]) -> Dict[str, Dict[str, float]]:
    """One step of each same-cut pair by ``baselines.COLUMNS`` category (ms, both processes summed; torch's W under
    B, its batched sends and receives under post), and the rest: Python between actions, idle outside a wait."""
    out: Dict[str, Dict[str, float]] = {}
    for step in (s for s in steps if s.name in {n for pair in SAME for n in pair} and s.traced is not None):
        wall, parts = barrier_timed(lambda step=step: step.traced(step.run))
        every = [v for part in (gather(parts) or []) for v in part.values()]
        if every:
            got = {k: sum(v.get(k, 0.0) for v in every) for k in baselines.COLUMNS}
            out[step.name] = dict(got, wall_ms=wall.wall * 1e3, other_ms=DEVICES * wall.wall * 1e3 - sum(got.values()))
    return out


def consecutive(run: Callable[[], Any], n: int) -> Callable[[], Any]:
    """``run`` called ``n`` times in a row (one timed reading): a step that leaves its peer waiting, or starts
    before its peer has finished the step before, pays for it here as in a training loop, which a barrier around
    every step would hide."""
    def block() -> Any:
        for _ in range(n - 1):
            run()
        return run()
    return block


def run_m(rank: int, model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, m: int, loss_fn: LossFn,
          opts: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    balance = cuts(rank, model, x, m)
    log0(f"  m={m}: cuts {balance[DEVICES]} (2 stages), {balance[2 * DEVICES]} (4 stages)")
    torch_balance = balance if opts["torch_cut"] == "same" else {n: equal_layers(len(model), n) for n in balance}
    if opts["torch_cut"] == "equal":
        log0(f"  m={m}: torch at equal layers per stage: {torch_balance[DEVICES]}, {torch_balance[2 * DEVICES]}")
    steps, failed = steps_at(rank, model, x, y, m, loss_fn, balance, torch_balance, opts["group_timeout"])
    checked = baselines.check_grads(steps, "accum", "accum")
    runs = {s.name: s.run for s in steps}
    barrier_rounds(runs, 0, opts["warmup"])
    # auto settles its order in its first steps: two to refine the costs, then each candidate (the close orders and
    # the two fixed ones) 2 to 24 times on whole steps (more where steps are short): untimed until every trial is over
    autos = {n: r for n, r in runs.items() if n.startswith("auto")}
    barrier_rounds(autos, 0, 2)
    barrier_rounds(autos, 0, trial_left([s for s in steps if s.name in autos]))
    # every other round reversed: each pair alternates which runs first; each reading a block of consecutive steps
    blocks = {n: None if r is None else consecutive(r, opts["block"]) for n, r in runs.items()}
    rounds = [barrier_rounds(dict(reversed(blocks.items())) if r % 2 else blocks, 1)[0] for r in range(opts["rounds"])]
    bubbles = traced_bubbles(steps, rank)
    spent = breakdown(steps)
    for s in steps:
        s.close()
    dist.barrier()
    if rank != 0:
        return None
    walls = {k: [t.wall / opts["block"] for got in rounds for t in got[k]] for k in runs}
    return {"m": m, "balance": balance, "torch_cut": opts["torch_cut"], "torch_balance": torch_balance,
            "check": checked, "torch_failed": failed, "times_s": walls,
            "vs_accum": {name: median_ratio(walls["accum"], walls[name]) for name in walls if name != "accum"},
            "vs_torch": {a: median_ratio(walls[b], walls[a]) for a, b in SAME if b in walls},
            "vs_own_1f1b": {a: median_ratio(walls["1f1b"], walls[a]) for a in PIPEDDP if a != "1f1b"},
            "auto_vs_fastest_torch": {a: median_ratio(walls[fastest], walls[a]) for a in AUTOS
                                      for fastest in [min((t for t in TORCH if t in walls),
                                                          key=lambda t: statistics.median(walls[t]))]},
            "stage_vs_replica": {a: median_ratio(walls[a + "-replica"], walls[a]) for a in ("1f1b", "interleaved")},
            "bubbles": bubbles, "breakdown": spent}


def job(settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    rank = common.init_job(settings["timeout"], settings["device"])
    out: Dict[str, Any] = {}
    for name in settings["models"]:
        work = WORKLOADS[name]
        model, x, y = work.seeded(settings["batch"][name], settings["seed"])
        common.check_same(model, x, y)
        rounds = settings["rounds"] or (1 if settings["quick"] else work.rounds[SCRIPT])
        block = settings["block"] or work.block.get(SCRIPT, 1)
        log0(f"{name}: {work.describe(x.shape[0])}; {rounds} rounds of {block} consecutive step(s) per configuration")
        t0 = time.perf_counter()
        rows = [run_m(rank, model, x, y, m, work.loss_fn, {**settings, "rounds": rounds, "block": block})
                for m in settings["ms"]]
        if rank == 0:
            out[name] = {"workload": work.describe(x.shape[0]), "rounds": rounds, "block": block,
                         "elapsed_s": time.perf_counter() - t0, "by_m": rows}
    dist.barrier()
    return out if rank == 0 else None


def worst(rows: Sequence[Dict[str, Any]], key: str, names: Sequence[str]) -> float:
    """The smallest of the ratios ``names`` under ``key`` over every m."""
    return min(r[key][a] for r in rows for a in names if a in r[key])


def report(res: Dict[str, Any], run: Run) -> Dict[str, Any]:
    targets: Dict[str, Any] = {}
    for name, doc in res.items():
        rows = doc["by_m"]
        cut = "the same cut" if rows[0]["torch_cut"] == "same" else "equal layers per stage (torch)"
        names = [*PIPEDDP, *REPLICA]
        run.table(f"{doc['workload']}: speedup over accumulation (medians of per-round ratios)",
                  ["m"] + names + [t for t in TORCH], [[r["m"]] + [r["vs_accum"].get(n) for n in names]
                                                      + [r["vs_accum"].get(t) for t in TORCH] for r in rows])
        run.table(f"{name}: pipeddp over torch at {cut}, same schedule, and over its own 1F1B", ["m"]
                  + [f"{a} / {b}" for a, b in SAME] + [f"{a} / 1f1b" for a in rows[0]["vs_own_1f1b"]]
                  + ["stage / replica 1f1b", "stage / replica interleaved"],
                  [[r["m"]] + [r["vs_torch"].get(a) for a, _ in SAME] + list(r["vs_own_1f1b"].values())
                   + [r["stage_vs_replica"]["1f1b"], r["stage_vs_replica"]["interleaved"]] for r in rows])
        run.table(f"{name}: one step's time by category, both processes summed (ms; other: Python between actions, "
                  "idle outside a wait)", ["m / config", "wall", "F", "B (or I + W)", "wait", "post", "agree", "other"],
                  [[f"{r['m']} / {k}"] + [v[c] for c in ["wall_ms", *baselines.COLUMNS, "other_ms"]]
                   for r in rows for k, v in r["breakdown"].items()])
        run.table(f"{name}: bubble (idle share of the devices' time) of one traced step",
                  ["m / schedule", "measured", "replayed (measured actions)", "equal stages (F=1, B=2)",
                   "best order (measured actions)"],
                  [[f"{r['m']} / {k}", v["measured_bubble"], v["replayed_bubble"], v["equal_stages_bubble"],
                    v["best_order_bubble"]]
                   for r in rows for k, v in r["bubbles"].items()])
        best_auto = min(max(r["auto_vs_fastest_torch"][a] for a in AUTOS) for r in rows)
        goals = [["interleaved / zb-v2 vs torch's counterpart, worst m",
                  worst(rows, "vs_torch", ("interleaved", "zb-v2")), 1.00],
                 ["stage mode vs replica mode, worst", worst(rows, "stage_vs_replica", ("1f1b", "interleaved")), 0.95],
                 [f"1f1b and interleaved vs torch's, {cut}, same schedule, worst m",
                  worst(rows, "vs_torch", ("1f1b", "interleaved")), 1.02],
                 [f"auto (best of v=1, v=2, the V, the profile's layout) vs torch's fastest schedule at {cut}, worst m",
                  best_auto, 1.15 if name == "lm" else 1.10],
                 [f"auto-layout (the profile's v and placement) vs torch's fastest schedule at {cut}, worst m",
                  min(r["auto_vs_fastest_torch"]["auto-layout"] for r in rows), 1.15 if name == "lm" else 1.00]]
        rows4 = [r for r in rows if r["m"] == 4]
        if rows4:
            goals.append(["interleaved or zero-bubble vs pipeddp's 1F1B at m=4",
                          max(rows4[0]["vs_own_1f1b"][a] for a in ("zb", "interleaved", "zb-v2")), 1.08])
        checks = [[text, got, f">= {goal:.2f}", got >= goal] for text, got, goal in goals]
        b8 = next((r["bubbles"] for r in rows if r["m"] == 8), {})
        if "auto" in b8 and "1f1b" in b8:
            one, autos = b8["1f1b"]["measured_bubble"], [b8[a] for a in AUTOS]
            got = min(b["measured_bubble"] for b in autos)
            checks.append(["auto's (best of its configurations) measured bubble / pipeddp 1F1B's at m=8", got / one,
                           "<= 0.50", got <= one / 2])
            split = [b["best_order_bubble"] for b in autos if b["best_order_bubble"] is not None]
            if split:  # auto may run whole backwards (1F1B's order won on its steps): no W to reorder then
                checks.append(["best order for auto's measured actions (any memory) / 1F1B's bubble at m=8",
                               min(split) / one, "(what reordering can reach)"])
        for r in rows:
            log0(f"  m={r['m']}: torch failed: {r['torch_failed'] or 'none'}")
            chosen = r["bubbles"].get("auto-layout", {}).get("layout")
            if chosen:
                log0(f"  m={r['m']}: auto-layout chose virtual_stages={chosen['virtual_stages']}, placement="
                     f"{chosen['placement']!r}, balance {chosen['balance']}")
            for a in AUTOS:
                trial = r["bubbles"].get(a, {}).get("trial")
                if trial and trial["quickest_ms"]:
                    quickest_ms = ", ".join(f"{k}: {t:.1f}" for k, t in sorted(trial["quickest_ms"].items()))
                    log0(f"  m={r['m']}: {a} kept candidate {trial['chosen']} of {trial['candidates']} "
                         f"({trial['samples']} timed steps each, quickest step ms: {quickest_ms})")
        targets[name] = run.targets(checks, f"{name}: against the targets")
    return targets


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = common.parser(__doc__, "mlp, m = 4, 1 round", "results/schedules.json", spawns=True)
    p.add_argument("--models", nargs="+", default=None, choices=names(SCRIPT), help="default: all")
    p.add_argument("--ms", nargs="+", type=int, default=None, help="micro-batch counts (default 2 4 8)")
    add_round_flags(p, SCRIPT, warmup=False)
    p.add_argument("--warmup", type=at_least(0), default=1, help="untimed rounds before them (0 with --quick)")
    p.add_argument("--block", type=at_least(1), default=None,
                   help="consecutive steps per timed reading; default per model: " + ", ".join(
                       f"{k} {WORKLOADS[k].block.get(SCRIPT, 1)}" for k in names(SCRIPT)))
    p.add_argument("--group-timeout", type=float, default=120.0, help="seconds a torch pipelining rank awaits its peer")
    p.add_argument("--torch-cut", choices=["same", "equal"], default="same",
                   help="torch's stages: pipeddp's measured cut, or equal layers per stage (as splitting a model by "
                   "its layer count gives); pipeddp keeps its own")
    args = p.parse_args(argv)
    args.models = args.models or (["mlp"] if args.quick else names(SCRIPT))
    args.ms = args.ms or ([4] if args.quick else [2, 4, 8])
    args.batch = {k: 32 if args.quick and k == "mlp" else WORKLOADS[k].batch[SCRIPT] for k in names(SCRIPT)}
    if any(m < DEVICES or args.batch[k] % m for m in args.ms for k in args.models):
        p.error(f"every m must be >= {DEVICES} and divide the batch {args.batch} (torch's schedules need equal "
                "micro-batches)")
    if args.quick:
        args.warmup = 0
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    run = Run(SCRIPT, args, BARRIER)
    res = pipeddp.spawn(job, DEVICES, args=(vars(args),), timeout=args.timeout, threads=1)[0]
    targets = report(res, run)
    run.finish({"devices": DEVICES, "threads_per_process": 1}, targets=targets, models=res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
