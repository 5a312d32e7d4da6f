"""Functions run inside spawned processes by the sharding tests (importable by the children)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist
from conftest import data, make_mlp
from hybrid_jobs import init
from torch import nn

import pipeddp

LOSS = nn.functional.mse_loss
WIDTH = 7  # rows that 2 replicas do not divide: FSDP pads the last shard
LOCAL = 6
MAX_NORM = 0.5


def model() -> nn.Sequential:
    return make_mlp(width=WIDTH)


def batches(replicas: int, steps: int = 2):
    return [data(LOCAL * replicas, width=WIDTH, seed=300 + i) for i in range(steps)]


def reference(replicas: int, steps: int = 2, clip: bool = True) -> Dict[str, Any]:
    """Plain AdamW on one device over the global batches (clipped at ``MAX_NORM``): weights and norms."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    norms = []
    for x, y in batches(replicas, steps):
        opt.zero_grad()
        LOSS(net(x), y).backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM).item())
        opt.step()
    return {"state": net.state_dict(), "norms": norms}


def _step(engine: pipeddp.HybridParallel, opt: torch.optim.Optimizer, batch: Any) -> None:
    """One step on this replica's rows of a global batch (any replica count that divides it)."""
    x, y = batch
    local = x.shape[0] // engine.topology.replicas
    r = engine.topology.replica
    x, y = x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]
    opt.zero_grad()
    engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
    opt.step()


def save_job(path: str, mode: str) -> None:
    """One sharded AdamW step on the first global batch, then a one-file and a sharded (DCP) checkpoint."""
    init()
    engine = pipeddp.HybridParallel(model(), stages=2, mode=mode, chunks=3, balance="uniform", shard="optimizer")
    opt = torch.optim.AdamW(engine.parameters(), lr=0.01)
    _step(engine, opt, batches(2, 1)[0])
    engine.save(f"{path}/one.pt", opt)
    engine.save(f"{path}/dcp", opt, sharded=True)
    engine.save_checkpoint(f"{path}/run", 1, opt, sharded=True, async_save=True)
    engine.close()  # waits for the background save


def load_job(path: str, mode: str, combos: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Load each checkpoint into another layout (``combo``: shard=, which file), run the second step; weights."""
    init()
    out = []
    for combo in combos:
        engine = pipeddp.HybridParallel(model(), stages=2, mode=mode, chunks=2, balance="uniform",
                                        schedule=combo.get("schedule", "1f1b"), shard=combo["shard"])
        opt = torch.optim.AdamW(engine.parameters(), lr=0.01)
        if combo["file"] == "run":  # the newest complete checkpoint of a save_checkpoint directory
            assert engine.resume(f"{path}/run", opt) is not None
        else:
            engine.load(f"{path}/{combo['file']}", opt)
        _step(engine, opt, batches(2, 2)[1])
        out.append({"combo": combo, "state": engine.state_dict()})
        engine.close()
    return out


class Counts:
    """Counts FSDP's all-gathers and reduce-scatters (the calls FSDP2 makes through torch.distributed)."""

    def __init__(self) -> None:
        from pipeddp.distributed.shard import GlooAllGather, GlooReduceScatter

        self.calls = {"all_gather": 0, "reduce_scatter": 0}
        # the names FSDP2 calls: *_single in newer torch, *_into_tensor / *_tensor in older (2.11)
        self._names = (("all_gather_single", "reduce_scatter_single") if hasattr(dist, "all_gather_single")
                       else ("all_gather_into_tensor", "reduce_scatter_tensor"))
        self._saved = tuple(getattr(dist, n) for n in self._names)
        self._gloo = (GlooAllGather.calls, GlooReduceScatter.calls)

        def counting(name, fn):
            def call(*args, **kwargs):
                self.calls[name] += 1
                return fn(*args, **kwargs)
            return call

        setattr(dist, self._names[0], counting("all_gather", self._saved[0]))
        setattr(dist, self._names[1], counting("reduce_scatter", self._saved[1]))

    def close(self) -> None:
        """Stop counting; add the calls FSDP made through pipeddp's gloo collectives."""
        from pipeddp.distributed.shard import GlooAllGather, GlooReduceScatter

        for name, fn in zip(self._names, self._saved):
            setattr(dist, name, fn)
        self.calls["all_gather"] += GlooAllGather.calls - self._gloo[0]
        self.calls["reduce_scatter"] += GlooReduceScatter.calls - self._gloo[1]


def train_job(mode: str, combos: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Two AdamW steps (clipped) per combination; weights, norms, what the parameters are, collective counts."""
    init()
    out = []
    for combo in combos:
        kwargs = dict(combo)
        engine = pipeddp.HybridParallel(model(), stages=2, mode=mode, balance="uniform", **kwargs)
        R, r = engine.topology.replicas, engine.topology.replica
        local = engine.replica_batch or LOCAL
        opt = torch.optim.AdamW(engine.parameters(), lr=0.01)
        counts = Counts()
        norms = []
        try:
            for x, y in batches(R):
                x, y = x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]
                opt.zero_grad()
                engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
                norms.append(engine.clip_grad_norm_(MAX_NORM).item())
                opt.step()
        finally:
            counts.close()
        params = list(engine.parameters())
        state_numel = sum(t.to_local().numel() for s in opt.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor) and t.dim() > 0)
        out.append({"combo": combo, "state": engine.state_dict(), "norms": norms, "calls": counts.calls,
                    "dtensor": all(type(p).__name__ == "DTensor" for p in params),
                    "grad_dtensor": all(type(p.grad).__name__ == "DTensor" for p in params),
                    "local_numel": sum(p.to_local().numel() for p in params),
                    "whole_numel": sum(p.numel() for p in params), "state_numel": state_numel,
                    "groups": sum(1 for st in engine.stages for m in st.module.modules()
                                  if type(m).__name__.startswith("FSDP")),
                    "stages": len(engine.stages)})
        engine.close()
    return out


class Overflows(nn.Module):
    """A Linear whose weight gradient becomes inf while ``armed`` (the hook sits on the weight as used in forward,
    which under FSDP is the gathered parameter, not the shard the user holds)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.armed = False

    def forward(self, x):
        w = self.lin.weight * 1.0
        if self.armed and w.requires_grad:
            w.register_hook(lambda g: g * float("inf"))
        return nn.functional.linear(x, w, self.lin.bias)


def nonfinite_job(mode: str, shard: str) -> Dict[str, Any]:
    """An overflow in the last stage's gradients at step 1: a GradScaler run and a skip_nonfinite run."""
    init()
    out: Dict[str, Any] = {}
    for kind in ("scaler", "skip"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), Overflows(8))
        engine = pipeddp.HybridParallel(net, stages=2, mode=mode, chunks=2, balance=[2, 1], shard=shard,
                                        skip_nonfinite=kind == "skip")
        opt = torch.optim.AdamW(engine.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if kind == "scaler" else None
        history = []
        for step in range(3):
            net[2].armed = step == 1
            x, y = data(8, width=8, seed=10 + step)
            x, y = x.float(), y.float()
            before = [p.detach().to_local().clone() for p in engine.parameters()]
            opt.zero_grad()
            engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS, scaler=scaler)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            changed = any(not torch.equal(a, b.detach().to_local()) for a, b in zip(before, engine.parameters()))
            history.append({"changed": changed, "scale": scaler.get_scale() if scaler is not None else None})
        out[kind] = {"history": history, "skipped": engine.skipped_steps}
        engine.close()
    return out


def tied_job(mode: str, combos: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """An input projection and output head sharing one weight, on stages 0 and 1, sharded; SGD with momentum,
    clipped; the global batch of 12 over the replicas."""
    from tied_jobs import global_batches, tied_model

    init()
    out = []
    for combo in combos:
        engine = pipeddp.HybridParallel(tied_model(), stages=2, mode=mode, balance=[2, 3], **combo)
        opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
        norms = []
        for x, y in global_batches():
            local = x.shape[0] // engine.topology.replicas
            r = engine.topology.replica
            x, y = x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]
            opt.zero_grad()
            engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
            norms.append(engine.clip_grad_norm_(MAX_NORM).item())
            opt.step()
        out.append({"combo": combo, "state": engine.state_dict(), "norms": norms})
        engine.close()
    return out


def call_job() -> Dict[str, Any]:
    """Replica mode: ``loss_fn(engine(x), y).backward()`` instead of train_step, then an evaluation forward."""
    init()
    engine = pipeddp.HybridParallel(model(), stages=2, chunks=3, balance="uniform", shard="optimizer", trace=True)
    opt = torch.optim.AdamW(engine.parameters(), lr=0.01)
    r = engine.topology.replica
    for x, y in batches(2):
        opt.zero_grad()
        LOSS(engine(x[r * LOCAL:(r + 1) * LOCAL]), y[r * LOCAL:(r + 1) * LOCAL]).backward()
        opt.step()
    with torch.no_grad():
        out = engine(batches(2)[0][0])
    resharded = all(p.to_local().numel() < p.numel() for p in engine.parameters())  # the gathered copies freed
    reductions = sorted(sp.stage for sp in engine.trace.spans if sp.kind == "reduce_scatter")
    result = {"state": engine.state_dict(), "out": out, "resharded": resharded, "reductions": reductions}
    engine.close()
    return result


def uneven_evaluation_job(mode: str, shard: str) -> Dict[str, Any]:
    """9 evaluation samples over 2 replicas (5 and 4: 3 and 2 batches of 2): every metric of shard='none'."""
    init()
    engine = pipeddp.HybridParallel(model(), stages=2, mode=mode, chunks=2, balance="uniform", shard=shard,
                                    timeout=60)
    x, y = data(9, width=WIDTH, seed=77)
    dataset = torch.utils.data.TensorDataset(x, y)
    loader = pipeddp.data.loader(dataset, 2, engine=engine, train=False)
    got = engine.evaluate(loader, lambda out, t: {"mse": LOSS(out, t)})
    resharded = all(p.to_local().numel() < p.numel() for p in engine.parameters()) if shard != "none" else True
    engine.close()
    return {"metrics": got, "resharded": resharded}
