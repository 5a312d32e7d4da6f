import itertools
import random

import pytest
import torch
from torch import nn

from pipeddp.partitioning.report import partition
from pipeddp.partitioning.solve import block_move, solve


def brute(costs, k):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    return best


def bottleneck(costs, balance):
    out, i = [], 0
    for b in balance:
        out.append(sum(costs[i:i + b]))
        i += b
    return max(out)


def test_known_cases_where_block_moves_fail():
    costs = [1] * 8 + [10]
    assert solve(costs, 2) == [8, 1]
    assert bottleneck(costs, block_move(costs, 2)) > 10
    costs = [5] + [1] * 11
    assert bottleneck(costs, solve(costs, 3)) == 6
    assert bottleneck(costs, block_move(costs, 3)) > 6


def test_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([0, 1, 2, 3, 5, 8, 13, rng.random() * 10]) for _ in range(n)]
        bal = solve(costs, k)
        assert len(bal) == k and sum(bal) == n and min(bal) >= 1
        assert bottleneck(costs, bal) == pytest.approx(brute(costs, k))


def test_transfer_cost_moves_the_cut():
    # compute alone would cut after layer 1; its output is huge, after layer 2 it is small
    costs = [1.0, 1.0, 1.0, 1.0]
    comm = [0.0, 5.0, 0.0, 0.0]
    assert solve(costs, 2) == [2, 2]
    assert solve(costs, 2, comm) in ([1, 3], [3, 1])


def test_errors():
    with pytest.raises(ValueError, match="at least one layer"):
        solve([1, 2], 3)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ValueError, match="at least one"):
        partition(model, 3, method="params")
    with pytest.raises(ValueError, match="sums to 3"):
        partition(model, 2, method=[1, 2])
    with pytest.raises(ValueError, match="sample"):
        partition(model, 2, method="time")
    with pytest.raises(TypeError, match="nn.Sequential"):
        partition(nn.Linear(2, 2), 1)


@pytest.mark.filterwarnings("ignore::pipeddp.HeavyLayerWarning")  # a small model: one layer may dominate
def test_time_profiles_in_place_layers():
    # torchvision's ResNet stem: conv, bn, ReLU(inplace=True)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(144, 2))
    x = torch.randn(4, 3, 8, 8)
    before = x.clone()
    plan = partition(model, 3, method="time", sample=x)
    assert sum(plan.balance) == 5 and all(c.time > 0 for c in plan.layers[:3])
    assert torch.equal(x, before)  # the sample itself is never written to


@pytest.mark.filterwarnings("ignore::pipeddp.HeavyLayerWarning")  # a small model: one layer may dominate
def test_methods_and_report():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(16, 64)
    by_params = partition(model, 2, method="params")
    assert by_params.balance == [1, 4]  # 4160 params vs 520 + 72
    assert partition(model, 5, method="uniform").balance == [1] * 5
    timed = partition(model, 2, method="time", sample=x, chunks=2)
    assert sum(timed.balance) == 5 and all(c.time > 0 for c in timed.layers)
    assert timed.layers[0].activation_bytes == 8 * 64 * 4  # first micro-batch of 8 samples
    mem = partition(model, 2, method="memory", sample=x)
    assert mem.stage_costs[0] >= mem.layer_costs[0]
    text = str(timed)
    for col in ("stage", "layers", "params", "fwd+bwd ms", "activation out", "share of bottleneck"):
        assert col in text


def test_a_layer_over_a_stage_share_warns_naming_it_and_how_to_split():
    import warnings

    from pipeddp import HeavyLayerWarning

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 8))
    x = torch.randn(4, 8)
    with pytest.warns(HeavyLayerWarning) as caught:
        plan = partition(model, 4, method="memory", sample=x)
    assert sum(plan.balance) == 4
    (w,) = caught
    text = str(w.message)
    assert "layer 1 ('1', Linear:" in text and "layer 3 ('3', Linear:" in text and "each hold more than a stage's " \
        "share (25.0% for 4 stages) of the model's measured memory" in text
    assert "flatten_sequential(model, sample)" in text and "finer layers" in text
    assert w.filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", HeavyLayerWarning)
        partition(model, 3, method="params")  # not measured: no warning
        partition(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), 2, method="memory", sample=x)


def test_report_says_not_measured_instead_of_zero():
    """Without a sample (balance falls back to "params") the time and activation columns were never measured:
    the table says so, and why, rather than showing 0.00 ms and 0 B as if they were measured zeros."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 16)

    def rows(p):
        return [line for line in str(p).splitlines() if line.lstrip("│ ").startswith(("0 ", "1 "))]

    for p in (partition(model, 2, method="params"), partition(model, 2, method=[2, 1])):
        assert not p.timed and not p.sized
        text = str(p)
        assert all(line.count("not measured") == 2 for line in rows(p)), text
        assert "0.00" not in text and " 0 B" not in text, text
        assert "fwd+bwd ms and activation out: not measured" in text and "sample=" in text, text
    assert "was given no sample" in str(partition(model, 2, method="params"))
    assert "measures nothing" in str(partition(model, 2, method=[2, 1]))

    sized = partition(model, 2, method="params", sample=x)  # activations measured, times not
    assert sized.sized and not sized.timed
    assert all(line.count("not measured") == 1 for line in rows(sized)), str(sized)
    assert "fwd+bwd ms: not measured, balance 'params' does not time the layers" in str(sized)

    timed = partition(model, 2, method="time", sample=x)
    assert timed.timed and timed.sized and timed.unmeasured_note() == ""
    assert "not measured" not in str(timed)


def test_a_layer_barely_over_its_share_is_noise_and_does_not_warn():
    import warnings

    from pipeddp import HeavyLayerWarning
    from pipeddp.partitioning.report import warn_heavy_layers

    layers = [nn.Linear(4, 4) for _ in range(6)]
    names = [str(i) for i in range(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", HeavyLayerWarning)
        # six equal layers on six stages, one timed 10% high (18.3% against a share of 16.7%): noise
        warn_heavy_layers(names, layers, [1.0, 1.0, 1.0, 1.1, 1.0, 1.0], 6, "time")
        warn_heavy_layers(names, layers, [1.0] * 6, 6, "time")
        warn_heavy_layers(names, layers, [1.0, 1.0, 1.0, 1.2, 1.0, 1.0], 2, "time")
    with pytest.warns(HeavyLayerWarning, match=r"layer 3 \('3', Linear: 28\.6%\) holds more than a stage's share "
                                               r"\(16\.7% for 6 stages\)"):
        warn_heavy_layers(names, layers, [1.0, 1.0, 1.0, 2.0, 1.0, 1.0], 6, "time")
