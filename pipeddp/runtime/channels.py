"""Move activations forward and gradients backward between neighbouring stages.

Every stage talks to its neighbours through a *channel* with two calls::

    channel.send(kind, mb, value)    kind "F": activation, "B": gradients
    channel.recv(kind, mb) -> value

``LocalChannel`` connects two stages of one process (threads): ``send`` copies
the value to the peer's device on the copy stream and drops it in the peer's
``Inbox``; ``recv`` waits for it there. ``P2PChannel`` (see ``p2p.py``)
connects stages in different processes with ``torch.distributed`` send/recv.
The executor cannot tell them apart, which is why one executor serves both
the threaded pipeline and the one-stage-per-process mode.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Dict, Hashable, Optional, Protocol, Tuple

from .microbatch import tree_map
from .streams import StageStreams

__all__ = ["Channel", "Inbox", "LocalChannel", "PipelineAborted", "describe", "device_copy"]


class Channel(Protocol):
    """A stage's link to one neighbour: what the executor needs, and all it needs.

    ``kind`` is ``"F"`` (an activation, sent to the next stage) or ``"B"`` (the
    gradients of an activation, sent back to the previous stage); ``mb`` is the
    micro-batch. ``recv`` returns the value ready to use on this stage's device.
    """

    def send(self, kind: str, mb: int, value: Any) -> None: ...

    def recv(self, kind: str, mb: int) -> Any: ...


class PipelineAborted(RuntimeError):
    """Raised in a stage that was waiting when another stage failed."""


def describe(kind: str) -> str:
    return "activation" if kind == "F" else "gradient"


class Inbox:
    """Thread-safe mailbox of one stage, keyed by ``(kind, micro-batch)``.

    Keys make the order of arrival irrelevant: a custom schedule may consume
    micro-batches in another order than they were produced. ``abort`` wakes
    every waiter with an error, so one failing stage never leaves the others
    blocked.
    """

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self._cv = threading.Condition()
        self._items: Dict[Hashable, Any] = {}
        self._error: Optional[BaseException] = None

    def put(self, key: Hashable, item: Any) -> None:
        with self._cv:
            self._items[key] = item
            self._cv.notify_all()

    def take(self, key: Tuple[str, int], timeout: float, source: int) -> Any:
        deadline = time.monotonic() + timeout
        with self._cv:
            while key not in self._items:
                if self._error is not None:
                    raise PipelineAborted(
                        f"stage {self.stage} stopped waiting for the {describe(key[0])} of micro-batch {key[1]} "
                        f"because another stage failed: {self._error!r}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"stage {self.stage} waited {timeout:.0f} s for the {describe(key[0])} of micro-batch "
                        f"{key[1]} from stage {source}; that stage is stuck or too slow (raise timeout= if "
                        "a micro-batch really takes this long)"
                    )
                self._cv.wait(left)
            return self._items.pop(key)

    def abort(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify_all()

    def reset(self) -> None:
        """Forget leftovers and errors of a previous step (a failed step leaves both behind)."""
        with self._cv:
            self._items.clear()
            self._error = None


def device_copy(value: Any, src: StageStreams, dst: StageStreams) -> Tuple[Any, Optional[Any]]:
    """Copy a tensor tree from ``src``'s device to ``dst``'s; return it and a 'ready' event.

    On CPU -> CPU nothing moves. Between CUDA devices the copy is issued on the
    copy streams (after the producer's compute), the source tensors are marked
    as used by the copy stream (``record_stream``) so their memory is not reused
    while the copy is in flight, and the returned event tells the consumer when
    the data has landed.
    """
    if src.device == dst.device:
        return value, src.record_event()
    if not (src.cuda or dst.cuda):
        return tree_map(lambda t: t.to(dst.device), value), None
    with contextlib.ExitStack() as stack:
        if src.cuda:
            stack.enter_context(src.copying())
            src.copy.wait_stream(src.compute)
        if dst.cuda:
            stack.enter_context(dst.copying())
        out = tree_map(lambda t: t.to(dst.device, non_blocking=True), value)
        if src.cuda:
            copy_stream = src.copy
            tree_map(lambda t: t.record_stream(copy_stream), value)
        event = dst.copy.record_event() if dst.cuda else None
    if not dst.cuda:
        # Device -> host into pageable memory: the host thread must not read it early.
        src.copy.synchronize()
    return out, event


class LocalChannel:
    """One direction-pair between two stages of the same process.

    ``own``/``peer`` are the streams of this stage and its neighbour;
    ``outbox`` is the neighbour's inbox and ``inbox`` this stage's own.
    """

    def __init__(self, own: StageStreams, peer: StageStreams, inbox: Inbox, outbox: Inbox, timeout: float) -> None:
        self.own = own
        self.peer = peer
        self.inbox = inbox
        self.outbox = outbox
        self.timeout = timeout

    def send(self, kind: str, mb: int, value: Any) -> None:
        self.outbox.put((kind, mb), device_copy(value, self.own, self.peer))

    def recv(self, kind: str, mb: int) -> Any:
        value, event = self.inbox.take((kind, mb), self.timeout, self.outbox.stage)
        return self.own.adopt(value, event)
