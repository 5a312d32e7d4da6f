"""Model families whose blocks take more than the first block is given, opened by ``flatten_sequential``'s one
mechanism (record what each block receives, carry it between blocks), against the original models in float64:
per-layer masks (Gemma2: alternate layers take a sliding-window and a full causal mask), a layer shared by
several blocks (ALBERT calls its one layer group at every block), an encoder-decoder whose first decoder block
computes what the later ones are given (T5's position bias), and heads that read the model's input after the last
block (GPT-2's and Llama's sequence classifiers)."""

from __future__ import annotations

import pytest
import torch

import pipeddp
from pipeddp.tools.models import flatten_sequential

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'pipeddp[test]')")

from hf_jobs import MODELS, batch, fresh, logits, loss_fn  # noqa: E402

CHUNKS = 3


def loads_both_ways(pipe, model, kind, x):
    """The pipeline's weights load into a fresh original model (strict), and a fresh original's into the pipeline,
    which then computes that model's logits."""
    other = fresh(kind)
    other.load_state_dict(pipe.state_dict(), strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    pipe.load_state_dict(fresh(kind).state_dict(), strict=True)
    torch.testing.assert_close(pipe(x), logits(fresh(kind), x), rtol=0, atol=1e-12)


def every_copy_has_the_gradient(pipe, reference, stages, by_first_name=True):
    """Each parameter of ``reference`` is held by the pipeline (under its first name; else, without
    ``by_first_name``, under any of its names), and every copy the pipeline holds of it, under any of its names (a
    shared layer's copy per stage; T5's embedding, named in the encoder, the decoder and the model), has the
    reference's gradient."""
    names = pipe.key_names
    copies = {}
    for n, p in pipe.named_parameters():
        copies.setdefault(names.original(n), []).append(p.grad)
    aliases = {}
    for name, p in reference.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), (p, []))[1].append(name)
    for p, names_of_p in aliases.values():
        assert any(copies.get(n) for n in (names_of_p[:1] if by_first_name else names_of_p)), names_of_p
        for got in (g for n in names_of_p for g in copies.get(n, [])):
            assert (got - p.grad).abs().max().item() < 1e-12, (stages, names_of_p)


def over_micro_batches(model, x, y, chunks=CHUNKS):
    """The original model's gradients over the pipeline's micro-batches (equal rows, each loss weighted n_i/N)."""
    n = y.shape[0]
    size = n // chunks
    for i in range(chunks):
        part = slice(i * size, (i + 1) * size)
        xi = {k: v[part] for k, v in x.items()}
        (loss_fn(logits(model, xi), y[part]) * (size / n)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def reference_step(kind, x, y):
    """A fresh original model, its logits and loss on the batch, the loss's gradients in it."""
    reference = MODELS[kind]()
    want = logits(reference, x)
    loss = loss_fn(want, y)
    loss.backward()
    return reference, want, loss


def original(kind, x, y):
    """The original model's logits and loss on the batch, and its gradients over the whole batch and over the
    pipeline's micro-batches."""
    reference, want, loss = reference_step(kind, x, y)
    whole = {name: p.grad.clone() for name, p in reference.named_parameters()}
    reference.zero_grad()
    return want, loss, whole, over_micro_batches(reference, x, y)


def trains_like_the_original(pipe, model, x, y, kind, stages):
    """One step of ``pipe`` gives the original's loss, logits and gradients: exact against the same micro-batches,
    and within float32's rounding of the whole batch's (RMSNorm computes in float32 inside)."""
    want, loss, whole, micro = original(kind, x, y)
    assert abs(pipe.train_step(x, y, loss_fn).item() - loss.item()) < 1e-12
    assert (pipe(x) - want).abs().max().item() < 1e-12
    grads = dict(model.named_parameters())
    for name in whole:
        got = grads[name].grad
        assert got is not None, name
        assert (got - micro[name]).abs().max().item() < 1e-12, (stages, name)
        assert (got - whole[name]).abs().max().item() < 1e-7, (stages, name)


@pytest.mark.parametrize("padded", [False, True])
def test_per_layer_masks_gemma2_equals_the_original(padded):
    assert set(MODELS["gemma2"]().config.layer_types) == {"sliding_attention", "full_attention"}
    sample, _ = batch("gemma2", 4, 0, padded)
    x, y = batch("gemma2", 6, 1, padded)
    for stages, balance in ((2, [3, 7]), (4, [2, 2, 2, 4])):
        model = MODELS["gemma2"]()
        flat = flatten_sequential(model, sample)
        assert [n for n, _ in flat.named_children()] == ["embed"] + [f"model_layers_{i}" for i in range(4)] + \
            ["model_norm", "lm_head", "div", "tanh", "mul"]  # the logits' soft cap after the head
        with pipeddp.Pipeline(flat, ["cpu"] * stages, chunks=CHUNKS, balance=balance) as pipe:
            trains_like_the_original(pipe, model, x, y, "gemma2", stages)
            loads_both_ways(pipe, model, "gemma2", x)


@pytest.mark.parametrize("padded", [False, True])
def test_a_layer_shared_by_every_block_albert_equals_the_original(padded):
    sample, _ = batch("albert", 4, 0, padded)
    x, y = batch("albert", 6, 1, padded)
    reference, want, loss = reference_step("albert", x, y)
    group = "albert_encoder_albert_layer_groups_0"
    for stages, balance in ((2, [2, 4]), (4, [1, 1, 1, 3])) if padded else ((2, [2, 3]), (4, [1, 1, 1, 2])):
        model = MODELS["albert"]()
        flat = flatten_sequential(model, sample)
        places = [group, f"{group}_1", f"{group}_2"]
        # one layer at three places (the mask travels with the hidden state where the sample has one)
        assert list(flat._modules) == ["embed", *places, *(["hidden"] if padded else []), "predictions"]
        assert flat[1] is flat[2] is flat[3]
        with pipeddp.Pipeline(flat, ["cpu"] * stages, chunks=CHUNKS, balance=balance) as pipe:
            assert abs(pipe.train_step(x, y, loss_fn).item() - loss.item()) < 1e-12
            assert (pipe(x) - want).abs().max().item() < 1e-12
            # every copy of the shared group (one per stage it is used in) holds the whole weight's gradient: the
            # uses' gradients are summed over the stages
            every_copy_has_the_gradient(pipe, reference, stages)
            loads_both_ways(pipe, model, "albert", x)


@pytest.mark.parametrize("padded", [False, True])
def test_an_encoder_decoder_t5_opens_both_stacks(padded):
    """The encoder's blocks, then the decoder's: the batch travels through the encoder's blocks to the layer that
    gives the model the encoder's output; each stack's first block computes the position bias the later ones take."""
    sample, _ = batch("t5", 4, 0, padded)
    x, y = batch("t5", 6, 1, padded)
    reference, want, loss = reference_step("t5", x, y)
    for stages, balance in ((2, [4, 7]), (4, [2, 2, 2, 5])):
        model = MODELS["t5"]()
        flat = flatten_sequential(model, sample)
        assert list(flat._modules)[:7] == ["embed", "encoder_block_0", "encoder_block_1", "encoded",
                                           "decoder_block_0", "decoder_block_1", "decoder_block_2"]
        for first, later in (("encoder_block_0", "encoder_block_1"), ("decoder_block_0", "decoder_block_1")):
            assert flat.get_submodule(first).makes and not flat.get_submodule(later).makes  # made once
        with pipeddp.Pipeline(flat, ["cpu"] * stages, chunks=CHUNKS, balance=balance) as pipe:
            assert abs(pipe.train_step(x, y, loss_fn).item() - loss.item()) < 1e-12
            assert (pipe(x) - want).abs().max().item() < 1e-12
            # T5's embedding: three names, one weight, held under the name its first place has in the flat model
            every_copy_has_the_gradient(pipe, reference, stages, by_first_name=False)
            loads_both_ways(pipe, model, "t5", x)


@pytest.mark.parametrize("padded", [False, True])
def test_a_head_that_reads_the_model_s_own_state_bart_equals_the_original(padded):
    """BART adds a buffer of the model itself to the logits after the last block: the steps there are replayed as one
    layer holding that buffer under its own key; both stacks are opened as T5's are."""
    sample, _ = batch("bart", 4, 0, padded)
    x, y = batch("bart", 6, 1, padded)
    for stages, balance in ((2, [4, 3]), (4, [2, 2, 2, 1])):
        model = MODELS["bart"]()
        flat = flatten_sequential(model, sample)
        assert list(flat._modules) == ["embed", "model_encoder_layers_0", "model_encoder_layers_1", "encoded",
                                       "model_decoder_layers_0", "model_decoder_layers_1", "head"]
        assert flat.head.kept.final_logits_bias is model.final_logits_bias
        with pipeddp.Pipeline(flat, ["cpu"] * stages, chunks=CHUNKS, balance=balance) as pipe:
            trains_like_the_original(pipe, model, x, y, "bart", stages)
            loads_both_ways(pipe, model, "bart", x)


@pytest.mark.parametrize("kind", ["gpt2-cls", "llama-cls"])
@pytest.mark.parametrize("padded", [False, True])
def test_a_head_that_reads_the_input_equals_the_original(kind, padded):
    """A *ForSequenceClassification head picks each row's last non-padding token from input_ids after the last
    block: input_ids travel with the hidden state to a layer that replays the head, batch size and all."""
    sample, _ = batch(kind, 4, 0, padded)
    x, y = batch(kind, 6, 1, padded)
    blocks = MODELS[kind]().config.num_hidden_layers
    for stages, balance in ((2, [2, blocks]), (4, [1, 1, 1, blocks - 1])):
        model = MODELS[kind]()
        flat = flatten_sequential(model, sample)
        assert list(flat._modules)[-1] == "head" and len(flat) == blocks + 2
        assert flat(x).shape == (6, 3)
        with pipeddp.Pipeline(flat, ["cpu"] * stages, chunks=CHUNKS, balance=balance) as pipe:
            trains_like_the_original(pipe, model, x, y, kind, stages)
            loads_both_ways(pipe, model, kind, x)


@pytest.mark.parametrize("kind", ["gpt2-cls", "llama-cls"])
def test_a_head_that_reads_the_input_follows_the_batch_s_length(kind):
    """The head computes with the sequence length as a number (``torch.arange(input_ids.shape[-1])``): recorded on a
    shorter sample too, it follows each batch's length, as the batch size; padded rows included."""
    model = MODELS[kind]()
    sample, _ = batch(kind, 4, 0, True)
    flat = flatten_sequential(model, sample)
    g = torch.Generator().manual_seed(3)
    for length in (3, 9):
        ids = torch.randint(1, 40, (5, length), generator=g)
        mask = torch.ones(5, length, dtype=torch.long)
        mask[1, length - 2:] = 0
        x = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}
        assert (flat(x) - logits(model, x)).abs().max().item() < 1e-12, length


class LengthPlusOne(torch.nn.Module):
    """A block stack whose head computes with the length other than as the length (``arange(T + 1)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.score = torch.nn.Linear(8, 3)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.score(h)
        last = (torch.arange(ids.shape[1] + 1)[1:] * (ids != 0)).argmax(-1)
        return logits[torch.arange(ids.shape[0]), last]


def test_a_head_that_reads_the_input_refuses_what_it_cannot_replay():
    """A head that computes with the length otherwise refuses a batch of another length instead of computing with
    the sample's; a one-row sample cannot tell the batch size from a constant."""
    torch.manual_seed(0)
    model = LengthPlusOne().double()
    sample = torch.randint(1, 40, (4, 6))
    flat = flatten_sequential(model, sample)
    x = torch.randint(1, 40, (3, 6))
    assert (flat(x) - model(x)).abs().max().item() < 1e-12  # the sample's length
    with pytest.raises(ValueError, match="flatten with a sample shaped like the batches"):
        flat(torch.randint(1, 40, (3, 8)))
    sample, _ = batch("gpt2-cls", 4, 0, True)
    with pytest.raises(ValueError) as info:
        flatten_sequential(MODELS["gpt2-cls"](), {k: v[:1] for k, v in sample.items()})
    assert str(info.value).index("a sample of 2 or more rows") < str(info.value).index("torch.fx")


class MaskedBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, h, mask=None):
        return self.lin(h) * (mask if mask is not None else 1.0)


class PerLayerMasks(torch.nn.Module):
    """Alternate blocks take one of two masks the forward keeps in a dict; the second only for batches over 2."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([MaskedBlock(), MaskedBlock()])

    def forward(self, x):
        masks = {"even": torch.ones_like(x)}
        if x.shape[0] > 2:
            masks["odd"] = torch.full_like(x, 0.5)
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(h, mask=masks.get("odd" if i % 2 else "even"))
        return h


def test_a_per_layer_value_the_forward_no_longer_holds_is_refused_not_dropped():
    torch.manual_seed(0)
    model = PerLayerMasks().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    flat = flatten_sequential(model, x)
    assert torch.equal(flat(x), model(x))  # the second block's mask is carried from where the forward holds it
    with pytest.raises(ValueError, match=r"no longer holds \('masks', 'odd'\)"):
        flat(x[:2])  # silently None would give the second block no mask
