"""Run each stage's action list: on a worker thread per stage, or in this process.

``run_actions`` is the whole executor for one stage: it walks the stage's
list from the schedule, pulls inputs from the previous stage's channel,
pushes outputs to the next, and records a span per action when tracing.
``ThreadRunner`` runs it for every stage of a process on one ``Workers``
thread per stage, joined by ``LocalChannel``s::

    caller --run(rows, spec)--> ThreadRunner
                                  stage 0 thread: run_actions(F0 F1 B0 ...) --LocalChannel--.
                                  stage 1 thread: run_actions(F0 B0 F1 ...) <---------------'
                                <-- one StageResults per stage (outputs, losses, input grads)

The process that owns one stage of a multi-process pipeline runs the same
``run_actions`` on its main thread (``pipeddp.distributed.stage_runner``).

Threads are persistent (a step is far too short to pay for thread start-up
per stage), daemonic (a forgotten pipeline can never block interpreter exit)
and are stopped and joined by ``ThreadRunner.close``, which the public classes
call from ``close()``, ``__exit__`` and a ``weakref.finalize`` hook.
"""

from __future__ import annotations

import functools
import queue
import threading
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from .channels import Channel, Inbox, LocalChannel, PipelineAborted
from .schedule import Action
from .stage import Grads, Stage, StepSpec
from .trace import Trace

__all__ = ["Workers", "StageResults", "run_actions", "ThreadRunner"]


@dataclass
class StageResults:
    """What one stage produced in a step: last-stage outputs/losses, first-stage input grads."""

    outputs: Dict[int, Any] = field(default_factory=dict)
    losses: Dict[int, torch.Tensor] = field(default_factory=dict)
    input_grads: Dict[int, Grads] = field(default_factory=dict)


def run_actions(
    stage: Stage,
    actions: Sequence[Action],
    spec: StepSpec,
    *,
    prev: Optional[Channel],
    next: Optional[Channel],
    inputs: Optional[Sequence[Any]] = None,
    output_grads: Optional[Sequence[Optional[Grads]]] = None,
    trace: Optional[Trace] = None,
    rank: int = 0,
    stop: Optional[threading.Event] = None,
) -> StageResults:
    """Execute ``actions`` on ``stage``.

    ``prev``/``next`` are channels to the neighbouring stages (None at the
    ends). The first stage reads micro-batch inputs from ``inputs``; the last
    stage takes output gradients from ``output_grads`` (None entries or no list
    at all in a loss step, where backward starts from the loss).

    An exception keeps its type and traceback and gains a note naming the
    rank, stage and action it interrupted (shown under its traceback).
    ``stop``, once set (another stage failed), ends the list before its next
    action: a stage that only sends (a forward-only call) waits on no one and
    would otherwise run all its micro-batches.
    """
    where: List[Action] = []

    def enter(a: Action) -> None:
        if stop is not None and stop.is_set():
            where.clear()  # the message says where it stopped; no action was interrupted
            raise PipelineAborted(f"stage {stage.index} stopped before {a} because another stage failed")
        where.append(a)

    try:
        return _run(stage, actions, spec, prev, next, inputs, output_grads, trace, enter)
    except BaseException as exc:
        if where and hasattr(exc, "add_note"):
            current = where[-1]
            exc.add_note(f"pipeddp: rank {rank}, stage {stage.index}, while running {current} "
                         f"({'forward' if current.kind == 'F' else 'backward'} of micro-batch {current.mb})")
        raise


def _run(
    stage: Stage,
    actions: Sequence[Action],
    spec: StepSpec,
    prev: Optional[Channel],
    next: Optional[Channel],
    inputs: Optional[Sequence[Any]],
    output_grads: Optional[Sequence[Optional[Grads]]],
    trace: Optional[Trace],
    enter: Callable[[Action], None],
) -> StageResults:
    results = StageResults()
    last_backward = max((k for k, a in enumerate(actions) if a.kind == "B"), default=-1)
    stream = stage.streams.compute if (trace is not None and stage.streams.cuda) else None
    for k, a in enumerate(actions):
        enter(a)
        if a.kind == "F":
            if prev is None:
                assert inputs is not None
                value = inputs[a.mb]
            else:
                value = _recv(prev, "F", a.mb, stage, trace)
            if trace is not None:
                with trace.span(stage.index, "F", a.mb, stream):
                    out, loss = stage.forward(a.mb, value, spec)
            else:
                out, loss = stage.forward(a.mb, value, spec)
            if next is not None:
                next.send("F", a.mb, out)
            else:
                results.outputs[a.mb] = out
                if loss is not None:
                    results.losses[a.mb] = loss
        else:
            if next is None:
                grads = output_grads[a.mb] if output_grads is not None else None
            else:
                grads = _recv(next, "B", a.mb, stage, trace)
            sync = spec.sync and k == last_backward
            if trace is not None:
                with trace.span(stage.index, "B", a.mb, stream):
                    gin = stage.backward(a.mb, grads, spec, sync=sync)
            else:
                gin = stage.backward(a.mb, grads, spec, sync=sync)
            if prev is not None:
                prev.send("B", a.mb, gin)
            else:
                results.input_grads[a.mb] = gin
        if trace is not None:
            trace.note_memory(stage.index, len(spec.store(stage.index)), stage.device)
    return results


def _recv(channel: Channel, kind: str, mb: int, stage: Stage, trace: Optional[Trace]) -> Any:
    if trace is None:
        return channel.recv(kind, mb)
    with trace.span(stage.index, "recv", mb, lane="comm"):
        return channel.recv(kind, mb)


class _Worker:
    def __init__(self, name: str, threads: Optional[int]) -> None:
        self.jobs: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self.thread = threading.Thread(target=self._loop, args=(self.jobs, threads), name=name, daemon=True)
        self.thread.start()

    @staticmethod
    def _loop(jobs: "queue.Queue[Optional[tuple]]", threads: Optional[int]) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, fut, grad_mode = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with torch.set_grad_enabled(grad_mode):
                    fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
            finally:
                del fn, fut, job


class Workers:
    """A fixed set of worker threads, one per stage.

    ``run(fns)`` runs ``fns[i]`` on worker ``i`` and waits for all of them. If
    one fails, ``on_error`` is called (the pipeline aborts its inboxes so
    waiting stages wake up), the rest are awaited, and the first real error is
    re-raised in the caller with its original traceback.
    """

    def __init__(self, n: int, *, threads: Optional[int] = None, name: str = "pipeddp") -> None:
        self._workers = [_Worker(f"{name}-stage{i}", threads) for i in range(n)]
        self._closed = False

    def __len__(self) -> int:
        return len(self._workers)

    def run(self, fns: Sequence[Callable[[], Any]], on_error: Callable[[BaseException], None]) -> List[Any]:
        if self._closed:
            raise RuntimeError("this pipeline was closed; create a new one")
        grad_mode = torch.is_grad_enabled()
        futures: List[Future] = []
        for worker, fn in zip(self._workers, fns):
            fut: Future = Future()
            worker.jobs.put((fn, fut, grad_mode))
            futures.append(fut)
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f.exception() for f in futures if f in done and f.exception() is not None]
        if failed:
            on_error(failed[0])
            wait(futures)
            errors = [f.exception() for f in futures if f.exception() is not None]
            real = [e for e in errors if not isinstance(e, PipelineAborted)]
            raise (real[0] if real else errors[0])
        return [f.result() for f in futures]

    def close(self) -> None:
        """Stop and join every worker (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            w.jobs.put(None)
        for w in self._workers:
            if w.thread is not threading.current_thread():
                w.thread.join()

    @property
    def threads(self) -> List[threading.Thread]:
        return [w.thread for w in self._workers]


class ThreadRunner:
    """Every stage of this process on a worker thread of its own, neighbours joined by ``LocalChannel``.

    ``threads`` is the intra-op thread count of each CPU stage's worker
    (default: the caller's count divided among the CPU stages, at least 1), so
    that stages sharing the cores do not oversubscribe them.
    """

    def __init__(self, stages: Sequence[Stage], *, threads: Optional[int], timeout: float, rank: int = 0) -> None:
        self.stages = list(stages)
        self.rank = rank
        cpu_stages = sum(1 for st in self.stages if st.device.type == "cpu")
        if threads is None and cpu_stages > 0:
            threads = max(1, torch.get_num_threads() // cpu_stages)
        self.threads = threads
        n = len(self.stages)
        self._inboxes = [Inbox(st.index) for st in self.stages]
        self._links: List[tuple] = []
        for k, st in enumerate(self.stages):
            prev = LocalChannel(st.streams, self.stages[k - 1].streams, self._inboxes[k], self._inboxes[k - 1],
                                timeout) if k > 0 else None
            nxt = LocalChannel(st.streams, self.stages[k + 1].streams, self._inboxes[k], self._inboxes[k + 1],
                               timeout) if k < n - 1 else None
            self._links.append((prev, nxt))
        self._workers = Workers(n, threads=threads)

    def run(self, rows: Sequence[Sequence[Action]], spec: StepSpec, *, inputs: Optional[Sequence[Any]] = None,
            output_grads: Optional[Sequence[Optional[Grads]]] = None, grad_event: Any = None,
            trace: Optional[Trace] = None) -> List[StageResults]:
        """Run ``rows[k]`` on stage k's thread; return each stage's results (re-raising the first real error)."""
        for inbox in self._inboxes:
            inbox.reset()
        for st in self.stages:
            st.streams.enter()
        if grad_event is not None and self.stages[-1].streams.cuda:
            self.stages[-1].streams.compute.wait_event(grad_event)
        last = len(self.stages) - 1
        stop = threading.Event()
        fns = [functools.partial(run_actions, st, rows[k], spec, prev=self._links[k][0], next=self._links[k][1],
                                 inputs=inputs if k == 0 else None, output_grads=output_grads if k == last else None,
                                 trace=trace, rank=self.rank, stop=stop)
               for k, st in enumerate(self.stages)]

        def abort(exc: BaseException) -> None:
            stop.set()
            for inbox in self._inboxes:
                inbox.abort(exc)

        try:
            return self._workers.run(fns, abort)
        finally:
            for st in self.stages:
                st.streams.leave()

    def close(self) -> None:
        """Stop and join the worker threads (idempotent)."""
        self._workers.close()

    @property
    def worker_threads(self) -> List[threading.Thread]:
        return self._workers.threads
