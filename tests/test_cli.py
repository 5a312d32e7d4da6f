"""The command line: demo, partition (timeline and plan are covered in test_trace.py)."""

import re

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


def test_partition_report(capsys):
    assert main(["partition", "--model", "mlp", "--stages", "3", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "partition by time" in out and "bottleneck / ideal" in out


def test_bad_arguments_give_an_error_not_a_traceback(capsys):
    assert main(["partition", "--model", "mlp", "--stages", "40"]) == 2
    assert "at most 32" in capsys.readouterr().out


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
