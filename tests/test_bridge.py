"""``runtime._bridge``: ``out = pipe(x)`` wired into the caller's autograd graph, seen through ``Pipeline.__call__``."""

import copy

import pytest
import torch
from torch import nn

import pipeddp
from conftest import data, make_mlp, max_diff

CPU2 = ["cpu", "cpu"]
LOSS = nn.functional.mse_loss


def grads(module):
    return [p.grad for p in module.parameters()]


def test_backward_through_the_output_gives_the_plain_gradients():
    model = make_mlp()
    ref = copy.deepcopy(model)
    x, y = data(11)
    with pipeddp.Pipeline(model, CPU2, chunks=4, balance=[5, 6]) as pipe:
        xp = x.clone().requires_grad_(True)
        out = pipe(xp)
        assert out.shape == (11, 12) and out.requires_grad
        # the caller's graph goes on after the output, and x also reaches the loss another way
        loss = LOSS(out.tanh(), y) + 0.1 * (xp ** 2).sum()
        loss.backward()

        xr = x.clone().requires_grad_(True)
        ref_loss = LOSS(ref(xr).tanh(), y) + 0.1 * (xr ** 2).sum()
        ref_loss.backward()
        assert abs(loss.item() - ref_loss.item()) < 1e-12
        assert max_diff(grads(ref), grads(pipe)) < 1e-12
        assert (xp.grad - xr.grad).abs().max().item() < 1e-12


def test_input_without_grad_still_gives_parameter_gradients():
    model = make_mlp()
    ref = copy.deepcopy(model)
    x, y = data(7)
    with pipeddp.Pipeline(model, CPU2, chunks=3, balance=[4, 7]) as pipe:
        out = pipe(x)
        LOSS(out, y).backward()
        LOSS(ref(x), y).backward()
        assert x.grad is None
        assert max_diff(grads(ref), grads(pipe)) < 1e-12
        # a second call accumulates, as a second backward on the plain model does
        LOSS(pipe(x), y).backward()
        LOSS(ref(x), y).backward()
        assert max_diff(grads(ref), grads(pipe)) < 1e-12


def test_a_second_backward_through_the_same_output_raises():
    model = make_mlp()
    ref = copy.deepcopy(model)
    x, y = data(6)
    with pipeddp.Pipeline(model, CPU2, chunks=2) as pipe:
        loss = LOSS(pipe(x), y)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward ran twice through the same Pipeline output"):
            loss.backward()
        # the failed second backward added nothing
        LOSS(ref(x), y).backward()
        assert max_diff(grads(ref), grads(pipe)) < 1e-12


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_raises_the_higher_order_error_and_the_pipeline_goes_on():
    model = make_mlp()
    ref = copy.deepcopy(model)
    x, y = data(6)
    with pipeddp.Pipeline(model, CPU2, chunks=2) as pipe:
        loss = LOSS(pipe(x), y)
        with pytest.raises(RuntimeError, match=r"higher-order gradients \(create_graph=True\) .* not supported"):
            loss.backward(create_graph=True)
        for p in pipe.parameters():
            p.grad = None
        LOSS(pipe(x), y).backward()
        LOSS(ref(x), y).backward()
        assert max_diff(grads(ref), grads(pipe)) < 1e-12


class WithIndex(nn.Module):
    """Returns the activation, a second floating output and the argmax of each row (int64, no gradient)."""

    def forward(self, h):
        return h, 2 * h, h.argmax(dim=1)


def test_output_tuple_with_a_non_floating_tensor_passes_through():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 5), WithIndex()).double()
    ref = copy.deepcopy(model)
    x, _ = data(9)
    target = torch.randn(9, 5, dtype=torch.float64)
    with pipeddp.Pipeline(model, CPU2, chunks=4, balance=[2, 2]) as pipe:
        xp = x.clone().requires_grad_(True)
        h, h2, idx = pipe(xp)
        rh, rh2, ridx = ref(x)
        assert idx.dtype == torch.int64 and not idx.requires_grad
        # micro-batches against the whole batch: equal to float tolerance (a matrix product over 3 rows and
        # over 9 may round differently on another CPU), and the index output is that of the pipeline's own h
        assert (h - rh).abs().max().item() < 1e-12 and (h2 - rh2).abs().max().item() < 1e-12
        assert torch.equal(idx, h.argmax(dim=1)) and idx.shape == ridx.shape
        # only the first output takes part in the loss: the second one's gradient is absent
        LOSS(h, target).backward()
        xr = x.clone().requires_grad_(True)
        LOSS(ref(xr)[0], target).backward()
        assert max_diff(grads(ref), grads(pipe)) < 1e-12
        assert (xp.grad - xr.grad).abs().max().item() < 1e-12
