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
from conftest import max_diff
from tp_dropout_jobs import BALANCE, BASES, CHUNKS, LR, MODELS, STEPS, batches, dropout_job, mlp, reference
from tp_jobs import SEED

import pipeddp


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
