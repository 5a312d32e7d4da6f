"""flatten_sequential in train mode: layer drop refused by name, and the flat model checked against the model in
training too.

BART, M2M100 (NLLB's model) and Wav2Vec2 skip whole blocks at random in training (``layerdrop``; on by default in
M2M100's and Wav2Vec2's configs). A flattened model cannot do that as the model's loop does, so flattening refuses
it, naming each setting; with the settings at 0 as the message says, the flat model equals the original
transformers model in train mode, dropout (and Wav2Vec2's SpecAugment masks, drawn with NumPy) included, from the
same seeds: outputs and gradients.
"""

from __future__ import annotations

import random
import re

import numpy
import pytest
import torch
from torch import nn

from pipeddp.tools.models import flatten_sequential

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'pipeddp[test]')")

VOCAB = 40


def bart(**drop):
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                        dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, pad_token_id=0, bos_token_id=0,
                        eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=None, **drop)
    return BartForConditionalGeneration(config).double()


def m2m100(**drop):
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    torch.manual_seed(0)
    config = M2M100Config(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                          decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                          max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=1,
                          decoder_start_token_id=0, **drop)  # dropout 0.1, attention dropout 0.1 by default
    return M2M100ForConditionalGeneration(config).double()


def wav2vec2(**drop):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(0)
    config = Wav2Vec2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 8),
                            num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, mask_time_length=3,
                            **drop)  # dropouts 0.1, SpecAugment's mask_time_prob 0.05 by default
    return Wav2Vec2ForCTC(config).double()


def sample(kind):
    g = torch.Generator().manual_seed(1)
    if kind == "wav2vec2":
        return torch.randn(4, 400, generator=g, dtype=torch.float64)
    return {"input_ids": torch.randint(1, VOCAB, (4, 6), generator=g),
            "decoder_input_ids": torch.randint(2, VOCAB, (4, 5), generator=g)}


# the model, its layer drop on (the default where it has one), and the settings the refusal must name
CASES = {
    "bart": (bart, dict(encoder_layerdrop=0.5, decoder_layerdrop=0.25),
             ["config.encoder_layerdrop=0.5", "config.decoder_layerdrop=0.25", "model.model.encoder.layerdrop=0.5",
              "model.model.decoder.layerdrop=0.25"]),
    "m2m100": (m2m100, {}, ["config.encoder_layerdrop=0.05", "config.decoder_layerdrop=0.05",
                            "model.model.encoder.layerdrop=0.05", "model.model.decoder.layerdrop=0.05"]),
    "wav2vec2": (wav2vec2, {}, ["config.layerdrop=0.1"]),
}


def seeded(seed):
    torch.manual_seed(seed)
    numpy.random.seed(seed)
    random.seed(seed)


def train_run(model, x):
    """Outputs and every parameter's gradient of one train-mode forward and backward."""
    for p in model.parameters():
        p.grad = None
    if isinstance(model, nn.Sequential):
        out = model(x)
    else:
        out = (model(**x, use_cache=False) if isinstance(x, dict) else model(x)).logits
    out.square().sum().backward()
    return out.detach(), {id(p): p.grad.clone() for p in model.parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", sorted(CASES))
def test_layer_drop_is_refused_by_name_and_off_the_flat_model_trains_as_the_original(kind):
    make, drop, named = CASES[kind]
    model = make(**drop)
    x = sample(kind)
    with pytest.raises(ValueError, match="drops whole layers at random in training") as refused:
        flatten_sequential(model, x)
    message = str(refused.value)
    for setting in named:
        assert setting in message, (setting, message)
    # the message's own fix, carried out as written: "set on this model: model.config.x = 0; model.model.y = 0"
    fixes = re.search(r"set on this model: (.*?)\. \(", message).group(1)
    exec(fixes, {"model": model})
    flat = flatten_sequential(model, x)
    if kind == "wav2vec2":  # the head's dropout (identity in eval mode) runs between the last block and lm_head
        assert list(flat._modules)[-2:] == ["dropout", "lm_head"]
    model.train()
    assert flat.training and all(m.training for m in flat.modules())
    for seed in (0, 1):
        seeded(seed)
        want, want_grads = train_run(model, x)
        seeded(seed)
        got, got_grads = train_run(flat, x)
        seeded(seed + 100)  # the dropout masks differ from one seed to another: the comparison is not vacuous
        other, _ = train_run(model, x)
        assert (other - want).abs().max().item() > 1e-3
        assert (got - want).abs().max().item() < 1e-12, (kind, seed)
        assert set(got_grads) == set(want_grads)
        assert max((got_grads[k] - want_grads[k]).abs().max().item() for k in want_grads) < 1e-12, (kind, seed)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(h))


class Skipping(nn.Module):
    """Skips blocks at random in training under a name of its own (no ``layerdrop`` to refuse it by)."""

    def __init__(self, skip: float) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 2)
        self.skip = skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(0) == 0:  # torch.fx cannot read this: the block-stack family opens the model
            raise ValueError("an empty batch")
        h = self.embed(x)
        for block in self.blocks:
            if self.training and torch.rand([]) < self.skip:
                continue
            h = block(h)
        return self.head(h)


def test_a_model_that_computes_otherwise_in_training_is_refused_and_flattening_changes_nothing():
    x = torch.randn(6, 4, dtype=torch.float64)
    for skip in (0.5, 0.0):
        torch.manual_seed(0)
        model = Skipping(skip).double()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        rng = torch.random.get_rng_state()
        if skip:  # the eval-mode check alone passes this model
            with pytest.raises(ValueError, match=r"does not compute the model's output on the sample in train mode "
                                                 r".*returned without calling blocks\.0.*self\.training"):
                flatten_sequential(model, x)
        else:
            flat = flatten_sequential(model, x)
            assert list(flat._modules) == ["embed", "blocks_0", "blocks_1", "blocks_2", "head"]
        assert model.training
        assert torch.equal(torch.random.get_rng_state(), rng)  # the generators and buffers are as they were
        for k, v in model.state_dict().items():
            assert torch.equal(v, state[k]), k
