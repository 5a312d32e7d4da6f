"""The vocabulary of schedules: actions, the events they produce and wait for, and rows of them.

A schedule has one *row* per device of the pipeline (a stage thread, or the
process that owns it): the ordered list of actions that device runs in one
training step. An action names its kind, its micro-batch and the *stage*
(the contiguous slice of the model) it runs::

    F  forward of one micro-batch
    B  its whole backward (input and weight gradients)
    I  the input-gradient half of a backward: what the previous stage waits for
    W  the weight-gradient half, run later (zero-bubble schedules fill the bubble with it)

Dependencies, written once in ``deps`` and used by ``validate``, ``play``,
``list_schedule``, the simulator and the executor::

    F(s, i)      needs  F(s-1, i)                  (its input; stage 0 reads the batch)
    B/I(s, i)    needs  F(s, i), B/I(s+1, i)       (its output gradient; the last stage
                                                     starts from its own loss)
    W(s, i)      needs  I(s, i)

``normalize`` reads a schedule written by hand (string kinds, actions without
a stage) into this vocabulary; everything else takes normalised rows.
"""

from __future__ import annotations

import enum
from typing import Callable, List, NamedTuple, Optional, Tuple

__all__ = ["Kind", "Action", "Schedule", "ScheduleFn", "Event", "PLACEMENTS", "row_of", "stages_on", "check_placement",
           "stage_count", "produces", "deps", "releases", "normalize"]


class Kind(str, enum.Enum):
    """What an action does. A ``str`` enum: ``Kind.F == "F"``, so schedules written with strings still work."""

    F = "F"  #: forward
    B = "B"  #: whole backward: input and weight gradients
    I = "I"  #: input-gradient half of a backward (sent to the previous stage)  # noqa: E741 - the letter printed
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

    @property
    def at(self) -> int:
        """The stage, as an int: ``normalize`` gives every action of a schedule its stage before anything runs it."""
        if self.stage is None:
            raise ValueError(f"{self!r} names no stage: normalize the schedule first")
        return self.stage


Schedule = List[List[Action]]
#: A schedule function: ``(stages, chunks) -> rows``, or ``(stages, chunks, virtual_stages) -> rows``.
ScheduleFn = Callable[..., Schedule]

#: What an action produces, by which its dependants find it: ("F", stage, mb) an activation,
#: ("G", stage, mb) the gradient of the stage's input, ("W", stage, mb) its weight gradients.
Event = Tuple[str, int, int]


#: How the stages of a pipeline of ``p`` devices sit on them. ``"loop"``: round robin, device r holds stages
#: r, r + p, ... (a micro-batch loops over the devices v times). ``"v"``: down the devices and back up, pass by
#: pass (p = 2, v = 2: device 0 holds stages 0 and 3, device 1 stages 1 and 2), so the first and the last stage
#: share a device (a weight tied between an embedding and a head stays on it), each turn between passes stays on
#: one device, and the devices sum other pairs of stages: a cut whose first stage is light and whose last is
#: heavy (a language model's head) adds up more evenly in the V, one whose both ends are heavy in the loop.
PLACEMENTS = ("loop", "v")


def check_placement(placement: str) -> str:
    """``placement`` when it is one of ``PLACEMENTS``, else a ValueError that lists them."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {list(PLACEMENTS)}, got {placement!r}")
    return placement


def row_of(stage: int, rows: int, placement: str = "loop") -> int:
    """The device row that holds ``stage`` under ``placement`` (see ``PLACEMENTS``)."""
    if placement == "v" and (stage // rows) % 2:
        return rows - 1 - stage % rows
    return stage % rows


def stages_on(row: int, rows: int, n_stages: int, placement: str = "loop") -> List[int]:
    """The stages device ``row`` holds, in model order."""
    return [s for s in range(n_stages) if row_of(s, rows, placement) == row]


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



def _guess_stages(schedule: Schedule) -> int:
    given = [a[2] for row in schedule for a in row if isinstance(a, tuple) and len(a) == 3 and a[2] is not None]
    return max(given) + 1 if given else len(schedule)

