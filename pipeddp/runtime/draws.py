"""Where a stage's random ops draw from: a generator of the stage's own, handed to every CPU random op.

torch has one default CPU generator per process. Seeding it for a stage's
forward cannot keep its numbers for the replay while any other thread (the
user's, a data loader's) draws from it too. So every random op of the CPU
that runs in a stage's forward draws from the stage's own generator instead:
``stage_generator(g)`` hands ``g`` to each one in this thread, as its
``generator`` argument, or through the overload that takes one
(``rand``, ``randn_like``, ``randint``, ``randperm``), or, for the one op of
the CPU that has none (``native_dropout``), through the same draws written
with it. No other thread can reach ``g``.

How the ops are reached: a Python kernel for each random aten op is
registered once under the ``PreDispatch`` dispatch key, which torch consults
only in a thread that includes it in its dispatch keys (torch.export's
pre-dispatch tracing does; nothing else). ``stage_generator`` includes it for
its body. Every other op passes that key inside the dispatcher (no Python),
so a forward that draws nothing pays next to nothing, and one that draws
pays a Python call per random op, not per op as a ``TorchDispatchMode``
would. The numbers are those of the process's generator seeded alike: a
generator seeded alike draws alike, and the generator overloads are the
ones the generator-less ops call inside torch.

``HostDraws`` keeps Python's ``random`` and NumPy's global generator
replayable: a forward whose activations recompute will drop records their
states where it changed them, and its replay runs from those states again.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

__all__ = ["stage_generator", "stop_handing", "HostDraws", "register_kernels"]

_KEY = torch._C.DispatchKey.PreDispatch
_KEYSET = torch._C.DispatchKeySet(_KEY)
_SEEDED = torch.Tag.nondeterministic_seeded
_state = threading.local()
_registered: List[Any] = []  # the Library that holds the kernels (kept alive), once registered
_register_guard = threading.Lock()


def _on_cpu(args: Any, kwargs: Dict[str, Any]) -> bool:
    """Whether a random op draws for the CPU: its tensors are there, or (a factory) its device is."""
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if tensors:
        return all(t.device.type == "cpu" for t in tensors)
    device = kwargs.get("device")
    return device is None or torch.device(device).type == "cpu"


def _signature(op: Any) -> List[Tuple[str, str]]:
    return sorted((a.name, str(a.type)) for a in op._schema.arguments)


def _with_generator(op: Any) -> Optional[Any]:
    """The overload of ``op`` that takes the same arguments and a generator (``rand`` -> ``rand.generator``)."""
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[1])
    want = _signature(op)
    for name in packet.overloads():
        other = getattr(packet, name)
        theirs = _signature(other)
        if [a for a in theirs if a[0] != "generator"] == want and len(theirs) == len(want) + 1:
            return other
    return None


def _native_dropout(generator: torch.Generator, input: torch.Tensor, p: float,
                    train: Optional[bool]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``native_dropout`` (which takes no generator) drawing from ``generator``: a mask kept with probability
    ``1 - p``, and the input scaled by it, as torch's CPU kernel computes them."""
    if train is False or input.numel() == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    keep = 1.0 - p
    mask = torch.empty_like(input).bernoulli_(keep, generator=generator)
    return input * mask * (0.0 if keep == 0 else 1.0 / keep), mask.bool()


def _kernel(op: Any) -> Optional[Callable[..., Any]]:
    """The PreDispatch kernel that hands this thread's stage generator to ``op`` (None: ``op`` needs none)."""
    names = [a.name for a in op._schema.arguments]
    if "generator" in names:
        at = names.index("generator")

        def hand(generator: torch.Generator, args: Any, kwargs: Dict[str, Any]) -> Any:
            if at < len(args):
                if args[at] is None:
                    args = tuple(args[:at]) + (generator,) + tuple(args[at + 1:])
            elif kwargs.get("generator") is None:
                kwargs["generator"] = generator
            return op(*args, **kwargs)
    elif str(op) == "aten.native_dropout.default":
        def hand(generator: torch.Generator, args: Any, kwargs: Dict[str, Any]) -> Any:
            return _native_dropout(generator, *args, **kwargs)
    else:
        overload = _with_generator(op)
        if overload is None:  # a device's own op (cudnn, flash attention on CUDA): not the CPU's
            return None

        def hand(generator: torch.Generator, args: Any, kwargs: Dict[str, Any]) -> Any:
            return overload(*args, generator=generator, **kwargs)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            generator = getattr(_state, "generator", None)
            if generator is None or not _on_cpu(args, kwargs):
                return op(*args, **kwargs)
            return hand(generator, args, dict(kwargs))

    return kernel


def register_kernels() -> None:
    """Register the kernels, once per process (before any thread includes the key)."""
    with _register_guard:
        if _registered:
            return
        library = torch.library.Library("aten", "IMPL")
        for name in dir(torch.ops.aten):
            packet = getattr(torch.ops.aten, name, None)
            if not isinstance(packet, torch._ops.OpOverloadPacket):
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if _SEEDED not in op.tags or torch._C._dispatch_has_kernel_for_dispatch_key(
                        op.name(), "CompositeImplicitAutograd"):
                    continue  # not random, or made of other ops (dropout, lstm) that reach their own kernels
                kernel = _kernel(op)
                if kernel is not None:
                    library.impl(op, kernel, "PreDispatch")
        _registered.append(library)


@contextlib.contextmanager
def stage_generator(generator: torch.Generator) -> Iterator[None]:
    """Every random op of the CPU run in this thread by the body draws from ``generator``."""
    before = getattr(_state, "generator", None), torch._C._dispatch_tls_is_dispatch_key_included(_KEY)
    _state.generator = generator
    torch._C._dispatch_tls_set_dispatch_key_included(_KEY, True)
    try:
        yield
    finally:
        torch._C._dispatch_tls_set_dispatch_key_included(_KEY, before[1])
        _state.generator = before[0]


def stop_handing() -> None:
    """The rest of the body of ``stage_generator`` in this thread draws from the process's generator."""
    _state.generator = None


# -- Python's random and NumPy's global generator -------------------------------------------------------------

_host_lock = threading.RLock()
HostState = Tuple[Any, Any]


def _host_get() -> HostState:
    numpy = sys.modules.get("numpy")  # not imported: nothing can have drawn from it
    return random.getstate(), (numpy.random.get_state() if numpy is not None else None)


def _host_set(state: HostState) -> None:
    random.setstate(state[0])
    if state[1] is not None:
        sys.modules["numpy"].random.set_state(state[1])


def _host_equal(a: HostState, b: HostState) -> bool:
    if a[0] != b[0] or (a[1] is None) != (b[1] is None):
        return False
    if a[1] is None:
        return True
    numpy = sys.modules["numpy"]
    return a[1][0] == b[1][0] and tuple(a[1][2:]) == tuple(b[1][2:]) and bool(numpy.array_equal(a[1][1], b[1][1]))


class HostDraws:
    """Python's ``random`` and NumPy's global generator, replayed for one stage.

    They have one state per process and no generator argument to hand over.
    The first forward of a micro-batch that recompute will replay records
    their states where it changes them (it drew: transformers' Wav2Vec2 draws
    its SpecAugment masks with NumPy); its replay sets them back to those
    states for the forward and then restores them, so it draws the numbers
    the first forward drew and the process's streams run on as without
    recompute. Once the stage is seen to draw, those forwards hold a lock
    that other stages drawing the same way take too; a thread that pipeddp
    does not own and that draws from them meanwhile shifts the numbers.
    """

    def __init__(self) -> None:
        self.draws = False
        self._first: Dict[int, HostState] = {}

    @contextlib.contextmanager
    def first(self, mb: int) -> Iterator[None]:
        """The first forward of micro-batch ``mb`` (its activations dropped, replayed later)."""
        with _host_lock if self.draws else contextlib.nullcontext():
            before = _host_get()
            try:
                yield
            finally:
                if _host_equal(before, _host_get()):
                    self._first.pop(mb, None)
                else:
                    self._first[mb] = before
                    self.draws = True

    @contextlib.contextmanager
    def again(self, mb: int) -> Iterator[None]:
        """The replay of micro-batch ``mb``: from the states its first forward began with, where it drew."""
        recorded = self._first.pop(mb, None)
        if recorded is None:
            yield
            return
        with _host_lock:
            now = _host_get()
            _host_set(recorded)
            try:
                yield
            finally:
                _host_set(now)
