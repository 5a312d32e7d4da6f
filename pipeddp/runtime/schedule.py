"""Pipeline schedules as plain data.

A schedule has one *row* per device of the pipeline (a stage thread, or the
process that owns it): the ordered list of actions that device runs in one
training step. An action names its kind, its micro-batch and the *stage*
(the contiguous slice of the model) it runs::

    F  forward of one micro-batch
    B  its whole backward (input and weight gradients)
    I  the input-gradient half of a backward: what the previous stage waits for
    W  the weight-gradient half, run later (zero-bubble schedules fill the bubble with it)

With one stage per device, stage and row are the same number and actions
print short. Nothing here touches a device, so schedules can be printed,
validated and simulated anywhere::

    >>> print(format_schedule(one_f_one_b(stages=3, chunks=4)))
    stage 0: F0 F1 F2 B0 F3 B1 B2 B3
    stage 1: F0 F1 B0 F2 B1 F3 B2 B3
    stage 2: F0 B0 F1 B1 F2 B2 F3 B3

With ``virtual_stages=v`` the model is cut into ``p * v`` stages and device
``r`` holds stages ``r, r + p, r + 2p, ...`` (round robin), so a micro-batch
visits every device v times and the bubble shrinks about v-fold::

    >>> print(format_schedule(interleaved(stages=2, chunks=2, virtual_stages=2)))
    device 0: F0@s0 F1@s0 F0@s2 F1@s2 B0@s2 B1@s2 B0@s0 B1@s0
    device 1: F0@s1 F1@s1 F0@s3 B0@s3 F1@s3 B1@s3 B0@s1 B1@s1

Dependencies, written once in ``deps`` and used by ``validate``, ``play``,
the simulator and the executor::

    F(s, i)      needs  F(s-1, i)                  (its input; stage 0 reads the batch)
    B/I(s, i)    needs  F(s, i), B/I(s+1, i)       (its output gradient; the last stage
                                                     starts from its own loss)
    W(s, i)      needs  I(s, i)

GPipe runs every forward, then every backward: stage s holds the
activations of all m micro-batches. 1F1B warms up with ``p - s - 1``
forwards, then alternates, so stage s holds at most ``p - s``; the bubble is
the same. The interleaved and zero-bubble schedules are built by
``list_schedule``: a device at a time runs the most urgent action that is
ready (input gradients first, then forwards while it holds fewer micro-batches
than its memory allows, then deferred weight gradients) on a model of unit
costs; the order it found is the schedule.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

__all__ = [
    "Kind",
    "Action",
    "Schedule",
    "ScheduleFn",
    "gpipe",
    "one_f_one_b",
    "interleaved",
    "zero_bubble",
    "list_schedule",
    "forward_only",
    "backward_only",
    "get_schedule",
    "validate",
    "format_schedule",
    "deps",
    "play",
    "Played",
    "SCHEDULES",
    "ready_time",
    "row_of",
    "stage_count",
    "releases",
]


class Kind(str, enum.Enum):
    """What an action does. A ``str`` enum: ``Kind.F == "F"``, so schedules written with strings still work."""

    F = "F"  #: forward
    B = "B"  #: whole backward: input and weight gradients
    I = "I"  #: input-gradient half of a backward (sent to the previous stage)  # noqa: E741
    W = "W"  #: weight-gradient half of a backward, after its I

    def __str__(self) -> str:
        return self.value

    @property
    def backward(self) -> bool:
        """Whether the action produces the gradient the previous stage waits for (B or I)."""
        return self is Kind.B or self is Kind.I

    @property
    def describe(self) -> str:
        return {"F": "forward", "B": "backward", "I": "input-gradient backward", "W": "weight-gradient backward"}[
            self.value]


class Action(NamedTuple):
    """One unit of work: ``kind`` of micro-batch ``mb`` on ``stage`` (None: the row's own stage, one per device)."""

    kind: Kind
    mb: int
    stage: Optional[int] = None

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"

    def label(self, short: bool = True) -> str:
        """``F0``, or ``F0@s2`` where a device holds several stages."""
        return str(self) if short or self.stage is None else f"{self.kind}{self.mb}@s{self.stage}"


Schedule = List[List[Action]]
#: A schedule function: ``(stages, chunks) -> rows``, or ``(stages, chunks, virtual_stages) -> rows``.
ScheduleFn = Callable[..., Schedule]

#: What an action produces, by which its dependants find it: ("F", stage, mb) an activation,
#: ("G", stage, mb) the gradient of the stage's input, ("W", stage, mb) its weight gradients.
Event = Tuple[str, int, int]


def row_of(stage: int, rows: int) -> int:
    """The device row that holds ``stage`` (round robin: device r holds r, r + rows, ...)."""
    return stage % rows


def stage_count(schedule: Schedule) -> int:
    """How many stages a (normalised) schedule runs."""
    return 1 + max((a.stage for row in schedule for a in row if a.stage is not None), default=len(schedule) - 1)


def produces(a: Action) -> Tuple[Event, ...]:
    s = a.stage if a.stage is not None else 0
    if a.kind is Kind.F:
        return (("F", s, a.mb),)
    if a.kind is Kind.B:
        return (("G", s, a.mb), ("W", s, a.mb))
    if a.kind is Kind.I:
        return (("G", s, a.mb),)
    return (("W", s, a.mb),)


def deps(a: Action, stages: int) -> List[Tuple[Event, bool]]:
    """What ``a`` waits for in a pipeline of ``stages`` stages: ``(event, crosses_stages)`` pairs.

    ``crosses_stages`` marks what another stage sends (an activation or a
    gradient, which a transfer delays); the rest is the stage's own earlier work.
    """
    s = a.stage if a.stage is not None else 0
    if a.kind is Kind.F:
        return [(("F", s - 1, a.mb), True)] if s > 0 else []
    if a.kind.backward:
        out = [(("F", s, a.mb), False)]
        if s < stages - 1:
            out.append((("G", s + 1, a.mb), True))
        return out
    return [(("G", s, a.mb), False)]


def releases(a: Action) -> bool:
    """Whether ``a`` frees its micro-batch's activations (the last action of a micro-batch on a stage)."""
    return a.kind is Kind.B or a.kind is Kind.W


def _check(stages: int, chunks: int, virtual_stages: int = 1) -> None:
    for name, value in (("stages", stages), ("chunks", chunks), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def gpipe(stages: int, chunks: int) -> Schedule:
    """All forwards, then all backwards (in micro-batch order) on every stage."""
    _check(stages, chunks)
    return [[Action(Kind.F, i, s) for i in range(chunks)] + [Action(Kind.B, i, s) for i in range(chunks)]
            for s in range(stages)]


def one_f_one_b(stages: int, chunks: int) -> Schedule:
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    _check(stages, chunks)
    out: Schedule = []
    for s in range(stages):
        warm = min(stages - s - 1, chunks)
        row = [Action(Kind.F, i, s) for i in range(warm)]
        for i in range(chunks - warm):
            row.append(Action(Kind.F, warm + i, s))
            row.append(Action(Kind.B, i, s))
        row += [Action(Kind.B, i, s) for i in range(chunks - warm, chunks)]
        out.append(row)
    return out


def _round_robin(rows: int, chunks: int, virtual_stages: int, row: int, reverse: bool) -> List[Tuple[int, int]]:
    """``(stage, mb)`` in the order a device prefers: groups of ``rows`` micro-batches, its stages in turn.

    Micro-batches go ``rows`` at a time through the device's first stage, then
    the same ones through its second stage, and so on (backwards: its last
    stage first), so that the next device always has work in hand.
    """
    local = [row + k * rows for k in range(virtual_stages)]
    if reverse:
        local.reverse()
    out = []
    for start in range(0, chunks, rows):
        group = range(start, min(start + rows, chunks))
        out += [(s, i) for s in local for i in group]
    return out


def list_schedule(stages: int, chunks: int, virtual_stages: int = 1, *, split_backward: bool = False,
                  limit: Optional[Sequence[int]] = None) -> Schedule:
    """Build a schedule by running the pipeline on paper with unit costs and recording what ran.

    Each device, whenever it is free, runs the first of these that is ready:
    a backward (``B``, or ``I`` with ``split_backward``) in its preferred
    order; a forward, while it holds fewer than ``limit[device]`` micro-batches
    (a micro-batch is held from its forward until its B or W); a deferred
    ``W``, oldest first. Costs are F = 1, B = 2 (I = W = 1). The order found
    is deadlock-free for any real costs (it is a topological order of the
    dependencies), so the executor may run it whatever the durations.
    """
    _check(stages, chunks, virtual_stages)
    p, n_stages = stages, stages * virtual_stages
    caps = [chunks * virtual_stages] * p if limit is None else list(limit)
    if len(caps) != p or any(c < 1 for c in caps):
        raise ValueError(f"limit must give every one of the {p} devices at least 1 micro-batch, got {limit!r}")
    fwd = [_round_robin(p, chunks, virtual_stages, r, reverse=False) for r in range(p)]
    bwd = [_round_robin(p, chunks, virtual_stages, r, reverse=True) for r in range(p)]
    back = Kind.I if split_backward else Kind.B
    cost = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0, Kind.W: 1.0}
    done: Dict[Event, float] = {}
    rows: Schedule = [[] for _ in range(p)]
    clock = [0.0] * p
    held = [0] * p
    pending_w: List[List[Tuple[int, int]]] = [[] for _ in range(p)]
    total = n_stages * chunks * (3 if split_backward else 2)
    count = 0

    def ready(a: Action) -> Optional[float]:
        times = [done.get(e) for e, _ in deps(a, n_stages)]
        return None if any(t is None for t in times) else max(times, default=0.0)  # type: ignore[type-var]

    def first_ready(order: List[Tuple[int, int]], kind: Kind, now: float) -> Optional[int]:
        for k, (s, i) in enumerate(order[:1] if kind is Kind.F else order):  # forwards strictly in order
            t = ready(Action(kind, i, s))
            if t is not None and t <= now:
                return k
        return None

    def backward(r: int, now: float) -> Optional[Action]:
        k = first_ready(bwd[r], back, now)
        if k is None:
            return None
        s, i = bwd[r].pop(k)
        if split_backward:
            pending_w[r].append((s, i))
        return Action(back, i, s)

    def forward(r: int, now: float) -> Optional[Action]:
        k = first_ready(fwd[r], Kind.F, now) if held[r] < caps[r] else None
        if k is None:
            return None
        s, i = fwd[r].pop(k)
        return Action(Kind.F, i, s)

    def pick(r: int, now: float) -> Optional[Action]:
        # one forward, one backward, in turn (the steady state of 1F1B), whichever is ready first otherwise
        after_forward = bool(rows[r]) and rows[r][-1].kind is Kind.F
        first, second = (backward, forward) if after_forward else (forward, backward)
        choice = first(r, now) or second(r, now)
        if choice is not None:
            return choice
        if pending_w[r]:
            s, i = pending_w[r].pop(0)
            return Action(Kind.W, i, s)
        return None

    while count < total:
        now = min(clock)
        acted = False
        for r in range(p):
            if clock[r] != now:
                continue
            choice = pick(r, now)
            if choice is None:
                continue
            acted = True
            end = now + cost[choice.kind]
            for e in produces(choice):
                done[e] = end
            rows[r].append(choice)
            clock[r] = end
            count += 1
            if choice.kind is Kind.F:
                held[r] += 1
            elif releases(choice):
                held[r] -= 1
        if acted:
            continue
        # nobody can act now: the idle devices wait for the next thing that becomes ready or finishes
        later = [clock[d] for d in range(p) if clock[d] > now]
        for r in range(p):
            later += [t for t in (ready(Action(back, i, s)) for s, i in bwd[r]) if t is not None and t > now]
            later += [t for t in (ready(Action(Kind.F, i, s)) for s, i in fwd[r]) if t is not None and t > now]
        if not later:
            raise ValueError(f"list_schedule: no device can proceed ({stages} devices, {chunks} micro-batches, "
                             f"virtual_stages={virtual_stages}, limit={caps}); raise the limit")
        nxt = min(later)
        for r in range(p):
            if clock[r] == now:
                clock[r] = nxt
    return rows


def interleaved_limit(stages: int, chunks: int, virtual_stages: int) -> List[int]:
    """How many micro-batches (of one stage each) device r of the interleaved 1F1B schedule holds at most.

    Megatron-LM's warm-up, plus the one forward of the steady state:
    ``2 (p - r - 1) + (v - 1) p + 1``, at most every forward of the device.
    """
    p, v = stages, virtual_stages
    return [min(chunks * v, 2 * (p - r - 1) + (v - 1) * p + 1) for r in range(p)]


def interleaved(stages: int, chunks: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B: each device holds ``virtual_stages`` non-adjacent stages.

    The bubble shrinks from ``(p - 1) / m`` to about ``(p - 1) / (v m)`` of a
    step; each device holds at most ``interleaved_limit`` micro-batches (of a
    stage v times smaller than with one stage per device). With one virtual
    stage it is 1F1B.
    """
    _check(stages, chunks, virtual_stages)
    if virtual_stages == 1:
        return one_f_one_b(stages, chunks)
    return list_schedule(stages, chunks, virtual_stages, limit=interleaved_limit(stages, chunks, virtual_stages))


def zero_bubble(stages: int, chunks: int, virtual_stages: int = 1) -> Schedule:
    """Zero-bubble (ZB-H1, Qi et al. 2023): each backward split into I (input gradient) and W (weights).

    I is on the critical path: the previous stage waits for it. W is not, so
    it is deferred to fill the idle time of the cool-down. Memory is that of
    1F1B's busiest device: every device holds at most ``p`` micro-batches (with
    virtual stages, the interleaved schedule's first device's limit), each
    held from its F until its W.
    """
    _check(stages, chunks, virtual_stages)
    cap = max(interleaved_limit(stages, chunks, virtual_stages)) if virtual_stages > 1 else min(stages, chunks)
    return list_schedule(stages, chunks, virtual_stages, split_backward=True, limit=[cap] * stages)


def _only(schedule: Schedule, keep: Callable[[Action], Optional[Action]]) -> Schedule:
    out = []
    for row in schedule:
        kept = (keep(a) for a in row)
        out.append([a for a in kept if a is not None])
    return out


def forward_only(stages: int, chunks: int, virtual_stages: int = 1) -> Schedule:
    """Forwards only, in the order of the training schedule: inference, and the forward half of ``pipe(x)``."""
    train = one_f_one_b(stages, chunks) if virtual_stages == 1 else interleaved(stages, chunks, virtual_stages)
    return _only(train, lambda a: a if a.kind is Kind.F else None)


def backward_only(stages: int, chunks: int, virtual_stages: int = 1) -> Schedule:
    """Whole backwards only, in the training schedule's order: the second half of ``pipe(x)`` + ``backward()``."""
    train = one_f_one_b(stages, chunks) if virtual_stages == 1 else interleaved(stages, chunks, virtual_stages)
    return _only(train, lambda a: a if a.kind is Kind.B else None)


def _auto(stages: int, chunks: int, virtual_stages: int = 1) -> Schedule:
    """``schedule="auto"`` without measured costs (unit costs): engines and ``simulate`` pass theirs."""
    from .costed import build  # built on this module: imported when first used

    return build(stages, chunks, virtual_stages)


SCHEDULES: Dict[str, ScheduleFn] = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
                                    "zb": zero_bubble, "auto": _auto}
_ALIASES = {"interleaved1f1b": "interleaved", "zerobubble": "zb", "zbh1": "zb"}
#: Schedules that run several stages per device when asked to (``virtual_stages > 1``).
VIRTUAL = ("interleaved", "zb", "auto")


def schedule_name(schedule: str) -> str:
    """The registered name for ``schedule`` (case, dashes and underscores ignored), or ValueError."""
    key = schedule.lower().replace("-", "").replace("_", "")
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)} or pass a function")
    return key


def get_schedule(schedule: Union[str, ScheduleFn], stages: int, chunks: int, virtual_stages: int = 1) -> Schedule:
    """Build, normalise and validate a schedule from a name or a function.

    ``stages`` is the number of devices (rows); the model has ``stages *
    virtual_stages`` stages. A function is called as ``fn(stages, chunks)``,
    or ``fn(stages, chunks, virtual_stages)`` when there are virtual stages.
    """
    _check(stages, chunks, virtual_stages)
    if isinstance(schedule, str):
        name = schedule_name(schedule)
        if virtual_stages > 1 and name not in VIRTUAL:
            raise ValueError(f"schedule {schedule!r} runs one stage per device; with virtual_stages={virtual_stages} "
                             f"choose one of {list(VIRTUAL)}")
        fn = SCHEDULES[name]
        plan = fn(stages, chunks) if name not in VIRTUAL else fn(stages, chunks, virtual_stages)
    elif callable(schedule):
        plan = schedule(stages, chunks) if virtual_stages == 1 else schedule(stages, chunks, virtual_stages)
    else:
        raise TypeError("schedule must be a name or a function(stages, chunks[, virtual_stages]), got "
                        f"{type(schedule).__name__}")
    plan = normalize(plan, stages * virtual_stages)
    validate(plan, chunks, training=True)
    return plan


def accepts_virtual_stages(schedule: Union[str, ScheduleFn]) -> bool:
    """Whether ``schedule`` can run several stages per device (a name in ``VIRTUAL``, or a 3-argument function)."""
    if isinstance(schedule, str):
        return schedule_name(schedule) in VIRTUAL
    try:
        inspect.signature(schedule).bind(1, 1, 1)
    except (TypeError, ValueError):
        return False
    return True


def normalize(schedule: Schedule, stages: Optional[int] = None) -> Schedule:
    """Every action as ``Action(Kind, mb, stage)``: string kinds become ``Kind``, a missing stage the row's own.

    ``stages`` (default: as many as the actions name, else one per row) is how
    many stages the model has; an action without a stage is only allowed where
    it equals the number of rows.
    """
    rows = len(schedule)
    n = _guess_stages(schedule) if stages is None else stages
    out: Schedule = []
    for r, row in enumerate(schedule):
        if not isinstance(row, (list, tuple)):
            raise ValueError(f"a schedule is a list of rows (one list of actions per device); row {r} is a "
                             f"{type(row).__name__}")
        fixed = []
        for a in row:
            if not isinstance(a, tuple) or len(a) not in (2, 3):
                raise ValueError(f"device {r}: {a!r} is not an Action(kind, mb[, stage])")
            kind_raw, mb, stage = (tuple(a) + (None,))[:3]
            try:
                kind = Kind(kind_raw)
            except ValueError:
                raise ValueError(f"device {r}: {a!r} has kind {kind_raw!r}; kinds are "
                                 f"{[k.value for k in Kind]}") from None
            if stage is None:
                if n != rows:
                    raise ValueError(f"device {r}: {a} names no stage, but the model has {n} stages on {rows} "
                                     "devices; give every action its stage: Action(kind, mb, stage)")
                stage = r
            if isinstance(mb, bool) or not isinstance(mb, int) or isinstance(stage, bool) or not isinstance(stage, int):
                raise ValueError(f"device {r}: {a!r} needs an int micro-batch and stage")
            fixed.append(Action(kind, mb, stage))
        out.append(fixed)
    return out


def validate(schedule: Schedule, chunks: int, *, training: bool = True, stages: Optional[int] = None) -> None:
    """Raise ``ValueError`` unless ``schedule`` is complete, ordered, placed and deadlock-free.

    Complete: every stage runs F i, and when ``training`` either B i or both
    I i and W i, exactly once, for every micro-batch. Ordered: a stage's
    backward comes after its F, a W after its I. Placed: stage s runs on
    device ``s % devices``. Deadlock-free: ``play`` with unit durations finishes.
    """
    if not schedule:
        raise ValueError("a schedule needs at least one device row")
    rows = len(schedule)
    schedule = normalize(schedule, stages)
    n = stage_count(schedule) if stages is None else stages
    if n % rows:
        raise ValueError(f"the schedule runs {n} stages on {rows} devices; every device must hold the same "
                         "number of stages")
    seen_all = set()
    for r, row in enumerate(schedule):
        seen = set()
        for a in row:
            tag = f"device {r}: {a.label(False)}" if n != rows else f"stage {r}: {a}"
            if not 0 <= a.stage < n:
                raise ValueError(f"{tag} refers to stage {a.stage}, but there are {n}")
            if row_of(a.stage, rows) != r:
                raise ValueError(f"{tag}: stage {a.stage} lives on device {row_of(a.stage, rows)} (device r holds "
                                 f"stages r, r + {rows}, ...)")
            if not 0 <= a.mb < chunks:
                raise ValueError(f"{tag} refers to micro-batch {a.mb}, but there are {chunks}")
            if a in seen:
                raise ValueError(f"{tag} appears twice")
            if not training and a.kind is not Kind.F:
                raise ValueError(f"{tag}: a forward-only schedule runs F actions only")
            if a.kind is not Kind.F and Action(Kind.F, a.mb, a.stage) not in seen:
                raise ValueError(f"{tag} comes before F{a.mb}")
            if a.kind is Kind.W and Action(Kind.I, a.mb, a.stage) not in seen:
                raise ValueError(f"{tag} comes before I{a.mb} (a W needs its I; use B for a whole backward)")
            if a.kind is Kind.I and Action(Kind.B, a.mb, a.stage) in seen or \
                    a.kind is Kind.B and Action(Kind.I, a.mb, a.stage) in seen:
                raise ValueError(f"{tag}: micro-batch {a.mb} has both a B and an I on stage {a.stage}")
            seen.add(a)
        seen_all |= seen
    for s in range(n):
        r = row_of(s, rows)
        tag = f"stage {s}" if n == rows else f"stage {s} (device {r})"
        missing = [f"F{i}" for i in range(chunks) if Action(Kind.F, i, s) not in seen_all]
        if training:
            for i in range(chunks):
                has_b = Action(Kind.B, i, s) in seen_all
                has_i, has_w = Action(Kind.I, i, s) in seen_all, Action(Kind.W, i, s) in seen_all
                if not (has_b or has_i):
                    missing.append(f"B{i}")
                elif has_i and not has_w:
                    missing.append(f"W{i}")
        if missing:
            raise ValueError(f"{tag} never runs {' '.join(missing)}")
    play(schedule)


def _guess_stages(schedule: Schedule) -> int:
    given = [a[2] for row in schedule for a in row if isinstance(a, tuple) and len(a) == 3 and a[2] is not None]
    return max(given) + 1 if given else len(schedule)


def format_schedule(schedule: Schedule) -> str:
    """One line per device: ``stage 0: F0 F1 B0 ...``, or ``device 0: F0@s0 F0@s2 ...`` with virtual stages."""
    plan = normalize(schedule)
    short = stage_count(plan) == len(plan)
    head = "stage" if short else "device"
    return "\n".join(f"{head} {r}: " + " ".join(a.label(short) for a in row) for r, row in enumerate(plan))


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
