"""Functions run inside spawned processes by tests/test_names.py (importable by the children)."""

from __future__ import annotations

import os
from typing import Any, Dict

import torch
import torchvision
from torch import nn

import pipeddp
from pipeddp.tools.models import flatten_sequential

import nccl_rules

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)


def resnet(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return torchvision.models.resnet18(weights=None, num_classes=10).double()


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 10, (4,), generator=g)


def stage_mode_job(directory: str) -> Dict[str, Any]:
    """2 stage processes x 1 replica: train a flattened resnet18 2 steps, save both formats, load them back."""
    import torch.distributed as dist

    dist.init_process_group("gloo")  # one group for the job: two engines are built one after the other
    model = resnet(0)
    flat = flatten_sequential(model, batch(0)[0][:2])
    x, y = batch(1)
    out: Dict[str, Any] = {}
    with pipeddp.HybridParallel(flat, stages=2, mode="stage", chunks=1) as engine:
        opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            engine.train_step(x if engine.is_first else None, y if engine.is_last else None,
                              nn.functional.cross_entropy)
            opt.step()
        out["local"] = list(engine.local_state_dict())
        out["state"] = engine.state_dict()
        engine.save(os.path.join(directory, "one.pt"), optimizer=opt)
        engine.save(os.path.join(directory, "sharded"), optimizer=opt, sharded=True)
    with pipeddp.HybridParallel(flatten_sequential(resnet(3), batch(0)[0][:2]), stages=2, mode="stage") as other:
        opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
        other.load(os.path.join(directory, "sharded"), optimizer=opt)
        out["loaded"] = other.state_dict()
    dist.destroy_process_group()
    return out
