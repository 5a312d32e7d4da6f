"""Jobs that stop at a step and start again with another replica count, the global batch fixed.

The final weights must equal the plain model's trained on the same global
batches, as an uninterrupted run's do (float64, to a tolerance: the passes and
replica shares of a global batch sum in another order than one whole batch).
Each start is a new set of processes with the environment torchrun gives
(``pipeddp.spawn``: no agent importing torch, no worker importing it again);
the elastic example restarts under real torchrun.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import elastic_job as job
import pipeddp
from pipeddp.data import ElasticSampler
from pipeddp.distributed.elastic import DataPosition

STEPS = 8
pytestmark = pytest.mark.timeout(500)


def start(tmp_path: Path, directory: Path, nproc: int, stop_at: int, form: str, shard: str = "none") -> str:
    """One start of ``elastic_job`` on ``nproc`` processes; the line its rank 0 printed."""
    out = tmp_path / "final.pt"
    if out.exists():
        out.unlink()
    return pipeddp.spawn(job.main, nproc, args=([str(directory), str(STEPS), str(stop_at), str(out), form],),
                         env={"ELASTIC_JOB_SHARD": shard}, timeout=200)[0]


def plain_training() -> dict:
    """The plain model, one SGD step per global batch: the next 8 samples of each epoch's one permutation."""
    model, data = job.model(), job.dataset()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    order = ElasticSampler(data, 1, 0, job.GLOBAL_BATCH, position=DataPosition(), seed=job.SEED)
    per_epoch = job.SAMPLES // job.GLOBAL_BATCH
    for step in range(STEPS):
        epoch, k = divmod(step, per_epoch)
        idx = order.order(epoch)[k * job.GLOBAL_BATCH:(k + 1) * job.GLOBAL_BATCH]
        x, y = data[idx]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def close(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_two_replicas_to_one_and_one_to_two_train_as_the_uninterrupted_run(tmp_path):
    expected = plain_training()
    first = start(tmp_path, tmp_path / "down", 2, 3, "file")  # stops after step 3: mid-epoch
    assert "replicas 2 accumulation 2: starting at step 0" in first and not (tmp_path / "final.pt").exists()
    log = start(tmp_path, tmp_path / "down", 1, 0, "file")
    assert "replicas 1 accumulation 4: starting at step 3, epoch 0, 24 samples consumed" in log
    down = torch.load(tmp_path / "final.pt")
    assert close(down, expected) < 1e-10

    start(tmp_path, tmp_path / "up", 1, 5, "sharded")  # stops after the last step of epoch 0
    log = start(tmp_path, tmp_path / "up", 2, 0, "sharded")
    # the epoch's samples are all consumed: the loader finds it empty and goes on with epoch 1
    assert "replicas 2 accumulation 2: starting at step 5, epoch 0, 40 samples consumed" in log
    up = torch.load(tmp_path / "final.pt")
    assert close(up, expected) < 1e-10


def test_a_sharded_job_restarts_with_fewer_replicas_and_resumes_its_shards_exactly(tmp_path):
    """shard="optimizer": 4 replicas write their shards (DCP) mid-epoch; 2 replicas, sharded alike, go on."""
    expected = plain_training()
    start(tmp_path, tmp_path / "run", 4, 3, "sharded", shard="optimizer")
    log = start(tmp_path, tmp_path / "run", 2, 0, "sharded", shard="optimizer")
    assert "replicas 2 accumulation 2: starting at step 3, epoch 0, 24 samples consumed" in log
    assert close(torch.load(tmp_path / "final.pt"), expected) < 1e-10


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_elastic.py"


def example_reference(argv, steps: int) -> dict:
    """The example's model and data on one device: one step per global batch of each epoch's permutation."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from conftest import load_example

        ex = load_example(EXAMPLE)
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    args = ex.parse(argv)
    model, train_set, _ = ex.build(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    order = ElasticSampler(train_set, 1, 0, args.global_batch, position=DataPosition(), seed=args.seed)
    per_epoch = len(train_set) // args.global_batch
    for step in range(steps):
        epoch, k = divmod(step, per_epoch)
        x, y = train_set[order.order(epoch)[k * args.global_batch:(k + 1) * args.global_batch]]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def test_the_elastic_example_goes_on_with_fewer_replicas(tmp_path):
    argv = ["--checkpoint-dir", str(tmp_path / "run"), "--samples", "96", "--global-batch", "16", "--batch-size", "4",
            "--every", "3", "--out", str(tmp_path / "final.pt")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    logs = []
    for nproc, steps in ((2, 9), (1, 14)):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={nproc}", str(EXAMPLE), *argv, "--steps", str(steps)],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        logs.append(proc.stdout)
    assert "2 replica(s) x 2 stage(s): 2 pass(es) of 4 per step; starting at step 0" in logs[0]
    assert "1 replica(s) x 2 stage(s): 4 pass(es) of 4 per step; starting at step 9, epoch 1, 48 samples" in logs[1]
    got, expected = torch.load(tmp_path / "final.pt"), example_reference(argv, 14)
    assert close(got, expected) < 2e-5  # float32: the passes sum in another order than one whole batch
