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
registered once under the ``VmapMode`` dispatch key, which torch consults
only in a thread that includes it in its dispatch keys. That key exists to
catch random ops: its kernels are torch's legacy vmap's, for random ops
alone (they refuse them inside ``torch._vmap_internals.vmap``; ours do the
same there), and every other op passes it as a fallthrough, in C++, at no
cost. ``stage_generator`` includes it for its body: a forward that draws
nothing pays nothing per op, and one that draws pays a Python call per random
op, not per op as a ``TorchDispatchMode`` would (about 10 us an op). The key
sits above autograd, so autograd records each op as it ran. The numbers are
those of the process's generator seeded alike: a generator seeded alike
draws alike, and the generator overloads are the ones the generator-less
ops call inside torch.

``HostDraws`` keeps Python's ``random`` and NumPy's global generator
replayable: a forward whose activations recompute will drop records their
states where it changed them, and its replay runs from those states again.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import struct
import sys
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from .shard_draws import whole_then_part

__all__ = ["stage_generator", "settled", "stop_handing", "split_draws", "process_draws", "HostDraws",
           "register_kernels"]

_PARSED = torch._C._parse_dispatch_key("VmapMode")  # not among the Python enum's names
if _PARSED is None:
    raise ImportError(f"pipeddp needs torch's VmapMode dispatch key, which torch {torch.__version__} lacks")
_KEY: torch._C.DispatchKey = _PARSED
_KEYSET = torch._C.DispatchKeySet(_KEY)
_is_included = torch._C._dispatch_tls_is_dispatch_key_included
_set_included = torch._C._dispatch_tls_set_dispatch_key_included
#: what the legacy vmap's kernels say (the only other code that includes the key)
_LEGACY = ("vmap: We do not yet support calling random operations inside of vmap. Please perform random operations "
           "outside of vmap as a workaround")
#: ``_state.generator`` once ``stop_handing`` ran: the process's generator for the rest of the body
_PROCESS = object()
_SEEDED = torch.Tag.nondeterministic_seeded
class _Hand(threading.local):
    """This thread's stage generator and the seed it takes at its first draw; the class's values are each new
    thread's (an attribute a thread never set is read from the class, without the cost of a missing one)."""

    generator: Any = None
    seed: Optional[int] = None
    split: Optional[Tuple[int, int]] = None  # (parts, index) while the ops act on a part of a split tensor


_state = _Hand()
_registered: List[Any] = []  # the Library that holds the kernels (kept alive), once registered
_register_guard = threading.Lock()


def _on_cpu(args: Any, kwargs: Dict[str, Any]) -> bool:
    """Whether a random op draws for the CPU: its tensors are there, or (a factory) its device is. (A random op's
    tensors are its arguments themselves, or in one list of them: ``normal``'s, ``_sample_dirichlet``'s.)"""
    tensors = False
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            value = value[0]
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                return False
            tensors = True
    if tensors:
        return True
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
    """The VmapMode kernel that hands this thread's stage generator to ``op`` (None: ``op`` needs none)."""
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

    def call(args: Any, kwargs: Dict[str, Any]) -> Any:
        generator = _state.generator
        if generator is _PROCESS or not _on_cpu(args, kwargs):
            return op(*args, **kwargs)
        return hand(settled(), args, dict(kwargs))

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _state.generator is None:  # not in a stage: torch's legacy vmap included the key
            raise RuntimeError(_LEGACY)
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            split = _state.split
            if split is not None and args and isinstance(args[0], torch.Tensor) and args[0].dim():
                return whole_then_part(call, op, args, kwargs, *split)
            return call(args, kwargs)

    return kernel


def register_kernels() -> None:
    """Register the kernels, once per process (before any thread includes the key)."""
    with _register_guard:
        if _registered:
            return
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns, once, that the legacy vmap's kernels are overridden
            warnings.filterwarnings("ignore", message=".*other operators may also be overridden")
            _register(library)
        _registered.append(library)


def _register(library: Any) -> None:
    """A kernel for every random aten op that is not made of others, and for those the legacy vmap catches."""
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if _SEEDED not in op.tags or (
                    torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
                    and not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "VmapMode")):
                continue  # not random, or made of other ops (dropout, lstm) that reach their own kernels
            kernel = _kernel(op)
            if kernel is not None:
                library.impl(op, kernel, "VmapMode")


class stage_generator:  # noqa: N801 (used as a context, like torch.no_grad)
    """Every random op of the CPU run in this thread by the body draws from ``generator`` (seeded with ``seed``
    first, where one is given). Entered around every forward of a stage: kept to a few attribute writes."""

    __slots__ = ("generator", "seed", "before", "included")  # (the split is reset for the body, then restored)

    def __init__(self, generator: torch.Generator, seed: Optional[int] = None) -> None:
        self.generator, self.seed = generator, seed

    def __enter__(self) -> None:
        state = _state
        self.before = (state.generator, state.seed, state.split)
        self.included = _is_included(_KEY)
        state.generator, state.seed, state.split = self.generator, self.seed, None  # seeded at the first draw
        if not self.included:
            _set_included(_KEY, True)

    def __exit__(self, *exc: Any) -> None:
        if not self.included:
            _set_included(_KEY, False)
        _state.generator, _state.seed, _state.split = self.before


def settled() -> torch.Generator:
    """This thread's stage generator, seeded if its body has not drawn yet (inside ``stage_generator`` alone)."""
    generator: torch.Generator = _state.generator
    if _state.seed is not None:
        generator.manual_seed(_state.seed)
        _state.seed = None
    return generator


def split_draws(parts: Optional[int] = None, index: int = 0) -> None:
    """To the end of this thread's ``stage_generator`` body, each random op on a tensor takes it for part ``index``
    of ``parts`` (tp): it draws the whole tensor and keeps that part (``shard_draws``); None: whole tensors again."""
    _state.split = None if parts is None else (parts, index)


def process_draws() -> stage_generator:
    """A body whose random ops draw from the process's generator but reach the kernels (a split applies to them)."""
    return stage_generator(_PROCESS)  # type: ignore[arg-type]  # the marker the kernels pass to the op as it is


def stop_handing() -> None:
    """The rest of the body of ``stage_generator`` in this thread draws from the process's generator."""
    _state.generator = _PROCESS


# -- Python's random and NumPy's global generator -------------------------------------------------------------

_host_lock = threading.RLock()
#: Python's random state, NumPy's global state (None: NumPy not imported), NumPy's and Python's Mersenne Twister
#: words as read in place (None: not that bit generator, not this interpreter's layout)
HostState = Tuple[Any, Any, Optional[bytes], Optional[bytes]]


_numpy_address: Tuple[Any, int] = (None, 0)  # the global bit generator, and where its state lies


def _numpy_words(numpy: Any) -> Optional[bytes]:
    """The key and position of NumPy's global Mersenne Twister, read in place: a microsecond, where ``get_state``
    builds a dict and an array (the change check of every forward that recompute drops reads these)."""
    global _numpy_address
    bits = numpy.random.mtrand._rand._bit_generator
    if bits is not _numpy_address[0]:
        if type(bits).__name__ != "MT19937":
            return None
        _numpy_address = (bits, bits.ctypes.state_address)
    return ctypes.string_at(_numpy_address[1], 624 * 4 + ctypes.sizeof(ctypes.c_int))


#: the last NumPy state read whole, with its words: while the words stay put (and no Gaussian was kept, which a
#: draw could take without moving them) it is still the state, and ``get_state`` need not run again
_numpy_last: Tuple[Optional[bytes], Any] = (None, None)


def _numpy_state(numpy: Any) -> Tuple[Any, Optional[bytes]]:
    global _numpy_last
    words = _numpy_words(numpy)
    last_words, last = _numpy_last
    if words is not None and words == last_words and not last[3]:
        return last, words
    state = numpy.random.get_state()
    if words is not None and _numpy_words(numpy) == words:  # nobody drew meanwhile: the pair belongs together
        _numpy_last = (words, state)
    return state, words


def _python_words_reader() -> Optional[Callable[[], bytes]]:
    """A reader of the Mersenne Twister words of Python's ``random`` in place (its C object: the header, the
    position, 624 words), where this interpreter lays them out so (checked against ``getstate``); None elsewhere."""
    instance = random._inst  # type: ignore[attr-defined]
    header = object.__basicsize__
    size = ctypes.sizeof(ctypes.c_int) + 624 * 4

    def read() -> bytes:
        return ctypes.string_at(id(instance) + header, size)

    words = random.getstate()[1]
    expected = struct.pack("=i624I", words[-1], *words[:-1])
    return read if read() == expected else None


_python_words = _python_words_reader()
#: as ``_numpy_last``, for Python's random (its kept Gaussian is ``gauss_next``, in the state)
_python_last: Tuple[Optional[bytes], Any] = (None, None)


def _python_state() -> Tuple[Any, Optional[bytes]]:
    global _python_last
    if _python_words is None:
        return random.getstate(), None
    words = _python_words()
    last_words, last = _python_last
    if words == last_words and last[2] is None:
        return last, words
    state = random.getstate()
    if _python_words() == words:
        _python_last = (words, state)
    return state, words


def _host_get() -> HostState:
    python, python_words = _python_state()
    numpy = sys.modules.get("numpy")  # not imported: nothing can have drawn from it
    if numpy is None:
        return python, None, None, python_words
    return (python, *_numpy_state(numpy), python_words)


def _host_set(state: HostState) -> None:
    random.setstate(state[0])
    if state[1] is not None:
        sys.modules["numpy"].random.set_state(state[1])


def _host_changed(before: HostState) -> bool:
    """Whether Python's or NumPy's generator moved since ``before``. Their words stay put only where no number was
    drawn or where a Gaussian kept from an earlier pair was (``gauss_next``, ``has_gauss``): then the whole state
    tells."""
    if before[3] is not None and before[0][2] is None:
        if _python_words() != before[3]:  # type: ignore[misc]
            return True
    elif random.getstate() != before[0]:
        return True
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return False
    if before[1] is None:  # imported meanwhile
        return True
    if before[2] is not None and not before[1][3]:
        return _numpy_words(numpy) != before[2]
    now = numpy.random.get_state()
    return not (now[0] == before[1][0] and tuple(now[2:]) == tuple(before[1][2:])
                and bool(numpy.array_equal(now[1], before[1][1])))


#: set once any stage's forward is seen to move Python's or NumPy's generator: from then on every forward that
#: recompute drops, and every replay, runs under ``_host_lock`` (a change seen while two stages ran could be either's)
_host_drawn = threading.Event()


class HostDraws:
    """Python's ``random`` and NumPy's global generator, replayed for one stage.

    They have one state per process and no generator argument to hand over.
    The first forward of a micro-batch that recompute will replay records
    their states where they change meanwhile (the stage drew: transformers'
    Wav2Vec2 draws its SpecAugment masks with NumPy); its replay sets them
    back to those states for the forward and then restores them, so it draws
    the numbers the first forward drew and the process's streams run on as
    without recompute. Once any stage is seen to draw, those forwards and the
    replays of every stage take turns on one lock; a thread that pipeddp does
    not own and that draws from them meanwhile, or a second stage in the very
    forward where the first draw is seen, can shift the numbers.
    """

    def __init__(self) -> None:
        self._first: Dict[int, HostState] = {}

    @contextlib.contextmanager
    def first(self, mb: int) -> Iterator[None]:
        """The first forward of micro-batch ``mb`` (its activations dropped, replayed later)."""
        with _host_lock if _host_drawn.is_set() else contextlib.nullcontext():
            before = _host_get()
            try:
                yield
            finally:
                if _host_changed(before):
                    self._first[mb] = before
                    _host_drawn.set()
                else:
                    self._first.pop(mb, None)

    @contextlib.contextmanager
    def again(self, mb: int) -> Iterator[None]:
        """The replay of micro-batch ``mb``: from the states its first forward began with, where they moved."""
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
