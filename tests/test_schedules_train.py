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
from pipeddp.runtime.schedule import get_schedule, play

NEW = [("interleaved", 2), ("zb", 1), ("zb", 2)]


def reference(replicas: int):
    model = make_mlp()
    names = [n for n, _ in model.named_parameters()]
    grads, params = reference_training(model, global_batches(replicas, 3), LOSS)
    return [dict(zip(names, g)) for g in grads], dict(zip(names, params))


@pytest.mark.parametrize("schedule,virtual", NEW)
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_pipeline_trains_the_plain_model(schedule, virtual, devices, checkpoint):
    ref_grads, ref_params = reference(1)
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * devices, chunks=4, schedule=schedule, virtual_stages=virtual,
                          checkpoint=checkpoint, balance="uniform") as pipe:
        assert len(pipe.stages) == devices * virtual
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for step, (x, y) in enumerate(global_batches(1, 3)):
            opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            got = dict(pipe.named_parameters())
            assert max_diff([got[n].grad for n in ref_grads[step]], ref_grads[step].values()) < 1e-12
            opt.step()
        state = pipe.state_dict()
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
        assert kinds == ({"F", "I", "W"} if schedule == "zb" else {"F", "B"})
        assert {s.row for s in pipe.trace.spans} == set(range(p))


COMBOS = [("interleaved", 2, 4, "never"), ("interleaved", 2, 4, "always"), ("zb", 1, 4, "never"),
          ("zb", 1, 4, "except_last"), ("zb", 2, 4, "always")]


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
        grads = [{} for _ in range(3)]
        state = {}
        for r in per_rank:
            for step in range(3):
                grads[step].update(r["grads"][step])
            state.update(r["state"])
        for step in range(3):
            assert sorted(grads[step]) == sorted(ref_grads[step])
            assert max_diff([grads[step][n] for n in ref_grads[step]], ref_grads[step].values()) < 1e-12, \
                (combo, step)
        assert max_diff([state[n] for n in ref_params], ref_params.values()) < 1e-12, combo
        virtual = combo[1]
        for r in per_rank:
            local = len(r["stages"])
            assert local == (stages * virtual if mode == "replica" else virtual)
            if replicas == 1:
                assert r["ddp"] == 0 and r["hook_calls"] == []
            else:
                # one DDP per stage, and its one bucket all-reduced once per step: 3 steps
                assert r["ddp"] == local
                assert r["hook_calls"] == [3] * local, (combo, r["hook_calls"])
