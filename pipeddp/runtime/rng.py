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
around that code (``ForeignDraws``), once it is found to draw. A thread that
pipeddp does not own cannot be held back; it can only meet a stage's first
forward in a mode (which finds what the stage draws) and a stage that keeps
the process's generator (below), as it would ``torch.utils.checkpoint``'s
replay (torch has no per-thread default generator): every other forward
draws from a generator of its stage's own.

On the CPU the draws of a stage go to a generator of its own: once a
stage's first forward in a mode is seen to draw from the CPU generator and
not to read or set that generator's state itself, and its second (warm) to
run ops large enough (``OWN_MIN_OP_SECONDS`` on average) that a Python
dispatch per op costs less than waiting for the lock would, its forwards
run under a dispatch mode (``_OwnDraws``, this thread only) that hands every
random op of the CPU the stage's generator, seeded as above. Stages then never wait for
each other's lock, and a thread that draws from the process's generator (the
user's, pipeddp's prefetch) cannot shift their numbers. An op that takes no
generator (``rand_like``, the CPU's fused attention with dropout) borrows the
process's generator under its lock with the stage generator's state swapped
in and out, so that it draws what it would have drawn from there. The numbers
are the same either way, bit for bit: a generator seeded alike draws alike.

A stage whose forward reads or sets the process's generator state itself
(``torch.utils.checkpoint`` in a layer stashes it to replay the layer in
backward, outside any pipeddp context; ``fork_rng``; ``manual_seed``) keeps
the process's generator, seeded under its lock for the whole forward, as
that replay needs; so does a compiled stage, where a dispatch mode cannot
reach the ops. Such a stage holds that lock through its backwards too
(``backward_guard``): the layer's replay there sets and draws from the
process's generator, which another stage's seeded forward must not meet.

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
import time
from types import FrameType
from typing import Any, Callable, ContextManager, Dict, FrozenSet, Hashable, Iterator, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Replay", "ForeignDraws", "draw_base_seed", "is_checkpointing", "is_recomputing", "checkpointing",
           "recomputing"]

_locks: Dict[str, threading.RLock] = {}  # re-entrant: a backward that holds it may recompute a forward
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


_SEEDED = torch.Tag.nondeterministic_seeded


def _on_cpu(args: Any, kwargs: Dict[str, Any]) -> bool:
    """Whether a random op draws for the CPU: its tensors are there, or (a factory) its device is."""
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if tensors:
        return all(t.device.type == "cpu" for t in tensors)
    device = kwargs.get("device")
    return device is None or torch.device(device).type == "cpu"


class _OwnDraws(TorchDispatchMode):
    """Every random op of the CPU in this thread draws from ``generator`` (see the module docstring)."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _SEEDED not in func.tags:  # nearly every op: straight through
            return func(*args, **(kwargs or {}))
        kwargs = dict(kwargs or {})
        if not _on_cpu(args, kwargs):
            return func(*args, **kwargs)
        names = [a.name for a in func._schema.arguments]
        if "generator" in names:
            at = names.index("generator")
            if at < len(args):
                if args[at] is None:
                    args = tuple(args[:at]) + (self.generator,) + tuple(args[at + 1:])
            elif kwargs.get("generator") is None:
                kwargs["generator"] = self.generator
            return func(*args, **kwargs)
        with _lock("cpu"):  # no generator argument: the process's generator, in the state ours is in
            saved = torch.get_rng_state()
            torch.set_rng_state(self.generator.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                self.generator.set_state(torch.get_rng_state())
                torch.set_rng_state(saved)


#: the mean time per op at and above which a stage's draws go to its own generator: the dispatch mode that hands
#: the generator over costs some microseconds per op, which small ops would feel more than the lock they spare
OWN_MIN_OP_SECONDS = 1e-4


class _Count(TorchDispatchMode):
    """Counts the ops run in this thread (the first forward's, to judge what a dispatch mode would cost there)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _StateWatch:
    """Whether code run in this thread reads or sets the process's CPU generator (its state, its seed)."""

    def __init__(self) -> None:
        self.touched = False

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and getattr(arg, "__self__", None) is torch.default_generator:
            self.touched = True

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

    ``own_cpu``: the stage's CPU draws may go to a generator of its own (False for a compiled stage).
    """

    def __init__(self, device: torch.device, own_cpu: bool = True) -> None:
        self.candidates: List[str] = ["cpu"] + ([str(device)] if device.type == "cuda" else [])
        self._draws: Dict[Hashable, FrozenSet[str]] = {}
        self.own_cpu = own_cpu
        #: per mode: whether the CPU draws go to ``_generator`` (found with the draws)
        self._own: Dict[Hashable, bool] = {}
        #: per mode: the ops of the first forward (the second's time over them judges the own generator)
        self._ops: Dict[Hashable, int] = {}
        self._generator = torch.Generator()

    def backward_guard(self, mode: Hashable) -> ContextManager[Any]:
        """What a backward of this stage holds: the CPU generator's lock where the stage keeps the process's
        generator and draws from it (a layer that checkpoints itself replays its forward in backward from the
        generator state it stashed, which another stage's seeded forward must not meet halfway); else nothing."""
        known = self._draws.get(mode)
        if known is not None and "cpu" in known and not self._own.get(mode, False):
            return _lock("cpu")
        return contextlib.nullcontext()

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
        own = known is not None and "cpu" in keys and self._own.get(mode, False)
        shared = [k for k in keys if not (own and k == "cpu")]
        # the first forward finds the draws (watched, its ops counted); the second, warm and bare, is timed
        first, timing = known is None, known is not None and mode not in self._own and self.own_cpu
        watch, count = (_StateWatch(), _Count()) if first and self.own_cpu else (None, None)
        with contextlib.ExitStack() as stack:
            for key in shared:
                stack.enter_context(_lock(key))
            saved = {key: _get(key) for key in shared}
            for key in shared:
                _seed(key, seed)
            if own:
                self._generator.manual_seed(seed)
                stack.enter_context(_OwnDraws(self._generator))
            start = {key: _get(key) for key in keys} if first else None
            began = time.perf_counter()
            try:
                with watch.watching() if watch is not None else contextlib.nullcontext(), \
                        count if count is not None else contextlib.nullcontext():
                    yield
            finally:
                if start is not None:
                    self._draws[mode] = frozenset(k for k in keys if not torch.equal(_get(k), start[k]))
                    if watch is None or count is None or watch.touched:
                        self._own[mode] = False  # compiled, or it reads the generator's state: the process's
                    else:
                        self._ops[mode] = count.ops
                elif timing:
                    per_op = (time.perf_counter() - began) / max(self._ops.get(mode, 1), 1)
                    self._own[mode] = per_op >= OWN_MIN_OP_SECONDS
                for key in shared:
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
