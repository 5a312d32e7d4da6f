"""Sharded checkpoints (torch.distributed.checkpoint): any layout in, any layout out, never taken half-written,
saved in the background, safe to open."""

import copy
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

import pipeddp
from conftest import data, make_mlp
from hybrid_jobs import LOSS, global_batches
from pipeddp.checkpoints import catalog, checkpoint as ckpt, sharded
from pipeddp.checkpoints.optim_state import named_optimizer_state
from pipeddp.tools.cli import main as cli
from sharded_jobs import (EXTRA, LR, adam, async_overlap_job, killed_writer_job, load_and_train_job, refusals_job,
                          narrow_model, other_model, replica_mode_job, save_both_job)


def plain_adam(model, batches):
    """The reference: the plain model with Adam on one device, whole global batches."""
    model = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for x, y in batches:
        opt.zero_grad()
        LOSS(model(x), y).backward()
        opt.step()
    return model, opt


def assert_same(a, b, tol=0.0, what=""):
    """Two state dicts (or named optimizer states) with the same keys and values (``tol``: max abs difference)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, what
        assert (a.double() - b.double()).abs().max().item() <= tol if a.numel() else True, what
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (what, sorted(a), sorted(b))
        for k in a:
            assert_same(a[k], b[k], tol, f"{what}.{k}")
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, tol, f"{what}[{i}]")
        return
    assert a == b, (what, a, b)


def assert_written_once(shards):
    """Every process wrote a part, and nothing in the files is written twice: the files hold exactly the entries
    the metadata indexes, one per key, so replicas' equal copies were written by one of them only."""
    sizes = {n: os.path.getsize(os.path.join(shards, n)) for n in os.listdir(shards) if n.endswith(".distcp")}
    assert all(size > 0 for size in sizes.values()), sizes
    indexed = {}
    for info in sharded.read_metadata(shards).storage_data.values():
        indexed[info.relative_path] = indexed.get(info.relative_path, 0) + info.length
    assert indexed == sizes


def same_extra(got):
    assert {k: v for k, v in got.items() if k != "mask"} == {k: v for k, v in EXTRA.items() if k != "mask"}
    assert torch.equal(got["mask"], EXTRA["mask"])


@pytest.mark.timeout(300)
def test_a_sharded_stage_mode_checkpoint_loads_into_other_layouts_a_pipeline_and_the_plain_model(tmp_path):
    pipeddp.spawn(save_both_job, 4, args=(str(tmp_path),), timeout=200)
    one, shards = str(tmp_path / "one.pt"), str(tmp_path / "sharded")
    # every process wrote its own file, in parallel; DCP's metadata last; replicas' equal copies written once
    assert sorted(os.listdir(shards)) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    assert_written_once(shards)
    ref = torch.load(one)  # the consolidated path: what the same state is, as one file
    batches = global_batches(2, 4)
    expect_model, expect_opt = plain_adam(make_mlp(), batches)
    mid_model, _ = plain_adam(make_mlp(), batches[:2])
    assert_same(ref["model"], mid_model.state_dict(), 1e-12, "one.pt")

    # 3 stages x 1 replica: the sharded checkpoint loads exactly as the one file does, and training goes on alike
    per_rank = pipeddp.spawn(load_and_train_job, 3, args=([shards, one], 3, "stage"), timeout=200)
    for from_shards, from_file in per_rank:
        same_extra(from_shards["extra"])
        assert_same(from_shards["loaded"]["model"], ref["model"], 0.0, "model")
        assert_same(from_shards["loaded"]["model"], from_file["loaded"]["model"], 0.0, "model")
        assert_same(from_shards["loaded"]["optimizer"], from_file["loaded"]["optimizer"], 0.0, "optimizer")
        assert_same(from_shards["final"], from_file["final"], 0.0, "after 2 more steps")
        assert_same(from_shards["final"], expect_model.state_dict(), 1e-12, "against the plain model")

    # a Pipeline in this process (2 stages, its own micro-batches)
    with pipeddp.Pipeline(make_mlp(seed=7), ["cpu", "cpu"], chunks=2) as pipe:
        opt = adam(pipe)
        same_extra(pipe.load(shards, opt))
        assert_same(pipe.state_dict(), ref["model"], 0.0, "pipeline")
        pipe_opt = named_optimizer_state(pipe, opt)
        assert_same(pipe_opt["state"], ref["optimizer"]["state"], 0.0, "pipeline optimizer")
        for x, y in batches[2:]:
            opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            opt.step()
        assert_same(pipe.state_dict(), expect_model.state_dict(), 1e-12, "pipeline against the plain model")

    # `pipeddp convert`: one file that torch.load (weights_only, its default) opens and the plain model loads
    out = str(tmp_path / "converted.pt")
    assert cli(["convert", shards, out]) == 0
    converted = torch.load(out)
    assert sorted(converted) == sorted(ref) and converted["format"] == ckpt.FORMAT
    assert converted["meta"] == ref["meta"] and converted["meta"]["optimizer"] == "torch.optim.adam.Adam"
    same_extra(converted["extra"])
    assert_same(converted["model"], ref["model"], 0.0, "converted model")
    assert_same(converted["optimizer"]["state"], ref["optimizer"]["state"], 0.0, "converted optimizer")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in converted["optimizer"]["param_groups"]]
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in ref["optimizer"]["param_groups"]]
    assert [sorted(g["params"]) for g in converted["optimizer"]["param_groups"]] == \
           [sorted(g["params"]) for g in ref["optimizer"]["param_groups"]]
    assert len(converted["rng"]) == 4
    plain = make_mlp(seed=5)
    plain.load_state_dict(converted["model"])
    plain_opt = torch.optim.Adam(plain.parameters(), lr=LR)
    set_optimizer_state_dict(plain, plain_opt, converted["optimizer"])
    for x, y in batches[2:]:
        plain_opt.zero_grad()
        LOSS(plain(x), y).backward()
        plain_opt.step()
    assert_same(plain.state_dict(), expect_model.state_dict(), 1e-12, "plain model after convert")
    # and any engine loads the converted file like the one it was converted from
    with pipeddp.HybridParallel(make_mlp(seed=8), stages=2) as engine:
        opt = adam(engine)
        engine.load(out, opt)
        assert_same(engine.state_dict(), ref["model"], 0.0, "converted into an engine")


@pytest.mark.timeout(120)
def test_replica_mode_writes_each_tensor_once_and_loads_into_one_process(tmp_path):
    state = pipeddp.spawn(replica_mode_job, 2, args=(str(tmp_path),), timeout=100)[0]
    shards = str(tmp_path / "sharded")
    assert_written_once(shards)
    ref = torch.load(str(tmp_path / "one.pt"))
    with pipeddp.HybridParallel(make_mlp(seed=4), stages=3) as engine:
        opt = adam(engine)
        engine.load(shards, opt)
        assert_same(engine.state_dict(), state, 0.0, "model")
        assert_same(named_optimizer_state(engine, opt)["state"], ref["optimizer"]["state"], 0.0, "optimizer")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim,when", [(1, "data"), (0, "metadata")])
def test_a_writer_killed_during_a_sharded_save_leaves_the_previous_checkpoint_the_newest(tmp_path, victim, when):
    """Rank ``victim`` is SIGKILLed mid-way through writing its shard file, or (rank 0) with every shard on disk
    but before DCP's metadata is renamed into place: either way the step-3 directory is never taken."""
    directory, reference = str(tmp_path / "run"), str(tmp_path / "step2.pt")
    with pytest.raises(Exception, match="SIGKILL|signal 9|exit code"):
        pipeddp.spawn(killed_writer_job, 2, args=(directory, reference, victim, when), timeout=90)
    broken = catalog.step_path(directory, 3, True)
    assert os.path.isdir(broken) and not sharded.is_complete(broken)
    shard = os.path.join(broken, f"__{victim}_0.distcp")
    if when == "data":
        assert os.path.getsize(shard) == 2000  # the victim died in the middle of its file
    else:
        assert os.path.getsize(os.path.join(broken, "__1_0.distcp")) > 2000  # the shards were all written
    path, _ = catalog.newest(directory)
    assert path == catalog.step_path(directory, 2, True)
    ref = torch.load(reference)
    with pipeddp.HybridParallel(make_mlp(seed=3), stages=1) as engine:
        opt = adam(engine)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            extra = engine.resume(directory, opt)
        assert extra == {"epoch": 0, "step": 2}
        messages = [str(w.message) for w in caught]
        assert any(broken in m and "incomplete" in m and ".metadata" in m for m in messages), messages
        assert_same(engine.state_dict(), ref["model"], 0.0, "resumed")
        assert_same(named_optimizer_state(engine, opt)["state"], ref["optimizer"]["state"], 0.0, "optimizer")
        # the next save sweeps the half-written directory away
        engine.save_checkpoint(directory, 4, opt, keep=2, sharded=True)
    assert [s for s, _ in catalog.list_checkpoints(directory)] == [4, 2]


@pytest.mark.timeout(120)
def test_an_asynchronous_save_overlaps_a_training_step_and_is_complete_after_close(tmp_path):
    delay = 3.0  # every shard file opens this late: a slow disk
    per_rank = pipeddp.spawn(async_overlap_job, 2, args=(str(tmp_path / "run"), delay), timeout=100)
    for r in per_rank:
        assert r["returned_after"] < delay, r  # save_checkpoint returned before any file was written
        assert r["stepped_after"] < delay, r  # and the next training step ran meanwhile
        assert not r["complete_after_step"]  # while the checkpoint was still being written
        assert r["complete_after_close"]
    saved = {**per_rank[0]["saved"], **per_rank[1]["saved"]}
    after = {**per_rank[0]["after_step"], **per_rank[1]["after_step"]}
    assert max((saved[k] - after[k]).abs().max().item() for k in saved) > 0  # the step did change the weights
    with pipeddp.HybridParallel(make_mlp(seed=3), stages=2) as engine:
        extra = engine.resume(str(tmp_path / "run"), adam(engine))
        assert extra == {"step": 1}
        assert_same(engine.state_dict(), saved, 0.0, "the state when save_checkpoint was called")


def test_async_save_needs_the_sharded_format_and_a_one_file_save_refuses_a_directory(tmp_path):
    with pipeddp.HybridParallel(make_mlp(), stages=2) as engine:
        with pytest.raises(ValueError, match="async_save=True needs sharded=True"):
            engine.save(str(tmp_path / "c.pt"), async_save=True)
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.txt").write_text("precious")
        with pytest.raises(ValueError, match=r"notes.txt.*choose an empty or a new directory"):
            engine.save(str(tmp_path / "mine"), sharded=True)
        assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"


def test_a_sharded_save_replaces_an_older_one_at_the_same_path_and_keeps_keep(tmp_path):
    run = str(tmp_path / "run")
    with pipeddp.HybridParallel(make_mlp(), stages=2) as engine:
        opt = adam(engine)
        for step in range(1, 5):
            engine.save_checkpoint(run, step, opt, keep=2, sharded=True, async_save=step % 2 == 0)
        engine.save_checkpoint(run, 5, opt, keep=2)  # formats mix in one directory
        assert engine.wait_for_save() is None
        with torch.no_grad():
            for p in engine.parameters():
                p.add_(1.0)
        engine.save_checkpoint(run, 4, opt, keep=2, sharded=True)  # the same step again: replaced, not mixed
        weights = engine.state_dict()
    assert [os.path.basename(p) for _, p in catalog.list_checkpoints(run)] == ["step-000000005.pt", "step-000000004"]
    with pipeddp.HybridParallel(make_mlp(seed=2), stages=1) as engine:
        engine.load(catalog.step_path(run, 4, True))
        assert_same(engine.state_dict(), weights, 0.0, "rewritten step 4")


@pytest.mark.timeout(120)
def test_resuming_a_sharded_checkpoint_restores_the_generators_and_continues_exactly(tmp_path):
    """Dropout draws from the generators: a resume that did not restore them (or the optimizer) would differ."""
    run = str(tmp_path / "run")
    batches = [data(8, seed=30 + i) for i in range(4)]

    def model(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 12)).double()

    def steps(engine, opt, part):
        for x, y in part:
            opt.zero_grad()
            engine.train_step(x, y, LOSS)
            opt.step()

    torch.manual_seed(1)
    with pipeddp.HybridParallel(model(0), stages=2, chunks=2, checkpoint="always") as engine:
        opt = adam(engine)
        steps(engine, opt, batches[:2])
        engine.save_checkpoint(run, 2, opt, sharded=True, async_save=True, extra={"batch": 2})
        steps(engine, opt, batches[2:])
        uninterrupted = engine.state_dict()
    torch.manual_seed(99)
    with pipeddp.HybridParallel(model(5), stages=2, chunks=2, checkpoint="always") as engine:
        opt = adam(engine)
        assert pipeddp.resume(engine, run, opt) == {"batch": 2, "step": 2}
        steps(engine, opt, batches[2:])
        assert_same(engine.state_dict(), uninterrupted, 0.0, "resumed against uninterrupted")


# -- safe to open ----------------------------------------------------------------------------------------------


class CreatesAFile:
    """Unpickling this object creates ``path``: what a malicious checkpoint would do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def saved(tmp_path, name="ok"):
    path = str(tmp_path / name)
    with pipeddp.HybridParallel(make_mlp(), stages=2) as engine:
        engine.save(path, optimizer=adam(engine), extra={"epoch": 2}, sharded=True)
    return path


def test_a_crafted_metadata_file_is_refused_and_nothing_in_it_runs(tmp_path):
    path = saved(tmp_path)
    marker = tmp_path / "pwned"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(CreatesAFile(str(marker)), f)
    for attempt in (lambda: sharded.read_metadata(path), lambda: cli(["convert", path, str(tmp_path / "x.pt")])):
        try:
            result = attempt()
        except ckpt.UnsafeCheckpointError as exc:
            assert "pathlib" in str(exc) and "nothing in it was run" in str(exc)
        else:
            assert result == 2  # the command line says so and exits 2
    with pipeddp.HybridParallel(make_mlp(), stages=1) as engine:
        with pytest.raises(ckpt.UnsafeCheckpointError, match=r"\.metadata was refused"):
            engine.load(path)
    assert not marker.exists()


def test_a_crafted_entry_is_refused_and_nothing_in_it_runs(tmp_path):
    path = saved(tmp_path)
    marker = tmp_path / "pwned"
    evil = str(tmp_path / "evil")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"pipeddp": (CreatesAFile(str(marker)),), "model": make_mlp().state_dict()},
                 checkpoint_id=evil, no_dist=True)
    with pipeddp.HybridParallel(make_mlp(), stages=1) as engine:
        with pytest.raises(ckpt.UnsafeCheckpointError, match="safe loader"):
            engine.load(evil)
        with pytest.raises(ckpt.UnsafeCheckpointError):
            sharded.to_file(evil, str(tmp_path / "x.pt"))
    assert not marker.exists()
    assert sharded.header(path, sharded.read_metadata(path))["extra"] == {"epoch": 2}


def test_a_damaged_shard_is_named(tmp_path):
    path = saved(tmp_path)
    shard = os.path.join(path, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(ckpt.DamagedCheckpointError, match=r"is damaged: its shard file __0_0.distcp holds \d+ bytes"):
        sharded.read_metadata(path)
    os.unlink(shard)
    with pytest.raises(ckpt.DamagedCheckpointError, match="__0_0.distcp is missing"):
        sharded.read_metadata(path)


# -- every rank refuses alike ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_every_rank_refuses_another_optimizer_another_model_and_an_unsafe_file_with_the_same_error(tmp_path):
    with pipeddp.HybridParallel(make_mlp(depth=2), stages=1) as engine:
        engine.save(str(tmp_path / "adam"), optimizer=adam(engine), sharded=True)
    with pipeddp.HybridParallel(other_model(), stages=1) as engine:
        engine.save(str(tmp_path / "other.pt"))
        engine.save(str(tmp_path / "other"), sharded=True)
    with pipeddp.HybridParallel(narrow_model(), stages=1) as engine:  # the same keys, one layer of other shapes
        optimizer = adam(engine)
        engine.train_step(torch.randn(4, 12, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64),
                          torch.nn.functional.mse_loss)
        optimizer.step()
        engine.save(str(tmp_path / "narrow.pt"), optimizer)
        engine.save(str(tmp_path / "narrow"), optimizer, sharded=True)
    run = tmp_path / "unsafe-run"
    run.mkdir()
    torch.save({"format": ckpt.FORMAT, "model": {}, "x": CreatesAFile(str(tmp_path / "pwned"))},
               str(run / "step-000000001.pt"))
    per_rank = pipeddp.spawn(refusals_job, 2, args=(str(tmp_path),), timeout=100)
    for got in per_rank:
        assert got["sgd for adam"].startswith("ValueError") and "torch.optim.adam.Adam" in got["sgd for adam"] \
            and "torch.optim.sgd.SGD" in got["sgd for adam"], got
        for name in ("other model (one file)", "other model (sharded)"):
            assert got[name].startswith("ValueError") and "checkpoint of another model" in got[name], got
            assert "missing keys (the model has them, the checkpoint does not): ['2.bias', '2.weight']" in got[name]
            assert "['1.bias', '1.weight', '3.bias', '3.weight']" in got[name]
        assert str(tmp_path / "other") in got["other model (sharded)"]
        assert got["unsafe newest"].startswith("UnsafeCheckpointError") and "step-000000001.pt" in got["unsafe newest"]
    for got in per_rank:  # rank 1 holds the last layer; every rank checks the whole model and says the same
        for name, path in (("narrower head (one file)", "narrow.pt"), ("narrower head (sharded)", "narrow")):
            said = f"ValueError: {tmp_path / path} holds tensors that do not fit the model (2 of them): 2.weight: " \
                   "saved [6, 12] float64, model [12, 12] float64; 2.bias: saved [6] float64, model [12] float64. " \
                   "Nothing was loaded"
            assert got[name].startswith(said), got[name]
        assert got["unchanged"] == "True"  # every refusal left every rank's share as it was
    assert not (tmp_path / "pwned").exists()
