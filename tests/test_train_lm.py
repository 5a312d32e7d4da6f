"""The character language model example (tied embedding and head across stages) against single-device training."""

import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_example, run_script

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"

# A tiny float64 model without dropout: the pipeline must give the plain model's weights to rounding.
TINY = ["--steps", "3", "--layers", "2", "--d-model", "16", "--heads", "2", "--context", "16", "--batch", "6",
        "--chunks", "3", "--dropout", "0", "--dtype", "float64", "--eval-windows", "12", "--sample-length", "8",
        "--temperature", "0", "--clip", "0.2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A copy of the example's default text: the project's sources may change between a run and its reference."""
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    files = load_example(EXAMPLE).corpus_files()
    path.write_text("".join(p.read_text(encoding="utf-8") for p in files), encoding="utf-8")
    return ["--text", str(path)]


def reference(argv, replicas):
    """One device, one optimizer; each step the replicas' windows (drawn as the example draws them) concatenated."""
    ex = load_example(EXAMPLE)
    args = ex.parse(argv)
    model, data = ex.build(args)
    opt = ex.make_optimizer(model.parameters(), args)
    gens = [ex.replica_generator(args.seed, r) for r in range(replicas)]
    norms = []
    for _ in range(args.steps):
        parts = [ex.sample_batch(data.train, args.batch, args.context, g) for g in gens]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        ex.loss_fn(model(x), y).backward()
        if args.clip > 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).item())
        opt.step()
    assert all(n > args.clip for n in norms)  # with --clip, every step of the reference was clipped
    return model, model.state_dict()


def run(cmd, cwd, timeout=120):
    """The example's own runs: a shorter bound than other scripts', on the CPU."""
    return run_script(cmd, cwd, timeout=timeout, CUDA_VISIBLE_DEVICES="")


def check_equal(out_path, argv, replicas):
    got = torch.load(out_path)
    model, expected = reference(argv, replicas)
    assert list(got) == list(expected)  # the plain model's keys, the head's tied weight included
    head = f"{len(model) - 1}.weight"
    assert torch.equal(got[head], got["0.tok.weight"])  # still one weight
    assert max((got[k] - expected[k]).abs().max().item() for k in got) < 1e-10


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags,where", [([], "Pipeline, 2 stages"),
                                         (["--hybrid"], "HybridParallel, mode=replica, 1 replica(s)")])
def test_one_process_equals_single_device(tmp_path, corpus, flags, where):
    out = tmp_path / "final.pt"
    argv = [*TINY, *corpus, *flags, "--out", str(out)]
    stdout = run([sys.executable, str(EXAMPLE), *argv], tmp_path)
    assert where in stdout
    assert "held-out loss at end" in stdout and "sample (temperature 0.0):\ndef " in stdout
    check_equal(out, argv, 1)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode,replicas", [("stage", 1), ("replica", 2)])
def test_torchrun_equals_single_device(tmp_path, corpus, mode, replicas):
    """2 processes: one per stage (embedding and head in different processes), or 2 replicas x 2 stages."""
    out = tmp_path / "final.pt"
    argv = [*TINY, *corpus, "--hybrid", "--mode", mode, "--out", str(out)]
    stdout = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                  str(EXAMPLE), *argv], tmp_path)
    assert f"mode={mode}, {replicas} replica(s) x 2 stages" in stdout
    assert stdout.count("held-out loss at end") == 1  # rank 0 alone prints
    assert "sample (temperature 0.0):\ndef " in stdout
    check_equal(out, argv, replicas)


@pytest.mark.timeout(150)
def test_defaults_learn(tmp_path, corpus):
    """The default model and settings, 80 of the 600 steps (about 20 s): 4.5 -> about 3.0 (train and held-out)."""
    stdout = run([sys.executable, str(EXAMPLE), *corpus, "--steps", "80", "--average", "10", "--eval-windows", "64",
                  "--sample-length", "40"], tmp_path, timeout=140)
    first, final = map(float, re.search(r"train loss ([\d.]+) at step 1, ([\d.]+) over", stdout).groups())
    after, before = map(float, re.search(r"held-out loss at end ([\d.]+) \(from ([\d.]+)\)", stdout).groups())
    assert first > 4.0 and final < 0.75 * first, stdout[-2000:]
    assert after < 0.75 * before, stdout[-2000:]


def runs_with_and_without_recompute(example: Path, argv, tmp_path):
    """The example's result and saved weights with ``--checkpoint never`` and ``always``, by policy."""
    ex = load_example(example)
    results, states = {}, {}
    for policy in ("never", "always"):
        out = tmp_path / f"{policy}.pt"
        results[policy] = ex.main([*argv, "--checkpoint", policy, "--out", str(out)])
        states[policy] = torch.load(out)
    return results, states


@pytest.mark.timeout(60)
def test_dropout_replays_under_recompute(tmp_path, corpus):
    """Attention and residual dropout draw the same numbers whether activations are kept or recomputed."""
    # a fixed cut: a measured one may differ between the runs, and each stage draws from a seed of its own
    argv = [*TINY, *corpus, "--dropout", "0.2", "--sample-length", "0", "--balance", "2,3"]
    losses, states = runs_with_and_without_recompute(EXAMPLE, argv, tmp_path)
    assert losses["never"] == losses["always"]
    assert all(torch.equal(states["never"][k], states["always"][k]) for k in states["never"])
