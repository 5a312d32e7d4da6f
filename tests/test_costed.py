"""``schedule="auto"``: an order built from measured costs, checked against the fixed schedules and the plain model."""

import itertools

import pytest
import torch

import pipeddp
from conftest import data, make_mlp, max_diff, reference_training
from hybrid_jobs import LOSS, global_batches
from pipeddp.runtime.schedule.costed import AutoSchedule, Costs, build, default_activations
from pipeddp.runtime.schedule import Kind, get_schedule, peak_held, play, validate
from pipeddp.tools.simulate import StageCost, simulate


def replay(plan, costs):
    return play(plan, lambda row, a: costs.of(a.kind, a.stage))


@pytest.mark.parametrize("p,m,v", [(1, 3, 1), (2, 1, 1), (2, 4, 1), (3, 5, 1), (4, 8, 1), (2, 4, 2), (3, 6, 2),
                                   (2, 3, 3)])
def test_auto_is_a_valid_schedule_no_slower_than_the_fixed_ones_within_its_cap(p, m, v):
    costs = Costs(tuple(0.5 + 0.3 * s for s in range(p * v)), tuple([0.0] + [0.7] * (p * v - 1)),
                  tuple(1.9 - 0.2 * s for s in range(p * v)), 0.05)
    fixed = ["1f1b", "zb"] if v == 1 else ["interleaved", "zb"]
    for cap in (None, v, 2 * p * v):
        plan = build(p, m, v, costs, cap)
        validate(plan, m)
        limit = cap if cap is not None else default_activations(p, m, v)
        assert max(peak_held(row) for row in plan) <= limit
        if cap is None:
            transfer = play(plan, lambda row, a: costs.of(a.kind, a.stage), lambda s, d, a: costs.transfer)
            for name in fixed:
                other = play(get_schedule(name, p, m, v), lambda row, a: costs.of(a.kind, a.stage),
                             lambda s, d, a: costs.transfer)
                assert transfer.makespan <= other.makespan + 1e-9, name


def test_auto_beats_zero_bubble_where_the_stages_differ():
    # the first stage has no input gradient (its W is its whole backward); the others have a W four times their I
    costs = Costs((1.0, 1.0, 1.0), (0.0, 0.4, 0.4), (2.0, 1.6, 1.6))
    auto, zb = replay(build(3, 8, 1, costs), costs), replay(get_schedule("zb", 3, 8), costs)
    assert auto.makespan < zb.makespan / 1.04 and auto.bubble < zb.bubble
    # twice 1F1B's activations lets the order hide more of the bubble
    costs = Costs((1.0, 1.0, 1.0), (0.0, 0.3, 1.5), (2.0, 1.7, 0.5))
    assert replay(build(3, 8, 1, costs, 6), costs).makespan < replay(build(3, 8, 1, costs), costs).makespan


def test_costs_from_a_profile_and_from_measured_actions():
    class Layer:
        def __init__(self, f, b):
            self.forward, self.backward = f, b

    got = Costs.from_layers([Layer(1.0, 2.0), Layer(0.5, 1.0), Layer(2.0, 4.0)], [2, 1])
    assert got.forward == (1.5, 2.0) and got.input == (0.0, 2.0) and got.weight == (3.0, 2.0)
    assert Costs.from_layers([Layer(0.0, 0.0)] * 4, [2, 2]) == Costs.unit(2)  # nothing timed: equal stages
    refined = got.measured({(0, "F"): [1.0, 3.0, 2.0], (1, "I"): [0.5], (1, "W"): [1.5], (0, "B"): [6.0]}, [0.1])
    assert refined.forward == (2.0, 2.0) and refined.input == (0.0, 0.5) and refined.weight == (6.0, 1.5)
    assert refined.transfer == 0.1


def test_simulate_and_the_schedule_name_know_auto():
    stage_costs = [StageCost(1.0, 2.0, backward_input=0.0), StageCost(1.0, 2.0, backward_input=0.4),
                   StageCost(1.0, 2.0, backward_input=0.4)]
    auto, zb = simulate(stage_costs, "auto", chunks=8), simulate(stage_costs, "zb", chunks=8)
    assert auto.step_time < zb.step_time and max(auto.peak_activations) <= 3
    plan = get_schedule("auto", 2, 4, 2)  # unit costs without an engine; several stages per device allowed
    validate(plan, 4)
    assert {a.kind for row in plan for a in row} <= {Kind.F, Kind.B, Kind.I, Kind.W}


@pytest.mark.parametrize("cap,v", [(0, 1), (1, 2), (2.5, 1), (True, 1)])
def test_a_cap_below_what_any_schedule_needs_is_refused_naming_the_minimum(cap, v):
    with pytest.raises(ValueError, match=f"max_activations must be an int >= {v}"):
        pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, chunks=4, schedule="auto", max_activations=cap, virtual_stages=v)
    with pytest.raises(ValueError, match=f"max_activations must be an int >= {v}"):
        build(2, 4, v, max_activations=cap)


def test_a_cap_with_a_fixed_schedule_is_refused():
    with pytest.raises(ValueError, match="max_activations=4 caps what schedule='auto' builds"):
        pipeddp.HybridParallel(make_mlp(), stages=2, schedule="zb", max_activations=4)


@pytest.mark.parametrize("devices,virtual,checkpoint,cap", [(2, 1, "never", None), (3, 1, "except_last", 6),
                                                            (2, 2, "always", None), (2, 1, "always", 1)])
def test_pipeline_with_auto_trains_the_plain_model_and_refines_its_order(devices, virtual, checkpoint, cap):
    model = make_mlp()
    names = [n for n, _ in model.named_parameters()]
    grads, params = reference_training(model, global_batches(1, 4), LOSS)
    x0, _ = data(10)
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * devices, chunks=4, schedule="auto", virtual_stages=virtual,
                          checkpoint=checkpoint, max_activations=cap, balance="time", sample=x0) as pipe:
        refiner = pipe._step.after_backward[-1]
        profiled = pipe._step.schedule.costs
        assert len(profiled.forward) == devices * virtual and sum(profiled.forward) > 0  # from the profile
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for step, (x, y) in enumerate(global_batches(1, 4)):
            opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            got = dict(pipe.named_parameters())
            assert max_diff([got[n].grad for n in names], grads[step]) < 1e-12, step
            opt.step()
            assert (refiner.refined is not None) == (step >= 1)
            assert (pipe.trace is None) == (step != 0)  # the second step is traced on a trace of its own
        assert pipe._step.schedule.costs is refiner.refined
        plan, _ = pipe._step._plan("train", 4)
        assert max(peak_held(row) for row in plan) <= (cap or (devices if virtual == 1 else 5))
        state = pipe.state_dict()
    assert max_diff([state[n] for n in names], params) < 1e-12


def test_auto_schedule_caches_per_shape_and_forgets_on_new_costs():
    auto = AutoSchedule(Costs.unit(2))
    first = auto(2, 4)
    assert auto(2, 4) == first and auto(2, 4) is not first  # a copy: the caller may not edit the cache
    auto.update(Costs((1.0, 1.0), (0.0, 0.4), (2.0, 1.6)))
    assert auto._built == {}
    for p, m in itertools.product((2,), (2, 4, 6)):
        validate(auto(p, m), m)


def test_the_fastest_candidate_is_the_one_whose_quickest_step_took_least_on_its_slowest_process():
    from pipeddp.runtime.refine import fastest, quickest

    # candidate 1 is quicker on the first process, but the second process's steps with it are slower still: a step
    # lasts as long as its slowest process (steps 1.3, 1.2 against 1.0, 1.2)
    parts = [{0: [1.0, 1.2], 1: [0.9, 0.95]}, {0: [1.0, 1.05], 1: [1.3, 1.2]}]
    assert quickest([[1.0, 1.2], [1.0, 1.05]]) == 1.0 and quickest([[0.9, 0.95], [1.3, 1.2]]) == 1.2
    assert fastest(parts) == 0
    assert fastest([{0: [2.0, 2.1], 1: [1.5, 1.6], 2: [1.7, 1.4]}]) == 2
    # the host only ever slows a step down: disturbed steps, even most of them, do not lose a candidate its trial
    assert fastest([{0: [1.0, 1.02], 1: [0.9, 3.0]}]) == 1
    assert fastest([{0: [1.0, 1.01, 1.02, 1.03], 1: [0.9, 1.6, 1.7, 1.8]}]) == 1
    assert fastest([{}]) == 0 and quickest([]) == float("inf")


def test_a_trial_gives_short_steps_more_samples():
    from pipeddp.runtime.refine import MOST_SAMPLES, trial_samples

    assert trial_samples(2.0) == trial_samples(0.13) == 2  # seconds: the noise is small beside them
    assert trial_samples(0.05) == 6 and trial_samples(0.005) == MOST_SAMPLES
    assert trial_samples(0.0) == 2  # nothing measured: the least
    assert all(trial_samples(t) % 2 == 0 for t in (0.3, 0.1, 0.07, 0.04, 0.01))


def test_each_timed_trial_step_follows_a_step_of_its_own_candidate_and_no_more_untimed_ones_run():
    from pipeddp.runtime.refine import trial_steps

    assert trial_steps([0, 1, 1, 0]) == [(0, False), (0, True), (1, False), (1, True), (1, True), (0, False), (0, True)]
    for tried, k in ((2, 2), (3, 6), (2, 24), (5, 24)):
        order = (list(range(tried)) + list(range(tried - 1, -1, -1))) * (k // 2)
        steps = trial_steps(order)
        assert [c for c, timed in steps if timed] == order  # every candidate timed k times, in the order asked
        assert all(i > 0 and steps[i - 1][0] == c for i, (c, timed) in enumerate(steps) if timed)
        assert all(i == 0 or steps[i - 1][0] != c for i, (c, timed) in enumerate(steps) if not timed)
    assert len(trial_steps(([0, 1, 1, 0]) * 12)) == 73  # two candidates at 24 samples: 96 steps without the turns


def test_close_candidates_are_timed_on_real_steps_and_the_steps_stay_exact():
    """Orders within a few percent on paper, and the fixed 1F1B and zero-bubble, each run whole steps (A B C C B A,
    repeated for steps of milliseconds), each timed step after a step of its own order; the fastest measured
    is kept; every step of the trial trains the plain model's gradients, whichever order ran it."""
    model = make_mlp()
    names = [n for n, _ in model.named_parameters()]
    batches = global_batches(1, 256)  # the longest trial: 1 + 2 x 24 steps x 5 candidates
    grads, params = reference_training(model, batches, LOSS)
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, chunks=4, schedule="auto", balance=[6, 5]) as pipe:
        refiner = pipe._step.after_backward[-1]
        auto = pipe._step.schedule
        # the step's measured costs would decide how many orders are close; equal stages make two tie on paper
        refiner._decide = lambda parts, stages: Costs.unit(stages)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        ran = []
        for step, (x, y) in enumerate(batches):
            opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            got = dict(pipe.named_parameters())
            assert max_diff([got[n].grad for n in names], grads[step]) < 1e-12, step
            opt.step()
            ran.append(refiner.running)
        options = auto.close(auto.last)
        # two tie, and the fixed 1F1B and zero-bubble are always timed (zero-bubble may be one of the two)
        assert pipeddp.one_f_one_b(2, 4) in options and pipeddp.zero_bubble(2, 4) in options and len(options) >= 3
        tried, k = len(options), refiner.samples
        assert k >= 2 and k % 2 == 0 and len(batches) > 1 + 2 * k * tried  # steps of milliseconds: up to 24 each
        # step 2 refines the costs, then each candidate is timed k times, in the order A B .. B A, repeated; a timed
        # step follows a step of its own candidate: an untimed one first, except at the turns (B B, A A)
        order = (list(range(tried)) + list(range(tried - 1, -1, -1))) * (k // 2)
        turns = sum(order[i - 1] == order[i] for i in range(1, len(order)))
        assert turns == k - 1
        expect = [c for i, c in enumerate(order) for _ in range(1 if i and order[i - 1] == c else 2)]
        n = len(expect)
        assert n == 2 * k * tried - turns
        assert ran[1:1 + n] == expect
        assert ran[1 + n:] == [None] * (len(batches) - 1 - n)  # then the trial is over
        assert sorted(refiner.times) == list(range(tried)) and all(len(t) == k for t in refiner.times.values())
        assert refiner.chosen == auto.pick and refiner.chosen in refiner.times
        assert [list(row) for row in pipe._step._plan("train", 4)[0]] == [list(row) for row in options[refiner.chosen]]
        state = pipe.state_dict()
    assert max_diff([state[n] for n in names], params) < 1e-12


def test_what_an_action_costs_beside_its_compute_is_measured_per_device():
    from pipeddp.runtime.refine import action_overhead
    from pipeddp.runtime.trace import Span

    spans = [  # device 0: two actions and a send; 1.0 s between them is the engine's own
        Span(0, "F", 0, 0.0, 2.0), Span(0, "send", 0, 2.0, 2.5, "comm"), Span(0, "B", 0, 3.0, 5.0),
        # device 1: waits 4 s for its message, then two actions 0.2 s apart; the agreement after the step is not
        # an action's
        Span(1, "recv", 0, 0.0, 4.0, "comm"), Span(1, "F", 0, 4.0, 5.0), Span(1, "B", 0, 5.2, 6.2),
        Span(1, "agree", -1, 6.2, 9.0, "comm"),
    ]
    assert action_overhead(spans) == pytest.approx([0.5, 0.1])
    assert action_overhead([]) == []


def test_an_engine_that_costs_more_per_action_than_a_split_backward_saves_keeps_whole_backwards():
    """Splitting every backward into I and W is one action more per micro-batch: worth it where the bubble it fills
    outweighs what an action costs the engine, not on a model whose actions take microseconds."""
    split = Costs((1.0, 1.0), (0.0, 1.0), (2.0, 1.0))
    assert any(a.kind is Kind.I for row in build(2, 8, 1, split) for a in row)
    costly = Costs(split.forward, split.input, split.weight, overhead=4.0)
    assert all(a.kind is not Kind.I for row in build(2, 8, 1, costly) for a in row)
    assert Costs.unit(2).measured({}, (), [0.3, 0.1, 0.2]).overhead == 0.2


def test_the_fixed_schedules_are_timed_even_where_paper_ranks_them_far_behind():
    costs = Costs((1.0, 1.0, 1.0), (0.0, 0.4, 0.4), (2.0, 1.6, 1.6))
    auto = AutoSchedule(costs)
    options = auto.close((3, 8, 1))
    assert pipeddp.one_f_one_b(3, 8) in options and pipeddp.zero_bubble(3, 8) in options
    fixed = options.index(pipeddp.one_f_one_b(3, 8))
    assert replay(options[0], costs).makespan * 1.05 < replay(options[fixed], costs).makespan  # far behind on paper
    v2 = AutoSchedule(Costs.unit(4)).close((2, 4, 2))
    assert pipeddp.interleaved(2, 4, 2) in v2 and pipeddp.zero_bubble(2, 4, 2) in v2
    tight = AutoSchedule(Costs.unit(2), max_activations=1).close((2, 4, 1))  # 1F1B needs 2: it does not fit
    assert pipeddp.one_f_one_b(2, 4) not in tight and pipeddp.zero_bubble(2, 4) not in tight
