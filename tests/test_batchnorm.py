"""BatchNorm running statistics: once per batch with deferred_batch_norm, never from a recompute."""

import copy

import pytest
import torch
from torch import nn

import pipeddp
from conftest import data

LOSS = nn.functional.mse_loss


def bn_model(momentum=0.1) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 12), nn.BatchNorm1d(12, momentum=momentum), nn.ReLU(), nn.Linear(12, 12),
                         nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 12)).double()


def statistics(module, layer=None):
    """Running statistics (of one layer, e.g. "1.", or all)."""
    return {k: v.clone() for k, v in module.state_dict().items()
            if ("running" in k or "num_batches" in k) and (layer is None or k.startswith(layer))}


def plain_statistics(model, batches, layer=None):
    """The plain model after whole-batch forwards in training mode."""
    model = copy.deepcopy(model).train()
    with torch.no_grad():
        for x, _ in batches:
            model(x)
    return statistics(model, layer)


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("kind", ["pipeline", "replica", "stage"])
def test_deferred_statistics_equal_whole_batch_forwards(momentum, checkpoint, kind):
    """The first BatchNorm sees the same inputs as in the plain model, so its statistics must match exactly.

    (A later one sees inputs normalised with micro-batch statistics, as in any micro-batching pipeline.)
    """
    model = bn_model(momentum)
    batches = [data(10, seed=3), data(10, seed=4)]  # 10 over 4 micro-batches: 3 3 2 2
    expect = plain_statistics(model, batches, "1.")
    if kind == "pipeline":
        engine = pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=4, balance=[3, 4],
                                  checkpoint=checkpoint, deferred_batch_norm=True)
    elif kind == "replica":
        engine = pipeddp.HybridParallel(copy.deepcopy(model), stages=2, chunks=4, balance=[3, 4], devices=["cpu"] * 2,
                                        checkpoint=checkpoint, deferred_batch_norm=True)
    else:
        engine = pipeddp.HybridParallel(copy.deepcopy(model), stages=1, mode="stage", chunks=4, devices=["cpu"],
                                        checkpoint=checkpoint, deferred_batch_norm=True)
    with engine:
        for x, y in batches:
            engine.train_step(x, y, LOSS)  # no optimizer step: the plain forwards saw the same weights
        got = statistics(engine, "1.")
        assert statistics(engine, "4.")["4.num_batches_tracked"].item() == 2  # the later one: once per batch too
    assert list(got) == list(expect) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    for k in expect:
        assert (got[k].double() - expect[k].double()).abs().max().item() < 1e-9, k
    assert got["1.num_batches_tracked"].item() == 2


def test_micro_batch_statistics_are_updated_once_per_micro_batch_even_under_recompute():
    """Without deferral each micro-batch updates the statistics once: a recompute adds nothing."""
    counts = {}
    for checkpoint in ("never", "always"):
        with pipeddp.Pipeline(bn_model(), ["cpu", "cpu"], chunks=4, balance=[3, 4], checkpoint=checkpoint) as pipe:
            pipe.train_step(*data(12), LOSS)
            counts[checkpoint] = statistics(pipe)
    assert counts["never"]["1.num_batches_tracked"].item() == 4  # before: 8 under recompute
    for k in counts["never"]:
        assert torch.equal(counts["never"][k], counts["always"][k]), k


def test_deferred_statistics_leave_the_normalisation_to_each_micro_batch():
    """The output still normalises each micro-batch with its own statistics (as BatchNorm in a pipeline does)."""
    model = bn_model()
    x, y = data(8)
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=2, balance=[3, 4],
                          deferred_batch_norm=True) as pipe:
        out = pipe(x)
    ref = copy.deepcopy(model).train()
    expect = torch.cat([ref(x[:4]), ref(x[4:])])
    assert (out - expect).abs().max().item() < 1e-12


def test_a_step_that_fails_leaves_no_half_batch_behind():
    class FailsOnce(nn.Module):
        def __init__(self):
            super().__init__()
            self.armed = True

        def forward(self, x):
            if self.armed:
                self.armed = False
                raise RuntimeError("boom")
            return x

    model = bn_model()
    fails = FailsOnce()
    model.append(fails)
    batches = [data(10, seed=3)]
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=4, balance=[3, 5],
                          deferred_batch_norm=True) as pipe:
        with pytest.raises(RuntimeError, match="boom"):
            pipe.train_step(*batches[0], LOSS)
        pipe.train_step(*batches[0], LOSS)
        got = statistics(pipe, "1.")
    expect = plain_statistics(bn_model(), batches, "1.")  # the same model without the failing layer
    for k in expect:
        assert (got[k].double() - expect[k].double()).abs().max().item() < 1e-9, k
