"""Random numbers that replay under recompute, whatever op draws them, independent of thread timing.

Any op may draw from a device's default generator: dropout modules, but
also ``F.dropout`` in a custom layer, ``nn.MultiheadAttention``'s attention
dropout, ``torch.rand_like`` noise. On CPU every stage thread shares one
generator, so draws would interleave in whatever order the threads run
(results would change from run to run), and recompute, which must see the
very numbers of the first forward, would have to rewind a generator that
another thread is using at that moment.

So every micro-batch of a stage that draws runs from a seed of its own,
derived from one base seed drawn in the caller's thread at the start of the
step::

    seed(stage s, micro-batch i) = base + 1_000_003 * s + i

and holds the lock of each generator it draws from while it runs: save the
generator, seed it, run, restore it. Recompute replays the same seed, so it
sees the same numbers, bit for bit, for every op.

Which generators a stage draws from (the CPU one, its CUDA device's, none)
is *found*, not declared: the first forward in each mode (the training flags of its layers)
runs seeded under every candidate's lock and compares each generator's state
after the forward with its state after seeding. From then on a stage that
drew nothing runs without seeding or locks (no cost for a deterministic
stage, and its thread never waits for another's), and one that drew locks
only the generators it used. A layer that starts drawing only later (its
dropout probability raised from 0 during training) needs a new pipeline.

The CPU generator is one per process, so a thread that draws from it while
a stage holds it seeded shifts the stage's numbers, and the replay would see
others. pipeddp's own threads that run user code (the ``prefetch`` thread,
loading a dataset that draws for random crops and flips) take the same lock
around that code (``ForeignDraws``), once it is found to draw. Threads pipeddp
does not own cannot be held back: a user thread that draws from the CPU
generator during a step with dropout under recompute breaks the replay, as it
breaks ``torch.utils.checkpoint``'s (torch has no per-thread default generator).

Why not a generator per stage, which would let CPU stages with dropout run
without waiting for each other's lock? torch's ops draw from the default
generator unless given one, and a layer that checkpoints itself
(``torch.utils.checkpoint``, as Hugging Face's gradient checkpointing does)
stashes and restores the *default* generator's state to replay its forward:
routing the stage's draws elsewhere (a dispatch mode handing each random op a
stage generator) would make that replay draw other numbers than the forward,
silently. So two CPU stages that both draw take turns on the CPU generator's
lock for the length of a forward; stages that draw nothing never wait, nor
do GPU stages on different devices (each draws from its device's generator).

``is_recomputing()`` tells a layer that its forward is a replay (to skip
side effects such as updating statistics); ``is_checkpointing()`` that its
forward is the first one of a micro-batch whose activations will be dropped
and replayed. A layer tells the three forwards apart::

    is_checkpointing()  is_recomputing()
          True               False        first forward, activations dropped (recompute on)
          False              True         the replay in backward
          False              False        a normal forward (kept for backward, or no grad at all)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, FrozenSet, Hashable, Iterator, List, Optional

import torch

__all__ = ["Replay", "ForeignDraws", "draw_base_seed", "is_checkpointing", "is_recomputing", "checkpointing",
           "recomputing"]

_locks: Dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
_state = threading.local()


def draw_base_seed() -> int:
    """A base seed from the global CPU generator (so ``torch.manual_seed`` controls it)."""
    return int(torch.randint(0, 2**62, (1,)).item())


def is_recomputing() -> bool:
    """True while a stage recomputes a forward in backward (activation checkpointing), on that thread."""
    return getattr(_state, "recomputing", False)


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark the body as a recompute, for ``is_recomputing``."""
    before = is_recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = before


def is_checkpointing() -> bool:
    """True, on that thread, while a stage runs a forward whose activations it will drop and recompute in backward.

    The first forward of a micro-batch under ``checkpoint="always"`` (or
    ``"except_last"``, but for the last micro-batch); false in the recompute
    itself (see ``is_recomputing``) and in every other forward.
    """
    return getattr(_state, "checkpointing", False)


@contextlib.contextmanager
def checkpointing() -> Iterator[None]:
    """Mark the body as a forward whose activations will be recomputed, for ``is_checkpointing``."""
    before = is_checkpointing()
    _state.checkpointing = True
    try:
        yield
    finally:
        _state.checkpointing = before


def _lock(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _get(key: str) -> torch.Tensor:
    return torch.get_rng_state() if key == "cpu" else torch.cuda.get_rng_state(key)


def _set(key: str, state: torch.Tensor) -> None:
    if key == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, key)


def _seed(key: str, seed: int) -> None:
    if key == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        with torch.cuda.device(key):
            torch.cuda.manual_seed(seed)


class Replay:
    """The random generators one stage on ``device`` draws from, and the seeded context it runs in."""

    def __init__(self, device: torch.device) -> None:
        self.candidates: List[str] = ["cpu"] + ([str(device)] if device.type == "cuda" else [])
        self._draws: Dict[Hashable, FrozenSet[str]] = {}

    def may_draw(self, mode: Hashable) -> bool:
        """Whether a forward in ``mode`` (the layers' training flags) may draw (unknown counts as yes)."""
        found = self._draws.get(mode)
        return found is None or bool(found)

    @contextlib.contextmanager
    def seeded(self, seed: Optional[int], mode: Hashable) -> Iterator[None]:
        """Run the body from ``seed`` on the generators this stage draws from, then restore them.

        ``seed=None`` (no base seed this step) runs the body as it is.
        """
        known = self._draws.get(mode)
        keys = sorted(self.candidates if known is None else known)  # one lock order everywhere: no deadlock
        if seed is None or not keys:
            yield
            return
        with contextlib.ExitStack() as stack:
            for key in keys:
                stack.enter_context(_lock(key))
            saved = {key: _get(key) for key in keys}
            for key in keys:
                _seed(key, seed)
            start = {key: _get(key) for key in keys} if known is None else None
            try:
                yield
            finally:
                if start is not None:
                    self._draws[mode] = frozenset(k for k in keys if not torch.equal(_get(k), start[k]))
                for key in keys:
                    _set(key, saved[key])


class ForeignDraws:
    """User code that pipeddp runs on a thread of its own, kept out of the stages' seeded forwards.

    ``guarded()`` runs its body under the CPU generator's lock until a run is
    seen not to draw from that generator; from then on without the lock (a
    dataset that draws nothing never waits for a stage with dropout).
    """

    def __init__(self) -> None:
        self.draws: Optional[bool] = None

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        if self.draws is False:
            yield
            return
        with _lock("cpu"):
            before = torch.get_rng_state() if self.draws is None else None
            try:
                yield
            finally:
                if before is not None:
                    self.draws = not torch.equal(before, torch.get_rng_state())
