"""Models and spawned-process jobs for the mixed-precision tests (importable by the children)."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

import pipeddp

import nccl_rules

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

LOSS = nn.functional.mse_loss


class SeesDtype(nn.Module):
    """A Linear that records the dtype its output is computed in (what autocast decides)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.seen: List[torch.dtype] = []

    def forward(self, x):
        out = self.lin(x)
        self.seen.append(out.dtype)
        return out


def probe_model(seed: int = 0, width: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(SeesDtype(width), nn.Tanh(), SeesDtype(width), nn.Tanh(), SeesDtype(width))


class Overflows(nn.Module):
    """A Linear whose weight gradient becomes inf while ``armed``: an overflow on this stage only."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.armed = False
        self.lin.weight.register_hook(lambda g: g * float("inf") if self.armed else g)

    def forward(self, x):
        return self.lin(x)


def overflow_model(seed: int = 0, width: int = 8) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), Overflows(width))


def batch(seed: int = 1, n: int = 8, width: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def stage_autocast_job(dtype_name: str) -> Dict[str, Any]:
    """1 replica x 2 stages in two processes, train_step and a forward under CPU autocast."""
    dtype = getattr(torch, dtype_name)
    model = probe_model()
    engine = pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=2, balance=[2, 3], devices=["cpu"])
    x, y = batch()
    with torch.autocast("cpu", dtype=dtype):
        loss = engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        with torch.no_grad():
            out = engine(x if engine.is_first else None)
    seen = sorted({str(d) for layer in model if isinstance(layer, SeesDtype) for d in layer.seen})
    result = {"loss": loss.item(), "out": out, "seen": seen, "rank": engine.topology.rank,
              "grads": {k: p.grad.clone() for k, p in engine.named_parameters()}}
    engine.close()
    return result


def stage_scaler_job(steps: int) -> Dict[str, Any]:
    """1 replica x 2 stages; the overflow at step 1 happens in stage 1's gradients only."""
    model = overflow_model()
    engine = pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=2, balance=[2, 1], devices=["cpu"])
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    history = []
    for step in range(steps):
        model[2].armed = step == 1
        x, y = batch(seed=10 + step, width=8)
        before = [p.detach().clone() for p in engine.parameters()]
        opt.zero_grad()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS, scaler=scaler)
        scaler.step(opt)
        scaler.update()
        changed = any(not torch.equal(a, b) for a, b in zip(before, engine.parameters()))
        history.append({"changed": changed, "scale": scaler.get_scale()})
    engine.close()
    return {"history": history, "stage": engine.topology.stage}
