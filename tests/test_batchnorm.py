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


BATCHES = [data(10, seed=3), data(10, seed=4)]  # 10 over 4 micro-batches: 3 3 2 2


def deferred_statistics(kind, momentum, checkpoint):
    """Two training steps (no optimizer step) with deferred_batch_norm; this process's running statistics."""
    model = bn_model(momentum)
    if kind == "pipeline":
        engine = pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=4, balance=[3, 4], checkpoint=checkpoint,
                                  deferred_batch_norm=True)
    else:  # replica: one process, stage threads; stage: two processes, one stage each
        engine = pipeddp.HybridParallel(model, stages=2, mode=kind, chunks=4, balance=[3, 4], checkpoint=checkpoint,
                                        deferred_batch_norm=True, **({"devices": ["cpu"] * 2} if kind == "replica"
                                                                     else {}))
    with engine:
        for x, y in BATCHES:
            engine.train_step(x, y, LOSS)
        own = engine.local_state_dict()  # this process's layers only
        return {k: v.clone() for k, v in own.items() if "running" in k or "num_batches" in k}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("kind", ["pipeline", "replica", "stage"])
def test_deferred_statistics_equal_whole_batch_forwards(momentum, checkpoint, kind):
    """The first BatchNorm sees the same inputs as in the plain model, so its statistics match to float64 rounding
    (the batch's moments are summed from the micro-batches'; 1e-12).

    (A later one sees inputs normalised with micro-batch statistics, as in any micro-batching pipeline.)
    """
    expect = plain_statistics(bn_model(momentum), BATCHES, "1.")
    if kind == "stage":  # layer 1 lives in rank 0, layer 4 in rank 1
        first, second = pipeddp.spawn(deferred_statistics, 2, args=(kind, momentum, checkpoint), timeout=100)
        assert not any(k.startswith("4.") for k in first) and not any(k.startswith("1.") for k in second)
        found = {**first, **second}
    else:
        found = deferred_statistics(kind, momentum, checkpoint)
    got = {k: v for k, v in found.items() if k.startswith("1.")}
    assert found["4.num_batches_tracked"].item() == 2  # the later one: once per batch too
    assert list(got) == list(expect) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    for k in expect:
        assert (got[k].double() - expect[k].double()).abs().max().item() < 1e-12, k
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
