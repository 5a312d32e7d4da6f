"""Dropout under tensor parallelism (``tp_plan=``), with and without recompute, equals the plain model on one device.

Without tp the engine runs each stage's forward of micro-batch i from the
seed ``base + 1_000_003 * stage + i`` (``runtime/rng.py``), so its dropout
masks are those of the plain model run micro-batch by micro-batch with the
process's generator seeded so at each stage's first layer: the reference
here, which the engine meets without tp too (checked below, one process).
With tp, a dropout on an activation replicated over tp (after the embedding,
after a row-wise layer) draws that mask on every tp rank, and one on an
activation split over tp (an MLP's hidden features between its column- and
row-wise layers, a Llama's attention probabilities with the heads split)
draws the whole tensor's mask and keeps its part: the plain model's too.
"""

from typing import Any, Dict

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from conftest import max_diff
from torch import nn
from tp_dropout_jobs import BALANCE, BASES, CHUNKS, LR, MODELS, STEPS, batches, dropout_job, mlp, reference
from tp_jobs import SEED

import pipeddp
from pipeddp.runtime.draws import split_draws


def check(got: Dict[str, Any], want: Dict[str, Any], what: Any) -> None:
    for step in range(STEPS):
        assert abs(got["loss"][step] - want["loss"][step]) < 1e-10, (what, step)
        keys = sorted(got["grads"][step])
        assert max_diff([got["grads"][step][k] for k in keys], [want["grads"][step][k] for k in keys]) < 1e-10, (
            what, step)
    keys = sorted(got["after"])
    assert max_diff([got["after"][k] for k in keys], [want["after"][k] for k in keys]) < 1e-10, what


def test_the_reference_is_what_the_engine_draws_without_tp(monkeypatch):
    """The plain model seeded per stage and micro-batch is what a pipeline of two stages trains as (one process)."""
    from pipeddp.runtime import step as step_module

    want = reference("mlp")
    seeds = iter(BASES)
    monkeypatch.setattr(step_module, "draw_base_seed", lambda: next(seeds))
    model = mlp()
    pipeddp.materialize(model, seed=SEED)
    got: Dict[str, Any] = {"loss": [], "grads": []}
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=CHUNKS, balance=BALANCE["mlp"]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        for x, y in batches("mlp"):
            opt.zero_grad()
            got["loss"].append(pipe.train_step(x, y, MODELS["mlp"][2]).item())
            got["grads"].append({k: p.grad.clone() for k, p in pipe.named_parameters()})
            opt.step()
        got["after"] = {k: p.detach().clone() for k, p in pipe.named_parameters()}
    check(got, want, "pipeline")


@pytest.mark.timeout(150)
def test_pp2_tp2_dropout_on_replicated_and_split_activations_equals_the_plain_model_with_and_without_recompute():
    results = pipeddp.spawn(dropout_job, 4, timeout=120)
    by_place = {res["place"]: res for res in results}
    for kind in MODELS:
        want = reference(kind)
        quiet = reference(kind, p=0.0)  # the masks matter: without them every gradient is another
        assert max_diff(list(want["grads"][0].values()), [quiet["grads"][0][k] for k in want["grads"][0]]) > 1e-3
        for checkpoint in ("never", "always"):
            for res in results:
                got = res[(kind, checkpoint)]
                assert got["sharded"], (kind, res["place"])  # the plan split something in every stage
                check(got, want, (kind, checkpoint, res["place"]))
            for pp in (0, 1):  # what the plan leaves whole is the same on both tp ranks, bit for bit
                a, b = (by_place[(0, pp, t)][(kind, checkpoint)]["replicated"] for t in (0, 1))
                assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a), (kind, pp)
    for res in results:  # tp ranks seeded apart would draw different masks on what they share: refused, on every rank
        assert "Seed every rank alike" in res.get("seeded apart", ""), res["place"]


class SplitDrop(nn.Module):
    """Dropout on part 1 of 2 of a tensor split on its last dimension, as between a column- and a row-wise layer
    under tp (the span the plan's hooks mark, marked here by hand); ``plain``: the plain model's, the whole
    tensor's mask and that part of it; ``own``: the layer checkpoints itself (torch.utils.checkpoint)."""

    def __init__(self, plain: bool, own: bool) -> None:
        super().__init__()
        self.fc, self.plain, self.own = nn.Linear(8, 8), plain, own

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if self.plain:
            return F.dropout(h.repeat(1, 2), 0.5, training=self.training)[:, 8:]
        split_draws(2, 1)
        out = F.dropout(h, 0.5, training=self.training)
        split_draws(None)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.drop, x, use_reentrant=False) if self.own else self.drop(x)


def split_grads(plain: bool, own: bool = True, policy: str = "never") -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), SplitDrop(plain, own), nn.Linear(8, 8)).double()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 8, generator=g, dtype=torch.float64))
            for _ in BASES]
    out = []
    if plain:  # one device, micro-batch by micro-batch, from the seeds the engine gives them
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for base, (x, y) in zip(BASES, data):
            opt.zero_grad()
            for i, (xi, yi) in enumerate(zip(x.chunk(CHUNKS), y.chunk(CHUNKS))):
                torch.manual_seed(base + i)
                (F.mse_loss(model(xi), yi) / CHUNKS).backward()
            out.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        return out
    with pipeddp.Pipeline(model, ["cpu"], chunks=CHUNKS, checkpoint=policy) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        for x, y in data:
            opt.zero_grad()
            pipe.train_step(x, y, F.mse_loss)
            out.append([p.grad.clone() for p in pipe.parameters()])
            opt.step()
    return out


@pytest.mark.parametrize("policy", ["never", "always"])
def test_a_split_draw_in_a_layer_that_checkpoints_itself_replays_the_whole_tensors_part(monkeypatch, policy):
    """A stage whose layer checkpoints itself keeps the process's generator; its split draws still take the whole
    tensor's part, in every forward and in torch.utils.checkpoint's replay (before: the replay drew the part
    alone, 0.09 off)."""
    from pipeddp.runtime import step as step_module

    want = split_grads(plain=True)
    seeds = iter(BASES)
    monkeypatch.setattr(step_module, "draw_base_seed", lambda: next(seeds))
    got = split_grads(plain=False, policy=policy)
    assert max(max_diff(a, b) for a, b in zip(got, want)) < 1e-12
    assert max(max_diff(a, b) for a, b in zip(split_grads(plain=True, own=False), want)) == 0.0
