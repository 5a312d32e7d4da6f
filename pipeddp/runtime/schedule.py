"""Pipeline schedules as plain data.

A schedule is, for each stage, the ordered list of actions that stage runs in
one training step: ``F i`` (forward of micro-batch i) and ``B i`` (its
backward). Nothing here touches a device, so schedules can be printed,
validated and simulated anywhere::

    >>> print(format_schedule(one_f_one_b(stages=3, chunks=4)))
    stage 0: F0 F1 F2 B0 F3 B1 B2 B3
    stage 1: F0 F1 B0 F2 B1 F3 B2 B3
    stage 2: F0 B0 F1 B1 F2 B2 F3 B3

GPipe runs every forward, then every backward: simple, but stage s holds the
activations of all m micro-batches. 1F1B warms up with ``p - s - 1``
forwards, then alternates one forward and one backward, so stage s never
holds more than ``p - s`` micro-batches in flight; the bubble is the same.

Dependencies that any executor honours::

    F(s, i)  needs  F(s-1, i)            (its input)
    B(s, i)  needs  F(s, i), B(s+1, i)   (its output grad; the last stage
                                          starts from its own loss)

``play`` walks the lists under these rules with given durations. It is the
deadlock check (used by ``validate``) and the core of the step-time
simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Union

__all__ = [
    "Action",
    "Schedule",
    "gpipe",
    "one_f_one_b",
    "forward_only",
    "backward_only",
    "get_schedule",
    "validate",
    "format_schedule",
    "play",
    "Played",
    "SCHEDULES",
    "ready_time",
]


class Action(NamedTuple):
    """One unit of work of one stage: ``kind`` is ``"F"`` or ``"B"``, ``mb`` the micro-batch."""

    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


Schedule = List[List[Action]]
ScheduleFn = Callable[[int, int], Schedule]


def _check(stages: int, chunks: int) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")


def gpipe(stages: int, chunks: int) -> Schedule:
    """All forwards, then all backwards (in micro-batch order) on every stage."""
    _check(stages, chunks)
    row = [Action("F", i) for i in range(chunks)] + [Action("B", i) for i in range(chunks)]
    return [list(row) for _ in range(stages)]


def one_f_one_b(stages: int, chunks: int) -> Schedule:
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    _check(stages, chunks)
    out: Schedule = []
    for s in range(stages):
        warm = min(stages - s - 1, chunks)
        row = [Action("F", i) for i in range(warm)]
        for i in range(chunks - warm):
            row.append(Action("F", warm + i))
            row.append(Action("B", i))
        row += [Action("B", i) for i in range(chunks - warm, chunks)]
        out.append(row)
    return out


def forward_only(stages: int, chunks: int) -> Schedule:
    """Forwards only: inference, and the forward half of ``Pipeline.__call__``."""
    _check(stages, chunks)
    return [[Action("F", i) for i in range(chunks)] for _ in range(stages)]


def backward_only(stages: int, chunks: int) -> Schedule:
    """Backwards only: the second half of ``Pipeline.__call__`` + ``loss.backward()``."""
    _check(stages, chunks)
    return [[Action("B", i) for i in range(chunks)] for _ in range(stages)]


SCHEDULES: Dict[str, ScheduleFn] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def get_schedule(schedule: Union[str, ScheduleFn], stages: int, chunks: int) -> Schedule:
    """Build and validate a schedule from a name (``"gpipe"``, ``"1f1b"``) or a function."""
    if isinstance(schedule, str):
        key = schedule.lower().replace("-", "").replace("_", "")
        if key not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)} or pass a function")
        plan = SCHEDULES[key](stages, chunks)
    elif callable(schedule):
        plan = schedule(stages, chunks)
    else:
        raise TypeError(f"schedule must be a name or a function(stages, chunks), got {type(schedule).__name__}")
    validate(plan, chunks, training=True)
    return plan


def validate(schedule: Schedule, chunks: int, *, training: bool = True) -> None:
    """Raise ``ValueError`` unless ``schedule`` is complete, ordered and deadlock-free.

    Complete: every stage runs F i (and B i when ``training``) exactly once for
    every micro-batch. Ordered: a stage's B i comes after its F i. Deadlock-free:
    ``play`` with unit durations finishes.
    """
    if not schedule:
        raise ValueError("a schedule needs at least one stage")
    kinds = ("F", "B") if training else ("F",)
    for s, row in enumerate(schedule):
        seen = set()
        for a in row:
            if not isinstance(a, Action) or a.kind not in ("F", "B"):
                raise ValueError(f"stage {s}: {a!r} is not an Action('F'|'B', mb)")
            if not 0 <= a.mb < chunks:
                raise ValueError(f"stage {s}: {a} refers to micro-batch {a.mb}, but there are {chunks}")
            if a in seen:
                raise ValueError(f"stage {s}: {a} appears twice")
            if a.kind == "B" and Action("F", a.mb) not in seen:
                raise ValueError(f"stage {s}: {a} comes before F{a.mb}")
            seen.add(a)
        missing = [f"{k}{i}" for k in kinds for i in range(chunks) if Action(k, i) not in seen]
        if missing:
            raise ValueError(f"stage {s} never runs {' '.join(missing)}")
    play(schedule)


def format_schedule(schedule: Schedule) -> str:
    """One line per stage: ``stage 0: F0 F1 B0 ...``."""
    return "\n".join(f"stage {s}: " + " ".join(str(a) for a in row) for s, row in enumerate(schedule))


@dataclass
class Played:
    """What ``play`` found: per stage, ``(action, start, end)`` in execution order."""

    events: List[List[Tuple[Action, float, float]]]

    @property
    def makespan(self) -> float:
        return max((row[-1][2] for row in self.events if row), default=0.0)

    def busy(self, stage: int) -> float:
        return sum(end - start for _, start, end in self.events[stage])

    @property
    def bubble(self) -> float:
        """Idle share of all stage-time: ``1 - sum(busy) / (stages * makespan)``."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy(s) for s in range(len(self.events))) / (len(self.events) * span)

    def peak_in_flight(self, stage: int) -> int:
        """Most micro-batches whose forward ran but whose backward has not finished."""
        live = peak = 0
        for a, _, _ in self.events[stage]:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        return peak


def _unit(stage: int, action: Action) -> float:
    return 1.0


def _free(src: int, dst: int, action: Action) -> float:
    return 0.0


def play(
    schedule: Schedule,
    duration: Callable[[int, Action], float] = _unit,
    transfer: Callable[[int, int, Action], float] = _free,
) -> Played:
    """Run ``schedule`` on paper and return when each action starts and ends.

    ``duration(stage, action)`` is the compute time; ``transfer(src, dst,
    action)`` the time to move the action's result (an activation for F, a
    gradient for B) from stage ``src`` to its neighbour ``dst``. A transfer
    does not occupy either stage (it runs on a copy stream / the network).
    Raises ``ValueError`` naming the stuck actions if the schedule deadlocks.
    """
    p = len(schedule)
    done: Dict[Tuple[int, str, int], float] = {}
    events: List[List[Tuple[Action, float, float]]] = [[] for _ in range(p)]
    pos = [0] * p
    clock = [0.0] * p
    total = sum(len(r) for r in schedule)
    finished = 0
    while finished < total:
        progressed = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                ready = ready_time(s, a, p, done, transfer)
                if ready is None:
                    break
                start = max(clock[s], ready)
                end = start + duration(s, a)
                events[s].append((a, start, end))
                done[(s, a.kind, a.mb)] = end
                clock[s] = end
                pos[s] += 1
                finished += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"stage {s} at {schedule[s][pos[s]]}" for s in range(p) if pos[s] < len(schedule[s])
            )
            raise ValueError(f"the schedule deadlocks: no stage can proceed ({stuck})")
    return Played(events)


def ready_time(
    s: int,
    a: Action,
    p: int,
    done: Dict[Tuple[int, str, int], float],
    transfer: Callable[[int, int, Action], float],
) -> Optional[float]:
    """When the inputs of ``a`` on stage ``s`` are available, or None if not yet produced."""
    if a.kind == "F":
        if s == 0:
            return 0.0
        t = done.get((s - 1, "F", a.mb))
        return None if t is None else t + transfer(s - 1, s, a)
    own = done.get((s, "F", a.mb))
    if own is None:
        return None
    if s == p - 1:
        return own
    t = done.get((s + 1, "B", a.mb))
    if t is None:
        return None
    return max(own, t + transfer(s + 1, s, a))
