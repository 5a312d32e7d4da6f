"""Jobs placed on a DeviceMesh of their own (``HybridParallel(..., mesh=)``), run by ``test_mesh.py``."""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import pipeddp
from conftest import make_mlp
from hybrid_jobs import LOSS, global_batches, train
from nccl_rules import as_on_nccl

STEPS = 3


def refusals(mesh2d: Any) -> List[str]:
    """What a wrong mesh or mode is told (nothing is built: the checks come first)."""
    out = []
    for kwargs in ({"mesh": mesh2d, "mode": "replica"}, {"mesh": mesh2d, "stages": 4},
                   {"mesh": "not a mesh"}):
        kwargs = {"stages": 2, "mode": "stage", **kwargs}
        try:
            pipeddp.HybridParallel(make_mlp(), balance="uniform", **kwargs)
            out.append("built")
        except (ValueError, TypeError) as exc:
            out.append(str(exc))
    return out


def two_by_two_job(order: str) -> Dict[str, Any]:
    """4 processes as 2 replicas x 2 stages, the mesh's dimensions in ``order`` (its ranks laid out unlike the
    default layout when ``pp`` comes first): the consolidated weights after training."""
    dist.init_process_group("gloo")
    shape = {"dp": 2, "pp": 2}
    names = tuple(order.split(","))
    mesh = init_device_mesh("cpu", tuple(shape[n] for n in names), mesh_dim_names=names)
    told = refusals(mesh) if dist.get_rank() == 0 else []
    with pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance="uniform", mesh=mesh) as engine:
        place = (engine.topology.replica, engine.topology.stage)
        train(engine, global_batches(2, STEPS), local=10)
        state = engine.state_dict()
    return {"rank": dist.get_rank(), "place": place, "state": state, "told": told}


def beside_another_dimension_job(twins: bool = False) -> Dict[str, Any]:
    """4 processes as a (dp=1, pp=2, tp=2) mesh: each tp slice runs an engine of its own on other data, starting at
    another time, with a collective over the tp dimension between steps (what a tensor-parallel layer would do).
    ``twins``: the agreements on gloo twins of the slice's groups, as on an nccl job (made by the slice alone)."""
    if twins:
        as_on_nccl()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    tp = mesh.get_local_rank("tp")
    if tp == 1:
        time.sleep(1.5)  # the other slice must not wait for this one
    engine = pipeddp.HybridParallel(make_mlp(seed=tp), stages=2, mode="stage", chunks=2, balance="uniform",
                                    mesh=mesh["dp", "pp"])
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    others = []
    for i, (x, y) in enumerate(global_batches(1, STEPS + tp)):  # the slices even train different numbers of steps
        x, y = x + tp, y - tp
        opt.zero_grad()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        opt.step()
        if i < STEPS:
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t, group=mesh.get_group("tp"))
            others.append(t.item())
    state = engine.state_dict()
    host = engine.agreement.host_group
    twin = host is not engine.topology.group and dist.get_process_group_ranks(host) == engine.topology.job_ranks
    engine.close()
    return {"rank": dist.get_rank(), "tp": tp, "state": state, "tp_sums": others, "twin": twin}
