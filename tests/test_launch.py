import socket
import time

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

import pipeddp
from launch_jobs import add_rank, env_of_child, fail_on_rank_1, join_group, sleep_forever


@pytest.mark.timeout(120)
def test_children_get_torchrun_environment_and_private_copies():
    t = torch.zeros(3)
    results = pipeddp.spawn(add_rank, 2, args=(t,), timeout=60)
    assert torch.equal(results[0], torch.ones(3)) and torch.equal(results[1], torch.full((3,), 2.0))
    assert torch.equal(t, torch.zeros(3))  # the parent's tensor was never shared
    envs = pipeddp.spawn(env_of_child, 3, timeout=60, threads=1)
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert all(e["WORLD_SIZE"] == "3" and e["LOCAL_WORLD_SIZE"] == "3" and e["threads"] == 1 for e in envs)
    assert len({e["MASTER_PORT"] for e in envs}) == 1


@pytest.mark.timeout(120)
def test_timeout_kills_everything():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks still running: \[0, 1\]"):
        pipeddp.spawn(sleep_forever, 2, timeout=1)
    assert time.monotonic() - start < 30


@pytest.mark.timeout(120)
def test_child_error_reaches_the_parent():
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="rank 1 broke"):
        pipeddp.spawn(fail_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < 30


@pytest.mark.timeout(180)
def test_a_job_whose_port_was_taken_meanwhile_starts_again_on_another(monkeypatch):
    """The port is free when spawn picks it, but another program may take it before rank 0 listens there (jobs
    started side by side): here one does, and the job starts again on a new port instead of failing."""
    from pipeddp.distributed import launch

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # held, listening: rank 0 cannot listen there
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    held = taken.getsockname()[1]
    first = iter([held])
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: next(first, None) or real())  # the held port, then free ones
    try:
        results = pipeddp.spawn(join_group, 2, timeout=120)
        assert [r["ranks"] for r in results] == [[0, 1], [0, 1]]
        assert results[0]["port"] == results[1]["port"] != str(held)  # the second attempt's port
        with pytest.raises(ProcessRaisedException, match="EADDRINUSE"):  # a port the caller fixed is not moved
            pipeddp.spawn(join_group, 2, timeout=60, env={"MASTER_PORT": str(held)})
    finally:
        taken.close()
