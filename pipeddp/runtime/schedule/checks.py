"""Checking a schedule before anything runs it, and printing it.

``validate`` turns every way a hand-written schedule can be wrong (a missing
or repeated action, a backward before its forward, a stage on the wrong
device, a deadlock) into a ``ValueError`` that names the action, so a bad
schedule fails at construction, never as a hang in the middle of a step.
"""

from __future__ import annotations

from typing import Optional

from .actions import Action, Kind, Schedule, normalize, row_of, stage_count, stages_on
from .replay import play

__all__ = ["validate", "format_schedule"]


def validate(schedule: Schedule, chunks: int, *, training: bool = True, stages: Optional[int] = None,
             placement: str = "loop") -> None:
    """Raise ``ValueError`` unless ``schedule`` is complete, ordered, placed and deadlock-free.

    Complete: every stage runs F i, and when ``training`` either B i or both
    I i and W i, exactly once, for every micro-batch. Ordered: a stage's
    backward comes after its F, a W after its I. Placed: stage s runs on
    device ``row_of(s, devices, placement)``. Deadlock-free: ``play`` with unit durations finishes.
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
            if not 0 <= a.at < n:
                raise ValueError(f"{tag} refers to stage {a.stage}, but there are {n}")
            if row_of(a.at, rows, placement) != r:
                raise ValueError(f"{tag}: stage {a.stage} lives on device {row_of(a.at, rows, placement)} (placement "
                                 f"{placement!r}: device {r} holds stages {stages_on(r, rows, n, placement)})")
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
        r = row_of(s, rows, placement)
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



def format_schedule(schedule: Schedule) -> str:
    """One line per device: ``stage 0: F0 F1 B0 ...``, or ``device 0: F0@s0 F0@s2 ...`` with virtual stages."""
    plan = normalize(schedule)
    short = stage_count(plan) == len(plan)
    head = "stage" if short else "device"
    return "\n".join(f"{head} {r}: " + " ".join(a.label(short) for a in row) for r, row in enumerate(plan))
