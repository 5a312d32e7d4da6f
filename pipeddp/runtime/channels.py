"""Move activations forward and gradients backward between the devices of a pipeline.

A device talks to every device it exchanges data with (its own included,
where one device holds consecutive stages) through a *channel* with two
calls::

    channel.send(kind, stage, mb, value)   kind "F": the input of ``stage`` (an activation)
                                           kind "B": the gradient of ``stage``'s output
    channel.recv(kind, stage, mb) -> value

Messages are named by the stage that *receives* them, so two stages on one
device (virtual stages) never mix their messages. ``LocalChannel`` connects
two devices of one process (threads): ``send`` copies the value to the
peer's device on the copy stream and drops it in the peer's ``Inbox``;
``recv`` waits for it there. ``P2PChannel`` (``pipeddp.distributed.p2p``)
connects devices in different processes with ``torch.distributed`` send/recv.
The executor cannot tell them apart, which is why one executor serves both
the threaded pipeline and the one-device-per-process mode.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Dict, Hashable, Optional, Protocol, Tuple

from .microbatch import tree_map
from .streams import StageStreams

__all__ = ["Channel", "Inbox", "LocalChannel", "PipelineAborted", "describe", "device_copy"]

#: ``(kind, stage, mb)``: what a message is, named by the stage that receives it
Key = Tuple[str, int, int]


class Channel(Protocol):
    """A device's link to one device: what the executor needs, and all it needs.

    ``kind`` is ``"F"`` (the input of ``stage``, an activation) or ``"B"`` (the
    gradients of ``stage``'s output); ``mb`` is the micro-batch. ``recv``
    returns the value ready to use on this device.
    """

    def send(self, kind: str, stage: int, mb: int, value: Any) -> None: ...

    def recv(self, kind: str, stage: int, mb: int) -> Any: ...


class PipelineAborted(RuntimeError):
    """Raised in a stage that was waiting when another stage failed."""


def describe(kind: str) -> str:
    return "activation" if kind == "F" else "gradient"


class _Abort:
    """The message that wakes a waiting device when the step failed elsewhere."""


_ABORT = _Abort()


class Inbox:
    """The mailbox of one device, keyed by ``(kind, stage, micro-batch)``; its own thread takes from it.

    Keys make the order of arrival irrelevant: a schedule may consume messages
    in another order than they were produced (one that arrives early waits in
    a stash of the consumer's). Delivery is one C-level queue operation, the
    cheapest hand-off between two Python threads. ``abort`` wakes the waiter
    with an error (each woken waiter passes the wake-up on, so every waiter
    wakes), so one failing stage never leaves the others blocked.
    """

    def __init__(self, row: int) -> None:
        self.row = row
        self._queue: "queue.SimpleQueue[Tuple[Hashable, Any]]" = queue.SimpleQueue()
        self._stash: Dict[Hashable, Any] = {}
        self._lock = threading.Lock()  # guards the stash against a second taker
        self._error: Optional[BaseException] = None

    def put(self, key: Hashable, item: Any) -> None:
        self._queue.put((key, item))

    def take(self, key: Key, timeout: float, source: int) -> Any:
        """The message ``key`` (waiting up to ``timeout`` seconds for it), sent by device ``source``."""
        if self._stash:  # read without the lock: only this device's thread takes, and an empty stash is the rule
            with self._lock:
                if key in self._stash:
                    return self._stash.pop(key)
        deadline = time.monotonic() + timeout
        left = timeout  # the first wait: the whole timeout (one clock reading per message, not two)
        while True:
            if self._error is not None:
                raise self._aborted(key)
            try:
                got, item = self._queue.get(timeout=max(left, 0.0)) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                raise self._timeout(key, timeout, source) from None
            if got == key:
                return item
            if item is _ABORT:
                self._queue.put((got, item))  # wake the next waiter too
                raise self._aborted(key)
            with self._lock:
                self._stash[got] = item
            left = deadline - time.monotonic()

    def _aborted(self, key: Key) -> PipelineAborted:
        kind, stage, mb = key
        return PipelineAborted(f"stage {stage} stopped waiting for the {describe(kind)} of micro-batch {mb} "
                               f"because another stage failed: {self._error!r}")

    def _timeout(self, key: Key, timeout: float, source: int) -> TimeoutError:
        kind, stage, mb = key
        return TimeoutError(
            f"stage {stage} waited {timeout:.0f} s for the {describe(kind)} of micro-batch {mb} from the device "
            f"of stage {stage - 1 if kind == 'F' else stage + 1} (device {source}); that stage is stuck or too slow "
            "(raise timeout= if a micro-batch really takes this long)"
        )

    def abort(self, error: BaseException) -> None:
        self._error = error
        self._queue.put((None, _ABORT))

    def reset(self) -> None:
        """Forget leftovers and errors of a previous step (a failed step leaves both behind).

        Called between steps, when no device takes or sends: after a step that took every message (the rule)
        there is nothing to forget, which three reads tell without taking the lock."""
        if not self._stash and self._error is None and self._queue.empty():
            return
        with self._lock:
            self._stash.clear()
        while not self._queue.empty():  # no one sends between steps: what is there is all there is (no raise per step)
            self._queue.get_nowait()
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
    """A device's link to another device of the same process (or to itself).

    ``own``/``peer`` are the streams of this device and the other one;
    ``inbox`` is this device's inbox and ``outbox`` the other's.
    """

    def __init__(self, own: StageStreams, peer: StageStreams, inbox: Inbox, outbox: Inbox, timeout: float) -> None:
        self.own = own
        self.peer = peer
        self.inbox = inbox
        self.outbox = outbox
        self.timeout = timeout
        #: two CPU devices, or one: a message is the value itself (decided here, not per message)
        self.as_is = own.device == peer.device and not own.cuda

    def send(self, kind: str, stage: int, mb: int, value: Any) -> None:
        self.outbox.put((kind, stage, mb), (value, None) if self.as_is else device_copy(value, self.own, self.peer))

    def recv(self, kind: str, stage: int, mb: int) -> Any:
        value, event = self.inbox.take((kind, stage, mb), self.timeout, self.outbox.row)
        return value if self.as_is else self.own.adopt(value, event)  # as is: nothing to wait for, nothing to adopt
