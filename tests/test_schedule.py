import pytest

from pipeddp.runtime.schedule import Action, format_schedule, get_schedule, gpipe, one_f_one_b, play, validate


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
