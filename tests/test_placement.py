"""The V placement (``placement="v"``): stages down the devices and back up, the first and last on one device.

Every training case compares each step's gradients and the final weights with single-device training on the
same global batch (float64); the multi-process jobs run under NCCL's rules (tags stripped, see conftest).
"""

import copy

import pytest
import torch

import pipeddp
from conftest import data, make_mlp, max_diff
from hybrid_jobs import LOSS, global_batches
from pipeddp.runtime.schedule import (crossings, get_schedule, interleaved, list_schedule, peak_held, play, row_of,
                                      stages_on, validate)
from pipeddp.runtime.schedule.costed import AutoSchedule, Costs
from test_schedules_train import reference, train_against

SCHEDULES = ["interleaved", "zb", "auto"]


def test_v_goes_down_the_devices_and_back_up():
    assert [row_of(s, 2, "v") for s in range(4)] == [0, 1, 1, 0]
    assert [row_of(s, 3, "v") for s in range(9)] == [0, 1, 2, 2, 1, 0, 0, 1, 2]
    assert [row_of(s, 3, "loop") for s in range(6)] == [0, 1, 2, 0, 1, 2]
    assert stages_on(0, 2, 4, "v") == [0, 3] and stages_on(1, 2, 4, "v") == [1, 2]
    assert stages_on(1, 3, 6, "loop") == [1, 4]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_every_schedule_places_its_stages_in_the_v_and_finishes(p, v, m):
    for name in SCHEDULES:
        plan = get_schedule(name, p, m, v, placement="v")  # validated there: placed, complete, deadlock-free
        for r, row in enumerate(plan):
            assert {a.at for a in row} == set(stages_on(r, p, p * v, "v")), (name, r)
        play(plan)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (3, 6), (4, 8)])
def test_zero_bubble_in_the_v_is_as_short_as_round_robin_on_paper(p, m):
    # a device's second stage in the V waits for the way down and back: a forward order kept strictly (as round
    # robin keeps it) would idle there; with unit costs the V's order is then as short as the loop's
    v_plan, loop = get_schedule("zb", p, m, 2, placement="v"), get_schedule("zb", p, m, 2)
    assert play(v_plan).makespan <= play(loop).makespan
    assert max(peak_held(row) for row in v_plan) <= max(peak_held(row) for row in loop)


def test_the_turns_of_the_v_cross_no_link():
    # p = 2, v = 2: stages 1 -> 2 sit on device 1; only 0 <-> 1 and 2 <-> 3 cross between the devices
    plan = get_schedule("interleaved", 2, 4, 2, placement="v")
    msgs = crossings(plan)[(0, 1)]
    assert {(m.kind, m.stage) for m in msgs} == {("F", 1), ("F", 3), ("B", 0), ("B", 2)}
    assert len(msgs) == 4 * 4


def test_a_schedule_placed_round_robin_is_refused_under_the_v():
    loop = interleaved(2, 4, 2)
    with pytest.raises(ValueError, match="placement 'v': device 0 holds stages \\[0, 3\\]"):
        validate(loop, 4, placement="v")
    with pytest.raises(ValueError, match="placement must be one of"):
        list_schedule(2, 4, 2, placement="w")


def test_auto_builds_for_the_placement_it_is_given():
    auto = AutoSchedule(Costs.unit(4), placement="v")
    plan = auto(2, 4, 2)
    validate(plan, 4, placement="v")
    assert {a.at for a in plan[0]} == {0, 3}


def test_the_settings_say_what_the_v_needs():
    with pytest.raises(ValueError, match="placement must be one of"):
        pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, schedule="interleaved", placement="zigzag")
    with pytest.raises(ValueError, match="needs at least two stages per device"):
        pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, schedule="1f1b", placement="v")

    def round_robin(stages, chunks, virtual):
        return interleaved(stages, chunks, virtual)

    with pytest.raises(ValueError, match="lives on device"):
        pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, schedule=round_robin, virtual_stages=2, placement="v")


def held_rows(pipe):
    """Which device (thread) of ``pipe`` holds each stage."""
    return {st.index: row for row, d in enumerate(pipe._runner.devices) for st in d.stages.values()}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_pipeline_in_the_v_trains_the_plain_model(schedule, devices, checkpoint):
    ref_grads, ref_params = reference(1)
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * devices, chunks=4, schedule=schedule, virtual_stages=2,
                          checkpoint=checkpoint, balance="uniform", placement="v") as pipe:
        held = held_rows(pipe)
        assert held == {s: row_of(s, devices, "v") for s in range(2 * devices)}
        assert held[0] == held[2 * devices - 1] == 0
        state = train_against(pipe, ref_grads)
    assert max_diff([state[n] for n in ref_params], ref_params.values()) < 1e-12


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_pipeline_in_the_v_runs_a_call_then_backward_and_evaluates(schedule):
    model = make_mlp()
    x, y = data(10)
    plain = copy.deepcopy(model)
    LOSS(plain(x), y).backward()
    with pipeddp.Pipeline(model, ["cpu"] * 2, chunks=3, schedule=schedule, virtual_stages=2, placement="v") as pipe:
        LOSS(pipe(x), y).backward()
        assert max_diff([p.grad for p in pipe.parameters()], [p.grad for p in plain.parameters()]) < 1e-12
        with torch.no_grad():
            assert max_diff([pipe(x)], [plain(x)]) < 1e-12


def test_a_checkpoint_of_the_v_loads_into_the_loop_and_back(tmp_path):
    x, y = data(10)
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, chunks=2, schedule="interleaved", placement="v") as pipe:
        pipe.train_step(x, y, LOSS)
        torch.optim.SGD(pipe.parameters(), lr=0.1).step()
        pipe.save(tmp_path / "v.pt")
        saved = pipe.state_dict()
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, chunks=2, schedule="interleaved") as loop:
        loop.load(tmp_path / "v.pt")
        assert max_diff([loop.state_dict()[k] for k in saved], saved.values()) == 0
        loop.save(tmp_path / "loop.pt")
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * 3, chunks=2, schedule="zb", virtual_stages=2,
                          placement="v") as other:
        other.load(tmp_path / "loop.pt")
        assert max_diff([other.state_dict()[k] for k in saved], saved.values()) == 0


# -- tied weights: the first and last stage share a device in the V ----------------------------------------------

from tied_jobs import global_batches as tied_batches  # noqa: E402
from tied_jobs import reference_state, shared_model  # noqa: E402


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_weight_used_on_three_stages_of_two_devices_in_the_v(schedule):
    expect = reference_state(shared_model(), tied_batches())
    with pipeddp.Pipeline(shared_model(), ["cpu"] * 2, chunks=3, schedule=schedule, virtual_stages=2,
                          balance=[1, 2, 1, 2], placement="v") as pipe:  # uses on stages 0, 2, 3: devices 0, 1, 0
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        for x, y in tied_batches():
            opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            opt.step()
        state = pipe.state_dict()
    assert sorted(state) == sorted(expect) and max_diff([state[k] for k in expect], expect.values()) < 1e-12


def tied_ends_job(placement: str):
    """An embedding and the head tied to it, on the first and last of 4 stages over 2 processes, 3 steps."""
    from test_meta import LOSS as META_LOSS
    from test_meta import batches, build

    engine = pipeddp.HybridParallel(build(tied=True), stages=2, mode="stage", chunks=3, seed=7,
                                    schedule="interleaved", virtual_stages=2, balance=[1, 2, 1, 2],
                                    placement=placement)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    for x, y in batches(tied=True):
        opt.zero_grad()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, META_LOSS)
        opt.step()
    with torch.no_grad():
        output = engine(x if engine.is_first else None)  # the trained model's output, where the last stage runs
    out = {"state": engine.state_dict(), "shared": len(engine._replica.ties.items),
           "ends": (engine.is_first, engine.is_last), "output": output}
    engine.close()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("placement", ["loop", "v"])
def test_a_tie_between_the_first_and_last_stage_stays_in_one_process_in_the_v(placement):
    from test_meta import batches, build, plain

    steps = batches(tied=True)
    expect = plain(7, steps, tied=True)
    trained = pipeddp.materialize(build(tied=True), seed=0)
    trained.load_state_dict(expect)
    results = pipeddp.spawn(tied_ends_job, 2, args=(placement,), timeout=150)
    for res in results:
        assert max_diff([res["state"][k] for k in expect], expect.values()) < 1e-12
        assert (res["output"] is None) != res["ends"][1]  # the output comes back where the last stage runs
        if res["output"] is not None:
            assert max_diff([res["output"]], [trained(steps[-1][0])]) < 1e-12
    if placement == "v":  # process 0 feeds the inputs and reads the targets; nothing tied crosses processes
        assert [res["ends"] for res in results] == [(True, True), (False, False)]
        assert [res["shared"] for res in results] == [0, 0]
    else:
        assert [res["ends"] for res in results] == [(True, False), (False, True)]
        assert [res["shared"] for res in results] == [1, 1]


# -- placement="auto": from the profile, when the engine is built ---------------------------------------------------

from pipeddp.runtime.schedule.placing import choose_placement  # noqa: E402


def stage_costs(*forward: float) -> Costs:
    """Per stage: F as given, I and W each as long (none for the first stage's I)."""
    return Costs(forward, tuple(0.0 if s == 0 else f for s, f in enumerate(forward)), forward, 0.0)


#: a light first stage and a heavy last one (a language model's head): the V pairs them, (0, 3) and (1, 2) sum to
#: 4 and 4, where round robin's (0, 2) and (1, 3) sum to 3 and 5
HEAD_HEAVY = stage_costs(1.0, 2.0, 2.0, 3.0)
#: both ends heavy: the V would put both on device 0, round robin splits them
ENDS_HEAVY = stage_costs(3.0, 1.0, 1.0, 3.0)


@pytest.mark.parametrize("schedule", ["auto", "zb", "interleaved"])
def test_auto_placement_takes_the_placement_whose_step_is_shorter_on_the_profile(schedule):
    assert choose_placement(schedule, 2, 4, 2, HEAD_HEAVY) == "v"
    assert choose_placement(schedule, 2, 4, 2, ENDS_HEAVY) == "loop"
    assert choose_placement(schedule, 2, 4, 2, Costs.unit(4)) == "loop"  # a tie: round robin, the default
    assert choose_placement(schedule, 2, 4, 1, stage_costs(1.0, 3.0)) == "loop"  # one stage per device
    if schedule != "auto":  # the V's fixed order is the shorter one on those costs, which is why it was chosen
        spans = {pl: play(get_schedule(schedule, 2, 4, 2, placement=pl),
                          lambda row, a: HEAD_HEAVY.of(a.kind, a.stage)).makespan for pl in ("loop", "v")}
        assert spans["v"] < spans["loop"]


def test_auto_placement_is_refused_for_a_schedule_function():
    with pytest.raises(ValueError, match="places its stages itself"):
        pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, schedule=lambda p, m, v: interleaved(p, m, v), virtual_stages=2,
                         placement="auto")


def test_a_pipeline_with_auto_placement_runs_what_the_profile_chose_and_trains_the_plain_model():
    ref_grads, ref_params = reference(1)
    x, _ = global_batches(1, 1)[0]
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * 2, chunks=4, schedule="auto", virtual_stages=2, balance="time",
                          sample=x, placement="auto") as pipe:
        expect = choose_placement("auto", 2, 4, 2, Costs.from_layers(pipe.partition.layers, pipe.balance))
        assert pipe.placement == expect
        assert held_rows(pipe) == {s: row_of(s, 2, expect) for s in range(4)}
        state = train_against(pipe, ref_grads)
    assert max_diff([state[n] for n in ref_params], ref_params.values()) < 1e-12


def auto_placement_job():
    """Stage mode, 2 processes, ``placement="auto"`` on a measured cut: rank 0's choice, run by both."""
    x, _ = global_batches(1, 1)[0]
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=4, schedule="auto", virtual_stages=2,
                                    balance="time", sample=x, placement="auto")
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    for x, y in global_batches(1, 3):
        opt.zero_grad()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        opt.step()
    out = {"state": engine.state_dict(), "placement": engine.placement,
           "stages": [st.index for st in engine.stages], "row": engine.topology.stage}
    engine.close()
    return out


@pytest.mark.timeout(180)
def test_auto_placement_is_one_choice_for_every_rank_and_trains_the_plain_model():
    _, ref_params = reference(1)
    results = pipeddp.spawn(auto_placement_job, 2, timeout=150)
    assert results[0]["placement"] == results[1]["placement"] in ("loop", "v")
    for res in results:
        assert res["stages"] == stages_on(res["row"], 2, 4, res["placement"])
        assert max_diff([res["state"][n] for n in ref_params], ref_params.values()) < 1e-12
