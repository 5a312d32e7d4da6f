"""Checkpoints of tensor-parallel stages: saved whole with the plain model's keys (one file, a Hugging Face
export), loaded per block, and a sharded checkpoint of one layout resumed in another (tp=2 -> tp=1 and back),
each compared with the plain model."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import pipeddp
from pipeddp.checkpoints import pretrained

pytest.importorskip("safetensors")

from tp_checkpoint_jobs import model, round_trips_job, stepped, write_inputs  # noqa: E402

TOL = 1e-12


def close(got, want) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].shape == want[k].shape and (got[k] - want[k]).abs().max().item() <= TOL, k


def close_share(got, want) -> None:
    """``got``: one stage's entries (a process's optimizer state), each equal to ``want``'s."""
    assert got and set(got) <= set(want)
    close(got, {k: want[k] for k in got})


def check_blocks(parts, want, t: int) -> None:
    """Each process holds its block of ``want`` (column-parallel: rows; row-parallel: columns), the rest whole."""
    for k, (placements, local) in parts.items():
        found = re.search(r"Shard\(dim=(\d)\)", placements)
        expected = torch.chunk(want[k], 2, int(found.group(1)))[t] if found else want[k]
        assert torch.equal(local, expected), (k, placements)


@pytest.mark.timeout(240)
def test_tensor_parallel_checkpoints_round_trip_between_layouts(tmp_path):
    tmp = str(tmp_path)
    write_inputs(tmp)
    results = pipeddp.spawn(round_trips_job, 4, args=(tmp,), timeout=200)
    ref = stepped(0, grads=1)
    want = ref.state_dict()
    grads = {k: p.grad for k, p in ref.named_parameters()}  # the first step's momentum buffer is the gradient

    for res in results:
        check_blocks(res["parts"], want, res["tp"])  # the step each process took on its blocks is the plain one's

    # one file, written once: the plain model's keys, whole tensors, loaded strictly by the plain model
    ck = torch.load(os.path.join(tmp, "one.pt"), weights_only=True)
    close(ck["model"], want)
    close({k: v["momentum_buffer"] for k, v in ck["optimizer"]["state"].items()}, grads)
    assert ck["meta"]["tp"] == 2 and len(ck["rng"]) == 2
    plain = model(9)
    plain.load_state_dict(ck["model"])

    # the Hugging Face export: one file per process, an index, every tensor once and whole
    hf = os.path.join(tmp, "hf")
    names = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert results[0]["written"] == sorted(names + [pretrained.INDEX])
    index = json.loads(open(os.path.join(hf, pretrained.INDEX)).read())["weight_map"]
    assert sorted(index) == sorted(want) and sorted(set(index.values())) == names
    from safetensors.torch import load_file

    exported = {}
    for name in names:
        exported.update(load_file(os.path.join(hf, name)))
    close(exported, want)

    # loaded per block: a pipeddp file and a Hugging Face directory of other weights; a wrong model refused
    for res in results:
        for what, seed in (("from_file", 3), ("from_hf", 4)):
            parts, whole = res[what]
            check_blocks(parts, model(seed).state_dict(), res["tp"])
            close(whole, model(seed).state_dict())
        assert "6.weight" in res["refused"] and "Nothing was loaded" in res["refused"]
        close(res["after_refusal"], model(4).state_dict())

    # tp2 -> tp1 (2 replicas x 2 stages): the sharded checkpoint and the file, weights and optimizer state
    for res in results:
        assert res["tp1_extra"] == {"step": 1}
        for what in ("tp1_sharded", "tp1_file"):
            state, buffers = res[what]
            close(state, want)
            close_share(buffers, grads)
        # and back: tp1's sharded checkpoint resumed at tp2
        assert res["back_extra"] == {"step": 2}
        parts, state, buffers = res["back"]
        check_blocks(parts, want, res["tp"])
        close(state, want)
        close_share(buffers, grads)


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
