"""``data.loader(..., prefetch=k)``: batches prepared ahead on a thread, the data position still exact."""

import threading
import time

import pytest
import torch
from torch import nn

import pipeddp
from conftest import make_mlp
from elastic_jobs import LOSS


class Recording(torch.utils.data.Dataset):
    """Samples i -> (i, i); remembers which it loaded, each after ``delay`` seconds (a slow disk)."""

    def __init__(self, n: int, delay: float = 0.0, fail_at: int = -1) -> None:
        self.n, self.delay, self.fail_at = n, delay, fail_at
        self.loaded = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise KeyError(f"sample {i} is unreadable")
        if self.delay:
            time.sleep(self.delay)
        self.loaded.append(i)
        x = torch.full((12,), float(i), dtype=torch.float64)
        return x, x.clone()


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "pipeddp-prefetch"]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_prefetch_must_be_a_non_negative_int(bad):
    with pytest.raises(ValueError, match=f"prefetch must be a non-negative int .*prefetch={bad!r}"):
        pipeddp.data.loader(Recording(8), 2, replicas=1, replica=0, prefetch=bad)


def test_prefetched_batches_are_the_loaders_batches_in_order():
    plain = [x for x, _ in pipeddp.data.loader(Recording(30), 4, replicas=2, replica=1, seed=3)]
    ahead = [x for x, _ in pipeddp.data.loader(Recording(30), 4, replicas=2, replica=1, seed=3, prefetch=3)]
    assert len(plain) == len(ahead) == 4 and all(torch.equal(a, b) for a, b in zip(plain, ahead))
    assert not prefetch_threads()  # exhausted: the thread is joined


def test_a_batch_prepared_ahead_is_not_consumed_and_a_checkpoint_resumes_at_the_right_sample(tmp_path):
    data = Recording(40)
    with pipeddp.HybridParallel(make_mlp(), stages=2, global_batch=8, batch_size=4) as engine:
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        loader = pipeddp.data.loader(data, engine=engine, seed=4, prefetch=2)
        for step, (x, y) in enumerate(loader, start=1):
            opt.zero_grad()
            engine.train_step(x, y, LOSS)
            opt.step()
            if step == 2:
                deadline = time.monotonic() + 10
                while len(data.loaded) < 32 and time.monotonic() < deadline:  # the thread runs 2 batches ahead
                    time.sleep(0.01)
                assert len(data.loaded) == 32 and engine.position.state() == {"epoch": 0, "consumed": 16}
                engine.save_checkpoint(str(tmp_path), step, opt)
                break
        assert not prefetch_threads()  # the loop's break dropped the iterator: its thread is joined
        order = loader.sampler.order(0)
    with pipeddp.HybridParallel(make_mlp(seed=5), stages=2, global_batch=8, batch_size=4) as engine:
        engine.resume(str(tmp_path), torch.optim.SGD(engine.parameters(), lr=0.1))
        assert engine.position.state() == {"epoch": 0, "consumed": 16}
        loader = pipeddp.data.loader(data, engine=engine, seed=4, prefetch=1)
        x, _ = next(iter(loader))
        assert x[:, 0].tolist() == [float(i) for i in order[16:24]]
        assert engine.position.state() == {"epoch": 0, "consumed": 24}
        loader.close()
        assert not prefetch_threads()


def test_an_error_while_loading_reaches_the_caller():
    loader = pipeddp.data.loader(Recording(20, fail_at=9), 4, replicas=1, replica=0, shuffle=False, prefetch=2)
    got = []
    with pytest.raises(KeyError, match="sample 9 is unreadable"):
        for x, _ in loader:
            got.append(x)
    assert len(got) == 2 and not prefetch_threads()


def test_loading_overlaps_the_step():
    # loading a batch takes 4 x 15 ms (sleeps: the thread holds no core), a step 60 ms: serial 8 x 120 ms
    def run(prefetch: int) -> float:
        loader = pipeddp.data.loader(Recording(32, delay=0.015), 4, replicas=1, replica=0, prefetch=prefetch)
        start = time.perf_counter()
        for _ in loader:
            time.sleep(0.06)
        return time.perf_counter() - start

    serial, overlapped = run(0), run(2)
    assert overlapped < 0.75 * serial, (serial, overlapped)


def test_an_engine_without_cuda_leaves_the_batch_where_the_loader_made_it():
    with pipeddp.HybridParallel(nn.Sequential(nn.Linear(12, 12)), stages=1, devices=["cpu"]) as engine:
        loader = pipeddp.data.loader(Recording(8), 4, engine=engine, prefetch=1)
        assert loader.placement is not None and not loader.placement.active
        assert [x.device.type for x, _ in loader] == ["cpu", "cpu"]
