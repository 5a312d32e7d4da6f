"""Hugging Face transformers and timm models, flattened by flatten_sequential, against the original models.

float64, tiny configs, random weights, nothing downloaded: outputs and the gradient of every parameter at 2 and
4 stages, the names (strict loads both ways), training with HybridParallel in both modes, and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeddp
from pipeddp.tools.models import flatten_sequential

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'pipeddp[test]')")
pytest.importorskip("timm", reason="timm is not installed (pip install 'pipeddp[test]')")

from hf_jobs import MODELS, batch, fresh, hybrid_job, logits, loss_fn, reference_training  # noqa: E402

CASES = [("gpt2", True), ("llama", False), ("llama", True), ("vit", False)]
LAYERS = {"gpt2": ["embed", "transformer_h_0", "transformer_h_1", "transformer_ln_f", "lm_head"],
          "llama": ["embed", "model_layers_0", "model_layers_1", "model_norm", "lm_head"],
          "vit": ["embed", "blocks_0", "blocks_1", "blocks_2", "norm", "getitem", "fc_norm", "head_drop", "head"]}
BALANCE = {2: {"gpt2": [2, 3], "llama": [2, 3], "vit": [3, 6]},
           4: {"gpt2": [1, 1, 1, 2], "llama": [1, 1, 1, 2], "vit": [2, 2, 2, 3]}}


@pytest.mark.parametrize("kind,padded", CASES)
def test_outputs_gradients_and_names_equal_the_original(kind, padded):
    reference = MODELS[kind]()
    sample, _ = batch(kind, 4, 0, padded)
    x, y = batch(kind, 6, 1, padded)
    want = logits(reference, x)
    loss = loss_fn(want, y)
    loss.backward()
    for stages in (2, 4):
        model = MODELS[kind]()  # a pipeline keeps its own copy of a weight tied across stages: one model each
        flat = flatten_sequential(model, sample)
        assert [n for n, _ in flat.named_children()] == LAYERS[kind]
        with pipeddp.Pipeline(flat, ["cpu"] * stages, chunks=3, balance=BALANCE[stages][kind]) as pipe:
            got = pipe.train_step(x, y, loss_fn)
            assert abs(got.item() - loss.item()) < 1e-12
            out = pipe(x)
            assert (out - want).abs().max().item() < 1e-12, stages
            grads = dict(model.named_parameters())
            for name, p in reference.named_parameters():
                assert grads[name].grad is not None, (stages, name)
                diff = (grads[name].grad - p.grad).abs().max().item()
                assert diff < 1e-12, (stages, name, diff)
            state = pipe.state_dict()
            other = fresh(kind)
            other.load_state_dict(state, strict=True)  # the original class takes the pipeline's weights
            for key, value in reference.state_dict().items():
                assert torch.equal(other.state_dict()[key], value), key
            pipe.load_state_dict(fresh(kind).state_dict(), strict=True)  # and the original's load into it
            torch.testing.assert_close(pipe(x), logits(fresh(kind), x), rtol=0, atol=1e-12)
            pipe.load_state_dict(reference.state_dict(), strict=True)


def test_a_tied_embedding_and_head_stay_one_weight_across_stages():
    model = MODELS["gpt2"]()
    assert model.lm_head.weight is model.transformer.wte.weight
    sample, _ = batch("gpt2", 4, 0, True)
    flat = flatten_sequential(model, sample)
    with pipeddp.Pipeline(flat, ["cpu"] * 2, chunks=2, balance=[2, 3]) as pipe:
        x, y = batch("gpt2", 4, 2, True)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        for _ in range(2):
            opt.zero_grad()
            pipe.train_step(x, y, loss_fn)
            opt.step()
        tied = [p for p in pipe.parameters() if p.shape == model.lm_head.weight.shape]
        assert len(tied) == 2 and torch.equal(tied[0], tied[1])
        state = pipe.state_dict()
        assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])


def test_a_batch_without_padding_after_a_padded_sample():
    """transformers builds no mask for a batch without padding: the mask's place travels empty."""
    reference = MODELS["llama"]()
    sample, _ = batch("llama", 4, 0, True)
    flat = flatten_sequential(MODELS["llama"](), sample)
    x, _ = batch("llama", 4, 3, False)
    x["attention_mask"] = torch.ones_like(x["input_ids"])
    with pipeddp.Pipeline(flat, ["cpu"] * 2, chunks=2, balance=[2, 3]) as pipe:
        torch.testing.assert_close(pipe(x), logits(reference, x), rtol=0, atol=1e-12)
    unpadded = flatten_sequential(MODELS["llama"](), batch("llama", 4, 0, False)[0])
    with pytest.raises(ValueError, match=r"a tensor at kwargs\['attention_mask'\].*flatten with a sample like this"):
        unpadded(batch("llama", 4, 3, True)[0])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode,nprocs", [("replica", 2), ("stage", 4)])
def test_hybrid_training_equals_the_original_model(mode, nprocs):
    # stage mode: GPT-2's tie spans processes, the classifier's input_ids travel to its head on another process, and
    # T5's batch through its encoder's blocks to the decoder's first layer
    runs = [("llama", True)] if mode == "replica" else [("gpt2", True), ("gpt2-cls", True), ("t5", True)]
    results = pipeddp.spawn(hybrid_job, nprocs, args=(mode, runs, 3, 3), timeout=350)
    for i, (kind, padded) in enumerate(runs):
        losses, state = reference_training(kind, padded, 3, 6)
        for res in results:
            got = res[i]
            assert got["kind"] == kind
            assert max(abs(a - b) for a, b in zip(got["losses"], losses)) < 1e-10, (kind, got["losses"], losses)
            other = fresh(kind)
            other.load_state_dict(got["state"], strict=True)
            for key, value in state.items():
                torch.testing.assert_close(other.state_dict()[key], value, rtol=0, atol=1e-10, msg=key)


def test_a_model_that_cannot_be_taken_names_the_construct_and_the_way_out():
    class Between(nn.Module):
        """A stack whose forward does more between its blocks than pass the hidden state on."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 2)

        def forward(self, ids, scale=None):
            h = self.embed(ids)
            for block in self.blocks:
                h = block(h) * 2 + h
            return self.head(h)

    with pytest.raises(ValueError, match=r"blocks\.1 is not called on the output of blocks\.0 .*test_hf\.py:\d+ in "
                                         r"forward.*one per block of model\.blocks taking and passing on") as info:
        flatten_sequential(Between(), torch.randint(0, 10, (2, 4)))
    assert str(info.value).startswith("cannot flatten Between: its blocks ")  # the real reason first, torch.fx's last
    assert str(info.value).index("torch.fx") > str(info.value).index("is not called on the output")


def test_the_way_out_is_written_with_the_model_s_own_parts():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.body = nn.Linear(8, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, ids):
            h = self.embed(ids)
            return self.head(self.body(h) + h)

    with pytest.raises(ValueError, match=r"embed output is used twice.*by hand, e\.g\. "
                                         r"nn\.Sequential\(model\.embed, model\.body, model\.head\)") as info:
        flatten_sequential(Twice(), torch.randint(0, 10, (2, 4)))
    assert "features" not in str(info.value)
