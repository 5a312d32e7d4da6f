"""The schedules pipeddp ships, built as plain data, and the registry that names them.

With one stage per device, stage and row are the same number and actions
print short::

    >>> print(format_schedule(one_f_one_b(stages=3, chunks=4)))
    stage 0: F0 F1 F2 B0 F3 B1 B2 B3
    stage 1: F0 F1 B0 F2 B1 F3 B2 B3
    stage 2: F0 B0 F1 B1 F2 B2 F3 B3

With ``virtual_stages=v`` the model is cut into ``p * v`` stages and device
``r`` holds stages ``r, r + p, r + 2p, ...`` (round robin; with
``placement="v"`` down the devices and back up, ``actions.row_of``), so a
micro-batch visits every device v times and the bubble shrinks about v-fold::

    >>> print(format_schedule(interleaved(stages=2, chunks=2, virtual_stages=2)))
    device 0: F0@s0 F1@s0 F0@s2 F1@s2 B0@s2 B1@s2 B0@s0 B1@s0
    device 1: F0@s1 F1@s1 F0@s3 B0@s3 F1@s3 B1@s3 B0@s1 B1@s1

GPipe runs every forward, then every backward: stage s holds the
activations of all m micro-batches. 1F1B warms up with ``p - s - 1``
forwards, then alternates, so stage s holds at most ``p - s``; the bubble is
the same. The interleaved and zero-bubble schedules are built by
``list_schedule``: a device at a time runs the most urgent action that is
ready (input gradients first, then forwards while it holds fewer micro-batches
than its memory allows, then deferred weight gradients) on a model of unit
costs; the order it found is the schedule. ``get_schedule`` builds one by
name or function and hands it back normalised and validated.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .actions import Action, Event, Kind, Schedule, check_placement, deps, produces, releases, stages_on

__all__ = ["gpipe", "one_f_one_b", "list_schedule", "interleaved_limit", "interleaved", "zero_bubble",
           "forward_only", "backward_only", "check_counts"]


def check_counts(stages: int, chunks: int, virtual_stages: int = 1) -> None:
    for name, value in (("stages", stages), ("chunks", chunks), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def gpipe(stages: int, chunks: int) -> Schedule:
    """All forwards, then all backwards (in micro-batch order) on every stage."""
    check_counts(stages, chunks)
    return [[Action(Kind.F, i, s) for i in range(chunks)] + [Action(Kind.B, i, s) for i in range(chunks)]
            for s in range(stages)]


def one_f_one_b(stages: int, chunks: int) -> Schedule:
    """1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    check_counts(stages, chunks)
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


def _round_robin(rows: int, chunks: int, virtual_stages: int, row: int, reverse: bool,
                 placement: str = "loop") -> List[Tuple[int, int]]:
    """``(stage, mb)`` in the order a device prefers: groups of ``rows`` micro-batches, its stages in turn.

    Micro-batches go ``rows`` at a time through the device's first stage, then
    the same ones through its second stage, and so on (backwards: its last
    stage first), so that the next device always has work in hand.
    """
    local = stages_on(row, rows, rows * virtual_stages, placement)
    if reverse:
        local.reverse()
    out = []
    for start in range(0, chunks, rows):
        group = range(start, min(start + rows, chunks))
        out += [(s, i) for s in local for i in group]
    return out


def list_schedule(stages: int, chunks: int, virtual_stages: int = 1, *, split_backward: bool = False,
                  limit: Optional[Sequence[int]] = None, placement: str = "loop") -> Schedule:
    """Build a schedule by running the pipeline on paper with unit costs and recording what ran.

    Each device, whenever it is free, runs the first of these that is ready:
    a backward (``B``, or ``I`` with ``split_backward``) in its preferred
    order; a forward, while it holds fewer than ``limit[device]`` micro-batches
    (a micro-batch is held from its forward until its B or W); a deferred
    ``W``, oldest first. Costs are F = 1, B = 2 (I = W = 1). The order found
    is deadlock-free for any real costs (it is a topological order of the
    dependencies), so the executor may run it whatever the durations.
    ``placement`` says which device holds which stage (``actions.PLACEMENTS``).
    """
    check_counts(stages, chunks, virtual_stages)
    check_placement(placement)
    p = stages
    caps = [chunks * virtual_stages] * p if limit is None else list(limit)
    if len(caps) != p or any(c < 1 for c in caps):
        raise ValueError(f"limit must give every one of the {p} devices at least 1 micro-batch, got {limit!r}")
    if placement != "loop":
        # In the V a device's second stage waits for the whole way down and back: there the first forward that is
        # ready in the device's order runs (per stage still in micro-batch order), unless that fills a device with
        # first passes that nothing can release (v >= 4); then forwards go strictly in order, as round robin's do.
        try:
            return _played(p, chunks, virtual_stages, split_backward, caps, placement, strict=False)
        except ValueError:
            pass
    return _played(p, chunks, virtual_stages, split_backward, caps, placement, strict=True)


def _played(p: int, chunks: int, virtual_stages: int, split_backward: bool, caps: List[int], placement: str, *,
            strict: bool) -> Schedule:
    """``list_schedule``'s play (its arguments checked), forwards strictly in each device's order or not."""
    n_stages = p * virtual_stages
    fwd = [_round_robin(p, chunks, virtual_stages, r, False, placement) for r in range(p)]
    bwd = [_round_robin(p, chunks, virtual_stages, r, True, placement) for r in range(p)]
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
        wanted = [e for e, _ in deps(a, n_stages)]
        times = [done[e] for e in wanted if e in done]
        return max(times, default=0.0) if len(times) == len(wanted) else None

    def first_ready(order: List[Tuple[int, int]], kind: Kind, now: float) -> Optional[int]:
        for k, (s, i) in enumerate(order[:1] if kind is Kind.F and strict else order):
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
            raise ValueError(f"list_schedule: no device can proceed ({p} devices, {chunks} micro-batches, "
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


def interleaved(stages: int, chunks: int, virtual_stages: int = 2, *, placement: str = "loop") -> Schedule:
    """Interleaved 1F1B: each device holds ``virtual_stages`` non-adjacent stages.

    The bubble shrinks from ``(p - 1) / m`` to about ``(p - 1) / (v m)`` of a
    step; each device holds at most ``interleaved_limit`` micro-batches (of a
    stage v times smaller than with one stage per device; in the V, whose last
    device turns a micro-batch around at once, every device the first one's
    limit). With one virtual stage it is 1F1B.
    """
    check_counts(stages, chunks, virtual_stages)
    if virtual_stages == 1:
        return one_f_one_b(stages, chunks)
    limit = interleaved_limit(stages, chunks, virtual_stages)
    return list_schedule(stages, chunks, virtual_stages, limit=limit if placement == "loop" else [max(limit)] * stages,
                         placement=placement)


def zero_bubble(stages: int, chunks: int, virtual_stages: int = 1, *, placement: str = "loop") -> Schedule:
    """Zero-bubble (ZB-H1, Qi et al. 2023): each backward split into I (input gradient) and W (weights).

    I is on the critical path: the previous stage waits for it. W is not, so
    it is deferred to fill the idle time of the cool-down. Memory is that of
    1F1B's busiest device: every device holds at most ``p`` micro-batches (with
    virtual stages, the interleaved schedule's first device's limit), each
    held from its F until its W.
    """
    check_counts(stages, chunks, virtual_stages)
    cap = max(interleaved_limit(stages, chunks, virtual_stages)) if virtual_stages > 1 else min(stages, chunks)
    return list_schedule(stages, chunks, virtual_stages, split_backward=True, limit=[cap] * stages,
                         placement=placement)


def _only(schedule: Schedule, keep: Callable[[Action], Optional[Action]]) -> Schedule:
    out = []
    for row in schedule:
        kept = (keep(a) for a in row)
        out.append([a for a in kept if a is not None])
    return out


def _training(stages: int, chunks: int, virtual_stages: int, placement: str) -> Schedule:
    if virtual_stages == 1:
        return one_f_one_b(stages, chunks)
    return interleaved(stages, chunks, virtual_stages, placement=placement)


def forward_only(stages: int, chunks: int, virtual_stages: int = 1, *, placement: str = "loop") -> Schedule:
    """Forwards only, in the order of the training schedule: inference, and the forward half of ``pipe(x)``."""
    train = _training(stages, chunks, virtual_stages, placement)
    return _only(train, lambda a: a if a.kind is Kind.F else None)


def backward_only(stages: int, chunks: int, virtual_stages: int = 1, *, placement: str = "loop") -> Schedule:
    """Whole backwards only, in the training schedule's order: the second half of ``pipe(x)`` + ``backward()``."""
    train = _training(stages, chunks, virtual_stages, placement)
    return _only(train, lambda a: a if a.kind is Kind.B else None)
