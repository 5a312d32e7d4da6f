"""pipeddp's gloo groups connect a pair of ranks when the pair first exchanges something, and the store stays up.

A gloo group made eagerly is a full mesh: every member connects to every other when the group is made, through
the rendezvous store (a ``get`` and a ``wait`` per peer). The job's group alone is N - 1 sockets and 2 (N - 1)
store operations per rank; a step uses O(log N) of them (the agreements' tree, the pipeline's neighbours, DDP's
ring). torch makes a gloo group lazily where ``TORCH_GLOO_LAZY_INIT=1`` is set when the group is made
(docs/scale.md), so with ``PIPEDDP_LAZY_GROUPS=1`` pipeddp sets it around the groups it makes itself
(``made_lazily``: its stage, pipeline, job and gloo-twin groups, and the process group where the engine starts it)
and restores it exactly after: the user's own groups stay as the user made them.

With a watcher for the failure notices. A rank that fails cannot close a connection it never made:
gloo makes one side of each pair connect and the other only accept, so a peer whose collective meets it for the
first time after it failed waits, where the peer accepts, for a connection that never comes (up to gloo's connect
timeout, 25-40 s whatever the group's), and where the peer connects, for data from a process still alive (up to
its timeout). Nothing that rank does reaches that wait, so the peer ends it itself: each process that makes such
groups watches the store (``_watch``, a thread blocked in one ``wait`` on its own clone of the store: no poll) for
its own ``WAKE`` key, which the rank that posts a failure notice sets for every rank (``wake``: one ``set`` per rank,
on failure alone), and the process itself when it leaves (then it joins the thread: a thread still inside the
store's client when an interpreter exits ends the process, "terminate called without an active exception"); the
watcher then cuts the groups of each
engine whose notice is posted (``on_failure``; the engine's own cut, which closes a pair waiting to be accepted
too), unless the engine is failing already.

Off by default all the same: a pair whose connection completes after its group was closed (a cut's receive, or
a stuck wait, left waiting to accept, and the peer connecting after; or a connection of this rank's in flight when
the group closed) is registered with gloo's event loop as connected although it failed, and gloo ends the
process (``std::terminate``, "enforce fail ... pair.cc:688 ex_ == nullptr") at that pair's next event, the peer's
exit included. Nothing outside gloo tells which pairs are connected, so no cut can avoid it (docs/scale.md: the
world rank 0 of a 16-process job so ended in one of four lost-rank cases, taking the store, and two survivors'
notices, with it).

The price of a connection made late: it goes through the store, and the store lives in world rank 0's process
(``pipeddp.spawn``, torchrun's ``env://`` without its agent's store). Were rank 0 to leave first, a rank whose last
collective connects to a peer for the first time would fail ("Did the remote server shutdown"). So every process
that made such a group counts itself in (``hold``: ``joined``) and, when it is done, out (``leave``: ``left``; at
the close of an engine that started the process group, before it is destroyed, else at the process's exit), and
the process that serves the store waits at its exit until every process counted in has left. The wait is
bounded by the engine's timeout and skipped where the job is failing anyway: a failure notice posted
(``watch``; ``notice``) or this process ending on an exception, which must not keep the peers waiting on it.
Not covered: a job on a mesh whose world rank 0 builds no engine (it never waits), and a process group the user
destroys and makes again on the same port while the old store is held (the new one would share its server).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import uuid
from datetime import timedelta
from multiprocessing import util
from types import TracebackType
from typing import Any, Callable, Dict, Iterator, List, Optional, Type

import torch.distributed as dist

__all__ = ["ENV", "enabled", "made_lazily", "watch", "leave", "failed", "on_failure", "wake"]

#: the setting: "1" pipeddp's gloo groups connect on first use, "0" (default) as full meshes when made
ENV = "PIPEDDP_LAZY_GROUPS"
#: torch's switch, read when each gloo process group is made
TORCH_ENV = "TORCH_GLOO_LAZY_INIT"
#: the store keys that count the processes in and out
JOINED, LEFT = "pipeddp/lazy/joined", "pipeddp/lazy/left"
#: how often the process that serves the store looks whether every process has left
POLL_S = 0.02
#: the store keys (``WAKE/<name>/<rank>``) that wake each process's watcher: "failed" (a failure notice is posted),
#: "done" (the process leaves); on the store under the process group's prefixes, the name set once per process group
#: (``WAKE_ID``: its first writer)
WAKE, WAKE_ID = "pipeddp/lazy/wake", "pipeddp/lazy/wake-id"
#: how long the watcher's one store wait lasts before it is posted again (a timeout of days may overflow)
WATCH_FOR = timedelta(hours=1)
#: how long a process that leaves waits at most for its watcher to end
JOIN_S = 2.0


def enabled() -> bool:
    """Whether pipeddp makes its gloo groups lazily (``PIPEDDP_LAZY_GROUPS``, default off: see the module)."""
    value = os.environ.get(ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: set it to 1 (pipeddp's gloo groups connect each pair of ranks on first "
                         "use) or 0 (every group a full mesh of connections when it is made, the default)")
    return value == "1"


class _Stay:
    """This process's count in the store that its lazy groups connect through (see the module docstring)."""

    def __init__(self, store: Any, timeout: timedelta) -> None:
        self.store = store  # held: the server stays up while the process lives, even past destroy_process_group
        self.timeout = timeout
        self.serves = dist.get_rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        self.world = dist.group.WORLD  # a process group made after this one is destroyed counts anew
        self.notices: List[str] = []
        self.acts: Dict[str, Callable[[], None]] = {}  # a notice's key: what the watcher does once it is posted
        self.open = True  # till this process leaves
        store.add(JOINED, 1)
        self.base = store
        while isinstance(self.base, dist.PrefixStore):  # a clone of a PrefixStore over a store of Python's is broken
            self.base = self.base.underlying_store
        self.wake = f"{WAKE}/{store.compare_set(WAKE_ID, '', uuid.uuid4().hex).decode()}"
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.thread: Optional[threading.Thread] = None
        with contextlib.suppress(Exception):  # a store that cannot be cloned (a user's own class): no watcher
            client = self.base.clone()
            self.thread = threading.Thread(target=_watch, args=(self, client), name="pipeddp-lazy-watch", daemon=True)
            self.thread.start()

    def leave(self, wait: bool = True) -> None:
        """Count this process out; where it serves the store, wait until every process counted in is out."""
        self.open = False
        if self.thread is not None and self.thread is not threading.current_thread():
            with contextlib.suppress(Exception):
                self.base.set(f"{self.wake}/{self.rank}", "done")
                self.thread.join(JOIN_S)
        with contextlib.suppress(Exception):  # a store that is gone has nobody left to serve
            self.store.add(LEFT, 1)
            if not (wait and self.serves) or _failed[0]:
                return
            deadline = time.monotonic() + self.timeout.total_seconds()
            while (self.store.add(LEFT, 0) < self.store.add(JOINED, 0) and time.monotonic() < deadline
                   and not any(self.store.check([key]) for key in self.notices)):
                time.sleep(POLL_S)


_stay: List[Optional[_Stay]] = [None]
_failed = [False]
_hooks_set = [False]


def _hold(timeout: timedelta) -> None:
    """Count this process in, once per process group (the exit hook set up on the first)."""
    if not dist.is_initialized():
        return
    if _stay[0] is not None and _stay[0].world is not dist.group.WORLD:  # destroyed by the user, made anew
        leave(wait=False)
    if _stay[0] is not None:
        _stay[0].timeout = max(_stay[0].timeout, timeout)
        return
    if not _hooks_set[0]:
        util.Finalize(None, leave, exitpriority=100)  # at exit, in a plain process and in a multiprocessing child
        previous = sys.excepthook

        def on_uncaught(kind: Type[BaseException], exc: BaseException, tb: Optional[TracebackType]) -> None:
            failed()
            previous(kind, exc, tb)

        sys.excepthook = on_uncaught
        _hooks_set[0] = True
    _stay[0] = _Stay(dist.distributed_c10d._get_default_store(), timeout)


@contextlib.contextmanager
def made_lazily(timeout: timedelta) -> Iterator[None]:
    """Make the gloo groups created inside connect on first use (with ``PIPEDDP_LAZY_GROUPS=1``); the variable
    torch reads is restored exactly after, and this process is counted in the store's users (``_hold``)."""
    if not enabled():
        yield
        return
    _hold(timeout)  # before the group where a store exists: a peer may connect to this process as soon as it is made
    before = os.environ.get(TORCH_ENV)
    os.environ[TORCH_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[TORCH_ENV]
        else:
            os.environ[TORCH_ENV] = before
    _hold(timeout)  # the process group itself: its store exists now


def watch(key: str) -> None:
    """A failure notice's store key (``Notices.key``): once posted, the exit does not wait for the others."""
    if _stay[0] is not None:
        _stay[0].notices.append(key)


def _watch(stay: _Stay, client: Any) -> None:
    """The watcher (see the module docstring): wait on ``client`` (a clone of the store: a wait on the store itself
    would hold every other operation of this process on it) until ``WAKE`` is set; where a failure set it, do what
    each engine whose notice is posted registered (``on_failure``: cut its groups). Ends with the process group."""
    while stay.open:
        try:
            client.wait([f"{stay.wake}/{stay.rank}"], WATCH_FOR)
        except Exception as exc:  # noqa: BLE001 - the wait's own timeout: again; anything else: the store is gone
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                continue
            return
        with contextlib.suppress(Exception):
            if client.get(f"{stay.wake}/{stay.rank}") == b"failed":
                for key, act in list(stay.acts.items()):
                    if stay.store.check([key]):  # not blocking: the process's own client
                        act()
        return


def on_failure(key: str, act: Callable[[], None]) -> None:
    """Once the failure notice ``key`` is posted (``wake``), this process's watcher calls ``act`` (with lazy groups)."""
    if _stay[0] is not None:
        _stay[0].acts[key] = act


def wake() -> None:
    """This rank posted a failure notice: every process's watcher looks which (``on_failure``); a ``set`` per rank."""
    stay = _stay[0]
    if stay is not None:
        with contextlib.suppress(Exception):
            for rank in range(stay.size):
                stay.base.set(f"{stay.wake}/{rank}", "failed")


def leave(wait: bool = True) -> None:
    """This process is done with pipeddp's groups (see the module docstring); the next process group counts anew."""
    stay, _stay[0] = _stay[0], None
    if stay is not None:
        stay.leave(wait)


def failed() -> None:
    """This process ends on an error: its exit does not wait for the others (they fail on its connections)."""
    _failed[0] = True
