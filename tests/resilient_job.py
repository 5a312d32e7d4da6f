"""A torchrun job that checkpoints every 2 steps and resumes from the newest checkpoint on (re)start.

    torchrun --nproc_per_node=4 --max-restarts=1 tests/resilient_job.py DIR STEPS KILL_AT OUT
    python tests/resilient_job.py --standalone --nproc_per_node=4 --max-restarts=1 -- DIR STEPS KILL_AT OUT

On the first attempt (TORCHELASTIC_RESTART_COUNT=0) rank 2 (replica 1, stage 0) SIGKILLs itself in the
middle of step KILL_AT (0: never). torchrun restarts the job; it resumes from the
newest checkpoint (model, optimizer, every rank's RNG, data position) and must end
exactly where an uninterrupted job ends. The model has dropout, so the RNG matters.

The second form is torchrun (its arguments, its agent, rendezvous and
restarts) with ``main`` as the entry point in place of this script: the
workers fork from a forkserver that imported torch and pipeddp once, where a
script's workers import them again in every process of every attempt (5-7 s
of CPU each).
"""

import os
import signal
import sys
import uuid
from typing import List

import torch
import torch.multiprocessing as mp
from torch import nn

import pipeddp

import nccl_rules

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)


class KillSwitch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x):
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)
        return x


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    directory, steps, kill_at, out = argv[0], int(argv[1]), int(argv[2]), argv[3]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    switch = KillSwitch()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), switch, nn.Linear(32, 32), nn.Tanh(),
                          nn.Dropout(0.1), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(96, 16, generator=g), torch.randn(96, 4, generator=g))
    engine = pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=3, balance=[4, 4])
    loader = pipeddp.data.loader(dataset, batch_size=6, engine=engine, seed=3, drop_last=True)
    per_epoch = len(loader)
    opt = torch.optim.Adam(engine.parameters(), lr=1e-2)
    resumed = pipeddp.resume(engine, directory, opt)
    step = resumed["step"] if resumed else 0
    if engine.topology.rank == 0:
        print(f"attempt {attempt}: starting at step {step}", flush=True)
    while step < steps:
        epoch, skip = divmod(step, per_epoch)
        loader.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if i < skip:
                continue  # the data position: batches this epoch already trained on
            switch.armed = attempt == 0 and engine.topology.rank == 2 and step + 1 == kill_at
            opt.zero_grad()
            engine.train_step(x, y, nn.functional.mse_loss)
            opt.step()
            step += 1
            if step % 2 == 0:
                engine.save_checkpoint(directory, step, opt, keep=2, extra={"epoch": epoch, "batch": i + 1})
            if step == steps:
                break
    state = engine.state_dict()
    if engine.topology.rank == 0:
        torch.save(state, out)
    engine.close()


def torchrun(argv: List[str]) -> None:
    """torchrun's own launch (as ``torch.distributed.run.run``) of ``main``, the workers forked (see above)."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    import resilient_job  # main by its module's name (this file runs as __main__ here), for the workers to import
    from pipeddp.distributed import launch

    cut = argv.index("--")
    args = parse_args([*argv[:cut], "--start-method=forkserver", __file__])
    if args.standalone:  # what torchrun's run() does with --standalone: a rendezvous on a free local port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = config_from_args(args)
    mp.get_context("forkserver").set_forkserver_preload(launch.PRELOAD)
    elastic_launch(config, entrypoint=resilient_job.main)(argv[cut + 1:])


if __name__ == "__main__":
    if "--" in sys.argv:
        torchrun(sys.argv[1:])
    else:
        main()
