"""Weights shared by several stages, modules used twice, and residuals across stages, against the plain model."""

import copy

import pytest
import torch
from torch import nn

import pipeddp
from conftest import data, max_diff
from tied_jobs import (LOSS, accumulated_batches, accumulated_reference, global_batches, hybrid_accumulation_job,
                       hybrid_tied_job, reference_state, stage_refresh_job, stage_unet_job, tied_model, unet,
                       zero_grad_between)


def test_tied_weights_on_two_stages_train_like_the_plain_model():
    model = tied_model()
    expect = reference_state(model, global_batches())
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=3, balance=[2, 3]) as pipe:
        first, last = pipe.stages[0].module[0].weight, pipe.stages[1].module[2].weight
        assert first is not last  # each stage holds a copy on its own device ...
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        for x, y in global_batches():
            opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            assert torch.equal(first.grad, last.grad)  # ... with the summed gradient
            opt.step()
        assert torch.equal(first, last)  # ... and stays one weight
        got = pipe.state_dict()
    assert list(got) == list(expect) == ["0.weight", "2.weight", "2.bias", "4.weight"]
    assert max_diff(expect.values(), got.values()) < 1e-12


def test_a_copy_of_a_tie_is_refreshed_only_where_a_use_changed():
    """The head's copy takes the embedding's value before a forward where either changed since the last refresh
    (an edit in place, a replaced tensor, a load, a backward: an update through ``.data``, which no version counter
    sees, follows one), and not between the forwards of an evaluation, which read the same weight. Each refresh
    writes the copy, so its version counter tells whether one ran; every output is the plain model's."""
    model = tied_model()
    ref = copy.deepcopy(model)
    x, y = data(6, width=6, seed=5)
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=3, balance=[2, 3]) as pipe:
        first, last = pipe.stages[0].module[0].weight, pipe.stages[1].module[2].weight

        def forward() -> int:
            with torch.no_grad():
                assert max_diff([ref(x)], [pipe(x)]) < 1e-12
            return last._version

        seen = forward()
        assert forward() == forward() == seen  # an evaluation: no copy
        for edit in (lambda w: w.mul_(0.5), lambda w: setattr(w, "data", w.data * 3)):  # in place; a new tensor
            with torch.no_grad():
                edit(first)
                edit(ref[0].weight)
            seen, before = forward(), seen
            assert seen > before and forward() == seen
        pipe.train_step(x, y, LOSS)  # a backward, then an update through .data alone
        first.data.sub_(0.1 * first.grad)
        ref[0].weight.data.sub_(0.1 * first.grad)
        seen, before = forward(), seen
        assert seen > before and forward() == seen and torch.equal(first, last)
        pipe.load_state_dict({k: v + 1 for k, v in pipe.state_dict().items()})  # the embedding's key only
        ref.load_state_dict({k: v + 1 for k, v in ref.state_dict().items()})
        assert forward() > seen and torch.equal(first, last)


@pytest.mark.timeout(120)
def test_a_tie_across_processes_is_broadcast_only_where_a_use_changed():
    """Stage mode: the embedding in one process, the head's copy in the other. The forwards of an evaluation
    broadcast the weight once; an edit in place on the embedding's process alone reaches the head at the next
    forward (the flag rides on the batch check every forward makes); a training step's update too."""
    model = tied_model()
    x, y = data(6, width=6, seed=5)
    expect = []
    with torch.no_grad():
        expect += [model(x)] * 3
        model[0].weight.mul_(0.5)
        expect += [model(x)] * 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    LOSS(model(x), y).backward()
    opt.step()
    with torch.no_grad():
        expect.append(model(x))
    results = pipeddp.spawn(stage_refresh_job, 2, timeout=100)
    (last,) = [r for r in results if r["last"]]
    assert len(last["outs"]) == len(expect) and max_diff(expect, last["outs"]) < 1e-12
    v = last["versions"]
    assert v[0] == v[1] == v[2] < v[3] == v[4] < v[5]  # broadcasts: the first forward's, after the edit, the step's
    assert torch.equal(results[0]["weight"], results[1]["weight"])  # one weight in both processes: the plain one
    assert max_diff([model[4].weight], [last["weight"]]) < 1e-12


def test_closing_gives_the_model_back_one_weight_that_a_second_engine_trains_on():
    model = tied_model()
    batches = global_batches(4)
    expect = reference_state(model, batches, momentum=0.0)  # plain SGD: two engines in turn are one run
    for part in (batches[:2], batches[2:]):
        with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=3, balance=[2, 3]) as pipe:  # the model's own layers
            assert model[4].weight is not model[0].weight  # the head's stage holds a copy while the engine runs
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
            for x, y in part:
                opt.zero_grad()
                pipe.train_step(x, y, LOSS)
                opt.step()
        assert model[4].weight is model[0].weight  # one weight again
    assert max_diff(expect.values(), model.state_dict().values()) < 1e-12


def test_tied_weights_through_call_and_backward():
    model = tied_model()
    x, y = data(9, width=6, seed=8)
    ref = copy.deepcopy(model)
    LOSS(ref(x), y).backward()
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=3, balance=[2, 3],
                          checkpoint="always") as pipe:
        LOSS(pipe(x), y).backward()
        assert (pipe.stages[0].module[0].weight.grad - ref[0].weight.grad).abs().max().item() < 1e-12
        assert torch.equal(pipe.stages[0].module[0].weight.grad, pipe.stages[1].module[2].weight.grad)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode,nprocs,clip", [("replica", 2, None), ("stage", 4, None), ("replica", 2, 0.05),
                                            ("stage", 4, 0.05)])
def test_tied_weights_across_replicas_and_processes(mode, nprocs, clip, tmp_path):
    """2 replicas x 2 stages; in stage mode the embedding and the head live in different processes.

    With ``clip`` every process clips by the plain model's norm: the other stage's gradients
    counted through the pipeline's collective, the tied weight once."""
    path = str(tmp_path / "tied.pt")
    results = pipeddp.spawn(hybrid_tied_job, nprocs, args=(mode, path, clip), timeout=150)
    norms = []
    expect = reference_state(tied_model(), global_batches(), clip=clip, norms=norms)  # one device, the global batch
    if clip is not None:
        assert min(norms) > clip
    for res in results:
        assert res["one_weight_after_close"], res["rank"]
        assert res["norms"] == pytest.approx(norms, rel=1e-12), res["rank"]
        assert list(res["state"]) == list(expect)
        assert max_diff(expect.values(), res["state"].values()) < 1e-12, res["rank"]
    copies = [v for res in results for k, v in res["local"].items() if k in ("0.weight", "4.weight")]
    assert len(copies) == 4 and all(torch.equal(copies[0], c) for c in copies[1:])
    plain = tied_model(seed=3)
    plain.load_state_dict(torch.load(path)["model"])  # the checkpoint is the plain model's
    assert plain[0].weight is plain[4].weight and max_diff(expect.values(), plain.state_dict().values()) < 1e-12


def test_a_module_used_twice_works_on_two_stages():
    torch.manual_seed(0)
    act = nn.ReLU()
    model = nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    assert sum(pipeddp.partition(model, 2, method="params").balance) == 4  # every position counted
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=2, balance=[2, 2]) as pipe, torch.no_grad():
        assert (pipe(x) - model(x)).abs().max().item() < 1e-12
    # a module with parameters used by two stages: a copy per stage, kept one weight
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Tanh(), lin).double()
    batches = [data(6, width=4, seed=s) for s in range(3)]
    expect = reference_state(model, batches)
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=2, balance=[2, 1]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        for xb, yb in batches:
            opt.zero_grad()
            pipe.train_step(xb, yb, LOSS)
            opt.step()
        got = pipe.state_dict()
    assert list(got) == list(expect) and max_diff(expect.values(), got.values()) < 1e-12


def test_a_module_with_buffers_cannot_be_shared_by_two_stages():
    bn = nn.BatchNorm1d(4)
    model = nn.Sequential(nn.Linear(4, 4), bn, nn.Linear(4, 4), bn)
    with pytest.raises(ValueError, match=r"positions 1 and 3 .*BatchNorm1d.*stages 0 and 1.*balance"):
        pipeddp.Pipeline(model, ["cpu", "cpu"], balance=[2, 2])
    with pipeddp.Pipeline(model, ["cpu", "cpu"], balance=[1, 3]) as pipe:  # both uses in one stage: fine
        assert pipe.balance == [1, 3]


def test_a_skip_connection_jumps_over_a_whole_stage():
    model = unet()
    x, y = data(7, width=6, seed=6)
    ref = copy.deepcopy(model)
    LOSS(ref(x), y).backward()
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu"] * 3, chunks=3, balance=[1, 2, 1]) as pipe:
        pipe.train_step(x, y, LOSS)
        assert max_diff([p.grad for p in ref.parameters()], [p.grad for p in pipe.parameters()]) < 1e-12


@pytest.mark.timeout(120)
def test_a_skip_connection_between_processes():
    model = unet(tag=False)
    x, y = data(6, width=6, seed=5)
    ref = copy.deepcopy(model)
    LOSS(ref(x), y).backward()
    expect = dict(ref.named_parameters())
    for res in pipeddp.spawn(stage_unet_job, 3, timeout=100):
        for name, g in res["grads"].items():
            assert (g - expect[name].grad).abs().max().item() < 1e-12, (res["rank"], name)


def _grads_close(expect, got, where=""):
    """Each of the engine's gradients (the tied weight under both its names) against the plain model's."""
    assert set(got) <= set(expect), where
    for name, g in got.items():
        assert (g - expect[name]).abs().max().item() < 1e-12, (where, name)


def test_tied_weights_accumulate_over_calls_like_the_plain_model():
    """Two calls per optimizer step without zero_grad between them, through ``train_step``, ``pipe(x)`` +
    ``backward`` and both mixed: the tied gradient is each call's once, as in the plain model; zero_grad in
    place or to None between steps (or between a forward and its backward) starts afresh; the clip norm counts
    the weight once."""
    model, clip = tied_model(), 0.05
    expect = accumulated_reference(model, clip)
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=3, balance=[2, 3]) as pipe:
        first, last = pipe.stages[0].module[0].weight, pipe.stages[1].module[2].weight
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        norms = []
        for step, ((x1, y1), (x2, y2)) in enumerate(accumulated_batches()):
            if step < 2:
                zero_grad_between(opt, step)
            if step == 0:
                pipe.train_step(x1, y1, LOSS)
                pipe.train_step(x2, y2, LOSS)
            elif step == 1:
                LOSS(pipe(x1), y1).backward()
                LOSS(pipe(x2), y2).backward()
            else:
                out = pipe(x1)
                zero_grad_between(opt, step)  # between a forward and its backward: the step's grads still held
                LOSS(out, y1).backward()
                pipe.train_step(x2, y2, LOSS)
            _grads_close(expect["grads"][step], {k: p.grad for k, p in pipe.named_parameters()}, step)
            assert torch.equal(first.grad, last.grad)
            norms.append(pipe.clip_grad_norm_(clip).item())
            opt.step()
        got = pipe.state_dict()
    assert norms == pytest.approx(expect["norms"], rel=1e-10)
    assert max_diff(expect["state"].values(), got.values()) < 1e-12


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["replica", "stage"])
def test_tied_weights_accumulate_over_calls_across_processes(mode):
    """Replica mode: 2 replicas (DDP) x 2 stages in each process; stage mode: 1 replica, the embedding and the
    head in two processes. Two calls per step without zero_grad, against the plain model on the global batches."""
    clip = 0.05
    expect = accumulated_reference(tied_model(), clip)
    for res in pipeddp.spawn(hybrid_accumulation_job, 2, args=(mode, clip), timeout=150):
        for step, grads in enumerate(res["grads"]):
            _grads_close(expect["grads"][step], grads, (res["rank"], step))
        assert res["norms"] == pytest.approx(expect["norms"], rel=1e-10), res["rank"]
        assert max_diff(expect["state"].values(), res["state"].values()) < 1e-12, res["rank"]


def test_tied_weights_accumulate_under_a_grad_scaler_and_an_overflow():
    """Two scaled calls per step without zero_grad, then ``unscale_``, the clip and ``scaler.step``; the second
    step's second call overflows (an inf input): the scaler skips that step, and the next step, after
    ``zero_grad``, is the plain model's again (the skipped step's non-finite gradients leave no trace)."""
    model, clip = tied_model(), 0.05
    steps = [[data(12, width=6, seed=70 + 2 * i), data(8, width=6, seed=71 + 2 * i)] for i in range(3)]
    steps[1][1][0][0, 0] = float("inf")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    expect_grads, expect_norms = [], []
    for step in (0, 2):  # the plain model never takes the overflowing step
        ref_opt.zero_grad()
        for x, y in steps[step]:
            LOSS(ref(x), y).backward()
        expect_grads.append({k: p.grad.clone() for k, p in ref.named_parameters(remove_duplicate=False)})
        expect_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        ref_opt.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=3, balance=[2, 3]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        grads, norms = [], []
        for step, calls in enumerate(steps):
            opt.zero_grad(set_to_none=False)
            for x, y in calls:
                pipe.train_step(x, y, LOSS, scaler=scaler)
            scaler.unscale_(opt)
            if step != 1:
                grads.append({k: p.grad.clone() for k, p in pipe.named_parameters()})
                norms.append(pipe.clip_grad_norm_(clip).item())
            before = [v.clone() for v in pipe.state_dict().values()]
            scaler.step(opt)
            scaler.update()
            assert (step == 1) == (max_diff(before, pipe.state_dict().values()) == 0), step
        got = pipe.state_dict()
    assert scaler.get_scale() == 2.0**9  # one overflow, one back-off
    for step, (e, g) in enumerate(zip(expect_grads, grads)):
        _grads_close(e, g, step)
    assert norms == pytest.approx(expect_norms, rel=1e-10)
    assert max_diff(ref.state_dict().values(), got.values()) < 1e-12
