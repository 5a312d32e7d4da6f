"""checkpoints/checkpointable.py: Pipeline and HybridParallel save, load and resume alike, and loading is all or
nothing. Each comparison is against the plain model trained on one device (float64)."""

import copy
import os
import stat
import warnings

import pytest
import torch
from torch import nn

import pipeddp
from conftest import max_diff
from pipeddp.tools.cli import main as cli

LOSS = nn.functional.mse_loss


def model(width: int = 12, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, width), nn.ReLU(), nn.Linear(width, 4)).double()


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64))
            for _ in range(n)]


def train(module, optimizer, steps, pipelined=True):
    for x, y in steps:
        optimizer.zero_grad()
        if pipelined:
            module.train_step(x, y, LOSS)
        else:
            LOSS(module(x), y).backward()
        optimizer.step()


def trained_plain(steps):
    """The plain model trained with Adam on one device: the reference every engine's run is compared with."""
    plain = model()
    train(plain, torch.optim.Adam(plain.parameters(), lr=0.01), steps, pipelined=False)
    return plain


def snapshot(module, optimizer):
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    state = copy.deepcopy(optimizer.state_dict())
    return weights, state


def same(a, b):
    (wa, sa), (wb, sb) = a, b
    if sorted(wa) != sorted(wb) or any(not torch.equal(wa[k], wb[k]) for k in wa):
        return False
    flat = lambda s: [t for p in s["state"].values() for t in p.values() if isinstance(t, torch.Tensor)]  # noqa: E731
    return len(flat(sa)) == len(flat(sb)) and all(torch.equal(x, y) for x, y in zip(flat(sa), flat(sb)))


# -- Pipeline writes what HybridParallel writes, and each loads the other's ---------------------------------


@pytest.mark.parametrize("sharded", [False, True])
def test_a_pipeline_checkpoint_loads_strictly_into_the_plain_model_and_resumes_exactly(tmp_path, sharded):
    steps = batches(6)
    plain = trained_plain(steps)

    run = str(tmp_path / "run")
    with pipeddp.Pipeline(model(), ["cpu", "cpu"], chunks=2) as pipe:
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
        assert pipe.resume(run, opt) is None  # a first run
        train(pipe, opt, steps[:3])
        path = pipe.save_checkpoint(run, 3, opt, sharded=sharded, async_save=sharded, extra={"epoch": 0})
        assert pipe.wait_for_save() == (path if sharded else None)
    with pipeddp.Pipeline(model(seed=5), ["cpu", "cpu"], chunks=4, balance=[1, 4]) as pipe:  # another cut
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
        assert pipeddp.resume(pipe, run, opt) == {"epoch": 0, "step": 3}
        train(pipe, opt, steps[3:])
        assert max_diff(plain.state_dict().values(), pipe.state_dict().values()) < 1e-12
        pipe.save(str(tmp_path / "final.pt"), opt)
    again = model(seed=7)
    again.load_state_dict(torch.load(str(tmp_path / "final.pt"))["model"], strict=True)
    assert max_diff(plain.state_dict().values(), again.state_dict().values()) < 1e-12


@pytest.mark.parametrize("sharded", [False, True])
def test_pipeline_and_hybrid_parallel_load_each_others_checkpoints(tmp_path, sharded):
    steps = batches(4)
    plain = trained_plain(steps)
    with pipeddp.Pipeline(model(), ["cpu", "cpu"], chunks=2) as pipe:
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
        train(pipe, opt, steps[:2])
        pipe.save(str(tmp_path / "from-pipe"), opt, sharded=sharded)
    with pipeddp.HybridParallel(model(seed=3), stages=3, chunks=2) as engine:
        opt = torch.optim.Adam(engine.parameters(), lr=0.01)
        engine.load(str(tmp_path / "from-pipe"), opt)
        train(engine, opt, steps[2:3])
        engine.save(str(tmp_path / "from-engine"), opt, sharded=sharded)
    with pipeddp.Pipeline(model(seed=4), ["cpu"]) as pipe:
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
        pipe.load(str(tmp_path / "from-engine"), opt)
        train(pipe, opt, steps[3:])
        assert max_diff(plain.state_dict().values(), pipe.state_dict().values()) < 1e-12


# -- all or nothing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ["Pipeline", "HybridParallel"])
def test_every_refused_load_leaves_the_model_and_the_optimizer_as_they_were(tmp_path, cls):
    def build(m):
        return pipeddp.Pipeline(m, ["cpu", "cpu"], chunks=2) if cls == "Pipeline" else \
            pipeddp.HybridParallel(m, stages=2, chunks=2)

    with build(model(width=16)) as other:  # the same keys; layers 2 and 4 of other shapes
        opt = torch.optim.Adam(other.parameters(), lr=0.01)
        train(other, opt, batches(1))
        other.save(str(tmp_path / "wide.pt"), opt)
        other.save(str(tmp_path / "wide"), opt, sharded=True)
        other.save_checkpoint(str(tmp_path / "run"), 1, opt)
    with build(model()) as mine:  # an SGD over two parameter groups: state of other groups than Adam's
        opt = torch.optim.Adam(mine.parameters(), lr=0.01)
        train(mine, opt, batches(1, seed=2))
        mine.save(str(tmp_path / "mine.pt"), opt)
        params = list(mine.parameters())
        grouped = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "lr": 0.5}], lr=0.01)
        train(mine, grouped, batches(1, seed=3))
        before = snapshot(mine, grouped)
        wide = "2.weight: saved [16, 12] float64, model [12, 12] float64; 2.bias: saved [16] float64, model [12] " \
               "float64; 4.weight: saved [4, 16] float64, model [4, 12] float64. Nothing was loaded"
        attempts = [
            (lambda: mine.load(str(tmp_path / "wide.pt"), grouped), f"wide.pt holds tensors that do not fit the "
                                                                     f"model (3 of them): {wide}"),
            (lambda: mine.load(str(tmp_path / "wide"), grouped), f"wide holds tensors that do not fit the model "
                                                                 f"(3 of them): {wide}"),
            (lambda: mine.resume(str(tmp_path / "run"), grouped), "step-000000001.pt holds tensors that do not fit"),
            (lambda: mine.load_state_dict(torch.load(str(tmp_path / "wide.pt"))["model"]),
             f"the state dict holds tensors that do not fit the model (3 of them): {wide}"),
            (lambda: mine.load(str(tmp_path / "mine.pt"), grouped), "mine.pt holds optimizer state of other parameter "
                                                                    "groups than the optimizer's (saved: [6] "
                                                                    "parameters per group, given: [2, 4])"),
        ]
        for attempt, said in attempts:
            with pytest.raises(ValueError) as info:
                attempt()
            assert said in str(info.value), str(info.value)
            assert same(before, snapshot(mine, grouped)), said
        state = mine.state_dict()
        state["0.bias"] = state["0.bias"].to(torch.int64)  # the right shape, another kind of value
        with pytest.raises(ValueError, match=r"0.bias: saved \[12\] int64, model \[12\] float64"):
            mine.load_state_dict(state)
        assert same(before, snapshot(mine, grouped))
        state["0.bias"] = state["0.bias"].float()  # float32 into float64: cast, as torch casts
        lacking = {k: v for k, v in state.items() if k != "4.bias"}
        with pytest.raises(RuntimeError, match=r"nothing was loaded.*\n\tMissing key\(s\) in state_dict: "
                                               r'"4.bias"\. $'):
            mine.load_state_dict({k: v + 1 for k, v in lacking.items()})
        assert same(before, snapshot(mine, grouped))
        with pytest.raises(RuntimeError, match=r'\n\tUnexpected key\(s\) in state_dict: "9.weight"\. $'):
            mine.load_state_dict({**{k: v + 1 for k, v in state.items()}, "9.weight": torch.zeros(2)})
        assert same(before, snapshot(mine, grouped))
        mine.load_state_dict({**lacking, "9.weight": torch.zeros(2)}, strict=False)  # loads what matches
        mine.load_state_dict(state)


def test_a_damaged_shard_leaves_the_model_as_it_was(tmp_path):
    with pipeddp.Pipeline(model(seed=2), ["cpu", "cpu"]) as pipe:
        pipe.save(str(tmp_path / "ck"), sharded=True)
    shard = tmp_path / "ck" / "__0_0.distcp"
    data = shard.read_bytes()
    with pipeddp.Pipeline(model(), ["cpu", "cpu"]) as pipe:
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        shard.write_bytes(bytes(data[: len(data) // 2]))  # half a shard: the read fails part way
        with pytest.raises(ValueError, match="is damaged"):
            pipe.load(str(tmp_path / "ck"))
        assert all(torch.equal(before[k], v) for k, v in pipe.state_dict().items())


# -- files a team can read -----------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoint_files_get_the_permissions_of_the_umask_as_torch_save_does(tmp_path, umask):
    old = os.umask(umask)
    try:
        torch.save({"a": 1}, str(tmp_path / "torch.pt"))
        with pipeddp.Pipeline(model(), ["cpu", "cpu"]) as pipe:
            pipe.save(str(tmp_path / "one.pt"))
            pipe.save_checkpoint(str(tmp_path / "run"), 1)
            pipe.save(str(tmp_path / "sharded"), sharded=True)
        assert cli(["convert", str(tmp_path / "sharded"), str(tmp_path / "converted.pt")]) == 0
    finally:
        os.umask(old)
    expected = 0o666 & ~umask
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(tmp_path / "torch.pt") == expected
    for path in ("one.pt", "run/step-000000001.pt", "converted.pt"):
        assert mode(tmp_path / path) == expected, (path, oct(mode(tmp_path / path)))
    assert not [n for n in os.listdir(tmp_path) + os.listdir(tmp_path / "run") if n.startswith(".tmp-")]


def test_a_one_process_asynchronous_sharded_save_prints_no_warning_of_torchs(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pipeddp.Pipeline(model(), ["cpu", "cpu"]) as pipe:
            for step in range(3):
                pipe.save_checkpoint(str(tmp_path), step, sharded=True, async_save=True)
            pipe.wait_for_save()
    assert [str(w.message) for w in caught] == []


def stage_mode_refusal_job(path: str):
    """Stage mode, 2 processes (layer 2 on rank 0, layer 4 on rank 1): load a checkpoint of wider layers."""
    with pipeddp.HybridParallel(model(), stages=2, mode="stage", balance=[3, 2]) as engine:
        before = {k: v.clone() for k, v in engine.local_state_dict().items()}
        try:
            engine.load(path)
        except ValueError as exc:
            said = str(exc)
        unchanged = all(torch.equal(v, engine.local_state_dict()[k]) for k, v in before.items())
    return said, unchanged


@pytest.mark.timeout(120)
def test_a_refused_load_in_stage_mode_counts_the_whole_models_misfits_on_every_rank(tmp_path):
    with pipeddp.Pipeline(model(width=16), ["cpu", "cpu"], chunks=2) as wide:
        wide.save(str(tmp_path / "wide.pt"))
    results = pipeddp.spawn(stage_mode_refusal_job, 2, args=(str(tmp_path / "wide.pt"),), timeout=100)
    (first, kept0), (second, kept1) = results
    assert kept0 and kept1
    assert first == second  # one message for the whole model, on every rank
    assert "(3 of them): 2.weight: saved [16, 12]" in first and "4.weight: saved [4, 16]" in first, first
