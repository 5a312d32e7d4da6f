"""Interleaved 1F1B and zero-bubble train the plain model's model: one process, and real multi-process jobs.

Every case trains 3 SGD steps on uneven micro-batches (10 samples per replica over 4) and compares each
step's gradients and the final weights with single-device training on the global batch (float64).
"""

import copy

import pytest
import torch
from torch import nn

import pipeddp
from conftest import data, make_mlp, max_diff, reference_training
from hybrid_jobs import LOSS, global_batches, schedule_job
from pipeddp.runtime.schedule import get_schedule, play, stages_on

NEW = [("interleaved", 2), ("zb", 1), ("zb", 2), ("auto", 1), ("auto", 2)]


def reference(replicas: int):
    model = make_mlp()
    names = [n for n, _ in model.named_parameters()]
    grads, params = reference_training(model, global_batches(replicas, 3), LOSS)
    return [dict(zip(names, g)) for g in grads], dict(zip(names, params))


def train_against(pipe, ref_grads):
    """3 SGD steps of ``global_batches(1, 3)``, each step's gradients compared with the plain model's (``ref_grads``,
    per step by name); the final state."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step, (x, y) in enumerate(global_batches(1, 3)):
        opt.zero_grad()
        pipe.train_step(x, y, LOSS)
        got = dict(pipe.named_parameters())
        assert max_diff([got[n].grad for n in ref_grads[step]], ref_grads[step].values()) < 1e-12
        opt.step()
    return pipe.state_dict()


@pytest.mark.parametrize("schedule,virtual", NEW)
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_pipeline_trains_the_plain_model(schedule, virtual, devices, checkpoint):
    ref_grads, ref_params = reference(1)
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * devices, chunks=4, schedule=schedule, virtual_stages=virtual,
                          checkpoint=checkpoint, balance="uniform") as pipe:
        assert len(pipe.stages) == devices * virtual
        state = train_against(pipe, ref_grads)
    assert max_diff([state[n] for n in ref_params], ref_params.values()) < 1e-12


@pytest.mark.parametrize("schedule,virtual", NEW)
def test_pipeline_call_then_backward_with_the_new_schedules(schedule, virtual):
    # pipe(x) + loss.backward() runs forward-only and backward-only rows taken from the training schedule
    model = make_mlp()
    x, y = data(10)
    plain = copy.deepcopy(model)
    LOSS(plain(x), y).backward()
    with pipeddp.Pipeline(model, ["cpu"] * 2, chunks=3, schedule=schedule, virtual_stages=virtual) as pipe:
        LOSS(pipe(x), y).backward()
        assert max_diff([p.grad for p in pipe.parameters()], [p.grad for p in plain.parameters()]) < 1e-12


@pytest.mark.parametrize("schedule,virtual", NEW + [("1f1b", 1), ("gpipe", 1)])
def test_measured_activation_memory_is_what_the_schedule_says(schedule, virtual):
    # each device holds a micro-batch from its forward to its B (or W): the trace counts it, play predicts it
    m, p = 5, 3
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * p, chunks=m, schedule=schedule, virtual_stages=virtual,
                          balance="uniform", trace=True) as pipe:
        x, y = data(10)
        pipe.train_step(x, y, LOSS)
        played = play(get_schedule(schedule, p, m, virtual))
        assert [pipe.trace.peak_in_flight[r] for r in range(p)] == [played.peak_in_flight(r) for r in range(p)]
        kinds = {s.kind for s in pipe.trace.spans if s.lane == "compute"}
        split = {a.kind.value for row in get_schedule(schedule, p, m, virtual) for a in row} >= {"I", "W"}
        assert kinds == ({"F", "I", "W"} if split else {"F", "B"})
        assert split or schedule != "zb"
        assert {s.row for s in pipe.trace.spans} == set(range(p))


COMBOS = [("interleaved", 2, 4, "never"), ("interleaved", 2, 4, "always"), ("zb", 1, 4, "never"),
          ("zb", 1, 4, "except_last"), ("zb", 2, 4, "always"), ("auto", 1, 4, "except_last"), ("auto", 2, 4, "always"),
          # in the V (placement="v"): in stage mode the process of row 0 holds the first and the last stage, so it
          # alone passes x and y
          ("interleaved", 2, 4, "never", "v"), ("zb", 2, 4, "always", "v"), ("auto", 2, 4, "except_last", "v")]


def check_joined(per_rank, ref_grads, ref_params, combo) -> None:
    """Every rank's gradients of each step and final weights (``schedule_job``'s), joined, are the plain model's."""
    grads = [{} for _ in range(3)]
    state = {}
    for r in per_rank:
        for step in range(3):
            grads[step].update(r["grads"][step])
        state.update(r["state"])
    for step in range(3):
        assert sorted(grads[step]) == sorted(ref_grads[step])
        assert max_diff([grads[step][n] for n in ref_grads[step]], ref_grads[step].values()) < 1e-12, (combo, step)
    assert max_diff([state[n] for n in ref_params], ref_params.values()) < 1e-12, combo


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,replicas,stages", [("replica", 2, 2), ("stage", 2, 2), ("replica", 1, 3),
                                                  ("stage", 1, 3)])
def test_hybrid_trains_the_plain_model_with_one_all_reduce_per_stage_and_step(mode, replicas, stages):
    nprocs = replicas if mode == "replica" else replicas * stages
    results = pipeddp.spawn(schedule_job, nprocs, args=(mode, stages, replicas, COMBOS), timeout=280)
    ref_grads, ref_params = reference(replicas)
    for i, combo in enumerate(COMBOS):
        per_rank = [r[i] for r in results]
        assert all(r["combo"] == combo for r in per_rank)
        check_joined(per_rank, ref_grads, ref_params, combo)
        virtual, placement = combo[1], (combo[4] if len(combo) > 4 else "loop")
        for rank, r in enumerate(per_rank):
            if mode == "stage":  # layout "pipeline": ranks 0..S-1 are replica 0
                assert r["stages"] == stages_on(rank % stages, stages, stages * virtual, placement), (combo, rank)
            local = len(r["stages"])
            assert local == (stages * virtual if mode == "replica" else virtual)
            if replicas == 1:
                assert r["ddp"] == 0 and r["hook_calls"] == []
            else:
                # one DDP per stage, and its one bucket all-reduced once per step: 3 steps
                assert r["ddp"] == local
                assert r["hook_calls"] == [3] * local, (combo, r["hook_calls"])


# -- with tied weights, deferred BatchNorm, autocast and the GradScaler ------------------------------------------

from tied_jobs import (global_batches as tied_batches, halves_loss, reference_state, shared_model,  # noqa: E402
                       shared_tie_job)


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("schedule,virtual", NEW)
def test_a_weight_used_on_three_stages_of_two_devices(schedule, virtual, calls):
    """With ``calls=2`` each step is two ``train_step`` calls on the batch's halves, without zero_grad between."""
    expect = reference_state(shared_model(), tied_batches())
    balance = [1, 2, 1, 2] if virtual == 2 else [3, 3]
    with pipeddp.Pipeline(shared_model(), ["cpu"] * 2, chunks=3, schedule=schedule, virtual_stages=virtual,
                          balance=balance) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        for x, y in tied_batches():
            opt.zero_grad()
            for xc, yc in zip(x.tensor_split(calls), y.tensor_split(calls)):
                pipe.train_step(xc, yc, halves_loss(calls))
            opt.step()
        state = pipe.state_dict()
        uses = [st.module._modules[name].weight for st in pipe.stages for name in ("0", "3", "5")
                if name in st.module._modules]
    assert sorted(state) == sorted(expect) and max_diff([state[k] for k in expect], expect.values()) < 1e-12
    assert len(uses) == 3 and all(torch.equal(uses[0], u) for u in uses[1:])  # still one weight


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule,virtual,calls,placement", [("interleaved", 2, 1, "loop"), ("zb", 2, 1, "loop"),
                                                              ("interleaved", 2, 2, "loop"), ("auto", 2, 2, "loop"),
                                                              ("interleaved", 2, 1, "v"), ("auto", 2, 2, "v")])
def test_a_weight_used_on_three_stages_across_processes(schedule, virtual, calls, placement):
    """Stage mode, 2 replicas x 2 devices: two uses in one process (stages 0 and 2; in the V stages 0 and 3), the
    third in another.

    With ``calls=2`` each step is two ``train_step`` calls on the local batch's halves, without zero_grad."""
    results = pipeddp.spawn(shared_tie_job, 4, args=("stage", schedule, virtual, calls, placement), timeout=200)
    expect = reference_state(shared_model(), tied_batches())
    for res in results:
        assert sorted(res["state"]) == sorted(expect)
        assert max_diff([res["state"][k] for k in expect], expect.values()) < 1e-12, res["rank"]
    copies = [v for res in results for k, v in res["local"].items() if k in ("0.weight", "3.weight", "5.weight")]
    assert len(copies) == 6 and all(torch.equal(copies[0], c) for c in copies[1:])


@pytest.mark.parametrize("schedule,virtual", NEW)
def test_deferred_batch_norm_with_the_new_schedules(schedule, virtual):
    from test_batchnorm import bn_model, plain_statistics, statistics

    model = bn_model()
    batches = [data(10, seed=3), data(10, seed=4)]
    expect = plain_statistics(model, batches, "1.")
    with pipeddp.Pipeline(copy.deepcopy(model), ["cpu", "cpu"], chunks=4, schedule=schedule, virtual_stages=virtual,
                          balance="params", deferred_batch_norm=True, checkpoint="except_last") as pipe:
        for x, y in batches:
            pipe.train_step(x, y, LOSS)
        got = statistics(pipe, "1.")
    for k in expect:
        assert (got[k].double() - expect[k].double()).abs().max().item() < 1e-9, k


@pytest.mark.parametrize("schedule,virtual", NEW)
def test_autocast_and_the_grad_scaler_with_the_new_schedules(schedule, virtual):
    from amp_jobs import Overflows, batch, probe_model
    from test_amp import close, plain_under_autocast, seen

    x, y = batch()
    ref, _, ref_loss = plain_under_autocast(torch.bfloat16, x, y)
    model = probe_model()
    with pipeddp.Pipeline(model, ["cpu"] * 2, chunks=2, schedule=schedule, virtual_stages=virtual,
                          balance="params", checkpoint="except_last") as pipe:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = pipe.train_step(x, y, LOSS)
        assert seen(model) == {torch.bfloat16} and close(loss, ref_loss)
        for p, q in zip(pipe.parameters(), ref.parameters()):
            assert close(p.grad, q.grad)
    # an overflow in one step's gradients (the last stage's, in its W half under zero-bubble) skips that step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), Overflows(8))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=2, schedule=schedule, virtual_stages=virtual,
                          balance=[1, 1, 1, 1] if virtual == 2 else [2, 2]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for step in range(3):
            model[3].armed = step == 1
            xs, ys = batch(seed=10 + step, width=8)
            before = [p.detach().clone() for p in pipe.parameters()]
            opt.zero_grad()
            pipe.train_step(xs, ys, LOSS, scaler=scaler)
            scaler.step(opt)
            scaler.update()
            changed = [not torch.equal(a, b) for a, b in zip(before, pipe.parameters())]
            assert (not any(changed)) if step == 1 else all(changed), step


# -- nothing waits for the garbage collector ----------------------------------------------------------------------

import gc  # noqa: E402


def tensors_in_cycles():
    """The tensors a full collection finds unreachable (kept alive only by reference cycles until it ran); not
    torch.compile's fake tensors, which an earlier test's compiled graphs may leave behind whenever their caches let
    go of them (no step's activation is ever fake)."""
    from torch._subclasses.fake_tensor import is_fake

    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return [o for o in gc.garbage if isinstance(o, torch.Tensor) and not is_fake(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.collect()  # what DEBUG_SAVEALL kept is still cyclic: free it now, or the next check finds it again


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1)] + NEW)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_activations_are_freed_without_the_garbage_collector(schedule, virtual, checkpoint):
    # a closure over a saved tensor, an error or a mailbox entry pointing back at its holder would keep a step's
    # activations alive until the collector runs: after a few steps, a collection must find no tensor
    x, y = data(10)
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, chunks=4, schedule=schedule, virtual_stages=virtual,
                          checkpoint=checkpoint) as pipe:
        gc.collect()  # what earlier code left behind is not this test's
        for _ in range(3):
            pipe.train_step(x, y, LOSS)
        LOSS(pipe(x), y).backward()
        with torch.no_grad():
            pipe(x)
        assert tensors_in_cycles() == []


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("zb", 2)])
def test_a_dropped_pipeline_leaves_nothing_to_the_garbage_collector(schedule, virtual):
    from test_batchnorm import bn_model

    gc.collect()
    x, y = data(10)
    for make, kw in ((bn_model, {"deferred_batch_norm": True}), (shared_model, {})):
        model = make()  # made here, so that nothing but this test holds it
        pipe = pipeddp.Pipeline(model, ["cpu"] * 2, chunks=4, schedule=schedule, virtual_stages=virtual,
                                balance="params", **kw)
        width = model[0].in_features
        pipe.train_step(torch.randn(10, width, dtype=torch.float64), torch.randn(10, width, dtype=torch.float64), LOSS)
        pipe.close()
        del pipe, model
        assert tensors_in_cycles() == []
