"""Run under torchrun by ``test_finetune_hf.py``: examples/finetune_hf.py's ``main`` on several model directories in
one job (the process group made once), float64, under NCCL's message rules.

    python -m torch.distributed.run --standalone --nproc_per_node=4 tests/finetune_job.py ROOT ARCH:SCHEDULE ...

Each ``ARCH:SCHEDULE`` fine-tunes ``ROOT/ARCH`` (written by ``--make-tiny``) and exports to ``ROOT/ARCH-out``.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nccl_rules  # noqa: E402
from conftest import load_example  # noqa: E402

nccl_rules.install()
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "finetune_hf.py"

if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    example = load_example(EXAMPLE)
    root, runs = Path(sys.argv[1]), sys.argv[2:]
    for run in runs:
        arch, schedule = run.split(":")
        example.main(["--model-dir", str(root / arch), "--export", str(root / f"{arch}-out"), "--dtype", "float64",
                      "--schedule", schedule, "--steps", os.environ.get("STEPS", "3"), "--batch", "8", "--chunks",
                      "2", "--lr", os.environ.get("LR", "1e-3"),
                      "--optimizer", os.environ.get("OPTIMIZER", "adamw")])
    dist.destroy_process_group()
