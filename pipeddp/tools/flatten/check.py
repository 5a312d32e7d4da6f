"""Checking a flattened model against the model: copies of the sample, and where two results differ."""

from __future__ import annotations

from typing import Any, List, Tuple

import torch

__all__ = ["clone", "differences"]


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


