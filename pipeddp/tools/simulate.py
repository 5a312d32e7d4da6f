"""Predict a training step: play the schedule with measured costs, links and the all-reduce.

::

    stage 0 | F0 | F1 |    | B0 | F2 | B1 | ...          forward/backward: measured per stage
    link        ->c0  ->c1   <-g0                        copy: latency + bytes / bandwidth
    stage 1      | F0 | B0 | F1 | B1 | ...
    all-reduce                         [==== s1 ====]    ring: 2 (R-1)/R bytes / bw + 2 (R-1) latency,
                                             [== s0 ==]   overlapped with that stage's last backward

The schedule itself is played by ``schedule.play`` (the same function that
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

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..runtime.costed import AutoSchedule, Costs, is_auto
from ..runtime.schedule import (Action, Kind, Played, Schedule, ScheduleFn, get_schedule, normalize, play, produces,
                                ready_time, row_of, stage_count)

__all__ = ["StageCost", "Link", "LINKS", "Prediction", "simulate", "ring_allreduce_time", "bubble_bound", "resolve_link",
           "play_shared", "contention_factor"]


@dataclass(frozen=True)
class StageCost:
    """One stage at one micro-batch size: seconds per micro-batch, bytes it sends, bytes it owns.

    ``backward_input`` is the input-gradient half of ``backward`` (what a
    zero-bubble schedule's I costs; W costs the rest). Unknown (None), it is
    taken as half, except on the first stage, which has no input gradient.
    """

    forward: float
    backward: float
    activation_bytes: int = 0
    param_bytes: int = 0
    backward_input: Optional[float] = None

    def cost(self, kind: Kind, first: bool) -> float:
        """Seconds of one action of ``kind`` on this stage (``first``: the pipeline's first stage)."""
        if kind is Kind.F:
            return self.forward
        if kind is Kind.B:
            return self.backward
        i = self.backward_input if self.backward_input is not None else (0.0 if first else self.backward / 2)
        i = min(max(i, 0.0), self.backward)
        return i if kind is Kind.I else self.backward - i


@dataclass(frozen=True)
class Link:
    """A connection: ``bandwidth`` in bytes/s, ``latency`` in seconds per message."""

    bandwidth: float
    latency: float = 0.0

    def time(self, nbytes: float) -> float:
        if math.isinf(self.bandwidth) and self.latency == 0.0:
            return 0.0
        return self.latency + nbytes / self.bandwidth


#: Typical links (per direction). "local" is two stages sharing one memory (CPU threads).
LINKS: Dict[str, Link] = {
    "local": Link(math.inf, 0.0),
    "nvlink": Link(150e9, 5e-6),
    "pcie": Link(12e9, 10e-6),
    "infiniband": Link(25e9, 5e-6),
    "ethernet": Link(1.25e9, 50e-6),
}


def ring_allreduce_time(nbytes: float, replicas: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` over ``replicas``: 2 (R-1) steps of nbytes/R each."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (replicas - 1)
    return steps * link.latency + steps / replicas * nbytes / link.bandwidth


def bubble_bound(stages: int, chunks: int) -> float:
    """The ideal speedup of p stages over one with m micro-batches: m p / (m + p - 1)."""
    return chunks * stages / (chunks + stages - 1)


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


def contention_factor(contention: Optional[Sequence[float]], workers: int) -> float:
    """How much slower compute runs with ``workers`` computing at once (see the module docstring)."""
    if not contention or workers < 1:
        return 1.0
    if workers <= len(contention):
        return float(contention[workers - 1])
    return float(contention[-1]) * workers / len(contention)


def play_shared(
    schedule: Schedule,
    duration: Callable[[int, Action], float],
    transfer: Callable[[int, int, Action], float],
    slowdown: Callable[[int], float],
) -> Played:
    """``schedule.play`` on shared compute: with n stages busy, each progresses at 1 / slowdown(n).

    Event-driven: at every start or end of an action the number of busy
    stages, and with it every running action's speed, is re-evaluated.
    ``duration`` is the solo compute time; transfers are not slowed down.
    With ``slowdown`` always 1 the result equals ``play``'s.
    """
    events, _ = _play_shared(schedule, duration, transfer, slowdown)
    return Played(events)


Span = Tuple[float, float]


def _last_weight(schedule: Schedule) -> Dict[int, Tuple[int, int]]:
    """Per stage, (row, position) of its last action that accumulates weight gradients (B or W)."""
    out: Dict[int, Tuple[int, int]] = {}
    for r, row in enumerate(schedule):
        for k, a in enumerate(row):
            if a.kind is Kind.B or a.kind is Kind.W:
                out[a.stage] = (r, k)
    return out


def _play_shared(
    schedule: Schedule,
    duration: Callable[[int, Action], float],
    transfer: Callable[[int, int, Action], float],
    slowdown: Callable[[int], float],
    collectives: Optional[Sequence[Sequence[Tuple[float, float]]]] = None,
) -> Tuple[List[List[Tuple[Action, float, float]]], List[List[Span]]]:
    """``play_shared``, optionally with collectives that compete for the same cores.

    ``collectives[s]`` lists stage s's reductions as ``(fraction, seconds)``:
    reduction k may start once the stage's last weight-gradient action (its
    last B or W) has done ``fraction`` of its work and reduction k-1 has
    finished; ``seconds`` is its duration when only the collectives run (that
    is how it was measured). A running reduction counts as one more busy
    worker: with n busy (actions + reductions), an action progresses at 1 /
    slowdown(n) and a reduction at slowdown(1) / slowdown(n). Returns each
    device row's events and each stage's reduction spans.
    """
    schedule = normalize(schedule)
    n_stages = stage_count(schedule)
    p = len(schedule)
    jobs = [list(j) for j in collectives] if collectives is not None else [[] for _ in range(n_stages)]
    last_w = _last_weight(schedule)
    done: Dict[Tuple[str, int, int], float] = {}
    events: List[List[Tuple[Action, float, float]]] = [[] for _ in range(p)]
    reduced: List[List[Span]] = [[] for _ in range(n_stages)]
    pos = [0] * p
    running: List[Optional[List[Any]]] = [None] * p  # [action, start, solo work left, solo work, index in row]
    comm: List[Optional[List[float]]] = [None] * n_stages  # [start, work left]
    queued = [0] * n_stages  # next reduction of each stage
    total = sum(len(r) for r in schedule) + sum(len(j) for j in jobs)
    finished = 0
    now = 0.0

    def progress(s: int) -> Optional[float]:
        """Share of stage s's last weight-gradient action done so far (None before it starts)."""
        if s not in last_w:
            return None
        r, k = last_w[s]
        if pos[r] <= k:
            return None
        run = running[r]
        if run is not None and run[4] == k and run[3] > 0:
            return 1.0 - run[2] / run[3]
        return 1.0

    while finished < total:
        pending: List[float] = []
        for r in range(p):
            if running[r] is not None or pos[r] >= len(schedule[r]):
                continue
            a = schedule[r][pos[r]]
            ready = ready_time(a, done, transfer, n_stages)
            if ready is None:
                continue
            if ready <= now:
                work = max(duration(r, a), 0.0)
                running[r] = [a, now, work, work, pos[r]]
                pos[r] += 1
            else:
                pending.append(ready)
        for s in range(n_stages):
            if comm[s] is None and queued[s] < len(jobs[s]):
                share = progress(s)
                if share is not None and share >= jobs[s][queued[s]][0] - 1e-12:
                    comm[s] = [now, max(jobs[s][queued[s]][1], 0.0)]
                    queued[s] += 1
        busy = [r for r in range(p) if running[r] is not None]
        talking = [s for s in range(n_stages) if comm[s] is not None]
        n = len(busy) + len(talking)
        factor = slowdown(n) if n else 1.0
        comm_factor = factor / slowdown(1) if n else 1.0
        ends = {r: now + running[r][2] * factor for r in busy}
        comm_ends = {s: now + comm[s][1] * comm_factor for s in talking}
        triggers = []
        for r in busy:  # a running last weight action reaching the share at which the next reduction may start
            run = running[r]
            s = run[0].stage
            if last_w.get(s) == (r, run[4]) and comm[s] is None and queued[s] < len(jobs[s]):
                left = run[2] - (1.0 - jobs[s][queued[s]][0]) * run[3]
                if left > 0:
                    triggers.append(now + left * factor)
        candidates = list(ends.values()) + list(comm_ends.values()) + pending + triggers
        if not candidates:
            stuck = ", ".join(f"device {r} at {schedule[r][pos[r]].label(False)}"
                              for r in range(p) if pos[r] < len(schedule[r]))
            raise ValueError(f"the schedule deadlocks: no stage can proceed ({stuck})")
        nxt = min(candidates)
        for r in busy:
            if ends[r] <= nxt:
                a, start = running[r][0], running[r][1]
                events[r].append((a, start, nxt))
                for e in produces(a):
                    done[e] = nxt
                running[r] = None
                finished += 1
            else:
                running[r][2] -= (nxt - now) / factor
        for s in talking:
            if comm_ends[s] <= nxt:
                reduced[s].append((comm[s][0], nxt))
                comm[s] = None
                finished += 1
            else:
                comm[s][1] -= (nxt - now) / comm_factor
        now = nxt
    return events, reduced


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
    virtual_stages: int = 1,
) -> Prediction:
    """Predict one training step of ``replicas`` pipelines with the stages of ``costs``.

    ``costs[s]`` is stage s at the micro-batch size used (``chunks`` micro-batches
    per replica); with ``virtual_stages=v`` there are ``stages * v`` of them and
    device r runs stages r, r + stages, ... (``stages`` defaults to
    ``len(costs) // v``). ``links`` is the link between devices (name from
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
                                      max(link.time(c.activation_bytes) for c in costs)))
    plan = get_schedule(schedule, rows, chunks, virtual_stages)

    def duration(row: int, a: Action) -> float:
        return costs[a.stage].cost(a.kind, a.stage == 0)

    def transfer(src: int, dst: int, a: Action) -> float:
        if row_of(src, rows) == row_of(dst, rows):
            return 0.0  # consecutive stages on one device: nothing moves
        # an activation leaves stage src forward; its gradient (same size) comes back from src = dst + 1
        sender = src if a.kind is Kind.F else dst
        return link.time(costs[sender].activation_bytes)

    buckets = [_buckets(c.param_bytes, bucket_bytes) for c in costs]
    reduce = [sum(ring_allreduce_time(b, replicas, ar_link) for b in bs) for bs in buckets]
    if collectives_share_cores:
        if contention is None:
            raise ValueError("collectives_share_cores=True needs contention= (how the shared cores slow down)")
        jobs: List[List[Tuple[float, float]]] = []
        for c, bs in zip(costs, buckets):
            produced, row = 0.0, []
            for size in bs:
                produced += size
                # a bucket may start once the backward has produced it; one piece (no bucket size) may start
                # with the last weight-gradient action, as in the model without sharing
                share = produced / c.param_bytes if bucket_bytes is not None else 0.0
                row.append((share, ring_allreduce_time(size, replicas, ar_link)))
            jobs.append(row if replicas > 1 else [])
        events, spans = _play_shared(plan, duration, transfer,
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
                    last[a.stage] = (start, stop)
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


def _buckets(nbytes: float, bucket_bytes: Optional[float]) -> List[float]:
    """``nbytes`` of gradients as DDP-like buckets of ``bucket_bytes`` (one piece without a size)."""
    if nbytes <= 0:
        return []
    if bucket_bytes is None or nbytes <= bucket_bytes:
        return [float(nbytes)]
    full = int(nbytes // bucket_bytes)
    rest = nbytes - full * bucket_bytes
    return [float(bucket_bytes)] * full + ([float(rest)] if rest > 0 else [])


def resolve_link(value: Union[None, str, Link]) -> Link:
    if value is None:
        return LINKS["local"]
    if isinstance(value, Link):
        return value
    if value not in LINKS:
        raise ValueError(f"unknown link {value!r}; choose one of {sorted(LINKS)} or pass a Link(bandwidth, latency)")
    return LINKS[value]
