"""Persistent worker threads, one per device: run a step's jobs, hand back results or the first real error.

::

    caller --run([fn0, fn1])--> worker 0: fn0()  --.
                                worker 1: fn1()  --+--> one queue --> results, or the first real error
                                                       (a dead thread is noticed within a second)

Threads are persistent (a step is far too short to pay for thread start-up
per stage), daemonic (a forgotten pipeline can never block interpreter exit)
and stopped and joined by ``Workers.close``. They know nothing of stages or
schedules: ``ThreadRunner`` (``executor``) gives them ``run_actions`` jobs.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch

from .channels import PipelineAborted

__all__ = ["Workers"]


class _Worker:
    """One persistent thread: runs the jobs it is given, one at a time, and reports each to ``done``.

    Its setup (the intra-op thread count) can fail; the error is kept and
    every job, the current and every later one, is answered with it, so a
    caller never waits for a thread that is gone.
    """

    def __init__(self, name: str, threads: Optional[int], done: "queue.SimpleQueue[tuple]") -> None:
        self.jobs: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self.done = done
        self.fatal: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._loop, args=(threads,), name=name, daemon=True)
        self.thread.start()

    def _loop(self, threads: Optional[int]) -> None:
        try:
            if threads is not None:
                torch.set_num_threads(threads)
        except BaseException as exc:  # noqa: BLE001 - every job is answered with it
            self.fatal = exc
        while True:
            job = self.jobs.get()
            if job is None:
                return
            run, k, fn, grad_mode, abort = job
            try:
                if self.fatal is not None:
                    raise RuntimeError(f"pipeddp: the worker thread {self.thread.name} could not start: "
                                       f"{self.fatal!r}") from self.fatal
                with torch.set_grad_enabled(grad_mode):
                    result = fn()
                self.done.put((run, k, True, result))
                del result  # handed over: this thread keeps nothing of the step until its next job
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                if abort is not None:  # the caller runs a job itself and reads ``done`` only after it
                    abort(exc)
                self.done.put((run, k, False, exc))
                del exc
            finally:
                del fn, job


class Workers:
    """A fixed set of worker threads, one per device.

    ``run(fns)`` runs ``fns[i]`` on worker ``i`` and waits for all of them:
    each reports to one queue, the cheapest wake-up there is. If one fails,
    ``on_error`` is called (the pipeline aborts its inboxes so waiting devices
    wake up), the rest are awaited, and the first real error is re-raised in
    the caller with its original traceback. A worker thread that died is
    noticed within a second and reported instead of waited for.
    """

    def __init__(self, n: int, *, threads: Optional[int] = None, name: str = "pipeddp") -> None:
        self._done: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._workers = [_Worker(f"{name}-stage{i}", threads, self._done) for i in range(n)]
        self._closed = False
        self._run = 0
        #: (run, worker) of jobs still running for a step whose caller stopped waiting (an interrupt)
        self._unfinished: Set[Tuple[int, int]] = set()

    def __len__(self) -> int:
        return len(self._workers)

    def run(self, fns: Sequence[Callable[[], Any]], on_error: Callable[[BaseException], None], *,
            caller_first: bool = False) -> List[Any]:
        """``fns[i]`` on worker ``i``; with ``caller_first``, ``fns[0]`` on the calling thread instead, while the
        workers run the rest: two hand-offs a step fewer (the first job handed over, its result handed back)."""
        if self._closed:
            raise RuntimeError("this pipeline was closed; create a new one")
        self.settle()
        self._run += 1
        run = self._run
        grad_mode = torch.is_grad_enabled()
        first = 1 if caller_first else 0
        for k in range(first, len(fns)):
            # with the caller running a job itself, a failed worker aborts the step at once from its own thread:
            # the caller reads the workers' results only after its job, which may wait for the failed one
            self._workers[k].jobs.put((run, k, fns[k], grad_mode, on_error if caller_first else None))
        n = len(fns)
        results: List[Any] = [None] * n
        errors: List[BaseException] = []
        pending = set(range(first, n))
        if caller_first:
            try:
                results[0] = fns[0]()
            except BaseException as failed:  # noqa: BLE001 - reported as a worker's error is
                on_error(failed)
                errors.append(failed)
                if not isinstance(failed, Exception):  # Ctrl-C in the caller: the devices are told to stop, not waited
                    self._unfinished |= {(run, k) for k in pending}
                    raise
        try:
            while pending:
                try:
                    got_run, k, ok, value = self._done.get(timeout=1.0)
                except queue.Empty:
                    dead = [self._workers[k].thread.name for k in pending if not self._workers[k].thread.is_alive()]
                    if dead:
                        exc = RuntimeError(f"pipeddp: worker thread(s) {dead} died without finishing the step")
                        if not errors:
                            on_error(exc)
                        errors.append(exc)
                        pending -= {k for k in pending if not self._workers[k].thread.is_alive()}
                    continue
                if got_run != run:  # left over from a step its caller stopped waiting for
                    continue
                pending.discard(k)
                if ok:
                    results[k] = value
                else:
                    if not errors:
                        on_error(value)
                    errors.append(value)
        except BaseException as exc:  # Ctrl-C (or SystemExit) in the caller: wake the devices that wait, then go
            if not errors:
                on_error(exc)
            self._unfinished |= {(run, k) for k in pending}
            raise
        if errors:
            real = [e for e in errors if not isinstance(e, PipelineAborted)]
            raise (real[0] if real else errors[0])
        return results

    def settle(self) -> None:
        """Wait for the jobs of a step whose caller stopped waiting (an interrupt mid-step).

        Its devices were told to stop, but one may still be inside an action;
        finishing it, it would hand its output to the *next* step's inboxes,
        which the next step would take for its own. So a step starts only once
        every job of an earlier one has ended (or its thread has died).
        """
        while self._unfinished:
            try:
                got_run, k, _, _ = self._done.get(timeout=1.0)
            except queue.Empty:
                self._unfinished = {(r, k) for r, k in self._unfinished if self._workers[k].thread.is_alive()}
                continue
            self._unfinished.discard((got_run, k))

    def close(self, wait: float = 2.0) -> None:
        """Stop and join every worker (idempotent), waiting at most ``wait`` seconds in all.

        A worker still in a long computation when the caller was interrupted is
        left to finish on its own (a daemon thread): closing, and so the exit of
        the process, never waits for it beyond ``wait``.
        """
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            w.jobs.put(None)
        deadline = time.monotonic() + wait
        for w in self._workers:
            if w.thread is not threading.current_thread():
                w.thread.join(max(deadline - time.monotonic(), 0.0))

    @property
    def threads(self) -> List[threading.Thread]:
        return [w.thread for w in self._workers]

    @property
    def closed(self) -> bool:
        return self._closed
