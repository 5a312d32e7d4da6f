"""Every Python block of the README runs as written, in a fresh interpreter (and under torchrun where it says so)."""

import re
import sys
from pathlib import Path

import pytest

from conftest import run_script

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs_as_written(index, tmp_path):
    script = tmp_path / f"block{index}.py"
    script.write_text(BLOCKS[index])
    run_script([sys.executable, str(script)], tmp_path)
    if "torchrun" in BLOCKS[index] and "def main" in BLOCKS[index]:
        # 2 processes x 2 stages: 4 GPUs or the CPU; this test means the CPU (a GPU machine may have fewer)
        out = run_script([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script)], tmp_path, CUDA_VISIBLE_DEVICES="")
        assert "2 replica(s)" in out


@pytest.mark.parametrize("name", ["Pipeline", "HybridParallel"])
def test_the_signature_the_readme_gives_is_the_real_one(name):
    """The constructor line of the README lists every argument, in order, and no other."""
    import inspect

    import pipeddp

    match = re.search(rf"^`{name}\((.*?)\)`", README.read_text(), flags=re.S | re.M)
    assert match, f"the README has no `{name}(...)` line"
    listed = [a.strip() for a in match.group(1).replace("\n", " ").split(",") if a.strip() != "*"]
    listed = [n for a in listed for n in a.split(" | ")]  # `chunks | split_size`: one or the other
    real = [p for p in inspect.signature(getattr(pipeddp, name).__init__).parameters if p != "self"]
    assert listed == real


def test_every_pipeddp_name_the_readmes_mention_exists():
    """`pipeddp.tools.models.flatten_sequential` and the like: a module that moves must take the docs with it."""
    import importlib

    text = README.read_text() + (README.parent / "benchmarks" / "README.md").read_text()
    names = sorted(set(re.findall(r"\bpipeddp(?:\.[A-Za-z_]\w*)+", text)))
    assert names
    missing = []
    for name in names:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            missing.append(name)
    assert not missing, f"the README names what pipeddp does not have: {missing}"
