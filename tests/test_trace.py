"""The recorded timeline of real runs: complete, ordered as the schedule allows, exportable."""

import json

import pytest
from torch import nn

import pipeddp
from conftest import data, make_mlp
import pipeddp.tools.simulate
from pipeddp.runtime.schedule import get_schedule
from pipeddp.tools.timeline import draw, have_matplotlib, measured_bubble


def traced_step(schedule, stages=3, chunks=5):
    with pipeddp.Pipeline(make_mlp(), ["cpu"] * stages, chunks=chunks, schedule=schedule, trace=True) as pipe:
        pipe.train_step(*data(10), nn.functional.mse_loss)  # warm-up step, then a clean trace
        pipe.trace.clear()
        pipe.train_step(*data(10), nn.functional.mse_loss)
        return pipe.trace


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_every_action_once_in_an_allowed_order(schedule):
    trace = traced_step(schedule)
    spans = [s for s in trace.spans if s.kind in ("F", "B")]
    keys = sorted((s.stage, s.kind, s.mb) for s in spans)
    assert keys == sorted((s, k, i) for s in range(3) for k in "FB" for i in range(5))
    at = {(s.stage, s.kind, s.mb): s for s in spans}
    plan = get_schedule(schedule, 3, 5)
    for stage in range(3):
        ran = [(s.kind, s.mb) for s in sorted((x for x in spans if x.stage == stage), key=lambda x: x.start)]
        assert ran == [(a.kind, a.mb) for a in plan[stage]]
    for i in range(5):
        for s in range(1, 3):
            assert at[(s, "F", i)].start >= at[(s - 1, "F", i)].end
        for s in range(2):
            assert at[(s, "B", i)].start >= at[(s + 1, "B", i)].end


def test_chrome_trace_and_picture(tmp_path):
    trace = traced_step("1f1b")
    path = tmp_path / "t.json"
    trace.save(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["name"] for e in events} >= {f"F{i}" for i in range(5)} | {f"B{i}" for i in range(5)}
    assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)
    bubble, span = measured_bubble(trace.spans)
    assert 0.0 <= bubble < 1.0 and span > 0
    if have_matplotlib():
        png = draw(trace.spans, str(tmp_path / "t.png"), bound=2 / 7)
        assert png == str(tmp_path / "t.png") and (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("schedule,placement", [("1f1b", "loop"), ("interleaved", "loop"), ("zb", "loop"),
                                                ("interleaved", "v")])
def test_timeline_command(tmp_path, capsys, schedule, placement):
    from pipeddp.tools.cli import main

    out = tmp_path / "tl"
    assert main(["timeline", "--stages", "2", "--chunks", "4", "--batch", "16", "--steps", "2", "--out", str(out),
                 "--schedule", schedule, "--placement", placement]) == 0
    events = json.loads((tmp_path / "tl.json").read_text())["traceEvents"]
    kinds = {e["cat"] for e in events}
    assert kinds >= ({"F", "I", "W"} if schedule == "zb" else {"F", "B"})
    text = capsys.readouterr().out
    assert ("in the V" in text) == (placement == "v")
    measured, predicted = text.split("per device: measured ")[1].split(", predicted ")
    assert measured.strip() == predicted.split("\n")[0].strip()  # peak activations held: as the schedule says
    if have_matplotlib():
        assert (tmp_path / "tl.png").exists()


def test_plan_command_respects_memory(capsys):
    from pipeddp.tools.cli import main

    assert main(["plan", "--model", "mlp", "--devices", "4", "--batch", "64", "--memory", "300MB",
                 "--profile-batch", "4", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "replicas x stages" in out and "1:" in out and "first choice:" in out and "torchrun" in out
    assert main(["plan", "--model", "mlp", "--devices", "4", "--memory", "1MB", "--profile-batch", "4"]) == 1


def test_trace_assigned_later_reaches_the_stage_threads():
    from pipeddp.runtime.trace import Trace

    with pipeddp.HybridParallel(make_mlp(), stages=2, chunks=3) as engine:
        assert engine.trace is None
        engine.trace = Trace()
        engine.train_step(*data(6), nn.functional.mse_loss)
        assert sorted((s.stage, s.kind, s.mb) for s in engine.trace.spans if s.kind in "FB") == sorted(
            (s, k, i) for s in range(2) for k in "FB" for i in range(3))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_measured_activation_memory_is_what_the_planner_predicts(schedule):
    """The trace's peak micro-batches held per stage equals the simulator's (GPipe m, 1F1B p - s)."""
    trace = traced_step(schedule)  # 3 stages, 5 micro-batches
    predicted = pipeddp.simulate([pipeddp.tools.simulate.StageCost(1.0, 2.0)] * 3, schedule, chunks=5)
    assert [trace.peak_in_flight[s] for s in range(3)] == predicted.peak_activations
    assert predicted.peak_activations == ([5, 5, 5] if schedule == "gpipe" else [3, 2, 1])
    assert trace.peak_memory == {}  # CPU stages: no CUDA allocation to report
