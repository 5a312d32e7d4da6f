"""Checkpoints of stages whose layers are tensor-parallel (``DTensor`` parameters over a ``tp`` mesh), run by
``test_tp_checkpoints.py``: 4 processes as (dp=1, pp=2, tp=2), each tp slice an engine on ``mesh['dp', 'pp']``
whose stage modules are parallelised here with torch's own styles."""

from __future__ import annotations

import os
from typing import Any, Dict

import nccl_rules
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import pipeddp
from pipeddp.checkpoints import checkpoint as files

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

WIDTH = 8


def model(seed: int) -> nn.Sequential:
    """Two column-then-row parallel pairs with a LayerNorm (left whole) between them, float64."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH), nn.LayerNorm(WIDTH),
                         nn.Linear(WIDTH, 3 * WIDTH), nn.Tanh(), nn.Linear(3 * WIDTH, WIDTH)).double()


def gradients(seed: int) -> Dict[str, torch.Tensor]:
    """A gradient for every parameter of ``model``, drawn from ``seed`` (what one optimizer step takes)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in model(0).named_parameters()}


def stepped(seed: int, grads: int) -> nn.Sequential:
    """The plain model after one SGD step with momentum on ``gradients(grads)`` (the reference)."""
    plain = model(seed)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for k, p in plain.named_parameters():
        p.grad = gradients(grads)[k]
    opt.step()
    return plain


def engine_on(mesh: Any, seed: int, tp: bool) -> pipeddp.HybridParallel:
    """``model(seed)`` in 2 stages on ``mesh['dp', 'pp']``; ``tp``: its Linear layers column/row-parallel over
    ``mesh['tp']`` (the layer after a column-parallel one row-parallel), as the engine's tp_plan would."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    engine = pipeddp.HybridParallel(model(seed), stages=2, mode="stage", chunks=2, balance=[3, 4],
                                    mesh=mesh["dp", "pp"])
    if tp:
        held = {name for name, _ in engine.named_children()}
        plan = {k: v for k, v in {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(),
                                  "6": RowwiseParallel()}.items() if k in held}
        parallelize_module(engine, mesh["tp"], plan)
        engine.tp_mesh = mesh["tp"]
    return engine


def step(engine: nn.Module, grads: int) -> torch.optim.Optimizer:
    """One SGD step with momentum on ``gradients(grads)``, each process taking its part of every gradient."""
    from pipeddp.distributed.shard import shard_like

    opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    whole = gradients(grads)
    for k, p in engine.named_parameters():
        p.grad = shard_like(whole[k], p)
    opt.step()
    return opt


def local_parts(engine: nn.Module) -> Dict[str, Any]:
    """This process's parameters as it holds them: (placements, its local tensor)."""
    out = {}
    for k, v in engine.local_state_dict().items():
        out[k] = (str(getattr(v, "placements", "whole")), (v.to_local() if hasattr(v, "to_local") else v).clone())
    return out


def momentum(engine: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    names = {id(p): k for k, p in engine.named_parameters()}
    return {names[id(p)]: s["momentum_buffer"].full_tensor() if hasattr(s["momentum_buffer"], "full_tensor")
            else s["momentum_buffer"] for p, s in opt.state.items()}


def round_trips_job(tmp: str) -> Dict[str, Any]:
    """pp2 x tp2: save (one file, sharded, a Hugging Face export) after one optimizer step; load a pipeddp file
    and a Hugging Face directory of other weights; then pp2 x dp2 (tp1) loads the tp2 sharded checkpoint and
    saves its own, which pp2 x tp2 resumes."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    out: Dict[str, Any] = {"rank": rank, "tp": mesh.get_local_rank("tp")}

    engine = engine_on(mesh, 0, tp=True)
    opt = step(engine, grads=1)
    out["parts"] = local_parts(engine)
    engine.save(os.path.join(tmp, "one.pt"), optimizer=opt, extra={"step": 1})
    engine.save(os.path.join(tmp, "sharded"), optimizer=opt, extra={"step": 1}, sharded=True)
    engine.save_pretrained(os.path.join(tmp, "hf"))
    out["written"] = sorted(os.listdir(os.path.join(tmp, "hf")))

    # other weights, as a pipeddp file and as a Hugging Face directory, loaded into this layout
    engine.load(os.path.join(tmp, "other.pt"))
    out["from_file"] = (local_parts(engine), engine.state_dict())
    engine.load(os.path.join(tmp, "other-hf"))
    out["from_hf"] = (local_parts(engine), engine.state_dict())
    # refused, all or nothing on every process: a checkpoint of another model (shapes) changes nothing
    try:
        engine.load(os.path.join(tmp, "wrong.pt"))
        out["refused"] = None
    except (ValueError, RuntimeError) as exc:
        out["refused"] = str(exc)
    out["after_refusal"] = engine.state_dict()
    engine.close()

    # tp1: the four processes as 2 replicas x 2 stages, loading the tp2 sharded checkpoint (and the one file)
    flat = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    plain = pipeddp.HybridParallel(model(5), stages=2, mode="stage", chunks=2, balance=[3, 4], mesh=flat)
    opt1 = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    out["tp1_extra"] = plain.load(os.path.join(tmp, "sharded"), optimizer=opt1)
    out["tp1_sharded"] = (plain.state_dict(), momentum(plain, opt1))
    opt1 = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain.load(os.path.join(tmp, "one.pt"), optimizer=opt1)
    out["tp1_file"] = (plain.state_dict(), momentum(plain, opt1))
    plain.save(os.path.join(tmp, "tp1-sharded"), optimizer=opt1, extra={"step": 2}, sharded=True)
    plain.close()

    # and back: tp2 resumes the tp1 sharded checkpoint
    engine = engine_on(mesh, 7, tp=True)
    opt2 = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    out["back_extra"] = engine.load(os.path.join(tmp, "tp1-sharded"), optimizer=opt2)
    out["back"] = (local_parts(engine), engine.state_dict(), momentum(engine, opt2))
    engine.close()
    dist.destroy_process_group()
    return out


def write_inputs(tmp: str) -> None:
    """What the job loads: other weights as a pipeddp file and as a Hugging Face directory; a wrong model."""
    from safetensors.torch import save_file

    def payload(state: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        return {"format": files.FORMAT, "model": state, "optimizer": None, "extra": {}, "rng": [], "meta": {}}

    files.atomic_save(payload(model(3).state_dict()), os.path.join(tmp, "other.pt"))
    os.makedirs(os.path.join(tmp, "other-hf"))
    save_file({k: v.contiguous() for k, v in model(4).state_dict().items()},
              os.path.join(tmp, "other-hf", "model.safetensors"))
    wrong = model(6).state_dict()
    wrong["6.weight"] = torch.zeros(WIDTH, 3 * WIDTH + 1, dtype=torch.float64)
    files.atomic_save(payload(wrong), os.path.join(tmp, "wrong.pt"))

