"""The command line: demo, partition (timeline and plan are covered in test_trace.py)."""

import re
import sys

import pytest

from pipeddp.tools.cli import main


@pytest.mark.timeout(180)
def test_demo_trains_plain_pipeline_and_hybrid_alike(capsys):
    assert main(["demo", "--steps", "4", "--batch", "32", "--chunks", "4", "--layers", "3", "--width", "64",
                 "--replicas", "2", "--stages", "2"]) == 0
    out = capsys.readouterr().out
    rows = {name: line for name in ("plain", "pipeline 1 x 2", "hybrid 2 x 2") for line in out.splitlines()
            if name in line and line.startswith("│")}
    assert len(rows) == 3, out
    for name in ("pipeline 1 x 2", "hybrid 2 x 2"):
        diff = float(re.findall(r"(\d\.\de[-+]\d+)", rows[name])[-1])
        assert diff < 1e-5, rows[name]  # the trained weights equal the plain model's (float32)
        # the comparison says in words which way it went, and never calls a slowdown a speedup
        ratio, word = re.search(r"(\d+\.\d+)x (faster|slower)", rows[name]).groups()
        if word == "slower":
            assert "Slower than the plain model here" in out and name in out.split("Slower than")[1]
        # ... and agrees at a glance with the step times beside it
        plain_ms = float(rows["plain"].split("│")[2])
        row_ms = float(rows[name].split("│")[2])
        shown = plain_ms / row_ms if word == "faster" else row_ms / plain_ms
        assert abs(shown - float(ratio)) < 0.02 * shown + 0.01, (rows["plain"], rows[name])


def test_partition_report(capsys):
    assert main(["partition", "--model", "mlp", "--stages", "3", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "partition by time" in out and "bottleneck / ideal" in out


def test_bad_arguments_give_an_error_not_a_traceback(capsys):
    assert main(["partition", "--model", "mlp", "--stages", "40"]) == 2
    said = capsys.readouterr()
    assert "at most 32" in said.out
    assert "profiling" not in said.out + said.err  # refused before anything is measured


def test_piped_output_keeps_every_cell_whole_and_shows_progress(capsys):
    # capsys is not a terminal, as a pipe or a log file is not: rich would assume 80 columns there
    assert main(["partition", "--model", "resnet18", "--stages", "3", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out, out
    assert "(conv1..layer" in out
    assert "profiling resnet18" in out and "100%" in out  # progress while it profiles


def test_the_pipeddp_command_starts():
    """The console script declared in pyproject.toml resolves, and the installed `pipeddp` command runs."""
    import importlib
    import os
    import subprocess
    import sys
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    target = re.search(r'^pipeddp = "([\w.]+):(\w+)"$', pyproject, flags=re.M)
    assert target, "pyproject.toml declares no `pipeddp` console script"
    assert callable(getattr(importlib.import_module(target.group(1)), target.group(2)))
    script = Path(sys.executable).with_name("pipeddp")
    if not script.exists():
        pytest.skip(f"pipeddp is not installed beside {sys.executable} (pip install -e . installs the command)")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "demo" in proc.stdout, proc.stdout + proc.stderr


def _subcommands():
    import argparse

    from pipeddp.tools.cli import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("command", ["demo", "partition", "timeline", "plan", "convert"])
def test_help_shows_every_options_default_and_description(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare with single spaces
    for action in _subcommands()[command]._actions:
        if "-h" in action.option_strings:
            continue
        assert action.help and len(action.help) > 8, f"{command} {action.dest}: no description"
        if action.option_strings:  # an option (positionals have no default to show)
            assert f"(default: {action.default})" in text, f"{command} {action.option_strings[0]}: no default shown"


@pytest.mark.parametrize("out, written", [("docs/deeper/tl", "docs/deeper/tl"), ("x.png", "x"), ("y.json", "y"),
                                          ("z.v2", "z.v2")])
def test_timeline_out_creates_its_folder_and_never_doubles_a_suffix(tmp_path, capsys, out, written):
    from pipeddp.tools.timeline import have_matplotlib

    assert main(["timeline", "--stages", "2", "--chunks", "2", "--batch", "4", "--steps", "1",
                 "--out", str(tmp_path / out)]) == 0
    assert (tmp_path / f"{written}.json").is_file()
    if have_matplotlib():
        assert (tmp_path / f"{written}.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.rglob("*.png.png")) and not list(tmp_path.rglob("*.json.json"))
    text = capsys.readouterr().out
    assert f"wrote {tmp_path / written}.json" in " ".join(text.split())


def test_timeline_out_is_checked_before_the_step_runs(tmp_path, capsys, monkeypatch):
    """A path that cannot be written fails at once, with the path named, before any traced step runs."""
    import pipeddp.pipeline

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    def refuse(*args, **kwargs):
        raise AssertionError("the pipeline was built before --out was checked")

    monkeypatch.setattr(pipeddp.pipeline.Pipeline, "__init__", refuse)
    assert main(["timeline", "--out", str(blocker / "tl")]) == 2
    text = " ".join(capsys.readouterr().out.split())
    assert "cannot create the folder" in text and "a-file" in text and "Traceback" not in text
    assert main(["timeline", "--out", str(tmp_path) + "/"]) == 2
    assert "names a folder, not a file" in capsys.readouterr().out


def test_text_in_brackets_prints_as_written_not_as_markup(tmp_path, capsys, monkeypatch):
    """rich reads ``[plot]`` or ``[b]`` as markup and drops it: the hint, paths and errors are printed escaped."""
    import pipeddp.tools.timeline

    monkeypatch.setattr(pipeddp.tools.timeline, "have_matplotlib", lambda: False)
    out = tmp_path / "run[b]" / "tl"
    assert main(["timeline", "--stages", "2", "--chunks", "2", "--batch", "4", "--steps", "1", "--out", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "pip install 'pipeddp[plot]'" in text
    assert f"wrote {out}.json" in text
    assert main(["timeline", "--out", str(tmp_path / "[plot]") + "/"]) == 2
    text = " ".join(capsys.readouterr().out.split())
    assert "names a folder, not a file" in text and "[plot]" in text


def test_partition_table_says_not_measured_for_what_it_did_not_measure(capsys):
    assert main(["partition", "--model", "mlp", "--stages", "2", "--batch", "8", "--method", "params"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "not measured" in text and "does not time the layers" in text
    assert "0.00" not in text


USER_MODELS = '''
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2048), nn.ReLU(), nn.Linear(2048, 8))
    return model, torch.randn(3, 8)


def whole():
    return nn.Linear(2, 2), torch.randn(2, 2)
'''


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    """A module of the user's own in the current folder, as `pipeddp ... --model NAME:function` finds it."""
    name = f"user_models_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(USER_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield name
    sys.modules.pop(name, None)


def test_a_users_own_model_is_cut_planned_and_drawn(user_models, tmp_path, capsys):
    assert main(["partition", "--model", f"{user_models}:build", "--stages", "2", "--batch", "8",
                 "--method", "params"]) == 0
    out = capsys.readouterr().out
    assert "18,504" in out, out  # the min-max cut by parameters: 72 + 18,432 in stage 0, the rest after
    assert main(["plan", "--model", f"{user_models}:build", "--devices", "2", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "first choice:" in out and "planned for inputs of 8 per sample" in out and "built-in" not in out
    out_stem = tmp_path / "tl"
    assert main(["timeline", "--model", f"{user_models}:build", "--batch", "8", "--chunks", "4", "--steps", "1",
                 "--out", str(out_stem)]) == 0
    assert (tmp_path / "tl.json").exists()


def test_a_users_model_that_cannot_be_used_is_an_error_saying_why(user_models, capsys):
    for spec, said in [(f"{user_models}:whole", "not an nn.Sequential; return pipeddp.tools.models.flatten_sequential"),
                       (f"{user_models}:missing", "has no function 'missing'"),
                       ("no_such_module_here:build", "cannot import 'no_such_module_here'"),
                       ("resnet9", "or give your own as package.module:function")]:
        assert main(["partition", "--model", spec]) == 2
        assert said in " ".join(capsys.readouterr().out.split()), spec


def test_a_warning_reads_as_one_line_of_the_report(user_models, capsys):
    assert main(["partition", "--model", f"{user_models}:build", "--stages", "4", "--batch", "8",
                 "--method", "memory"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "warning (HeavyLayerWarning): layer 1 ('1', Linear:" in out, out
    assert "cli.py" not in out and "plan = partition(" not in out  # no source location, no line of our code


def test_version_prints_the_packages_version(capsys):
    import pipeddp

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"pipeddp {pipeddp.__version__}"


@pytest.mark.parametrize("args, said", [
    (["--memory", "80XB"], "--memory '80XB' is not a size; write e.g. 80GB"),
    (["--memory", "0GB"], "--memory must be more than nothing"),
    (["--link", "pci"], "--link 'pci' is not a link this command knows; choose one of ethernet, infiniband"),
    (["--allreduce-link", "nvme"], "--allreduce-link 'nvme' is not a link"),
    (["--devices", "0"], "--devices must be >= 1, got 0"),
    (["--batch", "-4"], "--batch must be >= 1"),
    (["--profile-batch", "1"], "--profile-batch must be >= 2"),
    (["--devices", "8", "--devices-per-node", "3"], "--devices-per-node 3 must be >= 1 and divide --devices 8"),
])
def test_plan_checks_every_argument_before_building_or_profiling_the_model(monkeypatch, capsys, args, said):
    import pipeddp.tools.models as models

    monkeypatch.setattr(models, "build", lambda *a, **k: pytest.fail("the model was built before the arguments "
                                                                       "were checked"))
    assert main(["plan", *args]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert said in out and "Link(" not in out, out


def test_plan_says_the_input_size_a_built_in_model_is_planned_at(monkeypatch, capsys):
    import pipeddp.tools.models as models
    import pipeddp.tools.plan as plan

    def stop(*a, **k):
        raise ValueError("stopped before profiling")

    monkeypatch.setattr(plan, "fit_layers", stop)
    monkeypatch.setattr(models, "MODELS", dict(models.MODELS, resnet50=(lambda: models.mlp(2, 4, 4, 4),
                                                                        models.MODELS["resnet50"][1])))
    assert main(["plan", "--model", "resnet50"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "resnet50: planned for inputs of 3x64x64 per sample (the built-in model's sample" in out, out


def test_convert_says_what_is_wrong_with_its_argument(tmp_path, capsys):
    import torch
    from torch import nn

    import pipeddp

    run = tmp_path / "run"
    with pipeddp.Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), ["cpu", "cpu"]) as pipe:
        pipe.save_checkpoint(str(run), 4)
    for source, said in [(tmp_path / "no" / "such", "no/such does not exist; give a sharded checkpoint"),
                         (run / "step-000000004.pt", "is a file, not a sharded checkpoint"),
                         (run, "is a directory of one-file checkpoints (step-000000004.pt, ...), which need no "
                               "converting: torch.load opens them")]:
        assert main(["convert", str(source), str(tmp_path / "out.pt")]) == 2
        out = " ".join(capsys.readouterr().out.split())
        assert said in out and not (tmp_path / "out.pt").exists(), out
    assert "model" in torch.load(str(run / "step-000000004.pt"))
