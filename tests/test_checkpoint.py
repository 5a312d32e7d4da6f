"""Checkpoint files: safe to open, plainly loadable, and resumed exactly."""

import copy
import glob
import os
import pickle
import random
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import pipeddp
from conftest import data, max_diff
from pipeddp.checkpoints import catalog
from pipeddp.checkpoints import checkpoint as ckpt

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


# -- checkpoints never fail quietly ------------------------------------------------------------------------------


def resume_warnings(engine, directory, opt=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = engine.resume(str(directory), opt)
    return extra, [str(w.message) for w in caught if "pipeddp" in str(w.message)]


def test_resume_is_quiet_on_a_first_run_and_warns_once_where_a_directory_holds_no_checkpoint(tmp_path):
    with pipeddp.HybridParallel(dropout_model(), stages=2) as engine:
        before = [p.detach().clone() for p in engine.parameters()]
        for first in (tmp_path / "new", tmp_path / "empty"):  # no directory yet, or one made beforehand
            if first.name == "empty":
                first.mkdir()
            extra, said = resume_warnings(engine, first)
            assert extra is None and said == [], said
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
        extra, said = resume_warnings(engine, tmp_path / "other")
        assert extra is None and len(said) == 1, said
        assert str(tmp_path / "other") in said[0] and "no step-* checkpoint" in said[0] and "from scratch" in said[0]
        with pytest.raises(ValueError, match=r"notes.txt: it is a file, not a directory of checkpoints"):
            engine.resume(str(tmp_path / "other" / "notes.txt"))
        assert all(torch.equal(a, b) for a, b in zip(before, engine.parameters()))


def test_resume_names_every_file_it_skips_and_why_and_takes_the_newest_that_reads(tmp_path):
    run = tmp_path / "run"
    with pipeddp.HybridParallel(dropout_model(), stages=2) as engine:
        opt = torch.optim.Adam(engine.parameters())
        engine.save_checkpoint(str(run), 1, opt, keep=10)
        good = engine.state_dict()
        engine.save_checkpoint(str(run), 2, opt, keep=10, sharded=True)
    shard = run / "step-000000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])                                    # a damaged shard
    (run / "step-000000003").mkdir()                                               # a killed sharded writer
    (run / "step-000000003" / "__0_0.distcp").write_bytes(b"\0" * 64)
    whole = (run / "step-000000001.pt").read_bytes()
    (run / "step-000000004.pt").write_bytes(whole[: len(whole) // 2])               # a truncated zip
    (run / "step-000000005.pt").write_bytes(np.random.default_rng(0).bytes(4096))   # random bytes
    torch.save({"0.weight": torch.zeros(2)}, str(run / "step-000000006.pt"))       # another program's file
    with pipeddp.HybridParallel(dropout_model(seed=4), stages=1) as engine:
        extra, said = resume_warnings(engine, run, torch.optim.Adam(engine.parameters()))
        assert extra == {"step": 1}
        assert max_diff(good.values(), engine.state_dict().values()) == 0
    expect = {6: "is not a pipeddp checkpoint", 5: "is damaged or is not a checkpoint",
              4: "is damaged or is not a checkpoint", 3: "incomplete sharded checkpoint",
              2: "its shard file __0_0.distcp holds 100 bytes"}
    assert len(said) == len(expect), said
    for (step, why), message in zip(sorted(expect.items(), reverse=True), said):
        path = str(run / f"step-{step:09d}") + (".pt" if step != 2 and step != 3 else "")
        assert f"resume skips {path}, which " in message and why in message, (step, message)
        assert "unsafe" not in message and "run code" not in message


@pytest.mark.parametrize("content", [b"", b"hello\n", bytes(range(256)) * 16])
def test_a_file_that_is_not_a_checkpoint_is_called_damaged_never_unsafe(tmp_path, content):
    path = tmp_path / "c.pt"
    path.write_bytes(content)
    with pytest.raises(ckpt.DamagedCheckpointError, match=r"c.pt is damaged or is not a checkpoint") as info:
        ckpt.load(str(path))
    assert not isinstance(info.value, ckpt.UnsafeCheckpointError) and "unsafe" not in str(info.value)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_plain_pickle_that_would_run_code_is_still_unsafe(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "c.pt"
    with open(path, "wb") as f:
        pickle.dump({"model": CreatesAFile(str(marker))}, f)  # not torch.save's format, but code all the same
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"references Python objects \(.*pathlib"):
        ckpt.load(str(path))
    assert not marker.exists()


def test_an_optimizer_of_another_class_is_refused_naming_both(tmp_path):
    with pipeddp.HybridParallel(dropout_model(), stages=2) as engine:
        engine.save(str(tmp_path / "c.pt"), optimizer=torch.optim.Adam(engine.parameters()))
        with pytest.raises(ValueError, match=r"c.pt holds the state of a torch.optim.adam.Adam optimizer, but the "
                                             r"optimizer given is a torch.optim.sgd.SGD"):
            engine.load(str(tmp_path / "c.pt"), torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9))
        engine.save(str(tmp_path / "none.pt"))
        with pytest.raises(ValueError, match=r"none.pt holds no optimizer state"):
            engine.load(str(tmp_path / "none.pt"), torch.optim.Adam(engine.parameters()))
