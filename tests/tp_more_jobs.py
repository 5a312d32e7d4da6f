"""Jobs of ``test_tp_more.py``: a Llama on a pp2 x tp2 mesh through a loss over tokens, a skipped step, evaluate,
autocast, and an embedding tied to its head, one engine after another in the same four processes."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import nccl_rules
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from tp_jobs import LR, SEED, VOCAB, llama, lm_batches, lm_loss, whole

import pipeddp
from pipeddp.runtime.dtensors import local
from pipeddp.tools.models import flatten_sequential

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

SHAPE = (1, 2, 2)  # dp, pp, tp
N = 4  # samples a batch


def batches() -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Two batches whose labels are padded (-100) unevenly, so a mean of micro-batch means is not the token mean."""
    (x, y), = lm_batches(2 * N)
    y = y.clone()
    y[0, 2:] = -100
    y[1, 1:] = -100
    y[6, 4:] = -100
    return [(x[:N], y[:N]), (x[N:], y[N:])]


def counted(out: Any, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The loss over the batch's tokens as (sum, how many): the step divides by the whole batch's count."""
    out = getattr(out, "logits", out)
    total = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=-100,
                                        reduction="sum")
    return total, (y != -100).sum()


def metrics(out: Any, y: torch.Tensor) -> Dict[str, Any]:
    """A loss over tokens (total, count) and a per-sample mean: evaluate weighs each its own way."""
    total, count = counted(out, y)
    hits = (out.argmax(-1) == y).double().mean()
    return {"loss": (total, count), "top1": hits}


def model(dtype: torch.dtype, tied: bool = False) -> nn.Sequential:
    x = lm_batches(1)[0][0]
    return flatten_sequential(llama(tied=tied).to(dtype), x)


def refused_head(mesh: Any) -> str:
    """What a plan that leaves the head's logits split over the vocabulary is told (nothing is built)."""
    m = llama()
    plan = {**m.tp_plan, "lm_head": "colwise"}
    try:
        pipeddp.HybridParallel(flatten_sequential(m, lm_batches(1)[0][0]), stages=2, mode="stage", mesh=mesh,
                               tp_plan=plan).close()
    except ValueError as exc:
        return str(exc)
    return "built"


def float64_steps(mesh: Any) -> Dict[str, Any]:
    """A step on a loss over tokens; a step whose gradient holds an inf in one tp rank's shard (stage 0, t = 1);
    a step after it; evaluate."""
    (xa, ya), (xb, yb) = batches()
    out: Dict[str, Any] = {}
    place = tuple(mesh.get_coordinate() or ())
    with pipeddp.HybridParallel(model(torch.float64), stages=mesh.size(1), mode="stage", seed=SEED, mesh=mesh,
                                tp_plan="auto", chunks=2, balance="params", skip_nonfinite=True) as engine:
        first, last = engine.is_first, engine.is_last
        opt = torch.optim.SGD(engine.parameters(), lr=LR)
        out["loss1"] = engine.train_step(xa if first else None, ya if last else None, counted).item()
        out["grads1"] = whole((k, p.grad) for k, p in engine.named_parameters())
        opt.step()
        opt.zero_grad()
        out["after1"] = whole(engine.named_parameters())
        armed = [place[1:] == (0, 1)]
        # a projection's weight: its gradient is a shard (an embedding's comes replicated, then is cut to its rows)
        shard = next(p for k, p in engine.named_parameters() if "_proj" in k and isinstance(p, DTensor)
                     and isinstance(p.placements[0], Shard))

        def poison(p: torch.Tensor) -> None:
            if armed[0]:
                with torch.no_grad():
                    local(p.grad).view(-1)[0] = float("inf")
        hook = shard.register_post_accumulate_grad_hook(poison)
        out["loss2"] = engine.train_step(xb if first else None, yb if last else None, counted).item()
        out["grads2"] = [k for k, p in engine.named_parameters() if p.grad is not None]
        out["skipped"] = engine.skipped_steps
        opt.step()
        opt.zero_grad()
        out["after2"] = whole(engine.named_parameters())
        armed[0] = False
        hook.remove()
        out["loss3"] = engine.train_step(xb if first else None, yb if last else None, counted).item()
        opt.step()
        out["after3"] = whole(engine.named_parameters())
        out["skipped3"] = engine.skipped_steps
        out["evaluated"] = engine.evaluate([(xa, ya), (xb, yb)], metrics)
    return out


def autocast_step(mesh: Any) -> Dict[str, Any]:
    """One float32 step under CPU autocast to bfloat16: loss, gradients, weights after."""
    (x, y), _ = batches()
    y = y.clamp(min=0)
    with pipeddp.HybridParallel(model(torch.float32), stages=mesh.size(1), mode="stage", seed=SEED, mesh=mesh,
                                tp_plan="auto", chunks=2, balance="params") as engine:
        opt = torch.optim.SGD(engine.parameters(), lr=LR)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = engine.train_step(x if engine.is_first else None, y if engine.is_last else None, lm_loss)
        grads = whole((k, p.grad) for k, p in engine.named_parameters())
        opt.step()
        return {"loss": loss.item(), "grads": grads, "after": whole(engine.named_parameters())}


def refused_tie(mesh: Any) -> str:
    """What a plan that splits a tied embedding but leaves its head whole is told (nothing is built)."""
    plan = {k: v for k, v in llama(tied=True).tp_plan.items() if k != "lm_head"}
    try:
        pipeddp.HybridParallel(model(torch.float64, tied=True), stages=2, mode="stage", mesh=mesh,
                               tp_plan=plan).close()
    except ValueError as exc:
        return str(exc)
    return "built"


def one_step(engine: pipeddp.HybridParallel, x: torch.Tensor, y: torch.Tensor) -> Dict[str, Any]:
    """The engine's weights (whole) before a step of SGD on ``(x, y)``, its loss, gradients and weights after."""
    out: Dict[str, Any] = {"before": whole(engine.named_parameters())}
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    out["loss"] = engine.train_step(x if engine.is_first else None, y if engine.is_last else None, counted).item()
    out["grads"] = whole((k, p.grad) for k, p in engine.named_parameters())
    opt.step()
    out["after"] = whole(engine.named_parameters())
    return out


def tied_step(mesh: Any, tmp: str) -> Dict[str, Any]:
    """A Llama whose embedding is tied to its head (stage 0 and stage 1), both split by rows of the vocabulary under
    'auto', meta-built from the seed: its weights at the start, one step's loss, gradients, weights after; saved
    then to ``tmp`` as one file and with ``save_pretrained``."""
    (x, y), _ = batches()
    with pipeddp.HybridParallel(model(torch.float64, tied=True), stages=mesh.size(1), mode="stage", seed=SEED,
                                mesh=mesh, tp_plan="auto", chunks=2, balance="params") as engine:
        out = one_step(engine, x, y)
        engine.save(os.path.join(tmp, "tied.pt"))
        engine.save_pretrained(os.path.join(tmp, "tied"))
    return out


def tp_more_job(tmp: str) -> Dict[str, Any]:
    """Every check of ``test_tp_more`` in one pp2 x tp2 job: the group and the mesh made once."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=("dp", "pp", "tp"))
    return {"place": tuple(mesh.get_coordinate() or ()), "refused": refused_head(mesh),
            "float64": float64_steps(mesh), "bf16": autocast_step(mesh), "vocab": VOCAB,
            "refused_tie": refused_tie(mesh), "tied": tied_step(mesh, tmp)}


def tied_replicas(mesh: Any, **kwargs: Any) -> Dict[str, Any]:
    """The tied Llama of ``tied_step`` over two replicas, each taking its half of the two batches (one global batch
    of 2 * N, the loss over its tokens): weights before, loss, gradients, weights after a step."""
    x, y = batches()[mesh.get_local_rank("dp")]
    with pipeddp.HybridParallel(model(torch.float64, tied=True), stages=mesh.size(1), mode="stage", seed=SEED,
                                mesh=mesh, tp_plan="auto", chunks=2, balance="params", **kwargs) as engine:
        out = one_step(engine, x, y)
    return out


def skipped_full(mesh: Any) -> Dict[str, Any]:
    """The MLP under shard="full" and skip_nonfinite: a step whose gradient holds an inf in one rank's shard (replica
    0, stage 0, t = 1: its gathered fc1 weight's gradient, before the reduce-scatter), then the same batch again."""
    from tp_jobs import MLP_PLAN, mlp, mlp_batches, mse

    x, y = (t[mesh.get_local_rank("dp") * N:][:N] for t in mlp_batches(2 * N)[0])
    armed = [tuple(mesh.get_coordinate() or ()) == (0, 0, 1)]

    def poison(grad: torch.Tensor) -> torch.Tensor:  # FSDP2 keeps the gathered weight, and its hooks, for step 2
        if not armed[0]:
            return grad
        grad = grad.clone()
        local(grad).view(-1)[0] = float("inf")
        return grad

    def hook(module: nn.Module, args: Any) -> None:  # the weight as FSDP2 gathered it for this forward
        if armed[0] and module.weight.requires_grad:
            module.weight.register_hook(poison)

    with pipeddp.HybridParallel(mlp(), stages=mesh.size(1), mode="stage", seed=SEED, mesh=mesh, tp_plan=MLP_PLAN,
                                chunks=2, balance="params", shard="full", skip_nonfinite=True) as engine:
        opt = torch.optim.SGD(engine.parameters(), lr=LR)
        before = whole(engine.named_parameters())
        fc1 = [m for k, m in engine.stages[0].module.named_modules() if k.endswith("fc1")][0]
        handle = fc1.register_forward_pre_hook(hook)
        first = engine.train_step(x if engine.is_first else None, y if engine.is_last else None, mse).item()
        opt.step()
        opt.zero_grad()
        out = {"skipped": engine.skipped_steps, "unchanged": whole(engine.named_parameters()), "before": before}
        armed[0] = False
        handle.remove()
        out["loss1"] = first
        out["loss"] = engine.train_step(x if engine.is_first else None, y if engine.is_last else None, mse).item()
        opt.step()
        out["after"] = whole(engine.named_parameters())
        out["skipped2"] = engine.skipped_steps
    return out


def tp_replicas_job() -> Dict[str, Any]:
    """dp2 x pp2 x tp2: the tied Llama under 'zb' and under shard="optimizer"; a skipped step under shard="full"."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    return {"place": tuple(mesh.get_coordinate() or ()), "tied-zb": tied_replicas(mesh, schedule="zb"),
            "tied-optimizer": tied_replicas(mesh, shard="optimizer"), "full-skip": skipped_full(mesh)}
