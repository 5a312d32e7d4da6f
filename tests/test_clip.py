"""``clip_grad_norm_``: the plain model's norm and clip factor, however the model is cut (``runtime/clip.py``).

The multi-process case (stage mode, the tied weight in two processes) is in ``test_tied.py``.
"""

import copy

import pytest
import torch
from conftest import CountOps, max_diff
from tied_jobs import LOSS, global_batches, reference_state, tied_model

import pipeddp


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_counts_a_tied_weight_once(norm_type):
    """The engine's norm and clip equal torch's on the plain model; torch's over the pipeline's copies differs."""
    model, clip = tied_model(), 0.05
    norms = []
    expect = reference_state(model, global_batches(), clip=clip, norm_type=norm_type, norms=norms)
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=3, balance=[2, 3]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        got_norms = []
        for x, y in global_batches():
            opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            naive = torch.nn.utils.get_total_norm([p.grad for p in pipe.parameters()], norm_type) \
                if hasattr(torch.nn.utils, "get_total_norm") else None
            got_norms.append(pipe.clip_grad_norm_(clip, norm_type).item())
            if naive is not None and norm_type != float("inf"):
                assert abs(naive.item() - got_norms[-1]) > 1e-3  # the tied copy counted twice
            opt.step()
        got = pipe.state_dict()
    assert min(norms) > clip  # every step was clipped
    assert got_norms == pytest.approx(norms, rel=1e-12)
    assert max_diff(expect.values(), got.values()) < 1e-12


def test_clip_grad_norm_rejects_a_bad_order_and_a_nonfinite_norm():
    with pipeddp.Pipeline(tied_model(), ["cpu", "cpu"], chunks=3, balance=[2, 3]) as pipe:
        x, y = global_batches(1)[0]
        pipe.train_step(x, y, LOSS)
        for bad in (0, -1.0, float("-inf"), float("nan")):
            with pytest.raises(ValueError, match="norm_type"):
                pipe.clip_grad_norm_(1.0, bad)
        pipe.stages[0].module[0].weight.grad[0, 0] = float("nan")
        with pytest.raises(RuntimeError, match="error_if_nonfinite"):
            pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)


def test_clip_grad_norm_without_ties_on_three_stages_equals_the_plain_model():
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) if i % 2 == 0 else torch.nn.Tanh() for i in range(6))).double()
    norms = []
    expect = reference_state(model, global_batches(), clip=0.05, norms=norms)
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu"] * 3, chunks=4, balance=[2, 2, 2]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        got_norms = []
        for x, y in global_batches():
            opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            got_norms.append(pipe.clip_grad_norm_(0.05).item())
            opt.step()
        got = pipe.state_dict()
    assert min(norms) > 0.05 and got_norms == pytest.approx(norms, rel=1e-12)
    assert max_diff(expect.values(), got.values()) < 1e-12


def test_clip_grad_norm_takes_the_norms_and_scales_in_one_call_each_not_one_per_parameter():
    """As torch's ``clip_grad_norm_``: ``_foreach_norm`` and ``_foreach_mul_`` over the gradients (of one device and
    dtype), not a norm and a multiply per parameter (what it was); the norm still equals the plain model's."""
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(6))).double()
    x, y = global_batches(1)[0]
    plain = copy.deepcopy(model)
    LOSS(plain(x), y).backward()
    expect = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)
    with pipeddp.Pipeline(model, ["cpu"] * 2, chunks=2, balance=[3, 3]) as pipe:
        pipe.train_step(x, y, LOSS)
        with CountOps() as counted:
            norm = pipe.clip_grad_norm_(0.01)
        assert norm.item() == pytest.approx(expect.item(), rel=1e-12)
        assert max_diff([p.grad for p in pipe.parameters()], [p.grad for p in plain.parameters()]) < 1e-12
    assert counted.ops["_foreach_norm"] == 1 and counted.ops["_foreach_mul_"] == 1, counted.ops
    assert counted.ops["linalg_vector_norm"] == 0 and counted.ops["mul_"] == 0, counted.ops
