"""examples/train_hf.py: a transformers causal LM trained with HybridParallel learns, and its checkpoint loads
back into the transformers class (strict), also as a directory that --model-dir reads again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_example

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'pipeddp[test]')")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_hf.py"
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--context", "32", "--batch", "8", "--chunks", "2",
        "--log-every", "100"]


@pytest.mark.timeout(300)
def test_loss_falls_and_weights_load_back_into_transformers(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    ex = load_example(EXAMPLE)
    out, saved = tmp_path / "ckpt.pt", tmp_path / "pretrained"
    result = ex.main(["--text", str(text), "--steps", "30", "--out", str(out), "--save-pretrained", str(saved),
                      *TINY])
    printed = capsys.readouterr().out
    assert "opened into 5 layers: embed model_layers_0 model_layers_1 model_norm lm_head" in printed
    assert result["last"] < result["first"] - 1.5, result
    assert abs(result["loaded_back"] - result["held_out"]) < 1e-4
    model = AutoModelForCausalLM.from_pretrained(saved)
    model.load_state_dict(torch.load(out, weights_only=True)["model"], strict=True)

    again = ex.main(["--text", str(text), "--steps", "3", "--model-dir", str(saved), "--out", str(out), *TINY])
    assert again["losses"][0] < result["first"] - 1.0  # it starts where the first run ended
