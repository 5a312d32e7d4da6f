"""The loss agreement at a step's end (``step_end``): the first rank posts its receives of the other ranks' rows as
soon as it has issued every message of the step's last pass (``ordering.when_issued``), so that a row sent by a rank
that finished earlier has landed before the first rank finishes its own last backward. Checked in real 2-process
stage-mode jobs under NCCL's rules for messages, with the step's loss and gradients against the plain model's."""

import copy
import time

import pytest
import torch
from torch import nn

import pipeddp
from pipeddp.distributed.ordering import Ordering, when_issued
from conftest import data, make_mlp, max_diff

#: how long the first stage's last backward lingers, so that the last stage's row is surely sent before it ends
LINGER = 0.2


class Lingering(nn.Module):
    """Identity whose backward waits ``LINGER`` s at every ``at``-th call (the step's last micro-batch on stage 0)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linger.apply(x, self)


class _Linger(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):  # type: ignore[override]
        ctx.owner = owner
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        ctx.owner.calls += 1
        if ctx.owner.calls % ctx.owner.at == 0:
            time.sleep(LINGER)
        return g, None


def ahead_job(accumulation: int):
    """Two steps of a float64 MLP over 2 stage processes (``accumulation`` passes of 2 micro-batches each), beside
    the plain model; on each rank, what the loss agreement's gathering holds of rank 1's row as ``finish_step``
    begins (rank 1's loss where it has landed, else 0)."""
    chunks, n = 2, 8
    plain = make_mlp()
    layers = list(plain)
    model = nn.Sequential(layers[0], Lingering(at=chunks * accumulation), *layers[1:])  # stage 0's last backward
    reference = copy.deepcopy(nn.Sequential(layers[0], Lingering(at=1 << 30), *layers[1:]))  # lingers
    engine = pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=chunks, balance=[3, 9],
                                    **({"global_batch": n, "batch_size": n // accumulation} if accumulation > 1
                                       else {}))
    seen = []
    real = engine.agreement.finish_step

    def finish_step(*args, gathering=None, **kwargs):
        seen.append(gathering.table[1, 0].item())  # rank 1's loss, where it landed already
        return real(*args, gathering=gathering, **kwargs)

    engine.agreement.finish_step = finish_step
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    losses, expected = [], []
    for step in range(2):
        x, y = data(n, seed=step)
        opt.zero_grad()
        losses.append(float(engine.train_step(x if engine.is_first else None, y if engine.is_last else None,
                                              nn.functional.mse_loss)))
        opt.step()
        ref_opt.zero_grad()
        ref_loss = nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        expected.append(ref_loss.item())
        ref_opt.step()
    ref = dict(reference.named_parameters())
    mine = dict(engine.named_parameters())
    diff = max_diff(list(mine.values()), [ref[k] for k in mine])
    engine.close()
    return {"seen": seen, "losses": losses, "expected": expected, "diff": diff, "held": sorted(mine)}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_last_stage_s_row_lands_while_the_first_stage_still_computes(accumulation):
    first, last = pipeddp.spawn(ahead_job, 2, args=(accumulation,), timeout=80)
    # the row rank 1 sent after its last backward was in rank 0's buffer before rank 0 began its loss agreement
    assert first["seen"] == pytest.approx(last["losses"], rel=1e-12), (first["seen"], last["losses"])
    for res in (first, last):
        assert res["losses"] == pytest.approx(res["expected"], rel=1e-12)
        assert res["diff"] < 1e-12 and res["held"], res
    assert first["held"] == ["0.bias", "0.weight"]


class _Link:
    """A channel as the order sees it (``ordering.Link``): posting a receive is all it does."""

    def __init__(self) -> None:
        self.rank, self.peer = 0, 1
        self.posted = []

    def post_next(self, j: int) -> None:
        self.posted.append(j)

    def post_ahead(self, j: int) -> bool:
        self.posted.append(j)
        return True


def test_when_issued_calls_once_the_last_run_s_order_is_wholly_issued():
    link, called = _Link(), []
    with when_issued(lambda: called.append(True), runs=2):
        Ordering([])  # an order with nothing to issue is no run
        first = Ordering([(link, 0), (link, 1)])
        first.issued()
        first.advance()  # wholly issued, but the first of two runs
        assert not called
        last = Ordering([(link, 0), (link, 1), (link, 2)])
        last.issued()
        assert not called
        last.advance()  # posts 1 and 2 ahead: wholly issued
        assert called == [True]
        last.advance()
        again = Ordering([(link, 0)])
        again.issued()
        assert called == [True]  # once
    after = Ordering([(link, 0)])
    after.issued()
    assert called == [True]  # nothing outside the block
    with when_issued(None):
        Ordering([(link, 0)]).issued()
