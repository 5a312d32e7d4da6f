"""``save_pretrained``: a fine-tuned model leaves as a Hugging Face directory, every process writing its own tensors;
transformers' ``from_pretrained`` of the original class opens it and equals the plain model trained alike."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import pipeddp
from pipeddp.checkpoints import export, pretrained
from pipeddp.tools.models import flatten_sequential

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'pipeddp[test]')")
pytest.importorskip("safetensors")

from export_jobs import batches, lm_loss, model_class, plain_training, save_downloaded, stage_job  # noqa: E402


def file_keys(path: str):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return sorted(f.keys())


def assert_equal_models(plain, tuned, n: int = 4) -> None:
    """Every parameter and buffer, and the logits on a batch, within 1e-10 (float64)."""
    want, got = plain.state_dict(), tuned.state_dict()
    assert sorted(want) == sorted(got)
    worst = max((want[k] - got[k]).abs().max().item() for k in want)
    assert worst < 1e-10, worst
    x, _ = batches(1, n, seed=5)[0]
    with torch.no_grad():
        assert (plain(input_ids=x).logits - tuned(input_ids=x).logits).abs().max().item() < 1e-10


@pytest.mark.timeout(300)
def test_stage_mode_exports_each_stage_from_its_own_processes(tmp_path):
    """2 replicas x 2 stages built on meta, loaded per stage, trained two steps, exported by all four processes: a
    tied Llama (DDP) and a GPT-2 whose stages are sharded over their replicas (shard="full")."""
    steps, n = 2, 4
    runs = []
    for kind, shard in (("llama", "none"), ("gpt2", "full")):
        save_downloaded(kind, str(tmp_path / kind))
        runs.append((kind, str(tmp_path / kind), str(tmp_path / f"{kind}-tuned"), shard))
    refused = tmp_path / "notes"
    refused.mkdir()
    (refused / "notes.txt").write_text("mine")
    results = pipeddp.spawn(stage_job, 4, args=(runs, steps, n, str(refused)), timeout=270)

    for kind, _, target, _ in runs:
        shards = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]  # one per process
        assert sorted(os.listdir(target)) == ["config.json", "generation_config.json", *shards, pretrained.INDEX]
        cls = model_class(kind)
        tuned = cls.from_pretrained(target, dtype=torch.float64)
        assert json.loads((tmp_path / f"{kind}-tuned" / "config.json").read_text())["architectures"] == [cls.__name__]
        assert tuned.lm_head.weight is tuned.get_input_embeddings().weight  # still tied
        assert_equal_models(plain_training(kind, str(tmp_path / kind), steps, n), tuned)
        # each process wrote one file, of its own stage's tensors; every tensor once; the head not at all
        index = json.loads((tmp_path / f"{kind}-tuned" / pretrained.INDEX).read_text())["weight_map"]
        assert "lm_head.weight" not in index
        per_rank = {r["rank"]: [keys for name, keys in r["written"] if name.startswith(f"{kind}-tuned/")]
                    for r in results}
        everything = []
        for res in results:
            files = per_rank[res["rank"]]
            assert len(files) == 1 and files[0] and set(files[0]) <= set(res["own"][kind])
            everything += files[0]
        assert sorted(everything) == sorted(index)
        for name in set(index.values()):
            assert file_keys(os.path.join(target, name)) == sorted(k for k, v in index.items() if v == name)

    # refusals, on every rank alike: a directory holding other files (left as it was); a rank calling another
    assert os.listdir(refused) == ["notes.txt"] and not os.path.exists(str(refused) + "-other")
    for res in results:
        first, second = res["refusals"]
        assert "holds files that are not a Hugging Face export's (['notes.txt'])" in first
        assert "CollectiveError" not in first and "entered different collective calls" in second
        assert "save_pretrained" in second and "state_dict" in second


def test_a_pipeline_exports_in_one_process_over_an_earlier_export(tmp_path):
    """A GPT-2 flattened with its weights (not on meta), one process: on one device (the head and the embedding one
    tensor there) and on two (a copy on the second); an earlier save_pretrained in more shards is replaced."""
    steps, n = 1, 4
    source = str(tmp_path / "gpt2")
    save_downloaded("gpt2", source)
    plain = plain_training("gpt2", source, steps, n)
    for devices in (["cpu"], ["cpu", "cpu"]):
        target = str(tmp_path / f"tuned-{len(devices)}")
        save_downloaded("gpt2", target)  # an earlier export there: other shards, to be replaced whole
        model = model_class("gpt2").from_pretrained(source, dtype=torch.float64)
        with pipeddp.Pipeline(flatten_sequential(model, {"input_ids": batches(1, n)[0][0]}), devices,
                              chunks=2) as pipe:
            opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
            for x, y in batches(steps, n):
                opt.zero_grad()
                pipe.train_step(x, y, lm_loss)
                opt.step()
            pipe.save_pretrained(target)
        assert sorted(os.listdir(target)) == ["config.json", "generation_config.json",
                                              "model-00001-of-00001.safetensors", pretrained.INDEX]
        assert_equal_models(plain, model_class("gpt2").from_pretrained(target, dtype=torch.float64))


def test_a_weight_at_four_places_is_written_once_under_the_name_transformers_keeps(tmp_path):
    """T5's embedding is ``shared``, the encoder's and the decoder's ``embed_tokens`` and the head. The engine's first
    place is the encoder's, which transformers calls a later place of ``shared``: on one device all four are one
    tensor, over two stages the others are copies; either way ``shared`` is a later place to the engine."""
    from hf_jobs import batch, logits, t5

    model = t5().eval()
    x, _ = batch("t5", 4, 0)
    flat = flatten_sequential(model, x)
    for devices in (["cpu"], ["cpu", "cpu"]):
        target = str(tmp_path / f"t5-{len(devices)}")
        with pipeddp.Pipeline(flat, devices, chunks=2) as pipe:
            assert "shared.weight" in pipe.tied_keys()  # a later place: the encoder's tensor, or a copy of it
            pipe.save_pretrained(target)
        index = json.loads((tmp_path / f"t5-{len(devices)}" / pretrained.INDEX).read_text())["weight_map"]
        assert [k for k in index if k.endswith("embed_tokens.weight") or k in ("shared.weight", "lm_head.weight")
                ] == ["shared.weight"]
        back = type(model).from_pretrained(target, dtype=torch.float64).eval()
        want, got = model.state_dict(), back.state_dict()
        assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
        with torch.no_grad():
            assert (logits(model, x) - logits(back, x)).abs().max().item() < 1e-12


def test_a_model_not_from_transformers_gets_the_shards_and_the_index(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).double()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    target = str(tmp_path / "plain")
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=2) as pipe:
        pipe.save_pretrained(target)
    assert sorted(os.listdir(target)) == ["model-00001-of-00001.safetensors", pretrained.INDEX]
    from safetensors.torch import load_file

    got = load_file(os.path.join(target, "model-00001-of-00001.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_refusals_and_a_failed_writer_leave_no_directory_that_looks_complete(tmp_path, monkeypatch):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=2) as pipe:
        a_file = tmp_path / "file"
        a_file.write_text("mine")
        with pytest.raises(ValueError, match="is not a directory"):
            pipe.save_pretrained(str(a_file))
        target = str(tmp_path / "out")
        pipe.save_pretrained(target)
        assert pretrained.is_pretrained(target)

        def killed(path, layout):  # a writer that dies half-way through making its file
            with open(path + ".tmp", "wb") as f:
                f.write(b"\0" * 10)
            raise OSError("No space left on device")

        monkeypatch.setattr(export, "_create_file", killed)
        with pytest.raises(RuntimeError, match="No space left on device"):
            pipe.save_pretrained(target)
    assert not pretrained.is_pretrained(target)  # the earlier export lost its index first; the new one has none
    assert pretrained.INDEX not in os.listdir(target)
