"""Weights keep the model's own names: a pipeline of a flattened model saves, loads and checkpoints under the
original keys (torchvision's resnet18 takes its weights with strict=True, and gives them back)."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

import pipeddp
from pipeddp.runtime.names import Names, record, recorded
from pipeddp.tools.cli import main as cli
from pipeddp.tools.models import flatten_sequential


def _resnet(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return torchvision.models.resnet18(weights=None, num_classes=10).double()


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 10, (4,), generator=g)


def _flat(model: nn.Module) -> nn.Sequential:
    return flatten_sequential(model, _batch()[0][:2])


def _eval_out(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    module.eval()
    with torch.no_grad():
        return module(x)


LOSS = nn.functional.cross_entropy


def test_names_map_keys_both_ways_and_the_identity_keeps_them():
    names = Names({"layer1_0": "layer1.0", "enc_0.layer": "enc.layers.0", "same": "same"})
    assert names.original("layer1_0.conv1.weight") == "layer1.0.conv1.weight"
    assert names.original("enc_0.layer.linear1.bias") == "enc.layers.0.linear1.bias"
    assert names.original("layer1_01.weight") == "layer1_01.weight"  # a prefix ends at a dot
    assert names.original("fc.weight") == "fc.weight"
    own = ["layer1_0.conv1.weight", "fc.weight"]
    assert names.to_own({"layer1.0.conv1.weight": 1, "fc.weight": 2, "other": 3}, own) == \
        {"layer1_0.conv1.weight": 1, "fc.weight": 2, "other": 3}
    assert names.to_own({"layer1_0.conv1.weight": 1}, own) == {"layer1_0.conv1.weight": 1}  # own names taken too
    flat = {"state.layer1_0.conv1.weight.momentum_buffer": 1, "param_groups.layer1_0.conv1.weight.lr": 0.1}
    assert list(names.flat_optimizer_to_original(flat)) == ["state.layer1.0.conv1.weight.momentum_buffer",
                                                            "param_groups.layer1.0.conv1.weight.lr"]
    assert Names().identity and Names({"a": "a"}).identity


def test_a_plain_sequential_keeps_its_keys():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert recorded(model) is None
    with pipeddp.Pipeline(model, ["cpu", "cpu"]) as pipe:
        assert list(pipe.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_flatten_records_where_each_layer_came_from():
    flat = _flat(_resnet(0))
    names = recorded(flat)
    assert names["layer1_0"] == "layer1.0" and names["conv1"] == "conv1" and "flatten" not in names
    assert list(flat.state_dict())[6] == "layer1_0.conv1.weight"  # the flat nn.Sequential keeps its own keys


@pytest.mark.timeout(200)
def test_a_trained_pipelined_resnet18_loads_into_torchvision_resnet18():
    torch.set_num_threads(1)
    model = _resnet(0)
    reference = copy.deepcopy(model)
    x, y = _batch(1)
    with pipeddp.Pipeline(_flat(model), ["cpu", "cpu"], chunks=1) as pipe:  # one micro-batch: BatchNorm as one batch
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            LOSS(reference(x), y).backward()
            opt.step()
            ref_opt.step()
        state = pipe.state_dict()
        assert list(state) == list(reference.state_dict())  # the same keys in the same order
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-9, atol=1e-10, msg=key)
        fresh = _resnet(5)
        fresh.load_state_dict(state, strict=True)
        torch.testing.assert_close(_eval_out(fresh, x), _eval_out(pipe, x), rtol=1e-10, atol=1e-12)


def test_a_torchvision_state_dict_loads_into_the_pipeline():
    pretrained = _resnet(7)  # stands in for downloaded weights: a torchvision state dict
    x, _ = _batch(2)
    with pipeddp.Pipeline(_flat(_resnet(0)), ["cpu", "cpu"], chunks=2) as pipe:
        assert pipe.load_state_dict(pretrained.state_dict()) is not None
        torch.testing.assert_close(_eval_out(pipe, x), _eval_out(pretrained, x), rtol=1e-10, atol=1e-12)
        partial = {k: v for k, v in pretrained.state_dict().items() if k != "layer2.1.bn2.running_var"}
        partial["head.weight"] = torch.zeros(1)
        with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "head\.weight".*\n.*Missing '
                                               r'key\(s\) in state_dict: "layer2\.1\.bn2\.running_var"'):
            pipe.load_state_dict(partial)
        result = pipe.load_state_dict(partial, strict=False)
        assert result.missing_keys == ["layer2.1.bn2.running_var"] and result.unexpected_keys == ["head.weight"]


@pytest.mark.timeout(240)
def test_checkpoints_of_both_formats_keep_the_names(tmp_path):
    torch.set_num_threads(1)
    x, y = _batch(3)
    with pipeddp.HybridParallel(_flat(_resnet(0)), stages=2, chunks=2) as engine:
        opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            engine.train_step(x, y, LOSS)
            opt.step()
        saved = engine.state_dict()
        engine.save(str(tmp_path / "one.pt"), optimizer=opt)
        engine.save_checkpoint(str(tmp_path / "run"), 2, opt, sharded=True)
        momentum = {n: opt.state[p]["momentum_buffer"].clone() for n, p in engine.named_parameters()}

    ck = torch.load(tmp_path / "one.pt")
    assert list(ck["model"]) == list(_resnet(0).state_dict())
    assert "layer1.0.conv1.weight" in ck["optimizer"]["state"]
    assert "layer1.0.conv1.weight" in ck["optimizer"]["param_groups"][0]["params"]
    assert cli(["convert", str(tmp_path / "run" / "step-000000002"), str(tmp_path / "converted.pt")]) == 0
    converted = torch.load(tmp_path / "converted.pt")
    for name in ("one.pt", "converted.pt"):
        fresh = _resnet(9)
        fresh.load_state_dict(torch.load(tmp_path / name)["model"], strict=True)
        torch.testing.assert_close(fresh.state_dict(), saved, rtol=0, atol=0)
    assert set(converted["optimizer"]["state"]) == set(ck["optimizer"]["state"])

    for source in ("one.pt", "run"):  # into engines of another start, optimizer state by the original names
        if source == "one.pt":
            target = pipeddp.Pipeline(_flat(_resnet(4)), ["cpu", "cpu"], chunks=2)
            opt = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
            target.load(str(tmp_path / "one.pt"), opt)
        else:
            target = pipeddp.HybridParallel(_flat(_resnet(4)), stages=2, chunks=2)
            opt = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
            assert pipeddp.resume(target, str(tmp_path / "run"), opt) == {"step": 2}
        with target:
            torch.testing.assert_close(target.state_dict(), saved, rtol=0, atol=0)
            for n, p in target.named_parameters():
                torch.testing.assert_close(opt.state[p]["momentum_buffer"], momentum[n], rtol=0, atol=0, msg=n)


class TiedLM(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(16, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.body(self.emb(x)))


def test_tied_weights_stay_tied_under_the_original_names():
    model = TiedLM().double()
    reference = copy.deepcopy(model)
    x = torch.randint(0, 16, (6, 5), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 16, (6, 5), generator=torch.Generator().manual_seed(1))

    def loss_fn(out, target):
        return LOSS(out.reshape(-1, 16), target.reshape(-1))

    with pipeddp.Pipeline(_flat_tied(model, x), ["cpu", "cpu"], chunks=2, balance=[2, 3]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        for _ in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            pipe.train_step(x, y, loss_fn)
            loss_fn(reference(x), y).backward()
            opt.step()
            ref_opt.step()
        state = pipe.state_dict()
        assert list(state) == list(reference.state_dict())  # both names of the tied weight, as the model has
        torch.testing.assert_close(state["head.weight"], state["emb.weight"], rtol=0, atol=0)
        fresh = TiedLM(3).double()
        fresh.load_state_dict(state, strict=True)
        assert fresh.head.weight is fresh.emb.weight
        torch.testing.assert_close(fresh(x), reference(x), rtol=1e-10, atol=1e-12)
        pipe.load_state_dict(TiedLM(8).double().state_dict())  # both copies take the one weight
        torch.testing.assert_close(pipe(x), TiedLM(8).double()(x), rtol=1e-10, atol=1e-12)


def _flat_tied(model: nn.Module, x: torch.Tensor) -> nn.Sequential:
    flat = flatten_sequential(model, x)
    assert list(flat._modules) == ["emb", "body_0", "body_1", "body_2", "head"]
    return flat


def test_two_tensors_under_one_original_key_are_refused_not_dropped():
    flat = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    record(flat, {"0": "block", "1": "block"})
    with pytest.raises(ValueError, match=r"the layers' keys \['0\.weight', '1\.weight'\] would all be saved as "
                                         r"'block\.weight' of the original model, but they hold different tensors"):
        pipeddp.Pipeline(flat, ["cpu", "cpu"])


@pytest.mark.timeout(240)
def test_stage_mode_processes_save_and_load_under_the_original_names(tmp_path):
    from names_jobs import stage_mode_job

    results = pipeddp.spawn(stage_mode_job, 2, args=(str(tmp_path),), timeout=200)
    reference = _resnet(0)
    x, y = _batch(1)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        LOSS(reference(x), y).backward()
        opt.step()
    keys = list(reference.state_dict())
    first, second = (r["local"] for r in results)
    assert first + second == keys  # each process holds its stages' share, under the original names
    for r in results:
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(r["state"][key], value, rtol=1e-9, atol=1e-10, msg=key)
        torch.testing.assert_close(r["loaded"], r["state"], rtol=0, atol=0)
    fresh = _resnet(5)
    fresh.load_state_dict(torch.load(tmp_path / "one.pt")["model"], strict=True)
    torch.testing.assert_close(_eval_out(fresh, x), _eval_out(reference, x), rtol=1e-9, atol=1e-10)
