"""NCCL's rules for point-to-point messages, imposed on gloo, so that the CPU suite proves what GPUs need.

gloo pairs a send with the receive of the same tag; NCCL ignores tags. Between two ranks it pairs the n-th send
with the n-th receive, per direction, and runs the operations of one pair of ranks one after another on one
stream: an operation starts only when the one issued before it (either direction) has met its peer. A transport
that posts receives ahead in another order than its peer sends, or that issues a receive its peer will only
match after a send queued behind it, works on gloo and aborts, corrupts or hangs on GPUs.

``install()`` replaces ``torch.distributed.isend`` and ``irecv`` with versions that, while
``PIPEDDP_P2P_RULES`` is ``nccl`` (the suite's default, set by ``conftest``; read at every call, so a job
spawned with ``env={"PIPEDDP_P2P_RULES": "tags"}`` runs the ordinary tagged path):

* strip the tag (gloo then pairs by posting order, as NCCL does);
* queue each operation on a FIFO per (group, peer), run by a thread of its own that issues it on gloo only
  after the previous one has completed (NCCL's one stream per pair of ranks). The caller gets a work object at
  once, as from NCCL, and its ``wait(timeout)`` waits for that operation.

Collectives are untouched (NCCL runs them on other communicators). Installed in every process that imports
``conftest`` (every spawned test job) and explicitly by the torchrun scripts under ``tests/``.

``PIPEDDP_P2P_RULES=nccl-one`` runs all of a rank's operations, to every peer, on one stream: what a process
group whose single sends and receives share its one communicator would do (torch gives each pair its own today;
pipeddp's transport is right under both).

``as_on_nccl()`` completes the picture: the engine's agreements and headers then take gloo twins of its groups, as
they do beside nccl.
"""

from __future__ import annotations

import os
import queue
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["install", "active", "as_on_nccl"]

_REAL: Dict[str, Callable[..., Any]] = {}
_STREAMS: Dict[Tuple[int, int], "_PairStream"] = {}
_LOCK = threading.Lock()


def active() -> bool:
    """Whether point-to-point calls follow NCCL's rules now (``PIPEDDP_P2P_RULES``, default ``nccl``; ``nccl-one``:
    one stream for every peer of a rank, what a process group bound to a device may use for its P2P)."""
    return os.environ.get("PIPEDDP_P2P_RULES", "nccl") in ("nccl", "nccl-one")


class _Work:
    """What an emulated operation returns: done when its turn on the pair's stream has come and it completed."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if not self.done.wait(seconds):
            raise RuntimeError(f"{self.what} did not complete within {seconds} s (NCCL rules: it waits for every "
                               "operation issued before it between the same two ranks)")
        if self.error is not None:
            raise RuntimeError(f"{self.what} failed: {self.error}") from self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


class _PairStream:
    """The operations between this rank and one peer, run one at a time in the order they were issued."""

    def __init__(self, peer: int) -> None:
        self.queue: "queue.SimpleQueue[Tuple[Callable[[], Any], _Work]]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"nccl-rules-peer{peer}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            issue, work = self.queue.get()
            try:
                issue().wait()
            except BaseException as exc:  # the peer died or the group went away: this work fails, the next go on
                work.error = exc
            work.done.set()


def _stream(group: Any, peer: int) -> _PairStream:
    one = os.environ.get("PIPEDDP_P2P_RULES") == "nccl-one"
    key = (id(group) if group is not None else 0, -1 if one else peer)
    with _LOCK:
        if key not in _STREAMS:
            _STREAMS[key] = _PairStream(peer)
        return _STREAMS[key]


def _isend(tensor: torch.Tensor, dst: Optional[int] = None, group: Any = None, tag: int = 0, **kw: Any) -> Any:
    if not active():
        return _REAL["isend"](tensor, dst, group, tag, **kw)
    work = _Work(f"send of {tuple(tensor.shape)} {tensor.dtype} to rank {dst}")
    _stream(group, int(dst if dst is not None else -1)).queue.put(
        (lambda: _REAL["isend"](tensor, dst, group, 0, **kw), work))
    return work


def _irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Any = None, tag: int = 0, **kw: Any) -> Any:
    if not active():
        return _REAL["irecv"](tensor, src, group, tag, **kw)
    if src is None:
        raise RuntimeError("NCCL rules: a receive must name its source rank")
    work = _Work(f"receive of {tuple(tensor.shape)} {tensor.dtype} from rank {src}")
    _stream(group, int(src)).queue.put((lambda: _REAL["irecv"](tensor, src, group, 0, **kw), work))
    return work


def install() -> None:
    """Put the rules in place in this process (idempotent)."""
    if _REAL:
        return
    _REAL["isend"], _REAL["irecv"] = c10d.isend, c10d.irecv
    for module in (dist, c10d):
        module.isend = _isend  # type: ignore[assignment]
        module.irecv = _irecv  # type: ignore[assignment]


def as_on_nccl() -> None:
    """Make the engines built in this process take gloo twins of their groups for the agreements and the
    activations' headers, as on an nccl job (``groups.host_group``), while the job itself runs gloo."""
    from pipeddp.distributed import build, groups

    real = groups.host_group
    build.host_group = groups.host_group = lambda topo, ranks, _, group, timeout: real(topo, ranks, "nccl", group,
                                                                                      timeout)
