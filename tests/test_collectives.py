"""The engine's collective calls made on some ranks only: an error on every rank, naming the calls, never an
abort or a wait for the whole timeout; and what one rank may do alone."""

import os
import re
import time

import pytest
import torch

import pipeddp
from conftest import data, make_mlp

LOSS = torch.nn.functional.mse_loss


def one_rank_save_job(path: str):
    """The habit from plain DDP, ``if rank == 0: save``, in stage mode: rank 0 saves while rank 1 trains."""
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance=[5, 6], timeout=20)
    rank = engine.topology.rank
    x, y = data(4)
    out = {}
    try:
        if rank == 0:
            engine.save(path)
        engine.train_step(x if rank == 0 else None, y if rank == 1 else None, LOSS)
    except pipeddp.CollectiveError as exc:
        out["mismatch"] = str(exc)
    # the engine goes on: the same call on every rank works
    engine.train_step(x if rank == 0 else None, y if rank == 1 else None, LOSS)
    # clipping is a collective too: rank 0 clips while rank 1 saves
    try:
        if rank == 0:
            engine.clip_grad_norm_(1.0)
        else:
            engine.save(path)
    except pipeddp.CollectiveError as exc:
        out["clip"] = str(exc)
    # a one-file save that fails on rank 0 (its directory is a file) fails on every rank, at once
    began = time.monotonic()
    try:
        engine.save(os.path.join(path + ".file", "ckpt.pt"))
    except Exception as exc:  # noqa: BLE001 - what each rank raised
        out["failed_save"] = (f"{type(exc).__name__}: {exc}", time.monotonic() - began)
    engine.close()
    return out


@pytest.mark.timeout(120)
def test_a_collective_called_on_one_rank_is_named_on_every_rank(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    (tmp_path / "ckpt.pt.file").write_text("not a directory")
    results = pipeddp.spawn(one_rank_save_job, 2, args=(path,), timeout=100)
    for rank, res in enumerate(results):
        assert "the ranks entered different collective calls (rank 0 save, rank 1 train_step)" in res["mismatch"]
        assert "call each on every rank, not under `if rank == 0:`" in res["mismatch"]
        assert "the ranks entered different collective calls (rank 0 clip_grad_norm_, rank 1 save)" in res["clip"]
        said, took = res["failed_save"]
        assert took < 10, took  # not the timeout (20 s)
        assert ("rank 0 failed" in said) == (rank == 1) and "ckpt.pt" in said, said
    assert not os.path.exists(path)


def lonely_save_job(path: str):
    """Rank 0 saves; rank 1 never does, and leaves: rank 0 hears why, promptly."""
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance=[5, 6], timeout=5)
    error = ""
    if engine.topology.rank == 0:
        try:
            engine.save(path)
        except pipeddp.CollectiveError as exc:
            error = str(exc)
    else:
        time.sleep(1)
    engine.close()
    return error


@pytest.mark.timeout(120)
def test_a_rank_alone_in_a_collective_says_what_to_do(tmp_path):
    error = pipeddp.spawn(lonely_save_job, 2, args=(str(tmp_path / "ckpt.pt"),), timeout=100)[0]
    assert "rank 0 (stage 0) entered save, a collective, and not every rank came: each must call save too" in error, \
        error


def replica_state_job():
    """Replica mode without shard=: every process holds the whole model, so one rank may take its state alone."""
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, chunks=2)
    x, y = data(8)
    r = engine.topology.replica
    engine.train_step(x[r * 4:(r + 1) * 4], y[r * 4:(r + 1) * 4], LOSS)
    state = engine.state_dict() if r == 0 else None
    engine.close()
    return state


@pytest.mark.timeout(120)
def test_in_replica_mode_one_rank_may_take_the_state_dict_alone():
    plain = make_mlp()
    state = pipeddp.spawn(replica_state_job, 2, timeout=100)[0]
    assert list(state) == list(plain.state_dict())
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())  # no step taken: the initial weights


def drifted_replica_job():
    """2 replicas x 2 stages; rank 3 (stage 1 of replica 1) changes one weight alone. Before, rank 3 saves while the
    others check the replicas: every rank hears of it."""
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance="uniform")
    try:
        engine.save(os.path.join("no", "such", "directory")) if engine.topology.rank == 3 else engine.check_replicas()
        mixed = "no error"
    except pipeddp.CollectiveError as exc:
        mixed = str(exc)
    assert "(rank 0 check_replicas, rank 1 check_replicas, rank 2 check_replicas, rank 3 save)" in mixed, mixed
    engine.check_replicas()  # identical copies pass
    if engine.topology.rank == 3:
        with torch.no_grad():
            next(engine.parameters()).add_(1e-3)
    try:
        engine.check_replicas()
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_replicas_that_drifted_apart_are_named_on_every_rank():
    messages = pipeddp.spawn(drifted_replica_job, 4, timeout=100)
    keys = set(make_mlp().state_dict())
    for message in messages:
        found = re.fullmatch(r"stage 1: parameter '(.+)' differs between replicas \(ranks \[3\] disagree with rank 1\)",
                             message)
        assert found and found.group(1) in keys, message
    assert len(set(messages)) == 1
