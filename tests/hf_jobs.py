"""Tiny transformers and timm models (random weights, no download) and the jobs the bring-in tests spawn."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import pipeddp
from pipeddp.tools.models import flatten_sequential

import nccl_rules

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

VOCAB, T = 40, 6


def gpt2(seed: int = 0, layers: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=layers, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).double()


def llama(seed: int = 0, layers: int = 2, meta: bool = False) -> nn.Module:
    """``meta``: built under ``torch.device("meta")`` (no memory; ``seed`` then plays no part)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return LlamaForCausalLM(config).double()


def gemma2(seed: int = 0, layers: int = 4) -> nn.Module:
    """Alternate layers take a sliding-window and a full causal mask (both computed before the first block)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=3,
                          max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                          attn_implementation="eager")
    return Gemma2ForCausalLM(config).double()


def albert(seed: int = 0, layers: int = 3) -> nn.Module:
    """One layer group shared by all its blocks: the model calls the same module ``layers`` times."""
    from transformers import AlbertConfig, AlbertForMaskedLM

    torch.manual_seed(seed)
    config = AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=layers,
                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=16,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    return AlbertForMaskedLM(config).double()


def t5(seed: int = 0) -> nn.Module:
    """An encoder-decoder: the decoder's first block computes the position bias that every later block is given."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3,
                      num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(config).double()


def vit(seed: int = 0) -> nn.Module:
    import timm

    torch.manual_seed(seed)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=3,
                             embed_dim=32, num_heads=2, num_classes=5).double()


def gpt2_cls(seed: int = 0) -> nn.Module:
    """A classifier whose head reads ``input_ids`` after the last block (each row's last non-padding token)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                        num_labels=LABELS)
    return GPT2ForSequenceClassification(config).double()


def llama_cls(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, num_labels=LABELS)
    return LlamaForSequenceClassification(config).double()


def bart(seed: int = 0) -> nn.Module:
    """An encoder-decoder whose head adds a buffer of the model's own (``final_logits_bias``, made non-zero here) to
    the logits."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    config = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=0,
                        eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=None)
    model = BartForConditionalGeneration(config).double()
    with torch.no_grad():
        model.final_logits_bias.normal_()
    return model


LABELS = 3
MODELS = {"gpt2": gpt2, "llama": llama, "gemma2": gemma2, "albert": albert, "t5": t5, "vit": vit,
          "gpt2-cls": gpt2_cls, "llama-cls": llama_cls, "bart": bart}


def tokens(n: int, seed: int, padded: bool) -> Tuple[Dict[str, torch.Tensor], torch.Tensor]:
    """A batch of ``n`` sequences (right-padded where ``padded``: every other row loses its last tokens) and targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, T), generator=g)
    targets = torch.randint(0, VOCAB, (n, T), generator=g)
    if not padded:
        return {"input_ids": ids}, targets
    mask = torch.ones(n, T, dtype=torch.long)
    mask[::2, T - 2:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}, targets


def images(n: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


def batch(kind: str, n: int, seed: int, padded: bool = False) -> Tuple[Any, torch.Tensor]:
    """A batch of ``kind``'s inputs and targets (a classifier's: one label per row)."""
    if kind == "vit":
        return images(n, seed)
    x, y = tokens(n, seed, padded)
    if kind in ("t5", "bart"):  # the encoder's tokens, the decoder's, and the decoder's targets
        g = torch.Generator().manual_seed(seed + 50)
        x["decoder_input_ids"] = torch.randint(2, VOCAB, (n, 5), generator=g)
        if padded:
            x["decoder_attention_mask"] = torch.ones(n, 5, dtype=torch.long)
        return x, torch.randint(0, VOCAB, (n, 5), generator=g)
    return (x, y[:, 0] % LABELS) if kind.endswith("-cls") else (x, y)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position (the mean over equal-length rows is exact over micro-batches)."""
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


def logits(model: nn.Module, x: Any) -> torch.Tensor:
    out = model(**x, use_cache=False) if isinstance(x, dict) else model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def reference_training(kind: str, padded: bool, steps: int, n: int, lr: float = 0.1) -> Tuple[List[float], dict]:
    """Single-device training of the original model: the losses and the final state dict."""
    model = MODELS[kind]()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(kind, n, 100 + step, padded)
        opt.zero_grad()
        loss = loss_fn(logits(model, x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _local(x: Any, replica: int, local: int) -> Any:
    part = slice(replica * local, (replica + 1) * local)
    return {k: v[part] for k, v in x.items()} if isinstance(x, dict) else x[part]


def hybrid_job(mode: str, runs: List[Tuple[str, bool]], steps: int, local: int,
               lr: float = 0.1) -> List[Dict[str, Any]]:
    """Train each (model, padded) flattened with HybridParallel: losses and the consolidated state dict."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    out = []
    for kind, padded in runs:
        model = MODELS[kind]()
        sample, _ = batch(kind, 4, 0, padded)
        flat = flatten_sequential(model, sample)
        engine = pipeddp.HybridParallel(flat, stages=2, mode=mode, chunks=2, balance=[2, len(flat) - 2])
        opt = torch.optim.SGD(engine.parameters(), lr=lr)
        losses = []
        for step in range(steps):
            x, y = batch(kind, local * engine.topology.replicas, 100 + step, padded)
            x, y = _local(x, engine.topology.replica, local), y[engine.topology.replica * local:][:local]
            opt.zero_grad()
            loss = engine.train_step(x if engine.is_first else None, y if engine.is_last else None, loss_fn)
            opt.step()
            losses.append(loss.item())
        out.append({"kind": kind, "padded": padded, "losses": losses, "state": engine.state_dict()})
        engine.close()
    return out


def fresh(kind: str) -> nn.Module:
    """A new instance of the original class with other weights (for strict loads)."""
    return copy.deepcopy(MODELS[kind](seed=7))
