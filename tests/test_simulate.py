import pytest

from pipeddp.tools.simulate import LINKS, Link, StageCost, bubble_bound, ring_allreduce_time, simulate


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_textbook_results_on_unit_costs(schedule, p, m):
    pred = simulate([StageCost(1.0, 1.0)] * p, schedule, chunks=m)
    assert pred.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert pred.step_time == pytest.approx(2 * (m + p - 1))
    expect = [m] * p if schedule == "gpipe" else [min(p - s, m) for s in range(p)]
    assert pred.peak_activations == expect
    # the speedup over one stage doing all the work is the bubble bound
    assert (2 * m * p) / pred.step_time == pytest.approx(bubble_bound(p, m))


def test_links_and_allreduce():
    link = Link(bandwidth=100.0, latency=0.5)
    assert link.time(100) == pytest.approx(1.5)
    assert LINKS["local"].time(1e12) == 0.0
    # ring all-reduce of 400 bytes over 4 replicas: 6 steps of 100 bytes + 6 latencies
    assert ring_allreduce_time(400, 4, link) == pytest.approx(6 * 0.5 + 6 * 100 / 100)
    assert ring_allreduce_time(400, 1, link) == 0.0
    # two stages, one micro-batch: F0 | copy | F0' B0' | copy | B0
    costs = [StageCost(1.0, 2.0, activation_bytes=100), StageCost(1.0, 2.0)]
    pred = simulate(costs, "gpipe", chunks=1, links=link)
    assert pred.step_time == pytest.approx(1 + 1.5 + 1 + 2 + 1.5 + 2)
    # an all-reduce longer than the last backward is partly exposed
    costs = [StageCost(1.0, 2.0, param_bytes=1000), StageCost(1.0, 2.0, param_bytes=10)]
    pred = simulate(costs, "gpipe", chunks=1, replicas=2, links="local", allreduce_link=Link(100.0))
    assert pred.allreduce_time[0] == pytest.approx(2 * 1 / 2 * 1000 / 100)  # 10 s
    stage0_last_b_start = 1 + 1 + 2
    assert pred.step_time == pytest.approx(stage0_last_b_start + 10)
    assert pred.exposed_allreduce == pytest.approx(pred.step_time - pred.makespan)


def test_unknown_link():
    with pytest.raises(ValueError, match="unknown link"):
        simulate([StageCost(1, 1)], links="carrier pigeon")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_contention_of_one_is_the_plain_model(schedule):
    costs = [StageCost(1.0, 2.5, activation_bytes=100), StageCost(0.7, 1.1, activation_bytes=50), StageCost(1.3, 2.0)]
    link = Link(bandwidth=1000.0, latency=0.05)
    plain = simulate(costs, schedule, chunks=5, links=link)
    shared = simulate(costs, schedule, chunks=5, links=link, contention=[1.0, 1.0, 1.0])
    assert shared.step_time == pytest.approx(plain.step_time)
    for a, b in zip(plain.played.events, shared.played.events):
        assert [e[0] for e in a] == [e[0] for e in b]
        # flat lists: pytest >= 9.2 refuses approx over nested structures
        assert [t for e in a for t in e[1:]] == pytest.approx([t for e in b for t in e[1:]])


def test_contention_slows_only_overlapped_compute():
    # 2 stages, unit costs, GPipe m=2, two workers at once run at half speed:
    # s0 F0 0-1 alone | s0 F1 + s1 F0 1-3 together | s1 F1 3-4, B0 4-5 alone | s1 B1 + s0 B0 5-7 | s0 B1 7-8
    pred = simulate([StageCost(1.0, 1.0)] * 2, "gpipe", chunks=2, contention=[1.0, 2.0])
    assert pred.step_time == pytest.approx(8.0)
    assert pred.played.events[1][0][1:] == pytest.approx((1.0, 3.0))
    # one micro-batch never overlaps: no slowdown
    assert simulate([StageCost(1.0, 1.0)] * 2, "1f1b", chunks=1, contention=[1.0, 2.0]).step_time == pytest.approx(4.0)
    # replicas share the host too: one stage x 2 replicas is always 2 workers; beyond the list, time sharing
    assert simulate([StageCost(1.0, 1.0)], chunks=3, replicas=2, contention=[1.0, 1.5]).step_time == pytest.approx(9.0)
    assert simulate([StageCost(1.0, 1.0)], chunks=1, replicas=4, contention=[1.0, 1.5]).step_time == pytest.approx(6.0)
    with pytest.raises(ValueError, match="contention"):
        simulate([StageCost(1.0, 1.0)], contention=[])


def test_bucketed_allreduce_and_step_overhead():
    # one stage, B from 1 to 3, 300 bytes in buckets of 100, each bucket 1 s on the ring of 2 replicas
    link = Link(bandwidth=100.0)
    cost = [StageCost(1.0, 2.0, param_bytes=300)]
    whole = simulate(cost, chunks=1, replicas=2, allreduce_link=link)
    assert whole.step_time == pytest.approx(1 + 3)  # one piece, started with the backward
    pred = simulate(cost, chunks=1, replicas=2, allreduce_link=link, bucket_bytes=100)
    # buckets ready at 1+2/3, 1+4/3, 3; reduced one after another
    assert pred.step_time == pytest.approx(3 + 1 + 2 / 3)
    assert pred.allreduce_time[0] == pytest.approx(3.0)
    assert pred.exposed_allreduce == pytest.approx(1 + 2 / 3)
    # a fixed cost per step
    plain = simulate([StageCost(1.0, 1.0)] * 2, "1f1b", chunks=4)
    over = simulate([StageCost(1.0, 1.0)] * 2, "1f1b", chunks=4, step_overhead=0.5)
    assert over.step_time == pytest.approx(plain.step_time + 0.5)
    assert over.makespan == pytest.approx(plain.makespan)


def test_collectives_that_share_the_cores():
    # one stage x 2 replicas on 2 cores without cache effects (contention [1, 1]): F 0-1, B 1-?, 3 buckets of 1 s.
    # bucket 0 may start at 1/3 of B (t = 1 2/3); from then 4 workers share 2 cores: everything at half speed.
    # B ends at 4 1/3, bucket 0 ends at 3 2/3, bucket 1 runs 3 2/3 - 5 (half speed until B ends), bucket 2 5 - 6.
    link = Link(bandwidth=100.0)
    cost = [StageCost(1.0, 2.0, param_bytes=300)]
    pred = simulate(cost, chunks=1, replicas=2, allreduce_link=link, bucket_bytes=100, contention=[1.0, 1.0],
                    collectives_share_cores=True)
    assert pred.step_time == pytest.approx(6.0)
    assert pred.played.events[0][-1][1:] == pytest.approx((1.0, 4 + 1 / 3))
    assert pred.exposed_allreduce == pytest.approx(6.0 - (4 + 1 / 3))
    # without sharing, the same buckets overlap the backward (4 2/3, see above)
    apart = simulate(cost, chunks=1, replicas=2, allreduce_link=link, bucket_bytes=100, contention=[1.0, 1.0])
    assert apart.step_time == pytest.approx(4 + 2 / 3)
    # one replica: nothing to reduce, nothing shared
    alone = simulate(cost, chunks=1, replicas=1, allreduce_link=link, contention=[1.0, 1.0],
                     collectives_share_cores=True)
    assert alone.step_time == pytest.approx(3.0)
    with pytest.raises(ValueError, match="needs contention"):
        simulate(cost, replicas=2, collectives_share_cores=True)
