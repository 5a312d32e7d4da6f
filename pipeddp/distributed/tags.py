"""The tags of the messages between stage processes, and which activation a message belongs to.

A tag is unique per (kind, receiving stage, micro-batch, tensor slot) and fits gloo's 32 bits. NCCL ignores tags
(``p2p`` pairs messages by their order), but gloo honours them: a message that went astray then waits instead of
landing in the wrong buffer, and other messages between the same processes (``rows``, ``notice``) take tags no
pipeline message has (``spare_tag``). A link's messages are looked up by their ``Route`` (worked out once per
order of a link, not per message).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from ..runtime.schedule.messages import Message

__all__ = ["Route", "activation_of", "routes", "spare_tag", "tag"]

SLOTS = 5  # bits: the header (slot 0) and up to 31 tensors (as many as a header can describe)
STAGES = 8  # bits: up to 256 stages
MBS = 31 - SLOTS - 1 - STAGES  # bits left for the micro-batch


def tag(kind: str, stage: int, mb: int, slot: int) -> int:
    """A message's tag: unique per (kind, receiving stage, micro-batch, tensor slot); fits gloo's 32 bits."""
    if not 0 <= stage < 1 << STAGES or not 0 <= mb < 1 << MBS:
        raise ValueError(f"cannot tag a message of stage {stage}, micro-batch {mb} between processes: at most "
                         f"{1 << STAGES} stages and {1 << MBS} micro-batches per step")
    return ((((mb << STAGES) | stage) << 1 | (kind == "B")) << SLOTS) + slot


def spare_tag(kind: int) -> int:
    """A tag no pipeline message has (that of an activation for stage 0, which nothing sends), one per ``kind``
    (0 <= kind < 32): for other messages between the same processes (``rows.gather_rows``)."""
    if not 0 <= kind < 1 << SLOTS:
        raise ValueError(f"a spare tag's kind must be in [0, {1 << SLOTS}), got {kind}")
    return tag("F", 0, 0, kind)


def activation_of(kind: str, stage: int, mb: int) -> Tuple[int, int]:
    """Which activation a message belongs to: (the stage that takes it as input, micro-batch).

    An activation sent to stage s and the gradient sent back to stage s - 1
    belong to the same one: the gradient has its shapes.
    """
    return (stage + (kind == "B"), mb)


class Route:
    """What a message of a link's order needs at every step, worked out once for the order (``routes``): whether
    this process sends it, whether it is an activation, which activation it belongs to and its tags (``tag + slot``)."""

    __slots__ = ("m", "outgoing", "forward", "at", "tag")

    def __init__(self, m: Message, row: int) -> None:
        self.m = m
        self.outgoing = m.src == row
        self.forward = m.kind == "F"
        self.at = activation_of(m.kind, m.stage, m.mb)
        self.tag = tag(m.kind, m.stage, m.mb, 0)


def routes(order: Sequence[Message], row: int) -> Tuple[List[Route], Dict[Tuple[bool, str, int, int], int]]:
    """The ``Route`` of each message of a link's order at device row ``row``, and each message's index by
    (sent by this row, kind, stage, micro-batch)."""
    return [Route(m, row) for m in order], {(m.src == row, m.kind, m.stage, m.mb): i for i, m in enumerate(order)}
