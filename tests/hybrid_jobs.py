"""Functions run inside spawned processes by the hybrid tests (importable by the children)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch
from torch import nn

import pipeddp
from conftest import data, make_mlp

LOSS = nn.functional.mse_loss
HOOK_CALLS: Dict[int, int] = {}


def counting_hook(state, bucket):  # no annotations: DDP checks them
    """An all-reduce comm hook that counts its calls per stage group."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    key = id(state)
    HOOK_CALLS[key] = HOOK_CALLS.get(key, 0) + 1
    return default_hooks.allreduce_hook(state, bucket)


def global_batches(replicas: int, steps: int, local: int = 10, width: int = 12):
    return [data(local * replicas, width=width, seed=100 + i) for i in range(steps)]


def local_slice(batch, replica: int, local: int):
    x, y = batch
    return x[replica * local:(replica + 1) * local], y[replica * local:(replica + 1) * local]


def train(engine: pipeddp.HybridParallel, batches, local: int, optimizer=None, lr: float = 0.1) -> List[float]:
    opt = optimizer or torch.optim.SGD(engine.parameters(), lr=lr)
    losses = []
    for batch in batches:
        x, y = local_slice(batch, engine.topology.replica, local)
        opt.zero_grad()
        loss = engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        losses.append(loss.item())
        opt.step()
    return losses


def init() -> None:
    """One process group for the whole job, so that several engines can be built one after another."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


def equivalence_job(mode: str, stages: int, replicas: int, combos) -> List[Dict[str, Any]]:
    """Train 3 steps per (schedule, chunks) combination; return losses and the consolidated weights."""
    init()
    out = []
    for schedule, chunks, checkpoint in combos:
        engine = pipeddp.HybridParallel(make_mlp(), stages=stages, mode=mode, chunks=chunks, schedule=schedule,
                                        checkpoint=checkpoint, balance="uniform", comm_hook=counting_hook)
        HOOK_CALLS.clear()
        losses = train(engine, global_batches(replicas, 3), local=10)
        engine.check_replicas()
        out.append({"schedule": schedule, "chunks": chunks, "checkpoint": checkpoint, "losses": losses,
                    "state": engine.state_dict(), "local": engine.local_state_dict(),
                    "hook_calls": sorted(HOOK_CALLS.values()), "ddp": len([d for d in engine._ddps if d])})
        engine.close()
    return out


def bad_batch_job() -> str:
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="replica", chunks=2)
    n = 8 if engine.topology.rank == 1 else 10
    x, y = data(n)
    try:
        engine.train_step(x, y, LOSS)
    except ValueError as exc:
        return str(exc)
    finally:
        engine.close()
    return "no error"


def indivisible_world_job() -> str:
    try:
        pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage")
    except ValueError as exc:
        return str(exc)
    return "no error"


def checkpoint_save_job(path: str, mode: str) -> Dict[str, Any]:
    """2 x 2: train 2 steps with momentum, save, train 2 more; return the final weights."""
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode=mode, chunks=3)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    batches = global_batches(2, 4)
    train(engine, batches[:2], local=10, optimizer=opt)
    engine.save(path, optimizer=opt, extra={"step": 2})
    train(engine, batches[2:], local=10, optimizer=opt)
    state = engine.state_dict()
    engine.close()
    return state


def checkpoint_resume_job(path: str, mode: str, stages: int) -> Dict[str, Any]:
    """Load the 2-step checkpoint into another layout and train the remaining 2 steps."""
    engine = pipeddp.HybridParallel(make_mlp(seed=99), stages=stages, mode=mode, chunks=2)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    extra = engine.load(path, optimizer=opt)
    assert extra == {"step": 2}
    replicas = engine.topology.replicas
    batches = global_batches(2, 4)
    # the global batch is the same whatever the replica count: re-slice it
    local = 20 // replicas
    train(engine, batches[2:], local=local, optimizer=opt)
    state = engine.state_dict()
    engine.close()
    return state


def eval_job(n_samples: int, mode: str, stages: int, options: Optional[Dict[str, Any]] = None) -> Dict[str, float]:
    engine = pipeddp.HybridParallel(make_mlp(width=4, depth=3), stages=stages, mode=mode, chunks=2, **(options or {}))
    xs = torch.randn(n_samples, 4, dtype=torch.float64)
    ids = torch.arange(n_samples, dtype=torch.float64)
    dataset = torch.utils.data.TensorDataset(xs, ids)
    loader = pipeddp.data.loader(dataset, batch_size=2, engine=engine, train=False)

    def metric(out, idx):
        return {"id": idx.mean(), "id_sq": (idx ** 2).mean(), "one": torch.tensor(1.0)}

    result = engine.evaluate(loader, metric)
    engine.close()
    return result


def torchrun_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def traced_job(mode: str, stages: int) -> List[Dict[str, Any]]:
    init()
    engine = pipeddp.HybridParallel(make_mlp(), stages=stages, mode=mode, chunks=4, trace=True)
    train(engine, global_batches(2, 2), local=10)
    spans = engine.trace.to_json()
    engine.close()
    return spans


def nonfinite_job(mode: str) -> Dict[str, Any]:
    """Replica 1's batch holds a NaN at step 1: every rank must skip that step together."""
    import warnings

    init()
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode=mode, chunks=2, skip_nonfinite=True)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    seen = []
    for step, batch in enumerate(global_batches(2, 3)):
        x, y = local_slice(batch, engine.topology.replica, 10)
        if step == 1 and engine.topology.replica == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        before = [p.detach().clone() for p in engine.parameters()]
        opt.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        opt.step()
        changed = any(not torch.equal(a, b) for a, b in zip(before, engine.parameters()))
        seen.append({"changed": changed, "warnings": [str(w.message) for w in caught]})
    engine.check_replicas()
    engine.close()
    return {"steps": seen, "skipped": engine.skipped_steps}


def ddp_options_job(mode: str, chunks: int) -> Dict[str, Any]:
    """DDP options reach every stage: many small buckets, bucket views, unused-parameter search, fp16 hook."""
    init()
    out: Dict[str, Any] = {}
    options = {
        "buckets": dict(ddp_kwargs={"bucket_cap_mb": 0.0005, "gradient_as_bucket_view": True}),
        "unused": dict(ddp_kwargs={"find_unused_parameters": True}),
        "fp16": dict(comm_hook="fp16"),
        "bf16": dict(comm_hook="bf16"),
        "powersgd": dict(comm_hook="powersgd"),
    }
    for name, kw in options.items():
        hook = kw.pop("comm_hook", None)
        engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode=mode, chunks=chunks, balance="uniform",
                                        comm_hook=hook or counting_hook, **kw)
        HOOK_CALLS.clear()
        train(engine, global_batches(2, 3), local=10)
        engine.check_replicas()
        out[name] = {"state": engine.state_dict(), "hook_calls": sorted(HOOK_CALLS.values())}
        engine.close()
    return out


def batchnorm_job(mode: str) -> Dict[str, Any]:
    """BatchNorm buffers under DDP's broadcast_buffers: every replica ends with rank 0's running stats."""
    init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 12), nn.BatchNorm1d(12),
                          nn.Linear(12, 12)).double()
    engine = pipeddp.HybridParallel(model, stages=2, mode=mode, chunks=2, balance=[3, 3])
    train(engine, global_batches(2, 3), local=10)
    buffers = {k: v for k, v in engine.local_state_dict().items() if "running" in k}
    engine.close()
    return buffers



class ScaledBy(nn.Module):
    """Multiplies by a buffer: autograd saves the buffer for the input's gradient, so a buffer changed in place
    between this forward and its backward makes the backward refuse to run."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def scaled_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 12), ScaledBy(12), nn.Tanh(), nn.Linear(12, 12), ScaledBy(12),
                         nn.Linear(12, 12)).double()


def buffer_in_backward_job(mode: str) -> Dict[str, Any]:
    """DDP's buffers broadcast (the default) with a buffer that the backward reads: the step trains as the plain
    model does, and every replica holds the first's buffers after it."""
    init()
    engine = pipeddp.HybridParallel(scaled_model(), stages=2, mode=mode, chunks=2, balance=[3, 3])
    train(engine, global_batches(2, 2), local=10)
    state = {k: v.clone() for k, v in engine.local_state_dict().items()}
    engine.close()
    return state


def forward_backward_job() -> List[torch.Tensor]:
    """Replica mode, 2 replicas: loss_fn(engine(x), y).backward() averages the gradients like train_step."""
    init()
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="replica", chunks=3, balance="uniform",
                                    devices=["cpu", "cpu"], comm_hook=counting_hook)
    HOOK_CALLS.clear()
    x, y = local_slice(global_batches(2, 1)[0], engine.topology.replica, 10)
    LOSS(engine(x), y).backward()
    grads = [p.grad.clone() for p in engine.parameters()]
    calls = sorted(HOOK_CALLS.values())
    engine.close()
    return grads + [torch.tensor(calls)]


def schedule_job(mode: str, stages: int, replicas: int, combos) -> List[Dict[str, Any]]:
    """Train 3 steps per (schedule, virtual_stages, chunks, checkpoint[, placement]); return each step's gradients
    by name, the final weights, and how many gradient all-reduces each stage group ran."""
    init()
    out = []
    for combo in combos:
        schedule, virtual, chunks, checkpoint = combo[:4]
        placement = combo[4] if len(combo) > 4 else "loop"
        engine = pipeddp.HybridParallel(make_mlp(), stages=stages, mode=mode, chunks=chunks, schedule=schedule,
                                        virtual_stages=virtual, checkpoint=checkpoint, balance="uniform",
                                        comm_hook=counting_hook, placement=placement)
        HOOK_CALLS.clear()
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        grads = []
        for batch in global_batches(replicas, 3):
            x, y = local_slice(batch, engine.topology.replica, 10)
            opt.zero_grad()
            engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
            grads.append({n: p.grad.clone() for n, p in engine.named_parameters()})
            opt.step()
        engine.check_replicas()
        out.append({"combo": tuple(combo), "grads": grads,
                    "state": engine.local_state_dict(), "hook_calls": sorted(HOOK_CALLS.values()),
                    "ddp": len([d for d in engine._ddps if d]), "stages": [st.index for st in engine.stages]})
        engine.close()
    return out


def fifo_backwards(stages: int, chunks: int):
    """A schedule written by hand, as data: every forward, then the backwards in the order of the forwards."""
    return [[("F", i) for i in range(chunks)] + [("B", i) for i in range(chunks)] for _ in range(stages)]


def layout_job(batches) -> List[Dict[str, Any]]:
    """Stage mode, 2 replicas x 2 stages with the copies of a stage on neighbouring ranks (layout="data"), under
    1F1B and under a schedule written by hand; the batch size changes between steps. The state, and per step the
    headers this rank sent (none where every rank's batch has the shapes of the step before)."""
    init()
    out = []
    for schedule in ("1f1b", fifo_backwards):
        engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", layout="data", chunks=4,
                                        schedule=schedule, balance="uniform")
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        channels = engine._replica.runner.channels
        headers = []
        for x, y in batches:
            local = x.shape[0] // engine.topology.replicas
            x, y = local_slice((x, y), engine.topology.replica, local)
            opt.zero_grad()
            before = sum(ch.headers for ch in channels)
            engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
            headers.append(sum(ch.headers for ch in channels) - before)
            opt.step()
        out.append({"state": engine.state_dict(), "headers": headers, "first": engine.is_first})
        engine.close()
    return out
