"""A 2 x 2 stage-mode training job in which one rank dies or stalls mid-step (run as 4 plain processes).

    python tests/fault_job.py <victim rank> <kill|stall> <timeout seconds> [twins]

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (set by the test).
The victim stops itself while computing micro-batch 1 of step 2: SIGKILL
(died) or SIGSTOP (stalled). Everybody else must fail with an error naming
rank, stage and micro-batch within the timeout, and exit non-zero.

``twins``: as on an nccl job, the agreements and the activations' headers on
gloo twins of the groups; the tripwire sits in stage 0 and step 2's batch is
smaller, so the next stage waits for a header on the twin that never comes.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
from torch import nn

import pipeddp

import nccl_rules

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)


class Tripwire(nn.Module):
    def __init__(self, victim: bool, how: str) -> None:
        super().__init__()
        self.victim, self.how, self.step, self.calls = victim, how, 0, 0

    def forward(self, x):
        self.calls += 1
        if self.victim and self.step == 2 and self.calls == 2:
            print(f"rank {os.environ['RANK']}: {self.how} now", flush=True)
            os.kill(os.getpid(), signal.SIGKILL if self.how == "kill" else signal.SIGSTOP)
        return x


def main() -> None:
    victim, how, timeout = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    twins = sys.argv[4:] == ["twins"]
    if twins:
        nccl_rules.as_on_nccl()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    wire = Tripwire(rank == victim, how)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), wire, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    # the tripwire (layer 2) in stage 1, or with twins in stage 0
    engine = pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=4, balance=[3, 3] if twins else [2, 4],
                                    timeout=timedelta(seconds=timeout))
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    for step in range(6):
        wire.step, wire.calls = step, 0
        n = 6 if twins and step == 2 else 8
        x, y = torch.randn(n, 8), torch.randn(n, 8)
        opt.zero_grad()
        engine.train_step(x, y, nn.functional.mse_loss)
        opt.step()
        time.sleep(0.05)
    print(f"rank {rank}: finished", flush=True)


if __name__ == "__main__":
    main()
