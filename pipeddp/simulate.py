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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

from .schedule import Action, Played, ScheduleFn, get_schedule, play

__all__ = ["StageCost", "Link", "LINKS", "Prediction", "simulate", "ring_allreduce_time", "bubble_bound"]


@dataclass(frozen=True)
class StageCost:
    """One stage at one micro-batch size: seconds per micro-batch, bytes it sends, bytes it owns."""

    forward: float
    backward: float
    activation_bytes: int = 0
    param_bytes: int = 0


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


def simulate(
    costs: Sequence[StageCost],
    schedule: Union[str, ScheduleFn] = "1f1b",
    stages: Optional[int] = None,
    chunks: int = 1,
    replicas: int = 1,
    links: Union[None, str, Link] = None,
    allreduce_link: Union[None, str, Link] = None,
) -> Prediction:
    """Predict one training step of ``replicas`` pipelines of ``len(costs)`` stages.

    ``costs[s]`` is stage s at the micro-batch size used (``chunks`` micro-batches
    per replica). ``links`` is the link between neighbouring stages (name from
    ``LINKS`` or a ``Link``; default: free), ``allreduce_link`` the one between
    replicas (default: ``links``). Each stage's gradient all-reduce starts with its
    last backward (DDP reduces buckets as they fill) and ends no earlier than that
    backward; the step ends when the last stage's all-reduce does.
    """
    stages = len(costs) if stages is None else stages
    if stages != len(costs):
        raise ValueError(f"{len(costs)} stage costs given for stages={stages}")
    link = _link(links)
    ar_link = _link(allreduce_link) if allreduce_link is not None else link
    plan = get_schedule(schedule, stages, chunks)

    def duration(s: int, a: Action) -> float:
        return costs[s].forward if a.kind == "F" else costs[s].backward

    def transfer(src: int, dst: int, a: Action) -> float:
        # an activation leaves stage src forward; its gradient (same size) comes back from src = dst + 1
        sender = src if a.kind == "F" else dst
        return link.time(costs[sender].activation_bytes)

    played = play(plan, duration, transfer)
    reduce = [ring_allreduce_time(c.param_bytes, replicas, ar_link) for c in costs]
    end = played.makespan
    for s, row in enumerate(played.events):
        last_b = [(start, stop) for a, start, stop in row if a.kind == "B"]
        if last_b and reduce[s] > 0:
            start, stop = last_b[-1]
            end = max(end, stop, start + reduce[s])
    return Prediction(
        step_time=end,
        bubble=played.bubble,
        peak_activations=[played.peak_in_flight(s) for s in range(stages)],
        allreduce_time=reduce,
        exposed_allreduce=end - played.makespan,
        played=played,
    )


def _link(value: Union[None, str, Link]) -> Link:
    if value is None:
        return LINKS["local"]
    if isinstance(value, Link):
        return value
    if value not in LINKS:
        raise ValueError(f"unknown link {value!r}; choose one of {sorted(LINKS)} or pass a Link(bandwidth, latency)")
    return LINKS[value]
