"""Tiny transformers models saved as if downloaded, and the job ``test_export.py`` spawns: each is built on the meta
device, loaded per stage, trained and written back with ``save_pretrained`` by every process."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F

import pipeddp
from pipeddp.tools.models import flatten_sequential

import nccl_rules

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

VOCAB, T, LR = 40, 6, 0.5


def config(kind: str):
    """A tiny Llama with tied embeddings (``tie_word_embeddings=True``), or a GPT-2 (tied too, its default)."""
    from transformers import GPT2Config, LlamaConfig

    if kind == "llama":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0,
                           eos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    return GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=3, n_head=2, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def model_class(kind: str):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return LlamaForCausalLM if kind == "llama" else GPT2LMHeadModel


def save_downloaded(kind: str, path: str, seed: int = 7) -> None:
    """The 'pretrained' model: weights of its own, float64, written by transformers in several shards."""
    torch.manual_seed(seed)
    model_class(kind)(config(kind)).double().save_pretrained(path, max_shard_size="40KB")


def batches(steps: int, n: int, seed: int = 100) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Global batches of token ids and next-token targets (equal lengths: a mean over tokens is exact per replica)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(1, VOCAB, (n, T), generator=g), torch.randint(0, VOCAB, (n, T), generator=g))
            for _ in range(steps)]


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def plain_training(kind: str, path: str, steps: int, n: int):
    """The reference: transformers' own model from ``path`` trained on one device (SGD on each global batch)."""
    model = model_class(kind).from_pretrained(path, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches(steps, n):
        opt.zero_grad()
        lm_loss(model(input_ids=x, use_cache=False), y).backward()
        opt.step()
    return model


def _on_meta(kind: str, path: str, sample: torch.Tensor):
    from transformers import AutoConfig

    found = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = model_class(kind)._from_config(found, dtype=torch.float64)
    return flatten_sequential(model, {"input_ids": sample})


def stage_job(runs: List[Tuple[str, str, str, str]], steps: int, n: int, refused: str) -> Dict[str, Any]:
    """2 replicas x 2 stages (4 processes): for each (kind, downloaded, export, shard), the model built on meta,
    ``load``ed per stage, trained, exported. Returns this rank's own keys and the files it wrote (name, keys), and
    what the refusals raised."""
    import torch.distributed as dist

    from pipeddp.checkpoints import export

    dist.init_process_group("gloo")
    written: List[Tuple[str, List[str]]] = []
    original = export._create_file

    def recording(path, layout):  # the file this process makes, and the tensors in it
        written.append((os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path), sorted(layout.entries)))
        return original(path, layout)

    export._create_file = recording
    out: Dict[str, Any] = {"rank": dist.get_rank(), "own": {}, "refusals": []}
    for kind, source, target, shard in runs:
        flat = _on_meta(kind, source, batches(1, n)[0][0])
        with pipeddp.HybridParallel(flat, stages=2, mode="stage", chunks=2, shard=shard) as engine:
            engine.load(source)
            topo = engine.topology
            opt = torch.optim.SGD(engine.parameters(), lr=LR)
            for x, y in batches(steps, n):
                part = slice(topo.replica * n // 2, (topo.replica + 1) * n // 2)
                opt.zero_grad()
                engine.train_step(x[part] if engine.is_first else None, y[part] if engine.is_last else None, lm_loss)
                opt.step()
            engine.save_pretrained(target)
            out["own"][kind] = sorted(engine.local_state_dict())
            if not out["refusals"]:
                out["refusals"] = _refusals(engine, refused)
    out["written"] = written
    dist.destroy_process_group()
    return out


def _refusals(engine: pipeddp.HybridParallel, refused: str) -> List[str]:
    """What each refusal raised on this rank: a directory holding other files, a rank calling something else."""
    seen = []
    try:
        engine.save_pretrained(refused)
    except (ValueError, RuntimeError) as exc:
        seen.append(f"{type(exc).__name__}: {exc}")
    try:
        if engine.topology.rank == 3:
            engine.state_dict()
        else:
            engine.save_pretrained(refused + "-other")
    except RuntimeError as exc:
        seen.append(f"{type(exc).__name__}: {exc}")
    return seen
