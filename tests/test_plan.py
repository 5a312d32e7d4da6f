import pytest
import torch

from pipeddp.tools.models import mlp
from pipeddp.runtime.schedule import row_of
from pipeddp.tools.plan import LayerModel, fit_layers, parse_bytes, plan


def synthetic_layers(n=8):
    # layer i: 1 ms fixed + 0.1 ms per sample forward, twice that backward, 4 MB of parameters
    return [LayerModel(f"l{i}", 1e-3, 1e-4, 2e-3, 2e-4, 4096, 4_000_000) for i in range(n)]


def test_memory_budget_is_never_exceeded():
    layers = synthetic_layers()
    everything = plan(layers, devices=8, batch=256, link="nvlink", memory=None)
    assert everything
    budget = sorted(max(c.memory) for c in everything)[len(everything) // 2]
    fitting = plan(layers, devices=8, batch=256, link="nvlink", memory=budget)
    assert fitting and len(fitting) < len(everything)
    assert all(max(c.memory) <= budget for c in fitting)
    assert plan(layers, devices=8, batch=256, memory=1.0) == []


def test_ranking_and_shapes():
    layers = synthetic_layers()
    cands = plan(layers, devices=8, batch=256, link="pcie", top=5)
    assert len(cands) == 5
    assert [c.step_time for c in cands] == sorted(c.step_time for c in cands)
    for c in cands:
        assert c.stages * c.replicas == 8
        assert sum(c.balance) == len(layers) and len(c.balance) == c.stages * c.virtual_stages
        assert c.why
    # with slow replica links, fewer replicas (more stages) win over pure data parallelism
    slow = plan(layers, devices=8, batch=256, link="nvlink", allreduce_link="ethernet", top=1)[0]
    fast = plan(layers, devices=8, batch=256, link="nvlink", allreduce_link="nvlink", top=1)[0]
    assert slow.stages >= fast.stages


def test_fit_layers_on_a_real_model():
    torch.manual_seed(0)
    layers = fit_layers(mlp(4, 64, 64, 64), lambda b: torch.randn(b, 64), sizes=(2, 8), repeat=2)
    assert len(layers) == 8
    assert all(l.forward(4) >= 0 and l.backward(4) >= 0 for l in layers)
    assert layers[0].param_bytes == (64 * 64 + 64) * 4
    assert layers[0].activation_bytes_per_sample == 64 * 4


def test_parse_bytes():
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes(None) is None
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_plan_ranks_the_new_schedules_and_says_how_to_run_its_choice():
    from torch import nn

    import pipeddp

    layers = synthetic_layers(12)
    cands = plan(layers, devices=4, batch=64, link="nvlink")
    assert {c.schedule for c in cands if c.stages > 1} == {"1f1b", "gpipe", "interleaved", "zb", "auto"}
    # auto is built from the very costs plan simulates, with the fixed one-stage-per-device orders as candidates
    by = {(c.stages, c.replicas, c.chunks, c.schedule): c.step_time for c in cands}
    for (p, r, m, name), t in by.items():
        if name == "auto":
            assert t <= min(by[(p, r, m, s)] for s in ("1f1b", "zb", "gpipe")) * (1 + 1e-9)
    for c in cands:
        if c.schedule == "interleaved" and c.stages > 1:
            assert c.virtual_stages == 2 and len(c.balance) == 2 * c.stages
            assert c.schedule_text == "interleaved (v=2" + (", the V)" if c.placement == "v" else ")")
    # interleaved is ranked in both placements, each simulated as placed
    pairs = {}
    for c in cands:
        if c.schedule == "interleaved" and c.stages > 1:
            pairs.setdefault((c.stages, c.replicas, c.chunks), {})[c.placement] = c
    assert pairs and all(set(both) == {"loop", "v"} for both in pairs.values())
    dp = [c for c in cands if c.stages == 1 and c.replicas == 4]
    assert len(dp) == len({c.chunks for c in dp})  # one configuration per m: no schedule to choose
    assert dp[0].kind == "data parallel (DDP)" and dp[0].schedule_text == "-" and dp[0].layout == "4 x 1"
    assert "plain data parallelism" in dp[0].why
    # the arguments it prints build the engine it describes (one process: a replica on CPU stages)
    pipe_choice = next(c for c in cands if c.stages == 2 and c.schedule == "interleaved")
    text = pipe_choice.arguments()
    assert text.startswith("pipeddp.HybridParallel(model, stages=2, ") and "virtual_stages=2" in text
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])
    engine = eval(text.replace("HybridParallel(model, ", "HybridParallel(model, devices=['cpu', 'cpu'], "),
                  {"pipeddp": pipeddp, "model": model})
    try:
        assert list(engine.balance) == list(pipe_choice.balance) and engine.virtual_stages == 2
        assert engine.placement == pipe_choice.placement
        assert engine.settings.chunks == pipe_choice.chunks
    finally:
        engine.close()
    in_v = next(c for c in cands if c.stages == 2 and c.schedule == "interleaved" and c.placement == "v")
    text = in_v.arguments()
    assert "virtual_stages=2, placement='v'" in text
    engine = eval(text.replace("HybridParallel(model, ", "HybridParallel(model, devices=['cpu', 'cpu'], "),
                  {"pipeddp": pipeddp, "model": model})
    try:
        assert engine.placement == "v" and list(engine.balance) == list(in_v.balance)
    finally:
        engine.close()
    assert dp[0].command(devices_per_node=4) == "torchrun --nproc_per_node=4 train.py"
    assert dp[0].command(devices_per_node=2).startswith("torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d")


def test_plan_shards_over_replicas_only_where_memory_demands_it():
    from pipeddp.tools.plan import optimizer_slots, shard_memory

    layers = synthetic_layers(8)  # 32 MB of parameters
    free = plan(layers, devices=4, batch=64, link="nvlink")
    assert {c.shard for c in free} == {"none"}
    dp = [c for c in free if c.replicas == 4][0]
    whole = max(dp.memory)
    # Adam's two moments: the state alone is 2 x 32 MB; split over 4 replicas it is a quarter
    assert shard_memory(32e6, 4e6, 2, 4, "none") == pytest.approx(4 * 32e6)
    assert shard_memory(32e6, 4e6, 2, 4, "optimizer") < shard_memory(32e6, 4e6, 2, 4, "none")
    assert shard_memory(32e6, 4e6, 2, 4, "full") < shard_memory(32e6, 4e6, 2, 4, "optimizer")
    tight = plan(layers, devices=4, batch=64, link="nvlink", memory=whole - 40e6)
    assert tight and all(max(c.memory) <= whole - 40e6 for c in tight)
    sharded = [c for c in tight if c.shard != "none"]
    assert sharded and all(c.replicas > 1 for c in sharded)
    assert any(f"shard={c.shard!r}" in c.arguments() for c in sharded)
    assert all(c.shard == "none" for c in tight if c.replicas == 1)
    # SGD keeps one slot: a plan for it needs less memory than for Adam
    sgd = plan(layers, devices=4, batch=64, link="nvlink", optimizer_slots=optimizer_slots("sgd"))
    assert max(c.memory[0] for c in sgd if c.replicas == 4) < whole
    with pytest.raises(ValueError, match="adam"):
        optimizer_slots("lamb")


def test_a_device_in_the_v_is_planned_with_the_memory_of_the_stages_it_holds():
    # one heavy first stage: round robin's device 0 holds stages 0 and 2, the V's stages 0 and 3
    layers = [LayerModel(f"l{i}", 1e-3, 1e-4, 2e-3, 2e-4, 4096, (40 if i == 0 else 1) * 1_000_000) for i in range(8)]
    cands = [c for c in plan(layers, devices=2, batch=16, link="nvlink", schedules=("interleaved",))
             if c.stages == 2 and c.chunks == 4]
    by = {c.placement: c for c in cands}
    assert set(by) == {"loop", "v"}
    for placement, c in by.items():
        starts = [sum(c.balance[:k]) for k in range(4)]
        params = [sum(layers[i].param_bytes for i in range(starts[k], starts[k] + c.balance[k])) for k in range(4)]
        held = [[k for k in range(4) if row_of(k, 2, placement) == r] for r in range(2)]
        assert held == ([[0, 2], [1, 3]] if placement == "loop" else [[0, 3], [1, 2]])
        # Adam: weights, gradients and two slots per parameter; then the peak of micro-batches held times the
        # largest stage's saved activations (4096 bytes per sample per layer)
        expect = [4 * sum(params[k] for k in mine)
                  + c.prediction.peak_activations[r] * max(4096 * c.micro_batch * c.balance[k] for k in mine)
                  for r, mine in enumerate(held)]
        assert c.memory == pytest.approx(expect)
