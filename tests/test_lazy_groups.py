"""With ``PIPEDDP_LAZY_GROUPS=1`` pipeddp's gloo groups connect a pair of ranks on first use (``distributed.lazy``):
a 2 x 2 stage-mode job that
starts its own process group holds after setup fewer connections than its groups' full meshes, trains exactly as
the plain model, and two ranks whose first connection comes after world rank 0 (which serves the store) is done
still make it: rank 0's exit waits for them."""

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import pipeddp
from conftest import make_mlp, reference_training
from hybrid_jobs import LOSS, global_batches, local_slice


def peer_connections() -> int:
    """This process's established TCP connections, less those with the rendezvous store (its port either end)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    store_port = int(os.environ["MASTER_PORT"])
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                local, remote, state, inode = cols[1], cols[2], cols[3], cols[9]
                ports = {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)}
                count += inode in inodes and state == "01" and store_port not in ports  # 01: ESTABLISHED
    return count


def lazy_job(steps: int):
    """Build (the engine starts the process group), count connections, train ``steps`` steps; then ranks 2 and 3
    meet for the first time on their pipeline's group while rank 0 returns at once."""
    rank = int(os.environ["RANK"])
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance="uniform", timeout=60)
    groups = engine._replica.groups
    built = peer_connections()
    topo = engine.topology
    full_mesh = sum(len(ranks) - 1 for ranks in (topo.job_ranks, topo.stage_ranks(topo.stage),
                                                  topo.pipeline_ranks(topo.replica)))
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    for batch in global_batches(2, steps):
        x, y = local_slice(batch, engine.topology.replica, 10)
        opt.zero_grad()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        opt.step()
    state = engine.state_dict()
    if rank in (2, 3):  # the pipeline group of replica 1: no step of this job sent anything over it
        time.sleep(1.0)  # rank 0 is gone from its job by now; it serves the store this first connection reads
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=groups.pipeline)
        assert total.item() == 5.0
    return {"built": built, "full_mesh": full_mesh, "state": state if rank == 0 else None,
            "lazy_env": os.environ.get("TORCH_GLOO_LAZY_INIT")}


@pytest.mark.timeout(120)
def test_lazy_groups_connect_less_train_exactly_and_outlive_rank0():
    steps = 2
    results = pipeddp.spawn(lazy_job, 4, args=(steps,), timeout=100, env={"PIPEDDP_LAZY_GROUPS": "1"})
    for rank, r in enumerate(results):
        assert r["lazy_env"] is None  # torch's variable restored as it was (unset)
        # eager: the world's mesh (3), the stage group's (1), the pipeline's (1) on every rank
        assert r["full_mesh"] == 5
        if rank:  # rank 0 broadcasts the partition to every rank during setup
            assert r["built"] < r["full_mesh"] - 1, [r["built"] for r in results]
    _, params = reference_training(make_mlp(), [(x, y) for x, y in global_batches(2, steps)], LOSS)
    state = results[0]["state"]
    for name, p in zip(make_mlp().state_dict(), params):
        torch.testing.assert_close(state[name], p, rtol=0, atol=1e-12)


def test_the_setting_is_checked_and_torch_s_variable_restored_as_the_user_set_it(monkeypatch):
    from pipeddp.distributed import lazy

    monkeypatch.setenv("PIPEDDP_LAZY_GROUPS", "yes")
    with pytest.raises(ValueError, match="PIPEDDP_LAZY_GROUPS='yes': set it to 1"):
        lazy.enabled()
    monkeypatch.setenv("PIPEDDP_LAZY_GROUPS", "1")
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "0")  # the user's own groups eager: kept so after pipeddp's
    with lazy.made_lazily(timedelta(seconds=5)):
        assert os.environ["TORCH_GLOO_LAZY_INIT"] == "1"
    assert os.environ["TORCH_GLOO_LAZY_INIT"] == "0"


def cut_job(groups: int):
    """Rank 1 cuts ``groups`` lazy groups of two that never carried anything (on each, one rank of the pair is the
    one that accepts the connection, by the listening ports: a coin toss per group), then one that did, while rank 0
    waits there for a message that never comes."""
    from pipeddp.distributed import cut

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # the world's group eager: the test's own signals
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    idle = [dist.new_group([0, 1], timeout=timedelta(seconds=60)) for _ in range(groups)]
    used = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    del os.environ["TORCH_GLOO_LAZY_INIT"]
    token = torch.zeros(1)
    dist.broadcast(token, 0, group=used)  # the pair of ``used`` connects
    out = {}
    if rank == 1:
        start = time.monotonic()
        out["closed"] = [cut.cut_group(g, [0]) for g in idle]
        out["idle_s"] = time.monotonic() - start
        dist.barrier()  # rank 0 now waits on ``used``
        time.sleep(0.5)
        out["used_closed"] = cut.cut_group(used, [0])
    else:
        dist.barrier()
        start = time.monotonic()
        with pytest.raises(RuntimeError):
            dist.recv(token, 1, group=used)  # fails when rank 1 cuts, not at the group's timeout (60 s)
        out["woken_s"] = time.monotonic() - start
    return out


@pytest.mark.timeout(90)
def test_the_cut_skips_a_lazy_pair_never_connected_and_still_closes_a_connected_one():
    """Before, the cut's receive on a pair never connected waited for the peer to connect (40 s) where this rank
    was the accepting side of the pair; now its posting is left behind after ``cut.POSTING`` seconds, and a receive
    from any rank, which waits for no connection, closes the group (before, a group whose every pair was never
    connected, this rank the accepting side, stayed open: a wait of this rank's on it went on)."""
    groups = 10
    results = pipeddp.spawn(cut_job, 2, args=(groups,), timeout=80)
    cutter, waiter = results[1], results[0]
    assert cutter["idle_s"] < groups * 0.25 + 3.0, cutter  # at most POSTING per group that accepts, not 40 s
    assert all(cutter["closed"]), cutter  # the groups where rank 1 only accepts too: closed by a receive from any
    assert cutter["used_closed"] and waiter["woken_s"] < 3.0, (cutter, waiter)


def watch_job(alive_s: float):
    """Rank 1 waits in an all-gather on a lazy group never connected, inside a guard; rank 0 posts the notice of its
    own failure a second later and then stays alive without cutting anything (nothing it does reaches rank 1's
    wait, whichever side of the pair connects), for ``alive_s`` seconds (rank 0 serves the store: rank 1 would
    wait on its exit to tell the others otherwise)."""
    from pipeddp.distributed import lazy
    from pipeddp.distributed.notice import Notices
    from pipeddp.distributed.topology import Topology

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    with lazy.made_lazily(timedelta(seconds=60)):
        group = dist.new_group([0, 1], timeout=timedelta(seconds=60))
    notices = Notices(Topology(rank, 2, rank, 2, 2, "stage"), [group])
    out = {"watching": any(t.name == "pipeddp-lazy-watch" for t in threading.enumerate())}
    if rank == 0:
        time.sleep(1.0)  # rank 1 waits by now
        notices.post(ValueError("the batch holds a NaN"), "evaluate")
        time.sleep(alive_s)
        return out
    start = time.monotonic()
    try:
        with notices.guard("evaluate"):
            dist.all_gather([torch.zeros(1), torch.zeros(1)], torch.ones(1), group=group)
    except Exception as exc:  # noqa: BLE001 - what rank 1 raised, and when
        out.update(type=type(exc).__name__, error=str(exc), after_s=time.monotonic() - start)
    return out


@pytest.mark.timeout(90)
def test_a_wait_on_a_pair_never_connected_ends_when_a_failure_is_posted():
    """Before, rank 1 waited until rank 0 exited (where it connects: rank 0's listener took the connection) or gloo's
    connect timeout (25-40 s, where it accepts); now its watcher cuts its groups when the notice is posted."""
    alive_s = 6.0
    failed, waiter = pipeddp.spawn(watch_job, 2, args=(alive_s,), timeout=80, env={"PIPEDDP_LAZY_GROUPS": "1"})
    assert waiter.get("after_s", 99) < 1.0 + 3.0, waiter  # the notice after 1 s; rank 0 alive for 6 s more
    assert waiter["watching"] and failed["watching"], (waiter, failed)
    assert waiter["type"] == "PeerFailed", waiter
    assert waiter["error"].startswith("rank 1 (stage 1) stopped its evaluate: rank 0 (stage 0) failed in its "
                                      "evaluate with ValueError: the batch holds a NaN"), waiter
