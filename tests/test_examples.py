"""The hybrid example under a real torchrun, and as a plain script, against single-device training."""

import contextlib
import io
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_example, run_script

import pipeddp

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_hybrid.py"


def reference(argv, replicas):
    """One device, one optimizer, the replicas' shards of each step concatenated into the global batch."""
    ex = load_example(EXAMPLE)
    args = ex.parse(argv)
    model, train_set, _ = ex.build(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loaders = [pipeddp.data.loader(train_set, args.batch, replicas=replicas, replica=r, seed=args.seed,
                                   drop_last=True) for r in range(replicas)]
    step, epoch = 0, 0
    while step < args.steps:
        for ld in loaders:
            ld.set_epoch(epoch)
        for parts in zip(*loaders):
            x = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            step += 1
            if step == args.steps:
                break
        epoch += 1
    return model.state_dict()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,nproc,replicas", [("stage", 4, 2), ("replica", 2, 2)])
def test_torchrun_job_equals_single_device(tmp_path, mode, nproc, replicas):
    out = tmp_path / "final.pt"
    argv = ["--stages", "2", "--mode", mode, "--steps", "12", "--out", str(out)]
    stdout = run_script([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                         str(EXAMPLE), *argv], tmp_path)
    assert f"{replicas} replica(s) x 2 stage(s)" in stdout
    assert "held-out mse" in stdout
    got = torch.load(out)
    expected = reference(argv, replicas)
    assert list(got) == list(expected)
    assert max((got[k] - expected[k]).abs().max().item() for k in got) < 2e-5


@pytest.mark.timeout(300)
def test_plain_script_equals_single_device(tmp_path):
    out = tmp_path / "final.pt"
    argv = ["--stages", "3", "--steps", "10", "--out", str(out)]
    stdout = run_script([sys.executable, str(EXAMPLE), *argv], tmp_path)
    assert "1 replica(s) x 3 stage(s)" in stdout
    got = torch.load(out)
    expected = reference(argv, 1)
    assert max((got[k] - expected[k]).abs().max().item() for k in got) < 2e-5


@pytest.mark.timeout(300)
def test_example_learns_with_its_defaults(tmp_path):
    stdout = run_script([sys.executable, str(EXAMPLE)], tmp_path)
    before, after = map(float, re.search(r"held-out mse ([\d.]+) before training, ([\d.]+) after", stdout).groups())
    assert after < 0.7 * before, stdout[-2000:]


@pytest.mark.parametrize("script", sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py")),
                         ids=lambda p: p.name)
def test_every_examples_help_shows_each_options_default(script, monkeypatch):
    """``python examples/X.py --help``, run in this interpreter (as ``__main__``, from the examples' folder) rather
    than a new one: the same parser and text, without an interpreter's start and torch's import per script."""
    monkeypatch.syspath_prepend(str(script.parent))
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == 0
    out = buffer.getvalue()
    text = " ".join(out.split())  # help text wraps anywhere
    options = [w for w in re.findall(r"^  (--[a-z][a-z-]*)", out, flags=re.M)]
    assert options, out
    assert text.count("(default: ") >= len(options), out
