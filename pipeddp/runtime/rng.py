"""Reproducible randomness (dropout) in stages that run on threads.

Dropout draws from the device's default generator. On CPU every stage shares
one generator, and stage threads draw from it in whatever order they happen to
run, so masks (and results) would change from run to run; worse, replaying the
RNG for activation recompute means rewinding a generator another thread is
using at that moment.

So each random stage runs every micro-batch from a seed of its own, derived
from one base seed drawn (in the caller's thread) at the start of the step::

    seed(stage s, micro-batch i) = base + 1_000_003 * s + i

and holds the device's generator lock while it does: it saves the generator,
seeds it, runs, and restores it. Recompute replays the same seed, so the
recomputed dropout mask is bit-identical to the forward's. Results no longer
depend on thread timing, and only stages that contain random layers pay for
the lock (on CUDA each device has its own generator and lock).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterator, Optional

import torch
from torch import nn

__all__ = ["is_random", "draw_base_seed", "seeded"]

_RANDOM_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.RReLU)

_locks: Dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def is_random(module: nn.Module) -> bool:
    """Whether ``module`` (or a submodule) draws random numbers in its current mode.

    Recognises torch's dropout layers and RReLU; a custom layer that draws
    random numbers can opt in by setting ``pipeddp_random = True`` on itself.
    """
    for m in module.modules():
        if getattr(m, "pipeddp_random", False):
            return True
        if isinstance(m, _RANDOM_TYPES) and m.training:
            if not isinstance(m, nn.RReLU) and getattr(m, "p", 0.0) == 0.0:
                continue
            return True
    return False


def draw_base_seed() -> int:
    """A base seed from the global CPU generator (so ``torch.manual_seed`` controls it)."""
    return int(torch.randint(0, 2**62, (1,)).item())


def _lock_for(device: torch.device) -> threading.Lock:
    key = str(device) if device.type != "cpu" else "cpu"
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


@contextlib.contextmanager
def seeded(device: torch.device, seed: Optional[int]) -> Iterator[None]:
    """Run the body with ``device``'s generator seeded to ``seed``, then restore it.

    ``seed=None`` does nothing (the stage has no random layer).
    """
    if seed is None:
        yield
        return
    with _lock_for(device):
        if device.type == "cuda":
            state = torch.cuda.get_rng_state(device)
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
            try:
                yield
            finally:
                torch.cuda.set_rng_state(state, device)
        else:
            state = torch.get_rng_state()
            torch.default_generator.manual_seed(seed)
            try:
                yield
            finally:
                torch.set_rng_state(state)
