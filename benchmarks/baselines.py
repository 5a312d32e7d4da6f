"""What the benchmarks time: every configuration, each a ``Step``, of a model of the registry (``workloads.py``).

A step
zeroes the gradients, runs one forward and backward of the batch and returns the detached loss; no optimizer step.
Every baseline owns a deep copy of the model, so that its gradients can be checked against a reference before
anything is timed (benchmarks/README.md, "Nothing wrong is timed").
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

import pipeddp
from benchmarks import common
from benchmarks.common import Grads, LossFn, devices, gather, grad_rel_diff, grad_snapshot, here, synced
from pipeddp.runtime.microbatch import split, split_sizes
from pipeddp.runtime.trace import Span, Trace

Breakdown = Dict[int, Dict[str, float]]  # stage -> {"F_ms", "B_ms", ...}


@dataclass
class Step:
    """One configuration on this rank: ``run`` is None where this rank sits it out; ``traced(run)`` calls ``run()``
    once and returns this rank's forward and backward ms per stage; ``procs``: how many processes it uses."""

    name: str
    run: Optional[Callable[[], Any]]
    module: Optional[nn.Module] = None
    close: Callable[[], None] = lambda: None
    procs: int = 1
    traced: Optional[Callable[[Callable[[], Any]], Breakdown]] = None
    info: Dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> Any:
        return None if self.run is None else self.run()

    def grads(self) -> Grads:
        return grad_snapshot(self.module) if self.run is not None and self.module is not None else {}


def check_grads(steps: Sequence[Step], reference: Union[str, Callable[[Step], Grads]], label: str,
                exempt: Sequence[str] = ()) -> Dict[str, Dict[str, float]]:
    """Run every step once (also its warm-up) and compare its gradients, merged on rank 0, with ``reference`` (one
    of ``steps``, run first, or a function of the step), in full float32 (``without_tf32``); a difference above
    1e-4 is printed, but for ``exempt`` (not expected to match, e.g. whole batch vs micro-batches under BatchNorm)."""
    ref: Optional[Grads] = None
    out: Dict[str, Dict[str, float]] = {}
    for step in sorted(steps, key=lambda s: s.name != reference):
        with common.without_tf32():
            wall = common.barrier_timed(step.run)[0].wall
        parts = gather(step.grads())
        if parts is None:  # not rank 0
            continue
        grads = {k: v for p in parts for k, v in p.items()}
        if step.name == reference:
            ref = grads
        diff = grad_rel_diff(ref if isinstance(reference, str) else reference(step), grads)
        out[step.name] = {"first_step_s": wall, f"grad_rel_diff_vs_{label}": diff}
        if diff > 1e-4 and step.name not in exempt:
            print(f"  warning: {step.name} gradients differ from {label}'s by {diff:.2e} (relative)", flush=True)
    return out


def mb_text(sizes: Sequence[int]) -> str:
    """Micro-batch sizes in short: ``15 x 8``, ``7 x 16 + 8``, ``1 x 120`` (always a count, then a size)."""
    groups = [(len(list(g)), k) for k, g in itertools.groupby(sizes)]
    if len(groups) == 1:
        return f"{groups[0][0]} x {groups[0][1]}"
    return " + ".join(f"{n} x {k}" if n > 1 else str(k) for n, k in groups)


def idle(name: str, procs: int = 1) -> Step:
    """The stand-in for a configuration this rank does not run (it only joins the barriers)."""
    return Step(name, None, procs=procs)


def layers(model: nn.Sequential, a: int, b: int) -> nn.Sequential:
    """Own copies of layers a..b-1 under their original names (so parameter names match the model's)."""
    named = list(model.named_children())[a:b]
    return nn.Sequential(OrderedDict((n, copy.deepcopy(layer)) for n, layer in named))


def _direct(name: str, mod: nn.Module, params: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
            threads: Optional[int] = None, procs: int = 1) -> Step:
    """A module stepped directly; ``info["phases"]``: the last step's zero_grad / forward (with the loss) /
    backward seconds, which only a directly timed step can separate."""
    phases: Dict[str, float] = {}

    def run() -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            t0 = time.perf_counter()
            mod.zero_grad(set_to_none=True)
            t1 = synced()
            loss = loss_fn(mod(x), y)
            t2 = synced()
            loss.backward()
            phases.update(lead=t1 - t0, fwd=t2 - t1, bwd=synced() - t2)
            return loss.detach()
        finally:
            torch.set_num_threads(before)

    return Step(name, run, params, procs=procs, info={"phases": phases, "threads": threads})


def whole(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, *, name: str = "whole",
          threads: Optional[int] = None) -> Step:
    """The plain model on the whole batch (``threads``: intra-op threads during the step, default unchanged)."""
    mod, dev = copy.deepcopy(model).to(here()), here()
    return _direct(name, mod, mod, x.to(dev), y.to(dev), loss_fn, threads)


def accumulate(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, chunks: int, *,
               name: str = "accum") -> Step:
    """The plain model accumulating over ``split_sizes(N, chunks)`` micro-batches, each loss weighted n_i/N as
    the pipeline weights it: the gradients equal a pipeline's over the same micro-batches (BatchNorm included)."""
    dev = here()
    mod = copy.deepcopy(model).to(dev)
    n = x.shape[0]
    sizes = split_sizes(n, chunks=chunks)
    pieces = list(zip(split(x.to(dev), sizes), split(y.to(dev), sizes), [k / n for k in sizes]))

    def run() -> torch.Tensor:
        mod.zero_grad(set_to_none=True)
        total = torch.zeros((), device=dev)
        for xi, yi, w in pieces:
            loss = loss_fn(mod(xi), yi) * w
            loss.backward()
            total += loss.detach()
        return total

    return Step(name, run, mod, info={"microbatch_sizes": sizes})


def ddp(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, *, name: str = "ddp") -> Step:
    """Plain DDP over the job's ranks (gloo on CPU), each rank a ``split_sizes`` share of the batch."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world, dev = dist.get_rank(), dist.get_world_size(), here()
    wrapped = DistributedDataParallel(copy.deepcopy(model).to(dev), device_ids=None if dev.type == "cpu" else [dev])
    sizes = split_sizes(x.shape[0], chunks=world)
    step = _direct(name, wrapped, wrapped.module, split(x.to(dev), sizes)[rank], split(y.to(dev), sizes)[rank], loss_fn,
                   procs=world)
    step.info["batch_per_process"] = sizes[rank]
    return step


#: torch.distributed.pipelining's schedules by the name of pipeddp's counterpart; the last two run several stages
#: per rank (round robin, as pipeddp's virtual stages: rank r holds stages r, r + ranks, ...)
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zb": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


def torch_pipelining(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, *,
                     balance: Sequence[int], schedule: str, chunks: int, group: Any = None,
                     name: str = "torch") -> Step:
    """``torch.distributed.pipelining``: rank r runs stages r, r + ranks, ... (``balance`` slices; "zbv": r and
    n - 1 - r, the V its schedule requires) as ``PipelineStage``s, shapes inferred at the first step (the check step
    pays); ``schedule`` names pipeddp's counterpart. ``traced`` times the stages' ``*_one_chunk`` calls."""
    from torch.distributed import pipelining

    rank, ranks = dist.get_rank(), dist.get_world_size() if group is None else dist.get_world_size(group)
    n = len(balance)
    dev = here()
    mine = [rank, n - 1 - rank] if schedule == "zbv" else list(range(rank, n, ranks))
    subs = [layers(model, sum(balance[:k]), sum(balance[:k + 1])).to(dev).train() for k in mine]
    stages = [pipelining.PipelineStage(sub, k, n, dev, group=group) for sub, k in zip(subs, mine)]
    # every layer this rank trains, under its name in the plain model (what the gradient check compares by)
    holder = nn.Sequential(OrderedDict((n, layer) for sub in subs for n, layer in sub.named_children()))
    x, y = x.to(dev), y.to(dev)
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    sched = cls(stages if n > ranks else stages[0], n_microbatches=chunks, loss_fn=loss_fn)
    losses: List[torch.Tensor] = []
    first, last = 0 in mine, n - 1 in mine

    def run() -> Any:
        holder.zero_grad(set_to_none=True)
        losses.clear()
        if first and last:
            return sched.step(x, target=y, losses=losses)
        if first:
            return sched.step(x)
        return sched.step(target=y, losses=losses) if last else sched.step()

    def traced(step: Callable[[], Any]) -> Breakdown:  # the categories of ``stage_breakdown``, by wrapping calls
        from torch.distributed.pipelining import schedules as torch_schedules

        acc = dict.fromkeys(("F", "B", "post", "wait"), 0.0)

        def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    acc[key] += time.perf_counter() - t0
            return wrapper

        spots = [(st, attr, "F" if attr == "forward_one_chunk" else "B") for st in stages
                 for attr in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")]
        spots += [(torch_schedules, "_batch_p2p", "post"), (torch_schedules, "_wait_batch_p2p", "wait")]
        with contextlib.ExitStack() as patches:
            for owner, attr, key in (spot for spot in spots if hasattr(spot[0], spot[1])):
                patches.enter_context(mock.patch.object(owner, attr, timed(key, getattr(owner, attr))))
            step()
        return {rank: {f"{k}_ms": v * 1e3 for k, v in acc.items()}}

    return Step(name, run, holder, procs=ranks, traced=traced,
                info={"balance": list(balance), "schedule": TORCH_SCHEDULES[schedule]})


def guarded_torch(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, timeout: float,
                  **kwargs: Any) -> Tuple[Optional[Step], str]:
    """``torch_pipelining(**kwargs)`` on a process group of its own (``timeout`` seconds), its first step run. A
    failing rank tears the group down, so that the peer's pending receive fails instead of hanging; the step, or
    None and every rank's errors (real errors before timeouts)."""
    group: Any = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=timeout))
    step: Optional[Step] = None
    err = ""
    try:
        step = torch_pipelining(model, x, y, loss_fn, group=group, **kwargs)
        step()
    except Exception as exc:  # noqa: BLE001 - recorded, the benchmark goes on without this configuration
        err = f"rank {dist.get_rank()}: {type(exc).__name__}: {str(exc).strip()[-1500:]}"
        for teardown in (group.abort, lambda: dist.destroy_process_group(group)):
            with contextlib.suppress(Exception):
                teardown()
    errors: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, err)
    failed = sorted((e for e in errors if e), key=lambda e: "timed out" in e.lower())
    return (None, " | ".join(failed)) if failed else (step, "")


#: the trace's span kinds summed under each breakdown column (``agree``: the replica's two collectives per step)
COLUMNS = {"F_ms": ("F",), "B_ms": ("B", "I", "W"), "wait_ms": ("recv", "flush"), "post_ms": ("send",),
           "agree_ms": ("agree",)}


def stage_breakdown(spans: Sequence[Span]) -> Breakdown:
    """Per stage of a pipeddp trace, ms in each ``COLUMNS`` category: forward and backward actions (B, or I + W),
    waiting for messages (receives, and sends still in flight at the step's end), sending them, agreeing."""
    return {s: {col: sum(sp.duration for sp in spans if sp.stage == s and sp.kind in kinds) * 1e3
                for col, kinds in COLUMNS.items()} for s in sorted({sp.stage for sp in spans})}


def record(engine: Any, run: Callable[[], Any], rank: int = 0) -> List[Span]:
    """The spans of a pipeddp engine's trace over one call of ``run`` (a clock reading around every action)."""
    engine.trace = Trace(rank)
    try:
        run()
        return engine.trace.spans
    finally:
        engine.trace = None


def pipeline(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, *, stages: int = 2,
             name: str = "pipeline", **kwargs: Any) -> Step:
    """``pipeddp.Pipeline`` on ``stages`` CPU stage threads of 1 intra-op thread (kwargs: chunks, balance, ...)."""
    pipe = pipeddp.Pipeline(copy.deepcopy(model), devices(stages), threads=1, **kwargs)

    def run() -> torch.Tensor:
        pipe.zero_grad(set_to_none=True)
        return pipe.train_step(x, y, loss_fn)

    traced = None if kwargs.get("trace") else lambda call: stage_breakdown(record(pipe, call))
    return Step(name, run, pipe, pipe.close, traced=traced,
                info={"balance": list(pipe.balance), "schedule": kwargs.get("schedule", "1f1b")})


def hybrid(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, *, stages: int = 2,
           mode: str = "replica", name: str = "hybrid", **kwargs: Any) -> Step:
    """``pipeddp.HybridParallel`` over the job's ranks: in replica mode each rank a replica on ``stages`` stage
    threads, fed its replica's share of the batch; in stage mode one stage per rank."""
    rank, replica_mode = dist.get_rank(), mode == "replica"
    engine = pipeddp.HybridParallel(copy.deepcopy(model), stages=stages, mode=mode,
                                    devices=devices(stages, rank * stages) if replica_mode else devices(1, rank),
                                    **({"threads": 1} if replica_mode else {}), **kwargs)
    topo = engine.topology
    sizes = split_sizes(x.shape[0], chunks=topo.replicas)
    replica = topo.replica_of(rank)
    xl, yl = split(x, sizes)[replica], split(y, sizes)[replica]
    xin, yin = (xl if engine.is_first else None), (yl if engine.is_last else None)

    def run() -> torch.Tensor:
        engine.zero_grad(set_to_none=True)
        return engine.train_step(xin, yin, loss_fn)

    traced = None if kwargs.get("trace") else lambda call: stage_breakdown(record(engine, call, rank))
    return Step(name, run, engine, engine.close, procs=dist.get_world_size(), traced=traced,
                info={"balance": list(engine.balance), "schedule": kwargs.get("schedule", "1f1b"), "mode": mode,
                      "batch_per_process": sizes[replica]})
