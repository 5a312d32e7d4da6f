"""flatten_sequential opens what users write: nn.TransformerEncoder (masks kept exact), nn.ModuleList loops,
nested nn.Sequentials; a transformer LM so opened pipelines on 2 and 4 stages as the original model."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import pipeddp
from pipeddp.tools.models import flatten_sequential
from pipeddp.tools.transformer import EncoderLayerCall

V, D, HEADS, N_LAYERS, T = 24, 16, 2, 4, 6


def _encoder(norm: bool = True, batch_first: bool = True, layers: int = N_LAYERS) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(D, HEADS, 32, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(D) if norm else None, enable_nested_tensor=False)


class CausalLM(nn.Module):
    """The way a user writes it: embedding -> encoder with the causal mask of the input's length -> head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(V, D)
        self.encoder = _encoder()
        self.head = nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        return self.head(self.encoder(h, mask=mask, is_causal=True))


class BufferMaskLM(CausalLM):
    """A constant bool mask kept in a buffer (True = masked out), the causal hint left to detection."""

    def __init__(self) -> None:
        super().__init__(1)
        band = torch.ones(T, T, dtype=torch.bool).triu(1) | torch.ones(T, T, dtype=torch.bool).tril(-3)
        self.register_buffer("band", band)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(x), self.band))


class PlainLM(CausalLM):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.emb(x)))


def _tokens(n: int = 4, t: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (n, t), generator=torch.Generator().manual_seed(seed))


def _layer_names(flat: nn.Sequential):
    return list(flat._modules)


def test_a_causal_lm_flattens_to_one_entry_per_encoder_layer():
    model = CausalLM()
    flat = flatten_sequential(model, _tokens())
    assert _layer_names(flat) == ["emb"] + [f"encoder_layers_{i}" for i in range(N_LAYERS)] + ["encoder_norm", "head"]
    for i in range(N_LAYERS):
        call = flat[1 + i]
        assert isinstance(call, EncoderLayerCall) and call.layer is model.encoder.layers[i]  # shared, not copied
        assert call.kind == "causal" and call.is_causal
        assert "mask" not in call.state_dict()  # nothing new in the state dict
    assert flat.encoder_norm is model.encoder.norm
    model.eval()
    flat.eval()
    with torch.no_grad():  # another length than the sample's: each layer makes the causal mask of its input
        x = _tokens(3, 9, seed=5)
        torch.testing.assert_close(flat(x), model(x), rtol=1e-5, atol=1e-6)


def test_an_encoder_without_a_mask_gives_its_own_layers():
    model = PlainLM()
    flat = flatten_sequential(model, _tokens())
    assert [flat[1 + i] for i in range(N_LAYERS)] == list(model.encoder.layers)


def test_a_constant_mask_reaches_every_layer_and_follows_the_dtype():
    model = BufferMaskLM()
    flat = flatten_sequential(model, _tokens())
    calls = [m for m in flat if isinstance(m, EncoderLayerCall)]
    assert len(calls) == N_LAYERS and all(c.kind == "constant" and not c.is_causal for c in calls)
    model64, flat64 = model.double().train(), flat.double().train()
    x = _tokens(5, seed=2)
    torch.testing.assert_close(flat64(x), model64(x), rtol=1e-12, atol=1e-12)


def test_an_unbatched_sequence_first_encoder_opens_too():
    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(3, D)
            self.encoder = _encoder(norm=False, batch_first=False, layers=2)

        def forward(self, x):
            n = x.size(0)
            return self.encoder(self.proj(x), mask=nn.Transformer.generate_square_subsequent_mask(n))

    model = SeqFirst()
    flat = flatten_sequential(model, torch.randn(T, 2, 3))
    assert _layer_names(flat) == ["proj", "encoder_layers_0", "encoder_layers_1"]
    assert flat[1].is_causal  # detected from the mask, as the encoder does
    x = torch.randn(8, 3, 3)
    torch.testing.assert_close(flat(x), model(x), rtol=1e-5, atol=1e-6)


def test_a_size_mask_that_is_not_causal_is_refused():
    class Window(CausalLM):
        def forward(self, x):
            n = x.size(1)
            mask = torch.full((n, n), float("-inf")).triu(2)  # one token ahead visible: not causal
            return self.head(self.encoder(self.emb(x), mask=mask))

    with pytest.raises(ValueError, match=r"self\.encoder passes a mask computed from the input's size that is not "
                                         r"the causal mask"):
        flatten_sequential(Window(), _tokens())


def test_a_padding_mask_travels_with_the_hidden_state():
    """A src_key_padding_mask is a per-batch second input: the encoder's layers, a stack of identical blocks,
    take it along with the hidden state (training mode, gradients included)."""
    class Padded(CausalLM):
        def forward(self, x):
            return self.head(self.encoder(self.emb(x), src_key_padding_mask=x == 0))

    model = Padded()
    reference = copy.deepcopy(model)
    flat = flatten_sequential(model, _tokens())
    assert _layer_names(flat) == ["embed"] + [f"encoder_layers_{i}" for i in range(N_LAYERS)] + \
        ["encoder_norm", "head"]
    x = _tokens(5, seed=3)
    x[1, 2] = 0
    out, want = flat(x), reference(x)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12) if out.dtype == torch.float64 else \
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    want.square().sum().backward()
    got = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_module_list_loops_and_nested_sequentials_open():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 8)))

        def forward(self, x):
            return self.inner(x)

    class Looped(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.out = nn.Sequential(nn.Sequential(nn.ReLU()), nn.Linear(8, 2))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    model = Looped()
    flat = flatten_sequential(model, torch.randn(2, 8))
    assert _layer_names(flat) == [f"blocks_{i}_inner_{j}" for i in range(3) for j in ("0", "1_0", "1_1")] + \
        ["out_0_0", "out_1"]
    x = torch.randn(5, 8)
    torch.testing.assert_close(flat(x), model(x))


def _grads(module: nn.Module):
    return {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stages", [2, 4])
def test_a_flattened_transformer_lm_pipelines_as_the_original_model(stages):
    torch.set_num_threads(1)
    model = CausalLM().double()
    reference = copy.deepcopy(model)
    flat = flatten_sequential(model, _tokens())
    x, y = _tokens(8, seed=3), _tokens(8, seed=4)

    def loss_fn(out, target):
        return nn.functional.cross_entropy(out.reshape(-1, V), target.reshape(-1))

    with pipeddp.Pipeline(flat, ["cpu"] * stages, chunks=4, balance="uniform" if stages == 4 else None) as pipe:
        assert len(flat) == N_LAYERS + 3
        torch.testing.assert_close(pipe(x), reference(x), rtol=1e-10, atol=1e-10)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            loss = pipe.train_step(x, y, loss_fn)
            ref_loss = loss_fn(reference(x), y)
            ref_loss.backward()
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-10, atol=1e-10)
            got = {n: p.grad for n, p in model.named_parameters()}  # the model's own modules, now pipelined
            for name, grad in _grads(reference).items():
                torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-10, msg=name)
            opt.step()
            ref_opt.step()
        torch.testing.assert_close(pipe(x), reference(x), rtol=1e-10, atol=1e-10)


def test_an_encoder_left_whole_warns_naming_it():
    # by memory (bytes), not time: a layer's share of this tiny model's time moves with the host's load
    model = PlainLM()
    coarse = nn.Sequential(model.emb, model.encoder, model.head)
    with pytest.warns(pipeddp.HeavyLayerWarning, match=r"layer 1 \('1', TransformerEncoder: \d+\.\d%\) holds more "
                                                        r"than a stage's share \(50\.0% for 2 stages\).*"
                                                        r"flatten_sequential"):
        pipeddp.partition(coarse, 2, method="memory", sample=_tokens())
    flat = flatten_sequential(model, _tokens())
    with warnings.catch_warnings():
        warnings.simplefilter("error", pipeddp.HeavyLayerWarning)
        pipeddp.partition(flat, 2, method="memory", sample=_tokens())
