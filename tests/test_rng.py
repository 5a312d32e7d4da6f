"""Every random op replays under recompute, with no opt-in, and results do not depend on thread timing."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nccl_rules
import pipeddp

nccl_rules.install()  # point-to-point messages follow NCCL's rules in the spawned jobs too (see conftest)

LOSS = nn.functional.mse_loss


class FunctionalDropout(nn.Module):
    """Dropout written as a function call: no Dropout module for anyone to recognise."""

    def forward(self, x):
        return F.dropout(x, 0.3, training=self.training)


class Noise(nn.Module):
    def forward(self, x):
        return x + 0.1 * torch.rand_like(x) if self.training else x


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(dim, 2, dropout=0.5, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class Recorder(nn.Module):
    """Keeps the dropout mask it drew and whether the call was a recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def forward(self, x):
        keep = (F.dropout(torch.ones_like(x), 0.5, training=True) > 0)
        self.calls.append((pipeddp.is_recomputing(), keep.clone()))
        return x * keep


def random_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), FunctionalDropout(), Attention(8), Noise(), nn.Linear(8, 8), nn.Tanh(),
                         Attention(8), FunctionalDropout(), nn.Linear(8, 8)).double()


def batches(steps: int = 3):
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(6, 4, 8, generator=g, dtype=torch.float64),
             torch.randn(6, 4, 8, generator=g, dtype=torch.float64)) for _ in range(steps)]


def train(checkpoint: str, seed: int = 123, stages: int = 3):
    """Gradients of every step and the final weights, from a fixed seed."""
    model = random_model()  # seeds the weights itself
    torch.manual_seed(seed)  # the step seeds come from here
    grads = []
    with pipeddp.Pipeline(model, ["cpu"] * stages, chunks=3, checkpoint=checkpoint, balance="uniform") as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for x, y in batches():
            opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            grads.append([p.grad.clone() for p in pipe.parameters()])
            opt.step()
        return grads, [p.detach().clone() for p in pipe.parameters()]


def test_gradients_are_bit_identical_whatever_the_recompute_policy():
    base_grads, base = train("never")
    for checkpoint in ("except_last", "always"):
        grads, params = train(checkpoint)
        for step_a, step_b in zip(base_grads, grads):
            assert all(torch.equal(a, b) for a, b in zip(step_a, step_b)), checkpoint
        assert all(torch.equal(a, b) for a, b in zip(base, params)), checkpoint


def test_the_random_ops_really_draw():
    # the same seed again: the same result (thread timing does not matter) ...
    again, _ = train("always")
    base, _ = train("never")
    assert all(torch.equal(a, b) for a, b in zip(base[-1], again[-1]))
    # ... another seed: other masks and noise
    other, _ = train("never", seed=7)
    assert not all(torch.equal(a, b) for a, b in zip(base[-1], other[-1]))


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_the_recompute_sees_the_mask_of_the_first_forward(checkpoint):
    recorder = Recorder()
    model = nn.Sequential(nn.Linear(16, 16), recorder, nn.Linear(16, 16)).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=4, checkpoint=checkpoint, balance=[1, 2]) as pipe:
        pipe.train_step(x, torch.zeros(8, 16, dtype=torch.float64), LOSS)
    first = [mask for again, mask in recorder.calls if not again]
    replays = [mask for again, mask in recorder.calls if again]
    assert len(first) == 4 and len(replays) == (4 if checkpoint == "always" else 3)
    for i, mask in enumerate(replays):
        assert torch.equal(mask, first[i])  # the peer's bug: 40 of 128 elements differed
    assert not all(torch.equal(first[0], m) for m in first[1:])  # every micro-batch has a mask of its own
    assert pipeddp.is_recomputing() is False


def test_an_in_place_op_on_an_input_without_grad_runs_once_under_recompute():
    class AddsInPlace(nn.Module):
        def forward(self, pair):
            foo, bar = pair
            bar.add_(1)
            return foo * bar

    for checkpoint in ("never", "always"):
        foo = torch.ones(4, 3, dtype=torch.float64, requires_grad=True)
        bar = torch.ones(4, 3, dtype=torch.float64)
        with pipeddp.Pipeline(nn.Sequential(AddsInPlace()), ["cpu"], chunks=2, checkpoint=checkpoint) as pipe:
            pipe((foo, bar)).sum().backward()
        assert torch.equal(foo.grad, torch.full((4, 3), 2.0, dtype=torch.float64)), checkpoint  # 3 = ran twice


def random_grads_job(mode: str, checkpoint: str):
    """One step of the random model in HybridParallel; this process's gradients by name."""
    model = random_model()
    torch.manual_seed(5)
    kw = {"devices": ["cpu"] * 3} if mode == "replica" else {}
    with pipeddp.HybridParallel(model, stages=3, mode=mode, chunks=3, checkpoint=checkpoint, balance="uniform",
                                **kw) as engine:
        x, y = batches(1)[0]
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        return {n: p.grad.clone() for n, p in engine.named_parameters()}


@pytest.mark.timeout(120)
def test_random_layers_in_replica_and_stage_mode_match_across_checkpoint_policies():
    """The same replay in HybridParallel, one process (replica mode) or one process per stage: recompute does not
    change the result, bit for bit."""
    replica = [random_grads_job("replica", checkpoint) for checkpoint in ("never", "always")]
    stage = [{n: g for grads in pipeddp.spawn(random_grads_job, 3, args=("stage", checkpoint), timeout=100)
              for n, g in grads.items()} for checkpoint in ("never", "always")]
    for never, always in (replica, stage):
        assert never.keys() == always.keys() == set(n for n, _ in random_model().named_parameters())
        assert all(torch.equal(never[n], always[n]) for n in never)


class Records(nn.Module):
    """Multiplies by a weight and records, per call, (is_checkpointing(), is_recomputing()) under its name."""

    def __init__(self, name: str, calls: list) -> None:
        super().__init__()
        self.name, self.calls = name, calls
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=torch.float64))

    def forward(self, x):
        self.calls.append((self.name, pipeddp.is_checkpointing(), pipeddp.is_recomputing()))
        return x * self.scale


def recording_model(calls: list) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for name in "abcd":  # one recorder per stage: 2 devices, or 2 x 2 virtual stages
        layers += [nn.Linear(6, 6).double(), Records(name, calls)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb", "interleaved"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_is_checkpointing_tells_the_three_forwards_apart(schedule, checkpoint):
    """First forward of a dropped micro-batch: (True, False); its replay: (False, True); any other: (False, False).

    Every layer sees, per step, one first forward per micro-batch and one replay per dropped micro-batch
    (zero-bubble's I and W share one replay), and the gradients are those of the plain model."""
    chunks = 4
    dropped = {"never": 0, "except_last": chunks - 1, "always": chunks}[checkpoint]
    calls: list = []
    model = recording_model(calls)
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    LOSS(reference(x), y).backward()
    calls.clear()
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=chunks, schedule=schedule, checkpoint=checkpoint,
                          balance="uniform") as pipe:
        pipe.train_step(x, y, LOSS)
        for name in "abcd":
            mine = [(c, r) for n, c, r in calls if n == name]
            assert sorted(mine) == sorted([(False, False)] * (chunks - dropped) + [(True, False)] * dropped
                                          + [(False, True)] * dropped), (name, mine)
        assert max(float((p.grad - q.grad).abs().max()) for p, q in zip(pipe.parameters(), reference.parameters())) \
            < 1e-12
        calls.clear()
        with torch.no_grad():  # evaluation keeps nothing for backward: a normal forward
            pipe(x)
        assert {(c, r) for _, c, r in calls} == {(False, False)}
    assert (pipeddp.is_checkpointing(), pipeddp.is_recomputing()) == (False, False)  # the caller's thread


def test_is_checkpointing_in_a_module_call_and_backward():
    """pipe(x) then backward outside (the autograd bridge) marks its forwards the same way."""
    calls: list = []
    with pipeddp.Pipeline(recording_model(calls), ["cpu", "cpu"], chunks=4, checkpoint="always",
                          balance="uniform") as pipe:
        pipe(torch.randn(8, 6, dtype=torch.float64)).sum().backward()
    for name in "abcd":
        assert sorted((c, r) for n, c, r in calls if n == name) == [(False, True)] * 4 + [(True, False)] * 4


class Augmenting(torch.utils.data.Dataset):
    """A dataset that draws from the CPU generator while it loads (a random crop or flip would)."""

    def __len__(self) -> int:
        return 240

    def __getitem__(self, i: int):
        x = torch.randn(16, dtype=torch.float64) + 0.01 * torch.rand(200).sum().item()
        return x, torch.zeros(16, dtype=torch.float64)


@pytest.mark.timeout(120)
def test_the_recompute_replays_its_masks_while_the_prefetch_thread_draws():
    """pipeddp's own prefetch thread runs a dataset that draws: every replay must see the first forward's mask."""
    recorder = Recorder()
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), recorder, nn.Linear(16, 16)).double()
    loader = pipeddp.data.loader(Augmenting(), 8, replicas=1, replica=0, prefetch=2)
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=4, checkpoint="always", balance=[2, 2]) as pipe:
        for x, y in loader:
            pipe.train_step(x, y, LOSS)
    first = [mask for again, mask in recorder.calls if not again]
    replays = [mask for again, mask in recorder.calls if again]
    assert len(first) == len(replays) == 120  # 30 steps x 4 micro-batches
    assert sum(not torch.equal(a, b) for a, b in zip(first, replays)) == 0


class DrawProbe(nn.Module):
    """Dropout, and where this thread's random ops drew from while it ran: the stage's own generator (handed to
    them) or the process's."""

    def __init__(self) -> None:
        super().__init__()
        self.own = []

    def forward(self, x):
        from pipeddp.runtime import draws

        self.own.append(getattr(draws._state, "generator", None) is not None)
        return F.dropout(x, 0.5, training=self.training)


def test_cpu_stages_draw_from_their_own_generators_from_the_first_forward():
    """Every forward of a CPU stage, the first ones and the replays included, draws from a generator of its own, so
    two stages with dropout never take turns on the process generator's lock."""
    probes = [DrawProbe(), DrawProbe()]
    model = nn.Sequential(nn.Linear(8, 8), probes[0], nn.Linear(8, 8), probes[1]).double()
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=4, balance=[2, 2], checkpoint="always") as pipe:
        for _ in range(3):
            pipe.train_step(x, y, LOSS)
    for probe in probes:
        assert len(probe.own) == 24 and all(probe.own)


@pytest.mark.timeout(120)
def test_a_thread_drawing_from_the_process_generator_does_not_shift_a_stage_s_masks():
    """A thread pipeddp does not own draws from the CPU generator all through the steps: every replay still sees
    its first forward's mask (the step's base seed is drawn from that generator, so the thread moves the masks
    themselves, as ``torch.manual_seed`` does, but no longer splits a micro-batch from its replay)."""
    import threading

    recorder = Recorder()
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), recorder, nn.Linear(16, 16)).double()
    stop, draws = threading.Event(), [0]

    def draw():
        while not stop.is_set():
            torch.rand(64)
            draws[0] += 1

    noise = threading.Thread(target=draw, daemon=True)
    noise.start()
    try:
        with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=4, checkpoint="always", balance=[2, 2]) as pipe:
            for _ in range(30):
                x = torch.randn(8, 16, dtype=torch.float64)
                pipe.train_step(x, x, LOSS)
    finally:
        stop.set()
        noise.join()
    first = [mask for again, mask in recorder.calls if not again]
    replays = [mask for again, mask in recorder.calls if again]
    assert draws[0] > 10 and len(first) == len(replays) == 120  # the thread did draw meanwhile
    assert sum(not torch.equal(a, b) for a, b in zip(first, replays)) == 0  # the first forwards too


class SelfCheckpointed(nn.Module):
    """A layer that checkpoints itself with torch.utils.checkpoint (which stashes the process's generator state to
    replay the layer in backward), or the same layer run plainly."""

    def __init__(self, itself: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.itself = itself

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        def run(t):
            return F.dropout(self.lin(t), 0.5, training=self.training)

        return checkpoint(run, x, use_reentrant=False) if self.itself else run(x)


def test_a_layer_that_checkpoints_itself_keeps_the_process_generator_and_replays_exactly():
    """Its replay in backward draws from the process's generator as stashed: the stage keeps that generator (an
    own one would make the replay draw other numbers), and the gradients are those of the plain layer."""
    def grads(itself: bool, checkpoint: str):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), SelfCheckpointed(itself), nn.Tanh(), SelfCheckpointed(itself)).double()
        x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
        torch.manual_seed(9)
        with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=2, balance=[2, 2], checkpoint=checkpoint) as pipe:
            out = []
            for _ in range(3):
                pipe.zero_grad()
                pipe.train_step(x, y, LOSS)
                out.append([p.grad.clone() for p in pipe.parameters()])
            keeps = [st.replay._keeps for st in pipe.stages]
        return out, keeps

    plain, keeps = grads(False, "never")
    assert keeps == [{(True, True): False}, {(True, True): False}]  # plain dropout: generators of their own
    for checkpoint in ("never", "always"):
        got, keeps = grads(True, checkpoint)
        assert keeps == [{(True, True): True}, {(True, True): True}]  # they read the generator: the process's
        assert all(torch.equal(a, b) for step, other in zip(plain, got) for a, b in zip(step, other)), checkpoint


class Drawn(nn.Module):
    """Noise from the random ops that take no generator (``randn_like``, ``rand``, ``randint``, ``randperm``)."""

    def forward(self, x):
        if not self.training:
            return x
        noise = torch.randn_like(x) + torch.rand(x.shape[-1], dtype=x.dtype)
        return x[:, torch.randperm(x.shape[1])] * (1 + 0.1 * noise) + torch.randint(0, 3, x.shape).to(x.dtype)


def grads_of(model_fn, checkpoint: str, steps: int = 3, between=None, chunks: int = 3, dtype=torch.float64):
    """The gradients of each step of ``model_fn()`` on two CPU stages; ``between(step, model)`` runs before each."""
    model = model_fn()
    x, y = (t.to(dtype) for t in batches(1)[0])
    out = []
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=chunks, checkpoint=checkpoint, balance="uniform") as pipe:
        for step in range(steps):
            if between is not None:
                between(step, model)
            pipe.zero_grad()
            pipe.train_step(x, y, LOSS)
            out.append([p.grad.clone() for p in pipe.parameters()])
    return out


def bitwise(a, b) -> bool:
    return all(torch.equal(p, q) for step_a, step_b in zip(a, b) for p, q in zip(step_a, step_b))


@pytest.mark.timeout(120)
def test_ops_without_a_generator_replay_exactly_while_a_thread_draws_from_the_process_generator(monkeypatch):
    """A thread draws from the process's generator in a tight loop all through: the gradients under recompute are
    those without it, bit for bit, from the first step (before: 22 of 24 replays differed). The steps' base seeds,
    which come from that generator, are fixed here: only the replays are under test."""
    import threading

    from pipeddp.runtime import step as step_module

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), Drawn(), nn.Tanh(), nn.Linear(8, 8), Drawn(), nn.Linear(8, 8)).double()

    stop = threading.Event()

    def draw():
        while not stop.is_set():
            torch.rand(64)
            torch.randn(3, 3).normal_()

    results = {}
    for checkpoint in ("never", "always"):
        seeds = iter(range(1000, 1100))
        monkeypatch.setattr(step_module, "draw_base_seed", lambda seeds=seeds: next(seeds))
        built = model()  # before the thread starts: the weights come from the process's generator too
        noise = threading.Thread(target=draw, daemon=True)
        noise.start()
        try:
            results[checkpoint] = grads_of(lambda built=built: built, checkpoint)
        finally:
            stop.set()
            noise.join()
            stop.clear()
    assert bitwise(results["never"], results["always"])


class HostNoise(nn.Module):
    """Noise drawn with NumPy's and Python's global generators (as Wav2Vec2's SpecAugment masks are)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def forward(self, x):
        import random

        import numpy as np

        noise = torch.from_numpy(np.random.rand(*x.shape)) * random.random()
        self.calls.append((pipeddp.is_recomputing(), noise))
        return x + noise


def test_numpy_and_python_random_replay_under_recompute():
    """A stage that draws from NumPy's and Python's generators: each replay draws its first forward's numbers (before:
    every one differed), and the gradients are those without recompute, bit for bit."""
    import random

    import numpy as np

    def model(noise: HostNoise) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), noise, nn.Linear(8, 8)).double()

    results, layers = {}, {}
    for checkpoint in ("never", "always", "except_last"):
        np.random.seed(3)
        random.seed(3)
        layers[checkpoint] = noise = HostNoise()
        results[checkpoint] = grads_of(lambda noise=noise: model(noise), checkpoint, steps=2)
    first = [noise for again, noise in layers["always"].calls if not again]
    replays = [noise for again, noise in layers["always"].calls if again]
    assert len(first) == len(replays) == 6 and all(torch.equal(a, b) for a, b in zip(first, replays))
    assert bitwise(results["never"], results["always"]) and bitwise(results["never"], results["except_last"])


def test_a_dropout_raised_from_zero_later_is_seeded_and_replayed():
    """A dropout probability raised from 0 after two steps (a schedule on dropout): the gradients under recompute are
    those without it, bit for bit, every step (before: 3.6e-2 off once the masks began)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(0.0)).double()

    def schedule(step, model):
        for layer in model:
            if isinstance(layer, nn.Dropout):
                layer.p = 0.0 if step < 2 else 0.4

    results = {}
    for checkpoint in ("never", "always"):
        torch.manual_seed(11)
        results[checkpoint] = grads_of(model, checkpoint, steps=4, between=schedule)
    assert not bitwise(results["never"][2:], results["never"][1:2] * 2)  # the masks did begin
    assert bitwise(results["never"], results["always"])


def test_an_lstm_replays_bit_for_bit():
    """A float32 LSTM: the first forward of a dropped micro-batch runs with grad, as its replay does (without grad
    oneDNN's inference kernel runs, 3e-8 off the training one), so recompute changes no bit."""
    class LastOutput(nn.Module):
        def forward(self, pair):
            return pair[0]

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.LSTM(8, 8, num_layers=2, dropout=0.3, batch_first=True),
                             LastOutput(), nn.Linear(8, 8))

    results = {}
    for checkpoint in ("never", "always"):
        torch.manual_seed(11)
        results[checkpoint] = grads_of(model, checkpoint, steps=2, chunks=2, dtype=torch.float32)
    assert bitwise(results["never"], results["always"])
