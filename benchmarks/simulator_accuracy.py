"""How well does ``pipeddp.simulate`` predict a training step on 2 CPU cores? Predict, then measure.

Configurations of the MLP, every schedule included, are predicted from calibration alone
(simulator_calibration.py; the contention of the two cores is fitted to real 2-stage pipeline steps that are not
among the configurations measured), then measured in interleaved rounds, each step right after a calibration
sample at its micro-batch size; targets: median |error| <= 10 %, worst <= 15 %. See benchmarks/README.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks import baselines, common
from benchmarks import simulator_calibration as cal
from benchmarks.baselines import Step
from benchmarks.common import Run, StepTime, at_least, fmt, log0, on_rank0
from benchmarks.simulator_calibration import BATCH, DDP_BUCKET, SPECS, WORK, Calib, Spec, compute_sample, predict
from pipeddp.partitioning.solve import solve

SCRIPT = "simulator_accuracy"


def build(spec: Spec, model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, balance: List[int]) -> Step:
    """The configuration as a baseline: accumulation (1x1), Pipeline (1x2), HybridParallel with 2 replicas of 1
    stage (2x1) or in stage mode (1x2-stage). 1-process configurations run on rank 0."""
    loss, name = WORK.loss_fn, spec.name
    if spec.procs == 1 and dist.get_rank() != 0:
        return baselines.idle(name)
    if spec.layout == "1x1":
        return baselines.accumulate(model, x, y, loss, spec.m, name=name)
    if spec.layout == "1x2":
        return baselines.pipeline(model, x, y, loss, chunks=spec.m, balance=balance, schedule=spec.schedule, name=name,
                                  virtual_stages=spec.virtual)
    if spec.layout == "2x1":
        return baselines.hybrid(model, x, y, loss, stages=1, chunks=spec.m, balance=[len(model)], name=name)
    return baselines.hybrid(model, x, y, loss, mode="stage", chunks=spec.m, balance=balance, schedule=spec.schedule,
                            name=name, virtual_stages=spec.virtual)


def prior(rank: int, model: torch.nn.Sequential, x: torch.Tensor, y: torch.Tensor, sizes: List[int], quick: bool,
          reps: int) -> Tuple[Calib, Dict[int, List[int]], Dict[int, Step]]:
    """Before anything of any configuration runs: links, compute samples, the cuts (``solve``'s optimal cut of the
    profiled costs per micro-batch size) and a sample per size with the contention fitted to a calibration pipeline:
    GPipe on that cut over 2 micro-batches of b (not a measured configuration: those take the whole batch)."""
    calib = Calib(p2p=cal.calibrate_p2p(rank, reps), allreduce=cal.calibrate_allreduce(max(3, reps // 4)),
                  engine_collectives=cal.calibrate_engine_collectives(reps),
                  thread_latency=cal.calibrate_threads(reps * 10) if rank == 0 else 0.0)
    log0(f"links: p2p {calib.p2p['latency_s'] * 1e6:.0f} us + {calib.p2p['bandwidth_Bps'] / 1e9:.2f} GB/s; "
         f"DDP bucket all-reduce {calib.allreduce['latency_s'] * 1e6:.0f} us/step + "
         f"{calib.allreduce['bandwidth_Bps'] / 1e9:.2f} GB/s; thread hand-off {calib.thread_latency * 1e6:.0f} us; "
         f"engine collectives {calib.engine_collectives * 1e3:.2f} ms")
    for _ in range(1 if quick else 2):
        for b in sizes:
            sample = compute_sample(rank, model, x, b, repeat=1 if quick else 2, loss_reps=reps)
            if rank == 0:
                calib.add(b, dict(sample, when="before"))
    balances = on_rank0(lambda: {b: solve(cal.layer_costs(calib, b), 2) for b in sizes})
    pipes = {}
    for b, balance in balances.items() if rank == 0 else ():
        pipes[b] = baselines.pipeline(model, x[:2 * b], y[:2 * b], WORK.loss_fn, chunks=2, balance=balance,
                                      schedule="gpipe", name=f"calibration mb={b}")
        pipes[b].run()  # warm-up
    for b in sizes:
        sample = compute_sample(rank, model, x, b, repeat=1, loss_reps=reps, pipeline=pipes.get(b))
        if rank == 0:
            calib.add(b, dict(sample, when="before, with a pipeline step"))
    return calib, balances, pipes


def rows_of(times: Dict[str, List[StepTime]], calib: Calib, balance: Any, before: Dict[str, Any],
            paired: Dict[str, List[Any]], grads: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per configuration (rank 0): the measurement and the final / a-priori / plain / paired predictions. A
    1-process step is timed to its own end, a 2-process one to the closing barrier."""
    rows = []
    for s in SPECS:
        n, t = s.name, [(st.wall if s.procs > 1 else st.own) for st in times[s.name]]
        meas = statistics.median(t)
        final, plain = predict(s, calib, balance(s)), predict(s, calib, balance(s), plain=True)
        per_round = [predict(s, calib.only(s.micro_batch, smp), balance(s))["step_s"] / ti - 1
                     for smp, ti in zip(paired[n], t)]
        rows.append({
            "name": n, "layout": s.layout, "schedule": s.schedule if s.stages > 1 else None, "m": s.m,
            "micro_batch": s.micro_batch, "balance": balance(s), "procs": s.procs, "check": grads.get(n),
            "measured_s": meas, "measured_all_s": t, "predicted_s": final["step_s"],
            "error": final["step_s"] / meas - 1,
            "prior_predicted_s": before[n]["step_s"], "prior_error": before[n]["step_s"] / meas - 1,
            "plain_predicted_s": plain["step_s"], "plain_error": plain["step_s"] / meas - 1,
            "paired_errors": per_round, "paired_error": statistics.median(per_round),
            "prediction": final, "prior_prediction": before[n]})
    return rows


def job(settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    rank = common.init_job(settings["timeout"])
    model, x, y = WORK.seeded(BATCH, settings["seed"])
    common.check_same(model, x, y)
    sizes = sorted({s.micro_batch for s in SPECS}, reverse=True)
    reps = 5 if settings["quick"] else 20
    t0 = time.perf_counter()
    calib, balance_of, pipes = prior(rank, model, x, y, sizes, settings["quick"], reps)
    cuts4 = on_rank0(lambda: {b: solve(cal.layer_costs(calib, b), 4) for b in sizes})

    def balance(spec: Spec) -> List[int]:
        if spec.cut == 4:
            return cuts4[spec.micro_batch]
        return balance_of[spec.micro_batch] if spec.cut == 2 else [len(model)]

    before: Dict[str, Any] = {}
    if rank == 0:
        before = {s.name: predict(s, calib, balance(s)) for s in SPECS}
        log0(f"contention by micro-batch {({b: round(calib.contention(b), 2) for b in sizes})}; a-priori predictions "
             "(ms): " + ", ".join(f"{k} {v['step_s'] * 1e3:.0f}" for k, v in before.items()))
    calib_s = time.perf_counter() - t0
    steps = [build(s, model, x, y, balance(s)) for s in SPECS]
    plain = baselines.whole(model, x, y, WORK.loss_fn)
    plain()  # the MLP has no BatchNorm: every split of the batch must give the plain model's gradients
    grads = baselines.check_grads(steps, lambda step: plain.grads(), "plain")
    for step in steps if not settings["quick"] else []:  # a second untimed step: warm-up
        common.barrier_timed(step.run)
    spec_of = {s.name: s for s in SPECS}
    paired: Dict[str, List[Optional[Dict[str, Any]]]] = {s.name: [] for s in SPECS}

    def before_step(name: str) -> None:  # a calibration sample at the step's micro-batch size, paired with it
        b = spec_of[name].micro_batch
        sample = compute_sample(rank, model, x, b, repeat=1, loss_reps=max(3, reps // 4), pipeline=pipes.get(b))
        if rank == 0:
            calib.add(b, dict(sample, when=f"round {len(paired[name])}"))
        paired[name].append(sample)

    times, _ = common.barrier_rounds({s.name: s.run for s in steps}, settings["rounds"], before=before_step)
    for step in steps + list(pipes.values()):
        step.close()
    dist.barrier()
    if rank != 0:
        return None
    return {"rows": rows_of(times, calib, balance, before, paired, grads), "sizes": sizes,
            "contention": {b: {"median": calib.contention(b), "samples": calib.pipeline_ratios(b)} for b in sizes},
            "layers": {b: {"solo": calib.layers(b), "loss_s": calib.loss(b), "samples": len(calib.samples[b])}
                       for b in sizes},
            "p2p": calib.p2p, "allreduce": calib.allreduce, "thread_latency_s": calib.thread_latency,
            "engine_collectives_s": calib.engine_collectives, "balances": balance_of, "rounds": settings["rounds"],
            "calibration_s": calib_s}


def report(res: Dict[str, Any], run: Run) -> Dict[str, Any]:
    """The per-configuration table, the accuracy summary against the targets, and the calibration line."""
    rows = res["rows"]
    run.table(f"simulator vs measurement: {WORK.model_text}, batch {BATCH}, 2 CPU cores (median of {res['rounds']} "
              "interleaved steps; mb = micro-batch size)",
              ["configuration", "mb", "cut", "contention", "bubble", "predicted ms", "measured ms", "error",
               "a-priori ms", "a-priori err", "plain ms", "plain err", "paired err"],
              [[r["name"], r["micro_batch"], "/".join(map(str, r["balance"])) if len(r["balance"]) > 1 else "-",
                f"x{r['prediction']['contention']:.2f}" if r["layout"] != "1x1" else "-",
                f"{r['prediction']['bubble']:.0%}", f"{r['predicted_s'] * 1e3:.0f}", f"{r['measured_s'] * 1e3:.0f}",
                fmt(r["error"], "+.1%"), f"{r['prior_predicted_s'] * 1e3:.0f}", fmt(r["prior_error"], "+.1%"),
                f"{r['plain_predicted_s'] * 1e3:.0f}", fmt(r["plain_error"], "+.1%"), fmt(r["paired_error"], "+.1%")]
               for r in rows],
              caption="predicted: calibration from the same rounds as the measurements; a-priori: from before "
                      "them; plain: no contention, buckets, shared-core all-reduce, hand-off latency or engine "
                      "collectives; paired: from the sample right before each step")
    summary = {}
    for key in ("error", "prior_error", "plain_error", "paired_error"):
        errs = [abs(r[key]) for r in rows]
        summary[key] = {"median_abs": statistics.median(errs), "worst_abs": max(errs),
                        "worst": max(rows, key=lambda r, key=key: abs(r[key]))["name"],
                        "met": statistics.median(errs) <= 0.10 and max(errs) <= 0.15}
    labels = {"error": "final (judged)", "prior_error": "a-priori", "paired_error": "paired by round",
              "plain_error": "plain simulator"}
    run.table("accuracy against the targets (median |error| <= 10 %, worst <= 15 %)",
              ["prediction", "median |error|", "worst |error|", "worst configuration", "targets"],
              [[labels[k], f"{v['median_abs']:.1%}", f"{v['worst_abs']:.1%}", v["worst"], ("NOT met", "met")[v["met"]]]
               for k, v in summary.items()])
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = common.parser(__doc__, "1 round, light calibration", spawns=True, device=False)  # CPU steps, CPU calibration
    p.add_argument("--rounds", type=at_least(1), default=None, help=f"measurement rounds (default "
                   f"{WORK.rounds[SCRIPT]}; 1 with --quick)")
    args = p.parse_args(argv)
    args.rounds = args.rounds if args.rounds is not None else 1 if args.quick else WORK.rounds[SCRIPT]
    run = Run(SCRIPT, args, common.BARRIER)
    res = pipeddp.spawn(job, 2, args=(vars(args),), timeout=args.timeout, threads=1)[0]
    summary = report(res, run)
    run.finish({"model": WORK.model_text, "batch": BATCH, "threads": 1, "ddp_bucket_bytes": DDP_BUCKET,
                "specs": [s.name for s in SPECS]}, summary=summary, **res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
