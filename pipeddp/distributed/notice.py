"""A failure inside a step, told to every rank of the job at once: a notice in the job's store, and cut connections.

Inside a step the ranks are not in step: a rank whose ``loss_fn`` raises (or its batch, or its stage's forward or
backward) leaves its peers waiting for messages that never come, until the process group's timeout (30 minutes by
default), and then with a transport error (gloo's "Connection closed by peer") that names neither the rank that
failed nor its error. So a rank that fails inside a step or an evaluation (``Notices.guard``)::

    1. posts a notice to the job's store (the rendezvous store its process groups were built on): its rank, stage,
       call and error (type and message, and the note naming the action); the engine's first notice stays
    2. cuts its own gloo connections (``cut``): what a peer waits for from this rank fails there at once
    3. re-raises its own error, its traceback kept, with a note naming its rank, stage and call

A rank whose wait then fails in the transport reads the notice and raises ``PeerFailed``, naming the rank that
failed, its stage and its error, instead of the transport's words; it cuts its own connections in turn, so that a
rank waiting on it learns next (each link of a chain of waits takes milliseconds).

A peer killed or stalled posts nothing, and the rank to notice first may not be the one that waited on it: a DDP
peer's all-reduce fails at once with gloo's words (an address and port), and when a rank stalls, whichever rank's
own timeout expires first may have been waiting on a healthy peer (itself held up by the stalled one). So a rank
failing in the transport does not post at once (``_Settling``): it counts itself in (it is alive), cuts, adds what
its own wait names (``named``: "... from rank 5 ...: that process died, stalled") to the evidence, and waits, a
few seconds at most, for the notice. The first rank to see a named rank not counted in for ``GRACE`` seconds posts
it as the rank that stopped answering (a healthy rank named by a wait that its own hold-up timed out reaches its
guard in that time), at once where every other rank has counted in; one whose error names nobody waits ``WAIT``
seconds for such evidence before it posts its own. The process that serves the store (``linger``) stays until every
rank but the one named has read the notice, a few seconds at most: every wait here is bounded.

Why not wait in slices, polling the store: gloo cannot. A gloo wait with a timeout that expires closes every
connection of its group (gloo signals the timeout to every pair of the context, ``unbound_buffer.cc``), and a gloo
send or receive is never ``is_completed()`` before it is waited for. ``cut`` (its own module) uses the first on
purpose, on a receive that nothing sends, and skips a pair of a lazy group never connected. The healthy path pays
nothing: no poll, no thread, no timed wait. Over nccl the agreements and the activations' headers travel over gloo
twins, which are cut alike; a rank blocked on its GPU (a kernel waiting for an nccl receive) still waits for
NCCL's own timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import torch.distributed as dist

from . import lazy
from .agreement import CollectiveError
from .cut import cut
from .p2p import PeerError
from .topology import Topology

__all__ = ["Notices", "PeerFailed", "cut"]

#: the longest error message a notice carries
LONGEST = 2000
#: how long the process that holds the store waits at most for every rank to have read the notice (``linger``)
LINGER = 5.0
#: how long a rank named by a peer's failed wait has to show it is alive before it is posted as the one that stopped
GRACE = 2.0
#: how long a rank whose failure names no rank waits for evidence that names one before it posts its own
WAIT = 3.0
#: how often a rank that settles the notice looks at the store
POLL = 0.05
#: a failed wait's words for the peer it waited on (``PeerError``, ``rows``): "rank 5 (stage 1) within 20 s: that
#: process died", "no row came from rank 5: that process died"
NAMED = re.compile(r"rank (\d+)(?: \(stage \d+\))?(?: within [^:]*)?: that process died")


class PeerFailed(RuntimeError):
    """Another rank failed inside the step this rank was in; the message names it, its stage and its error."""


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what caused it, and so on."""
    seen: Optional[BaseException] = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__


def from_transport(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a failure of the transport: a wait that a peer's cut ended."""
    return any(isinstance(e, (PeerError, CollectiveError, dist.DistError)) or "gloo" in str(e)
               or "pair closure" in str(e) for e in _causes(exc))


def _own_wait(exc: BaseException) -> Optional[str]:
    """What this rank's own pipeline wait says (``PeerError``: which message from which rank did not come), kept
    beside the notice it raises with: when a peer stalls, the first rank to time out posts the notice, and that may
    be a rank whose wait names no one (a collective), while this one's names the stalled rank."""
    own = next((e for e in _causes(exc) if isinstance(e, PeerError)), None)
    return None if own is None else str(own).split(": that process", 1)[0][:LONGEST]  # without the transport's words


def _lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a wait that failed in the transport, not an agreement's own finding (ranks in different
    calls: every rank's alike, told at once)."""
    if isinstance(exc, CollectiveError):
        return exc.__cause__ is not None
    return from_transport(exc)


def named(exc: BaseException) -> Optional[int]:
    """The rank that ``exc``'s failed wait (or what caused it) waited on in vain, where it names one."""
    found = next((m for m in (NAMED.search(str(e)) for e in _causes(exc)) if m is not None), None)
    return None if found is None else int(found.group(1))


def _note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where Python has it (3.11 on), shown under the traceback."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


class _Settling:
    """Which notice a rank that failed in the transport raises with (see the module's docstring), from the store:
    the keys under the engine's ``key``: ``in/<rank>`` (that rank reached its guard: it is alive) and ``named`` (the
    notices of the ranks whose own wait names a peer, one a line). Every wait is bounded (``WAIT + GRACE``)."""

    def __init__(self, notices: "Notices") -> None:
        self.notices = notices
        self.store = notices.store
        self.key = notices.key
        self.seen: Dict[int, Tuple[float, Dict[str, Any]]] = {}  # a named rank: when first seen, its notice

    def count_in(self) -> None:
        self.notices.count_in()
        self.store.append(f"{self.key}/named", "")  # the key exists from now on: reading it never waits

    def alive(self, rank: int) -> bool:
        return int(self.store.add(f"{self.key}/in/{rank}", 0)) > 0

    def add(self, notice: Dict[str, Any]) -> None:
        self.store.append(f"{self.key}/named", json.dumps(notice) + "\n")

    def settle(self, own: Dict[str, Any]) -> Dict[str, Any]:
        """The notice every rank raises with: one posted already, else the first named rank not counted in for
        ``GRACE`` seconds, else (after ``WAIT`` seconds with none named) ``own``, posted here as this rank's."""
        start = time.monotonic()
        while True:
            posted = self.notices.posted()
            if posted is not None:
                return posted
            now = time.monotonic()
            if now - start < WAIT:
                for line in self.store.get(f"{self.key}/named").decode().splitlines():
                    notice = json.loads(line)
                    self.seen.setdefault(notice["names"], (now, notice))
            waiting = sorted((t, n["names"], n) for t, n in self.seen.values() if not self.alive(n["names"]))
            others = int(self.store.add(f"{self.key}/in", 0)) >= len(self.notices.topology.job_ranks) - 1
            ready = [n for t, _, n in waiting if others or now - t >= GRACE]  # all others in: it is the one
            if ready or (not waiting and now - start >= WAIT) or now - start >= WAIT + GRACE:
                fallback = dict(own, where=self.notices.where(), names=None)  # a named rank alive: no culprit
                fallback.pop("by", None)
                self.notices.publish(ready[0] if ready else fallback)
                continue
            time.sleep(POLL)


class Notices:
    """The failure notices of one engine's steps, in the job's store, and what a rank does when a step fails.

    Every rank builds its engines in the same order, so the n-th engine over the same ranks has the same key on
    every rank (``scope``), and a notice never reaches another engine's steps.
    """

    _made: Dict[Tuple[int, ...], int] = {}

    def __init__(self, topology: Topology, groups: Sequence[Any]) -> None:
        self.topology = topology
        #: the gloo groups cut when a step fails here (the world's, where the pipeline's messages travel, too)
        self.groups = [dist.group.WORLD, *groups]
        ranks = tuple(topology.job_ranks)
        n = Notices._made[ranks] = Notices._made.get(ranks, 0) + 1
        self.key = f"pipeddp/failed/{'-'.join(map(str, ranks))}/{n}"
        self._store: Any = None
        self._raised: Optional[BaseException] = None  # what a guard raised last: an enclosing guard lets it pass
        self._failing = False  # a guard of this engine reached its failure: it cuts the groups itself
        self._outer: Optional[str] = None  # the call of the outermost guard this rank is in
        lazy.on_failure(self.key, self._cut_if_waiting)  # with lazy groups, a notice posted cuts them here too

    def _cut_if_waiting(self) -> None:
        """On the lazy groups' watcher (``lazy``), a notice posted: cut this rank's groups, unless a guard of this
        engine is failing (it cuts them itself), so that a wait of this rank that no peer's cut reaches (a pair
        never connected: see ``lazy``) fails now, and the guard around it raises with the notice."""
        if not self._failing:
            cut(self.groups, self.topology.rank)

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def where(self, rank: Optional[int] = None) -> str:
        """This rank (or ``rank``) and its stage, as the notices name them."""
        topo, rank = self.topology, self.topology.rank if rank is None else rank
        return f"rank {rank}" + (f" (stage {topo.stage_of(rank)})" if topo.mode == "stage" else "")

    def count_in(self) -> None:
        """Count this rank as alive in a failed step (it reached its guard), by itself and among all."""
        self.store.add(f"{self.key}/in/{self.topology.rank}", 1)
        self.store.add(f"{self.key}/in", 1)

    def notice(self, exc: BaseException, call: str) -> Dict[str, Any]:
        """What this rank tells the others of ``exc``; where it is a wait that names the peer it waited on in vain,
        ``names`` that rank, and (but for an agreement's own account of its gathering) the notice is that rank's."""
        notes = [n for n in getattr(exc, "__notes__", []) if n.startswith("pipeddp:")]
        error = f"{type(exc).__name__}: {exc}"
        notice: Dict[str, Any] = {"where": self.where(), "call": call, "error": error[:LONGEST], "notes": notes,
                                  "names": None}
        peer = named(exc) if _lost(exc) else None
        if peer is not None and peer != self.topology.rank:
            notice["names"] = peer
            if not isinstance(exc, CollectiveError):
                with contextlib.suppress(Exception):  # a rank outside this engine's places: named by number
                    notice.update(where=f"rank {peer}", by=self.where())
                    notice.update(where=self.where(peer))
        return notice

    def post(self, exc: BaseException, call: str) -> None:
        """Tell every rank that ``exc`` ended this rank's ``call``, unless a rank did first."""
        with contextlib.suppress(Exception):  # a store that is gone leaves each rank its own error
            self.publish(self.notice(exc, call))

    def publish(self, notice: Dict[str, Any]) -> None:
        """Post ``notice`` unless a rank posted one first; where this one is posted, every rank's watcher is told."""
        mine = json.dumps(notice)
        if self.store.compare_set(self.key, "", mine) == mine.encode():
            lazy.wake()  # (lazy groups only: none is watching otherwise)

    def posted(self) -> Optional[Dict[str, Any]]:
        """The notice posted, if any."""
        if not self.store.check([self.key]):
            return None
        notice: Dict[str, Any] = json.loads(self.store.get(self.key))
        return notice

    def read(self) -> Optional[Dict[str, Any]]:
        """The notice another rank posted, if any (None where none is, or it is this rank's own)."""
        try:
            notice = self.posted()
        except Exception:  # noqa: BLE001 - no store, no notice: the transport's error stands
            return None
        return None if notice is None or notice["where"] == self.where() else notice

    def settle(self, exc: BaseException, call: str) -> Optional[Dict[str, Any]]:
        """For a failure in the transport: count in, cut, and settle which notice every rank raises with
        (``_Settling``); None where that is this rank's own (or the store is gone: its own error stands)."""
        settling: Optional[_Settling] = None
        own = self.notice(exc, call)
        with contextlib.suppress(Exception):
            settling = _Settling(self)
            settling.count_in()
            if own["names"] is not None:
                settling.add(own)
        cut(self.groups, self.topology.rank)  # the ranks held up by this one fail now, and count themselves in
        if settling is None:
            return None
        with contextlib.suppress(Exception):
            notice = settling.settle(own)
            return None if notice["where"] == self.where() else notice
        return None

    def linger(self, notice: Optional[Dict[str, Any]]) -> None:
        """Count this rank as told; in the process that holds the store (world rank 0 under torch's env://
        rendezvous; under torchrun its agent holds it), wait until every rank of the job but the one ``notice``
        names was told, a few seconds at most: this process's exit would take the store, and the notice, with it."""
        with contextlib.suppress(Exception):
            told = self.store.add(f"{self.key}/told", 1)
            if dist.get_rank() != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                return
            lost = notice is not None and notice.get("names") is not None
            deadline = time.monotonic() + LINGER
            while told < self.topology.world_size - lost and time.monotonic() < deadline:
                time.sleep(POLL)
                told = self.store.add(f"{self.key}/told", 0)

    @contextlib.contextmanager
    def guard(self, call: str) -> Iterator[None]:
        """Run a part of ``call`` where the ranks are not in step: a failure here reaches every rank at once. Guards
        may nest (an evaluation's forwards): a failure is told, and its connections cut, once, by the innermost; a
        peer's failure is raised as this rank's outermost call's (what the caller called, wherever it was in it)."""
        outer = self._outer is None
        if outer:
            self._outer = call
        try:
            yield
        except BaseException as exc:
            if self.topology.world_size == 1 or exc is self._raised:
                raise
            self._failing = True
            if _lost(exc):
                notice = self.settle(exc, call)
            else:  # this rank's own error: told at once, before the cut that the others learn of it by
                with contextlib.suppress(Exception):
                    self.count_in()
                notice = None
                self.post(exc, call)
                cut(self.groups, self.topology.rank)
            if notice is None and not any(n.startswith("pipeddp: rank") for n in getattr(exc, "__notes__", [])):
                topo = self.topology
                _note(exc, f"pipeddp: rank {topo.rank}{f', stage {topo.stage}' if topo.mode == 'stage' else ''}, "
                           f"in {call}")
            self.linger(notice if notice is not None else self.read_any())
            if notice is None:
                self._raised = exc
                raise
            failed = PeerFailed(f"{self.where()} stopped its {self._outer or call}: " + _headline(notice))
            own = _own_wait(exc)  # the peer this rank itself waited for, where its wait timed out on it
            for note in [f"on {notice.get('by', notice['where'])}: {n}" for n in notice["notes"]] + getattr(
                    exc, "__notes__", []) + ([f"pipeddp: this rank's own wait: {own}"] if own else []):
                _note(failed, note)
            self._raised = failed
            raise failed from None
        finally:
            if outer:
                self._outer = None

    def read_any(self) -> Optional[Dict[str, Any]]:
        """The notice posted, this rank's own included (None where none is, or no store)."""
        try:
            return self.posted()
        except Exception:  # noqa: BLE001 - no store: nothing to linger for
            return None


def _headline(notice: Dict[str, Any]) -> str:
    """What ``PeerFailed`` says of ``notice``: the rank that failed and its error, or the rank that stopped
    answering and the wait that found it out, and what to do."""
    restart = ("every rank of the job stops with it. Restart the job from its last checkpoint (torchrun "
               "--max-restarts=N restarts it; pipeddp.resume picks up the newest)")
    if "by" in notice:
        return (f"{notice['where']} stopped answering ({notice['by']}, in its {notice['call']}: {notice['error']}). "
                f"Its own output, or the host's (a crash, the OOM killer, a signal, a stopped process), says why; "
                + restart)
    return (f"{notice['where']} failed in its {notice['call']} with {notice['error']}. That error is the one to "
            "fix; " + restart)
