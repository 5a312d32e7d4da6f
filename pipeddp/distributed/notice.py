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
rank waiting on it learns next (each link of a chain of waits takes milliseconds). A rank that fails with no
notice posted (a peer killed or stalled) raises its own error and posts it: the others name it and what it saw.

Why not wait in slices, polling the store: gloo cannot. A gloo wait with a timeout that expires closes every
connection of its group (gloo signals the timeout to every pair of the context, ``unbound_buffer.cc``), and a gloo
send or receive is never ``is_completed()`` before it is waited for. ``cut`` uses the first on purpose, on a receive
that nothing sends. The healthy path pays nothing: no poll, no thread, no timed wait. Over nccl the agreements and
the activations' headers travel over gloo twins, which are cut alike; a rank blocked on its GPU (a kernel waiting
for an nccl receive) still waits for NCCL's own timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .agreement import CollectiveError
from .p2p import PeerError, spare_tag
from .topology import Topology

__all__ = ["Notices", "PeerFailed", "cut"]

#: the tag of the receive that cuts a gloo group's connections (nothing ever sends it)
CUT_TAG = spare_tag(31)
#: the longest error message a notice carries
LONGEST = 2000
#: how long the process that holds the store waits at most for every rank to have read the notice (``linger``)
LINGER = 3.0


class PeerFailed(RuntimeError):
    """Another rank failed inside the step this rank was in; the message names it, its stage and its error."""


def cut(groups: Sequence[Any], rank: int) -> None:
    """Close this process's connections of every gloo group in ``groups`` (see the module's docstring): every
    operation posted there, here or by a peer with this process, fails at once. The groups are unusable after."""
    seen: List[Any] = []
    for group in groups:
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER or any(group is g for g in seen):
            continue
        seen.append(group)
        try:
            if dist.get_backend(group) != "gloo":
                continue
            members = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):  # destroyed: nothing left to close
            continue
        if rank in members:
            _cut_group(group, [r for r in members if r != rank])


def _cut_group(group: Any, peers: Sequence[int]) -> None:
    """Wait 1 ms for the cut's receive from each of ``peers`` in turn, until one such wait expires: gloo closes the
    group's every connection then. A receive from a peer that cut its connections first fails at once, on that
    closed connection alone, and leaves this process's others open (a rank blocked on one of them, in a collective
    that the peers' cuts do not reach, would wait out the timeout): so the next peer is tried."""
    for peer in peers:
        try:
            _cut_receive(group, peer).wait(timedelta(milliseconds=1))
        except (RuntimeError, ValueError) as exc:
            if "Timed out" in str(exc):  # the wait expired: every connection is closed (no need to try the rest)
                return
            continue  # that peer's connection was closed already (or closed while waiting): try the next
        return


def _cut_receive(group: Any, peer: int) -> Any:
    """The receive that cuts ``group``: posted on the process group object, as ``dist.irecv`` posts it, but past
    whatever wraps ``dist.irecv`` to order the pipeline's messages (NCCL's one stream per pair of ranks, as the
    tests emulate it on gloo, queues a receive behind the pair's earlier operations and waits for it on a thread:
    there this wait would expire on the queue, and the connections would stay open). It is no message of the
    pipeline and must act at once."""
    return group.recv([torch.empty(1)], dist.get_group_rank(group, peer), CUT_TAG)


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


def _note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where Python has it (3.11 on), shown under the traceback."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


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

    @property
    def store(self) -> Any:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def where(self) -> str:
        topo = self.topology
        return f"rank {topo.rank}" + (f" (stage {topo.stage})" if topo.mode == "stage" else "")

    def post(self, exc: BaseException, call: str) -> None:
        """Tell every rank that ``exc`` ended this rank's ``call``, unless a rank did first."""
        notes = [n for n in getattr(exc, "__notes__", []) if n.startswith("pipeddp:")]
        error = f"{type(exc).__name__}: {exc}"
        notice = {"where": self.where(), "call": call, "error": error[:LONGEST], "notes": notes}
        with contextlib.suppress(Exception):  # a store that is gone leaves each rank its own error
            self.store.compare_set(self.key, "", json.dumps(notice))

    def read(self) -> Optional[Dict[str, Any]]:
        """The notice another rank posted, if any (None where none is, or it is this rank's own)."""
        try:
            if not self.store.check([self.key]):
                return None
            notice: Dict[str, Any] = json.loads(self.store.get(self.key))
        except Exception:  # noqa: BLE001 - no store, no notice: the transport's error stands
            return None
        return None if notice["where"] == self.where() else notice

    def linger(self) -> None:
        """Count this rank as told; in the process that holds the store (world rank 0 under torch's env://
        rendezvous; under torchrun its agent holds it), wait until every rank of the job was told, a few seconds at
        most: this process's exit would take the store, and the notice, with it."""
        with contextlib.suppress(Exception):
            told = self.store.add(f"{self.key}/told", 1)
            if dist.get_rank() != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                return
            deadline = time.monotonic() + LINGER
            while told < self.topology.world_size and time.monotonic() < deadline:
                time.sleep(0.02)
                told = self.store.add(f"{self.key}/told", 0)

    @contextlib.contextmanager
    def guard(self, call: str) -> Iterator[None]:
        """Run a part of ``call`` where the ranks are not in step: a failure here reaches every rank at once. Guards
        may nest (an evaluation's forwards): a failure is told, and its connections cut, once, by the innermost."""
        try:
            yield
        except BaseException as exc:
            if self.topology.world_size == 1 or exc is self._raised:
                raise
            notice = self.read() if from_transport(exc) else None
            if notice is None:
                self.post(exc, call)
                if not any(n.startswith("pipeddp: rank") for n in getattr(exc, "__notes__", [])):
                    topo = self.topology
                    _note(exc, f"pipeddp: rank {topo.rank}{f', stage {topo.stage}' if topo.mode == 'stage' else ''}, "
                               f"in {call}")
            cut(self.groups, self.topology.rank)
            self.linger()
            if notice is None:
                self._raised = exc
                raise
            failed = PeerFailed(
                f"{self.where()} stopped its {call}: {notice['where']} failed in its {notice['call']} with "
                f"{notice['error']}. That error is the one to fix; every rank of the job stops with it. Restart the "
                "job from its last checkpoint (torchrun --max-restarts=N restarts it; pipeddp.resume picks up the "
                "newest)")
            own = _own_wait(exc)  # the peer this rank itself waited for, where its wait timed out on it
            for note in [f"on {notice['where']}: {n}" for n in notice["notes"]] + getattr(exc, "__notes__", []) + (
                    [f"pipeddp: this rank's own wait: {own}"] if own else []):
                _note(failed, note)
            self._raised = failed
            raise failed from None
