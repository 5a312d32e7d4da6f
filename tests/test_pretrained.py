"""Pretrained weights from a Hugging Face directory (``save_pretrained``: safetensors, sharded with an index),
read per stage: the engine then computes ``from_pretrained``'s logits and trains like it."""

import copy
import os

import pytest
import torch

import pipeddp
from hf_jobs import llama, tokens
from pipeddp.tools.models import flatten_sequential

pytest.importorskip("safetensors")


def tiny_llama(seed: int, tied: bool, meta: bool = False):
    model = llama(seed=seed, layers=3, meta=meta)
    model.config.tie_word_embeddings = tied
    if tied:  # the output head reads the embedding's weight
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def saved_llama(path: str, tied: bool) -> None:
    """A tiny Llama with weights of its own (the 'pretrained' one), saved in several shards."""
    tiny_llama(7, tied).save_pretrained(path, max_shard_size="20KB")


def reference(path: str, batch):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float64).eval()
    with torch.no_grad():
        return model(**batch, use_cache=False).logits


def lm_loss(logits, targets):
    logits = getattr(logits, "logits", logits)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stepped(path: str, batch, targets):
    """``from_pretrained``'s model after one SGD step on ``batch``: its state dict."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float64)
    lm_loss(model(**batch, use_cache=False), targets).backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return model.state_dict()


def flat_llama(sample, tied, meta=False):
    """Other weights than the saved ones; ``meta``: built on the meta device, as a model too big for one process."""
    return flatten_sequential(tiny_llama(0, tied, meta), sample)


def stage_job(path: str, sample, batch, tied, targets=None):
    """Stage mode, 2 processes, the model built on the meta device: each allocates and reads only its own tensors;
    the last stage's logits, and the whole model after one SGD step on ``(batch, targets)``."""
    import pipeddp.checkpoints.pretrained as pretrained

    read = []
    original = pretrained.read_tensors

    def counting(where, keys, blocks=None):
        keys = list(keys)
        read.extend(keys)
        return original(where, keys, blocks)

    pretrained.read_tensors = counting
    flat = flat_llama(sample, tied, meta=True)
    with pipeddp.HybridParallel(flat, stages=2, mode="stage", chunks=2) as engine:
        allocated = sorted(k for k, v in flat.state_dict().items() if not v.is_meta)
        total = len(flat.state_dict())
        engine.load(path)
        engine.eval()
        with torch.no_grad():
            out = engine(batch["input_ids"] if engine.is_first else None)
        own = sorted(engine.local_state_dict())
        engine.train()
        opt = torch.optim.SGD(engine.parameters(), lr=0.5)
        engine.train_step(batch["input_ids"] if engine.is_first else None, targets if engine.is_last else None,
                          lm_loss)
        opt.step()
        after = engine.state_dict()
    return {"logits": out, "read": sorted(read), "own": own, "allocated": allocated, "total": total, "after": after}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tied", [False, True])
def test_a_sharded_hugging_face_directory_loads_per_stage(tmp_path, tied):
    path = str(tmp_path / "llama")
    saved_llama(path, tied)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))  # several shards
    batch, targets = tokens(4, seed=3, padded=False)
    want = reference(path, batch)
    # one process
    with pipeddp.Pipeline(flat_llama(batch, tied), ["cpu", "cpu"], chunks=2) as pipe:
        pipe.load(path)
        pipe.eval()
        with torch.no_grad():
            got = pipe(batch["input_ids"])
    assert (got - want).abs().max().item() < 1e-10
    # stage mode: each process reads exactly its own tensors, and the last one's logits are from_pretrained's
    results = pipeddp.spawn(stage_job, 2, args=(path, batch, batch, tied, targets), timeout=200)
    first, last = results
    assert set(first["read"]).isdisjoint(last["read"])
    for res in results:
        assert set(res["read"]) <= set(res["own"])
        assert 0 < len(res["allocated"]) < res["total"]  # its own layers only
    both = set(first["allocated"]) & set(last["allocated"])  # only the tied weight, which both stages use
    assert both == ({"embed.owned.model_embed_tokens.weight", "lm_head.weight"} if tied else set())
    assert (last["logits"] - want).abs().max().item() < 1e-10
    # and one optimizer step later it is from_pretrained's model after the same step
    expected = stepped(path, batch, targets)
    for res in results:
        got = res["after"]
        assert sorted(got) == sorted(expected)
        assert max((got[k] - expected[k]).abs().max().item() for k in got) < 1e-10


def test_a_directory_of_another_model_is_refused_before_anything_changes(tmp_path):
    path = str(tmp_path / "llama")
    saved_llama(path, tied=False)
    batch, _ = tokens(2, seed=3, padded=False)
    from transformers import LlamaConfig, LlamaForCausalLM

    wider = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=32)).double()
    with pipeddp.Pipeline(flatten_sequential(wider, batch), ["cpu", "cpu"], chunks=2) as pipe:
        before = copy.deepcopy(pipe.state_dict())
        with pytest.raises(ValueError, match="holds tensors that do not fit the model"):
            pipe.load(path)
        with pytest.raises(ValueError, match="weights only"):
            pipe.load(path, torch.optim.SGD(pipe.parameters(), lr=0.1))
        after = pipe.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.timeout(120)
def test_a_tied_model_loads_whatever_stage_holds_the_head(tmp_path):
    """The directory holds the embedding only. With the head in the embedding's stage the two are one tensor under
    two keys, and the head's key is not asked of the directory either: one stage, two stages, replica mode."""
    path = str(tmp_path / "llama")
    saved_llama(path, tied=True)
    batch, _ = tokens(4, seed=3, padded=False)
    want = reference(path, batch)
    engines = [lambda flat: pipeddp.Pipeline(flat, ["cpu"], chunks=2, seed=0),
               lambda flat: pipeddp.Pipeline(flat, ["cpu", "cpu"], chunks=2, seed=0),
               lambda flat: pipeddp.HybridParallel(flat, stages=1, mode="replica", chunks=2, seed=0)]
    for build in engines:
        with build(flat_llama(batch, tied=True, meta=True)) as engine:
            engine.load(path)
            engine.eval()
            with torch.no_grad():
                got = engine(batch["input_ids"])
            assert (got - want).abs().max().item() < 1e-10
            if len(engine.stages) == 1:  # still one weight, not two that would drift apart in training
                own = engine.state_dict(keep_vars=True)
                assert own["lm_head.weight"] is own["model.embed_tokens.weight"]


@pytest.mark.timeout(120)
def test_a_meta_built_bart_loads_its_directory_in_one_and_two_stages(tmp_path):
    """BART's head adds a buffer of the model itself (``final_logits_bias``), which the first layers of both its
    stacks hold too, and transformers keeps its embedding as ``model.shared.weight`` where the engine's first place
    is the encoder's: built on meta, flattened and loaded, it computes the saved model's logits."""
    from hf_jobs import bart, batch, logits
    from transformers import BartForConditionalGeneration

    real = bart(5).eval()
    path = str(tmp_path / "bart")
    real.save_pretrained(path)
    x, _ = batch("bart", 4, 0)
    with torch.no_grad():
        want = logits(real, x)
    for devices in (["cpu"], ["cpu", "cpu"]):
        with torch.device("meta"):
            model = BartForConditionalGeneration(real.config).double()
        with pipeddp.Pipeline(flatten_sequential(model, x), devices, chunks=2, seed=0) as pipe:
            pipe.eval()
            with torch.no_grad():
                assert (pipe(x) - want).abs().max().item() > 1e-3  # its own initial weights: the load changes them
                pipe.load(path)
                got = pipe(x)
        assert (got - want).abs().max().item() < 1e-10
