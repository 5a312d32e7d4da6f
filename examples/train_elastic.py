"""Train an MLP with a fixed global batch, checkpointing, so that torchrun may restart it with fewer hosts.

    torchrun --standalone --nproc_per_node=2 examples/train_elastic.py --checkpoint-dir run   # 2 replicas
    # stopped (a host lost, a preemption)? the same command with other counts goes on where it stopped:
    torchrun --standalone --nproc_per_node=1 examples/train_elastic.py --checkpoint-dir run   # 1 replica

Across hosts, see examples/slurm/train.sbatch and the README's "Multi-node
jobs". Every optimizer step trains on --global-batch samples, whatever the
replica count: each replica takes global_batch / replicas of them, in passes of
--batch-size (gradients accumulate), so losing a host changes the speed, not
the training. The loader's place in the epoch is in every checkpoint, and a
restarted job resumes it: no sample is skipped or seen twice in the epoch.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from train_hybrid import build

import pipeddp


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` keeps the docstring's layout and ends every flag's help with its default."""


def parse(argv: Any = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--checkpoint-dir", required=True, help="on a file system every host sees")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages per replica")
    p.add_argument("--mode", choices=["replica", "stage"], default="replica", help="a process per replica or per stage")
    p.add_argument("--chunks", type=int, default=2, help="micro-batches per step")
    p.add_argument("--global-batch", type=int, default=48, help="samples per optimizer step, all replicas together "
                   "(pick one that every replica count the job may run with divides)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per pass of one replica (the memory knob)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--every", type=int, default=5, help="checkpoint every this many steps")
    p.add_argument("--sharded", action="store_true", help="sharded checkpoints (every process writes its share)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a rank waits for a peer before failing")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate")
    p.add_argument("--width", type=int, default=32, help="hidden width of the model")
    p.add_argument("--layers", type=int, default=3, help="layers (blocks) of the model")
    p.add_argument("--samples", type=int, default=480, help="training samples")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--out", default=None, help="write the final consolidated state dict here")
    return p.parse_args(argv)


def main(argv: Any = None) -> None:
    args = parse(argv)
    model, train_set, _ = build(args)
    engine = pipeddp.HybridParallel(model, stages=args.stages, mode=args.mode, chunks=args.chunks, balance="params",
                                    devices="auto", timeout=args.timeout, global_batch=args.global_batch,
                                    batch_size=args.batch_size)
    loader = pipeddp.data.loader(train_set, engine=engine, seed=args.seed)  # batches of engine.replica_batch
    optimizer = torch.optim.SGD(engine.parameters(), lr=args.lr, momentum=0.9)
    resumed = engine.resume(args.checkpoint_dir, optimizer)  # model, optimizer and the loader's place
    step = resumed["step"] if resumed else 0
    rank = engine.topology.rank
    if rank == 0:
        print(f"{engine.topology.replicas} replica(s) x {args.stages} stage(s): {engine.accumulation} pass(es) of "
              f"{args.batch_size} per step; starting at step {step}, epoch {engine.position.epoch}, "
              f"{engine.position.consumed} samples of it consumed", flush=True)
    loss = float("nan")
    while step < args.steps:
        loader.set_epoch(engine.position.epoch)  # the epoch the job stands in (a resumed one goes on)
        for x, y in loader:
            optimizer.zero_grad()
            loss = engine.train_step(x, y, nn.functional.mse_loss).item()
            optimizer.step()
            step += 1
            if step % args.every == 0 or step == args.steps:
                engine.save_checkpoint(args.checkpoint_dir, step, optimizer, sharded=args.sharded)
            if rank == 0 and step % 10 == 0:
                print(f"step {step:4d}  loss {loss:.5f}", flush=True)
            if step == args.steps:
                break
    state = engine.state_dict()
    if rank == 0:
        print(f"done at step {step}, loss {loss:.5f}", flush=True)
        if args.out:
            torch.save(state, args.out)
    engine.close()


if __name__ == "__main__":
    main()
