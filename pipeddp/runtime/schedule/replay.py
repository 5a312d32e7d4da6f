"""Running a schedule on paper: when each action starts and ends, given durations and transfer times.

``play`` is the one model of time: ``validate`` plays a schedule with unit
durations to prove it deadlock-free, the simulator plays it with measured
costs, and ``peak_held`` counts the micro-batches a device holds::

    device 0  |F0|F1|  |B0|  |B1|            an action starts when its row is free
    device 1     |F0|F1|B0|B1|               and what it ``deps`` on has arrived
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from .actions import Action, Event, Kind, Schedule, deps, normalize, produces, releases, stage_count

__all__ = ["Played", "play", "peak_held", "ready_time"]


@dataclass
class Played:
    """What ``play`` found: per device row, ``(action, start, end)`` in execution order."""

    events: List[List[Tuple[Action, float, float]]]

    @property
    def makespan(self) -> float:
        return max((row[-1][2] for row in self.events if row), default=0.0)

    def busy(self, row: int) -> float:
        return sum(end - start for _, start, end in self.events[row])

    @property
    def bubble(self) -> float:
        """Idle share of all device time: ``1 - sum(busy) / (devices * makespan)``."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(len(self.events))) / (len(self.events) * span)

    def peak_in_flight(self, row: int) -> int:
        """Most micro-batches (of any of its stages) a device held at once: from an F to its B or W."""
        return peak_held(a for a, _, _ in self.events[row])


def peak_held(actions: Iterable[Action]) -> int:
    """The most micro-batches held at once by a device running ``actions`` in this order."""
    live = peak = 0
    for a in actions:
        if a.kind is Kind.F:
            live += 1
        elif releases(a):
            live -= 1
        peak = max(peak, live)
    return peak


def _unit(row: int, action: Action) -> float:
    return 1.0


def _free(src: int, dst: int, action: Action) -> float:
    return 0.0


def play(
    schedule: Schedule,
    duration: Callable[[int, Action], float] = _unit,
    transfer: Callable[[int, int, Action], float] = _free,
) -> Played:
    """Run ``schedule`` on paper and return when each action starts and ends.

    ``duration(row, action)`` is the compute time (``action.stage`` says
    which stage); ``transfer(src, dst, action)`` the time to move what a stage
    sends to the neighbouring stage (an activation for F, a gradient for B and
    I; ``src``/``dst`` are stages). A transfer occupies neither device (it runs
    on a copy stream / the network). Raises ``ValueError`` naming the stuck
    actions if the schedule deadlocks.
    """
    schedule = normalize(schedule)
    n_stages = stage_count(schedule)
    p = len(schedule)
    done: Dict[Event, float] = {}
    events: List[List[Tuple[Action, float, float]]] = [[] for _ in range(p)]
    pos = [0] * p
    clock = [0.0] * p
    total = sum(len(r) for r in schedule)
    finished = 0
    while finished < total:
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule[r]):
                a = schedule[r][pos[r]]
                ready = ready_time(a, done, transfer, n_stages)
                if ready is None:
                    break
                start = max(clock[r], ready)
                end = start + duration(r, a)
                events[r].append((a, start, end))
                for e in produces(a):
                    done[e] = end
                clock[r] = end
                pos[r] += 1
                finished += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"device {r} at {schedule[r][pos[r]].label(n_stages == p)}"
                              for r in range(p) if pos[r] < len(schedule[r]))
            raise ValueError(f"the schedule deadlocks: no stage can proceed ({stuck})")
    return Played(events)


def ready_time(a: Action, done: Dict[Event, float], transfer: Callable[[int, int, Action], float],
               stages: int) -> Optional[float]:
    """When the inputs of ``a`` are available (``done``: when each event happened), or None if not yet produced."""
    t = 0.0
    s = a.stage if a.stage is not None else 0
    for event, crosses in deps(a, stages):
        at = done.get(event)
        if at is None:
            return None
        t = max(t, at + transfer(event[1], s, a) if crosses else at)
    return t
