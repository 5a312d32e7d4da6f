"""A fixed global batch over any replica count, and the data position that carries over a restart."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import pipeddp
from conftest import make_mlp, max_diff
from elastic_jobs import LOSS, fixed_global_batch_job, global_batches, indivisible_job, tied_model, tied_stage_job
from pipeddp.data import ElasticSampler
from pipeddp.distributed.elastic import DataPosition, plan_global_batch


def plain_training(batches, lr: float = 0.1):
    """The reference: the plain float64 model, one SGD step per whole global batch."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = LOSS(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return model.state_dict(), losses


# -- the global batch ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["1f1b", "auto"])
def test_accumulation_in_one_process_equals_the_plain_model(schedule):
    batches = global_batches(3, 16)
    expected, expected_losses = plain_training(batches)
    with pipeddp.HybridParallel(make_mlp(), stages=2, chunks=2, global_batch=16, batch_size=4,
                                schedule=schedule) as engine:
        assert (engine.global_batch, engine.replica_batch, engine.accumulation) == (16, 16, 4)
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        for (x, y), want in zip(batches, expected_losses):
            opt.zero_grad()
            assert engine.train_step(x, y, LOSS).item() == pytest.approx(want, rel=1e-12)
            opt.step()
        got = engine.state_dict()
    assert list(got) == list(expected)
    assert max_diff(got.values(), expected.values()) < 1e-12


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode, nprocs", [("replica", 2), ("stage", 4)])
def test_two_replicas_accumulating_equal_the_plain_model(mode, nprocs):
    batches = global_batches(3, 16)
    expected, expected_losses = plain_training(batches)
    for res in pipeddp.spawn(fixed_global_batch_job, nprocs, args=(mode, 16, 4, 3), timeout=200):
        assert (res["accumulation"], res["replica_batch"]) == (2, 8)
        assert res["losses"] == pytest.approx(expected_losses, rel=1e-12)
        assert max_diff(res["state"].values(), [expected[k] for k in res["state"]]) < 1e-12


@pytest.mark.timeout(120)
def test_a_global_batch_the_replicas_do_not_divide_is_refused_on_every_rank():
    for msg in pipeddp.spawn(indivisible_job, 2, timeout=100):
        assert "global_batch=9 does not divide over the 2 replicas" in msg and "multiple of 2 (2, 4, 6" in msg


def test_global_batch_arguments_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match=r"global_batch=10 gives each of the 1 replicas 10 samples per step, which "
                                         r"passes of batch_size=4 do not divide.*4, 8, 12.*\(1, 2, 5, 10\)"):
        pipeddp.HybridParallel(make_mlp(), stages=2, global_batch=10, batch_size=4)
    with pytest.raises(ValueError, match="batch_size=4 needs global_batch="):
        pipeddp.HybridParallel(make_mlp(), stages=2, batch_size=4)
    for bad in (0, 2.5, "8", True):
        with pytest.raises(ValueError, match="global_batch must be an int >= 1"):
            plan_global_batch(bad, None, 1)
    assert plan_global_batch(12, None, 3).accumulation == 1
    assert plan_global_batch(12, 2, 3).accumulation == 2


def test_a_batch_of_another_size_than_the_replica_batch_is_named():
    x, y = global_batches(1, 12)[0]
    with pipeddp.HybridParallel(make_mlp(), stages=2, global_batch=16, batch_size=4) as engine:
        with pytest.raises(ValueError, match=r"train_step got 12 samples per replica, but global_batch=16 over 1 "
                                             r"replica\(s\) makes 16 per replica"):
            engine.train_step(x, y, LOSS)


def tied_reference(steps: int):
    ref = tied_model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in global_batches(steps, 8):
        opt.zero_grad()
        LOSS(ref(x), y).backward()
        opt.step()
    return ref.state_dict()


def test_tied_weights_are_summed_once_per_step_under_accumulation():
    """The copies of a tied weight get their gradients summed after the last pass only."""
    with pipeddp.HybridParallel(tied_model(), stages=2, chunks=2, balance=[2, 3], global_batch=8,
                                batch_size=2) as engine:
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        for x, y in global_batches(2, 8):
            opt.zero_grad()
            engine.train_step(x, y, LOSS)
            opt.step()
        got = engine.state_dict()
    want = tied_reference(2)
    assert max_diff([got[k] for k in want], want.values()) < 1e-12


@pytest.mark.timeout(120)
def test_tied_weights_across_stage_processes_under_accumulation():
    want = tied_reference(2)
    for got in pipeddp.spawn(tied_stage_job, 2, args=(2,), timeout=100):
        assert max_diff([got[k] for k in want], want.values()) < 1e-12


# -- the data position -----------------------------------------------------------------------------------------


def consume(dataset_len: int, replicas: int, global_batch: int, position: DataPosition, steps: int):
    """Every replica's next ``steps`` global batches, joined per step (as sets: the order within a step is free)."""
    data = range(dataset_len)
    shares = [list(ElasticSampler(data, replicas, r, global_batch, position=position, seed=7)) for r in range(replicas)]
    per_replica = global_batch // replicas
    out = []
    for s in range(steps):
        out.append(sorted(i for share in shares for i in share[s * per_replica:(s + 1) * per_replica]))
    position.consumed += steps * global_batch
    return out


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_a_restart_with_another_replica_count_continues_the_epoch(before, after):
    n, global_batch = 50, 12
    everything = ElasticSampler(range(n), 1, 0, global_batch, position=DataPosition(), seed=7).order(0)
    position = DataPosition()
    steps = consume(n, before, global_batch, position, 2) + consume(n, after, global_batch, position, 2)
    assert steps == [sorted(everything[s * global_batch:(s + 1) * global_batch]) for s in range(4)]
    seen = [i for step in steps for i in step]
    assert len(seen) == len(set(seen)) == 48  # 50 // 12 whole global batches: nothing twice, nothing skipped


def test_the_epoch_permutation_depends_on_seed_and_epoch_only():
    a = ElasticSampler(range(40), 2, 0, 8, position=DataPosition(), seed=1)
    b = ElasticSampler(range(40), 4, 3, 8, position=DataPosition(), seed=1)
    assert a.order(3) == b.order(3) != a.order(4)
    assert sorted(a.order(0)) == list(range(40))
    assert ElasticSampler(range(40), 1, 0, 8, position=DataPosition(), shuffle=False).order(5) == list(range(40))


def test_the_loader_moves_the_position_as_it_hands_batches_out():
    dataset = torch.utils.data.TensorDataset(torch.arange(40.0).unsqueeze(1), torch.arange(40.0).unsqueeze(1))
    with pipeddp.HybridParallel(nn.Sequential(nn.Linear(1, 1)), stages=1, global_batch=12, batch_size=4) as engine:
        loader = pipeddp.data.loader(dataset, engine=engine, seed=2)
        assert len(loader) == 3 and loader.batch_size == 12
        it = iter(loader)
        first = next(it)[0]
        assert first.shape == (12, 1) and engine.position.state() == {"epoch": 0, "consumed": 12}
        rest = [x for x, _ in it]
        assert engine.position.state() == {"epoch": 1, "consumed": 0}  # exhausted: the next epoch's beginning
        assert len(rest) == 2
        loader.set_epoch(1)  # the current epoch: no change
        assert engine.position.state() == {"epoch": 1, "consumed": 0}
        engine.position.consumed = 24
        assert len(list(loader)) == 1
        loader.set_epoch(5)
        assert engine.position.state() == {"epoch": 5, "consumed": 0}
        with pytest.raises(ValueError, match="each replica's batch is 12; leave batch_size out"):
            pipeddp.data.loader(dataset, 4, engine=engine)
    with pytest.raises(ValueError, match="pass batch_size="):
        pipeddp.data.loader(dataset, replicas=1, replica=0)


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoints_record_the_position_and_resume_restores_it(tmp_path, sharded):
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 12, dtype=torch.float64),
                                             torch.randn(40, 12, dtype=torch.float64))
    with pipeddp.HybridParallel(make_mlp(), stages=2, global_batch=8, batch_size=4) as engine:
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        loader = pipeddp.data.loader(dataset, engine=engine, seed=4)
        for step, (x, y) in enumerate(loader, start=1):
            opt.zero_grad()
            engine.train_step(x, y, LOSS)
            opt.step()
            if step == 2:
                engine.save_checkpoint(str(tmp_path), step, opt, sharded=sharded, extra={"note": "a"})
                break
        with pytest.raises(ValueError, match="extra may not use the key 'data_position'"):
            engine.save(str(tmp_path / "x.pt"), extra={"data_position": 1})
        order = loader.sampler.order(0)
    with pipeddp.HybridParallel(make_mlp(seed=5), stages=2, global_batch=8, batch_size=2) as engine:
        extra = engine.resume(str(tmp_path), torch.optim.SGD(engine.parameters(), lr=0.1))
        assert extra["step"] == 2 and extra["note"] == "a"
        assert extra["data_position"] == {"epoch": 0, "consumed": 16, "global_batch": 8}
        assert engine.position.state() == {"epoch": 0, "consumed": 16}
        x, _ = next(iter(pipeddp.data.loader(dataset, engine=engine, seed=4)))
        assert torch.equal(x, dataset.tensors[0][order[16:24]])


def test_a_checkpoint_without_a_position_warns(tmp_path):
    with pipeddp.HybridParallel(make_mlp(), stages=2) as engine:
        engine.save_checkpoint(str(tmp_path), 1)
    with pipeddp.HybridParallel(make_mlp(), stages=2, global_batch=8) as engine:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.resume(str(tmp_path))
        assert any("holds no data position" in str(w.message) for w in caught)
        assert engine.position.state() == {"epoch": 0, "consumed": 0}
