"""A training loop that runs until it is interrupted (``tests/test_interrupt.py`` sends it Ctrl-C or SIGTERM).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/interrupt_job.py replica
    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/interrupt_job.py stage
    python tests/interrupt_job.py pipeline [--stall]

Every rank prints ``rank R step N`` after each step. ``--stall`` makes the
last stage's layer sleep a minute in the third step (printing ``rank R
stalling``), so that the first stage is blocked taking a gradient from a
channel (a thread's inbox, or a receive from the other process) when the
interrupt comes: neither may keep the process alive.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time

import torch
from torch import nn

import pipeddp

import nccl_rules

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)


def say(line: str) -> None:
    """One write per line: the ranks share torchrun's output, and print's two writes would interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Stall(nn.Module):
    """The identity, which sleeps ``seconds`` on its ``at``-th call (a stage stuck in a long computation)."""

    def __init__(self, at: int, seconds: float) -> None:
        super().__init__()
        self.calls, self.at, self.seconds = 0, at, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            say(f"rank {os.environ.get('RANK', '0')} stalling")
            time.sleep(self.seconds)
        return x


def main() -> None:
    faulthandler.register(signal.SIGUSR1)  # a test that finds a process still alive dumps its threads' stacks
    # Python keeps SIGINT ignored where it was started so (a background job of a non-interactive shell, as a CI
    # runner may start the suite): the Ctrl-C a user at a terminal sends must reach this loop wherever it runs
    signal.signal(signal.SIGINT, signal.default_int_handler)
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["replica", "stage", "pipeline"])
    p.add_argument("--stall", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width = 384
    layers: list = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.Tanh()]
    if args.stall:
        layers.append(Stall(at=2 * 2 + 1, seconds=60.0))  # chunks=2: its fifth call is in the third step
    model = nn.Sequential(*layers)
    if args.mode == "pipeline":
        engine: nn.Module = pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=2, balance=[4, len(layers) - 4])
    else:
        engine = pipeddp.HybridParallel(model, stages=2, mode=args.mode, chunks=2, balance=[4, len(layers) - 4],
                                        timeout=120.0)
    rank = int(os.environ.get("RANK", "0"))
    x, y = torch.randn(64, width), torch.randn(64, width)
    params = list(engine.parameters())
    for step in range(100000):
        for p in params:
            p.grad = None
        engine.train_step(x, y, nn.functional.mse_loss)  # type: ignore[operator]
        with torch.no_grad():  # SGD by hand: torch.optim's first optimizer imports torch._dynamo (3 s of CPU)
            for p in params:
                p -= 0.01 * p.grad
        say(f"rank {rank} step {step}")


if __name__ == "__main__":
    main()
