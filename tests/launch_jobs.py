"""Functions for the spawn tests (importable by the children)."""

import os
import time

import torch

import nccl_rules

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)


def add_rank(t: torch.Tensor) -> torch.Tensor:
    rank = int(os.environ["RANK"])
    time.sleep(0.2 * (1 - rank))  # rank 1 writes first; rank 0 must not see it
    t.add_(rank + 1)
    return t


def env_of_child() -> dict:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: os.environ[k] for k in keys} | {"threads": torch.get_num_threads()}


def sleep_forever() -> None:
    time.sleep(3600)


def fail_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise KeyError("rank 1 broke")
    time.sleep(3600)


def join_group() -> dict:
    """Join the job's process group by torchrun's variables (rank 0 listens on MASTER_PORT), as a script would."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=30))
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, dist.get_rank())
    return {"ranks": ranks, "port": os.environ["MASTER_PORT"]}
