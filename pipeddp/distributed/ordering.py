"""``Ordering``: the order in which one process issues the operations of all its links between processes.

Both ends of a link issue its operations in the order ``crossings`` computes from the schedule; a process with
several links issues those of all of them in one order (``in_order``), so that it stays right even where every send
and receive of a rank, to any peer, runs on one stream (see ``p2p``).

Once a process has issued every operation of its step's order, whatever it issues next to the same peers comes after
them at both ends: ``when_issued`` lets the loss agreement post its receives there, in the middle of the process's
last computations, instead of after them (``rows.Gathering``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional, Protocol, Sequence, Tuple

__all__ = ["Ordering", "Link", "when_issued"]


class _Watch:
    """A call waiting for the ``left``-th order begun from now to be wholly issued (``when_issued``)."""

    def __init__(self, callback: Callable[[], None], runs: int) -> None:
        self.callback, self.left = callback, runs


class _Watching(threading.local):
    """The call ``when_issued`` keeps, per thread: two engines stepping on two threads never take each other's."""

    watch: Optional[_Watch] = None


_watching = _Watching()


@contextlib.contextmanager
def when_issued(callback: Optional[Callable[[], None]], runs: int = 1) -> Iterator[None]:
    """Call ``callback`` (None: nothing) as soon as this process has issued every operation of the ``runs``-th
    order begun in the block (a step run ``runs`` times for accumulation: its last), then never again.

    Not called where no such order is wholly issued in the block (a process without links to other processes, or a
    step that failed): the caller then does what it would have done at once, after the block. The runner runs on the
    caller's thread, so the watch is that thread's while the block lasts.
    """
    outer = _watching.watch
    _watching.watch = None if callback is None else _Watch(callback, runs)
    try:
        yield
    finally:
        _watching.watch = outer


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
        self._watch: Optional[_Watch] = None  # the call due once this order is wholly issued (``when_issued``)
        watch = _watching.watch
        if watch is not None and self.entries:
            watch.left -= 1
            if watch.left == 0:
                self._watch = watch

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
        if self.next == len(self.entries):
            self._done()

    def advance(self) -> None:
        """Post the receives that come next, as far as their shapes are known (never waits)."""
        while self.next < len(self.entries):
            ch, j = self.entries[self.next]
            if not ch.post_ahead(j):
                return
            self.next += 1
        self._done()

    def _done(self) -> None:
        """Every operation of the order is issued: the call ``when_issued`` keeps for it, once."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.callback()
