"""Watching a run: ``engine.last_step``'s figures against what a stopwatch and the plain model say, the
``"pipeddp"`` logger's records (rank 0 only, every ``log_every`` steps, none unless logging is configured), and
the profile's progress bar (only on a terminal)."""

import logging
import time

import pytest
import torch
from conftest import data, make_mlp, stderr_on_a_terminal
from hybrid_jobs import init
from torch import nn

import pipeddp

MSE = nn.functional.mse_loss


def counted_mse(out, y):
    """A loss over counted items: the rows whose first target is positive (as a token loss counts its tokens)."""
    keep = y[:, 0] > 0
    return (((out - y) ** 2) * keep[:, None]).sum(), keep.sum()


class Records(logging.Handler):
    """Every record that reaches the ``"pipeddp"`` logger's handlers."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def records():
    handler = Records()
    log = logging.getLogger("pipeddp")
    level = log.level
    log.addHandler(handler)
    yield handler.records
    log.removeHandler(handler)
    log.setLevel(level)


def timed_step(engine, x, y, loss_fn):
    start = time.perf_counter()
    loss = engine.train_step(x, y, loss_fn)
    return loss, time.perf_counter() - start


def check_figures(stats, wall: float, samples: int, count=None, timed: bool = True) -> None:
    """The step's figures against the stopwatch around its call and the batch it was given; each device's idle
    share where the step was ``timed`` (a step to log), else none."""
    assert 0 < stats.seconds <= wall
    assert stats.samples == samples
    assert stats.samples_per_s == pytest.approx(samples / stats.seconds, rel=1e-12)
    if count is None:
        assert stats.tokens is None and stats.tokens_per_s is None
    else:
        assert stats.tokens == count
        assert stats.tokens_per_s == pytest.approx(count / stats.seconds, rel=1e-12)
    if timed:
        assert stats.idle and all(v is not None and 0.0 <= v <= 1.0 for v in stats.idle.values()), stats.idle
    else:
        assert stats.idle and all(v is None for v in stats.idle.values()), stats.idle
    assert all(v is None for v in stats.peak_memory.values())  # the CPU has no per-device figure


@pytest.mark.timeout(60)
def test_a_pipeline_s_step_figures_are_the_stopwatch_s_and_the_batch_s(records):
    """Time within the wall time around the call, samples/s of the batch, tokens/s of the plain loss's count,
    idle shares on the steps to log; with logging not configured (the logger's level unset) nothing is emitted."""
    x, y = data(12)
    with pipeddp.Pipeline(make_mlp(), ["cpu", "cpu"], chunks=4, balance="uniform") as pipe:
        assert pipe.last_step is None and pipe.log_every == 100
        _, wall = timed_step(pipe, x, y, MSE)
        check_figures(pipe.last_step, wall, 12, timed=False)  # step 1 of 100: its actions are not timed
        pipe.log_every = 1
        pipe.zero_grad()  # a step whose loss changes kind starts from no gradients
        _, wall = timed_step(pipe, x, y, counted_mse)
        check_figures(pipe.last_step, wall, 12, count=float(counted_mse(x, y)[1]))
        assert pipe.last_step.step == 2 and pipe.last_step.waiting is None
        assert records == []  # not configured: the logger's level is WARNING's
        logging.getLogger("pipeddp").setLevel(logging.INFO)
        for _ in range(2):
            timed_step(pipe, x, y, MSE)
        assert [r.step_stats.step for r in records] == [3, 4]
        assert records[-1].getMessage().startswith("step 4: ") and "samples/s" in records[-1].getMessage()
        pipe.log_every = None
        timed_step(pipe, x, y, MSE)
        assert len(records) == 2
        with pytest.raises(ValueError, match="log_every"):
            pipe.log_every = -1


def heavy_light(heavy: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(heavy)], nn.Identity()).double()


@pytest.mark.timeout(60)
def test_idle_is_larger_where_the_stages_are_unbalanced():
    """Eight heavy layers against an identity, or four against four plus the identity: the devices of the
    lopsided cut idle more (the light one waits for the heavy one's outputs most of the step)."""
    x = torch.randn(64, 256, dtype=torch.float64)
    y = torch.randn(64, 256, dtype=torch.float64)
    idle = {}
    for name, balance in (("balanced", [4, 5]), ("unbalanced", [8, 1])):
        with pipeddp.Pipeline(heavy_light(8), ["cpu", "cpu"], chunks=8, balance=balance, threads=1,
                              log_every=1) as pipe:
            seen = []
            for _ in range(4):
                pipe.train_step(x, y, MSE)
                seen.append(max(pipe.last_step.idle.values()))
            idle[name] = sorted(seen)[1:3]  # the middle two: the first step warms up
    assert min(idle["unbalanced"]) > max(idle["balanced"]), idle
    assert max(idle["unbalanced"]) > 0.5, idle


def watch_job():
    """A 2-process job, in stage mode then replica mode (2 stages each): rank 0 logs every ``log_every`` steps,
    rank 1 never; the figures count every replica's samples and the plain loss's global count."""
    init()
    handler = Records()
    log = logging.getLogger("pipeddp")
    log.addHandler(handler)
    rank = torch.distributed.get_rank()
    out = {}
    x, y = data(20)
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance="uniform", log_every=1)
    engine.train_step(x if engine.is_first else None, y if engine.is_last else None, counted_mse)
    out["quiet"] = len(handler.records)  # logging not configured
    log.setLevel(logging.INFO)
    engine.log_every = 2
    walls = []
    for _ in range(5):
        _, wall = timed_step(engine, x if engine.is_first else None, y if engine.is_last else None, counted_mse)
        walls.append(wall)
    out["stage"] = (engine.last_step, walls[-1], [r.step_stats.step for r in handler.records])
    engine.close()
    handler.records.clear()
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="replica", chunks=2, balance="uniform",
                                    devices=["cpu", "cpu"], log_every=3)
    mine = slice(10 * rank, 10 * rank + 10)
    for _ in range(3):
        _, wall = timed_step(engine, x[mine], y[mine], MSE)
    out["replica"] = (engine.last_step, wall, [r.step_stats.step for r in handler.records])
    engine.close()
    log.removeHandler(handler)
    return out


@pytest.mark.timeout(120)
def test_rank_0_logs_every_log_every_steps_the_job_s_figures():
    results = pipeddp.spawn(watch_job, 2, timeout=100)
    x, y = data(20)
    count = float(counted_mse(x, y)[1])
    for rank, res in enumerate(results):
        assert res["quiet"] == 0
        stats, wall, logged = res["stage"]
        check_figures(stats, wall, 20, count=count)  # one replica of the 20 samples
        assert stats.step == 6 and stats.waiting is not None and 0 <= stats.waiting <= stats.seconds
        assert logged == ([2, 4, 6] if rank == 0 else []), (rank, logged)
        stats, wall, logged = res["replica"]
        check_figures(stats, wall, 20)  # two replicas of 10
        assert len(stats.idle) == 2 and stats.waiting is not None and 0 <= stats.waiting <= stats.seconds
        assert logged == ([3] if rank == 0 else []), (rank, logged)


@pytest.mark.timeout(60)
def test_the_profile_shows_progress_on_a_terminal_only(capfd, monkeypatch):
    """``balance="time"`` profiles the layers first: a bar on a terminal's stderr, nothing in a pipe or a file."""
    model = make_mlp()
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=2, sample=torch.randn(8, 12, dtype=torch.float64),
                          balance="time"):
        pass
    assert capfd.readouterr() == ("", "")  # pytest's capture: no terminal
    with stderr_on_a_terminal(monkeypatch) as shown:
        with pipeddp.Pipeline(make_mlp(), ["cpu", "cpu"], chunks=2,
                              sample=torch.randn(8, 12, dtype=torch.float64), balance="time"):
            pass
    assert b"profiling 11 layers" in b"".join(shown), b"".join(shown)[-2000:]
    assert capfd.readouterr() == ("", "")  # nothing reached the process's own stderr

