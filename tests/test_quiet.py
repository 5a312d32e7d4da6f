"""What a stage decides once a step (``runtime.quiet``) and its backward without torch's wrapper
(``runtime.autograd_call``), against the plain model and against ``torch.autograd.backward`` itself."""

import copy
import logging

from typing import List

import pytest
import torch
from conftest import CountOps
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import pipeddp
from pipeddp.runtime.autograd_call import backward
from pipeddp.runtime.quiet import read

LOSS = F.mse_loss


def plain_mlp(*middle: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), *middle, nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).double()


def batch(n: int = 6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(n, 4, generator=g, dtype=torch.float64)


def plain_grads(model: nn.Module, x, y, loss_fn=LOSS):
    model.zero_grad()
    loss_fn(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def pipe_steps(model: nn.Sequential, x, y, *, steps: int = 2, loss_fn=LOSS, checkpoint: str = "never", between=None):
    out = []
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=3, balance="uniform", checkpoint=checkpoint) as pipe:
        for step in range(steps):
            if between is not None:
                between(step, pipe)
            pipe.zero_grad()
            pipe.train_step(x, y, loss_fn)
            out.append([p.grad.clone() for p in pipe.parameters()])
    return out


def close(a, b, tol: float = 1e-12) -> bool:
    return all((p - q).abs().max() <= tol for p, q in zip(a, b))


@pytest.mark.timeout(60)
def test_layers_that_never_draw_leave_the_process_generator_as_the_plain_model_does():
    """torch's layers that draw nothing (dropout that is off among them) and torch's loss: no base seed is drawn, so
    the process's generator is where the plain model leaves it (before, every step drew one); the gradients are the
    plain model's. A dropout turned on draws again."""
    x, y = batch()
    plain = plain_mlp(nn.Dropout(0.0))
    state = torch.get_rng_state()
    want = plain_grads(plain, x, y)
    assert torch.equal(torch.get_rng_state(), state)  # the plain model draws nothing
    got = pipe_steps(copy.deepcopy(plain), x, y, steps=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(close(step, want) for step in got)

    def dropout_on(step, pipe):
        pipe.get_submodule("2").p = 0.5 if step == 1 else 0.0

    pipe_steps(copy.deepcopy(plain), x, y, steps=1, between=dropout_on)
    assert torch.equal(torch.get_rng_state(), state)
    pipe_steps(copy.deepcopy(plain), x, y, steps=2, between=dropout_on)
    assert not torch.equal(torch.get_rng_state(), state)  # the step with dropout on drew its base seed


class Noisy(nn.Module):
    """Draws noise in its forward (a layer of the user's: it may draw)."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x)


def noise_hook(module, args, output):
    return output * (1 + 0.1 * torch.rand_like(output))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["layer", "hook", "loss", "global hook"])
def test_whatever_may_draw_keeps_its_seeded_draws_under_recompute(where):
    """A layer of the user's, a forward hook on torch's Linear, a loss of the user's, a hook on every module: each
    may draw, so the stage keeps its seeded context and a recomputed forward draws the first forward's numbers
    (treated as drawing nothing, the replay would draw others and the gradients would differ)."""
    x, y = batch()
    loss_fn = LOSS
    if where == "loss":
        def loss_fn(out, target):
            return F.mse_loss(out + 0.1 * torch.randn_like(out), target)
    results = {}
    for checkpoint in ("never", "always"):
        torch.manual_seed(5)
        model = plain_mlp(Noisy()) if where == "layer" else plain_mlp()
        handle = None
        if where == "hook":
            model[3].register_forward_hook(noise_hook)
        elif where == "global hook":
            handle = nn.modules.module.register_module_forward_hook(
                lambda m, a, out: noise_hook(m, a, out) if isinstance(m, nn.Linear) else out)
        try:
            results[checkpoint] = pipe_steps(model, x, y, loss_fn=loss_fn, checkpoint=checkpoint)
        finally:
            if handle is not None:
                handle.remove()
    assert all(torch.equal(p, q) for a, b in zip(results["never"], results["always"]) for p, q in zip(a, b))
    assert not close(results["never"][0], results["never"][1], 1e-6)  # the draws are there: each step its own


@pytest.mark.timeout(60)
def test_hooks_added_between_steps_run_as_in_the_plain_model():
    """The layers are called by their forward where nothing hooks them; a hook put on a layer (or a pre-hook that
    changes its input) between steps runs from the next step on, as in the plain model, and a removed one stops."""
    x, y = batch()
    plain = plain_mlp()
    calls = {"plain": 0, "pipe": 0}

    def pre(module, args):
        return (args[0] * 0.5,)

    def counting(name):
        def hook(module, args, output):
            calls[name] += 1
        return hook

    want = [plain_grads(plain, x, y)]
    handles = [plain[2].register_forward_pre_hook(pre), plain[4].register_forward_hook(counting("plain"))]
    want.append(plain_grads(plain, x, y))
    for h in handles:
        h.remove()
    want.append(plain_grads(plain, x, y))
    held = []

    def between(step, pipe):
        if step == 1:
            held.extend([pipe.get_submodule("2").register_forward_pre_hook(pre),
                         pipe.get_submodule("4").register_forward_hook(counting("pipe"))])
        if step == 2:
            for h in held:
                h.remove()

    got = pipe_steps(copy.deepcopy(plain_mlp()), x, y, steps=3, between=between)
    assert all(close(g, w) for g, w in zip(got, want))
    assert not close(want[0], want[1], 1e-6)  # the pre-hook changed the step
    assert calls["plain"] == 1 and calls["pipe"] == 3  # one call per micro-batch, in the one step it was on


class AddsOne(nn.Module):
    """A layer of the user's: torch cannot tell whether its forward writes its input (this one does not)."""

    def forward(self, x):
        return x + 1


def test_a_stage_is_known_to_leave_its_input_alone_only_where_every_layer_is_one_of_torchs_that_does():
    layers = [nn.Linear(6, 6), nn.Tanh(), nn.Dropout(0.3), nn.LayerNorm(6)]
    assert read(nn.Sequential(*layers))[2] is False
    assert read(nn.Sequential(*layers, nn.ReLU(inplace=True)))[2] is True
    assert read(nn.Sequential(*layers, nn.Dropout(0.3, inplace=True)))[2] is True
    assert read(nn.Sequential(*layers, AddsOne()))[2] is True
    assert read(nn.Sequential(*layers, nn.Sequential(nn.Linear(6, 6))))[2] is True  # a container: not looked into
    hooked = nn.Sequential(*copy.deepcopy(layers))
    hooked[1].register_forward_pre_hook(lambda module, args: None)
    assert read(hooked)[2] is True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checkpoint,schedule", [("never", "1f1b"), ("always", "1f1b"), ("always", "zb")])
def test_stage_zero_copies_the_batch_only_where_a_layer_may_write_it(checkpoint, schedule):
    """The micro-batches are views of the user's batch: stage 0 gives its layers them as they are where every layer
    is one of torch's that writes nothing in place (no copy ran, for a forward that recompute replays too), and
    copies them where one may: a pre-hook that scales its input in place then trains as the plain model does (one
    batch, written once), where views written one after another would fail a backward (their version counter is
    shared), under recompute and a split backward too."""
    x, y = batch()
    plain = plain_mlp()
    with pipeddp.Pipeline(copy.deepcopy(plain), ["cpu"], chunks=3, checkpoint=checkpoint) as pipe:  # caller's thread
        with CountOps() as counted:
            pipe.train_step(x, y, LOSS)
        assert counted.ops["clone"] == 0, counted.ops
        assert close([p.grad for p in pipe.parameters()], plain_grads(plain, x, y))

    def halves(module, args):
        args[0].mul_(0.5)

    plain[0].register_forward_pre_hook(halves)
    want = plain_grads(plain, x.clone(), y)
    kept = x.clone()
    model = plain_mlp()
    model[0].register_forward_pre_hook(halves)
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=3, balance="uniform", checkpoint=checkpoint,
                          schedule=schedule) as pipe:
        pipe.train_step(x, y, LOSS)
        assert close([p.grad for p in pipe.parameters()], want)
    assert torch.equal(x, kept)  # the copies were written, not the user's batch


def leaf_grads(fn):
    torch.manual_seed(0)
    w = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    fn(w)
    return w.grad


@pytest.mark.timeout(30)
def test_backward_accumulates_what_torch_autograd_backward_does():
    """A scalar loss, given output gradients, two roots at once, and the cases that go through torch's own call
    (autograd's debug log on, a non-scalar root without its gradient, a gradient of another shape): the same
    ``.grad`` as ``torch.autograd.backward``, the same errors."""
    x = torch.randn(2, 4, dtype=torch.float64)
    g = torch.randn(2, 3, dtype=torch.float64)
    cases = {
        "loss": lambda bw: lambda w: bw([(x @ w).pow(2).sum()], None),
        "grads": lambda bw: lambda w: bw([x @ w], [g]),
        "two roots": lambda bw: lambda w: bw([x @ w, (x @ w).sum() * 2], [g, torch.ones((), dtype=torch.float64)]),
    }
    for name, case in cases.items():
        assert torch.equal(leaf_grads(case(backward)), leaf_grads(case(torch.autograd.backward))), name
    log = logging.getLogger("torch.autograd.graph")
    before = log.level
    log.setLevel(logging.DEBUG)
    try:
        assert torch.equal(leaf_grads(cases["loss"](backward)), leaf_grads(cases["loss"](torch.autograd.backward)))
    finally:
        log.setLevel(before)
    with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
        leaf_grads(lambda w: backward([x @ w], None))
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        leaf_grads(lambda w: backward([x @ w], [g[:1]]))


class Seen(TorchFunctionMode):
    """The torch functions called in its body, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: List[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["loss", "grads"])
def test_a_torch_function_mode_sees_the_backward_as_torchs_own_call_shows_it(case):
    """Under a ``TorchFunctionMode`` (a tracer's, a profiler's) the stage's backward goes through torch's own call,
    which hands the mode ``backward``, from a loss as from given gradients; the gradients are torch's."""
    x = torch.randn(2, 4, dtype=torch.float64)
    g = torch.randn(2, 3, dtype=torch.float64)

    def run(bw, w):
        with Seen() as seen:
            bw([(x @ w).pow(2).sum()], None) if case == "loss" else bw([x @ w], [g])
        return seen.names

    got, want = [], []
    assert torch.equal(leaf_grads(lambda w: got.extend(run(backward, w))),
                       leaf_grads(lambda w: want.extend(run(torch.autograd.backward, w))))
    assert "backward" in want and got == want


@pytest.mark.timeout(30)
def test_grad_and_edge_roots_give_what_torch_autograd_gives():
    """``grad`` (to a tensor, to an unreachable one, to a gradient edge) and ``backward`` from a gradient edge to
    chosen ``inputs`` (what a split backward's halves ask): the same gradients as ``torch.autograd.grad`` /
    ``torch.autograd.backward``, nothing accumulated by ``grad``; a gradient of the wrong shape for an edge gets
    torch's own error."""
    from torch.autograd.graph import GradientEdge

    from pipeddp.runtime.autograd_call import grad

    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    unused = torch.randn(2, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 3, dtype=torch.float64)

    def run(fn):
        y = torch.tanh(lin(x))
        node = y.grad_fn.next_functions[0][0]  # the Linear's addmm: gradient edges start there
        return fn(y, node)

    for ours, theirs in [
        (lambda y, _: grad([y], [g], [x, unused], keep_graph=False),
         lambda y, _: torch.autograd.grad([y], [x, unused], [g], allow_unused=True)),
        (lambda y, _: grad([y.sum()], None, [lin.weight, x]),
         lambda y, _: torch.autograd.grad([y.sum()], [lin.weight, x])),
        (lambda y, n: grad([GradientEdge(n, 0)], [g], [x, lin.bias]),
         lambda y, n: torch.autograd.grad([GradientEdge(n, 0)], [x, lin.bias], [g], allow_unused=True)),
    ]:
        got, want = run(ours), run(theirs)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))
        assert lin.weight.grad is None and x.grad is None
    weight_grads = []
    for fn in (lambda y, n: backward([GradientEdge(n, 0)], [g], [lin.weight], keep_graph=True),
               lambda y, n: torch.autograd.backward([GradientEdge(n, 0)], [g], inputs=[lin.weight])):
        lin.zero_grad(set_to_none=True)
        run(fn)
        assert lin.bias.grad is None and x.grad is None  # only what ``inputs`` names
        weight_grads.append(lin.weight.grad)
    assert torch.equal(weight_grads[0], weight_grads[1])
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        run(lambda y, n: grad([GradientEdge(n, 0)], [g[:1]], [x]))


@pytest.mark.timeout(30)
def test_a_split_backward_of_plain_layers_hands_autograd_its_work_directly(monkeypatch):
    """Both halves of a split backward over torch's layers go to autograd's engine without torch's wrappers (the
    wrappers replaced by ones that raise here), and still give the plain backward's gradients."""
    from pipeddp.runtime import split

    torch.manual_seed(0)
    model = plain_mlp()
    x, y = batch()
    want = plain_grads(model, x, y)
    inp = x.clone().requires_grad_()
    loss = LOSS(model(inp), y)
    model.zero_grad(set_to_none=True)

    def refused(*args, **kwargs):
        raise AssertionError("went through torch's wrapper")

    assert split._edges_supported()  # read off torch.autograd.backward's signature, before it is replaced
    monkeypatch.setattr(torch.autograd, "grad", refused)
    monkeypatch.setattr(torch.autograd, "backward", refused)
    got, weights = split.backward_input([(loss, None)], [inp], list(model.parameters()), loss=True)
    assert all(p.grad is None for p in model.parameters())
    weights.run()
    monkeypatch.undo()
    ref = x.clone().requires_grad_()
    torch.testing.assert_close(got[0], torch.autograd.grad(LOSS(model(ref), y), [ref])[0], rtol=0, atol=1e-12)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=1e-12)
