"""Tensor parallelism inside each stage (``mesh`` with ``tp``, ``tp_plan=``): the engine on a (dp, pp, tp) mesh,
meta-built from a seed, equals the plain model materialized from that seed on one device: initial weights, loss,
every gradient (clipped by the whole model's norm), one optimizer step and the evaluated outputs; plans that cannot
apply are refused before anything is built."""

from typing import Any, Dict, Tuple

import pytest
import torch
from conftest import max_diff
from tp_jobs import LR, MAX_NORM, SEED, llama, lm_batches, lm_loss, mlp, mlp_batches, mse, qwen2, refusal_job, tp_job

import pipeddp
from pipeddp.tools.models import flatten_sequential


def reference(kind: str, n: int) -> Dict[str, Any]:
    """The plain model materialized from SEED on one device, one step on the whole batch: what every layout equals."""
    if kind.startswith("mlp"):
        model, (x, y), loss_fn = mlp(), mlp_batches(n)[0], mse
        pipeddp.materialize(model, seed=SEED)
        if kind == "mlp-whole":  # built on a real device, as tp rank 0 builds it
            torch.manual_seed(0)
            model = mlp(meta=False)
    else:
        (x, y), loss_fn = lm_batches(n)[0], lm_loss
        # the original's names and init
        model = flatten_sequential(qwen2() if kind.startswith("qwen2") else llama(), x[:1])
        pipeddp.materialize(model, seed=SEED)
    start = {k: p.detach().clone() for k, p in model.named_parameters()}
    loss = loss_fn(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    with torch.no_grad():
        out = model(x)
    return {"start": start, "loss": loss.item(), "norm": norm.item(), "grads": grads,
            "after": {k: p.detach().clone() for k, p in model.named_parameters()},
            "logits": getattr(out, "logits", out)}


def check_layout(results, shape: Tuple[int, int, int], kinds) -> None:
    local = 4
    for kind in kinds:
        want = reference(kind, local * shape[0])
        held = set()
        for res in results:
            got = res[kind]
            assert got["sharded"], (kind, res["rank"])  # the plan sharded something in every stage
            assert abs(got["loss"] - want["loss"]) < 1e-10 and abs(got["norm"] - want["norm"]) < 1e-10
            assert want["norm"] > MAX_NORM  # the clipping scaled every gradient
            for part in ("start", "grads", "after"):
                keys = sorted(got[part])
                assert max_diff([got[part][k] for k in keys], [want[part][k] for k in keys]) < 1e-10, (kind, part)
            held |= set(got["start"])
            if kind.endswith(("-full", "-optimizer")):  # FSDP2 split each tp shard again over dp: 2-D DTensors
                assert got["local_numel"] < sum(t.numel() for t in got["start"].values()) / 2.5, (kind, res["rank"])
                assert "('dp', 'tp')" in got["meshes"], (kind, got["meshes"])
            if got["logits"] is not None:
                r = res["place"][0]
                assert max_diff([got["logits"]], [want["logits"][r * local:(r + 1) * local]]) < 1e-10
        assert held == set(want["start"])  # the stages together hold every parameter


@pytest.mark.timeout(240)
def test_pp2_tp2_meta_built_mlp_and_llama_with_the_models_own_plan_equal_the_plain_model_and_so_does_a_built_one():
    results = pipeddp.spawn(tp_job, 4, args=((1, 2, 2), ["mlp", "llama", "mlp-whole"]), timeout=200)
    check_layout(results, (1, 2, 2), ["mlp", "llama", "mlp-whole"])
    by_place = {res["place"]: res for res in results}
    # tp shards: each tp rank of a stage holds fewer elements than the stage, the sharded ones halved
    for kind in ("mlp", "llama"):
        for pp in (0, 1):
            stage = sum(t.numel() for t in by_place[(0, pp, 0)][kind]["start"].values())
            assert by_place[(0, pp, 0)][kind]["local_numel"] < stage
    assert "lm_head.weight" in by_place[(0, 1, 0)]["llama"]["sharded"]  # the head sharded on the vocabulary


@pytest.mark.timeout(300)
def test_dp2_pp2_tp2_replicas_average_their_shards_gradients_with_virtual_stages_recompute_qwen2_and_fsdp2(tmp_path):
    """Then, in the same processes, FSDP2 over dp of the tp stages (``shard=``, as torch composes them): an MLP with
    every layer its own FSDP group ("full") and Qwen2 under "optimizer", each equal to the plain model. The MLP's
    step saved as one file and as a sharded checkpoint holds the plain model's weights and momenta after that step,
    and an engine of other weights loads either back."""
    kinds = ["mlp-v2", "qwen2", "mlp-full", "qwen2-optimizer"]
    results = pipeddp.spawn(tp_job, 8, args=((2, 2, 2), kinds, str(tmp_path)), timeout=250)
    check_layout(results, (2, 2, 2), kinds)
    want = reference("mlp-full", 8)
    keys = sorted(want["after"])
    ck = torch.load(tmp_path / "mlp-full" / "one.pt", weights_only=True)
    assert sorted(ck["model"]) == keys
    assert max_diff([ck["model"][k] for k in keys], [want["after"][k] for k in keys]) < 1e-10
    momentum = {k: v["momentum_buffer"] for k, v in ck["optimizer"]["state"].items()}
    assert max_diff([momentum[k] for k in keys], [want["grads"][k] for k in keys]) < 1e-10  # the first step's
    for res in results:
        for name, (weights, momenta) in res["mlp-full"]["loaded"].items():
            held = sorted(weights)
            assert held and max_diff([weights[k] for k in held], [want["after"][k] for k in held]) < 1e-10, name
            assert max_diff([momenta[k] for k in held], [want["grads"][k] for k in held]) < 1e-10, name


REFUSALS = [
    ("no tp dimension", {"mesh": "2d"}),
    ("replica mode", {"mode": "replica"}),
    ("unmatched", {"tp_plan": {"block*.fc3": "colwise"}}),
    ("not a linear", {"tp_plan": {"block0.norm": "colwise"}}),
    ("indivisible", {"tp_plan": {"embed": "rowwise"}}),
    ("unknown style", {"tp_plan": {"head": "diagonal"}}),
    ("llama heads", {"tp_plan": "auto"}),
    ("llama tied", {"tp_plan": {"lm_head": "colwise_gather_output"}}),  # the head split, its tied embedding whole
]


@pytest.mark.timeout(120)
def test_plans_that_cannot_apply_are_refused_before_anything_is_built():
    told = pipeddp.spawn(refusal_job, 2, args=(REFUSALS,), timeout=100)
    assert told[0] == told[1]  # every rank alike
    told = told[0]
    assert "tp_plan needs a mesh with a 'tp' dimension" in told["no tp dimension"]
    assert "use mode='stage'" in told["replica mode"]
    assert "'block*.fc3' matches no module" in told["unmatched"]
    assert "block0.norm (LayerNorm) the colwise style" in told["not a linear"]
    assert "in_features=5 is not divisible by 2" in told["indivisible"]
    assert "a style is one of" in told["unknown style"]
    assert "config.num_attention_heads=3 is not divisible by 2" in told["llama heads"]
    assert "not alike at every place" in told["llama tied"] and "lm_head.weight" in told["llama tied"]
