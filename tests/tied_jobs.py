"""Models and spawned-process jobs for the tied-weight and residual tests (importable by the children)."""

from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Optional

import torch
from torch import nn

import pipeddp
from conftest import data

LOSS = nn.functional.mse_loss


def tied_model(seed: int = 0) -> nn.Sequential:
    """An input projection and an output head sharing one weight (a language model's embedding and head)."""
    torch.manual_seed(seed)
    first = nn.Linear(6, 6, bias=False)
    last = nn.Linear(6, 6, bias=False)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), last).double()


def global_batches(steps: int = 3, n: int = 12) -> List[Any]:
    return [data(n, width=6, seed=40 + i) for i in range(steps)]


def reference_state(model: nn.Sequential, batches: List[Any], momentum: float = 0.9, clip: Optional[float] = None,
                    norm_type: float = 2.0, norms: Optional[List[float]] = None) -> Dict[str, torch.Tensor]:
    """The plain model trained on one device; with ``clip``, torch's clip_grad_norm_ (norms appended to ``norms``)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for x, y in batches:
        opt.zero_grad()
        LOSS(model(x), y).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type).item())
        opt.step()
    return model.state_dict()


class Down(nn.Module):
    """Starts a skip connection: passes (h, skip) on, with a tag that is not a tensor when ``tag``."""

    def __init__(self, tag: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.tag = tag

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return (h, x, "skip") if self.tag else (h, x)


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, pair):
        h, skip, *rest = pair
        return (torch.tanh(self.lin(h)), skip, *rest)


class Up(nn.Module):
    def forward(self, pair):
        h, skip, *rest = pair
        assert not rest or rest == ["skip"], rest
        return h + skip


def unet(tag: bool = True, seed: int = 0) -> nn.Sequential:
    """Down | Middle Middle | Up on three stages: the skip jumps over the whole middle stage.

    Between processes only tensors cross, so the job in stage mode drops the tag.
    """
    torch.manual_seed(seed)
    return nn.Sequential(Down(tag), Middle(), Middle(), Up()).double()


def hybrid_tied_job(mode: str, path: str, clip: Optional[float] = None) -> Dict[str, Any]:
    """2 replicas x 2 stages, the tied weights on different stages; returns states and this rank's copies.

    With ``clip``, gradients are clipped to that norm each step (``engine.clip_grad_norm_``)."""
    model = tied_model()
    engine = pipeddp.HybridParallel(model, stages=2, mode=mode, chunks=3, balance=[2, 3])
    opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    replicas, r = engine.topology.replicas, engine.topology.replica
    norms = []
    for x, y in global_batches():
        local = x.shape[0] // replicas
        x, y = x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]
        opt.zero_grad()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        if clip is not None:
            norms.append(engine.clip_grad_norm_(clip).item())
        opt.step()
    engine.check_replicas()
    engine.save(path)
    out = {"state": engine.state_dict(), "local": engine.local_state_dict(), "rank": engine.topology.rank,
           "norms": norms}
    engine.close()
    out["one_weight_after_close"] = model[4].weight is model[0].weight
    return out


def stage_unet_job() -> Dict[str, Any]:
    engine = pipeddp.HybridParallel(unet(tag=False), stages=3, mode="stage", chunks=2, balance=[1, 2, 1])
    x, y = data(6, width=6, seed=5)
    engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
    grads = {name: p.grad.clone() for name, p in engine.named_parameters()}
    engine.close()
    return {"grads": grads, "rank": int(os.environ["RANK"])}


def shared_model(seed: int = 0) -> nn.Sequential:
    """One Linear used at three positions: cut [1, 2, 1, 2] over 2 devices x 2 virtual stages, its uses fall on
    stages 0 and 2 (the same device) and stage 3 (the other device)."""
    torch.manual_seed(seed)
    shared = nn.Linear(6, 6, bias=False)
    return nn.Sequential(shared, nn.Tanh(), nn.Linear(6, 6), shared, nn.Tanh(), shared).double()


def halves_loss(calls: int):
    """The loss of one of ``calls`` equal parts of a batch, so that the parts' gradients add up to the batch's."""
    return lambda out, y: LOSS(out, y) / calls


def shared_tie_job(mode: str, schedule: str, virtual: int, calls: int = 1, placement: str = "loop") -> Dict[str, Any]:
    """2 replicas x 2 devices x ``virtual`` stages of ``shared_model``, 3 steps of SGD with momentum.

    Each step's local batch is run as ``calls`` calls of ``train_step`` without ``zero_grad`` between them."""
    balance = [1, 2, 1, 2] if virtual == 2 else [3, 3]
    engine = pipeddp.HybridParallel(shared_model(), stages=2, mode=mode, chunks=3, balance=balance,
                                    schedule=schedule, virtual_stages=virtual, placement=placement)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    replicas, r = engine.topology.replicas, engine.topology.replica
    for x, y in global_batches():
        local = x.shape[0] // replicas
        x, y = x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]
        opt.zero_grad()
        for xc, yc in zip(x.tensor_split(calls), y.tensor_split(calls)):
            engine.train_step(xc if engine.is_first else None, yc if engine.is_last else None, halves_loss(calls))
        opt.step()
    engine.check_replicas()
    out = {"state": engine.state_dict(), "local": engine.local_state_dict(), "rank": engine.topology.rank}
    engine.close()
    return out


#: Three optimizer steps of two calls each, with no ``zero_grad`` between a step's calls.
ACCUMULATED_ROUNDS = 3


def accumulated_batches() -> List[List[Any]]:
    """Per optimizer step, the two global batches its two calls take (12 and 8: micro-batches of 4 and of 3, 3, 2)."""
    return [[data(12, width=6, seed=60 + 2 * i), data(8, width=6, seed=61 + 2 * i)]
            for i in range(ACCUMULATED_ROUNDS)]


def zero_grad_between(opt: torch.optim.Optimizer, step: int) -> None:
    """The way the user clears gradients before step ``step``: in place (zeros) or by dropping them."""
    opt.zero_grad(set_to_none=step % 2 == 0)


def accumulated_reference(model: nn.Sequential, clip: float) -> Dict[str, Any]:
    """The plain model accumulating each step's two batches (each call's mean loss), then clipping and stepping.

    Returns per step the gradients (every name of the tied weight, ``remove_duplicate=False``) and the
    clip norm, and the final state."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads, norms = [], []
    for step, calls in enumerate(accumulated_batches()):
        zero_grad_between(opt, step)
        for x, y in calls:
            LOSS(model(x), y).backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters(remove_duplicate=False)})
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    return {"grads": grads, "norms": norms, "state": model.state_dict()}


def hybrid_accumulation_job(mode: str, clip: float) -> Dict[str, Any]:
    """2 stages with the tied weight on both; each optimizer step takes two calls without ``zero_grad``.

    Replica mode mixes ``train_step`` with ``engine(x)`` + ``loss.backward()``; stage mode (where a
    backward through the output needs every stage) calls ``train_step`` twice."""
    model = tied_model()
    engine = pipeddp.HybridParallel(model, stages=2, mode=mode, chunks=3, balance=[2, 3])
    opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    replicas, r = engine.topology.replicas, engine.topology.replica
    grads, norms = [], []
    for step, calls in enumerate(accumulated_batches()):
        zero_grad_between(opt, step)
        for call, (x, y) in enumerate(calls):
            local = x.shape[0] // replicas
            x, y = x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]
            if mode == "replica" and (step + call) % 2 == 1:
                LOSS(engine(x), y).backward()
            else:
                engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        grads.append({k: p.grad.clone() for k, p in engine.named_parameters()})
        norms.append(engine.clip_grad_norm_(clip).item())
        opt.step()
    engine.check_replicas()
    out = {"grads": grads, "norms": norms, "state": engine.state_dict(), "rank": engine.topology.rank}
    engine.close()
    return out


def stage_refresh_job() -> Dict[str, Any]:
    """2 stages in 2 processes, the embedding's weight tied to the head's: the head's copy (in the other process)
    across evaluation forwards, an edit in place on the embedding's process alone, and a training step. Returns
    the last rank's outputs and the head copy's version counter after each forward (each broadcast writes it)."""
    model = tied_model()
    x, y = data(6, width=6, seed=5)
    engine = pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=3, balance=[2, 3])
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    mine = engine.stages[0].module[0 if engine.is_first else 2].weight  # the embedding, or the head's copy
    outs, versions = [], []

    def evaluate() -> None:
        with torch.no_grad():
            out = engine(x if engine.is_first else None)
        outs.append(out)
        versions.append(mine._version)

    for _ in range(3):
        evaluate()
    if engine.is_first:
        with torch.no_grad():
            mine.mul_(0.5)  # on this process only: the next forward's check finds it
    evaluate()
    evaluate()
    opt.zero_grad()
    engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
    opt.step()
    evaluate()
    out = {"outs": outs, "versions": versions, "weight": mine.detach().clone(), "last": engine.is_last}
    engine.close()
    return out
