"""Losses over tokens: a loss_fn that returns ``(total, count)``, divided once by the count of the whole batch.

A language model's loss is the mean over the batch's non-ignored tokens. The
mean of micro-batch means weighted by rows is not that mean when padding
differs between micro-batches (nor across replicas), so a loss_fn may return
the micro-batch's *sum* and how many items it counted::

    def loss_fn(logits, labels):
        total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        return total, (labels != -100).sum()

The step's loss is then sum(totals) / sum(counts) over every micro-batch (and
every replica), and so are its gradients. The counts are only known once every
micro-batch has run its forward, after the first backwards have started, so
backward runs from the totals and what the step added to ``.grad`` is divided
by the global count at its end (``Baseline.scale``). Gradients that were there
before the step (accumulation over calls) are kept aside in ``Baseline`` and
left as they were. A count made on a GPU stays there (``summed``): a
``Pipeline`` divides by it on the device, and ``HybridParallel`` brings it to
the host in the one copy of the step's loss, instead of a sync per micro-batch.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Set, Union

import torch
from torch import nn

__all__ = ["Baseline", "Count", "parameters_of", "per_count", "scalar_on", "summed"]

#: a count: a number, or a 0-d float64 tensor where the loss_fn counted on a device (kept there until the step's
#: loss crosses to the host with it)
Count = Union[float, torch.Tensor]


def scalar_on(value: Union[None, int, float, torch.Tensor], dev: torch.device) -> torch.Tensor:
    """``value`` as a 0-d float64 tensor on ``dev``, without a sync: a tensor copied there (device to device), a
    number (None: 0) filled there."""
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(()).to(dev, torch.float64)
    return torch.full((), float(value or 0.0), dtype=torch.float64, device=dev)


def summed(counts: Iterable[Union[int, float, torch.Tensor]]) -> Count:
    """The micro-batches' counts added up: a float where they are numbers, else summed on the device of the first
    tensor, so that counts made on a GPU reach the host once with the step's loss instead of one sync each."""
    values = list(counts)
    dev = next((c.device for c in values if isinstance(c, torch.Tensor)), None)
    if dev is None:
        return float(sum(values))
    return torch.stack([scalar_on(c, dev) for c in values]).sum()


def per_count(replicas: int, count: Count) -> Count:
    """``replicas / count``, NaN where nothing was counted (0/0, as the plain model gives); a tensor stays one."""
    if isinstance(count, torch.Tensor):
        return torch.where(count != 0, replicas / count, torch.full_like(count, float("nan")))
    return replicas / count if count else float("nan")


def parameters_of(modules: Iterable[nn.Module]) -> List[nn.Parameter]:
    """Every parameter under ``modules``, each once: the set ``Module.parameters()`` yields (in another order),
    found without the names and nested generators it builds (every training step starts with this walk): one
    list walked as it grows, a module's dicts read only where they hold something."""
    out: Dict[int, nn.Parameter] = {}
    seen: Set[int] = set()
    todo: List[Optional[nn.Module]] = list(modules)
    for module in todo:  # breadth first: the children are appended to the list being walked
        if module is None or id(module) in seen:
            continue
        seen.add(id(module))
        if module._parameters:  # what named_parameters reads
            for p in module._parameters.values():
                if p is not None and id(p) not in out:
                    out[id(p)] = p
        if module._modules:
            todo.extend(module._modules.values())
    return list(out.values())


def _all_zero_on_host(grads: List[torch.Tensor]) -> bool:
    """Whether every one of ``grads`` is a plain CPU tensor of zeros (False where any is elsewhere or sharded)."""
    if any(type(g) is not torch.Tensor or g.device.type != "cpu" or g.is_sparse for g in grads):
        return False
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():  # the largest magnitude of each: one kernel per dtype, host values (no sync)
        peaks = torch.stack(torch._foreach_norm(group, float("inf")))
        if not torch.equal(peaks, torch.zeros_like(peaks)):
            return False
    return True


class Baseline:
    """The gradients of ``params`` when a step starts: copied where the step's loss may be counted.

    ``counting`` is what the previous step's loss was (None: no step yet):
    after a step with a mean loss nothing is copied, and a step that then
    counts finds out whether it needed a copy (``scale`` refuses).
    """

    def __init__(self, params: Iterable[nn.Parameter], counting: Optional[bool], *, unique: bool = False) -> None:
        #: each once (``unique``: the caller's list already is, as ``parameters_of``'s: not walked again)
        self.params: List[nn.Parameter] = params if unique and type(params) is list else \
            list({id(p): p for p in params}.values())
        self.had_grads = False
        for p in self.params:
            if p.grad is not None:
                self.had_grads = True
                break
        self.kept: Optional[Dict[int, torch.Tensor]] = None
        if self.had_grads and counting is not False:
            grads = [p.grad.detach() for p in self.params if p.grad is not None]
            # gradients zeroed in place (``zero_grad(set_to_none=False)``) hold nothing to keep apart; on the host
            # that is one read of them, cheaper than a copy (on a device it would be a sync: copied there)
            self.kept = {} if _all_zero_on_host(grads) else \
                {id(p): p.grad.detach().clone() for p in self.params if p.grad is not None}

    def scale(self, factor: Count) -> None:
        """Multiply what the step added to every gradient by ``factor`` (a tensor: copied to each gradient's device
        once, device to device); what was there before stays."""
        if self.had_grads and self.kept is None:
            raise ValueError(
                "this step's loss_fn returned (total, count) while the gradients held earlier steps' sums, after a "
                "step whose loss_fn returned a mean: what this step added cannot be told apart. Zero the gradients "
                "(optimizer.zero_grad()) before a step whose loss changes kind"
            )
        kept = self.kept or {}
        on: Dict[torch.device, Count] = {}
        for p in self.params:
            if p.grad is None:
                continue
            dev = p.grad.device
            if dev not in on:
                on[dev] = factor.to(dev) if isinstance(factor, torch.Tensor) else factor
            before = kept.get(id(p))
            if before is None:
                p.grad.mul_(on[dev])
            else:
                p.grad.sub_(before).mul_(on[dev]).add_(before)
