import pytest
import torch

from pipeddp.runtime.schedule import row_of
from pipeddp.tools.models import mlp
from pipeddp.tools.plan import LayerModel, fit_layers, parse_bytes, plan


def synthetic_layers(n=8):
    # layer i: 1 ms fixed + 0.1 ms per sample forward, twice that backward, 4 MB of parameters
    return [LayerModel(f"l{i}", 1e-3, 1e-4, 2e-3, 2e-4, 4096, 4_000_000) for i in range(n)]


#: a sweep of three micro-batch counts: the tests below are about memory and ranking, not about every count
FEW = (1, 4, 16)


def test_memory_budget_is_never_exceeded():
    layers = synthetic_layers()
    everything = plan(layers, devices=8, batch=256, link="nvlink", memory=None, chunks=FEW)
    assert everything
    budget = sorted(max(c.memory) for c in everything)[len(everything) // 2]
    fitting = plan(layers, devices=8, batch=256, link="nvlink", memory=budget, chunks=FEW)
    assert fitting and len(fitting) < len(everything)
    assert all(max(c.memory) <= budget for c in fitting)
    assert plan(layers, devices=8, batch=256, memory=1.0, chunks=FEW) == []


def test_ranking_and_shapes():
    layers = synthetic_layers()
    cands = plan(layers, devices=8, batch=256, link="pcie", top=5, chunks=FEW)
    assert len(cands) == 5
    assert [c.step_time for c in cands] == sorted(c.step_time for c in cands)
    for c in cands:
        assert c.stages * c.replicas == 8
        assert sum(c.balance) == len(layers) and len(c.balance) == c.stages * c.virtual_stages
        assert c.why
    # with slow replica links, fewer replicas (more stages) win over pure data parallelism
    slow = plan(layers, devices=8, batch=256, link="nvlink", allreduce_link="ethernet", top=1, chunks=FEW)[0]
    fast = plan(layers, devices=8, batch=256, link="nvlink", allreduce_link="nvlink", top=1, chunks=FEW)[0]
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


# -- tensor parallelism ---------------------------------------------------------------------------------------------

SEQ, HIDDEN, VOCAB = 8, 32, 96
#: the Linear weights a Llama's own tensor-parallel plan splits (its config's base_model_tp_plan and the head's
#: _tp_plan: q, k, v, gate, up column-wise, o, down row-wise, the head column-wise) and its vocabulary-parallel
#: embedding; every other parameter (the norms) stays whole on each tp rank
SPLIT = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
         "down_proj.weight", "embed_tokens.weight", "lm_head.weight")


def tiny_llama(heads=4, kv_heads=2, tied=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def flat_llama():
    """A tiny Llama flattened for pipeddp, and one batch of 4 token rows (``--model module:flat_llama``)."""
    from pipeddp.tools.flatten import flatten_sequential

    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (4, SEQ))
    return flatten_sequential(model, ids), ids


def llama_layers(compute: float):
    """The flat Llama, its layers as plan sees them (``compute`` seconds per sample forward, twice that backward,
    no fixed cost; each layer's own parameter bytes and output size), and what its own plan splits in them."""
    from pipeddp.tools.tp_costs import sharded_layers

    flat, ids = flat_llama()
    layers = [LayerModel(name, 0.0, compute, 0.0, 2 * compute, 4096,
                         sum(p.numel() * p.element_size() for p in layer.parameters()))
              for name, layer in flat.named_children()]
    return flat, layers, sharded_layers(flat, "auto", ids)


def test_tensor_parallel_memory_is_the_plain_llamas_parameters_with_the_split_ones_divided():
    flat, layers, sharded = llama_layers(1e-4)
    model = flat._pipeddp_source
    whole = sum(p.numel() * 4 for p in model.parameters())
    for tp in (1, 2):
        # counted on the transformers model itself: the split tensors divided by tp, the rest whole
        expect = sum(p.numel() * 4 / (tp if name.endswith(SPLIT) else 1) for name, p in model.named_parameters())
        assert tp == 1 or expect < 0.51 * whole
        for stages in (1, 2):
            c = [c for c in plan(layers, devices=stages * tp, batch=8, tp=tp, sharded=sharded, chunks=(2,),
                                 schedules=("1f1b",)) if c.stages == stages][0]
            assert c.tp == tp and c.replicas == 1 and c.kind == {(1, 1): "plain model", (1, 2): "tensor parallel",
                                                                 (2, 1): "pipeline", (2, 2): "pipeline x TP"}[
                                                                     (stages, tp)]
            starts = [sum(c.balance[:k]) for k in range(stages)]
            saved = [4096 * c.micro_batch * c.balance[k] for k in range(stages)]  # the outputs: whole on every rank
            held = [m - c.prediction.peak_activations[k] * saved[k] for k, m in enumerate(c.memory)]
            # Adam: weights, gradients and two moments, on each device for its stage's share
            assert sum(held) == pytest.approx(4 * expect, rel=1e-6), (tp, stages, starts)


def test_tensor_parallel_time_is_the_split_work_and_the_all_reduces_of_a_llama_block():
    import math

    from pipeddp.tools.simulate import Link

    b, tp = 4, 2
    # the all-reduces alone (no compute): per block, o_proj and down_proj all-reduce their outputs forward; q, k, v,
    # gate and up each their input's gradient backward (torch's ColwiseParallel: five, where Megatron's fused
    # projections make two); the vocabulary-parallel embedding all-reduces its output, the head all-gathers its
    # logits and all-reduces its input's gradient. Each a ring over tp ranks: 2 (tp-1) steps of n/tp (all-gather:
    # tp-1), at 1 GB/s and 10 us a step
    link = Link(1e9, 1e-5)
    hidden = b * SEQ * HIDDEN * 4
    ring = lambda n, steps: steps * 1e-5 + steps / tp * n / 1e9  # noqa: E731
    reduce_, gather = (lambda n: ring(n, 2 * (tp - 1))), (lambda n: ring(n, tp - 1))
    expect = 2 * (7 * reduce_(hidden)) + reduce_(hidden) + gather(b * SEQ * VOCAB * 4) + reduce_(hidden)
    _, layers, sharded = llama_layers(0.0)
    only = plan(layers, devices=tp, batch=b, tp=tp, sharded=sharded, tp_link=link, chunks=(1,))
    assert len(only) == 1 and only[0].step_time == pytest.approx(expect, rel=1e-9)
    assert f"tp=2: 17 collectives a micro-batch over the stages' tp devices, {expect * 1e3:.2f} ms" in only[0].why
    # the work alone (a free link): each layer's per-sample time times (the share of its parameters left whole
    # + the split share / tp), counted on the transformers model's own parameters
    flat, layers, sharded = llama_layers(1e-3)
    model = flat._pipeddp_source
    kept = []
    for name, layer in flat.named_children():
        split = sum(p.numel() for n, p in layer.named_parameters() if f"{name}.{n}".endswith(SPLIT))
        total = sum(p.numel() for p in layer.parameters())
        kept.append(1 - split / total + split / total / tp if total else 1.0)
    assert sum(p.numel() for n, p in model.named_parameters() if n.endswith(SPLIT)) == \
        sum(s.split_bytes for s in sharded) // 4
    only = plan(layers, devices=tp, batch=b, tp=tp, sharded=sharded, tp_link=Link(math.inf), chunks=(1,))
    assert only[0].step_time == pytest.approx(sum(3e-3 * b * k for k in kept), rel=1e-9)


def test_plan_answers_pp_x_tp_x_dp_and_refuses_a_tp_the_heads_do_not_allow():
    from pipeddp.tools.flatten import flatten_sequential
    from pipeddp.tools.tp_costs import sharded_layers, tp_refusals

    flat, layers, sharded = llama_layers(1e-4)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    # the heads bind only where the attention is split: the MLPs alone split 4 ways (intermediate 64)
    assert tp_refusals(sharded_layers(flat, MLP_PLAN, ids), 4) == [] and tp_refusals(sharded, 4)
    # what HybridParallel(tp_plan=) refuses before building, plan refuses alike
    with pytest.raises(ValueError, match="'packed_colwise': a style is one of"):
        sharded_layers(flat, {"lm_head": "packed_colwise"}, ids)
    with pytest.raises(ValueError, match=r"pattern 'model.layers.\*.mlp.fc1' matches no module"):
        sharded_layers(flat, {"lm_head": "colwise", "model.layers.*.mlp.fc1": "colwise"}, ids)
    tied = tiny_llama(tied=True)
    with pytest.raises(ValueError, match="whose weight is tied to another place, but not alike"):
        sharded_layers(flatten_sequential(tied, ids), {"lm_head": "colwise_gather_output"}, ids)  # the embedding whole
    # 2 key-value heads: tp=4 would leave a rank half a head; 4 attention heads: tp=3 cannot split them
    with pytest.raises(ValueError, match=r"tp=4 does not divide the model's key-value heads \(2\).*choose tp from "
                                         r"\[1, 2\]"):
        plan(layers, devices=8, batch=16, tp=[1, 2, 4], sharded=sharded)
    with pytest.raises(ValueError, match=r"tp=3 does not divide the model's .*attention heads \(4\)"):
        plan(layers, devices=6, batch=12, tp=3, sharded=sharded)
    with pytest.raises(ValueError, match="sharded="):
        plan(layers, devices=8, batch=16, tp=2)
    cands = plan(layers, devices=8, batch=16, tp=[1, 2], sharded=sharded)
    grids = {(c.replicas, c.stages, c.tp) for c in cands}
    assert {(8, 1, 1), (4, 2, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 4, 1)} <= grids
    assert all(dp * pp * tp == 8 for dp, pp, tp in grids)
    assert [c.step_time for c in cands] == sorted(c.step_time for c in cands)
    # what the engine runs with tp_plan: one backward action per micro-batch, whole copies on the replicas
    assert {c.schedule for c in cands if c.tp > 1} == {"1f1b", "gpipe", "interleaved"}
    tight = plan(layers, devices=8, batch=16, tp=[1, 2], sharded=sharded,
                 memory=sorted(max(c.memory) for c in cands)[len(cands) // 4])
    assert {c.shard for c in tight if c.tp == 1} > {"none"} and {c.shard for c in tight if c.tp > 1} == {"none"}
    # a slow link between a tp group's devices ranks every tp layout below the same layout without tp
    slow = plan(layers, devices=8, batch=16, tp=[1, 2], sharded=sharded, tp_link="ethernet")
    best = {}
    for c in slow:
        best.setdefault((c.tp, c.stages), c.step_time)
    assert best[(2, 2)] > best[(1, 2)] and best[(2, 1)] > best[(1, 1)]
    c = next(c for c in cands if (c.replicas, c.stages, c.tp) == (2, 2, 2))
    assert c.layout == "2 x 2 x 2" and c.kind == "pipeline x TP x DDP"
    assert c.mesh() == "init_device_mesh('cuda', (2, 2, 2), mesh_dim_names=('dp', 'pp', 'tp'))"
    assert c.arguments().startswith("pipeddp.HybridParallel(model, stages=2, mode='stage', mesh=mesh, "
                                    "tp_plan='auto', chunks=")
    assert c.command(devices_per_node=8) == "torchrun --nproc_per_node=8 train.py"
    assert c.command(devices_per_node=4).startswith("torchrun --nnodes=2 --nproc_per_node=4 ")


def test_the_plan_command_refuses_a_tp_before_measuring(monkeypatch, capsys):
    import pipeddp.tools.plan as plan_module
    from pipeddp.tools.cli import main

    monkeypatch.setattr(plan_module, "fit_layers", lambda *a, **k: pytest.fail("profiled before refusing"))
    for args, said in ((["--tp", "3"], "--tp 3 must divide --devices 8"),
                       (["--tp", "4", "--devices-per-node", "2"], "and --devices-per-node 2 (a tp group sits on one"),
                       (["--tp", "two"], "--tp 'two': give tensor-parallel degrees such as 2 or 1,2,4, or auto"),
                       (["--tp-link", "wifi"], "--tp-link 'wifi' is not a link"),
                       (["--model", "mlp", "--tp", "2"], "mlp carries no tensor-parallel plan"),
                       (["--model", "mlp", "--tp", "2", "--tp-plan", "{x"], "--tp-plan '{x': give auto or a JSON")):
        assert main(["plan", "--devices", "8", *args]) == 2
        out = " ".join(capsys.readouterr().out.split())
        assert said in out, out


@pytest.mark.timeout(120)
def test_the_collectives_plan_counts_are_those_torchs_tensor_parallelism_sends():
    """Each split module's collectives, as plan predicts them from the plan and one forward, against what
    ``parallelize_module`` with the same torch styles sends over gloo in 2 processes (one forward, one backward)."""
    import plan_jobs

    import pipeddp
    from pipeddp.tools.tp_costs import sharded_layers

    batch = 3
    sample = torch.randint(0, plan_jobs.VOCAB, (batch, plan_jobs.TOKENS))
    sharded = sharded_layers(plan_jobs.model(), plan_jobs.styles(), sample)
    predicted = {when: sorted((c.kind, round(c.bytes_per_sample * batch)) for layer in sharded
                              for c in getattr(layer, when)) for when in ("forward", "backward")}
    # 2 blocks: o and down forward, q, k, v and up backward; the embedding forward; the head both ways
    assert [len(predicted["forward"]), len(predicted["backward"])] == [6, 9], predicted
    for counted in pipeddp.spawn(plan_jobs.count_job, 2, args=(batch,), timeout=100):
        assert counted == predicted


MLP_PLAN = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise"}
LLAMA_MODULE = '''
import sys
sys.path.insert(0, {tests!r})
from test_plan import flat_llama
'''


@pytest.fixture
def llama_module(tmp_path, monkeypatch):
    """A module of the user's in the current folder whose ``flat_llama`` the command line plans."""
    import os
    import sys

    name = f"plan_models_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(LLAMA_MODULE.format(tests=os.path.dirname(__file__)))
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


@pytest.mark.timeout(120)
def test_the_plan_command_ranks_tp_and_shows_its_sweep_on_a_terminal_only(llama_module, capfd, monkeypatch):
    import json

    from conftest import stderr_on_a_terminal

    from pipeddp.tools.cli import main

    # a log or a pipe (pytest's capture): the table, nothing of the sweep's bar
    assert main(["plan", "--model", f"{llama_module}:flat_llama", "--devices", "8", "--batch", "16", "--tp", "auto",
                 "--profile-batch", "4", "--top", "40"]) == 0
    out, err = capfd.readouterr()
    said = " ".join(out.split())
    assert "tp=4 left out: it does not divide the model's key-value heads (2)" in said, said
    assert "tp=8 left out" in said and "replicas x stages x tp" in said and "2 x 2 x 2" in said
    assert "simulating" not in out + err and err == "", err
    with stderr_on_a_terminal(monkeypatch) as shown:  # as a user's at a shell: the sweep's bar
        code = main(["plan", "--model", f"{llama_module}:flat_llama", "--devices", "2", "--batch", "8", "--tp", "2",
                     "--profile-batch", "4", "--tp-plan", json.dumps(MLP_PLAN)])
    assert code == 0
    drawn = b"".join(shown)
    assert b"simulating the layouts of 2 devices" in drawn and b"100%" in drawn, drawn[-2000:]  # it moved to the end
    out = " ".join(capfd.readouterr().out.split())
    assert "mesh = init_device_mesh('cuda', (1, 1, 2), mesh_dim_names=('dp', 'pp', 'tp'))" in out, out
    assert f"engine = pipeddp.HybridParallel(model, stages=1, mode='stage', mesh=mesh, tp_plan={MLP_PLAN!r}" in out
    assert "tp=2: 6 collectives a micro-batch" in out  # the MLPs' only: gate and up backward, down forward
    assert "torchrun --nproc_per_node=2 train.py" in out
    assert "no pipeline, no replicas: the model split over 2 devices" in out and "plain data" not in out
