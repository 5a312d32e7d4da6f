"""The messages a schedule sends between devices, in one order both ends of every link can compute.

Between two processes NCCL pairs the n-th send with the n-th receive (tags are
ignored), and the operations of one pair of ranks run one after another on one
stream, both directions together. A transport is right there only if both ends
issue the operations of their link in the *same* order: each send where its
peer posts the matching receive. Both ends know the schedule, so both can
compute that order from it::

    device 0  |F0|F1|  |B0|F2|  |B1| ...      messages on link 0-1, by the time they are sent:
    device 1     |F0|B0|  |F1|B1|  ...        F0->1 (t=1), F1->1 (t=2), B0->0 (t=3), F2->1 (t=5), ...

``crossings`` plays the schedule with unit durations and sorts every message
that leaves a device by the time its action ends (ties: the lower row first).
That order follows causality: a message that needs another one to exist (an
action that waits for it) ends later, so no end waits for a message its peer
can only send after one queued behind it. It also keeps each device's own
order, so each end issues its sends in the order it runs its actions.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

from .actions import Kind, Schedule, normalize, stage_count
from .replay import play

__all__ = ["Message", "crossings", "in_order"]


class Message(NamedTuple):
    """One message between devices: from device row ``src`` to ``dst``, named as the channels name it.

    ``kind`` is ``"F"`` (the input of ``stage``) or ``"B"`` (the gradient of
    ``stage``'s output), ``mb`` the micro-batch.
    """

    src: int
    dst: int
    kind: str
    stage: int
    mb: int


def crossings(schedule: Schedule) -> Dict[Tuple[int, int], List[Message]]:
    """Per link ``(low row, high row)``, the messages between its two devices in the order both ends issue them.

    Messages between stages of one device (consecutive virtual stages on a
    one-row pipeline) cross no link and are left out.
    """
    out: Dict[Tuple[int, int], List[Message]] = {}
    for msg in in_order(schedule):
        out.setdefault((min(msg.src, msg.dst), max(msg.src, msg.dst)), []).append(msg)
    return out


def in_order(schedule: Schedule) -> List[Message]:
    """Every message between devices, in one order for the whole pipeline (each link's is its part of it).

    A device that issues the operations of all its links in this order (one
    stream for every peer) never waits for a peer that waits for it either.
    """
    schedule = normalize(schedule)
    n_stages = stage_count(schedule)
    where = {a.at: r for r, row in enumerate(schedule) for a in row}  # the schedule's placement, whichever it is
    timed: List[Tuple[float, int, Message]] = []
    for r, events in enumerate(play(schedule).events):
        for a, _start, end in events:
            s = a.at
            if a.kind is Kind.F and s < n_stages - 1:
                kind, to = "F", s + 1
            elif a.kind.backward and s > 0:
                kind, to = "B", s - 1
            else:
                continue
            dst = where[to]
            if dst != r:
                timed.append((end, r, Message(r, dst, kind, to, a.mb)))
    return [msg for _end, _r, msg in sorted(timed, key=lambda t: (t[0], t[1]))]
