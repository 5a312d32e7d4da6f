"""A torchrun job with a fixed global batch that may stop at a step and be restarted with another replica count.

    torchrun --standalone --nproc_per_node=R tests/elastic_job.py DIR STEPS STOP_AT OUT FORMAT
    pipeddp.spawn(elastic_job.main, R, args=([DIR, STEPS, STOP_AT, OUT, FORMAT],))

Replica mode, one process per replica driving 2 stage threads. It resumes from
the newest checkpoint of DIR (model, optimizer and the data position), trains
until step STEPS with global_batch=8 (batch_size=2: 2 passes a step with 2
replicas, 4 with 1), saves a checkpoint (FORMAT: "file" or "sharded") every 2
steps, and at step STOP_AT (0: never) stops there, as a job that lost a host
would. OUT receives the final weights (rank 0) when it reaches STEPS. With 40
samples an epoch is 5 steps, so a run of 8 steps crosses an epoch's end.

With LOSE_HOST_AT=k in its environment (one host of a multi-host job), the
first attempt's worker there, after step k, SIGKILLs its torchrun agent and
itself: the host is gone, and the other hosts must go on without it. ELASTIC_JOB_SHARD sets ``shard=``.
"""

import os
import signal
import sys
from typing import List, Optional

import torch
from torch import nn

import pipeddp

import nccl_rules

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

GLOBAL_BATCH, BATCH_SIZE, SAMPLES, SEED = 8, 2, 40, 11


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).double()


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64),
                                          torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64))


def main(argv: Optional[List[str]] = None) -> Optional[str]:
    """The job (``argv`` as on the command line); rank 0 prints and returns the line that says where it starts."""
    argv = sys.argv[1:] if argv is None else argv
    directory, steps, stop_at, out, form = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4]
    torch.set_num_threads(1)
    engine = pipeddp.HybridParallel(model(), stages=2, chunks=2, devices=["cpu", "cpu"], threads=1, timeout=60,
                                    global_batch=GLOBAL_BATCH, batch_size=BATCH_SIZE,
                                    shard=os.environ.get("ELASTIC_JOB_SHARD", "none"))
    loader = pipeddp.data.loader(dataset(), engine=engine, seed=SEED)
    opt = torch.optim.SGD(engine.parameters(), lr=0.05, momentum=0.9)
    resumed = engine.resume(directory, opt)
    step = resumed["step"] if resumed else 0
    lose_at = int(os.environ.get("LOSE_HOST_AT", "0")) if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" else 0
    start = (f"replicas {engine.topology.replicas} accumulation {engine.accumulation}: starting at step {step}, "
             f"epoch {engine.position.epoch}, {engine.position.consumed} samples consumed")
    if engine.topology.rank == 0:
        print(start, flush=True)
    while step < steps and not (stop_at and step >= stop_at):
        loader.set_epoch(engine.position.epoch)
        for x, y in loader:
            if lose_at and step == lose_at:
                os.kill(os.getppid(), signal.SIGKILL)  # the agent first, so that nothing restarts this host
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            engine.train_step(x, y, nn.functional.mse_loss)
            opt.step()
            step += 1
            if step % 2 == 0 or step == stop_at:
                engine.save_checkpoint(directory, step, opt, keep=2, sharded=form == "sharded")
            if step in (steps, stop_at):
                break
    if step == steps:
        state = engine.state_dict()
        if engine.topology.rank == 0:
            torch.save(state, out)
    rank = engine.topology.rank
    engine.close()
    return start if rank == 0 else None


if __name__ == "__main__":
    main()
