"""The settings both public classes take are checked once, with one message each, in every mode."""

from datetime import timedelta

import pytest
import torch
from torch import nn

import pipeddp
from conftest import data, make_mlp
from pipeddp.partitioning.solve import solve

LOSS = nn.functional.mse_loss


def build(kind, **kw):
    """The same settings through each public class (one process: stage mode runs a 1-stage pipeline here)."""
    stages = kw.pop("stages", 2)
    if kind == "pipeline":
        return pipeddp.Pipeline(kw.pop("model", make_mlp()), ["cpu"] * stages, **kw)
    if kind == "replica":
        return pipeddp.HybridParallel(kw.pop("model", make_mlp()), stages=stages, mode="replica",
                                      devices=["cpu"] * stages, **kw)
    return pipeddp.HybridParallel(kw.pop("model", make_mlp()), stages=1, mode="stage", devices=["cpu"], **kw)


KINDS = ["pipeline", "replica", "stage"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad,match", [
    (dict(checkpoint="alwayz"), r"checkpoint must be one of \('never', 'except_last', 'always'\), got 'alwayz'"),
    (dict(chunks=0), r"chunks must be an int >= 1 \(the number of micro-batches\), got 0"),
    (dict(split_size=2.5), r"split_size must be an int >= 1 \(samples per micro-batch\), got 2.5"),
    (dict(chunks=2, split_size=4), "give chunks= .* or split_size= .*, not both"),
    (dict(schedule="zigzag"), "unknown schedule 'zigzag'"),
    (dict(virtual_stages=2), "virtual_stages=2 needs a schedule that runs several stages per device"),
    (dict(virtual_stages=0), "virtual_stages must be an int >= 1"),
    (dict(timeout=-1.0), "timeout must be a positive number of seconds or a timedelta"),
    (dict(model=nn.Linear(2, 2)), "pipeddp cuts an nn.Sequential into stages, got Linear"),
    (dict(model=nn.Sequential()), "empty nn.Sequential"),
])
def test_a_bad_setting_is_refused_alike_everywhere(kind, bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build(kind, **bad)


STAGES_VS_LAYERS = "cannot cut 3 layers into 4 stages: every stage needs at least one layer; use at most 3 stages"


def test_more_stages_than_layers_has_one_message_everywhere():
    model = make_mlp(depth=2)  # 3 layers
    for make in (lambda: pipeddp.Pipeline(model, ["cpu"] * 4),
                 lambda: pipeddp.HybridParallel(model, stages=4, devices=["cpu"] * 4),
                 lambda: pipeddp.partition(model, 4, method="params"),
                 lambda: solve([1.0, 1.0, 1.0], 4)):
        with pytest.raises(ValueError, match=STAGES_VS_LAYERS):
            make()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("timeout", [30.0, 30, timedelta(seconds=30)])
def test_timeout_in_seconds_or_as_a_timedelta(kind, timeout):
    x, y = data(6)
    with build(kind, timeout=timeout, chunks=2) as engine:
        assert engine.settings.timeout == 30.0
        assert torch.isfinite(engine.train_step(x, y, LOSS))


@pytest.mark.parametrize("kind", KINDS)
def test_forward_means_the_same_in_both_classes(kind):
    """Under no_grad: an evaluation; with autograd (where one process has every stage): a pipelined graph."""
    model = make_mlp()
    x, y = data(7)
    with torch.no_grad():
        expect = model(x)
    with build(kind, model=make_mlp(), chunks=3) as engine:
        with torch.no_grad():
            assert (engine(x) - expect).abs().max().item() < 1e-12
        if kind != "pipeline":  # HybridParallel names its evaluation call too
            assert (engine.eval_step(x) - expect).abs().max().item() < 1e-12
        LOSS(engine(x), y).backward()
        ref = make_mlp()
        LOSS(ref(x), y).backward()
        for p, q in zip(engine.parameters(), ref.parameters()):
            assert (p.grad - q.grad).abs().max().item() < 1e-12


def test_auto_devices_fall_back_to_the_cpu_where_there_is_no_gpu():
    with pipeddp.HybridParallel(make_mlp(), stages=2, devices="auto", chunks=2) as engine:
        assert [d.type for d in engine.devices] == ["cpu", "cpu"] and engine.backend == "gloo"
        assert torch.isfinite(engine.train_step(*data(6), LOSS))


# -- no argument hangs: every bad argument is refused at once, naming itself ----------------------------------

BAD_EVERYWHERE = [
    (dict(threads=False), "threads must be an int >= 1"),
    (dict(threads=0), "threads must be an int >= 1"),
    (dict(threads=2.5), "threads must be an int >= 1"),
    (dict(threads="2"), "threads must be an int >= 1"),
    (dict(trace="yes"), "trace must be True or False"),
    (dict(deferred_batch_norm=1), "deferred_batch_norm must be True or False"),
    (dict(balance="fast"), "unknown balance 'fast'"),
    (dict(balance="time"), "balance='time' measures the model on a sample batch"),
    (dict(balance=[5, 5]), "balance .* sums to 10 but the model has 11 layers"),
    (dict(balance=[2, 3, 3, 3], schedule="interleaved", virtual_stages=3),
     "has 4 stages but the pipeline has .* virtual stages"),
    (dict(compile="max-autotune"), "compile must be True, False or a dict"),
]

BAD_HYBRID = [
    (dict(skip_nonfinite="no"), "skip_nonfinite must be True or False"),
    (dict(sync_batchnorm=None), "sync_batchnorm must be True or False"),
    (dict(ddp_kwargs=[("bucket_cap_mb", 1)]), "ddp_kwargs must be a dict"),
    (dict(ddp_kwargs={"bucket_size": 1}), r"ddp_kwargs has \['bucket_size'\], which DistributedDataParallel"),
    (dict(comm_hook=3), "comm_hook must be one of"),
    (dict(layout="ring"), "layout must be one of"),
    (dict(backend="mpi"), "backend must be 'nccl' or 'gloo'"),
]


def refused_within_a_second(make, match):
    began = __import__("time").monotonic()
    with pytest.raises((ValueError, TypeError), match=match):
        make()
    assert __import__("time").monotonic() - began < 1.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad,match", BAD_EVERYWHERE)
def test_a_bad_argument_is_refused_within_a_second_naming_itself(kind, bad, match):
    refused_within_a_second(lambda: build(kind, **bad), match)


@pytest.mark.parametrize("kind", ["replica", "stage"])
@pytest.mark.parametrize("bad,match", BAD_HYBRID)
def test_a_bad_hybrid_argument_is_refused_within_a_second_naming_itself(kind, bad, match):
    refused_within_a_second(lambda: build(kind, **bad), match)


def test_a_bad_mode_is_refused_within_a_second_naming_itself():
    refused_within_a_second(lambda: pipeddp.HybridParallel(make_mlp(), stages=2, mode="pipeline"),
                            "mode must be one of")


def test_a_sample_the_model_cannot_take_is_a_value_error_like_every_bad_argument():
    wrong = torch.randn(8, 5, dtype=torch.float64)  # the model takes 12 features
    for build in (lambda: pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, balance="time", sample=wrong, chunks=2),
                  lambda: pipeddp.partition(make_mlp(), 2, method="time", sample=wrong)):
        try:
            build()
        except ValueError as exc:
            assert "profiling the sample" in str(exc)
        else:
            pytest.fail("a sample the model cannot take was accepted")


def test_a_sample_the_model_cannot_take_says_what_was_profiled():
    from pipeddp.partitioning.profile import ProfileError

    wrong = torch.randn(8, 5, dtype=torch.float64)  # the model takes 12 features
    with pytest.raises(ProfileError) as info:
        pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, balance="time", sample=wrong, chunks=2)
    msg = str(info.value)
    assert "profiling the sample" in msg and "the sample (8, 5) float64, profiled on a micro-batch of it, " \
        "(4, 5) float64" in msg
    assert "layer 0 ('0', Linear) raised in its forward on an input of (4, 5) float64" in msg
    assert "mat1 and mat2 shapes cannot be multiplied" in msg
    assert isinstance(info.value.__cause__, RuntimeError)  # the layer's own error, with its traceback
