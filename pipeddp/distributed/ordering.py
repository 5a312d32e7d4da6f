"""``Ordering``: the order in which one process issues the operations of all its links between processes.

Both ends of a link issue its operations in the order ``crossings`` computes from the schedule; a process with
several links issues those of all of them in one order (``in_order``), so that it stays right even where every send
and receive of a rank, to any peer, runs on one stream (see ``p2p``).
"""

from __future__ import annotations

from typing import Protocol, Sequence, Tuple

__all__ = ["Ordering", "Link"]


class Link(Protocol):
    """What the order needs of a channel (``p2p.P2PChannel``): its ends, and posting its receives."""

    rank: int
    peer: int

    def post_next(self, j: int) -> None: ...

    def post_ahead(self, j: int) -> bool: ...


class Ordering:
    """The order in which this process issues the operations of all its links (``in_order``), one after another.

    With it, no channel posts a receive ahead of an operation that comes before
    it on another link: the process stays right even where all its sends and
    receives, to every peer, run on one stream.
    """

    def __init__(self, entries: Sequence[Tuple[Link, int]]) -> None:
        self.entries = list(entries)  # (channel, index in its link's order)
        self.next = 0

    def catch_up(self, channel: Link, upto: int) -> None:
        """Post every receive that comes before ``channel``'s message ``upto`` (waiting for headers and flags)."""
        while self.next < len(self.entries) and self.entries[self.next] != (channel, upto):
            ch, j = self.entries[self.next]
            ch.post_next(j)
            self.next += 1
        if self.next == len(self.entries):
            raise RuntimeError(f"pipeddp: rank {channel.rank}'s message {upto} to or from rank {channel.peer} is "
                               "not in this step's order")

    def issued(self) -> None:
        """The operation the order stands at was issued (a send, or a receive posted)."""
        self.next += 1

    def advance(self) -> None:
        """Post the receives that come next, as far as their shapes are known (never waits)."""
        while self.next < len(self.entries):
            ch, j = self.entries[self.next]
            if not ch.post_ahead(j):
                return
            self.next += 1
