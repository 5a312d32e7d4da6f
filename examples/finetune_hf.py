"""Fine-tune a Hugging Face model in stage mode and write it back as a Hugging Face directory, from every process.

    python examples/finetune_hf.py --make-tiny tiny-llama                 # a tiny model, saved as if downloaded
    torchrun --nproc_per_node=4 examples/finetune_hf.py --model-dir tiny-llama --export tuned
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('tuned')"

The main path of a model too big for one process, end to end:

1. the model is built on the meta device from the directory's config (nothing allocated);
2. ``flatten_sequential`` opens it into the ``nn.Sequential`` pipeddp cuts (its own modules, its own names);
3. ``HybridParallel(mode="stage")``: each process materializes only its stage; ``load(model_dir)`` reads only
   that stage's tensors from the safetensors files;
4. training on dynamically padded batches (each batch padded to its own longest row, so both the sequence length
   and whether an attention mask crosses a cut change from batch to batch) with transformers' default attention,
   and a loss returned as ``(total, count)`` over the non-padding tokens: the step's loss is the token mean of the
   whole global batch, however the padding falls over micro-batches and replicas;
5. figures of every step logged through the ``pipeddp`` logger (rank 0);
6. ``save_pretrained(export)`` on every rank: each process writes its own tensors, one writes the index and the
   config, and ``from_pretrained(export)`` of the original class opens it.

``--make-tiny DIR`` writes a small model of ``--arch`` (llama, qwen2, gpt2, llama-cls) with ``save_pretrained``, so
the example runs without a download. Every rank draws the same global batches (``batches``) and trains on its
replica's share; ``tests/test_finetune_hf.py`` trains the plain transformers model on the same batches and compares.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import pipeddp

PAD = 0
ARCHS = ("llama", "qwen2", "gpt2", "llama-cls")
LABELS = 3


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--make-tiny", metavar="DIR", default=None, help="write a tiny --arch model to DIR and stop")
    p.add_argument("--arch", choices=ARCHS, default="llama", help="the tiny model --make-tiny writes")
    p.add_argument("--model-dir", default=None, help="the Hugging Face directory to fine-tune")
    p.add_argument("--export", default="finetuned", help="where save_pretrained writes the result")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per step, over all replicas")
    p.add_argument("--max-len", type=int, default=12, help="the longest sequence of a batch")
    p.add_argument("--chunks", type=int, default=2, help="micro-batches per step")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages per replica")
    p.add_argument("--schedule", default="1f1b", help="the pipeline's schedule (gpipe, 1f1b, zb, ...)")
    p.add_argument("--lr", type=float, default=1e-3, help="the learning rate")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw", help="the optimizer")
    p.add_argument("--seed", type=int, default=0, help="seed of the data")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="the parameters' dtype")
    p.add_argument("--log-every", type=int, default=1, help="log the step's figures every this many steps")
    return p.parse_args(argv)


def tiny_config(arch: str, dtype: str = "float32") -> Any:
    """A small config of ``arch`` (random weights, nothing downloaded)."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    common: Dict[str, Any] = dict(vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=PAD, dtype=dtype)
    if arch == "gpt2":
        return GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0, **common)
    kind = Qwen2Config if arch == "qwen2" else LlamaConfig
    return kind(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=arch == "llama",
                num_labels=LABELS, **common)


def model_class(config: Any) -> Any:
    """The transformers class the directory's config names (a causal LM or a sequence classifier)."""
    import transformers

    return getattr(transformers, config.architectures[0])


def make_tiny(arch: str, path: str, seed: int = 7) -> None:
    """A tiny model with weights of its own, written with ``save_pretrained`` in several shards."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_config(arch)
    kind = AutoModelForSequenceClassification if arch.endswith("-cls") else AutoModelForCausalLM
    kind.from_config(config).save_pretrained(path, max_shard_size="40KB")


def batches(seed: int, steps: int, n: int, max_len: int, vocab: int, classify: bool
            ) -> Iterator[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
    """Dynamically padded batches: each row has a random length, the batch is right-padded to its own longest row
    (so its length changes from batch to batch, and a micro-batch may hold no padding at all). Targets: the next
    token (-100 at padding), or one label per row for a classifier."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        width = int(torch.randint(max(2, max_len - 4), max_len + 1, (1,), generator=g))  # this batch's longest
        lengths = torch.randint(2, width + 1, (n,), generator=g)
        lengths[(torch.arange(n) // 2) % 2 == 0] = width  # rows 0, 1, 4, 5, ... unpadded: no mask needed there
        ids = torch.randint(3, vocab, (n, width), generator=g)
        mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, PAD)
        if classify:
            target = torch.randint(0, LABELS, (n,), generator=g)
        else:
            target = torch.cat([ids[:, 1:], torch.full((n, 1), PAD)], 1).masked_fill(
                torch.cat([mask[:, 1:], torch.zeros(n, 1, dtype=torch.long)], 1) == 0, -100)
        yield {"input_ids": ids, "attention_mask": mask}, target


def loss_fn(out: Any, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's summed loss and how many items it covers (non-padding tokens, or rows)."""
    logits = getattr(out, "logits", out)
    if logits.dtype in (torch.float16, torch.bfloat16):  # the loss in float32 at least
        logits = logits.float()
    if target.dim() == 1:  # a classifier: one label per row
        return F.cross_entropy(logits, target, reduction="sum"), target.new_tensor(target.numel())
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100,
                            reduction="sum")
    return total, (target != -100).sum()


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr) if name == "adamw" else torch.optim.SGD(params, lr=lr)


def build_on_meta(model_dir: str, dtype: torch.dtype, sample: Dict[str, torch.Tensor]) -> nn.Sequential:
    """The directory's model built on the meta device and opened into an ``nn.Sequential`` (no weights read yet)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = model_class(config)._from_config(config, dtype=dtype)
    return pipeddp.flatten_sequential(model, sample)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse(argv)
    if args.make_tiny:
        make_tiny(args.arch, args.make_tiny)
        print(f"wrote a tiny {args.arch} to {args.make_tiny}")
        return {}
    if not args.model_dir:
        raise SystemExit("--model-dir is needed (write a tiny one first with --make-tiny DIR)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stdout)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model_dir, local_files_only=True)
    classify = config.architectures[0].endswith("ForSequenceClassification")
    dtype = getattr(torch, args.dtype)
    data = list(batches(args.seed, args.steps, args.batch, args.max_len, config.vocab_size, classify))
    flat = build_on_meta(args.model_dir, dtype, data[0][0])
    engine = pipeddp.HybridParallel(flat, stages=args.stages, chunks=args.chunks, mode="stage",
                                    schedule=args.schedule, balance="params", seed=args.seed,
                                    log_every=args.log_every)
    engine.load(args.model_dir)  # each process reads its own stage's tensors
    topo = engine.topology
    opt = make_optimizer(args.optimizer, engine.parameters(), args.lr)
    losses: List[float] = []
    for x, y in data:
        share = slice(topo.replica * len(y) // topo.replicas, (topo.replica + 1) * len(y) // topo.replicas)
        opt.zero_grad()
        loss = engine.train_step({k: v[share] for k, v in x.items()} if engine.is_first else None,
                                 y[share] if engine.is_last else None, loss_fn)
        opt.step()
        losses.append(float(loss))
    engine.save_pretrained(args.export)  # every rank: its own tensors; one rank the index and the config
    engine.close()
    if int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("pipeddp").info("losses %s; saved to %s", " ".join(f"{v:.4f}" for v in losses),
                                          args.export)
    return {"losses": losses}


if __name__ == "__main__":
    main()
    sys.exit(0)
