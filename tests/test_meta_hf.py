"""Transformers models built on the meta device: ``flatten_sequential`` opens them without giving them their memory,
and an engine materializes each stage with the model's own initialisation, seeded by the original names. The
initialisation is transformers' own (``from_config``'s, tensor by tensor: the reference for the weights), and
training equals the whole model materialized on one device (float64)."""

import pytest
import torch
from torch import nn

import pipeddp
from conftest import max_diff
from hf_jobs import MODELS, VOCAB, T, llama, logits
from hf_jobs import batch as family_batch, loss_fn as family_loss
from pipeddp.tools.models import flatten_sequential

pytest.importorskip("transformers")


def gpt2_meta() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=3, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        return GPT2LMHeadModel(config).double()  # its head is tied to the token embedding


def bert_meta() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    with torch.device("meta"):
        return BertForMaskedLM(config).double()  # position and token-type buffers computed in __init__


def llama_meta(tied: bool) -> nn.Module:
    model = llama(layers=3, meta=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


BUILDERS = {"llama": lambda: llama_meta(False), "llama-tied": lambda: llama_meta(True), "gpt2": gpt2_meta,
            "bert": bert_meta}


def loss_fn(logits, y):
    logits = getattr(logits, "logits", logits)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def data(steps=2, n=4):
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(1, VOCAB, (n, T), generator=g), torch.randint(0, VOCAB, (n, T), generator=g))
            for _ in range(steps)]


def on_meta(model: nn.Module) -> bool:
    return all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def trains_the_materialized_model(build, flat, steps, loss, tolerance=1e-10):
    """Two SGD steps of ``flat``'s engine (built from seed 5 by the recorded init) end in the state of
    ``build()`` materialized whole with that seed and trained alike."""
    reference = build()
    pipeddp.materialize(reference, seed=5, init=reference._init_weights)
    assert not any(t.is_meta for t in reference.state_dict().values())
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in steps:
        opt.zero_grad()
        loss(logits(reference, x), y).backward()
        opt.step()
    # the engine's default init is the model's own (recorded by flatten); its seeds come from the original names
    with pipeddp.Pipeline(flat, ["cpu", "cpu"], chunks=2, seed=5, balance="params") as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for x, y in steps:
            opt.zero_grad()
            pipe.train_step(x, y, loss)
            opt.step()
        got = pipe.state_dict()
    want = reference.state_dict()
    assert sorted(got) == sorted(want)
    assert max_diff([got[k] for k in want], list(want.values())) < tolerance


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_meta_built_transformers_model_flattens_without_memory_and_trains_the_materialized_model(name):
    steps = data()
    model = BUILDERS[name]()
    flat = flatten_sequential(model, steps[0][0])
    assert on_meta(model) and on_meta(flat)  # nothing lent while flattening outlives it
    trains_the_materialized_model(BUILDERS[name], flat, steps, loss_fn)


@pytest.mark.parametrize("kind", ["gpt2-cls", "llama-cls", "t5"])
def test_a_meta_built_classifier_and_encoder_decoder_train_the_materialized_model(kind):
    """A classifier whose head reads input_ids (replayed as one layer) and T5 (both stacks opened; its embedding
    held at three places, each seeded by its first name), built on meta: the engine's stages equal the whole model
    materialized with the same seed."""
    def build():
        with torch.device("meta"):
            return MODELS[kind]()

    steps = [family_batch(kind, 4, 20 + i, True) for i in range(2)]
    flat = flatten_sequential(build(), steps[0][0])
    assert on_meta(flat)
    # T5's layer norm computes its variance in float32: after a step, weights 1e-14 apart round apart there
    trains_the_materialized_model(build, flat, steps, family_loss, 1e-6 if kind == "t5" else 1e-10)


@pytest.mark.filterwarnings("ignore::pipeddp.HeavyLayerWarning")  # a tiny model's times are noise
def test_balance_time_profiles_a_meta_built_transformers_model_with_its_own_init():
    """The profile materializes one layer at a time with the recorded init (Llama's RMSNorm has no
    reset_parameters), then the engine builds from the seed: the logits are the materialized model's."""
    x, _ = data(1)[0]
    flat = flatten_sequential(llama_meta(False), x)
    reference = llama_meta(False)
    pipeddp.materialize(reference, seed=3, init=reference._init_weights)
    with pipeddp.Pipeline(flat, ["cpu", "cpu"], chunks=2, seed=3, balance="time", sample=x) as pipe:
        assert len(pipe.balance) == 2 and sum(pipe.balance) == len(flat)
        pipe.eval()
        with torch.no_grad():
            got = pipe(x)
    with torch.no_grad():
        want = reference.eval()(x).logits
    assert (got - want).abs().max().item() < 1e-10


class Rotary(nn.Module):
    """A buffer computed in ``__init__`` that ``reset_parameters`` does not set again."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("freq", torch.arange(4.0))

    def reset_parameters(self) -> None:
        pass

    def forward(self, x):
        return self.lin(x) * self.freq


def test_a_tensor_that_the_initialisation_never_sets_is_refused_and_left_on_meta():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Rotary())
    with pytest.raises(ValueError, match=r"1 \(Rotary\).*left freq without values"):
        pipeddp.materialize(model, seed=0)
    assert model[1].freq.is_meta
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Rotary())
    with pytest.raises(ValueError, match="left freq without values"):
        pipeddp.Pipeline(model, ["cpu", "cpu"], balance=[1, 1], seed=0)


def test_a_meta_built_torchvision_resnet_flattens_through_the_chain_family_too():
    torchvision = pytest.importorskip("torchvision")

    def build():
        with torch.device("meta"):
            return torchvision.models.resnet18(num_classes=10)

    flat = flatten_sequential(build(), torch.randn(2, 3, 32, 32))
    assert len(flat) == 15 and on_meta(flat)
    reference = pipeddp.materialize(build(), seed=1).eval()
    x = torch.randn(4, 3, 32, 32)
    with pipeddp.Pipeline(flat, ["cpu", "cpu"], chunks=2, seed=1) as pipe:
        pipe.eval()
        with torch.no_grad():
            assert (pipe(x) - reference(x)).abs().max().item() < 1e-6  # float32: the same weights, the same math


def test_a_meta_built_timm_vision_transformer_needs_an_init_of_its_own_and_then_equals_materialize():
    """timm's _init_weights is no per-module initialisation (it re-initialises the whole model from the top), so
    none is recorded: the class token and position embedding, which the model holds itself, are refused without
    init=; with a per-module init= the engine starts from materialize's weights."""
    timm = pytest.importorskip("timm")

    def build():
        with torch.device("meta"):
            return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3,
                                     embed_dim=32, num_heads=2, num_classes=5).double()

    def per_module(module: nn.Module) -> None:
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            t.normal_(0.0, 0.02)

    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    flat = flatten_sequential(build(), x)
    assert on_meta(flat)  # the model's own tensors the first layer keeps are the meta ones, not the lent values
    with pytest.raises(ValueError, match=r"cannot materialize embed\.kept .* pass init="):
        pipeddp.Pipeline(flat, ["cpu", "cpu"], chunks=2, seed=1)
    reference = pipeddp.materialize(build(), seed=1, init=per_module).eval()
    with pipeddp.Pipeline(flatten_sequential(build(), x), ["cpu", "cpu"], chunks=2, seed=1, init=per_module) as pipe:
        pipe.eval()
        with torch.no_grad():
            assert (pipe(x) - reference(x)).abs().max().item() < 1e-12


# -- the initialisation is transformers' own ---------------------------------------------------------------------

def _configs():
    """Models of hidden size 256 (large enough that a tensor's mean and std tell one initialisation from another),
    two layers each: the class and the config."""
    import transformers as tf

    small = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64)
    decoder = dict(small, num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return {
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=512, n_positions=64, n_embd=256, n_layer=2, n_head=4)),
        "t5": (tf.T5ForConditionalGeneration, tf.T5Config(vocab_size=512, d_model=256, d_kv=32, d_ff=512, num_layers=2,
                                                          num_heads=8, decoder_start_token_id=0, pad_token_id=0)),
        "bart": (tf.BartForConditionalGeneration, tf.BartConfig(
            vocab_size=512, d_model=256, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=512, decoder_ffn_dim=512, max_position_embeddings=64)),
        "bert": (tf.BertForMaskedLM, tf.BertConfig(**small)),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(**decoder)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(**decoder)),
        "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config(**decoder, head_dim=64)),
    }


def _ties(model: nn.Module):
    """The groups of names that hold one parameter."""
    groups = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return sorted(sorted(names) for names in groups.values() if len(names) > 1)


def _like_transformers(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` drawn as transformers draws ``want``: the same values where it computes them (a constant, a buffer),
    else mean and std within a few percent (a few standard errors at their size)."""
    assert got.shape == want.shape and got.dtype == want.dtype, name
    if not want.is_floating_point() or want.numel() < 2 or want.std() == 0 or name.endswith(("_freq", "_scale")):
        assert torch.equal(got, want), f"{name}: {got.flatten()[:4]} where transformers has {want.flatten()[:4]}"
        return
    g, w = got.double(), want.double()
    n, std = want.numel(), w.std().item()
    assert abs(g.std().item() / std - 1) < 0.03 + 5 / n ** 0.5, f"{name}: std {g.std().item():.4g}, not {std:.4g}"
    assert abs(g.mean().item() - w.mean().item()) < 5 * std * (2 / n) ** 0.5, f"{name}: mean {g.mean().item():.4g}"


@pytest.mark.parametrize("kind", ["gpt2", "t5", "bart", "bert", "llama", "qwen2", "gemma2"])
def test_a_meta_built_model_starts_from_transformers_own_initialisation_in_every_layout(kind):
    """Built on meta and materialized (whole, and by a 2-stage engine from the flattened model), every parameter
    and buffer is drawn as ``from_config`` draws it: GPT-2's scaled ``c_proj``, T5's factors per projection, zeroed
    biases, LayerNorm ones, Gemma's zero-centred norms, rotary frequencies; tied weights stay tied. The engine's
    weights equal ``materialize``'s, bit for bit."""
    cls, config = _configs()[kind]
    torch.manual_seed(0)
    want = cls(config)  # transformers' own initialisation (post_init)
    with torch.device("meta"):
        plain = cls(config)
    pipeddp.materialize(plain, seed=3)  # a transformers model's default init: its own _init_weights
    got = dict(plain.named_parameters())
    got.update(plain.named_buffers())
    expected = dict(want.named_parameters())
    expected.update(want.named_buffers())
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        _like_transformers(name, got[name], tensor)
    assert _ties(plain) == _ties(want)
    with torch.device("meta"):
        model = cls(config)
    ids = torch.randint(1, 512, (2, 6), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "decoder_input_ids": ids[:, :4]} if kind in ("t5", "bart") else ids
    with pipeddp.Pipeline(flatten_sequential(model, sample), ["cpu", "cpu"], seed=3, balance="params") as pipe:
        engine = pipe.state_dict()
    state = plain.state_dict()
    assert sorted(engine) == sorted(state)
    assert all(torch.equal(engine[k], state[k]) for k in state)
