"""Functions run inside spawned processes by the elastic tests (importable by the children)."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

import pipeddp
from conftest import make_mlp

LOSS = nn.functional.mse_loss


def global_batches(steps: int, n: int, width: int = 12) -> List[Any]:
    """``steps`` global batches of ``n`` float64 samples."""
    out = []
    for i in range(steps):
        g = torch.Generator().manual_seed(500 + i)
        out.append((torch.randn(n, width, generator=g, dtype=torch.float64),
                    torch.randn(n, width, generator=g, dtype=torch.float64)))
    return out


def fixed_global_batch_job(mode: str, global_batch: int, batch_size: int, steps: int) -> Dict[str, Any]:
    """Train ``steps`` steps of a fixed global batch (each replica its strided share); the final weights."""
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode=mode, chunks=2, global_batch=global_batch,
                                    batch_size=batch_size)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    r, replicas = engine.topology.replica, engine.topology.replicas
    losses = []
    for x, y in global_batches(steps, global_batch):
        opt.zero_grad()
        loss = engine.train_step(x[r::replicas] if engine.is_first else None, y[r::replicas] if engine.is_last
                                 else None, LOSS)
        losses.append(loss.item())
        opt.step()
    out = {"state": engine.state_dict(), "losses": losses, "accumulation": engine.accumulation,
           "replica_batch": engine.replica_batch}
    engine.close()
    return out


def indivisible_job() -> str:
    try:
        pipeddp.HybridParallel(make_mlp(), stages=1, global_batch=9)
    except ValueError as exc:
        return str(exc)
    return "no error"


def tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    shared = nn.Linear(12, 12).double()
    return nn.Sequential(shared, nn.Tanh(), nn.Linear(12, 12).double(), nn.Tanh(), shared)


def tied_stage_job(steps: int) -> Dict[str, Any]:
    """Stage mode, the tie's uses in two processes, 4 passes a step: the final weights."""
    engine = pipeddp.HybridParallel(tied_model(), stages=2, mode="stage", chunks=2, balance=[2, 3], global_batch=8,
                                    batch_size=2)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    for x, y in global_batches(steps, 8):
        opt.zero_grad()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        opt.step()
    state = engine.state_dict()
    engine.close()
    return state
