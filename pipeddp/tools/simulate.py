"""Predict a training step: play the schedule with measured costs, links and the all-reduce.

::

    stage 0 | F0 | F1 |    | B0 | F2 | B1 | ...          forward/backward: measured per stage
    link        ->c0  ->c1   <-g0                        copy: latency + bytes / bandwidth
    stage 1      | F0 | B0 | F1 | B1 | ...
    all-reduce                         [==== s1 ====]    ring: 2 (R-1)/R bytes / bw + 2 (R-1) latency,
                                             [== s0 ==]   overlapped with that stage's last backward

The cost model (``StageCost``, ``Link``, the ring all-reduce) lives in
``costs``, the replay on shared cores in ``contention``; this module puts
them together. The schedule itself is played by ``schedule.play`` (the same function that
checks schedules for deadlocks), so the simulator and the executor agree on
what may run when. The result is the predicted step time, the bubble (idle
share of stage time), and how many micro-batches of activations each stage
holds at its peak.

Four effects are off by default (the textbook model above) and switched on by
keyword arguments, for hosts where they matter:

* ``contention``: the stages (and replicas) share cores, caches and memory
  bandwidth, e.g. CPU stages on one machine. ``contention[n - 1]`` is how much
  slower compute runs while ``n`` workers (busy stages x ``replicas``) compute
  at once, measured on the host (time of a kernel run on n cores at once over
  its time alone; ``contention[0]`` is normally 1). With n beyond the list, the
  workers time-share the cores: the last factor x n / len(contention). The
  schedule is then played by an event-driven processor-sharing model
  (``play_shared``): every running action progresses at 1 / contention[n - 1]
  of its solo speed, re-evaluated whenever an action starts or ends, so a
  stage computing alone in the fill or drain of the pipeline runs at full
  speed and only the overlapped part pays. Without contention the schedule is
  played by ``schedule.play`` exactly as before.
* ``bucket_bytes``: DDP does not reduce a stage's gradients in one piece that
  can start with the last backward; it cuts them into buckets (25 MiB by
  default), each reduced once the backward has produced it, one after
  another. Gradients are taken to appear at a steady rate over the last
  backward, so bucket k is ready at ``start + duration * (bytes up to and
  including k) / param_bytes``; the last bucket, always exposed, is ready
  only when the backward ends. Without it, the whole all-reduce may start
  with the last backward (the optimistic bound).
* ``collectives_share_cores`` (with ``contention``): the all-reduce runs on
  the same cores as the compute (gloo on CPU: copies through the loopback
  socket and the reduction are CPU work), so a bucket in flight is one more
  busy worker per replica: it slows the compute beside it, and is slowed by
  it, as ``contention`` says (its own duration, from ``allreduce_link``, is
  the time with only the reductions running, which is how it is measured).
  On a host whose every core computes, this makes the all-reduce cost about
  as much as if it did not overlap at all, which is what a 2-core CPU shows.
* ``step_overhead``: a fixed cost per step outside the schedule (seconds),
  e.g. the collectives with which ``HybridParallel.train_step`` checks the
  batch sizes and averages the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..runtime.schedule.actions import Action, Kind, ScheduleFn, row_of
from ..runtime.schedule.costed import AutoSchedule, Costs, is_auto
from ..runtime.schedule.registry import get_schedule
from ..runtime.schedule.replay import Played, play
from .contention import play_shared, play_with_collectives
from .costs import (
    LINKS,
    Link,
    StageCost,
    bubble_bound,
    contention_factor,
    resolve_link,
    ring_allreduce_time,
    split_buckets,
)

# the cost model's names are handed on: ``simulate`` is where users find them
__all__ = ["StageCost", "Link", "LINKS", "Prediction", "simulate", "ring_allreduce_time", "bubble_bound",
           "resolve_link", "play_shared", "contention_factor"]


@dataclass
class Prediction:
    """What ``simulate`` predicts for one step."""

    step_time: float
    bubble: float
    peak_activations: List[int]
    allreduce_time: List[float]
    exposed_allreduce: float
    played: Played = field(repr=False)

    @property
    def makespan(self) -> float:
        """Forward+backward time of the pipeline, before any exposed all-reduce."""
        return self.played.makespan


def simulate(
    costs: Sequence[StageCost],
    schedule: Union[str, ScheduleFn] = "1f1b",
    stages: Optional[int] = None,
    chunks: int = 1,
    replicas: int = 1,
    links: Union[None, str, Link] = None,
    allreduce_link: Union[None, str, Link] = None,
    *,
    contention: Optional[Sequence[float]] = None,
    bucket_bytes: Optional[float] = None,
    collectives_share_cores: bool = False,
    step_overhead: float = 0.0,
    placement: str = "loop",
    virtual_stages: int = 1,
) -> Prediction:
    """Predict one training step of ``replicas`` pipelines with the stages of ``costs``.

    ``costs[s]`` is stage s at the micro-batch size used (``chunks`` micro-batches
    per replica); with ``virtual_stages=v`` there are ``stages * v`` of them and
    device r runs stages r, r + stages, ... (``placement="v"``: r, 2 stages - 1 - r,
    ...; ``stages`` defaults to ``len(costs) // v``). ``links`` is the link between devices (name from
    ``LINKS`` or a ``Link``; default: free), ``allreduce_link`` the one between
    replicas (default: ``links``). Each stage's gradient all-reduce starts with its
    last weight-gradient action (its last B or W: DDP reduces buckets as they
    fill) and ends no earlier than that action; the step ends when the last
    all-reduce does.

    ``contention`` (slowdown by number of workers computing at once on shared
    cores, replicas included), ``bucket_bytes`` (DDP bucket size: buckets are
    reduced one after another as the backward produces them),
    ``collectives_share_cores`` (a reduction in flight is one more worker on
    those cores; needs ``contention``) and ``step_overhead`` (seconds added to
    the step) are described in the module docstring; their defaults leave the
    model as above.
    """
    n_stages = len(costs)
    rows = n_stages // virtual_stages if stages is None else stages
    if not isinstance(virtual_stages, int) or virtual_stages < 1 or rows * virtual_stages != n_stages:
        raise ValueError(f"{n_stages} stage costs given for stages={stages} x virtual_stages={virtual_stages}; "
                         "give one cost per stage (devices x virtual stages)")
    if contention is not None and (not contention or any(c <= 0 for c in contention)):
        raise ValueError(f"contention must be a non-empty list of positive slowdown factors, got {contention!r}")
    if bucket_bytes is not None and bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes!r}")
    link = resolve_link(links)
    ar_link = resolve_link(allreduce_link) if allreduce_link is not None else link
    if is_auto(schedule):  # built from these very costs, as an engine builds it from its measured ones
        schedule = AutoSchedule(Costs(tuple(c.forward for c in costs), tuple(c.cost(Kind.I, s == 0) for s, c in
                                                                             enumerate(costs)),
                                      tuple(c.cost(Kind.W, s == 0) for s, c in enumerate(costs)),
                                      max(link.time(c.activation_bytes) for c in costs)), placement=placement)
    plan = get_schedule(schedule, rows, chunks, virtual_stages, placement=placement)

    def duration(row: int, a: Action) -> float:
        return costs[a.at].cost(a.kind, a.at == 0)

    def transfer(src: int, dst: int, a: Action) -> float:
        if row_of(src, rows, placement) == row_of(dst, rows, placement):
            return 0.0  # consecutive stages on one device: nothing moves
        # an activation leaves stage src forward; its gradient (same size) comes back from src = dst + 1
        sender = src if a.kind is Kind.F else dst
        return link.time(costs[sender].activation_bytes)

    buckets = [split_buckets(c.param_bytes, bucket_bytes) for c in costs]
    reduce = [sum(ring_allreduce_time(b, replicas, ar_link) for b in bs) for bs in buckets]
    if collectives_share_cores:
        if contention is None:
            raise ValueError("collectives_share_cores=True needs contention= (how the shared cores slow down)")
        jobs: List[List[Tuple[float, float]]] = []
        for c, bs in zip(costs, buckets):
            produced, pieces = 0.0, []
            for size in bs:
                produced += size
                # a bucket may start once the backward has produced it; one piece (no bucket size) may start
                # with the last weight-gradient action, as in the model without sharing
                share = produced / c.param_bytes if bucket_bytes is not None else 0.0
                pieces.append((share, ring_allreduce_time(size, replicas, ar_link)))
            jobs.append(pieces if replicas > 1 else [])
        events, spans = play_with_collectives(plan, duration, transfer,
                                              lambda n: contention_factor(contention, n * replicas), jobs)
        played = Played(events)
        end = max([played.makespan] + [stop for row in spans for _, stop in row])
    else:
        if contention is None:
            played = play(plan, duration, transfer)
        else:
            played = play_shared(plan, duration, transfer, lambda n: contention_factor(contention, n * replicas))
        end = played.makespan
        last: Dict[int, Tuple[float, float]] = {}
        for row in played.events:
            for a, start, stop in row:
                if a.kind is Kind.B or a.kind is Kind.W:
                    last[a.at] = (start, stop)
        for s, (start, stop) in sorted(last.items()):
            if reduce[s] <= 0:
                continue
            if bucket_bytes is None:
                end = max(end, stop, start + reduce[s])
                continue
            clock, produced = start, 0.0
            for size in buckets[s]:
                produced += size
                ready = start + (stop - start) * produced / costs[s].param_bytes
                clock = max(clock, ready) + ring_allreduce_time(size, replicas, ar_link)
            end = max(end, stop, clock)
    return Prediction(
        step_time=end + step_overhead,
        bubble=played.bubble,
        peak_activations=[played.peak_in_flight(r) for r in range(rows)],
        allreduce_time=reduce,
        exposed_allreduce=end - played.makespan,
        played=played,
    )
