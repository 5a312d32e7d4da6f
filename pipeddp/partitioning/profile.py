"""Measure what each layer of an ``nn.Sequential`` costs.

The partitioner needs, per layer: forward+backward time at the micro-batch
size the pipeline will really use (per-sample cost on a CPU or a GPU is far
from constant in the batch size), the parameter count, and the size of the
layer's output (what must cross to the next device if a cut falls after it).

The sample is pushed through the model once and each layer's input is kept;
then every layer is run forward and backward on its own input, layer after
layer, ``repeat`` rounds over the whole model. The median per layer is used,
because a slow stretch of the machine (page faults, the host's neighbours)
must not move a cut. A model on the meta device (too big to hold) is
profiled one layer at a time instead: each layer materialized alone with
random weights, timed ``repeat`` times, and freed before the next.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

from ..runtime.materialize import Init, is_meta, materialize_layer, recorded_init
from ..runtime.microbatch import batch_size, split, split_sizes, tree_map, tree_tensors
from ..runtime.progress import shown
from ..runtime.tied import layers_of

__all__ = ["LayerCost", "ProfileError", "profile_layers", "sample_microbatch", "describe_shapes"]


class ProfileError(ValueError, RuntimeError):
    """A layer failed while the partitioner profiled it on the sample (the layer's own error is the cause).

    A ``ValueError`` like every other bad argument (here: a ``sample`` the
    model cannot take); still a ``RuntimeError`` too, so code that caught it so keeps working.
    """


def _leaf(want_grad: bool, t: torch.Tensor) -> torch.Tensor:
    """A profiled layer's input: detached, and asking for a gradient where the pipeline's would."""
    return t.detach().requires_grad_(want_grad and t.is_floating_point())


def describe_shapes(value: Any) -> str:
    """The shapes and dtypes of a tensor tree, for messages: ``(8, 16) float32`` or ``((8, 16) float32, ...)``."""
    leaves = tree_tensors(value)
    parts = [f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in leaves]
    if isinstance(value, torch.Tensor):
        return parts[0]
    return f"{type(value).__name__} of [{', '.join(parts)}]" if parts else f"{type(value).__name__} without tensors"


def _failed(exc: BaseException, sample: Any, whole: Any, position: int, name: str, layer: nn.Module, value: Any,
            what: str) -> ProfileError:
    cut = f"the sample {describe_shapes(whole)}, profiled on a micro-batch of it, {describe_shapes(sample)}" \
        if whole is not None else f"the sample {describe_shapes(sample)}"
    return ProfileError(
        f"profiling the sample (balance='time' or 'memory' measures every layer on it) failed on {cut}: "
        f"layer {position} ({name!r}, {type(layer).__name__}) raised in its {what} on an input of "
        f"{describe_shapes(value)}: "
        f"{type(exc).__name__}: {exc}. Pass a sample batch the model takes (model(sample) must run), or a balance "
        "that needs no sample ('params', 'uniform' or a list)"
    )


@dataclass
class LayerCost:
    """Measured cost of one layer.

    ``forward`` and ``backward`` are seconds at micro-batch size (0 when not
    timed), ``params`` the number of parameters, ``param_bytes`` their size, and
    ``activation_bytes`` the size of the layer's output for one micro-batch.
    """

    name: str
    forward: float
    backward: float
    params: int
    param_bytes: int
    activation_bytes: int

    @property
    def time(self) -> float:
        """Forward + backward seconds."""
        return self.forward + self.backward


def sample_microbatch(sample: Any, chunks: int) -> Any:
    """The first micro-batch of ``sample`` when split into ``chunks`` pieces."""
    sizes = split_sizes(batch_size(sample, name="sample"), chunks=chunks)
    return split(sample, sizes)[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_tensors(value))


def profile_layers(
    layers: nn.Sequential,
    sample: Optional[Any] = None,
    *,
    device: Optional[torch.device] = None,
    repeat: int = 3,
    timed: bool = True,
    progress: Optional[Callable[[int, int], None]] = None,
    whole: Optional[Any] = None,
    init: Optional[Init] = None,
) -> List[LayerCost]:
    """Cost of every layer of ``layers`` (see module docstring).

    ``sample`` is one micro-batch; it is needed for times and activation sizes
    (without it both are 0). The model is not modified: layers are deep-copied
    to ``device`` (default: where the first parameter lives, else CPU) so that
    profiling neither moves the user's model nor touches its gradients.
    ``progress(done, total)`` is called after every layer run, so that a
    command line can show how far a profile of many seconds has come; without it, a bar on rank 0's terminal
    (nothing where stderr is not one: ``runtime.progress``).
    ``whole``: the batch ``sample`` was cut from, named in the error if a layer fails. ``init``: how a layer on
    the meta device is initialised for its turn (default: the flattened model's recorded one, else each module's
    ``reset_parameters``).
    """
    named = layers_of(layers)  # every position: a module used twice is profiled twice
    costs: List[LayerCost] = []
    params = [sum(p.numel() for p in m.parameters()) for _, m in named]
    pbytes = [sum(p.numel() * p.element_size() for p in m.parameters()) for _, m in named]
    if sample is None:
        return [LayerCost(n, 0.0, 0.0, params[i], pbytes[i], 0) for i, (n, _) in enumerate(named)]

    if device is None:
        first = next(layers.parameters(), None)
        device = first.device if first is not None and not first.is_meta else torch.device("cpu")
    device = torch.device(device)
    rounds = repeat + 1 if timed else 0
    total, done = len(named) * (rounds + 1), 0
    with contextlib.ExitStack() as bar:
        report = progress if progress is not None else bar.enter_context(shown(f"profiling {len(named)} layers"))

        def advance() -> None:
            nonlocal done
            done += 1
            report(done, total)

        x = tree_map(lambda t: t.detach().to(device), sample)
        if any(is_meta(layer) for _, layer in named):
            fb, outs = _one_at_a_time(named, x, device, rounds, sample, whole, advance,
                                       init if init is not None else recorded_init(layers))
        else:
            fb, outs = _round_robin(named, x, device, rounds, sample, whole, advance)
    for i, (name, _) in enumerate(named):
        costs.append(LayerCost(name, fb[i][0], fb[i][1], params[i], pbytes[i], outs[i]))
    return costs


Timings = List[Tuple[float, float]]


def _first_pass(pos: int, name: str, layer: nn.Module, work: nn.Module, x: Any, sample: Any, whole: Any) -> Any:
    """``work``'s output on ``x`` (without grad): the next layer's input."""
    try:
        with torch.no_grad():
            return work(tree_map(lambda t: t.clone(), x))
    except Exception as exc:
        raise _failed(exc, sample, whole, pos, name, layer, x, "forward") from exc


def _timed(work: nn.Module, x: Any, pos: int, name: str, layer: nn.Module, sample: Any, whole: Any,
           device: torch.device) -> Tuple[float, float]:
    """One forward and backward of ``work`` on ``x``: (forward seconds, backward seconds)."""
    # the first layer gets no input gradient, as in the pipeline (the batch does not require grad)
    want = pos > 0 or any(t.requires_grad for t in tree_tensors(sample))
    leaf = tree_map(functools.partial(_leaf, want), x)
    # a fresh non-leaf copy: in-place layers (ReLU(inplace=True)) may write into it
    inp = tree_map(lambda t: t.clone(), leaf)
    _sync(device)
    start = time.perf_counter()
    try:
        out = work(inp)
        _sync(device)
        mid = time.perf_counter()
        grads = [t for t in tree_tensors(out) if t.requires_grad]
        if grads:
            torch.autograd.backward(grads, [torch.ones_like(t) for t in grads])
    except Exception as exc:
        raise _failed(exc, sample, whole, pos, name, layer, x, "forward or backward") from exc
    _sync(device)
    return mid - start, time.perf_counter() - mid


def _medians(f: List[float], b: List[float]) -> Tuple[float, float]:
    return (statistics.median(f[1:]) if len(f) > 1 else 0.0, statistics.median(b[1:]) if len(b) > 1 else 0.0)


def _round_robin(named: List[Tuple[str, nn.Module]], x: Any, device: torch.device, rounds: int, sample: Any,
                 whole: Any, advance: Callable[[], None]) -> Tuple[Timings, List[int]]:
    """Every layer copied to ``device`` at once; timing rounds go layer 0, 1, ..., n-1, again and again, so that a
    slow stretch of the machine hits one repeat of every layer, not every repeat of a few neighbouring layers."""
    works, inputs, outs = [], [], []
    for pos, (name, layer) in enumerate(named):
        work = copy.deepcopy(layer).to(device)
        work.train(layer.training)
        works.append(work)
        inputs.append(x)
        x = _first_pass(pos, name, layer, work, x, sample, whole)
        outs.append(_bytes(x))
        advance()
    fwd: List[List[float]] = [[] for _ in named]
    bwd: List[List[float]] = [[] for _ in named]
    for _ in range(rounds):
        for i, work in enumerate(works):
            f, b = _timed(work, inputs[i], i, named[i][0], named[i][1], sample, whole, device)
            fwd[i].append(f)
            bwd[i].append(b)
            advance()
    return [_medians(fwd[i], bwd[i]) for i in range(len(named))], outs


def _one_at_a_time(named: List[Tuple[str, nn.Module]], x: Any, device: torch.device, rounds: int, sample: Any,
                   whole: Any, advance: Callable[[], None], init: Optional[Init]) -> Tuple[Timings, List[int]]:
    """A model on the meta device: each layer materialized alone (random weights; ``init``, a flattened model's
    recorded initialisation, where there is one), timed, then freed, so the profile never holds more than one layer
    and its input and output."""
    fb, outs = [], []
    for pos, (name, layer) in enumerate(named):
        work = materialize_layer(copy.deepcopy(layer), name, seed=0, device=device, init=init)
        work.train(layer.training)
        out = _first_pass(pos, name, layer, work, x, sample, whole)
        outs.append(_bytes(out))
        advance()
        f, b = [], []
        for _ in range(rounds):
            ff, bb = _timed(work, x, pos, name, layer, sample, whole, device)
            f.append(ff)
            b.append(bb)
            advance()
        fb.append(_medians(f, b))
        del work
        x = out
    return fb, outs
