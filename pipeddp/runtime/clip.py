"""Gradient-norm clipping that sees the plain model's parameters, each once.

``torch.nn.utils.clip_grad_norm_(engine.parameters(), ...)`` is wrong for a
pipeline in two ways, and both change the model that training produces:

- a tied weight (an embedding reused as the output head) has a copy in every
  stage that uses it, each holding the *whole* gradient, so the norm counts it
  once per copy;
- in stage mode a process holds one stage, so the norm is of that stage's
  gradients alone and every process clips by a different factor.

Here the copies are left out of the norm, and where the stages live in
several processes each contributes its part (``sum |g|^p``, or the max for
the inf-norm) to one collective. Every gradient, copies included, is then
scaled by the same factor as ``clip_grad_norm_`` on the plain model would.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from .dtensors import local

__all__ = ["clip_grad_norm", "local_part", "total_from_part", "scale_grads", "Combine"]

#: ``combine(part, is_max)``: the shares of a norm held by the processes of one pipeline, joined
Combine = Callable[[torch.Tensor, bool], torch.Tensor]


def _grouped(tensors: Sequence[torch.Tensor]) -> Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]]:
    """``tensors`` by device and dtype, each group in order: what one ``_foreach`` call takes (as torch's
    ``clip_grad_norm_`` groups them), instead of a norm and a multiply per parameter."""
    out: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def local_part(grads: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This process's share of the total norm, on ``device``: ``sum |g|^p``, or ``max |g|`` for the inf-norm.

    Shares of several processes combine by a sum (a max for the inf-norm);
    ``total_from_part`` turns the combined share into the norm.
    """
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    per_grad: List[torch.Tensor] = []
    for group in _grouped([local(g.detach()) for g in grads]).values():  # one kernel per device and dtype
        per_grad.extend(torch._foreach_norm(group, norm_type))
    norms = torch.stack([n.to(device, torch.float64) for n in per_grad])
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum()


def total_from_part(part: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm from the combined shares (see ``local_part``)."""
    return part if math.isinf(norm_type) else part.pow(1.0 / norm_type)


def scale_grads(params: Iterable[torch.nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient by ``min(1, max_norm / (total + 1e-6))``, the factor ``clip_grad_norm_`` uses."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [local(p.grad.detach()) for p in params if p.grad is not None]
    for (dev, dtype), group in _grouped(grads).items():
        torch._foreach_mul_(group, coef.to(dev, dtype))  # a tensor factor: no host sync on a GPU


def clip_grad_norm(params: Sequence[torch.nn.Parameter], copies: Iterable[torch.nn.Parameter], max_norm: float,
                   norm_type: float, *, device: torch.device,
                   combine: Optional[Combine] = None,
                   error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of ``params`` by the norm of all of them but ``copies``; returns that norm (float64).

    ``combine(part, is_max)`` sums (or, for the inf-norm, maxes) the shares of
    the processes that hold the other stages; None where this process holds
    them all.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:  # NaN and -inf too
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    left_out = {id(p) for p in copies}
    counted = [p.grad for p in params if p.grad is not None and id(p) not in left_out]
    part = local_part(counted, norm_type, device)
    if combine is not None:
        part = combine(part, math.isinf(norm_type))
    total = total_from_part(part, norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total.item()}; "
                           "pass error_if_nonfinite=False to clip anyway (the gradients become NaN)")
    scale_grads(params, max_norm, total)
    return total
