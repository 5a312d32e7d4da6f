"""``pipeddp demo``: train a small model plainly and as a 2-stage pipeline, and compare.

The data is synthetic and generated from a fixed seed (nothing to download):
inputs are Gaussian and targets come from a fixed random "teacher" network,
so the loss really goes down. Both runs start from the same weights and see
the same batches; the steps are interleaved (plain, pipeline, plain, ...) so
that a drift in the machine's speed hits both alike.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from typing import Dict, List, Optional

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from torch import nn

from ..pipeline import Pipeline
from .models import mlp

__all__ = ["run_demo", "synthetic_regression"]


def synthetic_regression(n: int, features: int, outputs: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A fixed regression task: ``y = teacher(x)`` for a random 2-layer teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w1 = torch.randn(features, 256, generator=g) / features**0.5
    w2 = torch.randn(256, outputs, generator=g) / 16
    y = torch.tanh(x @ w1) @ w2
    return {"x": x, "y": y}


def _batches(data: Dict[str, torch.Tensor], batch: int, steps: int) -> List[tuple]:
    n = data["x"].shape[0] // batch
    return [(data["x"][(i % n) * batch:(i % n + 1) * batch], data["y"][(i % n) * batch:(i % n + 1) * batch])
            for i in range(steps)]


def _hybrid_job(model: nn.Sequential, batches: List[tuple], stages: int, chunks: int, schedule: str,
                mode: str) -> Dict[str, object]:
    """Runs in every spawned process: train on this replica's slice of each global batch."""
    from ..hybrid import HybridParallel

    # the demo compares CPU runs (a GPU machine runs it the same): every stage on the CPU, over gloo
    engine = HybridParallel(model, stages=stages, chunks=chunks, schedule=schedule, mode=mode, balance="params",
                            threads=1, devices=["cpu"] * (stages if mode == "replica" else 1))
    opt = torch.optim.SGD(engine.parameters(), lr=0.05)
    replicas, r = engine.topology.replicas, engine.topology.replica
    times, loss = [], 0.0
    for x, y in batches:
        local = x.shape[0] // replicas
        xs, ys = x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]
        start = time.perf_counter()
        opt.zero_grad()
        loss = engine.train_step(xs, ys, nn.functional.mse_loss).item()
        opt.step()
        times.append(time.perf_counter() - start)
    state = engine.state_dict()
    engine.close()
    return {"times": times, "loss": loss, "state": state, "balance": engine.balance}


def run_demo(
    *,
    steps: int = 30,
    batch: int = 256,
    chunks: int = 8,
    layers: int = 8,
    width: int = 512,
    schedule: str = "1f1b",
    replicas: int = 2,
    stages: int = 2,
    mode: str = "replica",
    console: Optional[Console] = None,
) -> Dict[str, Dict[str, float]]:
    """Train the plain model, a 1 x ``stages`` pipeline and (if ``replicas`` > 1) a spawned
    ``replicas`` x ``stages`` hybrid job on CPU from the same weights and data; print the comparison.

    ``batch`` is the global batch; each replica takes ``batch / replicas`` of it.
    """
    console = console or Console()
    if replicas < 1 or stages < 1 or batch % replicas:
        raise ValueError("--replicas and --stages must be >= 1 and --batch divisible by --replicas")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = mlp(layers=layers, width=width, in_features=width, out_features=width)
        batches = _batches(synthetic_regression(batch * 4, width, width), batch, steps)
        init = copy.deepcopy(model)
        plain = copy.deepcopy(model)
        pipe = Pipeline(copy.deepcopy(model), ["cpu"] * stages, chunks=chunks, sample=batches[0][0],
                        schedule=schedule, threads=1)
        opt_plain = torch.optim.SGD(plain.parameters(), lr=0.05)
        opt_pipe = torch.optim.SGD(pipe.parameters(), lr=0.05)
        loss_fn = nn.functional.mse_loss
        t_plain: List[float] = []
        t_pipe: List[float] = []
        losses = [0.0, 0.0]
        with pipe, Progress(console=console, transient=True) as progress:
            task = progress.add_task(f"plain vs 1 x {stages} pipeline (interleaved steps)", total=steps)
            for x, y in batches:
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
                losses = [lp.item(), lq.item()]
                progress.advance(task)
            pipe_diff = _max_diff(plain, pipe.state_dict())
            balance = pipe.balance
        rows: Dict[str, Dict[str, float]] = {
            "plain": {"ms": _median_ms(t_plain), "speedup": 1.0, "loss": losses[0], "diff": 0.0},
            f"pipeline 1 x {stages} {balance}": {"ms": _median_ms(t_pipe), "loss": losses[1], "diff": pipe_diff,
                                                  "speedup": _median_ms(t_plain) / _median_ms(t_pipe)},
        }
        if replicas > 1:
            from ..distributed.launch import spawn

            nprocs = replicas if mode == "replica" else replicas * stages
            with console.status(f"running {replicas} x {stages} hybrid job ({nprocs} processes, mode={mode}) ..."):
                results = spawn(_hybrid_job, nprocs, args=(init, batches, stages, chunks, schedule, mode),
                                timeout=600)
            res = results[0]
            times = res["times"]
            rows[f"hybrid {replicas} x {stages} ({mode}) {res['balance']}"] = {
                "ms": _median_ms(times), "loss": res["loss"], "diff": _max_diff(plain, res["state"]),
                "speedup": _median_ms(t_plain) / _median_ms(times),
            }
        table = Table(title=f"pipeddp demo: MLP {layers}x{width}, global batch {batch}, {chunks} micro-batches, "
                            f"{schedule}, CPU, 1 thread per stage, {steps} steps",
                      caption="against plain: the plain model's step ms over the row's, as the column shows them "
                              "(medians); the pipeline's steps run interleaved with the plain model's, the hybrid "
                              "job afterwards")
        for col in ("run", "step ms", "against plain", "final loss", "max |w - w_plain|"):
            table.add_column(col, justify="right", overflow="fold")
        for name, row in rows.items():
            table.add_row(name, f"{row['ms']:.4g}", "baseline" if name == "plain" else _against_plain(row["speedup"]),
                          f"{row['loss']:.5f}",
                          f"{row['diff']:.1e}")
        console.print(table)
        console.print(_verdict(rows, stages))
        return rows
    finally:
        torch.set_num_threads(threads_before)


def _against_plain(speedup: float) -> str:
    if speedup >= 1.0:
        return f"{speedup:.2f}x faster"
    return f"{1 / speedup:.2f}x slower"


def _verdict(rows: Dict[str, Dict[str, float]], stages: int) -> str:
    """What the table says, in words: equal weights, and faster or slower and why."""
    diff = max(row["diff"] for row in rows.values())
    lines = [f"The trained weights equal the plain model's to {diff:.0e} (float32 rounding)."]
    slower = [name for name, row in rows.items() if row["speedup"] < 1.0]
    if slower:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        lines.append(
            f"Slower than the plain model here: {', '.join(slower)}. On CPU every stage and replica shares this "
            f"machine's {cores} core(s) (the plain model runs alone), a small micro-batch costs more per sample "
            "than the whole batch, the pipeline's fill and drain leave a core idle, and every step pays fixed costs "
            "(thread hand-offs; between processes, the gradient all-reduce) that weigh most on a small model. "
            "Pipelining pays where each "
            f"stage has a device of its own (GPUs) or the model does not fit one device; with {stages} stages and "
            "enough micro-batches the best it can do over one device is the bubble bound m*p/(m+p-1). "
            "benchmarks/ measures it against gradient accumulation over the same micro-batches.")
    else:
        lines.append("Faster than the plain model on every row.")
    return "\n".join(lines)


def _median_ms(times: List[float]) -> float:
    return statistics.median(times[2:] if len(times) > 4 else times) * 1e3


def _max_diff(plain: nn.Module, state: Dict[str, torch.Tensor]) -> float:
    ref = plain.state_dict()
    return max((ref[k].detach() - state[k].detach().cpu()).abs().max().item() for k in ref)
