"""A training run in the log: every ``log_every`` steps, on rank 0, one INFO record of the ``"pipeddp"`` logger.

A library does not print: it logs, and the application decides what shows::

    import logging
    logging.basicConfig(level=logging.INFO)        # pipeddp's lines appear; nothing does without it
    engine = pipeddp.HybridParallel(model, stages=2, log_every=10)
    # INFO:pipeddp:step 10: 0.214 s, 149.5 samples/s, 38272 tokens/s, idle 12% 9%, peak memory 1.4 GiB, ...

Each record carries the step's ``StepStats`` (``runtime.stats``) as ``record.step_stats``, for a handler that
sends figures elsewhere. The figures are the logging rank's own (its devices, in stage mode its stage); every
rank keeps its own in ``engine.last_step``. Nothing is gathered across ranks.
"""

from __future__ import annotations

import logging
from typing import List, Optional

from .runtime.stats import Recorder, StepStats

__all__ = ["Watch", "describe", "logger"]

logger = logging.getLogger("pipeddp")


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def describe(stats: StepStats) -> str:
    """One line: the step's time, throughput, each device's idle share and peak memory, and the waits for peers."""
    parts: List[str] = [f"step {stats.step}: {stats.seconds:.3f} s", f"{stats.samples_per_s:.1f} samples/s"]
    tokens = stats.tokens_per_s
    if tokens is not None:
        parts.append(f"{tokens:.0f} tokens/s")
    idle = [f"{v:.0%}" for v in stats.idle.values() if v is not None]
    if idle:
        parts.append("idle " + " ".join(idle))
    memory = [_bytes(v) for v in stats.peak_memory.values() if v is not None]
    if memory:
        parts.append("peak memory " + " ".join(memory))
    if stats.waiting is not None:
        parts.append(f"waited for peers {stats.waiting:.3f} s")
    return ", ".join(parts)


class Watch:
    """Logs ``recorder``'s step figures every ``log_every`` steps (None: never) where ``rank`` is 0.

    Called after every training step (a ``Step.after_step`` hook); a step that is not logged costs a modulo.
    Every ``log_every``-th step (on every rank) times its actions, for the devices' idle shares.
    """

    def __init__(self, recorder: Recorder, log_every: Optional[int], rank: int) -> None:
        self.recorder = recorder
        self.rank = rank
        self._every: Optional[int] = None
        self.log_every = log_every

    @property
    def log_every(self) -> Optional[int]:
        return self._every

    @log_every.setter
    def log_every(self, value: Optional[int]) -> None:
        self._every = value
        self._next()

    def _next(self) -> None:
        """Whether the coming step is one to log, and so to time."""
        every = self._every
        self.recorder.timing = every is not None and (self.recorder.steps + 1) % every == 0

    def __call__(self) -> None:
        self._next()
        stats = self.recorder.last
        if stats is None or not self._every or self.rank != 0 or stats.step % self._every:
            return
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s", describe(stats), extra={"step_stats": stats})
