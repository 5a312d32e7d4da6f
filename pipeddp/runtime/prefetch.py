"""Prepare the next batches while the current step runs: the input path as a pipeline of its own.

Without it a training loop is serial: the step waits while the loader reads
and collates the next batch, then the loader waits while the step computes::

    load 0 | step 0 | load 1 | step 1 | ...           a step costs load + compute

With ``prefetch=k`` a daemon thread runs the loader ahead and keeps up to
``k`` batches ready; on CUDA it also pins each batch and copies the inputs to
the first stage's device and the targets to the last stage's on a side
stream, with an event the caller's stream waits for before the batch is
used::

    thread   | load 0 | load 1 | load 2 | ...          (+ pin, copy on the side stream)
    caller            | step 0 | step 1 | step 2 |     a step costs max(load, compute)

What the caller has not received is not consumed: a loader that counts what
it hands out (``data.ElasticLoader``'s position) counts on the caller's side,
so a checkpoint saved mid-epoch resumes at the first batch the caller did not
train, whatever the thread had prepared. The thread ends when the loader is
exhausted, when the caller drops or closes the iterator (a ``break`` out of
the loop), or on an error, which the caller receives in its own thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator, Optional, Tuple

import torch

from .microbatch import tree_map, tree_tensors
from .rng import ForeignDraws

__all__ = ["Prefetcher", "Placement", "check_prefetch"]

#: How long a blocked put or get waits before it looks at the stop flag again (seconds).
_POLL = 0.05


def check_prefetch(prefetch: Any) -> int:
    """``prefetch`` as a count of batches to prepare ahead; ValueError naming it unless a non-negative int."""
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative int (batches prepared ahead of the step; 0: none), got "
                         f"prefetch={prefetch!r}")
    return prefetch


class Placement:
    """Where a batch's inputs and targets go: the first stage's device and the last stage's (None: leave them).

    Only CUDA devices get anything done: pinned host memory, a copy on a side
    stream of the device, and an event to wait for. On CPU a batch stays as the loader made it.
    """

    def __init__(self, inputs: Optional[torch.device] = None, targets: Optional[torch.device] = None) -> None:
        self.inputs, self.targets = inputs, targets
        self._streams: dict = {}

    @property
    def active(self) -> bool:
        return any(d is not None and d.type == "cuda" for d in (self.inputs, self.targets))

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _move(self, value: Any, device: Optional[torch.device], events: list) -> Any:
        if device is None or device.type != "cuda":
            return value
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            moved = tree_map(lambda t: t.pin_memory().to(device, non_blocking=True) if t.device.type == "cpu"
                             else t.to(device, non_blocking=True), value)
        event = torch.cuda.Event()
        event.record(stream)
        events.append((device, event, moved))
        return moved

    def __call__(self, batch: Any) -> Tuple[Any, list]:
        """The batch with its parts on their devices, and the events the consumer waits for."""
        if not self.active:
            return batch, []
        events: list = []
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            x, y = batch
            pair = (self._move(x, self.inputs, events), self._move(y, self.targets, events))
            return (list(pair) if isinstance(batch, list) else pair), events
        return self._move(batch, self.inputs, events), events

    @staticmethod
    def ready(events: list) -> None:
        """Order the consumer's current streams after the copies, and keep the copies' memory for them."""
        for device, event, moved in events:
            current = torch.cuda.current_stream(device)
            current.wait_event(event)
            for t in tree_tensors(moved):
                if t.is_cuda:
                    t.record_stream(current)


_END = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Prefetcher:
    """An iterator over ``make()``'s batches, run up to ``ahead`` batches ahead on a daemon thread.

    ``close`` (also on exhaustion, on an error and when the iterator is
    dropped) stops the thread and joins it.
    """

    def __init__(self, make: Callable[[], Iterator[Any]], ahead: int, place: Optional[Placement] = None) -> None:
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._slots = threading.Semaphore(max(ahead, 1))  # a batch is loaded only into a free slot: k ahead, not k + 1
        self._stop = threading.Event()
        self._place = place
        self._done = False
        self._thread = threading.Thread(target=self._fill, args=(make,), name="pipeddp-prefetch", daemon=True)
        self._thread.start()

    def _slot(self) -> bool:
        """Wait for the caller to take a batch (a free slot); False once stopped."""
        while not self._stop.is_set():
            if self._slots.acquire(timeout=_POLL):
                return True
        return False

    def _fill(self, make: Callable[[], Iterator[Any]]) -> None:
        draws = ForeignDraws()  # a dataset that draws (random crops) must not shift a stage's seeded numbers
        try:
            with ForeignDraws().guarded():  # (a loader that is a generator draws nothing here: judge next() alone)
                batches = make()
            while self._slot():
                try:
                    with draws.guarded():
                        batch = next(batches)
                except StopIteration:
                    self._queue.put(_END)
                    return
                self._queue.put(self._place(batch) if self._place is not None else (batch, []))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread, raised there
            self._queue.put(_Failed(exc))

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=_POLL)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise StopIteration from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failed):
            self.close()
            raise item.exc
        self._slots.release()
        batch, events = item
        if events:
            Placement.ready(events)
        return batch

    def close(self) -> None:
        """Stop the thread, drop what it prepared, and join it."""
        self._done = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __del__(self) -> None:
        if not self._done:
            self.close()
