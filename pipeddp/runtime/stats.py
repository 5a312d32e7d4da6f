"""The last training step's figures: time, throughput, each device's idle share and memory, waits for peers.

Both engines keep a ``Recorder`` on their ``Step``; at the end of every
training step it leaves a ``StepStats`` (``engine.last_step``)::

    begin (the step's first pass; HybridParallel: before its batch agreement)
      -> the passes run with the recorder's Clock as their trace (a ``timing`` step, CPU devices):
         per device row, seconds computing (F, B, I, W) and waiting on a message
      -> end (after the agreement that closes the step): StepStats

Nothing here makes a device wait: the clock times CPU devices only, and on
CUDA the memory figures are the caching allocator's counters, kept on the
host. A count that a ``Pipeline`` made on a GPU stays there until
``StepStats.tokens`` is read. Timing every action costs a few microseconds
each on the host (small CPU models, 16 to 32 actions a step: 3-6% measured),
so the clock runs only on the steps that ask for it (``timing``: the engines
time the steps they log, every ``log_every``-th); the others' ``idle`` is None.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, ContextManager, Dict, Optional, Sequence, Set, Union

import torch

from .schedule.actions import row_of
from .stage import Stage
from .trace import Trace

__all__ = ["Clock", "Recorder", "StepStats"]

#: what the comm lane's spans wait on: a message from another device, or sends still in flight at a step's end
_WAITS = ("recv", "flush")


@dataclass(frozen=True)
class StepStats:
    """One training step, as this process saw it.

    ``seconds``: from the step's start to its end on the host (a ``HybridParallel`` step ends after the one
    copy of its loss to the host, so it includes the devices' work; a ``Pipeline`` on CUDA does not wait for
    its devices, so there it is the time to issue the step, which in a loop follows the devices' pace).
    ``samples``: the step's samples, every replica together. ``count``: the step's count where the loss_fn
    returned ``(total, count)`` (every replica together), else None; read ``tokens``. ``idle``: per device
    row of this process, the share of ``seconds`` it did not compute (None for a CUDA device, whose busy
    time only its stream knows: ``trace=True`` records it). ``peak_memory``: per device row, the most bytes
    CUDA's allocator has held since the process started or the user last reset its peak
    (``torch.cuda.reset_peak_memory_stats``: the engine leaves the user's counters alone); None on the CPU,
    where no per-device figure exists.
    ``waiting``: seconds this process waited for other processes (the step's agreements, and on a step that
    times its actions, in stage mode on the CPU, its receives and the end-of-step flush); None for a
    one-process engine. ``idle`` too is measured on such steps only (``Recorder.timing``), else None.
    """

    step: int
    seconds: float
    samples: int
    count: Union[None, float, torch.Tensor] = None
    idle: Dict[int, Optional[float]] = field(default_factory=dict)
    peak_memory: Dict[int, Optional[int]] = field(default_factory=dict)
    waiting: Optional[float] = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tokens(self) -> Optional[float]:
        """The step's count (None for a mean loss). A count a ``Pipeline`` made on a GPU is read here: a sync."""
        return float(self.count) if self.count is not None else None

    @property
    def tokens_per_s(self) -> Optional[float]:
        tokens = self.tokens
        if tokens is None:
            return None
        return tokens / self.seconds if self.seconds > 0 else float("nan")


_UNTIMED = contextlib.nullcontext()  # reusable: a span nothing times


class _Tick:
    """One timed span on the clock (and on the user's trace inside it, when there is one)."""

    __slots__ = ("sums", "row", "inner", "start")

    def __init__(self, sums: Dict[int, float], row: int, inner: Optional[ContextManager[Any]]) -> None:
        self.sums, self.row, self.inner = sums, row, inner
        self.start = 0.0

    def __enter__(self) -> None:
        if self.inner is not None:
            self.inner.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.sums[self.row] += time.perf_counter() - self.start  # only this row's thread writes its entry
        if self.inner is not None:
            self.inner.__exit__(*exc)


class Clock(Trace):
    """A trace that keeps no spans: per device row, the seconds its actions computed and waited on messages.

    It stands in the runner's ``trace`` place; a user's trace (``inner``) still gets every span. A span on a
    CUDA stream is left to the inner trace alone (the host's time of an asynchronous kernel is not its time).
    """

    def __init__(self, rows: Sequence[int]) -> None:
        super().__init__()
        self.inner: Optional[Trace] = None
        self.busy: Dict[int, float] = {r: 0.0 for r in rows}
        self.waited: Dict[int, float] = {r: 0.0 for r in rows}
        #: rows whose compute ran on a CUDA stream: their busy time is unknown here
        self.untimed: Set[int] = set()
        #: whether waits on messages are timed (they come from other processes: stage mode)
        self.waits = False

    def reset(self) -> None:
        for sums in (self.busy, self.waited):
            for r in sums:
                sums[r] = 0.0

    # mypy: Trace.span is a generator context manager; this returns a plain one (cheaper on every action)
    def span(self, stage: int, kind: str, mb: int, stream: Optional[Any] = None,  # type: ignore[override]
             lane: str = "compute", row: Optional[int] = None) -> ContextManager[Any]:
        inner = self.inner.span(stage, kind, mb, stream, lane=lane, row=row) if self.inner is not None else None
        r = stage if row is None else row
        if stream is not None:
            self.untimed.add(r)
        sums = None if stream is not None else self.busy if lane == "compute" \
            else self.waited if self.waits and kind in _WAITS else None
        if sums is None or r not in sums:  # nothing to time here: no cost but the inner trace's
            return inner if inner is not None else _UNTIMED
        return _Tick(sums, r, inner)

    def note_memory(self, row: int, in_flight: int, device: torch.device) -> None:
        if self.inner is not None:
            self.inner.note_memory(row, in_flight, device)


class _Agreeing:
    """``Recorder.agreeing``'s span: a plain context manager (entered twice a step; a generator-based one costs
    several times more)."""

    __slots__ = ("recorder", "inner", "start")

    def __init__(self, recorder: "Recorder", inner: ContextManager[Any]) -> None:
        self.recorder, self.inner = recorder, inner
        self.start = 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()
        try:
            self.inner.__enter__()
        except BaseException:
            self.recorder._agreed += time.perf_counter() - self.start
            raise

    def __exit__(self, *exc: Any) -> Optional[bool]:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.recorder._agreed += time.perf_counter() - self.start


def _peak(device: torch.device) -> int:
    """``torch.cuda.max_memory_allocated(device)`` without flattening every counter of the allocator into one dict
    (which costs about as much as a small step's bookkeeping): read from the nested statistics."""
    return int(torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["peak"])


class Recorder:
    """Times the training steps of ``stages`` (this process's share of a pipeline of ``rows`` devices) and keeps
    the last one's ``StepStats`` in ``last``.

    ``replicas`` multiplies the local batch into the step's samples; ``processes`` says whether there are peers to
    wait for, and ``peers`` whether the devices' receives come from other processes (stage mode): both set by the
    distributed engine.
    """

    def __init__(self, stages: Sequence[Stage], rows: int, placement: str = "loop") -> None:
        self.devices: Dict[int, torch.device] = {}
        for st in stages:
            self.devices.setdefault(row_of(st.index, rows, placement), st.device)
        cpu = [r for r, d in self.devices.items() if d.type == "cpu"]
        # once per configuration, not per step: the rows in order, and the CUDA devices whose peaks a step reads
        self._rows = sorted(self.devices.items())
        self._cuda = [d for d in dict.fromkeys(d for _, d in self._rows) if d.type == "cuda"]
        #: None where no device of this process is a CPU: nothing is timed per action
        self.clock: Optional[Clock] = Clock(cpu) if cpu else None
        #: whether the next step times its actions (``idle``, and in stage mode the waits on messages)
        self.timing = False
        self._timed = False
        self.replicas = 1
        self.processes = 1
        self.peers = False
        self.steps = 0
        self.last: Optional[StepStats] = None
        self._start = 0.0
        self._early = False
        self._agreed = 0.0
        self._samples = 0

    def _reset(self) -> None:
        self._start = time.perf_counter()
        self._agreed = 0.0
        self._timed = self.timing and self.clock is not None
        if self._timed and self.clock is not None:
            self.clock.reset()

    def arrive(self) -> None:
        """A step starts before its pass (its batch agreement): ``begin`` then keeps this start."""
        self._reset()
        self._early = True

    def begin(self, samples: int) -> None:
        """A step's passes start on ``samples`` local samples."""
        if not self._early:
            self._reset()
        self._early = False
        self._samples = samples

    def timeline(self, trace: Optional[Trace]) -> Optional[Trace]:
        """What the runner records spans on: the clock (with ``trace`` inside it), or ``trace`` itself where no
        device of this process is timed on the host."""
        if self.clock is None or not self._timed:
            return trace
        self.clock.inner, self.clock.waits = trace, self.peers
        return self.clock

    def agreeing(self, inner: ContextManager[Any]) -> ContextManager[Any]:
        """Around one of a step's agreement collectives: its seconds count as waiting for peers."""
        return _Agreeing(self, inner)

    def end(self, count: Union[None, float, torch.Tensor]) -> StepStats:
        """The step is over (``count``: its count, every replica's, where the loss_fn counted)."""
        seconds = time.perf_counter() - self._start
        self.steps += 1
        clock = self.clock if self._timed else None
        idle: Dict[int, Optional[float]] = {}
        memory: Dict[int, Optional[int]] = {}
        waited = self._agreed
        peaks = {d: _peak(d) for d in self._cuda}
        for r, dev in self._rows:
            idle[r] = None
            if clock is not None and r in clock.busy and r not in clock.untimed and seconds > 0:
                idle[r] = min(max(1.0 - clock.busy[r] / seconds, 0.0), 1.0)
            memory[r] = peaks.get(dev)
            if self.peers and clock is not None and r in clock.waited:
                waited += clock.waited[r]
        self.last = StepStats(self.steps, seconds, self._samples * self.replicas, count, idle, memory,
                              waited if self.processes > 1 else None)
        return self.last
