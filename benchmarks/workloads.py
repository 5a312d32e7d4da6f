"""The models the benchmarks time, in one registry, so that "the MLP" and "resnet50" mean the same model, input,
target and loss in every table; each script's defaults for each (batch, rounds, warm-up)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from benchmarks.common import LossFn, at_least
from pipeddp.tools.models import language_model, mlp, resnet


def tokens(n: int) -> torch.Tensor:
    """``n`` sequences of 64 random tokens of a 16384-token vocabulary (the ``lm`` workload's inputs and targets)."""
    return torch.randint(0, 16384, (n, 64))


def token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every token's logits against its target (batch x tokens x vocabulary)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


@dataclass(frozen=True)
class Workload:
    """A model, how to make a batch for it, and its loss; ``batch`` and ``rounds``: each script's defaults (by
    the script's name), chosen so that a full run fits its time in README.md; ``block``: consecutive steps per
    timed reading (default 1), for steps so short that what one step leaves to the next (a rank still finishing
    while its peer starts) is part of their cost, as in a training loop."""

    name: str
    model_text: str
    build: Callable[[], nn.Sequential]
    inputs: Callable[[int, Optional[int]], torch.Tensor]
    targets: Callable[[int], torch.Tensor]
    loss_fn: LossFn
    loss_text: str
    batch: Dict[str, int] = field(default_factory=dict)
    rounds: Dict[str, int] = field(default_factory=dict)
    warmup: int = 0
    block: Dict[str, int] = field(default_factory=dict)

    def seeded(self, n: int, seed: int, side: Optional[int] = None) -> Tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
        """Model (train mode), x and y of ``n`` samples (``side``: image side), drawn in this order after
        ``torch.manual_seed(seed)``: every rank of a job, and every run of a script, builds the same."""
        torch.manual_seed(seed)
        model = self.build().train()
        return model, self.inputs(n, side), self.targets(n)

    def describe(self, n: int, side: Optional[int] = None) -> str:
        shape = "" if side is None or "MLP" in self.model_text else f", 3x{side}x{side}"
        return f"{self.model_text}{shape}, batch {n}, {self.loss_text}"

    def rounds_of(self, script: str, args: argparse.Namespace, quick_rounds: int = 1) -> Tuple[int, int]:
        """``(rounds, warmup)`` for this model: the flags where given, else its defaults (--quick: no warm-up)."""
        rounds = args.rounds if args.rounds is not None else quick_rounds if args.quick else self.rounds[script]
        warmup = getattr(args, "warmup", None)
        return rounds, warmup if warmup is not None else (0 if args.quick else self.warmup)


def mlp_workload(layers: int = 16, width: int = 1024, **defaults: object) -> Workload:
    """``layers`` x (Linear(width, width) + ReLU), MSE against random targets."""
    return Workload(f"mlp{'' if (layers, width) == (16, 1024) else f'-{layers}x{width}'}",
                    f"MLP {layers} x (Linear({width},{width})+ReLU)", lambda: mlp(layers, width, width, width),
                    lambda n, side=None: torch.randn(n, width), lambda n: torch.randn(n, width),
                    nn.functional.mse_loss, "MSE vs random targets", **defaults)  # type: ignore[arg-type]


def resnet_workload(name: str, layers: int, **defaults: object) -> Workload:
    """A torchvision ResNet flattened to ``layers`` children, 3x64x64 images (or ``side``), 1000 random labels."""
    return Workload(name, f"{name} (flattened, {layers} layers)", lambda: resnet(name),
                    lambda n, side=None: torch.randn(n, 3, side or 64, side or 64),
                    lambda n: torch.randint(0, 1000, (n,)), nn.functional.cross_entropy,
                    "cross-entropy vs random labels (1000 classes)", **defaults)  # type: ignore[arg-type]


WORKLOADS: Dict[str, Workload] = {
    # ~0.3-0.9 s per step at 1 thread: cheap, so many rounds for a tight median.
    "mlp": mlp_workload(
        batch={"pipeline_cpu": 256, "hybrid_cpu": 256, "split_sizes": 240, "partition_quality": 64,
               "iteration_table": 128, "simulator_accuracy": 256, "schedules": 256},
        rounds={"pipeline_cpu": 10, "hybrid_cpu": 8, "split_sizes": 12, "partition_quality": 25,
                "iteration_table": 8, "simulator_accuracy": 12, "schedules": 8},
        warmup=1),
    # ~2-6 s per step at batch 64, ~11 s at 120: few rounds; the check step before timing warms it up.
    "resnet50": resnet_workload(
        "resnet50", 23,
        batch={"pipeline_cpu": 64, "hybrid_cpu": 64, "split_sizes": 120, "partition_quality": 32,
               "iteration_table": 128, "schedules": 64},
        rounds={"pipeline_cpu": 4, "hybrid_cpu": 4, "split_sizes": 5, "partition_quality": 8, "iteration_table": 8,
                "schedules": 4}),
    # a model too small to hide anything: the engine's fixed costs per step and per action, against torch's
    "tiny": mlp_workload(8, 64, batch={"schedules": 32}, rounds={"schedules": 20}, warmup=3, block={"schedules": 10}),
    # a language model whose head weighs as much as five blocks: where a measured cut beats equal layers per stage;
    # in blocks of consecutive steps, as its single steps between barriers made 1F1B look 7% slower than it runs
    "lm": Workload("lm", "LM Embedding(16384,256) + 8 x TransformerEncoderLayer(256, 4 heads, 1024) + LayerNorm + "
                   "Linear(256,16384), 64 tokens", language_model, lambda n, side=None: tokens(n),
                   lambda n: tokens(n), token_loss, "cross-entropy per token (16384 classes)",
                   batch={"schedules": 16}, rounds={"schedules": 4}, warmup=1, block={"schedules": 3}),
    "resnet18": resnet_workload(
        "resnet18", 15, batch={"partition_quality": 32, "iteration_table": 128},
        rounds={"partition_quality": 11, "iteration_table": 8}),
}


def names(script: str) -> List[str]:
    """The workloads a script has defaults for, in registry order (its ``--models`` choices)."""
    return [k for k, w in WORKLOADS.items() if script in w.batch]


def add_round_flags(p: argparse.ArgumentParser, script: str, what: str = "timed rounds per (model, m)",
                    warmup: bool = True, quick_rounds: int = 1) -> None:
    """--rounds (>= 1) and --warmup (>= 0), their help naming each model's default."""
    choices = names(script)
    per_model = ", ".join(f"{k} {WORKLOADS[k].rounds[script]}" for k in choices)
    p.add_argument("--rounds", type=at_least(1), default=None,
                   help=f"{what}; default per model: {per_model}; {quick_rounds} with --quick")
    if warmup:
        p.add_argument("--warmup", type=at_least(0), default=None, help="untimed rounds before them; default per "
                       "model: " + ", ".join(f"{k} {WORKLOADS[k].warmup}" for k in choices) + "; 0 with --quick")
