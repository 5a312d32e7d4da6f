"""Train a character language model written with ``nn.TransformerEncoder``, pipelined through ``flatten_sequential``.

    python examples/train_transformer.py                                   # Pipeline, 2 stages on one process
    python examples/train_transformer.py --hybrid                          # HybridParallel, 1 replica x 2 stages
    torchrun --nproc_per_node=2 examples/train_transformer.py --hybrid     # 2 replicas x 2 stages (threads)

``examples/train_lm.py`` writes its model as an ``nn.Sequential`` of blocks of its
own. Most transformer code is written the way this file's ``TransformerLM`` is: a
module whose ``forward`` runs an embedding, ``nn.TransformerEncoder`` under the
causal mask of the input's length, and an output head::

    h = self.embed(idx)
    mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1), device=idx.device, dtype=h.dtype)
    return self.head(self.encoder(h, mask=mask, is_causal=True))

pipeddp cuts between the layers of an ``nn.Sequential``, so
``pipeddp.tools.models.flatten_sequential(model, sample)`` turns the model into
one: the embedding, one entry per encoder layer (each given the causal mask the
encoder would give it), the encoder's final norm and the head, sharing the
model's parameters and checked against ``model(sample)``. Without that, the
encoder would be one layer holding nearly all the time, and no cut could balance.
The head's weight is the embedding's (tied across the first and the last stage),
as in ``train_lm.py``.

The data, the command line, the loss, the optimizer and the sampling are
``train_lm.py``'s (see there; ``--help`` lists the flags): the project's README and
sources as text, random windows of ``--context`` characters, AdamW, the same
defaults (4 layers, d_model 128, 4 heads, feed-forward 512, dropout 0.1, batch 32 in
4 micro-batches, 600 steps), so the two examples compare. Only rank 0 prints.
``--out PATH`` writes the final consolidated state dict.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, NamedTuple, Optional, Union

import torch
from torch import nn

import pipeddp
from pipeddp.tools.models import flatten_sequential

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_lm.py beside this file, whatever the directory
import train_lm as lm  # noqa: E402  (after the path it is found on)

# -- model -----------------------------------------------------------------------------------------


class TransformerLM(nn.Module):
    """Token + position embedding, a pre-norm causal ``nn.TransformerEncoder`` with a final norm, a tied head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, context: int, dropout: float) -> None:
        super().__init__()
        self.embed = lm.Embed(vocab, d, context, dropout)  # positions live in a layer, so the model flattens
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d), enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.size(1), device=idx.device, dtype=h.dtype)
        return self.head(self.encoder(h, mask=mask, is_causal=True))


def make_model(vocab: int, args: Any) -> TransformerLM:
    """The model, seeded by ``--seed`` (the same initial weights on every rank); the head tied to the embedding."""
    torch.manual_seed(args.seed)
    model = TransformerLM(vocab, args.d_model, args.heads, args.layers, args.context, args.dropout)
    model = model.to(lm.DTYPES[args.dtype])
    model.head.weight = model.embed.tok.weight  # tied after the dtype conversion: one Parameter
    return model


def parse(argv: Any = None) -> Any:
    """``train_lm.py``'s command line, with this file's description."""
    return lm.parse(argv, description=__doc__)


class Result(NamedTuple):
    """What ``main`` returns: every step's training loss and the held-out loss before and after."""

    losses: List[float]
    held_before: float
    held_after: float

    @property
    def final(self) -> float:
        """The mean training loss of the last 20 steps (one step is noisy)."""
        tail = self.losses[-20:]
        return sum(tail) / len(tail)


# -- training --------------------------------------------------------------------------------------


def main(argv: Any = None) -> Result:
    """Flatten, pipeline, train, evaluate before and after, write ``--out``, print a sample (rank 0)."""
    args = parse(argv)
    data = lm.load_text([Path(p) for p in args.text] if args.text else None)
    model = make_model(len(data.vocab), args)
    held_set = lm.held_out_set(data.held, args.context, args.eval_windows)
    x_sample, _ = lm.sample_batch(data.train, args.batch, args.context, torch.Generator().manual_seed(args.seed))
    n_params = sum(p.numel() for p in model.parameters())  # before wrapping: the tied weight counted once

    # embed, encoder_layers_0 .. encoder_layers_{N-1}, encoder_norm, head: the layers the partitioner cuts between
    flat = flatten_sequential(model, x_sample)
    if args.hybrid:
        engine: Union[pipeddp.Pipeline, pipeddp.HybridParallel] = pipeddp.HybridParallel(
            flat, stages=args.stages, mode=args.mode, chunks=args.chunks, sample=x_sample, balance=args.balance,
            checkpoint=args.checkpoint, threads=args.threads, devices="auto")
        rank, replica = engine.topology.rank, engine.topology.replica
        held_loader = pipeddp.data.loader(held_set, args.batch, engine=engine, train=False)

        def held_out() -> float:
            return engine.evaluate(held_loader, lambda out, y: {"loss": lm.loss_fn(out, y)})["loss"]
        where = f"HybridParallel, mode={args.mode}, {engine.topology.replicas} replica(s) x {args.stages} stages"
    else:
        engine = pipeddp.Pipeline(flat, "auto", stages=args.stages, chunks=args.chunks, sample=x_sample,
                                  balance=args.balance, checkpoint=args.checkpoint, threads=args.threads)
        rank, replica = 0, 0

        def held_out() -> float:
            return lm.pipeline_held_out(engine, held_set, args.batch)
        where = f"Pipeline, {args.stages} stages"

    say: Callable[..., None] = print if rank == 0 else (lambda *a, **k: None)
    say(f"{where} on {[str(d) for d in engine.devices]}: {len(flat)} layers "
        f"({', '.join(name for name, _ in flat.named_children())}), balance {engine.balance}", flush=True)
    say(f"text {len(data.train) + len(data.held):,} characters, vocabulary {len(data.vocab)} "
        f"(ln {math.log(len(data.vocab)):.2f}), model {n_params:,} parameters, {args.dtype}", flush=True)
    held_before = held_out()
    say(f"held-out loss at start {held_before:.4f} ({len(held_set)} windows)", flush=True)

    optimizer = lm.make_optimizer(engine.parameters(), args)
    g = lm.replica_generator(args.seed, replica)
    losses: List[float] = []
    start = time.perf_counter()
    with lm.progress_bar(rank == 0) as bar:
        task = bar.add_task("train", total=args.steps, loss=float("nan"))
        for step in range(1, args.steps + 1):
            x, y = lm.sample_batch(data.train, args.batch, args.context, g)
            optimizer.zero_grad()
            losses.append(engine.train_step(x, y, lm.loss_fn).item())
            if args.clip > 0:
                engine.clip_grad_norm_(args.clip)
            optimizer.step()
            bar.update(task, advance=1, loss=losses[-1])
            if rank == 0 and args.log_every and (step % args.log_every == 0 or step == 1):
                recent = losses[-args.log_every:]
                bar.console.print(f"step {step:5d}  loss {losses[-1]:.4f}  (mean of the last {len(recent)}: "
                                  f"{sum(recent) / len(recent):.4f})", highlight=False)
    seconds = time.perf_counter() - start

    held_after = held_out()
    state = engine.state_dict()  # a collective in stage mode
    result = Result(losses, held_before, held_after)
    say(f"train loss {losses[0]:.4f} at step 1, {result.final:.4f} over the last {min(20, len(losses))} steps "
        f"({args.steps} steps in {seconds:.1f} s, {seconds / max(args.steps, 1):.3f} s/step)", flush=True)
    say(f"held-out loss at end {held_after:.4f} (from {held_before:.4f})", flush=True)
    if rank == 0 and args.out:
        torch.save(state, args.out)
    if rank == 0 and args.sample_length > 0:
        forward: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        if args.hybrid and args.mode == "stage":
            # Only the last stage's process sees outputs: rank 0 samples from the plain model, rebuilt.
            plain = make_model(len(data.vocab), args)
            plain.load_state_dict(state)
            forward = plain.eval()
        else:
            forward = engine.eval()
        text = lm.generate(forward, data, args.prompt, args.sample_length, args.context, args.temperature,
                           args.seed)
        print(f"sample (temperature {args.temperature}):\n{text}", flush=True)
    engine.close()
    return result


if __name__ == "__main__":
    main()
