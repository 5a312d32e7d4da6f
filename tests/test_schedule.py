import pytest

from pipeddp.runtime.schedule import (Action, format_schedule, get_schedule, gpipe, one_f_one_b, play, stage_count,
                                      validate)


def test_1f1b_layout():
    assert format_schedule(one_f_one_b(3, 4)).splitlines() == [
        "stage 0: F0 F1 F2 B0 F3 B1 B2 B3",
        "stage 1: F0 F1 B0 F2 B1 F3 B2 B3",
        "stage 2: F0 B0 F1 B1 F2 B2 F3 B3",
    ]
    assert format_schedule(gpipe(2, 2)).splitlines() == ["stage 0: F0 F1 B0 B1", "stage 1: F0 F1 B0 B1"]


@pytest.mark.parametrize("fn", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_valid_and_textbook_bubble(fn, p, m):
    sched = fn(p, m)
    validate(sched, m)
    played = play(sched)
    # unit F and B: the bubble of both schedules is (p-1)/(m+p-1)
    assert played.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert played.makespan == pytest.approx(2 * (m + p - 1))


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_activation_memory(p, m):
    for s in range(p):
        assert play(gpipe(p, m)).peak_in_flight(s) == m
        assert play(one_f_one_b(p, m)).peak_in_flight(s) == min(p - s, m)


def test_validate_catches_mistakes():
    F, B = (lambda i: Action("F", i)), (lambda i: Action("B", i))
    with pytest.raises(ValueError, match="before F0"):
        validate([[B(0), F(0)]], 1)
    with pytest.raises(ValueError, match="never runs"):
        validate([[F(0), F(1), B(0)]], 2)
    with pytest.raises(ValueError, match="twice"):
        validate([[F(0), F(0), B(0)]], 1)
    # stage 0 waits for B0 before sending F1; stage 1 waits for F1 before B0: deadlock
    with pytest.raises(ValueError, match="deadlock"):
        validate([[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]], 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        get_schedule("zigzag", 2, 2)


# -- interleaved 1F1B and zero-bubble -------------------------------------------------------------------------

from pipeddp.runtime.schedule import (Kind, interleaved, interleaved_limit, list_schedule, normalize,  # noqa: E402
                                      zero_bubble)

COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def unit(v: int = 1):
    """F = 1, B = 2 (I = W = 1) for a stage v times smaller than one stage per device."""
    return lambda row, a: COST[a.kind.value] / v


@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 12])
def test_interleaved_and_zero_bubble_are_valid_for_any_shape(p, v, m):
    for plan in (interleaved(p, m, v), zero_bubble(p, m, v)):
        validate(plan, m)
        assert len(plan) == p
        for r, row in enumerate(plan):
            assert {a.stage for a in row} == {r + k * p for k in range(v)}  # device r holds stages r, r + p, ...


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (3, 6), (3, 9)])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_reaches_its_theoretical_step_time(p, m, v):
    # p divides m: the bubble shrinks v-fold, from (p - 1)(F + B) to (p - 1)(F + B) / v
    assert play(interleaved(p, m, v), unit(v)).makespan == pytest.approx(3 * m + 3 * (p - 1) / v)
    assert play(one_f_one_b(p, m), unit()).makespan == pytest.approx(3 * m + 3 * (p - 1))


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("m", [4, 8, 12])
def test_zero_bubble_reaches_zb_h1(p, m):
    if m < p:
        pytest.skip("ZB-H1's bound assumes at least p micro-batches")
    # ZB-H1 (Qi et al.): the bubble is (p - 1)(F + I - W) instead of 1F1B's (p - 1)(F + B)
    assert play(zero_bubble(p, m), unit()).makespan == pytest.approx(3 * m + (p - 1))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 3, 4, 8])
def test_activation_memory_of_the_new_schedules(p, m):
    zb = play(zero_bubble(p, m))
    # as much as 1F1B's busiest device (the first, p micro-batches), on every device
    assert max(zb.peak_in_flight(r) for r in range(p)) == max(play(one_f_one_b(p, m)).peak_in_flight(r)
                                                             for r in range(p))
    assert all(zb.peak_in_flight(r) <= min(p, m) for r in range(p))
    for v in (2, 3):
        limits = interleaved_limit(p, m, v)
        assert limits == [min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) for r in range(p)]
        played = play(interleaved(p, m, v))
        peaks = [played.peak_in_flight(r) for r in range(p)]
        assert all(peak <= limit for peak, limit in zip(peaks, limits))
        if m % p == 0:  # full rounds of p micro-batches: Megatron-LM's warm-up, exactly
            assert peaks == limits


def test_zero_bubble_defers_weight_gradients_into_the_cool_down():
    plan = zero_bubble(2, 4)
    assert format_schedule(plan).splitlines() == [
        "stage 0: F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3",
        "stage 1: F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3",
    ]
    for row in plan:  # every W after its I, every I after its F
        for k, a in enumerate(row):
            if a.kind is Kind.W:
                assert Action("I", a.mb, a.stage) in row[:k]


def test_interleaved_prints_the_stage_of_each_action():
    assert format_schedule(interleaved(2, 2, 2)).splitlines() == [
        "device 0: F0@s0 F1@s0 F0@s2 F1@s2 B0@s2 B1@s2 B0@s0 B1@s0",
        "device 1: F0@s1 F1@s1 F0@s3 B0@s3 F1@s3 B1@s3 B0@s1 B1@s1",
    ]
    assert interleaved(3, 4, 1) == one_f_one_b(3, 4)


def test_schedules_written_with_strings_still_run():
    # a 0.2 user schedule: Action("F", i) with the row as its stage
    plan = [[Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]] * 2
    assert normalize(plan) == gpipe(2, 2)
    assert get_schedule(lambda stages, chunks: plan, 2, 2) == gpipe(2, 2)
    assert Action("F", 3) == Action(Kind.F, 3)


def test_user_schedules_may_use_the_new_kinds_and_virtual_stages():
    def split_gpipe(stages, chunks):  # GPipe with every backward split, W at the very end
        return [[Action("F", i) for i in range(chunks)] + [Action("I", i) for i in range(chunks)]
                + [Action("W", i) for i in range(chunks)] for _ in range(stages)]

    plan = get_schedule(split_gpipe, 2, 3)
    assert [a.kind for a in plan[0]] == [Kind.F] * 3 + [Kind.I] * 3 + [Kind.W] * 3

    def looped(stages, chunks, virtual_stages):  # every forward of each stage in turn, then the backwards
        out = []
        for r in range(stages):
            mine = [r + k * stages for k in range(virtual_stages)]
            out.append([Action("F", i, s) for s in mine for i in range(chunks)]
                       + [Action("B", i, s) for s in reversed(mine) for i in range(chunks)])
        return out

    assert stage_count(get_schedule(looped, 2, 3, virtual_stages=2)) == 4


def test_validate_catches_mistakes_of_the_new_kinds():
    F, I, W, B = (lambda i, s=0: Action("F", i, s)), (lambda i, s=0: Action("I", i, s)), \
        (lambda i, s=0: Action("W", i, s)), (lambda i, s=0: Action("B", i, s))
    with pytest.raises(ValueError, match="before I0"):
        validate([[F(0), W(0), I(0)]], 1)
    with pytest.raises(ValueError, match="never runs W0"):
        validate([[F(0), I(0)]], 1)
    with pytest.raises(ValueError, match="both a B and an I"):
        validate([[F(0), I(0), B(0), W(0)]], 1)
    with pytest.raises(ValueError, match="lives on device 1"):  # stage 1 belongs to device 1 of 2
        validate([[F(0, 0), F(0, 1), B(0, 1), B(0, 0)], []], 1, stages=2)
    with pytest.raises(ValueError, match="kinds are"):
        validate([[Action("X", 0)]], 1)
    with pytest.raises(ValueError, match="names no stage"):
        normalize([[Action("F", 0)], [Action("F", 0)]], stages=4)
    with pytest.raises(ValueError, match="virtual_stages=2 needs a schedule"):
        pipeddp_check_virtual(2, "1f1b")
    with pytest.raises(ValueError, match="one stage per device"):
        get_schedule("gpipe", 2, 2, virtual_stages=2)


def pipeddp_check_virtual(v, schedule):
    from pipeddp._settings import check_virtual_stages

    return check_virtual_stages(v, schedule)


def test_list_schedule_says_when_a_memory_limit_is_too_small_to_finish():
    # one micro-batch per device cannot feed a device's second stage before its first is released
    with pytest.raises(ValueError, match="raise the limit"):
        list_schedule(2, 4, 2, limit=[1, 1])


def test_virtual_stages_default_to_two_for_the_interleaved_schedule():
    from pipeddp._settings import check_virtual_stages

    assert check_virtual_stages(None, "interleaved") == 2
    assert check_virtual_stages(None, "1F1B") == 1
    assert check_virtual_stages(3, "zb") == 3
