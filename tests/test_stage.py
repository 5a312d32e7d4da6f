"""``runtime.stage``: one stage's forward / backward / recompute against autograd on the plain layers."""

import copy
from collections import OrderedDict

import pytest
import torch
from conftest import CountOps, data, make_mlp, max_diff
from torch import nn

from pipeddp.runtime.owned import register_layers
from pipeddp.runtime.slicing import build_stages
from pipeddp.runtime.stage import Stage, StepSpec

CPU = torch.device("cpu")
LOSS = nn.functional.mse_loss


def middle_slice(seed: int = 0) -> nn.Sequential:
    """Layers 2..5 of a 6-layer float64 MLP: Linear, Tanh, Linear, ReLU (a stage in the middle of a pipeline)."""
    return nn.Sequential(*list(make_mlp(seed=seed))[2:6])


def tail_slice(seed: int = 0) -> nn.Sequential:
    """The last three layers of the MLP (ends with a Linear): a last stage."""
    return nn.Sequential(*list(make_mlp(seed=seed))[-3:])


def grads_of(module: nn.Module):
    return [p.grad for p in module.parameters()]


def test_forward_returns_the_detached_output_of_the_plain_layers():
    plain = middle_slice()
    stage = Stage(1, copy.deepcopy(plain), CPU, last=False)
    x, _ = data(5)
    spec = StepSpec(grad=True)
    out, loss = stage.forward(0, x, spec)
    assert loss is None
    assert torch.equal(out, plain(x))
    assert not out.requires_grad and out.grad_fn is None
    # a received activation is the stage's own (a channel hands over a fresh tensor): it becomes the leaf that
    # carries the gradient back, marked as it is, not copied
    assert spec.saved[1][0].inputs is x and x.requires_grad and x.grad_fn is None


def test_backward_gives_input_and_parameter_gradients_of_autograd_on_the_slice():
    plain = middle_slice()
    stage = Stage(1, copy.deepcopy(plain), CPU, last=False)
    spec = StepSpec(grad=True)
    xs = [data(n, seed=s)[0] for n, s in ((4, 1), (3, 2), (5, 3))]
    gs = [data(n, seed=10 + s)[1] for n, s in ((4, 1), (3, 2), (5, 3))]
    for i, x in enumerate(xs):
        stage.forward(i, x, spec)
    # backwards in another order than the forwards: each uses its own saved micro-batch
    gins = {i: stage.backward(i, [gs[i]], spec) for i in (1, 0, 2)}

    expected_dx = []
    for x, g in zip(xs, gs):
        leaf = x.detach().clone().requires_grad_(True)
        torch.autograd.backward(plain(leaf), g)
        expected_dx.append(leaf.grad)
    for i in range(3):
        assert len(gins[i]) == 1
        assert (gins[i][0] - expected_dx[i]).abs().max().item() < 1e-12
    # .grad holds the sum over the three micro-batches, as autograd accumulates it on the plain slice
    assert max_diff(grads_of(plain), grads_of(stage.module)) < 1e-12
    assert spec.saved[1] == {}  # every micro-batch was freed by its backward


def test_last_stage_returns_the_weighted_loss_and_starts_backward_from_it():
    plain = tail_slice()
    stage = Stage(2, copy.deepcopy(plain), CPU, last=True)
    x, y = data(10)
    xs, ys = list(x.split([6, 4])), list(y.split([6, 4]))
    weights = [0.6, 0.4]
    spec = StepSpec(grad=True, loss_fn=LOSS, targets=ys, weights=weights)
    results = [stage.forward(i, xs[i], spec) for i in range(2)]
    for i, (out, loss) in enumerate(results):
        assert out is None  # a loss step's last stage sends nothing
        assert loss is spec.saved[2][i].roots  # the one backward starts from, not detached again
        assert abs(loss.item() - weights[i] * LOSS(plain(xs[i]), ys[i]).item()) < 1e-15
    gins = [stage.backward(i, None, spec) for i in range(2)]

    leaf = x.detach().clone().requires_grad_(True)
    LOSS(plain(leaf), y).backward()  # the whole batch's mean loss: the weighted sum of the micro-batch losses
    assert max_diff(grads_of(plain), grads_of(stage.module)) < 1e-12
    assert (torch.cat([g[0] for g in gins]) - leaf.grad).abs().max().item() < 1e-12


def test_forward_without_grad_keeps_nothing():
    stage = Stage(2, tail_slice(), CPU, last=True)
    x, y = data(4)
    spec = StepSpec(grad=False, loss_fn=LOSS, targets=[y], weights=[1.0])
    out, loss = stage.forward(0, x, spec)
    assert torch.equal(out, stage.module(x))
    assert loss.item() == LOSS(stage.module(x), y).item()
    with pytest.raises(RuntimeError, match="no saved forward for micro-batch 0"):
        stage.backward(0, None, spec)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_recompute_gives_bit_identical_gradients(dropout):
    model = make_mlp(dropout=dropout)
    part = nn.Sequential(*list(model)[3:9])  # holds dropout layers when dropout > 0
    x, _ = data(6)
    g = data(6, seed=7)[1]
    kept = Stage(1, copy.deepcopy(part), CPU, last=False)
    again = Stage(1, copy.deepcopy(part), CPU, last=False)
    keep_spec = StepSpec(grad=True, seed=1234)
    rec_spec = StepSpec(grad=True, seed=1234, recompute=lambda i: True)
    xs = list(x.split([4, 2]))
    outs = [kept.forward(i, xs[i], keep_spec)[0] for i in range(2)]
    rec_outs = [again.forward(i, xs[i], rec_spec)[0] for i in range(2)]
    assert rec_spec.saved[1][0].roots is None  # nothing of the graph was kept
    for a, b in zip(outs, rec_outs):
        assert torch.equal(a, b)
    gs = list(g.split([4, 2]))
    gin_kept = [kept.backward(i, [gs[i]], keep_spec) for i in (1, 0)]
    gin_rec = [again.backward(i, [gs[i]], rec_spec) for i in (1, 0)]
    for a, b in zip(gin_kept, gin_rec):
        assert torch.equal(a[0], b[0])
    for p, q in zip(kept.module.parameters(), again.module.parameters()):
        assert torch.equal(p.grad, q.grad)
    if dropout:
        # the dropout really drew random numbers (else the comparison above proves little)
        assert not torch.equal(outs[0], part.eval()(xs[0]))


def test_recomputed_last_stage_equals_the_plain_loss_gradient():
    plain = tail_slice()
    stage = Stage(2, copy.deepcopy(plain), CPU, last=True)
    x, y = data(7)
    spec = StepSpec(grad=True, recompute=lambda i: True, loss_fn=LOSS, targets=[y], weights=[1.0])
    _, loss = stage.forward(0, x, spec)
    (gin,) = stage.backward(0, None, spec)
    leaf = x.detach().clone().requires_grad_(True)
    ref_loss = LOSS(plain(leaf), y)
    ref_loss.backward()
    assert loss.item() == ref_loss.item()
    assert (gin - leaf.grad).abs().max().item() < 1e-12
    assert max_diff(grads_of(plain), grads_of(stage.module)) < 1e-12


def test_backward_without_its_forward_raises():
    stage = Stage(3, middle_slice(), CPU, last=False)
    spec = StepSpec(grad=True)
    with pytest.raises(RuntimeError, match="stage 3 has no saved forward for micro-batch 2"):
        stage.backward(2, [torch.zeros(4, 12, dtype=torch.float64)], spec)
    x, _ = data(4)
    stage.forward(0, x, spec)
    stage.backward(0, [torch.ones(4, 12, dtype=torch.float64)], spec)
    with pytest.raises(RuntimeError, match="no saved forward for micro-batch 0: its backward ran twice"):
        stage.backward(0, [torch.ones(4, 12, dtype=torch.float64)], spec)


def test_backward_refuses_a_wrong_number_of_output_gradients():
    stage = Stage(1, middle_slice(), CPU, last=False)
    spec = StepSpec(grad=True)
    x, _ = data(4)
    stage.forward(0, x, spec)
    g = torch.ones(4, 12, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="stage 1: got 2 output gradients for 1 outputs"):
        stage.backward(0, [g, g], spec)


@pytest.mark.parametrize("grad,recompute", [(True, False), (True, True), (False, False)])
def test_in_place_first_layer_does_not_modify_the_received_tensor(grad, recompute):
    torch.manual_seed(0)
    lin = nn.Linear(12, 3).double()
    plain = nn.Sequential(nn.ReLU(), copy.deepcopy(lin))
    stage = Stage(1, nn.Sequential(nn.ReLU(inplace=True), lin), CPU, last=False)
    x, _ = data(5)
    received = x.clone()
    assert (received < 0).any()
    spec = StepSpec(grad=grad, recompute=lambda i: recompute)
    out, _ = stage.forward(0, received, spec)
    assert torch.equal(received, x)
    assert torch.equal(out, plain(x))
    if grad:
        g = torch.ones(5, 3, dtype=torch.float64)
        (gin,) = stage.backward(0, [g], spec)
        assert torch.equal(received, x)
        leaf = x.detach().clone().requires_grad_(True)
        torch.autograd.backward(plain(leaf), g)
        assert (gin - leaf.grad).abs().max().item() < 1e-12
        assert max_diff(grads_of(plain), grads_of(stage.module)) < 1e-12


@pytest.mark.parametrize("in_place", [True, False])
def test_a_checkpointed_forward_copies_its_input_once_at_most(in_place):
    """A forward that recompute replays gives its layers one copy of a received activation where a layer writes in
    place (two before: the checkpoint's and the in-place layer's), none where none does (a leaf that requires grad
    cannot be written in place); the gradients stay the plain layers'."""
    torch.manual_seed(0)
    layers = [nn.Linear(12, 12), nn.ReLU(inplace=in_place), nn.Linear(12, 3)]
    plain = copy.deepcopy(nn.Sequential(*layers)).double()
    stage = Stage(1, nn.Sequential(*layers).double(), CPU, last=False)
    x, _ = data(5)
    spec = StepSpec(grad=True, recompute=lambda i: True)
    with CountOps() as counted:
        out, _ = stage.forward(0, x, spec)
    assert counted.ops["clone"] == (1 if in_place else 0), counted.ops
    g = torch.ones(5, 3, dtype=torch.float64)
    (gin,) = stage.backward(0, [g], spec)
    leaf = x.detach().clone().requires_grad_(True)
    torch.autograd.backward(plain(leaf), g)
    assert torch.equal(out, plain(x)) and (gin - leaf.grad).abs().max().item() < 1e-12
    assert max_diff(grads_of(plain), grads_of(stage.module)) < 1e-12


def test_in_place_layer_behind_a_pass_through_first_layer():
    torch.manual_seed(0)
    lin = nn.Linear(12, 3).double()
    plain = nn.Sequential(nn.Flatten(), nn.ReLU(inplace=True), copy.deepcopy(lin))
    stage = Stage(1, nn.Sequential(nn.Flatten(), nn.ReLU(inplace=True), lin), CPU, last=False)
    x, _ = data(5)
    received = x.clone()
    spec = StepSpec(grad=True)
    out, _ = stage.forward(0, received, spec)
    assert torch.equal(received, x)
    g = torch.ones(5, 3, dtype=torch.float64)
    (gin,) = stage.backward(0, [g], spec)
    leaf = x.detach().clone().requires_grad_(True)
    torch.autograd.backward(plain(leaf * 1.0), g)
    assert (gin - leaf.grad).abs().max().item() < 1e-12


def test_build_stages_cuts_by_balance_and_keeps_the_layer_objects():
    model = make_mlp(depth=4)  # 7 layers
    layers = list(model)
    stages = build_stages(model, [2, 4, 1], [CPU, CPU, CPU])
    assert [st.index for st in stages] == [0, 1, 2]
    assert [st.last for st in stages] == [False, False, True]
    assert [list(st.module._modules) for st in stages] == [["0", "1"], ["2", "3", "4", "5"], ["6"]]
    flat = [m for st in stages for m in st.module]
    assert all(a is b for a, b in zip(flat, layers)) and len(flat) == len(layers)
    assert all(st.device == CPU for st in stages)
    x, _ = data(3)
    h = x
    for st in stages:
        h = st.module(h)
    assert torch.equal(h, model(x))


def test_build_stages_places_only_the_stages_asked_for():
    model = make_mlp(depth=4)
    (only,) = build_stages(model, [2, 4, 1], [CPU], indices=[1])
    assert only.index == 1 and not only.last
    assert list(only.module._modules) == ["2", "3", "4", "5"]
    (tail,) = build_stages(model, [2, 4, 1], [CPU], indices=[2])
    assert tail.last and tail.module[0] is model[6]
    with pytest.raises(ValueError, match="2 stages to place but 1 devices"):
        build_stages(model, [2, 4, 1], [CPU], indices=[0, 1])


@pytest.mark.parametrize("balance", [[1, 6], [3, 3, 1], [2, 2, 2, 1]])
def test_register_layers_gives_the_plain_keys_and_parameter_order(balance):
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict([
        ("embed", nn.Linear(4, 6)), ("act", nn.ReLU()), ("norm", nn.LayerNorm(6)), ("hidden", nn.Linear(6, 6)),
        ("bn", nn.BatchNorm1d(6)), ("drop", nn.Dropout(0.1)), ("head", nn.Linear(6, 2)),
    ]))
    keys = list(model.state_dict())
    params = list(model.parameters())
    owner = nn.Module()
    register_layers(owner, build_stages(model, balance, [CPU] * len(balance)))
    assert list(owner.state_dict()) == keys  # buffers (BatchNorm statistics) included
    assert [n for n, _ in owner.named_parameters()] == [n for n, _ in model.named_parameters()]
    got = list(owner.parameters())
    assert len(got) == len(params) and all(a is b for a, b in zip(got, params))
    fresh = copy.deepcopy(model)
    for p in fresh.parameters():
        nn.init.normal_(p)
    owner.load_state_dict(fresh.state_dict())  # a plain state dict loads into the stages
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
