"""Model families whose blocks take more than the first block is given, opened by ``flatten_sequential``'s one
mechanism (record what each block receives, carry it between blocks), against the original models in float64:
per-layer masks (Gemma2: alternate layers take a sliding-window and a full causal mask)."""

from __future__ import annotations

import pytest
import torch

import pipeddp
from pipeddp.tools.models import flatten_sequential

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'pipeddp[test]')")

from hf_jobs import MODELS, batch, fresh, logits, loss_fn  # noqa: E402

CHUNKS = 3


def over_micro_batches(model, x, y, chunks=CHUNKS):
    """The original model's gradients over the pipeline's micro-batches (equal rows, each loss weighted n_i/N)."""
    n = y.shape[0]
    size = n // chunks
    for i in range(chunks):
        part = slice(i * size, (i + 1) * size)
        xi = {k: v[part] for k, v in x.items()}
        (loss_fn(logits(model, xi), y[part]) * (size / n)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("padded", [False, True])
def test_per_layer_masks_gemma2_equals_the_original(padded):
    reference = MODELS["gemma2"]()
    assert set(reference.config.layer_types) == {"sliding_attention", "full_attention"}
    sample, _ = batch("gemma2", 4, 0, padded)
    x, y = batch("gemma2", 6, 1, padded)
    want = logits(reference, x)
    loss = loss_fn(want, y)
    loss.backward()
    whole = {name: p.grad.clone() for name, p in reference.named_parameters()}
    reference.zero_grad()
    micro = over_micro_batches(reference, x, y)
    for stages, balance in ((2, [3, 7]), (4, [2, 2, 2, 4])):
        model = MODELS["gemma2"]()
        flat = flatten_sequential(model, sample)
        assert [n for n, _ in flat.named_children()] == ["embed"] + [f"model_layers_{i}" for i in range(4)] + \
            ["model_norm", "lm_head", "div", "tanh", "mul"]  # the logits' soft cap after the head
        with pipeddp.Pipeline(flat, ["cpu"] * stages, chunks=CHUNKS, balance=balance) as pipe:
            assert abs(pipe.train_step(x, y, loss_fn).item() - loss.item()) < 1e-12
            assert (pipe(x) - want).abs().max().item() < 1e-12
            grads = dict(model.named_parameters())
            for name in whole:
                got = grads[name].grad
                # Gemma2's RMSNorm computes in float32 inside: exact against the same micro-batches, and within
                # float32's rounding of the whole batch's sums
                assert (got - micro[name]).abs().max().item() < 1e-12, (stages, name)
                assert (got - whole[name]).abs().max().item() < 1e-7, (stages, name)
            other = fresh("gemma2")
            other.load_state_dict(pipe.state_dict(), strict=True)
            for key, value in model.state_dict().items():
                assert torch.equal(other.state_dict()[key], value), key
            pipe.load_state_dict(fresh("gemma2").state_dict(), strict=True)
            torch.testing.assert_close(pipe(x), logits(fresh("gemma2"), x), rtol=0, atol=1e-12)
