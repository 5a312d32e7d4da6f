"""Random numbers that replay under recompute, whatever op draws them, independent of thread timing.

Any op may draw from a device's default generator: dropout modules, but
also ``F.dropout`` in a custom layer, ``nn.MultiheadAttention``'s attention
dropout, ``torch.rand_like`` noise, ``torch.randperm``. Recompute must see
the very numbers of the first forward, and results must not depend on
which stage thread draws first.

So every forward of a stage runs from a seed of its own per micro-batch,
derived from one base seed drawn in the caller's thread at the start of the
step::

    seed(stage s, micro-batch i) = base + 1_000_003 * s + i

On every forward of an eager stage, the first included, every random op of
the CPU draws from a generator of the stage's own seeded so (``draws``: it is
handed to the op), so no other thread, the user's included, can shift the
numbers, and stages never take turns on a lock. Nothing is found out first:
a layer that starts drawing late (a dropout probability raised from 0, a
layer switched to training) is seeded like any other. A CUDA stage seeds its
device's generator too, under that generator's lock. (A stage made only of
torch's layers that never draw, read once a step, runs without any of this:
``quiet``.)

A stage whose forward reads or sets the process's CPU generator state itself
(``torch.utils.checkpoint`` in a layer stashes it to replay the layer in
backward, outside any pipeddp context; ``fork_rng``; ``manual_seed``) keeps
the process's generator, seeded under its lock for the whole forward, as
that replay needs. Its first forward in each mode (the training flags of its
layers) is watched: at the first read the process's generator takes the
state the stage's own has reached, and the rest of the forward draws from
it, so the numbers are the same either way. Such a stage holds that lock
through its backwards too (``backward_guard``): the layer's replay there
sets and draws from the process's generator, which another stage's seeded
forward must not meet. Its random ops still reach the kernels there and in
its forwards (``draws.process_draws``), so a tensor-parallel split
(``draws.split_draws``) applies alike in a forward and the layer's replay.
A thread that pipeddp does not own can shift its numbers, as it would
``torch.utils.checkpoint``'s own replay; pipeddp's own
(``prefetch``) takes the lock (``ForeignDraws``). A compiled stage, whose ops
no kernel can reach, draws from the process's generator the same way, with
what it draws (which generators) found on its first forward in each mode.

Python's ``random`` and NumPy's global generator are replayed by state:
``draws.HostDraws``.

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
import sys
import threading
from types import FrameType
from typing import Any, Callable, ContextManager, Dict, FrozenSet, Hashable, Iterator, List, Optional

import torch

from .draws import HostDraws, process_draws, register_kernels, settled, stage_generator, stop_handing

__all__ = ["Replay", "ForeignDraws", "draw_base_seed", "is_checkpointing", "is_recomputing", "checkpointing",
           "recomputing"]

_locks: Dict[str, threading.RLock] = {}  # re-entrant: a backward that holds it may recompute a forward
_locks_guard = threading.Lock()
_state = threading.local()
_FREE = contextlib.nullcontext()  # reusable: what most backwards hold (nothing), entered on every one


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


def _lock(key: str) -> threading.RLock:
    with _locks_guard:
        return _locks.setdefault(key, threading.RLock())


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


class _StateWatch:
    """Whether code run in this thread reads or sets the process's CPU generator (its state, its seed).

    At the first such call the process's generator takes the stage generator's state and the random ops stop
    drawing from the stage's: the rest of the body continues the same stream from the process's."""

    def __init__(self) -> None:
        self.touched = False

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.touched and event == "c_call" and getattr(arg, "__self__", None) is torch.default_generator:
            self.touched = True
            torch.default_generator.set_state(settled().get_state())
            stop_handing()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        before: Optional[Callable[..., Any]] = sys.getprofile()
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(before)


class Replay:
    """The random generators one stage on ``device`` draws from, and the seeded context it runs in.

    ``own_cpu``: the stage's CPU draws go to a generator of its own (False for a compiled stage, whose ops no
    kernel reaches: it keeps the process's generator).
    """

    def __init__(self, device: torch.device, own_cpu: bool = True) -> None:
        self.candidates: List[str] = ["cpu"] + ([str(device)] if device.type == "cuda" else [])
        self.own_cpu = own_cpu
        #: a compiled stage: per mode, the generators its first forward drew from
        self._draws: Dict[Hashable, FrozenSet[str]] = {}
        #: per mode: whether the stage's layers read or set the process's CPU generator (it keeps that one)
        self._keeps: Dict[Hashable, bool] = {}
        #: whether any mode keeps the process's generator (else a backward holds nothing, whatever its mode)
        self._keeping = False
        self._generator = torch.Generator()
        #: Python's random and NumPy's, for the forwards that recompute replays
        self.host = HostDraws()
        if own_cpu:
            register_kernels()

    def holds_nothing(self) -> bool:
        """Whether no backward of this stage holds anything in any mode (``backward_guard``'s rule, read without the
        mode: a CPU stage's backward then enters no context at all)."""
        return not (self._keeping or self._draws)

    def backward_guard(self, mode: Hashable) -> ContextManager[Any]:
        """What a backward of this stage holds: the CPU generator's lock where the stage keeps the process's
        generator and draws from it (a layer that checkpoints itself replays its forward in backward from the
        generator state it stashed, which another stage's seeded forward must not meet halfway), its random ops
        reaching the kernels as in its forward (``_kept``); else nothing."""
        if self.holds_nothing():  # the rule: no mode keeps, nothing compiled found drawing
            return _FREE
        if self._keeps.get(mode, False):
            return _kept()
        if "cpu" in self._draws.get(mode, ()):
            return _lock("cpu")
        return _FREE

    def may_draw(self, mode: Hashable) -> bool:
        """Whether a forward in ``mode`` (the layers' training flags) may draw: always for an eager stage (any
        forward may start to); for a compiled one, unless its first forward in the mode drew nothing."""
        found = self._draws.get(mode)
        return self.own_cpu or found is None or bool(found)

    def seeded(self, seed: Optional[int], mode: Hashable) -> ContextManager[None]:
        """Run the body from ``seed`` on the generators this stage draws from, then restore them.

        ``seed=None`` (no base seed this step) runs the body as it is.
        """
        if seed is None:
            return contextlib.nullcontext()
        if self.own_cpu and self._keeps.get(mode) is False and len(self.candidates) == 1:
            return stage_generator(self._generator, seed)  # the common case, lean: a CPU stage, nothing to hold
        return self._own(seed, mode) if self.own_cpu else self._found(seed, mode)

    @contextlib.contextmanager
    def _own(self, seed: int, mode: Hashable) -> Iterator[None]:
        """An eager stage: its CPU draws from its own generator; the process's seeded where it keeps that."""
        keeps = self._keeps.get(mode)
        shared = self.candidates if keeps is not False else self.candidates[1:]  # a CUDA device's, always
        with _seeded_shared(shared, seed):
            if keeps:
                with process_draws():  # the ops reach the kernels as in the first forward: a tp split applies
                    yield
                return
            watch = _StateWatch() if keeps is None else None
            with stage_generator(self._generator, seed), watch.watching() if watch else contextlib.nullcontext():
                yield
            if watch is not None:
                self._keeps[mode] = watch.touched
                self._keeping = self._keeping or watch.touched

    @contextlib.contextmanager
    def _found(self, seed: int, mode: Hashable) -> Iterator[None]:
        """A compiled stage: the process's generators, seeded; the first forward in a mode finds which."""
        known = self._draws.get(mode)
        keys = self.candidates if known is None else sorted(known)
        with _seeded_shared(keys, seed):
            start = {key: _get(key) for key in keys} if known is None else None
            try:
                yield
            finally:
                if start is not None:
                    self._draws[mode] = frozenset(k for k in keys if not torch.equal(_get(k), start[k]))


@contextlib.contextmanager
def _kept() -> Iterator[None]:
    """A backward of a stage that keeps the process's generator: its lock held, random ops through the kernels."""
    with _lock("cpu"), process_draws():
        yield


@contextlib.contextmanager
def _seeded_shared(keys: List[str], seed: int) -> Iterator[None]:
    """The process's generators ``keys`` held, seeded for the body, and restored after it."""
    with contextlib.ExitStack() as stack:
        for key in sorted(keys):  # one lock order everywhere: no deadlock
            stack.enter_context(_lock(key))
        saved = {key: _get(key) for key in keys}
        for key in keys:
            _seed(key, seed)
        try:
            yield
        finally:
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
