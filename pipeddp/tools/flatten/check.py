"""Checking a flattened model against the model: copies of the sample, runs in train mode under the same random
numbers, and where two results differ.

The check runs in eval mode and in train mode: a model's forward may do in training what its layers do not (drop
whole blocks at random, branch on ``self.training``). Train mode draws random numbers (dropout, SpecAugment's
masks, stochastic depth), so each train-mode run starts from the same seeds of every generator the model may draw
from (torch's CPU generator and its devices', NumPy's, Python's ``random``): the flat model runs the model's own
modules in the model's order, so it draws the same numbers in the same order and the two results are equal, bit for
bit, exactly when it computes what the model computes. The generators and the modules' buffers (BatchNorm's
running statistics) are put back afterwards, so flattening changes neither.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Callable, Iterator, List, Sequence, Tuple

import torch
from torch import nn

__all__ = ["clone", "differences", "in_train_mode"]

#: the seed every train-mode run of the check starts from
SEED = 0


def clone(value: Any) -> Any:
    """A copy of the tensors in ``value`` (a forward that starts in place must not change the sample)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(clone(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(clone(v) for v in value)
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    return value


def differences(got: Any, want: Any, rtol: float, atol: float, where: str = "output") -> List[Tuple[str, str]]:
    """``(where, what)`` for each place where ``got`` is not ``want``; a tensor's 'what' is its largest difference."""
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)):
            return [(where, f"{type(got).__name__} instead of {type(want).__name__}")]
        if got.shape != want.shape:
            return [(where, f"shape {tuple(got.shape)} instead of {tuple(want.shape)}")]
        if got.is_floating_point() or got.is_complex() or want.is_floating_point() or want.is_complex():
            a, b = got.detach().to(torch.complex128 if got.is_complex() else torch.float64), \
                want.detach().to(torch.complex128 if want.is_complex() else torch.float64)
            if torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
                return []
            diff = (a - b).abs()
            both_nan = torch.isnan(a.abs()) & torch.isnan(b.abs())
            diff = torch.where(both_nan, torch.zeros_like(diff), diff)
            return [(where, f"largest difference {diff.max().item():.3g}")]
        return [] if torch.equal(got, want) else [(where, "different values")]
    if isinstance(want, (tuple, list)) and isinstance(got, (tuple, list)):
        if len(got) != len(want):
            return [(where, f"{len(got)} items instead of {len(want)}")]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, rtol, atol, f"{where}[{i}]")]
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [(where, f"keys {sorted(map(str, got))} instead of {sorted(map(str, want))}")]
        return [d for k in want for d in differences(got[k], want[k], rtol, atol, f"{where}[{k!r}]")]
    try:
        same = bool(got == want)
    except Exception:  # noqa: BLE001
        same = False
    return [] if same else [(where, f"{got!r} instead of {want!r}")]




@contextlib.contextmanager
def _same_draws(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Every generator the modules may draw from seeded with ``SEED``; each one's state put back on leaving."""
    devices = sorted({t.device.index or 0 for m in modules for t in (*m.parameters(), *m.buffers())
                      if t.device.type == "cuda"})
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with every torch wheel
        numpy = None  # type: ignore[assignment]
    saved = (random.getstate(), numpy.random.get_state() if numpy is not None else None)
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(SEED)
        for index in devices:
            torch.cuda.default_generators[index].manual_seed(SEED)
        random.seed(SEED)
        if numpy is not None:
            numpy.random.seed(SEED)
        try:
            yield
        finally:
            random.setstate(saved[0])
            if numpy is not None:
                numpy.random.set_state(saved[1])


@contextlib.contextmanager
def _buffers_kept(modules: Sequence[nn.Module]) -> Iterator[None]:
    """The modules' buffers (running statistics, counters) back at their values, on leaving (copied into the
    tensors the modules hold then: a layer may hand a buffer to the module it was taken from)."""
    kept = [(m, name, b.clone()) for root in modules for m in root.modules() for name, b in m._buffers.items()
            if b is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, name, value in kept:
                now = m._buffers.get(name)
                if now is not None:
                    now.copy_(value)


def in_train_mode(run: Callable[[], Any], modules: Sequence[nn.Module]) -> Any:
    """``run()`` with ``modules`` in train mode, from the check's seeds, buffers kept (the modes are the caller's to
    put back)."""
    for m in modules:
        m.train()
    with _buffers_kept(modules), _same_draws(modules):
        return run()


def train_mode_differences(original: Callable[[], Any], flat: Callable[[], Any], modules: Sequence[nn.Module],
                           rtol: float, atol: float) -> List[Tuple[str, str]]:
    """Where the flat model's train-mode result differs from the model's, both run from the same seeds (see the
    module's docstring). Nothing where the model itself cannot run in train mode on the sample (BatchNorm given one
    sample): then there is nothing to compare with."""
    try:
        want = in_train_mode(original, modules)
    except Exception:  # noqa: BLE001 - the model's own failure is no finding about the flat model
        return []
    try:
        got = in_train_mode(flat, modules)
    except Exception as exc:  # noqa: BLE001 - reported with the other differences, naming the failure
        return [("output", f"{type(exc).__name__}: {exc}")]
    return differences(got, want, rtol, atol)
