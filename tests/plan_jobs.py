"""What torch's tensor parallelism really sends, counted in spawned processes for ``test_plan`` (importable by the
children): a small transformer-like model split by ``parallelize_module`` over gloo, every collective of one forward
and one backward recorded with its size as it reaches the dispatcher."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nccl_rules

nccl_rules.install()  # as in every job module (this one sends nothing point to point)

WIDTH, HIDDEN, VOCAB, TOKENS = 16, 32, 24, 6


class Block(nn.Module):
    """Attention-like projections (q, k, v in, o out) and an MLP (up, down), each on a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.o(self.q(x) * self.k(x) + self.v(x))
        return x + self.down(torch.relu(self.up(x)))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), Block(), Block(), nn.Linear(WIDTH, VOCAB))


def styles() -> Dict[str, Any]:
    """The model's plan in torch's own styles: a vocabulary-parallel embedding and head, Megatron's block split."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: Dict[str, Any] = {"0": RowwiseParallel(input_layouts=Replicate()),
                            "3": ColwiseParallel(output_layouts=Replicate())}
    for name in ("q", "k", "v", "up"):
        plan[f"*.{name}"] = ColwiseParallel()
    for name in ("o", "down"):
        plan[f"*.{name}"] = RowwiseParallel()
    return plan


class Collectives(TorchDispatchMode):
    """Every functional collective dispatched while active, as ``(kind, bytes of the whole tensor)``."""

    def __init__(self, tp: int) -> None:
        super().__init__()
        self.tp = tp
        self.seen: List[Tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in ("all_reduce", "all_gather_into_tensor"):
            t = args[0]
            whole = t.numel() * t.element_size() * (self.tp if name.startswith("all_gather") else 1)
            self.seen.append(("all_reduce" if name == "all_reduce" else "all_gather", whole))
        return func(*args, **(kwargs or {}))


def count_job(batch: int) -> Dict[str, List[Tuple[str, int]]]:
    """Split ``model()`` over this job's ranks with ``styles()``; the collectives of one forward and one backward."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    dist.init_process_group("gloo")
    try:
        tp = dist.get_world_size()
        net = parallelize_module(model(), init_device_mesh("cpu", (tp,)), styles())
        ids = torch.randint(0, VOCAB, (batch, TOKENS), generator=torch.Generator().manual_seed(1))
        with Collectives(tp) as forward:
            out = net(ids)
        with Collectives(tp) as backward:
            out.sum().backward()
        return {"forward": sorted(forward.seen), "backward": sorted(backward.seen)}
    finally:
        dist.destroy_process_group()
