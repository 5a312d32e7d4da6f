"""Mixed precision and torch.compile in stage threads and stage processes, against the plain model."""

import copy

import pytest
import torch
from torch import nn

import pipeddp
from conftest import data, make_mlp, reference_training
from amp_jobs import (LOSS, SeesDtype, batch, overflow_model, probe_model, stage_autocast_job,
                      stage_scaler_job)

DTYPES = [torch.bfloat16, torch.float16]


def seen(model):
    return {d for layer in model if isinstance(layer, SeesDtype) for d in layer.seen}


def plain_under_autocast(dtype, x, y, chunks=2):
    """The plain model run by hand over the engines' micro-batches (each under autocast, its loss weighted by
    its share of the batch): what a pipeline computes, in the same precision, so a tight tolerance holds."""
    model = probe_model()
    outs, total = [], 0.0
    for xi, yi in zip(torch.tensor_split(x, chunks), torch.tensor_split(y, chunks)):
        with torch.autocast("cpu", dtype=dtype):
            out = model(xi)
            loss = LOSS(out, yi) * (xi.shape[0] / x.shape[0])
        loss.backward()
        outs.append(out.detach())
        total = total + loss.detach()
    return model, torch.cat(outs), total


def close(a, b):
    """Equal up to the float32 rounding of a sum taken in another order (a gradient that is all zeros, or off by a
    16-bit rounding step, fails)."""
    assert b.abs().max() > 0, "the reference is all zeros: nothing would be tested"
    return torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_autocast_reaches_every_stage_of_a_pipeline(dtype):
    x, y = batch()
    ref, ref_out, ref_loss = plain_under_autocast(dtype, x, y)
    model = probe_model()
    with pipeddp.Pipeline(model, ["cpu"] * 3, chunks=2, balance=[1, 2, 2], checkpoint="except_last") as pipe:
        with torch.autocast("cpu", dtype=dtype):
            out = pipe(x)
            loss = pipe.train_step(x, y, LOSS)
        assert seen(model) == {dtype}  # every stage, forward and recompute: not float32
        assert out.dtype == dtype and close(out, ref_out)
        assert close(loss, ref_loss)
        for p, q in zip(pipe.parameters(), ref.parameters()):
            assert p.grad.dtype == torch.float32 and close(p.grad, q.grad)
        model[0].seen.clear()
        out = pipe(x)  # outside autocast again: float32
        assert out.dtype == torch.float32 and model[0].seen == [torch.float32] * 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_autocast_in_replica_mode(dtype):
    x, y = batch()
    ref, _, ref_loss = plain_under_autocast(dtype, x, y)
    model = probe_model()
    with pipeddp.HybridParallel(model, stages=2, chunks=2, balance=[2, 3], devices=["cpu"] * 2) as engine:
        with torch.autocast("cpu", dtype=dtype):
            loss = engine.train_step(x, y, LOSS)
        assert seen(model) == {dtype}
        assert close(loss, ref_loss)
        for p, q in zip(engine.parameters(), ref.parameters()):
            assert close(p.grad, q.grad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES)
def test_autocast_in_stage_mode(dtype):
    x, y = batch()
    ref, ref_out, ref_loss = plain_under_autocast(dtype, x, y)
    expect = dict(ref.named_parameters())
    for res in pipeddp.spawn(stage_autocast_job, 2, args=(str(dtype).split(".")[1],), timeout=100):
        assert res["seen"] == [str(dtype)], res  # the layers of this rank's stage
        assert abs(res["loss"] - ref_loss.item()) < 1e-6
        for name, g in res["grads"].items():
            assert close(g, expect[name].grad), name
        if res["rank"] == 1:
            assert res["out"].dtype == dtype and close(res["out"], ref_out)


def test_grad_scaler_skips_an_overflow_and_proceeds():
    model = overflow_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=2, balance=[2, 1]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for step in range(3):
            model[2].armed = step == 1
            x, y = batch(seed=10 + step, width=8)
            before = [p.detach().clone() for p in pipe.parameters()]
            opt.zero_grad()
            loss = pipe.train_step(x, y, LOSS, scaler=scaler)
            assert torch.isfinite(loss) and loss.item() < 10  # the returned loss is not scaled
            scaler.step(opt)
            scaler.update()
            changed = [not torch.equal(a, b) for a, b in zip(before, pipe.parameters())]
            assert (not any(changed)) if step == 1 else all(changed), step
            assert scaler.get_scale() == (2.0**9 if step >= 1 else 2.0**10)


def test_scaled_gradients_unscale_to_the_plain_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    x, y = batch(width=8)
    ref = copy.deepcopy(model)
    LOSS(ref(x), y).backward()
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=3) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        pipe.train_step(x, y, LOSS, scaler=scaler)
        scaler.unscale_(opt)
        for p, q in zip(pipe.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(120)
def test_an_overflow_on_one_stage_process_is_skipped_by_every_stage():
    results = pipeddp.spawn(stage_scaler_job, 2, args=(4,), timeout=100)
    for res in results:
        assert [h["changed"] for h in res["history"]] == [True, False, True, True], res
    scales = [[h["scale"] for h in res["history"]] for res in results]
    assert scales[0] == scales[1] == [2.0**10, 2.0**9, 2.0**9, 2.0**9]


def compiled_run(compile, checkpoint, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    batches = [batch(seed=s) for s in range(steps)]
    _, params = reference_training(model, batches, LOSS)
    expect = {name: p for (name, _), p in zip(model.named_parameters(), params)}
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=3, checkpoint=checkpoint, compile=compile) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for x, y in batches:
            opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            opt.step()
        assert all(st.call is not st.module for st in pipe.stages)  # compiled, once per stage
        return expect, pipe.state_dict()


@pytest.mark.timeout(600)
def test_compiled_stages_train_like_the_plain_model():
    """compile=True (inductor), with recompute for all but the last micro-batch (uneven: 8 over 3)."""
    expect, got = compiled_run(True, "except_last")
    for k, v in expect.items():
        assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), k


@pytest.mark.timeout(300)
def test_compile_options_reach_torch_compile():
    expect, got = compiled_run({"backend": "aot_eager"}, "always")
    for k, v in expect.items():
        assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), k
    with pytest.raises(ValueError, match="compile must be True, False or a dict"):
        pipeddp.Pipeline(nn.Sequential(nn.Linear(2, 2)), ["cpu"], compile="max-autotune")


class GraphCounter:
    """A torch.compile backend that runs each graph eagerly and counts the graphs dynamo hands it, per stage."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):  # no annotations: dynamo inspects backends
        self.graphs += 1
        return gm.forward


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n,per_mode", [(8, 1), (10, 2)])
def test_compiled_stages_keep_one_graph_per_mode(n, per_mode):
    # 4 stages, each in 3 modes (the forward of the last micro-batch keeps its graph, the others run without grad
    # and are replayed in backward), then an evaluation forward (a 4th mode: without grad, like the dropped
    # forwards, but not checkpointing, which a layer may read): 16 (stage, mode) pairs, above dynamo's limit of 8
    # recompiles for one code object. Each pair is compiled once (even micro-batches, 8 over 4), or once more for
    # a dynamic batch size (10 over 4: 3 3 2 2), and never again however many steps run.
    torch._dynamo.reset()
    counter = GraphCounter()
    model = make_mlp(depth=4)
    x, y = data(n)
    with pipeddp.Pipeline(model, ["cpu"] * 4, chunks=4, checkpoint="except_last", compile={"backend": counter},
                          schedule="zb") as pipe:
        counts = []
        for _ in range(3):
            pipe.train_step(x, y, LOSS)
            counts.append(counter.graphs)
        trained = [len(st.call.by_mode) for st in pipe.stages]
        with torch.no_grad():
            pipe(x)  # a forward without grad in training mode, not checkpointing: one more mode per stage
            pipe(x)
        modes = [len(st.call.by_mode) for st in pipe.stages]
        evaluated = counter.graphs
        with torch.no_grad():
            pipe(x)
    assert trained == [3, 3, 3, 3] and modes == [4, 4, 4, 4]
    assert len(set(counts)) == 1 and counter.graphs == evaluated  # nothing compiled after the first of each
    if per_mode == 1:
        assert counts[0] == sum(trained) and evaluated == sum(modes)
    else:  # a mode whose micro-batches come in two sizes compiles twice, the others once
        assert sum(modes) < counts[0] <= 2 * sum(modes)
