"""Train a small GPT-style character language model as a pipeline, alone or as replicas x stages.

    python examples/train_lm.py                                            # Pipeline, 2 stages on one process
    python examples/train_lm.py --hybrid                                   # HybridParallel, 1 replica x 2 stages
    torchrun --nproc_per_node=2 examples/train_lm.py --hybrid              # 2 replicas x 2 stages (threads)
    torchrun --nproc_per_node=2 examples/train_lm.py --hybrid --mode stage # 1 replica, one process per stage

The model is an ``nn.Sequential``: token embedding + learned positions, N pre-norm
transformer blocks (causal ``nn.MultiheadAttention``, MLP, dropout), a final
LayerNorm and an output head whose weight *is* the embedding's weight. The tie
spans the first and the last stage (two processes in stage mode); pipeddp keeps
the two copies one weight, so the result is the plain model's, and the saved
state dict has the plain model's keys.

The text is the one that ships with the project (README.md and pipeddp/**/*.py,
found next to this file, so any working directory works), split 90/10 into
training and held-out characters (``--text FILE ...`` trains on other files, or on
a copy that does not change while the project does). Each step every replica
draws ``--batch`` random windows of ``--context`` characters (targets shifted by
one) from a generator of its own, seeded by ``--seed`` and the replica index
(``replica_generator``), rather than through ``pipeddp.data.loader``: a window may
start at any character, so there is no fixed list of samples to shard. Replicas
see different windows, the processes of one replica (stage mode) the same ones,
and a run is reproducible. The global batch is ``--batch`` x replicas. The
held-out loss is measured on fixed, evenly spaced windows.

Defaults: 4 blocks, d_model 128, 4 heads, context 64, dropout 0.1 (813,824 parameters
with the tied weight counted once), batch 32 in 4 micro-batches, 2 stages cut by measured
time, AdamW (lr 3e-3, betas 0.9/0.99, weight decay 0.01), 600 steps. Measured on 2 CPU
cores (AMD EPYC, one intra-op thread per stage) with the text as it was then (333,711
characters, a vocabulary of 96: ln 96 = 4.56), ``python examples/train_lm.py``::

    step               1     100     200     300     400     500     600
    training loss   4.53    3.18    2.73    2.52    2.32    2.16    2.00   (mean of the 100 steps up to there)
    held-out loss   4.52 at the start, 1.95 at the end
    600 steps in 149 and 157 s in two runs (0.25-0.26 s/step), 158 and 166 s in all

and then, at temperature 0.8 from the prompt "def ", a sample that has learnt Python's
shape but not its words::

    def in wor ith on fone Falld None)
                   ef x.ale = treepocess import in iself.stepoing(stage=ind) -> intstage: ...
              rainel, stage: Optional[int] -> None:
                      return stages stain

The same defaults take 0.25 s/step with ``--hybrid --mode stage`` under torchrun (one process
per stage) and 0.40 s/step for 2 replicas x 2 stages (a global batch of 64, four stage
threads on two cores). The text grows as the project does, so numbers drift a little.

Only rank 0 prints: every ``--log-every`` steps the loss, and the step's time, samples/s and
each stage's idle share from ``engine.last_step``. ``--out PATH`` writes the final consolidated
state dict.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import pipeddp

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float32": torch.float32, "float64": torch.float64}


# -- data ------------------------------------------------------------------------------------------


def corpus_files(root: Path = ROOT) -> List[Path]:
    """README.md and the package's sources, in a fixed order (the text must be the same on every rank)."""
    return [root / "README.md"] + sorted((root / "pipeddp").rglob("*.py"))


class CharData(NamedTuple):
    """The text as indices into a character vocabulary, split into training and held-out parts."""

    vocab: str
    train: torch.Tensor  # int64 indices
    held: torch.Tensor

    def encode(self, s: str) -> torch.Tensor:
        index = {c: i for i, c in enumerate(self.vocab)}
        return torch.tensor([index[c] for c in s], dtype=torch.long)

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.vocab[i] for i in ids)


def load_text(files: Optional[Sequence[Path]] = None, held_fraction: float = 0.1) -> CharData:
    """Read the files, build the vocabulary of their characters, and split at 90% (the tail is held out)."""
    text = "".join(p.read_text(encoding="utf-8") for p in (files or corpus_files()))
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    cut = int(len(ids) * (1 - held_fraction))
    return CharData(vocab, ids[:cut], ids[cut:])


def windows(ids: torch.Tensor, starts: torch.Tensor, context: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``ids[s : s+context]`` and targets shifted by one, one row per start."""
    offsets = torch.arange(context + 1)
    rows = ids[starts[:, None] + offsets]
    return rows[:, :-1], rows[:, 1:]


def replica_generator(seed: int, replica: int) -> torch.Generator:
    """The window generator of one replica: its own stream, the same in every process of that replica."""
    return torch.Generator().manual_seed(seed * 1000 + replica)


def sample_batch(ids: torch.Tensor, batch: int, context: int,
                 generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows at random starts (uniform over every full window)."""
    starts = torch.randint(0, len(ids) - context, (batch,), generator=generator)
    return windows(ids, starts, context)


def held_out_set(ids: torch.Tensor, context: int, count: int) -> TensorDataset:
    """``count`` evenly spaced windows over the held-out text (fixed, so losses compare across runs)."""
    last = len(ids) - context - 1
    count = max(1, min(count, last + 1))
    starts = torch.tensor([i * last // max(count - 1, 1) for i in range(count)], dtype=torch.long)
    return TensorDataset(*windows(ids, starts, context))


# -- model -----------------------------------------------------------------------------------------


class Embed(nn.Module):
    """Token embedding plus learned positions: one layer, so the embedding weight can be tied to the head."""

    def __init__(self, vocab: int, d: int, context: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(context, d))
        self.drop = nn.Dropout(dropout)
        # Small weights (GPT-2's 0.02): the tied head then starts near uniform logits, loss ln(vocab).
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tok(idx) + self.pos[: idx.shape[1]])


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)) under a causal mask, then x + mlp(ln(x))."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        # Built per call: generation feeds shorter sequences than training, and a buffer would enter the state dict.
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False, is_causal=True)
        x = x + self.drop(a)
        return x + self.drop(self.mlp(self.ln2(x)))


def make_model(vocab: int, args: argparse.Namespace) -> nn.Sequential:
    """Embed, ``--layers`` blocks, LayerNorm, head; the head's weight is the embedding's (seeded by ``--seed``)."""
    torch.manual_seed(args.seed)
    embed = Embed(vocab, args.d_model, args.context, args.dropout)
    blocks = [Block(args.d_model, args.heads, args.dropout) for _ in range(args.layers)]
    head = nn.Linear(args.d_model, vocab, bias=False)
    model = nn.Sequential(embed, *blocks, nn.LayerNorm(args.d_model), head).to(DTYPES[args.dtype])
    head.weight = embed.tok.weight  # tied after the dtype conversion, so it is one Parameter whatever .to does
    return model


def build(args: argparse.Namespace) -> Tuple[nn.Sequential, CharData]:
    """The model (the same initial weights on every rank) and the text."""
    data = load_text([Path(p) for p in args.text] if args.text else None)
    return make_model(len(data.vocab), args), data


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of the micro-batch: (batch*time, vocab) logits."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@torch.no_grad()
def pipeline_held_out(engine: pipeddp.Pipeline, held_set: TensorDataset, batch: int) -> float:
    """Mean loss of a ``Pipeline`` over the held-out windows, in batches of ``batch`` (evaluation mode)."""
    engine.eval()
    total = 0.0
    for i in range(0, len(held_set), batch):
        x, y = held_set[i:i + batch]
        out = engine(x)
        total += loss_fn(out, y.to(out.device)).item() * len(x)
    engine.train()
    return total / len(held_set)


def make_optimizer(params: Iterable[nn.Parameter], args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; the same for the pipeline, the engine and a plain reference (each tied copy is updated alike)."""
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)


# -- generation ------------------------------------------------------------------------------------


@torch.no_grad()
def generate(forward: Callable[[torch.Tensor], torch.Tensor], data: CharData, prompt: str, length: int,
             context: int, temperature: float, seed: int) -> str:
    """Sample ``length`` characters after ``prompt``, feeding the last ``context`` characters each time.

    ``forward`` maps (1, t) indices to (1, t, vocab) logits: the pipeline, the engine or the plain model,
    in eval mode. Temperature 0 is greedy; otherwise a seeded generator makes the sample reproducible.
    """
    g = torch.Generator().manual_seed(seed)
    ids = data.encode(prompt)[None]
    for _ in range(length):
        logits = forward(ids[:, -context:])[0, -1].double().cpu()
        if temperature <= 0:
            nxt = logits.argmax().view(1, 1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=g).view(1, 1)
        ids = torch.cat([ids, nxt], dim=1)
    return data.decode(ids[0].tolist())


# -- training --------------------------------------------------------------------------------------


class Losses(NamedTuple):
    """What ``main`` returns: the first and last training losses and the held-out loss before and after."""

    first: float         # training loss of the first step
    final: float         # mean training loss of the last ``--average`` steps (one step is noisy)
    held_before: float
    held_after: float


def balance_arg(text: str) -> Union[str, List[int]]:
    """``--balance``: a method name, or layers per stage as comma-separated numbers (``3,4``)."""
    if text in ("time", "params", "memory", "uniform"):
        return text
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither time, params, memory, uniform nor a list like 3,4") \
            from None


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` keeps the docstring's layout and ends every flag's help with its default."""


def parse(argv: Any = None, description: Optional[str] = None) -> argparse.Namespace:
    """The command line (``argv=None``: ``sys.argv``); the test parses the same flags to build its reference.

    ``description``: the help text's head (default: this file's docstring); ``train_transformer.py`` takes
    the same flags with its own.
    """
    p = argparse.ArgumentParser(description=description or __doc__, formatter_class=HelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--batch", type=int, default=32, help="windows per replica per step (the global batch is "
                   "this times the number of replicas)")
    p.add_argument("--context", type=int, default=64, help="characters per window (and the longest sequence)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=128, help="width of the embeddings and of every block")
    p.add_argument("--heads", type=int, default=4, help="attention heads per block")
    p.add_argument("--dropout", type=float, default=0.1, help="attention, residual and embedding dropout")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    p.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm to this each step "
                   "(engine.clip_grad_norm_, the plain model's norm; 0: no clipping)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (devices, or processes in stage mode)")
    p.add_argument("--balance", type=balance_arg, default="time",
                   help="how to cut the model: time (measured on a batch), params, uniform, or layers per stage "
                   "such as 3,4 (measured cuts can differ between runs, and with them which stage draws which "
                   "dropout numbers)")
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
    p.add_argument("--checkpoint", choices=["never", "except_last", "always"], default="never",
                   help="recompute activations in backward (dropout replays the same numbers)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per stage")
    p.add_argument("--seed", type=int, default=0, help="initial weights, windows, and the generated sample")
    p.add_argument("--hybrid", action="store_true", help="train with HybridParallel (torchrun or alone) "
                   "instead of Pipeline")
    p.add_argument("--mode", choices=["replica", "stage"], default="replica", help="HybridParallel's mode")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the model's parameters' dtype")
    p.add_argument("--text", nargs="+", default=None, metavar="FILE",
                   help="train on these files instead of the project's README.md and pipeddp/**/*.py (which "
                   "change as the project does: a copy pins the data)")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out windows")
    p.add_argument("--average", type=int, default=20, help="final training loss: mean of this many last steps")
    p.add_argument("--log-every", type=int, default=100, help="print the loss every this many steps (0: never)")
    p.add_argument("--prompt", default="def ", help="the text the generated sample starts from")
    p.add_argument("--sample-length", type=int, default=300, help="characters to generate (0: none)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    p.add_argument("--out", default=None, help="write the final consolidated state dict here")
    return p.parse_args(argv)


def pipeline_devices(stages: int) -> List[str]:
    """One device per stage: the GPUs in turn where there are any, else the CPU (a thread per stage)."""
    n = torch.cuda.device_count()
    return [f"cuda:{s % n}" for s in range(stages)] if n else ["cpu"] * stages


def progress_bar(enabled: bool) -> Progress:
    """Steps done, the last step's loss and the time left; ``enabled`` on rank 0 only, so one bar is drawn."""
    return Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    disable=not enabled)


def main(argv: Any = None) -> Losses:
    """Train, evaluate before and after, write ``--out``, print a sample (rank 0); returns the losses.

    The same code drives ``Pipeline`` and ``HybridParallel``: both take ``train_step(x, y, loss_fn)``
    and give ``state_dict()`` with the plain model's keys. What differs is evaluation (``evaluate``
    collects the loss from every replica) and, in stage mode, where outputs appear.
    """
    args = parse(argv)
    model, data = build(args)
    held_set = held_out_set(data.held, args.context, args.eval_windows)
    x_sample, _ = sample_batch(data.train, args.batch, args.context, torch.Generator().manual_seed(args.seed))
    # Counted before wrapping: the engine gives the head a copy of the tied weight (one per stage that uses it).
    n_params = sum(p.numel() for p in model.parameters())

    if args.hybrid:
        if args.mode == "stage":
            torch.set_num_threads(args.threads)  # one stage per process
        engine: Union[pipeddp.Pipeline, pipeddp.HybridParallel] = pipeddp.HybridParallel(
            model, stages=args.stages, mode=args.mode, chunks=args.chunks, sample=x_sample, balance=args.balance,
            checkpoint=args.checkpoint, threads=args.threads, devices="auto",  # the CPU where GPUs are too few
            log_every=args.log_every)  # idle shares are timed on the steps it would log, the ones printed here
        topo = engine.topology
        rank, replica, replicas = topo.rank, topo.replica, topo.replicas
        held_loader = pipeddp.data.loader(held_set, args.batch, engine=engine, train=False)

        def held_out() -> float:
            return engine.evaluate(held_loader, lambda out, y: {"loss": loss_fn(out, y)})["loss"]
        where = f"HybridParallel, mode={args.mode}, {replicas} replica(s) x {args.stages} stages, " \
                f"devices {[str(d) for d in engine.devices]}"
    else:
        engine = pipeddp.Pipeline(model, pipeline_devices(args.stages), chunks=args.chunks, sample=x_sample,
                                  balance=args.balance, checkpoint=args.checkpoint, threads=args.threads,
                                  log_every=args.log_every)
        rank, replica, replicas = 0, 0, 1

        def held_out() -> float:
            return pipeline_held_out(engine, held_set, args.batch)
        where = f"Pipeline, {args.stages} stages on {[str(d) for d in engine.devices]}"

    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{where}, balance {engine.balance}", flush=True)
    say(f"text {len(data.train) + len(data.held):,} characters, vocabulary {len(data.vocab)} "
        f"(ln {math.log(len(data.vocab)):.2f}), model {n_params:,} parameters, {args.dtype}", flush=True)
    held_before = held_out()
    say(f"held-out loss at start {held_before:.4f} ({len(held_set)} windows)", flush=True)

    optimizer = make_optimizer(engine.parameters(), args)
    g = replica_generator(args.seed, replica)
    losses: List[float] = []
    start = time.perf_counter()
    with progress_bar(rank == 0) as bar:
        task = bar.add_task("train", total=args.steps, loss=float("nan"))
        for _ in range(args.steps):
            x, y = sample_batch(data.train, args.batch, args.context, g)
            optimizer.zero_grad()
            losses.append(engine.train_step(x, y, loss_fn).item())
            if args.clip > 0:  # the tied head counted once, every stage's gradients in (a collective in stage mode)
                engine.clip_grad_norm_(args.clip)
            optimizer.step()
            bar.update(task, advance=1, loss=losses[-1])
            step = len(losses)
            if rank == 0 and args.log_every and (step % args.log_every == 0 or step == 1):
                recent = losses[-args.log_every:]
                figures = engine.last_step  # the step's time, samples/s, idle shares (what pipeddp.watch logs)
                idle = " ".join(f"{v:.0%}" for v in figures.idle.values() if v is not None) if figures else ""
                speed = f"  {figures.seconds:.3f} s, {figures.samples_per_s:.0f} samples/s" if figures else ""
                bar.console.print(f"step {step:5d}  loss {losses[-1]:.4f}  (mean of the last {len(recent)}: "
                                  f"{sum(recent) / len(recent):.4f}){speed}{', idle ' + idle if idle else ''}",
                                  highlight=False, soft_wrap=True)
    seconds = time.perf_counter() - start

    held_after = held_out()
    state = engine.state_dict()  # the plain model's keys; a collective in stage mode
    tail = losses[-args.average:]
    result = Losses(losses[0], sum(tail) / len(tail), held_before, held_after)
    say(f"train loss {result.first:.4f} at step 1, {result.final:.4f} over the last {len(tail)} steps "
        f"({args.steps} steps in {seconds:.1f} s, {seconds / args.steps:.3f} s/step)", flush=True)
    say(f"held-out loss at end {held_after:.4f} (from {held_before:.4f})", flush=True)
    if rank == 0 and args.out:
        torch.save(state, args.out)

    if rank == 0 and args.sample_length > 0:
        if args.hybrid and args.mode == "stage":
            # Only the last stage's process sees outputs: rank 0 generates on the plain model, rebuilt.
            plain = make_model(len(data.vocab), args)
            plain.load_state_dict(state)
            plain.eval()
            forward: Callable[[torch.Tensor], torch.Tensor] = plain
        else:
            engine.eval()
            forward = engine
        text = generate(forward, data, args.prompt, args.sample_length, args.context, args.temperature, args.seed)
        print(f"sample (temperature {args.temperature}):\n{text}", flush=True)
    engine.close()
    return result


if __name__ == "__main__":
    main()
