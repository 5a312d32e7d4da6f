"""A job of thousands of ranks played in one process (``benchmarks/scale.py``): the agreements' gathering
(``rows``: a star up to ``rows.STAR_UP_TO`` members, a binomial tree above) within 2 log2 N rounds and 2 log2 N
messages per rank at 4,096 and 16,384 ranks, the peers a step talks to within O(log N); and the plan the
simulation plays (``rows.tree_links``) checked against the messages a real gloo job's gathering makes, rank by
rank."""

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import pipeddp
from benchmarks import scale
from pipeddp.distributed import rows
from pipeddp.distributed.rows import gather_rows, tree_links


def counted_rows_job(star_up_to: int):
    """One gathering over the whole job, its isend/irecv calls from ``rows`` counted; every row checked against
    torch's all-gather."""
    import nccl_rules

    nccl_rules.install()
    rows.STAR_UP_TO = star_up_to
    calls = {"n": 0}
    real = {name: getattr(dist, name) for name in ("isend", "irecv")}

    def counting(name):
        def call(*args, **kwargs):
            calls["n"] += 1
            return real[name](*args, **kwargs)
        return call

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(3, dtype=torch.int64) + 10 * rank
    got = [torch.zeros_like(mine) for _ in range(world)]
    expected = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(expected, mine)
    for name in real:
        setattr(dist, name, counting(name))
    try:
        gather_rows(got, mine, group=None, ranks=list(range(world)), rank=rank, kind=3)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    dist.barrier()
    return calls["n"], torch.equal(torch.stack(got), torch.stack(expected))


@pytest.mark.timeout(120)
def test_the_simulated_plan_makes_the_real_gathering_s_messages():
    world = 7  # not a power of two: the tree's last subtrees are cut short
    results = pipeddp.spawn(counted_rows_job, world, args=(1,), timeout=90)
    assert all(same for _, same in results)
    for i, (messages, _) in enumerate(results):
        children, parent, _ = tree_links(world, i)
        assert messages == 2 * (len(children) + (parent is not None)), i
    plan = scale.agreement_plan(world) if world > rows.STAR_UP_TO else None
    assert plan is None  # at 7 members the default gathers over a star; the tree's plan played at 7:
    saved = rows.STAR_UP_TO
    rows.STAR_UP_TO = 1
    try:
        plan = scale.agreement_plan(world)
    finally:
        rows.STAR_UP_TO = saved
    assert plan["messages_max"] == max(m for m, _ in results)
    assert plan["rounds"] == 2 * max(bin(i).count("1") for i in range(world))  # up and down the deepest member


@pytest.mark.parametrize("n", [4096, 16384])
def test_a_job_of_thousands_agrees_within_log_rounds_and_messages(n):
    sim = scale.simulate([n], stages=8)[n]
    bound = 2 * math.log2(n)
    assert sim["rounds"] <= bound
    assert sim["messages_max"] <= bound  # per rank per agreement (two per step)
    assert sim["step_peers"] <= bound  # the agreements' tree, two pipeline neighbours, DDP's ring
    # today's groups: a full mesh of gloo connections over the world (docs/scale.md), linear in N
    assert sim["gloo_job"] >= n - 1
