"""``pipeddp demo``: train a small model plainly and as a 2-stage pipeline, and compare.

The data is synthetic and generated from a fixed seed (nothing to download):
inputs are Gaussian and targets come from a fixed random "teacher" network,
so the loss really goes down. Both runs start from the same weights and see
the same batches; the steps are interleaved (plain, pipeline, plain, ...) so
that a drift in the machine's speed hits both alike.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Dict, List

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch import nn

from .models import mlp
from .pipeline import Pipeline

__all__ = ["run_demo", "synthetic_regression"]


def synthetic_regression(n: int, features: int, outputs: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A fixed regression task: ``y = teacher(x)`` for a random 2-layer teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w1 = torch.randn(features, 256, generator=g) / features**0.5
    w2 = torch.randn(256, outputs, generator=g) / 16
    y = torch.tanh(x @ w1) @ w2
    return {"x": x, "y": y}


def run_demo(
    *,
    steps: int = 30,
    batch: int = 256,
    chunks: int = 8,
    layers: int = 8,
    width: int = 512,
    schedule: str = "1f1b",
    console: Console | None = None,
) -> Dict[str, float]:
    """Train plain vs pipeline on CPU (one intra-op thread each stage) and print the comparison."""
    console = console or Console()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = mlp(layers=layers, width=width, in_features=width, out_features=width)
        data = synthetic_regression(batch * 4, width, width)
        plain = copy.deepcopy(model)
        pipe = Pipeline(model, ["cpu", "cpu"], chunks=chunks, sample=data["x"][:batch], schedule=schedule, threads=1)
        opt_plain = torch.optim.SGD(plain.parameters(), lr=0.05)
        opt_pipe = torch.optim.SGD(pipe.parameters(), lr=0.05)
        loss_fn = nn.functional.mse_loss
        t_plain: List[float] = []
        t_pipe: List[float] = []
        losses = (0.0, 0.0)
        with pipe, Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"training plain vs {len(pipe.stages)}-stage pipeline", total=steps)
            for step in range(steps):
                lo = (step % 4) * batch
                x, y = data["x"][lo:lo + batch], data["y"][lo:lo + batch]
                start = time.perf_counter()
                opt_plain.zero_grad()
                lp = loss_fn(plain(x), y)
                lp.backward()
                opt_plain.step()
                t_plain.append(time.perf_counter() - start)
                start = time.perf_counter()
                opt_pipe.zero_grad()
                lq = pipe.train_step(x, y, loss_fn)
                opt_pipe.step()
                t_pipe.append(time.perf_counter() - start)
                losses = (lp.item(), lq.item())
                progress.advance(task)
            diff = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(plain.parameters(), pipe.parameters()))
            balance = pipe.balance
        warm = slice(2, None)
        plain_ms = statistics.median(t_plain[warm]) * 1e3
        pipe_ms = statistics.median(t_pipe[warm]) * 1e3
        ratios = [a / b for a, b in zip(t_plain[warm], t_pipe[warm])]
        speedup = statistics.median(ratios)
        table = Table(title=f"pipeddp demo: MLP {layers}x{width}, batch {batch}, {chunks} micro-batches, "
                            f"{schedule}, CPU, 1 thread per stage, {steps} steps")
        for col in ("run", "step time (ms)", "speedup", "final loss", "max |w - w_plain|"):
            table.add_column(col, justify="right")
        table.add_row("plain model (1 thread)", f"{plain_ms:.1f}", "1.00x", f"{losses[0]:.5f}", "0")
        table.add_row(f"pipeline 2 stages {balance}", f"{pipe_ms:.1f}", f"{speedup:.2f}x", f"{losses[1]:.5f}", f"{diff:.2e}")
        console.print(table)
        return {"plain_ms": plain_ms, "pipeline_ms": pipe_ms, "speedup": speedup, "max_weight_diff": diff,
                "loss_plain": losses[0], "loss_pipeline": losses[1]}
    finally:
        torch.set_num_threads(threads_before)
