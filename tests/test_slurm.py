"""examples/slurm/train.sbatch: valid bash, and every torchrun flag, rendezvous setting and script option exists."""

from __future__ import annotations

import inspect
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_example

ROOT = Path(__file__).resolve().parent.parent
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"


def command() -> list:
    """The srun line's words, continuation lines joined, from ``torch.distributed.run`` on."""
    text = SBATCH.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith("srun "))
    words = shlex.split(line)
    return words[words.index("torch.distributed.run") + 1:]


def test_it_is_valid_bash():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


@pytest.mark.timeout(60)
def test_its_torchrun_flags_exist_in_the_installed_torch():
    helptext = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--help"], capture_output=True,
                              text=True, check=True).stdout
    words = command()
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    flags = [w.split("=")[0] for w in words[:script]]
    assert {"--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--max-restarts"} <= set(flags)
    for flag in flags:
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}[\s,\]]", helptext), f"torchrun has no {flag}"


def test_its_rendezvous_settings_are_ones_torch_reads():
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    source = inspect.getsource(dynamic_rendezvous) + inspect.getsource(c10d_rendezvous_backend)
    conf = next(w for w in command() if w.startswith("--rdzv-conf="))[len("--rdzv-conf="):]
    for key in (item.split("=")[0] for item in conf.split(",")):
        name = key[:-len("_timeout")] if key.endswith("_timeout") else key
        assert f'"{name}"' in source, f"torch's rendezvous does not read {key}"


def test_its_script_takes_the_options_given():
    words = command()
    script = next(i for i, w in enumerate(words) if w.endswith(".py"))
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        example = load_example(ROOT / words[script])
    finally:
        sys.path.remove(str(ROOT / "examples"))
    args = example.parse(words[script + 1:])  # an unknown option exits here
    assert args.global_batch % (4 * args.batch_size) == 0 and args.global_batch % (2 * args.batch_size) == 0
