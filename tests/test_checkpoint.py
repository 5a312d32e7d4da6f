"""Checkpoint files: safe to open, plainly loadable, and resumed exactly."""

import copy
import glob
import os
import random
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from torch import nn

import pipeddp
from conftest import data, max_diff
from pipeddp.distributed import catalog
from pipeddp.distributed import checkpoint as ckpt

LOSS = nn.functional.mse_loss


def dropout_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 12)).double()


class CreatesAFile:
    """Unpickling this object creates ``path``: what a malicious checkpoint would do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def write_malicious(path, marker):
    torch.save({"format": ckpt.FORMAT, "model": {}, "extra": {"step": 9, "payload": CreatesAFile(str(marker))}},
               str(path))


def test_a_pickle_that_would_run_code_is_refused_by_load_and_resume(tmp_path):
    marker = tmp_path / "pwned"
    directory = tmp_path / "ckpts"
    directory.mkdir()
    evil = directory / "step-000000009.pt"
    write_malicious(evil, marker)
    # the trap is real: an unsafe load does create the file
    probe = tmp_path / "probe.pt"
    write_malicious(probe, tmp_path / "probe-marker")
    torch.load(str(probe), weights_only=False)
    assert (tmp_path / "probe-marker").exists()

    with pipeddp.HybridParallel(dropout_model(), stages=2, chunks=2) as engine:
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        with pytest.raises(ckpt.UnsafeCheckpointError, match="step-000000009.pt.*safe loader"):
            engine.load(str(evil), optimizer=opt)
        with pytest.raises(ckpt.UnsafeCheckpointError, match="step-000000009.pt"):
            engine.resume(str(directory), opt)
        with pytest.raises(ckpt.UnsafeCheckpointError, match="step-000000009.pt"):
            pipeddp.resume(engine, str(directory), opt)
        with pytest.warns(DeprecationWarning, match=r"resume\(engine, directory, optimizer\)"), \
                pytest.raises(ckpt.UnsafeCheckpointError):
            pipeddp.resume(engine, opt, str(directory))  # the 0.1 argument order still reaches the same check
    assert not marker.exists()


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"0.weight": torch.zeros(2)}, str(path))
    with pipeddp.HybridParallel(dropout_model(), stages=1) as engine:
        with pytest.raises(ValueError, match=r"weights.pt is not a pipeddp checkpoint"):
            engine.load(str(path))


def test_extra_that_the_safe_loader_could_not_read_is_refused_at_save(tmp_path):
    with pipeddp.HybridParallel(dropout_model(), stages=1) as engine:
        with pytest.raises(TypeError, match=r"extra\['lr'\] is a numpy.float64"):
            engine.save(str(tmp_path / "c.pt"), extra={"epoch": 1, "lr": np.float64(0.1)})
    assert not (tmp_path / "c.pt").exists()


def test_rng_state_round_trips_as_plain_values():
    state = ckpt.rng_state()
    ckpt.check_plain(state, "rng")
    expect = (torch.rand(3), random.random(), np.random.rand(3))
    torch.rand(5), random.random(), np.random.rand(7)  # move every generator on
    ckpt.set_rng_state(state)
    got = (torch.rand(3), random.random(), np.random.rand(3))
    assert torch.equal(expect[0], got[0]) and expect[1] == got[1] and np.array_equal(expect[2], got[2])


def train(engine, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        engine.train_step(x, y, LOSS)
        opt.step()


@pytest.mark.timeout(120)
def test_checkpoint_opens_with_plain_torch_load_and_resumes_exactly(tmp_path):
    directory = str(tmp_path / "run")
    batches = [data(8, seed=20 + i) for i in range(4)]
    model = dropout_model()
    # uninterrupted: 4 steps
    torch.manual_seed(1)
    with pipeddp.HybridParallel(copy.deepcopy(model), stages=2, chunks=2, checkpoint="always") as engine:
        opt = torch.optim.Adam(engine.parameters(), lr=1e-2)
        train(engine, opt, batches[:2])
        engine.save_checkpoint(directory, 2, opt, extra={"epoch": 0, "batch": 2, "note": "half way"})
        train(engine, opt, batches[2:])
        uninterrupted = engine.state_dict()
    # a fresh interpreter opens the file with torch's defaults and loads it into the plain model
    path = catalog.step_path(directory, 2)
    script = (
        "import sys, torch\n"
        "from torch import nn\n"
        "ck = torch.load(sys.argv[1])\n"
        "model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 16), nn.Tanh(),"
        " nn.Linear(16, 12)).double()\n"
        "model.load_state_dict(ck['model'])\n"
        "print(sorted(ck), ck['extra'], ck['meta']['stages'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "['extra', 'format', 'meta', 'model', 'optimizer', 'rng']" in proc.stdout
    assert "'note': 'half way'" in proc.stdout and "'step': 2" in proc.stdout
    # resumed: a new engine loads model, Adam state and RNG, then trains the last 2 steps (dropout masks
    # depend on the generators, so an unrestored RNG would show)
    torch.manual_seed(99)
    with pipeddp.HybridParallel(dropout_model(seed=5), stages=2, chunks=2, checkpoint="always") as engine:
        opt = torch.optim.Adam(engine.parameters(), lr=1e-2)
        extra = pipeddp.resume(engine, directory, opt)
        assert extra == {"epoch": 0, "batch": 2, "note": "half way", "step": 2}
        train(engine, opt, batches[2:])
        resumed = engine.state_dict()
    assert list(resumed) == list(uninterrupted)
    assert max_diff(uninterrupted.values(), resumed.values()) == 0


def child_sees_private_directories(_: int) -> list:
    return [os.stat(d).st_mode & 0o777 for d in glob.glob(os.path.join(tempfile.gettempdir(), "pipeddp-spawn-*"))]


@pytest.mark.timeout(60)
def test_spawn_keeps_its_argument_files_in_a_private_directory():
    modes = pipeddp.spawn(child_sees_private_directories, 1, args=(0,), timeout=50)[0]
    assert modes and all(m == 0o700 for m in modes), [oct(m) for m in modes]
