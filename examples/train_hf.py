"""Train a Hugging Face transformers causal LM with HybridParallel, and load the weights back into transformers.

    python examples/train_hf.py                                        # Llama from a tiny config, 1 replica x 2 stages
    python examples/train_hf.py --arch gpt2 --text notes.txt           # GPT-2 (its head tied to the embedding)
    python examples/train_hf.py --model-dir ./my-model                 # a model directory you already have
    torchrun --nproc_per_node=2 examples/train_hf.py                   # 2 replicas x 2 stages (threads)
    torchrun --nproc_per_node=4 examples/train_hf.py --mode stage      # 2 replicas x 2 stages, a process each

The model is a transformers ``AutoModelForCausalLM``, built from a config (random
weights) or loaded from ``--model-dir`` (local files only: nothing is downloaded).
``pipeddp.flatten_sequential(model, sample)`` opens it into the ``nn.Sequential``
pipeddp cuts: an ``embed`` layer (the model's own forward up to its first block:
embeddings, rotary table, attention mask), one layer per decoder block passing
``(hidden, mask, cos, sin, positions)`` on, the final norm and the head. The text
(``--text``, default this project's README) is read as bytes, one token per byte
(or with the model directory's tokenizer, when it has one), so no tokenizer is
fetched either; training takes random windows of ``--context`` tokens, AdamW.

At the end every rank calls ``engine.save``: the checkpoint holds the model's own
keys (``model.layers.0.self_attn.q_proj.weight``), so rank 0 loads it with
``strict=True`` into a fresh ``AutoModelForCausalLM.from_config(config)`` and checks
that it computes the pipeline's loss. ``--save-pretrained DIR`` writes that model
with ``save_pretrained`` (a directory ``--model-dir`` and transformers read back).
Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import pipeddp

README = Path(__file__).resolve().parent.parent / "README.md"



class HelpFormatter(argparse.RawTextHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` keeps the docstring's layout and ends every flag's help with its default."""


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--text", default=str(README), help="the text file to train on (default: pipeddp's README)")
    p.add_argument("--model-dir", default=None, help="a local transformers model directory (config + weights)")
    p.add_argument("--arch", choices=["llama", "gpt2"], default="llama", help="the config to build without --model-dir")
    p.add_argument("--layers", type=int, default=4, help="layers (blocks) of the model")
    p.add_argument("--hidden", type=int, default=128, help="hidden size of the model")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--context", type=int, default=64, help="tokens per training window")
    p.add_argument("--batch", type=int, default=16, help="sequences per replica per step")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages per replica")
    p.add_argument("--mode", choices=["replica", "stage"], default="replica", help="a process per replica or per stage")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="the model's parameter dtype")
    p.add_argument("--out", default="train_hf.pt", help="the checkpoint engine.save writes at the end")
    p.add_argument("--save-pretrained", default=None, help="also write the trained model with save_pretrained")
    p.add_argument("--log-every", type=int, default=20, help="print the loss every this many steps")
    return p.parse_args(argv)


def tokenizer(args: argparse.Namespace) -> Tuple[Callable[[str], List[int]], int]:
    """The model directory's tokenizer when it has one, else bytes (256 ids): nothing is downloaded."""
    if args.model_dir:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
            return (lambda text: tok(text)["input_ids"]), len(tok)
        except (OSError, ValueError, ImportError):
            pass
    return (lambda text: list(text.encode("utf-8"))), 256


def build_model(args: argparse.Namespace, vocab: int) -> Tuple[nn.Module, Any]:
    """The transformers model (seeded: the same weights on every rank) and its config."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig

    torch.manual_seed(args.seed)
    if args.model_dir:
        config = AutoConfig.from_pretrained(args.model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, local_files_only=True)
    elif args.arch == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_positions=args.context, n_embd=args.hidden, n_layer=args.layers,
                            n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                            eos_token_id=0)
        model = AutoModelForCausalLM.from_config(config)
    else:
        config = LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=args.heads, max_position_embeddings=args.context, bos_token_id=0,
                             eos_token_id=0)
        model = AutoModelForCausalLM.from_config(config)
    if config.vocab_size < vocab:
        raise SystemExit(f"the model's vocabulary ({config.vocab_size}) is smaller than the tokenizer's ({vocab})")
    return model.to(getattr(torch, args.dtype)), config


def windows(data: torch.Tensor, n: int, context: int, generator: torch.Generator) -> Tuple[dict, torch.Tensor]:
    """``n`` random windows of the text: the inputs and the next token at every position."""
    starts = torch.randint(0, len(data) - context - 1, (n,), generator=generator)
    rows = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
    return {"input_ids": rows[:, :-1]}, rows[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's summed loss over its non-padding tokens (-100), and how many there are: pipeddp divides
    by the count of the whole batch, so padded batches train the plain model's token mean (no padding here)."""
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, (target != -100).sum()


def main(argv: Optional[List[str]] = None) -> dict:
    args = parse(argv)
    encode, vocab = tokenizer(args)
    data = torch.tensor(encode(Path(args.text).read_text(encoding="utf-8", errors="replace")), dtype=torch.long)
    if len(data) <= args.context + 1:
        raise SystemExit(f"{args.text} holds {len(data)} tokens: fewer than --context + 1")
    model, config = build_model(args, vocab)
    sample, _ = windows(data, 2, args.context, torch.Generator().manual_seed(args.seed))
    flat = pipeddp.flatten_sequential(model, sample)
    engine = pipeddp.HybridParallel(flat, stages=args.stages, chunks=args.chunks, mode=args.mode, balance="params")
    rank0 = int(os.environ.get("RANK", "0")) == 0
    say: Callable[..., None] = print if rank0 else (lambda *a, **k: None)
    topo = engine.topology
    say(f"{type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters) opened into "
        f"{len(flat)} layers: {' '.join(n for n, _ in flat.named_children())}")
    say(f"{topo.replicas} replica(s) x {topo.stages} stage(s), mode={args.mode}, balance {engine.balance}; "
        f"{len(data)} tokens, vocabulary {vocab}")
    opt = torch.optim.AdamW(engine.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)  # every rank draws the global batch; each takes its share
    losses: List[float] = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = windows(data, args.batch * topo.replicas, args.context, gen)
        part = slice(topo.replica * args.batch, (topo.replica + 1) * args.batch)
        x, y = {k: v[part] for k, v in x.items()}, y[part]
        opt.zero_grad()
        loss = engine.train_step(x if engine.is_first else None, y if engine.is_last else None, loss_fn)
        opt.step()
        losses.append(loss.item())
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            say(f"step {step:4d}  loss {losses[-1]:.3f}  ({time.perf_counter() - start:.1f}s)")
    first = sum(losses[:5]) / len(losses[:5])
    last = sum(losses[-5:]) / len(losses[-5:])
    say(f"mean loss of the first {len(losses[:5])} steps {first:.3f}, of the last {len(losses[-5:])} steps "
        f"{last:.3f} (ln vocabulary = {math.log(vocab):.3f})")

    engine.save(args.out)
    held = windows(data, args.batch, args.context, torch.Generator().manual_seed(args.seed + 2))
    pipe_loss = engine.evaluate([held], lambda out, y: {"loss": loss_fn(out, y)})["loss"]
    result = {"first": first, "last": last, "losses": losses, "held_out": pipe_loss}
    if rank0:
        from transformers import AutoModelForCausalLM

        again = AutoModelForCausalLM.from_config(config).to(getattr(torch, args.dtype))
        state = torch.load(args.out, weights_only=True)["model"]
        again.load_state_dict(state, strict=True)
        again.eval()
        with torch.no_grad():
            total, count = loss_fn(again(**held[0], use_cache=False).logits, held[1])
            back = (total / count).item()
        say(f"the checkpoint loads into {type(again).__name__} (strict): held-out loss {back:.4f} "
            f"(the pipeline's: {pipe_loss:.4f})")
        result["loaded_back"] = back
        if args.save_pretrained:
            again.save_pretrained(args.save_pretrained)
            say(f"saved with save_pretrained to {args.save_pretrained}")
    engine.close()
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
