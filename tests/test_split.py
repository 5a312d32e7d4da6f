"""``runtime.split`` through ``Stage.backward_input`` / ``backward_weight``: the two halves of a backward.

Every case compares against autograd's whole backward on the plain layers:
the I half must give the input gradients and touch no ``.grad``; the W half
must then give the parameter gradients. Where W re-enters the graph is checked
on the graph itself (``test_the_weight_half_re_enters_the_graph_where_the_paths_part``):
one split point per Linear, at its weight side, with no whole-backward
fallback, so W adds no activation-gradient work of its own; nothing here times it.
"""

import copy

import pytest
import torch
from torch import nn

from conftest import data, make_mlp, max_diff
from pipeddp.runtime import split
from pipeddp.runtime.stage import Stage, StepSpec

CPU = torch.device("cpu")
LOSS = nn.functional.mse_loss


class Attention(nn.Module):
    """Self-attention with its own projections and an inner tensor op on the weights (a residual block)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, h, h, need_weights=False)[0] * self.scale


class Tied(nn.Module):
    """One Linear used twice in a row: its weight is reached through both the weight and the input side."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def slices():
    torch.manual_seed(0)
    return {
        "mlp": nn.Sequential(*list(make_mlp())[2:7]),
        "conv": nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1),
                              nn.Flatten()).double(),
        "attention": nn.Sequential(Attention(8), nn.Linear(8, 8)).double(),
        "tied": nn.Sequential(Tied(12), nn.ReLU()).double(),
    }


def sample(name: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = {"mlp": (n, 12), "conv": (n, 3, 5, 5), "attention": (n, 3, 8), "tied": (n, 12)}[name]
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def plain_backward(plain: nn.Module, xs, gs):
    dxs = []
    for x, g in zip(xs, gs):
        leaf = x.detach().clone().requires_grad_(True)
        torch.autograd.backward(plain(leaf), g)
        dxs.append(leaf.grad)
    return dxs, [p.grad.clone() for p in plain.parameters()]


@pytest.mark.parametrize("name", ["mlp", "conv", "attention", "tied"])
@pytest.mark.parametrize("recompute", [False, True])
def test_input_then_weight_half_equal_the_whole_backward(name, recompute):
    plain = slices()[name]
    stage = Stage(1, copy.deepcopy(plain), CPU, last=False)
    spec = StepSpec(grad=True, recompute=lambda i: recompute)
    xs = [sample(name, n, s) for n, s in ((4, 1), (3, 2))]
    outs = [stage.forward(i, x, spec)[0] for i, x in enumerate(xs)]
    g = torch.Generator().manual_seed(7)
    gs = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]
    expected_dx, expected_dw = plain_backward(plain, xs, gs)
    # I of both micro-batches first, as a zero-bubble schedule does: no parameter gradient yet
    dxs = [stage.backward_input(i, [gs[i]], spec) for i in range(2)]
    assert all(p.grad is None for p in stage.module.parameters())
    for dx, want in zip(dxs, expected_dx):
        assert (dx[0] - want).abs().max().item() < 1e-12
    for i in (1, 0):  # W in another order than I
        stage.backward_weight(i, spec)
    assert max_diff([p.grad for p in stage.module.parameters()], expected_dw) < 1e-12
    assert spec.saved[1] == {}


def test_the_weight_half_re_enters_the_graph_where_the_paths_part():
    plain = slices()["mlp"]
    x = sample("mlp", 4, 1).requires_grad_(True)
    out = plain(x)
    got, w = split.backward_input([(out, torch.ones_like(out))], [x], list(plain.parameters()), loss=False)
    # one split point per Linear (addmm: its weight side holds the weight and the bias), no whole-backward fallback
    assert w.whole is None and not w.roots
    assert len(w.points) == 3
    assert all(len(p.params) == 2 and p.below is None for p in w.points)  # each entered at the node
    assert got[0] is not None and all(p.grad is None for p in plain.parameters())
    w.run()
    assert all(p.grad is not None for p in plain.parameters())


def test_a_weight_used_twice_is_entered_below_its_outer_use():
    # lin(tanh(lin(x))): the outer addmm reaches the weight through both sides; W enters it below (at its weight
    # side's children) and the inner one at the node, so the inner use is counted once, without a whole backward
    torch.manual_seed(0)
    lin = nn.Linear(12, 12).double()
    x = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    out = lin(torch.tanh(lin(x)))
    g = torch.randn_like(out)
    got, w = split.backward_input([(out, g)], [x], list(lin.parameters()), loss=False)
    assert w.whole is None and len(w.points) == 2
    assert [p.below is not None for p in w.points] == [False, True]  # the inner use first (children first)
    w.run()
    plain = copy.deepcopy(lin)
    for p in plain.parameters():
        p.grad = None
    leaf = x.detach().clone().requires_grad_(True)
    plain(torch.tanh(plain(leaf))).backward(g)
    assert (got[0] - leaf.grad).abs().max().item() < 1e-12
    assert max_diff([p.grad for p in lin.parameters()], [p.grad for p in plain.parameters()]) < 1e-12


def test_a_first_stage_defers_its_whole_backward_to_the_weight_half():
    # stage 0 takes the batch itself: no input gradient to send, so the I half has nothing to compute
    plain = nn.Sequential(*list(make_mlp())[:3])
    stage = Stage(0, copy.deepcopy(plain), CPU, last=False)
    spec = StepSpec(grad=True)
    x, g = data(4)
    stage.forward(0, x, spec)
    assert stage.backward_input(0, [g], spec) == [None]
    assert all(p.grad is None for p in stage.module.parameters())
    stage.backward_weight(0, spec)
    torch.autograd.backward(plain(x), g)
    assert max_diff([p.grad for p in stage.module.parameters()], [p.grad for p in plain.parameters()]) < 1e-12


def test_the_last_stage_splits_the_backward_of_its_loss():
    plain = nn.Sequential(*list(make_mlp())[-3:])
    stage = Stage(2, copy.deepcopy(plain), CPU, last=True)
    x, y = data(5)
    spec = StepSpec(grad=True, loss_fn=LOSS, targets=[y], weights=[0.5])
    stage.forward(0, x, spec)
    dx = stage.backward_input(0, None, spec)
    stage.backward_weight(0, spec)
    leaf = x.detach().clone().requires_grad_(True)
    (LOSS(plain(leaf), y) * 0.5).backward()
    assert (dx[0] - leaf.grad).abs().max().item() < 1e-12
    assert max_diff([p.grad for p in stage.module.parameters()], [p.grad for p in plain.parameters()]) < 1e-12


def test_the_halves_in_the_wrong_order_or_twice_are_refused():
    stage = Stage(1, slices()["mlp"], CPU, last=False)
    spec = StepSpec(grad=True)
    out, _ = stage.forward(0, sample("mlp", 2, 1), spec)
    with pytest.raises(RuntimeError, match="before its input-gradient backward"):
        stage.backward_weight(0, spec)
    stage.backward_input(0, [torch.ones_like(out)], spec)
    with pytest.raises(RuntimeError, match="ran twice"):
        stage.backward_input(0, [torch.ones_like(out)], spec)
    stage.backward_weight(0, spec)
    with pytest.raises(RuntimeError, match="no saved forward"):
        stage.backward_weight(0, spec)
