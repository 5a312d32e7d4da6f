"""Tensor parallelism (pp2 x tp2, a meta-built Llama under ``tp_plan="auto"``) through what the other tp tests do
not run, each against the plain model materialized from the same seed on one device: a loss over tokens returned
as ``(total, count)``, a step skipped for an inf in one tp rank's gradient shard and the exact step after it,
``evaluate``, a step under CPU autocast to bfloat16, and an embedding tied to its head across the stages, both split
by rows of the vocabulary (saved whole, read back by transformers); a head whose logits would stay split is
refused, and a tie split differently at its two places. At dp2 x pp2 x tp2: that tie over two replicas under "zb" and
under shard="optimizer", and a step skipped for an inf in one rank's shard under shard="full"."""

from typing import Any, Dict, List

import pytest
import torch
from conftest import max_diff
from tp_jobs import LR, SEED, lm_loss, mlp, mlp_batches, mse
from tp_more_jobs import N, batches, counted, metrics, model, tp_more_job, tp_replicas_job

import pipeddp
from pipeddp.runtime.names import Names


def plain(dtype: torch.dtype) -> torch.nn.Module:
    m = model(dtype)
    pipeddp.materialize(m, seed=SEED)
    return m


def snapshot(m: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in m.named_parameters()}


def reference_steps() -> Dict[str, Any]:
    """The float64 sequence of ``float64_steps`` on one device: the skipped step changes nothing."""
    (xa, ya), (xb, yb) = batches()
    m = plain(torch.float64)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    out: Dict[str, Any] = {}

    def step(x, y):  # backward from the sum, then divided by the count: Llama's RMSNorm computes in float32 even in
        total, count = counted(m(x), y)  # a float64 model, so a loss scaled otherwise rounds otherwise (~1e-7)
        total.backward()
        for p in m.parameters():
            p.grad /= count
        return (total / count).item()

    out["loss1"] = step(xa, ya)
    out["grads1"] = {k: p.grad.clone() for k, p in m.named_parameters()}
    opt.step()
    opt.zero_grad()
    out["after1"] = snapshot(m)
    out["loss3"] = step(xb, yb)
    opt.step()
    out["after3"] = snapshot(m)
    with torch.no_grad():
        parts = [metrics(m(x), y) for x, y in ((xa, ya), (xb, yb))]
    out["evaluated"] = {"loss": sum(p["loss"][0] for p in parts).item() / sum(p["loss"][1] for p in parts).item(),
                        "top1": sum(p["top1"].item() * N for p in parts) / (2 * N), "samples": 2.0 * N}
    return out


def autocast_reference(cast: bool) -> Dict[str, Any]:
    """One float32 step of the plain model over the engine's two micro-batches (accumulated, each mean weighted by
    its half of the batch: bfloat16 rounds each micro-batch's weight gradient), under CPU autocast to bfloat16
    (``cast``) or not; backward outside autocast, as the engine runs it."""
    (x, y), _ = batches()
    m = plain(torch.float32)
    loss = 0.0
    for part in (slice(0, N // 2), slice(N // 2, N)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
            half = lm_loss(m(x[part]), y[part].clamp(min=0)) / 2
        half.backward()
        loss += half.item()
    grads = {k: p.grad.clone() for k, p in m.named_parameters()}
    torch.optim.SGD(m.parameters(), lr=LR).step()
    return {"loss": loss, "grads": grads, "after": snapshot(m)}


def relative(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> float:
    """How far ``got``'s tensors are from ``want``'s, as one vector: the norm of the difference over ``want``'s."""
    keys = sorted(got)
    diff = sum(((got[k].double() - want[k].double()) ** 2).sum() for k in keys) ** 0.5
    return (diff / sum((want[k].double() ** 2).sum() for k in keys) ** 0.5).item()


def close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> float:
    keys = sorted(got)
    return max_diff([got[k] for k in keys], [want[k] for k in keys])


@pytest.mark.timeout(240)
def test_pp2_tp2_llama_loss_over_tokens_skipped_step_evaluate_autocast_and_tied_embedding_equal_the_plain_model(
        tmp_path):
    results = pipeddp.spawn(tp_more_job, 4, args=(str(tmp_path),), timeout=200)
    check(results)
    check_tied(results, tmp_path)


def tied_reference(both: bool = False) -> Dict[str, Any]:
    """The tied Llama on one device, materialized from the seed: weights, one step's loss and gradients (every
    place of the tied weight named), the weights after, and the model itself; on the first batch, or ``both``."""
    (x, y), (xb, yb) = batches()
    if both:
        x, y = torch.cat([x, xb]), torch.cat([y, yb])
    m = model(torch.float64, tied=True)
    pipeddp.materialize(m, seed=SEED)
    out: Dict[str, Any] = {"before": {k: p.detach().clone() for k, p in m.named_parameters(remove_duplicate=False)}}
    total, count = counted(m(x), y)
    total.backward()
    for p in m.parameters():
        p.grad /= count
    out["loss"] = (total / count).item()
    out["grads"] = {k: p.grad.clone() for k, p in m.named_parameters(remove_duplicate=False)}
    torch.optim.SGD(m.parameters(), lr=LR).step()
    out["after"] = {k: p.detach().clone() for k, p in m.named_parameters(remove_duplicate=False)}
    out["model"] = m
    return out


def check_tied(results: List[Dict[str, Any]], tmp_path: Any) -> None:
    """The embedding and the head split alike by rows of the vocabulary, tied across stages: equal to the plain
    tied model; a tie split differently at its places refused, naming them; saved whole: one file (the plain model's
    state_dict) and save_pretrained (transformers loads it tied, its logits the plain model's)."""
    from transformers import LlamaForCausalLM

    want = tied_reference()
    for res in results:
        assert "lm_head.weight (whole), model.embed_tokens.weight (split by rows)" in res["refused_tie"]
        got = res["tied"]
        assert abs(got["loss"] - want["loss"]) < 1e-10
        for part in ("before", "grads", "after"):
            assert got[part].keys() <= want[part].keys() and close(got[part], want[part]) < 1e-10, part
    held = [set(res["tied"]["before"]) for res in results]
    assert "embed.owned.model_embed_tokens.weight" in held[0] and "lm_head.weight" in held[-1]  # both places
    saved = torch.load(tmp_path / "tied.pt", weights_only=True)["model"]  # the transformers model's keys, whole
    names = Names.of(want["model"])
    assert saved.keys() == {names.original(k) for k in want["after"]}  # both places of the tie included
    assert close({k: saved[names.original(k)] for k in want["after"]}, want["after"]) < 1e-10
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "tied", dtype=torch.float64)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    x = batches()[0][0]
    with torch.no_grad():
        assert (loaded(x).logits - want["model"](x)).abs().max().item() < 1e-10  # the flattened model: the logits


def check(results: List[Dict[str, Any]]) -> None:
    want = reference_steps()
    for res in results:
        assert "leaves its output split" in res["refused"] and "'colwise_gather_output'" in res["refused"]
        got = res["float64"]
        # (total, count): the token mean over the whole batch, its gradients and the step
        assert abs(got["loss1"] - want["loss1"]) < 1e-10
        assert close(got["grads1"], want["grads1"]) < 1e-10 and close(got["after1"], want["after1"]) < 1e-10
        # an inf in one tp rank's shard: every rank skipped, its weights untouched; the next step exact
        assert got["skipped"] == 1 and got["grads2"] == [] and got["skipped3"] == 1
        assert abs(got["loss2"] - want["loss3"]) < 1e-10  # the skipped step's loss is still reported
        assert all(torch.equal(got["after2"][k], got["after1"][k]) for k in got["after1"])
        assert abs(got["loss3"] - want["loss3"]) < 1e-10 and close(got["after3"], want["after3"]) < 1e-10
        assert got["evaluated"].keys() == want["evaluated"].keys()
        assert all(abs(got["evaluated"][k] - v) < 1e-10 for k, v in want["evaluated"].items())
    # held together, the stages hold every parameter
    assert set().union(*(res["float64"]["after1"] for res in results)) == set(want["after1"])

    # bfloat16 autocast, against the plain model under the same autocast. tp rounds in other places than one device
    # does (a row-wise layer's two half sums each rounded to bfloat16, then added in bfloat16; the same in backward
    # for a column-wise layer's input gradient), so it may differ from the plain model by about what bfloat16 moves
    # the plain model's gradients against float32, not more than twice that; and it must be that far from the
    # float32 step (which would be ~1e-7 from the plain float32 model): autocast did apply in the stages.
    cast, full = autocast_reference(True), autocast_reference(False)
    for res in results:
        got = res["bf16"]
        for part in ("grads", "after"):
            held = {k: cast[part][k] for k in got[part]}
            bf16 = relative(held, full[part])
            assert bf16 > 1e-5, (part, bf16)  # the weights: 1e-4, the gradients: 4e-3
            assert relative(got[part], cast[part]) < 2 * bf16, (part, relative(got[part], cast[part]), bf16)
            assert relative(got[part], full[part]) > bf16 / 4, (part, relative(got[part], full[part]), bf16)
        assert abs(got["loss"] - cast["loss"]) < 1e-3  # a mean of about 3.7, where one bfloat16 rounding is 0.015


@pytest.mark.timeout(300)
def test_dp2_pp2_tp2_tied_llama_under_zb_and_fsdp2_and_a_step_skipped_under_full_shard_equal_the_plain_model():
    """dp2 x pp2 x tp2 (8 processes): the tied Llama ('auto': embedding and head split by vocabulary rows) over two
    replicas, under the zero-bubble schedule and under shard="optimizer", each equal to the plain tied model on the
    global batch; the MLP under shard="full" with an inf in one rank's gradient shard: every rank skips, the weights
    stay, and the same step again equals the plain model's."""
    results = pipeddp.spawn(tp_replicas_job, 8, timeout=250)
    want = tied_reference(both=True)
    for res in results:
        for kind in ("tied-zb", "tied-optimizer"):
            got = res[kind]
            assert abs(got["loss"] - want["loss"]) < 1e-10, kind
            for part in ("before", "grads", "after"):
                assert got[part].keys() <= want[part].keys() and close(got[part], want[part]) < 1e-10, (kind, part)
    plain = mlp()
    pipeddp.materialize(plain, seed=SEED)
    x, y = mlp_batches(2 * N)[0]
    loss = mse(plain(x), y)  # equal halves: the replicas' mean of means is the batch's mean
    loss.backward()
    torch.optim.SGD(plain.parameters(), lr=LR).step()
    after = snapshot(plain)
    for res in results:
        got = res["full-skip"]
        assert got["skipped"] == 1 and got["skipped2"] == 1
        assert all(torch.equal(got["unchanged"][k], got["before"][k]) for k in got["before"])
        assert abs(got["loss"] - loss.item()) < 1e-10 and close(got["after"], after) < 1e-10
