"""``virtual_stages="auto"``: one or two stages per device, chosen from the profile when the engine is built.

The choice is made on paper (``schedule.placing.choose_layout``), so its unit tests give it stage costs; the
engine tests give it models whose measured costs leave no doubt (a model of microseconds per layer, where the
engine's own cost per action decides, and one whose layers weigh 2, 0, 4 and 2 blocks, which only a V of two
stages per device balances), and compare every step's gradients and the final weights with single-device
training on the same global batch (float64). The two-process job runs under NCCL's rules (tags stripped).
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import pipeddp
from conftest import make_mlp, max_diff, reference_training
from hybrid_jobs import LOSS
from pipeddp.partitioning.solve import solve
from pipeddp.runtime.schedule import stages_on
from pipeddp.runtime.schedule.costed import Costs, build, makespan
from pipeddp.runtime.schedule.placing import choose_layout
from test_placement import held_rows
from test_schedules_train import reference, train_against


def layer_costs(seconds):
    """``costs_of(v)`` for layers of these fwd+bwd seconds (a third forward), cut as the partitioner cuts them."""
    layers = [SimpleNamespace(forward=t / 3, backward=2 * t / 3) for t in seconds]
    return lambda v: Costs.from_layers(layers, solve(seconds, 2 * v))


def paper(costs_of, v, placement="loop", m=2):
    """The step on paper of ``auto``'s best order, without the price per action."""
    return makespan(build(2, m, v, costs_of(v), placement=placement), costs_of(v), 2, placement)


def test_two_stages_per_device_only_where_their_shorter_bubble_pays_for_their_actions():
    # eight equal layers on 2 devices, m = 2: two stages per device shorten the step on paper at any scale
    for seconds, expect in ((1.0, 2), (1e-5, 1)):
        costs_of = layer_costs([seconds] * 8)
        assert paper(costs_of, 2) < paper(costs_of, 1)
        # ... but where an action computes for microseconds, the actions a second stage adds cost more than that
        assert choose_layout(2, 2, 8, costs_of, "loop") == (expect, "loop")


def test_the_v_is_chosen_with_two_stages_where_only_it_balances_the_devices():
    # layers of 2, 1, 4 and 3: one stage per device splits them 3 / 7 or 7 / 3 at best, round robin's
    # (0, 2) and (1, 3) give 6 / 4, the V's (0, 3) and (1, 2) give 5 / 5
    costs_of = layer_costs([2.0, 1.0, 4.0, 3.0])
    assert choose_layout(2, 4, 4, costs_of, "auto") == (2, "v")
    assert choose_layout(2, 4, 4, costs_of, "loop") == (2, "loop")


def test_a_layout_that_cannot_be_cut_or_held_is_not_weighed():
    costs_of = layer_costs([1.0] * 8)
    assert choose_layout(2, 2, 3, layer_costs([1.0] * 3), "auto") == (1, "loop")  # 3 layers: no 4 stages
    assert choose_layout(2, 2, 8, costs_of, "auto", max_activations=1) == (1, "loop")  # two stages hold >= 2
    with pytest.raises(ValueError, match="no number of stages per device"):
        choose_layout(4, 2, 3, layer_costs([1.0] * 3), "auto")


@pytest.mark.parametrize("kwargs,match", [
    ({"schedule": "1f1b"}, "pass schedule='auto'"),
    ({"schedule": "auto", "placement": "v"}, "pass placement='auto'"),
    ({"schedule": "auto", "balance": [1] * 4}, "fixes the number of stages"),
    ({"schedule": "auto", "balance": "params"}, "measured times"),
    ({"schedule": "auto", "no_sample": True}, "measured times"),
])
def test_the_settings_say_what_virtual_stages_auto_needs(kwargs, match):
    x = torch.randn(8, 12, dtype=torch.float64)
    sample = None if kwargs.pop("no_sample", False) else x
    with pytest.raises(ValueError, match=match):
        pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, virtual_stages="auto", sample=sample, **kwargs)


def test_a_word_other_than_auto_is_refused_naming_auto():
    with pytest.raises(ValueError, match="or 'auto' with schedule='auto'"):
        pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, schedule="auto", virtual_stages="two")


def test_a_model_of_microseconds_per_layer_keeps_one_stage_per_device_and_trains_the_plain_model():
    ref_grads, ref_params = reference(1)
    x = torch.randn(10, 12, dtype=torch.float64)
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, chunks=4, schedule="auto", virtual_stages="auto",
                          placement="auto", sample=x) as pipe:
        assert (pipe.virtual_stages, pipe.placement, len(pipe.balance)) == (1, "loop", 2)
        assert pipe.settings.virtual_stages == 1 and not pipe.settings.choose_virtual
        state = train_against(pipe, ref_grads)
    assert max_diff([state[n] for n in ref_params], ref_params.values()) < 1e-12


def blocks(k):
    return nn.Sequential(*[m for _ in range(k) for m in (nn.Linear(256, 256), nn.Tanh())])


def weighed_model():
    """Four layers: 2 blocks of Linear(256, 256) + Tanh, a Tanh, 4 blocks, 2 blocks (float64). One stage per device
    leaves 6 blocks on one device at best, as does round robin with two ((0, 2) and (1, 3)); the V's (0, 3) and
    (1, 2) hold 4 each."""
    torch.manual_seed(0)
    return nn.Sequential(blocks(2), nn.Tanh(), blocks(4), blocks(2)).double()


def weighed_batches(steps=3):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(512, 256, generator=g, dtype=torch.float64),
             torch.randn(512, 256, generator=g, dtype=torch.float64)) for _ in range(steps)]


def train_weighed(engine, batches, first=True, last=True):
    """3 SGD steps; each step's gradients (by name, where this process holds them)."""
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    grads = []
    for x, y in batches:
        opt.zero_grad()
        engine.train_step(x if first else None, y if last else None, LOSS)
        grads.append({n: p.grad.clone() for n, p in engine.named_parameters()})
        opt.step()
    return grads


@pytest.mark.parametrize("placement", ["auto", "loop"])
def test_a_model_only_the_v_balances_gets_two_stages_per_device_and_trains_the_plain_model(placement):
    batches = weighed_batches()
    names = [n for n, _ in weighed_model().named_parameters()]
    ref_grads, ref_params = reference_training(weighed_model(), batches, LOSS)
    with pipeddp.Pipeline(weighed_model(), ["cpu"] * 2, chunks=8, schedule="auto", virtual_stages="auto",
                          placement=placement, sample=batches[0][0]) as pipe:
        layout = pipe.virtual_stages, pipe.placement
        cut = pipe.partition  # the measurements every layout was weighed on, cut for the one chosen
        assert cut.recut(len(cut.balance)) is cut and len(cut.recut(3).balance) == 3
        assert layout == choose_layout(2, 8, 4, lambda v: Costs.from_layers(cut.layers, cut.recut(2 * v).balance),
                                       placement)
        if placement == "auto":  # the V's step is a quarter shorter on paper than any other: no noise hides that
            assert layout == (2, "v") and pipe.balance == [1, 1, 1, 1]
            assert held_rows(pipe) == {0: 0, 1: 1, 2: 1, 3: 0}
        else:
            assert pipe.placement == "loop" and len(pipe.balance) == 2 * pipe.virtual_stages
        grads = train_weighed(pipe, batches)
        state = pipe.state_dict()
    for step, ref in enumerate(ref_grads):
        assert max_diff([grads[step][n] for n in names], ref) < 1e-10, step
    assert max_diff([state[n] for n in names], ref_params) < 1e-10


def weighed_job():
    """Stage mode, 2 processes: ``virtual_stages="auto"`` and ``placement="auto"`` chosen on rank 0, run by both."""
    batches = weighed_batches()
    engine = pipeddp.HybridParallel(weighed_model(), stages=2, mode="stage", chunks=8, schedule="auto",
                                    virtual_stages="auto", placement="auto", sample=batches[0][0])
    grads = train_weighed(engine, batches, engine.is_first, engine.is_last)
    out = {"grads": grads, "state": engine.state_dict(), "layout": (engine.virtual_stages, engine.placement),
           "stages": [st.index for st in engine.stages], "row": engine.topology.stage}
    engine.close()
    return out


@pytest.mark.timeout(180)
def test_virtual_stages_auto_is_one_choice_for_every_rank_and_trains_the_plain_model():
    batches = weighed_batches()
    names = [n for n, _ in weighed_model().named_parameters()]
    ref_grads, ref_params = reference_training(weighed_model(), batches, LOSS)
    results = pipeddp.spawn(weighed_job, 2, timeout=150)
    assert results[0]["layout"] == results[1]["layout"] == (2, "v")
    for res in results:
        assert res["stages"] == stages_on(res["row"], 2, 4, "v")
        for step, ref in enumerate(ref_grads):
            held = {n: g for n, g in zip(names, ref) if n in res["grads"][step]}
            assert held and max_diff([res["grads"][step][n] for n in held], held.values()) < 1e-10, step
        assert max_diff([res["state"][n] for n in names], ref_params) < 1e-10
