"""Run each device's action list: on a worker thread per device, or in this process.

``run_actions`` is the whole executor for one device: it walks the device's
row of the schedule, dispatching each action to the stage it names, pulls
inputs from the channels of the devices that send them, pushes outputs to
the devices that take them, and records a span per action when tracing (and,
on the communication lane, each wait for a receive and each send).
``ThreadRunner`` runs it for every device of a process on one ``Workers``
thread per device (``workers``), joined by ``LocalChannel``s::

    caller --run(rows, spec)--> ThreadRunner
                                  device 0 thread: run_actions(F0 F1 B0 ...) --LocalChannel--.
                                  device 1 thread: run_actions(F0 B0 F1 ...) <---------------'
                                <-- one StageResults per device (outputs, losses, input grads)

With virtual stages a device holds several stages (device r: stages r, r + p,
...) and the last device feeds the first device's next stage, so channels
form a ring (in the V, ``placement="v"``, the last device feeds itself and the
way back runs the other way; ``Device.row_of`` says where a neighbour is).
The process that owns one device of a multi-process pipeline runs the same
``run_actions`` on its main thread (``pipeddp.distributed.stage_runner``).

The threads (``workers``) are persistent and daemonic, and are stopped and joined by ``ThreadRunner.close``,
which the public classes call from ``close()``, ``__exit__`` and a ``weakref.finalize`` hook.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from .channels import Channel, Inbox, LocalChannel, PipelineAborted, describe
from .schedule.actions import Action, Kind, Schedule, row_of
from .spec import Grads, StepSpec
from .stage import Stage
from .streams import StageStreams
from .trace import Trace, timed
from .workers import Workers

__all__ = ["Workers", "StageResults", "Device", "run_actions", "ThreadRunner", "group_rows"]


@dataclass
class StageResults:
    """What one device produced in a step: last-stage outputs/losses, first-stage input grads."""

    outputs: Dict[int, Any] = field(default_factory=dict)
    losses: Dict[int, torch.Tensor] = field(default_factory=dict)
    input_grads: Dict[int, Grads] = field(default_factory=dict)
    #: the sum of ``losses`` in micro-batch order (None: none), added by the device that made them once its actions
    #: are over (on a worker thread, while the caller's device may still compute)
    total: Optional[torch.Tensor] = None


@dataclass
class Device:
    """One device of a pipeline (a row of the schedule) and the stages it holds.

    ``row`` is its place in the pipeline, ``rows`` how many devices the
    pipeline has, ``n_stages`` how many stages (``rows * virtual_stages``) and
    ``placement`` which device holds which (``schedule.actions.PLACEMENTS``).
    """

    row: int
    rows: int
    n_stages: int
    stages: Dict[int, Stage]
    placement: str = "loop"

    def row_of(self, stage: int) -> int:
        """The device row of the pipeline that holds ``stage`` (a neighbour's, to send to or receive from)."""
        return row_of(stage, self.rows, self.placement)

    @property
    def index(self) -> int:
        """The row (what error notes and traces name)."""
        return self.row

    @property
    def first(self) -> Stage:
        return self.stages[min(self.stages)]


def group_rows(stages: Sequence[Stage], rows: int, n_stages: int, placement: str = "loop") -> List[Device]:
    """This process's stages as devices (rows), each holding its stages; stages of a row share its streams.

    A device's stages run one after another on one thread, so they compute
    on one stream: its first stage's.
    """
    by_row: Dict[int, Dict[int, Stage]] = {}
    for st in stages:
        by_row.setdefault(row_of(st.index, rows, placement), {})[st.index] = st
    out = []
    for r in sorted(by_row):
        dev = Device(r, rows, n_stages, dict(sorted(by_row[r].items())), placement)
        for st in dev.stages.values():
            st.streams = dev.first.streams
        out.append(dev)
    return out


def run_actions(
    device: Device,
    actions: Sequence[Action],
    spec: StepSpec,
    *,
    links: Mapping[int, Channel],
    inputs: Optional[Sequence[Any]] = None,
    output_grads: Optional[Sequence[Optional[Grads]]] = None,
    trace: Optional[Trace] = None,
    rank: int = 0,
    stop: Optional[threading.Event] = None,
) -> StageResults:
    """Execute ``actions`` on ``device``'s stages.

    ``links[r]`` is the channel to device row ``r`` (only the rows this
    device exchanges data with). Stage 0 reads micro-batch inputs from
    ``inputs``; the last stage takes output gradients from ``output_grads``
    (None entries or no list at all in a loss step, where backward starts
    from the loss).

    An exception keeps its type and traceback and gains a note naming the
    rank, stage and action it interrupted (shown under its traceback).
    ``stop``, once set (another device failed), ends the list before its next
    action: a device that only sends (a forward-only call) waits on no one and
    would otherwise run all its micro-batches.
    """
    where: List[Action] = []
    actions = _normal(actions, device.row)
    try:
        return _run(device, actions, spec, links, inputs, output_grads, trace, where, stop)
    except BaseException as exc:
        if where and hasattr(exc, "add_note"):
            a = where[-1]
            exc.add_note(f"pipeddp: rank {rank}, stage {a.stage}, while running {a} "
                         f"({a.kind.describe} of micro-batch {a.mb})")
        raise


#: rows seen to be normal already, by id (each kept here, so its id names it while it is here): a step's rows are
#: the same tuples every step (``Step._plan``), read once instead of action by action every step
_NORMAL: Dict[int, Tuple[Action, ...]] = {}


def _normal(actions: Sequence[Action], row: int) -> Sequence[Action]:
    """``actions`` in the schedule's vocabulary: a row written by hand may name kinds as strings and leave out the
    stage of a one-stage device (``row``'s)."""
    if type(actions) is tuple and _NORMAL.get(id(actions)) is actions:
        return actions
    out = [a if isinstance(a.kind, Kind) and a.stage is not None
           else Action(Kind(a.kind), a.mb, row if a.stage is None else a.stage) for a in actions]
    if type(actions) is tuple and all(a is b for a, b in zip(out, actions)):
        if len(_NORMAL) >= 256:  # rows of plans no longer used: forgotten
            _NORMAL.clear()
        _NORMAL[id(actions)] = actions
    return out


def last_weight_actions(actions: Sequence[Action]) -> Dict[int, int]:
    """Per stage, the position of its last action that accumulates weight gradients (its last B or W).

    That action carries the data-parallel reduction of the stage's gradients.
    """
    out: Dict[int, int] = {}
    for k, a in enumerate(actions):
        if a.kind is Kind.B or a.kind is Kind.W:
            out[a.at] = k
    return out


def _run(
    device: Device,
    actions: Sequence[Action],
    spec: StepSpec,
    links: Mapping[int, Channel],
    inputs: Optional[Sequence[Any]],
    output_grads: Optional[Sequence[Optional[Grads]]],
    trace: Optional[Trace],
    where: List[Action],
    stop: Optional[threading.Event],
) -> StageResults:
    results = StageResults()
    last_stage = device.n_stages - 1
    arm = set(last_weight_actions(actions).values()) if spec.sync else set()
    stages = device.stages
    first = device.first
    streams = first.streams  # every send and receive runs with the compute stream current (see _recv)
    stream = streams.compute if (trace is not None and streams.cuda) else None
    bare = trace is None and not streams.cuda  # a message needs no context around it: no stream, no span
    # each stage's links to the devices before and after it, looked up once per step rather than per action
    before = {s: _link(links, device.row_of(s - 1), s) for s in stages if s > 0}
    after = {s: _link(links, device.row_of(s + 1), s) for s in stages if s < last_stage}
    for k, a in enumerate(actions):
        if stop is not None and stop.is_set():
            where.clear()  # the message says where it stopped; no action was interrupted
            raise PipelineAborted(f"device {device.row} stopped before {a.label(False)} because another stage failed")
        where.append(a)
        kind, mb, stage = a
        s: int = stage  # type: ignore[assignment]  # normal: every action names its stage
        st = stages.get(s)
        if st is None:
            raise RuntimeError(f"device {device.row} runs an action of stage {s}, which it does not hold "
                               f"(it holds {sorted(stages)})")
        if kind is Kind.F:
            if s == 0:
                if inputs is None:
                    raise RuntimeError("stage 0 was given no inputs")
                value = inputs[mb]
            else:
                value = _recv(before[s], "F", s, mb, device.row, trace, streams)
            if trace is None:
                out, loss = st.forward(mb, value, spec)
            else:
                with timed(trace, s, "F", mb, stream, device.row):
                    out, loss = st.forward(mb, value, spec)
            if s < last_stage:
                if bare:
                    after[s].send("F", s + 1, mb, out)
                else:
                    with streams.computing(), timed(trace, s, "send", mb, None, device.row, lane="comm"):
                        after[s].send("F", s + 1, mb, out)
            else:
                if loss is not None:
                    results.losses[mb] = loss
                else:  # an output the caller reads (a training step reads only its losses)
                    results.outputs[mb] = out
            del out
        elif kind is Kind.B or kind is Kind.I:
            if s == last_stage:
                grads = output_grads[mb] if output_grads is not None else None
            else:
                grads = _recv(after[s], "B", s, mb, device.row, trace, streams)
            if trace is None and kind is Kind.B:
                gin = st.backward(mb, grads, spec, sync=k in arm)
            else:
                with timed(trace, s, kind.value, mb, stream, device.row):
                    gin = st.backward(mb, grads, spec, sync=k in arm) if kind is Kind.B \
                        else st.backward_input(mb, grads, spec)
            if s > 0:
                if bare:
                    before[s].send("B", s - 1, mb, gin)
                else:
                    with streams.computing(), timed(trace, s, "send", mb, None, device.row, lane="comm"):
                        before[s].send("B", s - 1, mb, gin)
            else:
                results.input_grads[mb] = gin
        elif kind is Kind.W:
            with timed(trace, s, "W", mb, stream, device.row):
                st.backward_weight(mb, spec, sync=k in arm)
        else:
            raise ValueError(f"device {device.row}: unknown action kind {kind!r} in {a!r}")
        if trace is not None:
            trace.note_memory(device.row, sum(len(spec.store(i)) for i in stages), first.device)
    where.clear()
    losses = results.losses
    if losses:  # a loss may still hang on its graph (``Stage.forward``): its value, summed outside it
        with streams.computing(), torch.no_grad():  # on CUDA: on the stream the losses were made on
            results.total = torch.stack([losses[i] for i in sorted(losses)]).sum()
    return results


def _link(links: Mapping[int, Channel], row: int, stage: int) -> Channel:
    """The channel to device ``row``; where the runner gave none, one whose messages raise, saying which."""
    channel = links.get(row)
    return channel if channel is not None else _NoLink(stage)


class _NoLink:
    """A neighbour without a channel from this device: a message there raises, saying which."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def send(self, kind: str, stage: int, mb: int, value: Any = None) -> None:
        raise KeyError(f"stage {self.stage} has no link for its {describe(kind)} messages: the runner gave this "
                       "device no channel to that neighbour's device")

    def recv(self, kind: str, stage: int, mb: int) -> Any:
        self.send(kind, stage, mb)


def _recv(channel: Channel, kind: str, stage: int, mb: int, row: int, trace: Optional[Trace],
          streams: StageStreams) -> Any:
    """A message from ``channel``, with the stage's compute stream current: a NCCL receive (and any receive the
    channel posts ahead meanwhile) is then ordered after the stage's kernels, and its wait orders the kernels that
    read it after it; a send likewise runs after the kernels that produced its tensors."""
    if trace is None and not streams.cuda:
        return channel.recv(kind, stage, mb)
    with streams.computing(), timed(trace, stage, "recv", mb, None, row, lane="comm"):
        return channel.recv(kind, stage, mb)


class ThreadRunner:
    """Every device of this process on a worker thread of its own, joined by ``LocalChannel``s.

    ``stages`` are this process's stages of a pipeline of ``n_stages`` stages
    on ``rows`` devices (stage s on device ``row_of(s, rows, placement)``). ``threads`` is the
    intra-op thread count of each CPU device's worker (default: the caller's
    count divided among the CPU devices, at least 1), so that devices sharing
    the cores do not oversubscribe them.
    """

    def __init__(self, stages: Sequence[Stage], *, threads: Optional[int], timeout: float, rank: int = 0,
                 rows: Optional[int] = None, n_stages: Optional[int] = None, placement: str = "loop") -> None:
        n_stages = len(stages) if n_stages is None else n_stages
        rows = len(stages) if rows is None else rows
        self.devices = group_rows(stages, rows, n_stages, placement)
        self.stages = list(stages)
        self.rank = rank
        cpu_devices = sum(1 for d in self.devices if d.first.device.type == "cpu")
        if threads is None and cpu_devices > 0:
            threads = max(1, torch.get_num_threads() // cpu_devices)
        self.threads = threads
        self._inboxes = {d.row: Inbox(d.row) for d in self.devices}
        self._links: List[Dict[int, LocalChannel]] = []
        for d in self.devices:
            links = {}
            for peer in self.devices:
                links[peer.row] = LocalChannel(d.first.streams, peer.first.streams, self._inboxes[d.row],
                                               self._inboxes[peer.row], timeout)
            self._links.append(links)
        #: what a step reads of the devices, found once: the CUDA streams to enter and leave (none on CPU), the
        #: device of the last stage (it takes the output gradients) and which devices take the inputs
        self._cuda_streams = [d.first.streams for d in self.devices if d.first.streams.cuda]
        self._last = next(d for d in self.devices if d.n_stages - 1 in d.stages)
        self._takes_inputs = [0 in d.stages for d in self.devices]
        self._workers = Workers(len(self.devices), threads=threads)
        #: set when a device fails, so the others stop before their next action; one event, cleared per step
        #: (a step starts once every job of the one before has ended: ``Workers.settle``)
        self._stop = threading.Event()

    def run(self, rows: Sequence[Sequence[Action]], spec: StepSpec, *, plan: Optional[Schedule] = None,
            inputs: Optional[Sequence[Any]] = None, output_grads: Optional[Sequence[Optional[Grads]]] = None,
            grad_event: Any = None, trace: Optional[Trace] = None) -> List[StageResults]:
        """Run ``rows[k]`` on device k's thread; return each device's results (re-raising the first real error).

        ``plan``, the whole schedule, is not needed here: the devices of one process pass messages by key.
        A step interrupted in the caller (Ctrl-C) is waited for before the next one clears the inboxes."""
        self._workers.settle()
        for inbox in self._inboxes.values():
            inbox.reset()
        for streams in self._cuda_streams:
            streams.enter()
        last = self._last
        if grad_event is not None and last.first.streams.cuda:
            last.first.streams.compute.wait_event(grad_event)
        stop = self._stop
        if stop.is_set():  # only a failed step set it (clearing takes the event's lock: not every step)
            stop.clear()
        fns = [functools.partial(run_actions, d, rows[k], spec, links=self._links[k],
                                 inputs=inputs if self._takes_inputs[k] else None,
                                 output_grads=output_grads if d is last else None,
                                 trace=trace, rank=self.rank, stop=stop)
               for k, d in enumerate(self.devices)]
        abort = self._abort
        try:
            caller = self._callers_threads()
            if caller and len(fns) == 1:
                if self._workers.closed:
                    raise RuntimeError("this pipeline was closed; create a new one")
                try:
                    return [fns[0]()]
                except BaseException as exc:
                    abort(exc)
                    raise
            return self._workers.run(fns, abort, caller_first=caller)
        finally:
            for streams in self._cuda_streams:
                streams.leave()

    def _abort(self, exc: BaseException) -> None:
        """A device failed: the others stop before their next action, and those waiting on a message wake."""
        self._stop.set()
        for inbox in self._inboxes.values():
            inbox.abort(exc)

    def _callers_threads(self) -> bool:
        """Whether the first device runs on the caller's thread: it wants the caller's intra-op threads.

        Two hand-offs per step (a job there, its result back) are saved; with one
        device the whole step runs there. The worker thread stays for a device
        that asks for another thread count than the caller's.
        """
        return self.threads is None or self.threads == torch.get_num_threads()

    def close(self) -> None:
        """Stop and join the worker threads (idempotent); a device waiting on a channel is woken first."""
        if not self._workers.closed:
            for inbox in self._inboxes.values():
                inbox.abort(PipelineAborted("the pipeline was closed"))
        self._workers.close()

    @property
    def worker_threads(self) -> List[threading.Thread]:
        return self._workers.threads
