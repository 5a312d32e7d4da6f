import pytest
import torch

from pipeddp.runtime.microbatch import Pieces, batch_size, merge, split, split_sizes


def test_chunks_uneven_and_larger_than_batch():
    assert split_sizes(10, chunks=4) == [3, 3, 2, 2]
    assert split_sizes(3, chunks=8) == [1, 1, 1]
    assert split_sizes(8, chunks=8) == [1] * 8
    assert split_sizes(10, split_size=4) == [4, 4, 2]
    assert split_sizes(12, split_size=4) == [4, 4, 4]
    assert split_sizes(3, split_size=16) == [3]


def test_sizes_match_tensor_split():
    for n in range(1, 30):
        for c in range(1, 12):
            expect = [len(p) for p in torch.arange(n).tensor_split(c) if len(p)]
            assert split_sizes(n, chunks=c) == expect


@pytest.mark.parametrize("kwargs", [{"chunks": 0}, {"chunks": -1}, {"split_size": 0}, {"chunks": 2, "split_size": 2}, {}])
def test_bad_settings(kwargs):
    with pytest.raises(ValueError):
        split_sizes(10, **kwargs)


def test_split_and_merge_trees():
    x = torch.arange(20.0).reshape(10, 2)
    batch = {"a": x, "b": (x[:, 0], [x * 2]), "flag": "keep"}
    pieces = split(batch, [3, 3, 2, 2])
    assert len(pieces) == 4
    assert pieces[1]["flag"] == "keep"
    assert torch.equal(pieces[1]["b"][1][0], (x * 2)[3:6])
    back = merge(pieces)
    assert torch.equal(back["a"], x) and torch.equal(back["b"][0], x[:, 0]) and torch.equal(back["b"][1][0], x * 2)


def test_batch_size_errors():
    with pytest.raises(ValueError, match="disagree"):
        batch_size((torch.zeros(4, 2), torch.zeros(5, 2)))
    with pytest.raises(ValueError, match="empty batch"):
        batch_size(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="no tensor"):
        batch_size(["x"])
    with pytest.raises(ValueError, match="0-dim"):
        batch_size(torch.tensor(1.0))
    assert batch_size({"x": torch.zeros(7, 1), "y": [torch.zeros(7)]}) == 7


def test_pieces_cut_when_read_as_split_cuts():
    # a step's targets, cut by the thread that reads them: the same pieces as torch.tensor_split's, trees included
    y = torch.randn(10, 3)
    batch = (y, {"mask": torch.arange(10)})
    for value in (y, batch):
        pieces = Pieces(value, [3, 3, 2, 2])
        assert len(pieces) == 4
        for i, expected in enumerate(split(value, [3, 3, 2, 2])):
            got = pieces[i]
            if isinstance(value, tuple):
                assert torch.equal(got[0], y.tensor_split(4)[i]) and torch.equal(got[1]["mask"], expected[1]["mask"])
            else:
                assert torch.equal(got, y.tensor_split(4)[i]) and got.data_ptr() == expected.data_ptr()
