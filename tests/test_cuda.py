"""CUDA: several stages on one GPU, GPU-to-CPU cuts (a tied weight across one too), autocast, dropout's masks under
every schedule and recompute policy, no device-to-host sync in a step, the stream sanitizer, and with two GPUs real
cross-device stages and nccl. The checks (``cuda_checks.py``) run in subprocesses that see the machine's GPUs (the
rest of the suite hides them, see conftest.py); on a machine without a GPU every test here is skipped."""

import functools
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GPU_ENV

CHECKS = Path(__file__).resolve().parent / "cuda_checks.py"


@functools.lru_cache(maxsize=None)
def gpus() -> int:
    """How many CUDA devices this machine has (asked in a subprocess that sees them)."""
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                          env=GPU_ENV, capture_output=True, text=True, timeout=120)
    return int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0


def run(*checks: str, sanitizer: bool = False) -> str:
    env = dict(GPU_ENV, OMP_NUM_THREADS="1")
    if sanitizer:
        env["TORCH_CUDA_SANITIZER"] = "1"
    proc = subprocess.run([sys.executable, str(CHECKS), *checks], env=env, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for check in checks:
        assert f"ok {check}" in proc.stdout
    return proc.stderr


def need(count: int) -> None:
    if gpus() < count:
        pytest.skip(f"needs {count} CUDA device(s); this machine has {gpus()}")


@pytest.mark.timeout(600)
def test_stages_on_one_gpu_and_cuts_to_the_cpu_equal_the_plain_model():
    need(1)
    run("one-gpu", "cut", "tied", "autocast", "dropout", "syncs")


@pytest.mark.timeout(600)
def test_the_stream_sanitizer_finds_no_unsynchronised_access():
    need(1)
    stderr = run("one-gpu", "cut", "tied", "dropout", sanitizer=True)
    assert "CSAN" not in stderr and "data race" not in stderr.lower(), stderr[-6000:]


@pytest.mark.timeout(600)
def test_two_gpus_and_nccl():
    need(2)
    run("two-gpus", "nccl")


def test_the_checks_themselves_on_the_cpu():
    """The checks' logic, with every CUDA device mapped to the CPU: it must hold wherever the suite runs."""
    checks = ["one-gpu", "cut", "tied", "autocast", "dropout", "two-gpus", "nccl"]
    proc = subprocess.run([sys.executable, str(CHECKS), *checks, "--fake-cpu"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == [word for check in checks for word in ("ok", check)]
