"""The main path end to end (examples/finetune_hf.py): a transformers model saved as if downloaded, built on meta
under torchrun in stage mode, loaded per stage, fine-tuned on dynamically padded batches with the default
attention and a ``(total, count)`` loss, exported with ``save_pretrained`` by every process; ``from_pretrained`` of
the export equals the plain transformers model trained on the same batches (float64)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from conftest import load_example, run_script

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'pipeddp[test]')")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "finetune_hf.py"
JOB = Path(__file__).resolve().parent / "finetune_job.py"
STEPS = 3
LR = 0.5


def plain_training(example, model_dir: Path, divide_after: bool = False):
    """The original transformers model from ``model_dir``, trained on one device on the example's global batches:
    SGD on the token (or row) mean of each whole batch. ``divide_after``: the same mean, with the backward of the
    sum and the gradients divided by the count after it (equal in exact arithmetic)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    model = example.model_class(config).from_pretrained(model_dir, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    classify = config.architectures[0].endswith("ForSequenceClassification")
    for x, y in example.batches(0, STEPS, 8, 12, config.vocab_size, classify):
        opt.zero_grad()
        total, count = example.loss_fn(model(**x, use_cache=False), y)
        if divide_after:
            total.backward()
            for p in model.parameters():
                p.grad /= count
        else:
            (total / count).backward()
        opt.step()
    return model


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(600)
def test_the_export_of_a_stage_mode_fine_tune_equals_the_plain_model(tmp_path):
    """Llama and Qwen2 compute their norms in float32 (``LlamaRMSNorm`` casts), so their gradients carry float32
    roundings that depend on where the loss is divided by its count: the plain model itself moves by up to ~1e-8
    between dividing the loss and dividing its gradients. The bound is that floor of the reference's own (and 1e-10
    for GPT-2 and the row-counted classifier, whose floor is ~1e-16)."""
    from transformers import AutoConfig

    example = load_example(EXAMPLE)
    runs = {"llama": "1f1b", "qwen2": "zb", "gpt2": "interleaved", "llama-cls": "gpipe"}
    for arch in runs:
        example.make_tiny(arch, str(tmp_path / arch))
    stdout = run_script([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", JOB,
                         tmp_path, *(f"{a}:{s}" for a, s in runs.items())], ROOT, timeout=540, STEPS=str(STEPS),
                        LR=str(LR), OPTIMIZER="sgd")
    assert stdout.count("pipeddp: step ") == STEPS * len(runs), stdout[-3000:]  # rank 0 logs every step, alone
    for arch in runs:
        out = tmp_path / f"{arch}-out"
        config = AutoConfig.from_pretrained(out)
        tuned = example.model_class(config).from_pretrained(out, dtype=torch.float64)
        plain = plain_training(example, tmp_path / arch)
        floor = worst(plain.state_dict(), plain_training(example, tmp_path / arch, divide_after=True).state_dict())
        start = example.model_class(config).from_pretrained(tmp_path / arch, dtype=torch.float64).state_dict()
        assert worst(plain.state_dict(), start) > 1e-3, arch  # it trained
        assert floor < 1e-7, (arch, floor)
        assert worst(plain.state_dict(), tuned.state_dict()) <= max(1e-10, 2 * floor), arch
        x, _ = next(example.batches(5, 1, 4, 12, config.vocab_size, False))
        with torch.no_grad():
            a, b = plain(**x, use_cache=False).logits, tuned(**x, use_cache=False).logits
        assert (a - b).abs().max().item() <= max(1e-10, 100 * floor), arch
