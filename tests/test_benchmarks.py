"""The harness every benchmark's figures rest on (benchmarks/common.py, baselines.py), and three scripts in miniature."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import baselines
from benchmarks.common import grad_rel_diff, grad_snapshot, interleaved, median_ratio, write_json

ROOT = Path(__file__).resolve().parent.parent


def test_interleaved_rotates_the_order_and_drops_warmup_rounds():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = interleaved(fns, rounds=3, warmup=1)
    # round r starts at configuration r mod 3: no configuration always follows the same neighbour
    assert calls == list("abc" "bca" "cab" "abc")
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    with pytest.raises(ValueError, match="rounds"):
        interleaved(fns, rounds=0)


def test_median_ratio_pairs_rounds_so_that_drift_cancels():
    # the host slows down 3x over the run; b is always exactly twice as fast as a in the same round
    a = [1.0, 2.0, 3.0, 10.0, 30.0]
    b = [0.5, 1.0, 1.5, 5.0, 15.0]
    assert median_ratio(a, b) == 2.0
    # one round hit by a hiccup does not move the median
    assert median_ratio(a, b[:2] + [30.0] + b[3:]) == 2.0
    with pytest.raises(ValueError, match="same rounds"):
        median_ratio(a, b[:-1])


def test_grad_rel_diff_is_zero_for_equal_grads_and_scales_with_the_difference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    model(torch.randn(5, 4)).sum().backward()
    ref = grad_snapshot(model)
    assert grad_rel_diff(ref, model) == 0.0
    scale = max(g.abs().max().item() for g in ref.values())
    with torch.no_grad():
        model[0].weight.grad[0, 0] += 0.5 * scale
    assert grad_rel_diff(ref, model) == pytest.approx(0.5)
    model[2].bias.grad = None
    assert grad_rel_diff(ref, model) == float("inf")


def test_write_json_records_the_machine_and_the_code(tmp_path):
    out = write_json(tmp_path / "sub" / "r.json", {"value": torch.tensor([1.5])})
    doc = json.loads(out.read_text())
    assert doc["value"] == [1.5]
    assert doc["machine"]["torch"] == torch.__version__
    assert doc["pipeddp_commit"]  # a commit id, or "unknown" outside a git checkout


def test_baselines_compute_the_gradients_of_the_plain_model():
    # the MLP has no BatchNorm: accumulation over uneven micro-batches and a pipeline both give the whole batch's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    loss = nn.functional.mse_loss
    steps = [baselines.whole(model, x, y, loss), baselines.accumulate(model, x, y, loss, 4),
             baselines.pipeline(model, x, y, loss, chunks=3, balance=[2, 3])]
    try:
        checked = baselines.check_grads(steps, "whole", "whole")
    finally:
        for step in steps:
            step.close()
    assert steps[1].info["microbatch_sizes"] == [3, 3, 2, 2]
    assert set(checked) == {"whole", "accum", "pipeline"}
    assert all(c["grad_rel_diff_vs_whole"] < 1e-6 for c in checked.values()), checked


def test_benchmarks_use_public_pipeddp_names_only_and_never_torch_chunk():
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeddp"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
            if isinstance(node, ast.Attribute) and node.attr == "chunk":
                pytest.fail(f"{path.name}:{node.lineno} uses .chunk (pipeddp.runtime.microbatch.split never drops "
                            "a micro-batch)")


def _run_script(name, *args, tmp_path):
    """Run ``benchmarks/<name>.py`` as a user would, with its JSON in ``tmp_path``; return the JSON."""
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_iteration_table_cuts_never_rank_pipeddp_below_another_cut_on_its_own_profile(tmp_path):
    doc = _run_script("iteration_table", "--cuts", "--models", "mlp", "--stages", "2", "3", "--rounds", "1",
                      tmp_path=tmp_path)
    rows = doc["models"]["mlp"]["rows"]
    for stages in (2, 3):
        by = {r["method"]: r for r in rows if r["stages"] == stages}
        assert set(by) == {"pipeddp", "uniform", "params", "block-move"}
        # the cut is the optimal min-max of the profile it was made from, found here by trying every cut
        costs = doc["models"]["mlp"]["profile_layer_ms"][str(stages)]
        assert len(costs) == doc["models"]["mlp"]["layers"]
        best = min(bottleneck(costs, cut) for cut in every_cut(len(costs), stages))
        assert bottleneck(costs, by["pipeddp"]["balance"]) <= best * (1 + 1e-9), stages
        for r in by.values():
            assert sum(r["balance"]) == doc["models"]["mlp"]["layers"]
            assert r["measured_bottleneck_ms"] > 0


def every_cut(layers, stages):
    """Every balance of ``layers`` into ``stages`` contiguous non-empty stages."""
    if stages == 1:
        yield [layers]
        return
    for first in range(1, layers - stages + 2):
        for rest in every_cut(layers - first, stages - 1):
            yield [first] + rest


def bottleneck(costs, balance):
    bounds = [sum(balance[:i]) for i in range(len(balance) + 1)]
    return max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))


@pytest.mark.timeout(300)
def test_pipeline_cpu_splits_time_pipelines_that_compute_the_plain_gradients(tmp_path):
    doc = _run_script("pipeline_cpu", "--splits", "16", "24", "--models", "mlp", "--batch", "64", "--rounds", "1",
                      tmp_path=tmp_path)
    assert [r["split_size"] for r in doc["by_split"]] == [16, 24]
    assert doc["by_split"][1]["microbatch_sizes"] == [24, 24, 16]
    for name in ("naive-mp", "split=16", "split=24"):
        assert doc["check"][name]["grad_rel_diff_vs_plain"] < 1e-5, name
    assert doc["best"]["split_size"] in (16, 24)


@pytest.mark.timeout(300)
def test_checkpoint_scale_script_measures_every_save_on_every_rank(tmp_path):
    doc = _run_script("checkpoint_scale", "--quick", tmp_path=tmp_path)
    assert set(doc["configs"]) == {"consolidated", "sharded", "sharded-async"}
    for name, c in doc["configs"].items():
        assert [r["rank"] for r in c["ranks"]] == [0, 1, 2, 3], name
        assert all(d >= b > 0 for b, d in zip(c["blocked_s"], c["durable_s"])), name
        assert all(r["rss_peak_mb"] >= r["rss_before_mb"] > 0 and r["shard_mb"] > 0 for r in c["ranks"]), name
    sizes = [doc["configs"][n]["disk_mb"] for n in ("consolidated", "sharded")]
    assert 0.5 < sizes[0] / sizes[1] < 2  # the same state in both formats
    assert set(doc["targets"]) >= {"sharded_peak_met", "blocked_met", "async_blocked_over_consolidated"}
    assert not (tmp_path / "checkpoint_scale.tmp").exists()  # the checkpoints were removed
