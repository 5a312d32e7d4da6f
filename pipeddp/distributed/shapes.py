"""``Shapes``: what crossed a link at each (stage, micro-batch), this step and in the last step of each kind.

Both ends of a link keep the same memory, so they predict alike without a word: where every rank's batch has
the shapes of the previous call of its kind (``Agreement.repeated``), each activation is expected as it crossed
at the same (stage, micro-batch) then (``predicted``), and its receives are posted without a header. This step's
activations are kept too, because a gradient crosses back with its activation's shapes and needs no header.
A class of its own because both halves of a channel read and write it: its sends (``p2p``) and the posting of its
receives (``posting``). What it keeps of each activation is its ``predicted.Plan`` (its ``Meta`` and all that
follows from it), so that an activation that crossed as predicted is kept as the very plan it was predicted by.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

from .predicted import Plan

__all__ = ["Shapes"]

Key = Tuple[int, int]  # (the stage that takes the activation as input, micro-batch)


class Shapes:
    """The activations' shapes of this step so far and of the last completed step of each kind (a key)."""

    def __init__(self) -> None:
        self._last: Dict[str, Dict[Key, Plan]] = {}  # per key: every activation of its last completed step
        self._known: Dict[Key, Plan] = {}  # the prediction of this step (empty where its batch does not repeat)
        self._seen: Dict[Key, Plan] = {}  # what crossed this step, kept for the next step of its key
        self._open: Dict[Key, Plan] = {}  # activations whose gradient has not crossed back yet
        self._key = ""

    def begin(self, key: str, repeat: bool) -> None:
        """Start a step of kind ``key``; ``repeat``: predict its activations from that kind's last step."""
        self._key, self._seen = key, {}
        self._open.clear()
        self._known = self._last.get(key, {}) if repeat and key else {}

    def predicted(self, at: Key) -> Optional[Plan]:
        """The shapes the activation at ``at`` is expected to have (None: it crosses after a header)."""
        return self._known.get(at)

    def crossed(self, at: Key, shapes: Plan) -> None:
        """The activation at ``at`` was sent or received with the shapes of ``shapes``."""
        self._open[at] = self._seen[at] = shapes

    def sent(self, at: Key) -> Optional[Plan]:
        """The shapes of the activation at ``at`` if it crossed this step and its gradient has not (else None)."""
        return self._open.get(at)

    def take(self, at: Key) -> Plan:
        """The shapes of the activation at ``at``, whose gradient crosses now."""
        return self._open.pop(at)

    @property
    def pending(self) -> int:
        """How many activations still wait for their gradient to cross back."""
        return len(self._open)

    def finish(self) -> None:
        """The step ran to completion: what crossed is what its kind's next step may predict from."""
        if self._key:
            self._last[self._key] = self._seen

    def clear(self) -> None:
        """A step failed: forget everything (no later step may predict from what it left half crossed)."""
        self._open.clear()
        self._last.clear()
