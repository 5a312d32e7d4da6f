"""Checkpoints of tensor-parallel stages (``DTensor`` parameters over ``tp``): saved whole with the original model's
keys (one file, a Hugging Face export), loaded block by block, and a sharded checkpoint of one layout resumed in
another (tp=2 -> tp=1 and back), each compared with transformers' own model."""

from __future__ import annotations

import os

import pytest
import torch

import pipeddp

pytest.importorskip("safetensors")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'pipeddp[test]')")

from tp_checkpoint_jobs import LR, llama_config, llama_round_trips_job, lm_batch, lm_loss, save_downloaded  # noqa: E402

TOL = 1e-12


def close(got, want) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape and (got[k] - want[k]).abs().max().item() <= TOL, k


def test_a_file_written_block_by_block_reads_back_whole_with_safetensors(tmp_path):
    """The header first, then each tensor's blocks in any order (rows, columns, blocks of a 3-D tensor, whole
    ones): safetensors' own reader returns every tensor whole, dtypes of several widths aligned."""
    from safetensors.torch import load_file

    from pipeddp.checkpoints.slices import Layout, create_file, write_block

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(8, 6, dtype=torch.float64, generator=g),
               "x": torch.randn(5, 3, 4, generator=g).to(torch.bfloat16), "n": torch.arange(7, dtype=torch.int32),
               "s": torch.tensor(3.5), "e": torch.empty(0, 4), "m": torch.rand(3, 3, generator=g) > 0.5}
    layout = Layout.of({k: (v.dtype, v.shape) for k, v in tensors.items()})
    path = str(tmp_path / "model.safetensors")
    create_file(path, layout)
    fd = os.open(path, os.O_WRONLY)
    try:
        for c in (4, 0, 2):  # column blocks, as Shard(1) over 3 ranks
            write_block(fd, layout, "w", tensors["w"][:, c:c + 2], ((0, c), (8, 2)))
        for r, rows in ((2, 3), (0, 2)):  # and blocks cut along all three dimensions of a 3-D one
            for o1, s1, o2, s2 in ((0, 2, 0, 4), (2, 1, 2, 2), (2, 1, 0, 2)):
                write_block(fd, layout, "x", tensors["x"][r:r + rows, o1:o1 + s1, o2:o2 + s2], ((r, o1, o2),
                                                                                                 (rows, s1, s2)))
        for k in "nsem":
            write_block(fd, layout, k, tensors[k], None)
    finally:
        os.close(fd)
    back = load_file(path)
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


@pytest.mark.timeout(240)
def test_a_tensor_parallel_llama_round_trips_through_every_format_and_layout(tmp_path):
    """HybridParallel(mesh=(dp, pp, tp), tp_plan="auto") on a transformers Llama: the downloaded directory read block
    by block; after one step saved at pp2 x tp2 as one file (loads strictly into LlamaForCausalLM), a Hugging Face
    export (from_pretrained opens it) and a sharded checkpoint; pp2 x tp1 loads the file and the sharded one, and a
    fresh pp2 x tp2 loads what tp1 saved. Weights, momentum and logits equal transformers' model after the same
    step; a wrong file is refused on every rank and changes nothing."""
    from transformers import LlamaForCausalLM

    from pipeddp.checkpoints import checkpoint as files

    tmp = str(tmp_path)
    save_downloaded(os.path.join(tmp, "downloaded"))
    ref = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "downloaded"), dtype=torch.float64)
    probe, (x, y) = lm_batch(3, 2)[0], lm_batch(4, 1)
    with torch.no_grad():
        before = ref(input_ids=probe).logits
    lm_loss(ref(input_ids=x, use_cache=False), y).backward()
    torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9).step()
    with torch.no_grad():
        after = ref(input_ids=probe).logits
    want = ref.state_dict()
    grads = {k: p.grad for k, p in ref.named_parameters()}  # a first step's momentum buffer
    wrong = dict(want, **{"model.norm.weight": torch.zeros(33, dtype=torch.float64)})
    files.atomic_save({"format": files.FORMAT, "model": wrong, "optimizer": None, "extra": {}, "rng": [], "meta": {}},
                      os.path.join(tmp, "wrong.pt"))

    results = pipeddp.spawn(llama_round_trips_job, 4, args=(tmp,), timeout=200)

    for res in results:
        # each process read only its blocks of the sharded tensors
        blocks = dict(res["read"])
        assert res["shapes"] and set(res["shapes"]) <= set(blocks)
        for k, shape in res["shapes"].items():
            assert blocks[k] is not None and tuple(blocks[k][1]) == shape, k
        assert any(shape != tuple(want[k].shape) for k, shape in res["shapes"].items())
        # every load's logits are transformers' (the last stage's processes hold them)
        for what, got in res["logits"].items():
            if got is not None:
                expected = before if what == "tp2 from the directory" else after
                assert (got - expected).abs().max().item() < 1e-10, what
        assert "model.norm.weight" in res["refused"] and "Nothing was loaded" in res["refused"]
        assert res["gathered"] == []  # save_pretrained wrote every block in place: no tensor was whole in memory
    assert sum(got is not None for res in results for got in res["logits"].values()) == 2 * 6

    # each one-file checkpoint: tp2's own, tp1's of the tp2 sharded one, tp2's of the tp1 sharded one
    for name in ("tp2.pt", "tp1.pt", "back.pt"):
        ck = torch.load(os.path.join(tmp, name), weights_only=True)
        close(ck["model"], want)
        close({k: v["momentum_buffer"] for k, v in ck["optimizer"]["state"].items()}, grads)
        plain = LlamaForCausalLM(llama_config()).double()
        plain.load_state_dict(ck["model"], strict=True)
        with torch.no_grad():
            assert (plain(input_ids=probe).logits - after).abs().max().item() < 1e-10, name
    # the export opens with from_pretrained
    tuned = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "export"), dtype=torch.float64)
    close(tuned.state_dict(), want)
    with torch.no_grad():
        assert (tuned(input_ids=probe).logits - after).abs().max().item() < 1e-10
