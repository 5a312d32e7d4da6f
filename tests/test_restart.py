"""A torchrun job killed mid-step restarts, resumes and ends exactly like an uninterrupted one.

torchrun's agent restarts it (its arguments, rendezvous, store and restart
count), with the job's ``main`` as the entry point so that the workers fork
from a forkserver that imported torch once (``resilient_job.torchrun``).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import resilient_job
import torch

import pipeddp

JOB = Path(__file__).resolve().parent / "resilient_job.py"


def torchrun(tmp_path, name, kill_at, steps=9):
    directory, out = tmp_path / f"{name}-ckpt", tmp_path / f"{name}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(JOB), "--standalone", "--nproc_per_node=4", "--max-restarts=1", "--",
         str(directory), str(steps), str(kill_at), str(out)],
        env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out), proc.stdout + proc.stderr


@pytest.mark.timeout(600)
def test_killed_worker_restarts_and_resumes_exactly(tmp_path):
    # the uninterrupted job, the reference, in processes spawned alike (the model's dropout draws per stage)
    pipeddp.spawn(resilient_job.main, 4, args=([str(tmp_path / "clean-ckpt"), "9", "0", str(tmp_path / "clean.pt")],))
    clean = torch.load(tmp_path / "clean.pt")
    resumed, log = torchrun(tmp_path, "killed", kill_at=7)
    assert "attempt 0: starting at step 0" in log
    assert "attempt 1: starting at step 6" in log  # the newest complete checkpoint before step 7
    assert list(resumed) == list(clean)
    for k in clean:
        assert torch.equal(resumed[k], clean[k]), k
