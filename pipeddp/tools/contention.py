"""Playing a schedule on shared cores: every running action slows down with the number running.

``schedule.play`` gives each device its own processor. On a host where the
stages (and replicas, and gloo's reductions) share the cores, ``play_shared``
plays the same dependencies by processor sharing: with n workers busy, each
progresses at 1 / slowdown(n) of its solo speed, re-evaluated whenever an
action or a reduction starts or ends::

    1 busy   |== F0 ==|                   full speed in the fill
    2 busy            |==== F1 ====|      both slowed while they overlap
                      |==== F0 ====|
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..runtime.schedule.actions import Action, Kind, Schedule, normalize, produces, stage_count
from ..runtime.schedule.replay import Played, ready_time

__all__ = ["play_shared", "play_with_collectives", "Span"]


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
    events, _ = play_with_collectives(schedule, duration, transfer, slowdown)
    return Played(events)


Span = Tuple[float, float]


def _last_weight(schedule: Schedule) -> Dict[int, Tuple[int, int]]:
    """Per stage, (row, position) of its last action that accumulates weight gradients (B or W)."""
    out: Dict[int, Tuple[int, int]] = {}
    for r, row in enumerate(schedule):
        for k, a in enumerate(row):
            if a.kind is Kind.B or a.kind is Kind.W:
                out[a.at] = (r, k)
    return out


def play_with_collectives(
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
        busy = {r: run for r, run in enumerate(running) if run is not None}
        talking = {c: job for c, job in enumerate(comm) if job is not None}
        n = len(busy) + len(talking)
        factor = slowdown(n) if n else 1.0
        comm_factor = factor / slowdown(1) if n else 1.0
        ends = {r: now + run[2] * factor for r, run in busy.items()}
        comm_ends = {c: now + job[1] * comm_factor for c, job in talking.items()}
        triggers = []
        # a running last weight action reaching the share at which the next reduction may start
        for r, run in busy.items():
            s = run[0].at
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
        for r, run in busy.items():
            if ends[r] <= nxt:
                a, start = run[0], run[1]
                events[r].append((a, start, nxt))
                for e in produces(a):
                    done[e] = nxt
                running[r] = None
                finished += 1
            else:
                run[2] -= (nxt - now) / factor
        for c, job in talking.items():
            if comm_ends[c] <= nxt:
                reduced[c].append((job[0], nxt))
                comm[c] = None
                finished += 1
            else:
                job[1] -= (nxt - now) / comm_factor
        now = nxt
    return events, reduced
