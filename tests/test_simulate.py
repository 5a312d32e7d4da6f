import math

import pytest

from pipeddp.simulate import LINKS, Link, StageCost, bubble_bound, ring_allreduce_time, simulate


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
