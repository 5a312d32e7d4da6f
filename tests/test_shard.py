"""shard="optimizer" / "full": FSDP2 over each stage's replicas, checked against plain AdamW on one device."""

from __future__ import annotations

import pytest
import torch
from conftest import data, make_mlp
from shard_jobs import (
    LOSS,
    WIDTH,
    MAX_NORM,
    batches,
    call_job,
    load_job,
    model,
    nonfinite_job,
    reference,
    save_job,
    tied_job,
    train_job,
    uneven_evaluation_job,
)
from torch.distributed.checkpoint import FileSystemReader

import pipeddp

COMBOS = [
    {"shard": "optimizer", "schedule": "gpipe", "chunks": 3},
    {"shard": "optimizer", "schedule": "1f1b", "chunks": 4, "checkpoint": "always"},
    {"shard": "optimizer", "schedule": "zb", "chunks": 3},
    {"shard": "optimizer", "schedule": "interleaved", "chunks": 4},
    {"shard": "optimizer", "schedule": "1f1b", "chunks": 2, "global_batch": 12, "batch_size": 3},
    {"shard": "full", "schedule": "1f1b", "chunks": 3},
    {"shard": "full", "schedule": "interleaved", "chunks": 4, "checkpoint": "except_last"},
    {"shard": "optimizer", "schedule": "interleaved", "chunks": 4, "placement": "v"},
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,nprocs", [("replica", 2), ("stage", 4)])
def test_sharded_training_equals_single_device_adamw(mode, nprocs):
    combos = COMBOS + ([{"shard": "optimizer", "schedule": "zb", "chunks": 3, "compile": True}]
                       if mode == "replica" else [])
    results = pipeddp.spawn(train_job, nprocs, args=(mode, combos), timeout=280)
    ref = reference(replicas=2)
    for rank, per_rank in enumerate(results):
        for res in per_rank:
            combo = res["combo"]
            where = f"rank {rank}, {mode}, {combo}"
            for key, value in ref["state"].items():
                assert torch.allclose(res["state"][key], value, rtol=0, atol=1e-12), (where, key)
            assert res["norms"] == pytest.approx(ref["norms"], rel=1e-12, abs=0), where
            assert res["dtensor"] and res["grad_dtensor"], where
            # each replica holds about half of every parameter and of the optimizer state (7 rows -> 4 + 3)
            assert res["local_numel"] < 0.6 * res["whole_numel"], where
            assert 0 < res["state_numel"] <= 2 * res["local_numel"], where
            steps = 2
            # one reduce-scatter per FSDP group per step, after the last pass only
            groups = res["groups"] if combo["shard"] == "full" else res["stages"]
            if combo["shard"] == "full":
                groups -= res["stages"]  # the stage roots of "full" hold no parameters of their own
            assert res["calls"]["reduce_scatter"] == steps * groups, where
            if combo["shard"] == "optimizer":  # gathered once per step, kept whole through every micro-batch
                assert res["calls"]["all_gather"] == steps * res["stages"], where


def test_unknown_shard_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'none', 'optimizer', 'full'"):
        pipeddp.HybridParallel(make_mlp(), stages=2, shard="zero3")


def test_shard_with_one_replica_does_nothing_and_says_so():
    with pytest.warns(UserWarning, match="one replica"):
        engine = pipeddp.HybridParallel(make_mlp(), stages=2, shard="optimizer")
    with engine:
        assert engine.shard == "none"
        assert not any(type(p).__name__ == "DTensor" for p in engine.parameters())


@pytest.mark.timeout(300)
def test_sharded_checkpoints_load_into_other_layouts(tmp_path):
    """Written by shard="optimizer" in stage mode (2 x 2); read by replica counts 1, 2 and 3, every shard= setting."""
    pipeddp.spawn(save_job, 4, args=(str(tmp_path), "stage"), timeout=120)
    ref = reference(replicas=2, clip=False)["state"]
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    assert all(type(v) is torch.Tensor for v in one["model"].values())  # whole tensors, the plain model's names
    assert set(one["model"]) == set(ref)
    meta = FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    chunks = meta["model.0.weight"].chunks  # written as the replicas' shards (4 + 3 rows), nothing gathered
    assert sorted(c.sizes[0] for c in chunks) == [3, 4]
    assert sorted(c.sizes[0] for c in meta["optimizer.state.0.weight.exp_avg"].chunks) == [3, 4]
    combos = [{"shard": "none", "file": "one.pt"}, {"shard": "full", "file": "dcp"},
              {"shard": "optimizer", "file": "one.pt", "schedule": "zb"}, {"shard": "none", "file": "dcp"}]
    runs = {2: pipeddp.spawn(load_job, 2, args=(str(tmp_path), "replica", combos), timeout=150),
            3: pipeddp.spawn(load_job, 3, args=(str(tmp_path), "replica", [{"shard": "full", "file": "run"}]),
                                  timeout=150)}
    for replicas, results in runs.items():
        for rank, per_rank in enumerate(results):
            for res in per_rank:
                for key, value in ref.items():
                    assert torch.allclose(res["state"][key], value, rtol=0, atol=1e-12), (replicas, rank, res["combo"])
    for name in ("one.pt", "dcp"):  # the plain model on one device takes both, optimizer state included
        net = pipeddp.Pipeline(model(), devices=["cpu"], chunks=1)
        opt = torch.optim.AdamW(net.parameters(), lr=0.01)
        net.load(str(tmp_path / name), opt)
        x, y = batches(2, 2)[1]
        opt.zero_grad()
        LOSS(net(x), y).backward()
        opt.step()
        for key, value in ref.items():
            assert torch.allclose(net.state_dict()[key], value, rtol=0, atol=1e-12), (name, key)
        net.close()


@pytest.mark.timeout(200)
def test_an_overflow_in_one_stage_is_skipped_on_every_rank_with_shards():
    """GradScaler and skip_nonfinite agree on every rank: the last stage overflows, the first stage's ranks skip too."""
    for res in pipeddp.spawn(nonfinite_job, 4, args=("stage", "optimizer"), timeout=180):
        assert [h["changed"] for h in res["scaler"]["history"]] == [True, False, True], res
        assert [h["scale"] for h in res["scaler"]["history"]] == [2.0**10, 2.0**9, 2.0**9], res
        assert [h["changed"] for h in res["skip"]["history"]] == [True, False, True], res
        assert res["skip"]["skipped"] == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,nprocs", [("replica", 2), ("stage", 4)])
def test_tied_weights_across_stages_with_shards(mode, nprocs):
    from tied_jobs import global_batches, reference_state, tied_model

    norms = []
    ref = reference_state(tied_model(), global_batches(), clip=MAX_NORM, norms=norms)
    combos = [{"shard": "optimizer", "schedule": "zb", "chunks": 3},
              {"shard": "full", "schedule": "1f1b", "chunks": 2, "global_batch": 12, "batch_size": 3}]
    for rank, per_rank in enumerate(pipeddp.spawn(tied_job, nprocs, args=(mode, combos), timeout=280)):
        for res in per_rank:
            for key, value in ref.items():
                assert torch.allclose(res["state"][key], value, rtol=0, atol=1e-12), (rank, res["combo"], key)
            assert res["norms"] == pytest.approx(norms, rel=1e-12, abs=0), (rank, res["combo"])


@pytest.mark.timeout(200)
def test_calling_the_engine_and_backward_with_shards():
    ref = reference(replicas=2, clip=False)["state"]
    net = model()
    net.load_state_dict(ref)
    for res in pipeddp.spawn(call_job, 2, timeout=180):
        # local losses are means over each replica's rows, so the global gradient is their mean: as train_step
        for key, value in ref.items():
            assert torch.allclose(res["state"][key], value, rtol=0, atol=1e-12), key
        assert torch.allclose(res["out"], net(batches(2)[0][0]), rtol=0, atol=1e-12)
        assert res["resharded"]
        assert res["reductions"] == [0, 0, 1, 1]  # traced: one reduction per stage and step


def test_settings_that_cannot_work_with_shards_are_refused_naming_the_way_out(monkeypatch):
    """Checked before any process group: the message names the conflict and what to use instead."""
    monkeypatch.setenv("WORLD_SIZE", "4")  # 2 replicas x 2 stages as the constructor sees it, refused before joining
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="shard='optimizer' with that schedule"):
        pipeddp.HybridParallel(make_mlp(), stages=2, shard="full", schedule="zb")
    with pytest.raises(ValueError, match="schedule 'auto', which splits backwards"):
        pipeddp.HybridParallel(make_mlp(), stages=2, shard="full", schedule="auto")
    with pytest.raises(ValueError, match="drop them, or use shard='none'"):
        pipeddp.HybridParallel(make_mlp(), stages=2, shard="optimizer", comm_hook="fp16")
    bn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="BatchNorm"):
        pipeddp.HybridParallel(bn, stages=2, shard="optimizer")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode,nprocs,shard", [("replica", 2, "optimizer"), ("stage", 4, "full")])
def test_evaluation_with_uneven_batches_per_replica_equals_the_plain_model(mode, nprocs, shard):
    net = model()
    x, y = data(9, width=WIDTH, seed=77)
    with torch.no_grad():
        want = LOSS(net(x), y).item()  # a mean over equal-sized samples: any grouping into batches gives it
    for res in pipeddp.spawn(uneven_evaluation_job, nprocs, args=(mode, shard), timeout=180):
        assert res["metrics"]["samples"] == 9
        assert abs(res["metrics"]["mse"] - want) < 1e-12
        assert res["resharded"]
