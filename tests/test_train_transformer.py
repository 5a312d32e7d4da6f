"""The nn.TransformerEncoder language model example, flattened and pipelined, against the plain model."""

import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import load_example, run_script
from test_train_lm import corpus  # noqa: F401  (a fixture: a fixed copy of the example's text)
from test_train_lm import runs_with_and_without_recompute

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_transformer.py"

# A tiny float64 model without dropout: the pipeline must train as the plain model does, to rounding.
TINY = ["--steps", "3", "--layers", "3", "--d-model", "16", "--heads", "2", "--context", "16", "--batch", "6",
        "--chunks", "3", "--dropout", "0", "--dtype", "float64", "--eval-windows", "12", "--sample-length", "8",
        "--temperature", "0"]


def reference(ex, argv):
    """The plain TransformerLM on one device, one optimizer: the losses of each step, the held-out loss after
    and the trained state dict."""
    lm = ex.lm
    args = ex.parse(argv)
    data = lm.load_text([Path(p) for p in args.text])
    model = ex.make_model(len(data.vocab), args)
    opt = lm.make_optimizer(model.parameters(), args)
    g = lm.replica_generator(args.seed, 0)
    losses = []
    for _ in range(args.steps):
        x, y = lm.sample_batch(data.train, args.batch, args.context, g)
        opt.zero_grad()
        loss = lm.loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    held = lm.held_out_set(data.held, args.context, args.eval_windows)
    model.eval()
    with torch.no_grad():
        total = sum(lm.loss_fn(model(held[i:i + args.batch][0]), held[i:i + args.batch][1]).item()
                    * len(held[i:i + args.batch][0]) for i in range(0, len(held), args.batch))
    return losses, total / len(held), model.state_dict()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flags", [[], ["--stages", "4"], ["--hybrid"]])
def test_training_equals_the_plain_model(tmp_path, corpus, capsys, flags):  # noqa: F811
    ex = load_example(EXAMPLE)
    argv = [*TINY, *corpus, *flags, "--out", str(tmp_path / "final.pt")]
    got = ex.main(argv)
    out = capsys.readouterr().out
    # one entry per encoder layer: the encoder was opened, not kept whole
    assert "(embed, encoder_layers_0, encoder_layers_1, encoder_layers_2, encoder_norm, head)" in out, out
    assert "sample (temperature 0.0):\ndef " in out
    losses, held_after, expected = reference(ex, argv)
    assert got.losses == pytest.approx(losses, rel=1e-10, abs=0)
    assert got.held_after == pytest.approx(held_after, rel=1e-10, abs=0)
    saved = torch.load(tmp_path / "final.pt")
    assert list(saved) == list(expected)  # the original model's names: encoder.layers.0..., not encoder_layers_0
    assert torch.equal(saved["head.weight"], saved["embed.tok.weight"])  # the tie holds
    assert max((saved[k] - expected[k]).abs().max().item() for k in saved) < 1e-10


@pytest.mark.timeout(90)
def test_defaults_learn(corpus, capsys):  # noqa: F811
    """The default model and settings for 24 of the 600 steps (20-40 s on 2 busy cores): the loss falls from
    ln 96 = 4.56 to the level of character frequencies (about 3.3), on the training and the held-out text."""
    ex = load_example(EXAMPLE)
    got = ex.main([*corpus, "--steps", "24", "--eval-windows", "32", "--sample-length", "0", "--log-every", "0"])
    out = capsys.readouterr().out
    last = got.losses[-8:]
    assert got.losses[0] > 4.0 and sum(last) / len(last) < 0.8 * got.losses[0], out[-2000:]
    assert got.held_after < 0.8 * got.held_before, out[-2000:]


@pytest.mark.timeout(60)
def test_encoder_dropout_replays_under_recompute(tmp_path, corpus):  # noqa: F811
    """The encoder layers' attention, feed-forward and residual dropout draw the same numbers whether the
    activations are kept or recomputed in backward: the same losses and weights, bit for bit (same shapes)."""
    # a fixed cut: a measured one may differ between the runs, and each stage draws from a seed of its own
    argv = [*TINY, *corpus, "--dropout", "0.2", "--sample-length", "0", "--balance", "3,3"]
    runs, states = runs_with_and_without_recompute(EXAMPLE, argv, tmp_path)
    assert runs["never"] == runs["always"]
    assert all(torch.equal(states["never"][k], states["always"][k]) for k in states["never"])


@pytest.mark.timeout(150)
def test_torchrun_stage_mode_equals_the_plain_model(tmp_path, corpus):  # noqa: F811
    """One process per stage under a real torchrun: the embedding and the tied head in different processes; the
    consolidated weights (original keys) are the plain model's, and rank 0 samples from them."""
    out = tmp_path / "final.pt"
    argv = [*TINY, *corpus, "--hybrid", "--mode", "stage", "--out", str(out)]
    stdout = run_script([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                         str(EXAMPLE), *argv], tmp_path, timeout=140, CUDA_VISIBLE_DEVICES="")
    assert "mode=stage, 1 replica(s) x 2 stages" in stdout and stdout.count("held-out loss at end") == 1
    assert "sample (temperature 0.0):\ndef " in stdout
    _, _, expected = reference(load_example(EXAMPLE), argv)
    saved = torch.load(out)
    assert list(saved) == list(expected)
    assert max((saved[k] - expected[k]).abs().max().item() for k in saved) < 1e-10


def test_help_describes_every_flag_with_its_default(capsys):
    ex = load_example(EXAMPLE)
    with pytest.raises(SystemExit) as exit_:
        ex.parse(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare with single spaces
    assert "flatten_sequential" in text  # the docstring heads it
    options = text.split("options:", 1)[1]
    entries = re.split(r" (?=--[a-z-]+[ ,])", options)[1:]  # one per flag: "--steps STEPS optimizer steps (...)"
    assert len(entries) > 20, options
    for entry in entries:
        if not entry.startswith("--help"):
            assert "(default:" in entry, f"no help with its default: {entry!r}"
