"""HybridParallel on real processes (gloo, CPU) against single-device training on the global batch."""

import copy

import pytest
import torch

import pipeddp
from conftest import data, make_mlp, max_diff, reference_training
from hybrid_jobs import (LOSS, bad_batch_job, checkpoint_resume_job, checkpoint_save_job, equivalence_job, eval_job,
                         global_batches, indivisible_world_job, layout_job)

# local batch 10: uneven over 4 micro-batches; recompute must not fire DDP's hooks twice
COMBOS = [("gpipe", 1, "never"), ("gpipe", 4, "never"), ("1f1b", 1, "never"), ("1f1b", 4, "never"),
          ("1f1b", 5, "always")]


def reference_state(steps, model=None, **kw):
    model = model or make_mlp()
    _, params = reference_training(model, steps, LOSS, **kw)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), params):
            p.copy_(q)
    return ref.state_dict()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,replicas,stages", [
    ("replica", 2, 2), ("stage", 2, 2), ("replica", 1, 3), ("stage", 1, 3), ("replica", 2, 1), ("stage", 2, 1),
])
def test_equivalence_with_single_device_training(mode, replicas, stages):
    nprocs = replicas if mode == "replica" else replicas * stages
    results = pipeddp.spawn(equivalence_job, nprocs, args=(mode, stages, replicas, COMBOS), timeout=200)
    expected = reference_state(global_batches(replicas, 3))
    for rank, per_rank in enumerate(results):
        for combo in per_rank:
            got = combo["state"]
            assert list(got) == list(expected)
            assert max_diff(expected.values(), got.values()) < 1e-12, (rank, combo["schedule"], combo["chunks"],
                                                                       combo["checkpoint"])
    # the copies of each stage are bit-identical across replicas
    if replicas > 1:
        for i in range(len(COMBOS)):
            by_key = {}
            for per_rank in results:
                for k, v in per_rank[i]["local"].items():
                    by_key.setdefault(k, []).append(v)
            for k, copies in by_key.items():
                assert len(copies) == replicas
                assert all(torch.equal(copies[0], c) for c in copies[1:]), k
    # the gradient all-reduce ran once per step per stage (one bucket here), whatever the micro-batch count,
    # and never in a one-replica job
    for per_rank in results:
        for combo in per_rank:
            local_stages = stages if mode == "replica" else 1
            if replicas == 1:
                assert combo["ddp"] == 0 and combo["hook_calls"] == []
            else:
                assert combo["ddp"] == local_stages
                assert combo["hook_calls"] == [3] * local_stages, combo


@pytest.mark.timeout(120)
def test_rank_with_another_batch_size_is_named():
    messages = pipeddp.spawn(bad_batch_job, 3, timeout=100)
    for msg in messages:  # every rank raises the same error, none hangs
        assert "rank 1 passed x with 8 samples but the others have 10" in msg


@pytest.mark.timeout(120)
def test_world_size_not_divisible_by_stages():
    messages = pipeddp.spawn(indivisible_world_job, 3, timeout=100)
    for rank, msg in enumerate(messages):
        assert f"rank {rank}:" in msg and "not divisible by stages=2" in msg


def test_bad_configuration_errors_in_one_process():
    with pytest.raises(ValueError, match="rank 0: backend 'nccl' cannot serve CPU"):
        pipeddp.HybridParallel(make_mlp(), stages=2, backend="nccl", devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="needs 3 device"):
        pipeddp.HybridParallel(make_mlp(), stages=3, devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="does not exist"):
        pipeddp.HybridParallel(make_mlp(), stages=2, devices=["cuda:0", "cuda:1"])
    with pytest.raises(ValueError, match="at most 11 stages"):
        pipeddp.HybridParallel(make_mlp(), stages=12)
    with pytest.raises(ValueError, match="rank 0: sync_batchnorm=True needs CUDA"):
        pipeddp.HybridParallel(make_mlp(), stages=2, sync_batchnorm=True)
    with pytest.raises(ValueError, match="static_graph"):
        pipeddp.HybridParallel(make_mlp(), stages=1, ddp_kwargs={"static_graph": True})._ddps  # noqa: B018


def test_one_process_job_without_torchrun():
    """Without torchrun's variables the engine is a 1 x S job in this process."""
    steps = global_batches(1, 3)
    expected = reference_state(steps)
    with pipeddp.HybridParallel(make_mlp(), stages=3, chunks=4) as engine:
        assert engine.topology.world_size == 1 and engine.topology.replicas == 1
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        for x, y in steps:
            opt.zero_grad()
            engine.train_step(x, y, LOSS)
            opt.step()
        assert max_diff(expected.values(), engine.state_dict().values()) < 1e-12
        with torch.no_grad():
            assert engine(steps[0][0]).shape == (10, 12)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["replica", "stage"])
def test_checkpoint_moves_between_layouts_and_resumes_exactly(tmp_path, mode):
    path = str(tmp_path / "ckpt.pt")
    nprocs = 2 if mode == "replica" else 4
    finals = pipeddp.spawn(checkpoint_save_job, nprocs, args=(path, mode), timeout=200)
    uninterrupted = finals[0]
    for f in finals[1:]:
        assert max_diff(uninterrupted.values(), f.values()) == 0
    # the same 4 steps on one device
    model = make_mlp()
    batches = global_batches(2, 4)
    expected = reference_state(batches, model=model)
    ref_opt_model = copy.deepcopy(model)
    opt = torch.optim.SGD(ref_opt_model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        LOSS(ref_opt_model(x), y).backward()
        opt.step()
    assert max_diff(ref_opt_model.state_dict().values(), uninterrupted.values()) < 1e-12
    del expected

    ckpt = torch.load(path)  # PyTorch's safe default loader
    plain = make_mlp(seed=5)
    plain.load_state_dict(ckpt["model"])  # the plain model takes the checkpoint as is
    assert ckpt["meta"]["replicas"] == 2 and ckpt["meta"]["stages"] == 2

    # 1 x 1 and 1 x 3 in this process (no torchrun variables: world size 1)
    for stages in (1, 3):
        resumed = checkpoint_resume_job(path, "replica", stages)
        assert max_diff(uninterrupted.values(), resumed.values()) < 1e-12
    # 1 x 3 as three processes
    resumed = pipeddp.spawn(checkpoint_resume_job, 3, args=(path, "stage", 3), timeout=200)
    for r in resumed:
        assert max_diff(uninterrupted.values(), r.values()) < 1e-12


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode,nprocs,stages,options", [
    ("stage", 4, 2, None), ("replica", 3, 2, None),
    # in the V the process of row 0 holds the first and the last stage: it takes the inputs and the targets
    ("stage", 4, 2, {"schedule": "interleaved", "virtual_stages": 2, "placement": "v"})])
def test_distributed_evaluation_counts_every_sample_once(mode, nprocs, stages, options):
    n = 11  # divides by neither 2 nor 3 replicas
    results = pipeddp.spawn(eval_job, nprocs, args=(n, mode, stages, options), timeout=150)
    for r in results:
        assert r["samples"] == n
        assert r["one"] == pytest.approx(1.0)
        assert r["id"] == pytest.approx(sum(range(n)) / n)
        assert r["id_sq"] == pytest.approx(sum(i * i for i in range(n)) / n)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,nprocs", [("replica", 2), ("stage", 4)])
def test_trace_records_the_gradient_all_reduce_sends_and_agreement(mode, nprocs):
    from hybrid_jobs import traced_job

    per_rank = pipeddp.spawn(traced_job, nprocs, args=(mode, 2), timeout=100)
    for spans in per_rank:
        stages = {s["stage"] for s in spans if s["kind"] in ("F", "B")}
        for st in stages:
            reduces = [s for s in spans if s["kind"] == "allreduce" and s["stage"] == st]
            backs = sorted((s for s in spans if s["kind"] == "B" and s["stage"] == st), key=lambda s: s["start"])
            assert len(reduces) == 2  # one bucket, two steps
            assert len(backs) == 8
            # each all-reduce is issued during the step's last backward of that stage
            for step, red in enumerate(sorted(reduces, key=lambda s: s["start"])):
                last_b = backs[4 * step + 3]
                assert last_b["start"] <= red["start"] <= last_b["end"]
            # every activation (stage 0) or gradient (stage 1) sent, after the action that made it
            sends = sorted((s for s in spans if s["kind"] == "send" and s["stage"] == st), key=lambda s: s["start"])
            made = sorted((s for s in spans if s["kind"] == ("F" if st == 0 else "B") and s["stage"] == st),
                          key=lambda s: s["start"])
            assert len(sends) == len(made) == 8
            assert all(a["mb"] == s["mb"] and a["end"] <= s["start"] for a, s in zip(made, sends))
        # the two agreement collectives of each step, and in stage mode the wait for sends in flight at its end
        assert len([s for s in spans if s["kind"] == "agree"]) == 4
        assert len([s for s in spans if s["kind"] == "flush"]) == (2 if mode == "stage" else 0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,nprocs", [("replica", 2), ("stage", 4)])
def test_nonfinite_batch_on_one_rank_skips_the_step_everywhere(mode, nprocs):
    from hybrid_jobs import nonfinite_job

    loss_rank = 1 if mode == "replica" else 3  # the last stage of replica 1 sees the NaN loss
    for res in pipeddp.spawn(nonfinite_job, nprocs, args=(mode,), timeout=100):
        assert res["skipped"] == 1
        assert [s["changed"] for s in res["steps"]] == [True, False, True]
        assert any(f"non-finite loss on rank(s) [{loss_rank}]" in w for w in res["steps"][1]["warnings"])
        assert not res["steps"][0]["warnings"] and not res["steps"][2]["warnings"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,nprocs", [("replica", 2), ("stage", 4)])
def test_ddp_options_and_comm_hooks_reach_every_stage(mode, nprocs):
    from hybrid_jobs import ddp_options_job

    expected = reference_state(global_batches(2, 3))
    results = {}
    for chunks in (1, 5):
        results[chunks] = pipeddp.spawn(ddp_options_job, nprocs, args=(mode, chunks), timeout=200)
    for chunks, per_rank in results.items():
        for res in per_rank:
            for name in ("buckets", "unused"):
                assert max_diff(expected.values(), res[name]["state"].values()) < 1e-12, name
            # compressed gradients: close to, not equal to, the exact result (a hook never registered gives 0)
            for name in ("fp16", "bf16", "powersgd"):
                err = max_diff(expected.values(), res[name]["state"].values())
                assert 1e-9 < err < (5e-2 if name != "fp16" else 1e-3), (name, err)
    # tiny buckets: several all-reduces per step per stage (DDP re-buckets after the first step), and the
    # same number whatever the micro-batch count
    for a, b in zip(results[1], results[5]):
        calls = a["buckets"]["hook_calls"]
        assert calls == b["buckets"]["hook_calls"]
        assert all(c > 3 for c in calls), calls


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,nprocs", [("replica", 2), ("stage", 4)])
def test_batchnorm_buffers_follow_broadcast_buffers(mode, nprocs):
    from hybrid_jobs import batchnorm_job

    per_rank = pipeddp.spawn(batchnorm_job, nprocs, args=(mode,), timeout=100)
    by_key = {}
    for bufs in per_rank:
        for k, v in bufs.items():
            by_key.setdefault(k, []).append(v)
    assert set(by_key) == {"1.running_mean", "1.running_var", "4.running_mean", "4.running_var"}
    for k, copies in by_key.items():
        assert len(copies) == 2 and torch.equal(copies[0], copies[1]), k


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,nprocs", [("replica", 2), ("stage", 4)])
def test_buffers_are_broadcast_after_the_backward_that_reads_them(mode, nprocs):
    """A layer whose backward reads a buffer (autograd saved it; BatchNorm's running statistics in some torch
    releases): DDP's broadcast_buffers overwrites buffers in place before the forward it runs, which in pipeddp is
    the arming before the stage's last backward; a torch whose DDP does not preserve the buffers' version counters
    there (2.11) then refuses that backward. The broadcast runs after it, and the replicas train the plain model."""
    from hybrid_jobs import buffer_in_backward_job, global_batches, scaled_model

    model = scaled_model()
    _, params = reference_training(model, global_batches(2, 2), LOSS)
    names = [n for n, _ in model.named_parameters()]
    for state in pipeddp.spawn(buffer_in_backward_job, nprocs, args=(mode,), timeout=100):
        mine = [n for n in names if n in state]
        assert mine and max_diff([state[n] for n in mine], [params[names.index(n)] for n in mine]) < 1e-12
        for n, buf in model.named_buffers():
            if n in state:
                assert torch.equal(state[n], buf), n


@pytest.mark.timeout(120)
def test_forward_then_backward_averages_gradients_over_replicas():
    from hybrid_jobs import forward_backward_job

    model = make_mlp()
    x, y = global_batches(2, 1)[0]
    LOSS(model(x), y).backward()
    expect = [p.grad for p in model.parameters()]
    for res in pipeddp.spawn(forward_backward_job, 2, timeout=100):
        *grads, calls = res
        assert max_diff(expect, grads) < 1e-12
        assert calls.tolist() == [1, 1]  # one all-reduce per stage, in the last backward


@pytest.mark.timeout(240)
def test_stage_mode_with_the_data_layout_a_schedule_by_hand_and_a_changing_batch_size():
    # 10, 10, then 7, 7, then 10 per replica: activations cross without headers where the shapes repeat
    batches = global_batches(2, 2) + [data(14, width=12, seed=150 + i) for i in range(2)] + global_batches(2, 1)
    expected = reference_state(batches)
    for rank, per_rank in enumerate(pipeddp.spawn(layout_job, 4, args=(batches,), timeout=200)):
        for got in per_rank:
            assert max_diff(expected.values(), [got["state"][k] for k in expected]) < 1e-12, rank
            sent = got["headers"]
            if got["first"]:  # one per micro-batch where the shapes are new; none where they repeat
                assert sent == [4, 0, 4, 0, 4], (rank, sent)
            else:
                assert sent == [0] * 5, (rank, sent)
