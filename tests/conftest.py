"""Shared fixtures: small float64 models and the plain single-device reference.

The suite means CPU: on a machine with GPUs, pipeddp would otherwise pick CUDA
devices by itself (``HybridParallel`` without ``devices=``, the examples, jobs
started with ``spawn`` or torchrun) and a one-GPU machine could not place
2 x 2 stages. So the GPUs are hidden from this process and every process it
starts, before anything initialises CUDA. The CUDA tests (``test_cuda.py``)
run their checks in subprocesses that see the machine's GPUs again
(``GPU_ENV``), and skip, with the reason, where there are none.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import pty
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

#: Where the mask the suite started with is kept ("*": none): pytest-xdist's workers inherit the hidden GPUs below
#: from the process that started them, and find the machine's own mask here.
_MASK = "PIPEDDP_TESTS_GPU_MASK"
os.environ.setdefault(_MASK, os.environ.get("CUDA_VISIBLE_DEVICES", "*"))
#: The environment under which a subprocess sees this machine's GPUs (as before the suite hid them).
GPU_ENV: Dict[str, str] = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", _MASK)}
if os.environ[_MASK] != "*":
    GPU_ENV["CUDA_VISIBLE_DEVICES"] = os.environ[_MASK]
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import nccl_rules
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

#: Point-to-point messages follow NCCL's rules (in order, no tags) in this process and every one it starts,
#: unless a job is started with PIPEDDP_P2P_RULES=tags (``nccl_rules``).
os.environ.setdefault("PIPEDDP_P2P_RULES", "nccl")
nccl_rules.install()

if importlib.util.find_spec("transformers") is not None:
    from pipeddp.distributed import launch

    # the jobs' forkserver imports, once per test worker, the model families their processes build (about 1.5 s of
    # CPU in each process of each job otherwise)
    launch.PRELOAD += ["transformers"] + [f"transformers.models.{m}.modeling_{m}" for m in ("llama", "qwen2", "gpt2")]


@pytest.fixture(autouse=True)
def _no_thread_left_behind():
    """Every test must stop the threads it started (pipelines are closed or collected)."""
    before = {t.ident for t in threading.enumerate()}
    yield

    def new_threads():
        return [t for t in threading.enumerate() if t.ident not in before and t.name.startswith("pipeddp")]

    leaked = new_threads()
    if leaked:  # a pipeline that was not closed may only be waiting for the collector
        import gc

        gc.collect()
        leaked = new_threads()
    for t in leaked:
        t.join(timeout=5)
    alive = [t.name for t in leaked if t.is_alive()]
    assert not alive, f"pipeline worker threads outlived the test: {alive}"


def make_mlp(width: int = 12, depth: int = 6, seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    """A float64 MLP of ``depth`` Linear layers with activations in between (2*depth-1 children)."""
    torch.manual_seed(seed)
    layers: List[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i < depth - 1:
            layers.append(nn.Tanh() if i % 2 else nn.ReLU())
            if dropout:
                layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers).double()


def data(n: int = 10, width: int = 12, seed: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, width, generator=g, dtype=torch.float64),
            torch.randn(n, width, generator=g, dtype=torch.float64))


def reference_training(model: nn.Module, batches, loss_fn: Callable, lr: float = 0.1):
    """Plain single-device SGD on each batch; returns (per-step grads, final params)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def max_diff(a, b) -> float:
    return max((x.detach().cpu() - y.detach().cpu()).abs().max().item() for x, y in zip(a, b))


def load_example(path: Path) -> ModuleType:
    """An example script imported as a module (``examples/`` is no package), so a test builds its reference
    with the example's own model, data and optimizer."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(cmd: Sequence[str], cwd: Path, *, timeout: float = 240, **env_extra: str) -> str:
    """Run ``cmd`` as a user would (one intra-op thread, unbuffered output); its stdout, or a failure that
    shows the ends of its stdout and stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_extra)
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


class CountOps(TorchDispatchMode):
    """The aten ops run in its body, by name (what ran, not a stand-in: the ops are run as they come)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def stderr_on_a_terminal(monkeypatch) -> Iterator[List[bytes]]:
    """``sys.stderr`` a pseudo-terminal in the block, as a user's at a shell; yields the list its output is read
    into (whole once the block has ended)."""
    monkeypatch.setenv("TERM", "xterm")
    for name in ("FORCE_TERMINAL", "TTY_COMPATIBLE", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    main, tty = pty.openpty()
    shown: List[bytes] = []
    reader = threading.Thread(target=_drain, args=(main, shown))
    reader.start()
    try:
        with open(tty, "w", closefd=True) as terminal:
            monkeypatch.setattr(sys, "stderr", terminal)
            try:
                yield shown
            finally:
                monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    finally:
        reader.join(timeout=30)
        os.close(main)


def _drain(fd: int, into: List[bytes]) -> None:
    """Read a terminal's output until its other end is closed (so that its buffer never fills)."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other end is closed
            return
        if not chunk:
            return
        into.append(chunk)
