"""Losses over tokens: a loss_fn returning ``(total, count)`` trains the plain model's token mean, exactly, with
padding spread unevenly over micro-batches and replicas, in one process and in both multi-process modes."""

import copy

import pytest
import torch
from torch import nn

import pipeddp
from conftest import max_diff

VOCAB, WIDTH, LENGTH = 11, 8, 6


def lm(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                         nn.Tanh(), nn.Linear(WIDTH, VOCAB)).double()


def batch(n: int, seed: int):
    """Tokens and labels; each row keeps a random number (1 to LENGTH) of its first labels, the rest is padding
    (-100), so micro-batches and replicas count different numbers of tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    y = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
    for i, keep in enumerate(torch.randint(1, LENGTH + 1, (n,), generator=g).tolist()):
        y[i, keep:] = -100
    return x, y


def token_sum(logits, labels):
    """The micro-batch's summed loss and how many tokens it counted."""
    total = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return total, (labels != -100).sum()


def token_mean(logits, labels):
    """What the plain model trains: the mean over the whole batch's non-ignored tokens."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def plain_steps(batches, accumulate: int = 1):
    model = lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], []
    for k in range(0, len(batches), accumulate):
        opt.zero_grad()
        for x, y in batches[k:k + accumulate]:
            loss = token_mean(model(x), y)
            loss.backward()
            losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return losses, grads, model.state_dict()


def test_a_pipeline_trains_the_token_mean_of_the_whole_batch():
    batches = [batch(10, seed) for seed in range(3)]
    losses, grads, state = plain_steps(batches)
    with pipeddp.Pipeline(lm(), ["cpu", "cpu"], chunks=4, balance=[2, 4]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        for k, (x, y) in enumerate(batches):
            opt.zero_grad()
            loss = pipe.train_step(x, y, token_sum)
            assert abs(loss.item() - losses[k]) < 1e-12
            assert max_diff([p.grad for p in pipe.parameters()], grads[k]) < 1e-12
            opt.step()
        assert max_diff(list(pipe.state_dict().values()), list(state.values())) < 1e-12
        # the row-weighted mean of micro-batch means, what a mean loss_fn gives, is another model here
        x, y = batches[0]
        opt.zero_grad()
        rows = pipe.train_step(x, y, token_mean).item()
        opt.zero_grad()
        assert abs(rows - pipe.train_step(x, y, token_sum).item()) > 1e-3


def test_gradients_accumulated_over_calls_keep_each_calls_own_mean():
    batches = [batch(10, seed) for seed in range(4)]
    _, grads, _ = plain_steps(batches, accumulate=2)
    with pipeddp.Pipeline(lm(), ["cpu", "cpu"], chunks=3, balance=[3, 3]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        for k in range(2):
            opt.zero_grad()
            for x, y in batches[2 * k:2 * k + 2]:
                pipe.train_step(x, y, token_sum)
            assert max_diff([p.grad for p in pipe.parameters()], grads[k]) < 1e-12
            opt.step()


def test_gradients_zeroed_in_place_are_not_copied_and_still_train_the_token_mean():
    """After ``zero_grad(set_to_none=False)`` the step's gradients start at zero: nothing to keep apart (a copy of
    every gradient per step before), and the steps still equal the plain model's; a real accumulation is kept."""
    batches = [batch(10, seed) for seed in range(3)]
    losses, grads, state = plain_steps(batches)
    with pipeddp.Pipeline(lm(), ["cpu", "cpu"], chunks=4, balance=[2, 4]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
        kept = []
        begin = pipe._step.train  # what the step's baseline held, seen as its first pass starts
        pipe._step.train = lambda *a, **k: (kept.append(pipe._step.baseline.kept), begin(*a, **k))[1]
        for k, (x, y) in enumerate(batches):
            opt.zero_grad(set_to_none=False)
            assert abs(pipe.train_step(x, y, token_sum).item() - losses[k]) < 1e-12
            assert max_diff([p.grad for p in pipe.parameters()], grads[k]) < 1e-12
            opt.step()
        assert max_diff(list(pipe.state_dict().values()), list(state.values())) < 1e-12
        assert kept[0] is None and kept[1:] == [{}, {}]  # no gradient before the first; zeros after
        pipe.train_step(*batches[0], token_sum)  # accumulating onto real gradients: those are kept
        assert len(kept[-1]) == len(list(pipe.parameters()))


def test_a_loss_that_changes_kind_over_accumulated_gradients_is_refused():
    with pipeddp.Pipeline(lm(), ["cpu", "cpu"], chunks=2, balance=[3, 3]) as pipe:
        x, y = batch(6, 0)
        pipe.train_step(x, y, lambda out, t: token_mean(out, t))
        with pytest.raises(ValueError, match="Zero the gradients"):
            pipe.train_step(x, y, token_sum)
        for p in pipe.parameters():
            p.grad = None
        pipe.train_step(x, y, token_sum)  # after zeroing, it counts
        with pytest.raises(ValueError, match="one kind for every micro-batch"):
            mixed = iter([True, False, True, False])
            pipe.train_step(x, y, lambda out, t: token_sum(out, t) if next(mixed) else token_mean(out, t))


def counted_job(mode: str, batches):
    engine = pipeddp.HybridParallel(lm(), stages=2, mode=mode, chunks=3, balance=[2, 4])
    opt = torch.optim.SGD(engine.parameters(), lr=0.5)
    out = []
    for x, y in batches:
        r, per = engine.topology.replica, x.shape[0] // engine.topology.replicas
        opt.zero_grad()
        loss = engine.train_step(x[r * per:(r + 1) * per], y[r * per:(r + 1) * per], token_sum)
        out.append(loss.item())
        opt.step()
    state = engine.state_dict()
    engine.close()
    return out, state


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode,nprocs", [("stage", 4), ("replica", 2)])
def test_replicas_train_the_token_mean_of_the_global_batch(mode, nprocs):
    batches = [batch(12, seed) for seed in range(3)]  # replica 0 takes rows 0-5, replica 1 rows 6-11
    losses, _, state = plain_steps(batches)
    for got, got_state in pipeddp.spawn(counted_job, nprocs, args=(mode, batches), timeout=150):
        assert max(abs(a - b) for a, b in zip(got, losses)) < 1e-12
        assert max_diff([got_state[k] for k in state], list(state.values())) < 1e-12


def evaluate_job(batches):
    engine = pipeddp.HybridParallel(lm(), stages=2, mode="stage", chunks=3, balance=[2, 4])
    r = engine.topology.replica
    mine = [(x[r * 6:(r + 1) * 6], y[r * 6:(r + 1) * 6]) for x, y in batches]
    got = engine.evaluate(mine, lambda out, y: {"tokens": token_sum(out, y), "rows": token_mean(out, y)})
    engine.close()
    return got


@pytest.mark.timeout(180)
def test_evaluation_takes_the_same_pair():
    batches = [batch(12, seed) for seed in range(2)]
    model = lm()
    with torch.no_grad():
        tokens = torch.cat([y.flatten() for _, y in batches])
        logits = torch.cat([model(x).flatten(0, 1) for x, _ in batches])
        want = nn.functional.cross_entropy(logits, tokens, ignore_index=-100).item()
    for got in pipeddp.spawn(evaluate_job, 4, args=(batches,), timeout=150):
        assert abs(got["tokens"] - want) < 1e-12 and got["samples"] == 24
        assert abs(got["rows"] - want) > 1e-3  # a mean per batch, weighted by rows: another number


@pytest.mark.timeout(30)
def test_parameters_of_lists_what_module_parameters_yields():
    """The step's baseline lists its parameters by ``parameters_of``: each parameter once, a tied one (one object in
    two layers, a module used twice) included once, a layer whose weight was set to None skipped, exactly the set
    torch's ``Module.parameters()`` yields over the same modules."""
    from pipeddp.runtime.counted import parameters_of

    shared = nn.Linear(4, 4)
    inner = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), shared)
    tied = nn.Linear(4, 4)
    tied.weight = inner[0].weight
    a = nn.Sequential(inner, nn.ReLU(), tied)
    b = nn.Sequential(shared, nn.Linear(4, 2, bias=False))
    b[1].register_parameter("bias", None)
    got = parameters_of([a, b])
    want = {id(p): p for m in (a, b) for p in m.parameters()}
    assert len(got) == len({id(p) for p in got}) == len(want)
    assert {id(p) for p in got} == set(want)
