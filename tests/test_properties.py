"""Property-based: whatever the settings, the pipeline equals the plain model or says what to change."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import pipeddp
from conftest import make_mlp, max_diff

LOSS = nn.functional.mse_loss
MODEL = make_mlp(width=6, depth=3)  # 5 layers


@st.composite
def configs(draw):
    batch = draw(st.integers(min_value=0, max_value=12))
    how = draw(st.sampled_from(["chunks", "split_size", "default"]))
    chunks = draw(st.integers(min_value=-1, max_value=10)) if how == "chunks" else None
    split_size = draw(st.integers(min_value=-1, max_value=13)) if how == "split_size" else None
    stages = draw(st.integers(min_value=1, max_value=6))
    balance = draw(st.one_of(
        st.none(), st.sampled_from(["uniform", "params"]),
        st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=6),
    ))
    schedule = draw(st.sampled_from(["gpipe", "1f1b"]))
    checkpoint = draw(st.sampled_from(["never", "always"]))
    return batch, chunks, split_size, stages, balance, schedule, checkpoint


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_pipeline_equals_plain_or_raises_a_clear_error(cfg):
    batch, chunks, split_size, stages, balance, schedule, checkpoint = cfg
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 6, dtype=torch.float64, generator=g)
    y = torch.randn(batch, 6, dtype=torch.float64, generator=g)
    try:
        pipe = pipeddp.Pipeline(copy.deepcopy(MODEL), ["cpu"] * stages, chunks=chunks, split_size=split_size,
                                balance=balance, schedule=schedule, checkpoint=checkpoint)
    except (ValueError, TypeError) as exc:
        bad_balance = isinstance(balance, list) and (sum(balance) != 5 or len(balance) != stages or 0 in balance)
        # what is wrong, and the words a message about it must hold (the setting it names, or what to do)
        wrong = {"stages": stages > 5, "balance": bad_balance, "chunks": chunks is not None and chunks < 1,
                 "split_size": split_size is not None and split_size < 1}
        assert any(wrong.values()), f"rejected a valid configuration: {exc}"
        words = {"stages": "use at most 5 stages", "balance": "balance", "chunks": "chunks must be an int >= 1",
                 "split_size": "split_size must be an int >= 1"}
        assert any(words[k] in str(exc) for k, bad in wrong.items() if bad), f"{wrong}: {exc}"
        return
    with pipe:
        try:
            pipe.train_step(x, y, LOSS)
        except ValueError as exc:
            assert batch == 0 and "empty" in str(exc)
            return
        ref = copy.deepcopy(MODEL)
        LOSS(ref(x), y).backward()
        assert max_diff([p.grad for p in ref.parameters()], [p.grad for p in pipe.parameters()]) < 1e-12
        with torch.no_grad():
            assert (pipe(x) - ref(x)).abs().max().item() < 1e-12


def test_nonfinite_step_is_skipped_and_reported():
    with pipeddp.HybridParallel(make_mlp(), stages=2, chunks=3, skip_nonfinite=True) as engine:
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        before = [p.detach().clone() for p in engine.parameters()]
        x = torch.randn(6, 12, dtype=torch.float64)
        x[4, 3] = float("nan")
        with pytest.warns(RuntimeWarning, match=r"skipped a training step: non-finite loss on rank\(s\) \[0\]"):
            loss = engine.train_step(x, torch.randn(6, 12, dtype=torch.float64), LOSS)
        assert not torch.isfinite(loss)
        assert all(p.grad is None for p in engine.parameters())
        opt.step()
        assert max_diff(before, list(engine.parameters())) == 0.0
        assert engine.skipped_steps == 1
        # a finite step afterwards trains normally
        loss = engine.train_step(torch.randn(6, 12, dtype=torch.float64), torch.randn(6, 12, dtype=torch.float64), LOSS)
        assert torch.isfinite(loss) and all(p.grad is not None for p in engine.parameters())
