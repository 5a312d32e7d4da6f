"""Record when each stage works on what: the pipeline's timeline.

With ``trace=True`` the executor wraps every action in ``Trace.span``, and
on a communication lane beside it every wait for a message and every send
(the engines add their gradient reductions and per-step collectives)::

    stage 0 | F0 | F1 | F2 | F3 |    | B0 |    | B1 | ...
    stage 1 |    | F0 | F1 | F2 | F3 | B0 | B1 | ...

On CPU a span is two readings of a monotonic clock. On CUDA the work is
asynchronous, so a span records two CUDA events on the stage's compute stream
and is resolved to wall-clock seconds (relative to an event recorded with the
step) only when the timeline is read. Events are kept per step; ``clear``
forgets them. Memory is recorded beside the spans: the peak number of
micro-batches a stage holds activations for, and on CUDA the device's peak
allocation.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["Span", "Trace", "UNTIMED", "timed"]


@dataclass
class Span:
    """One recorded interval; ``stage`` the model stage.

    ``kind``: an action (F, B, I, W) on the ``"compute"`` lane; on the ``"comm"`` lane a wait for a message
    (``recv``), a send (``send``), the wait for sends still in flight at a step's end (``flush``), a gradient
    reduction (``allreduce``, ``reduce_scatter``) and a step's agreement collectives (``agree``).
    """

    stage: int
    kind: str
    mb: int
    start: float
    end: float
    lane: str = "compute"
    rank: int = 0
    #: the device (schedule row) that ran it: the stage itself, unless a device holds several stages
    row: Optional[int] = None

    @property
    def device(self) -> int:
        """The device row this span belongs to (``stage`` where no row was recorded)."""
        return self.stage if self.row is None else self.row

    @property
    def duration(self) -> float:
        return self.end - self.start


class Trace:
    """A thread-safe list of spans (see module docstring)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._spans: List[Span] = []
        self._pending: List[Tuple[int, str, int, str, Any, Any, Any, float, Optional[int]]] = []
        self._anchors: Dict[Any, Tuple[Any, float]] = {}
        #: per device (schedule row), the most micro-batches whose activations its stages held at once
        #: (what its memory scales with)
        self.peak_in_flight: Dict[int, int] = {}
        #: per CUDA device row, ``torch.cuda.max_memory_allocated`` of its device after its actions (bytes)
        self.peak_memory: Dict[int, int] = {}

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._pending.clear()
            self._anchors.clear()
            self.peak_in_flight.clear()
            self.peak_memory.clear()

    def note_memory(self, row: int, in_flight: int, device: torch.device) -> None:
        """Record what device ``row`` holds after an action: micro-batches in flight, and CUDA memory."""
        with self._lock:
            self.peak_in_flight[row] = max(self.peak_in_flight.get(row, 0), in_flight)
            if device.type == "cuda":
                self.peak_memory[row] = max(self.peak_memory.get(row, 0), torch.cuda.max_memory_allocated(device))

    @contextlib.contextmanager
    def span(self, stage: int, kind: str, mb: int, stream: Optional[Any] = None, lane: str = "compute",
             row: Optional[int] = None) -> Iterator[None]:
        """Time the body; ``stream`` (a CUDA stream) switches to CUDA events. ``row``: the device that ran it."""
        if stream is None:
            start = time.perf_counter()
            try:
                yield
            finally:
                end = time.perf_counter()
                with self._lock:
                    self._spans.append(Span(stage, kind, mb, start, end, lane, self.rank, row))
            return
        anchor = self._anchor(stream)
        begin = torch.cuda.Event(enable_timing=True)
        finish = torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        try:
            yield
        finally:
            finish.record(stream)
            with self._lock:
                self._pending.append((stage, kind, mb, lane, begin, finish, anchor[0], anchor[1], row))

    def _anchor(self, stream: Any) -> Tuple[Any, float]:
        """A per-stream reference event with the wall-clock time it was recorded at."""
        with self._lock:
            got = self._anchors.get(stream)
            if got is None:
                torch.cuda.synchronize(stream.device)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(stream)
                ev.synchronize()
                got = (ev, time.perf_counter())
                self._anchors[stream] = got
            return got

    def add(self, span: Span) -> None:
        with self._lock:
            self._spans.append(span)

    @property
    def spans(self) -> List[Span]:
        """All spans, CUDA ones resolved (this synchronises the devices involved)."""
        with self._lock:
            pending, self._pending = self._pending, []
            for stage, kind, mb, lane, begin, finish, anchor, wall, row in pending:
                finish.synchronize()
                start = wall + anchor.elapsed_time(begin) / 1e3
                end = wall + anchor.elapsed_time(finish) / 1e3
                self._spans.append(Span(stage, kind, mb, start, end, lane, self.rank, row))
            return sorted(self._spans, key=lambda s: (s.start, s.stage))

    def to_chrome(self) -> Dict[str, Any]:
        """The spans as a Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev)."""
        spans = self.spans
        t0 = min((s.start for s in spans), default=0.0)
        events = []
        for s in spans:
            events.append({
                "name": f"{s.kind}{s.mb}" if s.mb >= 0 else s.kind,
                "cat": s.kind,
                "ph": "X",
                "ts": (s.start - t0) * 1e6,
                "dur": max(s.duration, 0.0) * 1e6,
                "pid": s.rank,
                "tid": f"device {s.device} {s.lane}" if s.row is not None and s.row != s.stage
                else f"stage {s.stage} {s.lane}",
                "args": {"stage": s.stage, "microbatch": s.mb},
            })
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str) -> None:
        """Write the Chrome/Perfetto JSON trace to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_chrome(), f)

    def to_json(self) -> List[Dict[str, Any]]:
        """Plain list of spans (for merging traces of several ranks)."""
        return [asdict(s) for s in self.spans]


#: reusable: what the work runs in when nothing is traced (entered on every action of an untraced step)
UNTIMED = contextlib.nullcontext()


def timed(trace: Optional[Trace], stage: int, kind: str, mb: int, stream: Any = None, row: Optional[int] = None,
          lane: str = "compute") -> ContextManager[Any]:
    """``trace.span(...)`` around the body, or nothing (no cost but a ``with``) when there is no trace."""
    return UNTIMED if trace is None else trace.span(stage, kind, mb, stream, lane=lane, row=row)
