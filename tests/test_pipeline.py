"""The single-process Pipeline against the plain model on one device."""

import copy
import gc
import time
import warnings

import pytest
import torch
from torch import nn

import pipeddp
from conftest import data, make_mlp, max_diff, reference_training

LOSS = nn.functional.mse_loss
DEVICES = {1: ["cpu"], 2: ["cpu", "cpu"], 3: ["cpu", "cpu", "cpu"]}


def batches(steps=3, n=10):
    return [data(n, seed=10 + i) for i in range(steps)]


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_train_step_equals_plain_training(stages, chunks, schedule, checkpoint):
    model = make_mlp()
    steps = batches()  # batch 10: uneven over 3 and 8 micro-batches
    ref_grads, ref_params = reference_training(model, steps, LOSS)
    with pipeddp.Pipeline(copy.deepcopy(model), DEVICES[stages], chunks=chunks, schedule=schedule,
                          checkpoint=checkpoint, balance="uniform") as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for (x, y), grads in zip(steps, ref_grads):
            opt.zero_grad()
            loss = pipe.train_step(x, y, LOSS)
            assert loss.requires_grad is False
            assert loss.item() == pytest.approx(LOSS(reference_model_output(pipe, x), y).item(), rel=1e-12)
            assert max_diff(grads, [p.grad for p in pipe.parameters()]) < 1e-12
            opt.step()
        assert max_diff(ref_params, list(pipe.parameters())) < 1e-12


def reference_model_output(pipe, x):
    with torch.no_grad():
        return pipe(x)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_call_and_backward_equal_plain(stages, checkpoint):
    model = make_mlp()
    x, y = data(11)
    x.requires_grad_(True)
    ref = copy.deepcopy(model)
    LOSS(ref(x), y).backward()
    ref_dx = x.grad.clone()
    x.grad = None
    with pipeddp.Pipeline(copy.deepcopy(model), DEVICES[stages], chunks=4, checkpoint=checkpoint) as pipe:
        out = pipe(x)
        assert out.shape == (11, 12)
        (LOSS(out, y) * 1.0).backward()
        assert max_diff([p.grad for p in ref.parameters()], [p.grad for p in pipe.parameters()]) < 1e-12
        assert (x.grad - ref_dx).abs().max().item() < 1e-12
        with pytest.raises(RuntimeError, match="twice"):
            out2 = pipe(x)
            l2 = out2.sum()
            l2.backward(retain_graph=True)
            l2.backward()


def test_batch_sizes_change_between_steps():
    # sizes seen before come back (a step's micro-batch layout is kept per batch size): each step's loss and
    # gradients are still its own batch's
    model = make_mlp()
    steps = [data(8, seed=1), data(4, seed=2), data(3, seed=3), data(10, seed=4), data(8, seed=5), data(3, seed=6)]
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with pipeddp.Pipeline(copy.deepcopy(model), DEVICES[2], chunks=4) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for x, y in steps:
            ref_opt.zero_grad()
            ref_loss = LOSS(ref(x), y)
            ref_loss.backward()
            opt.zero_grad()
            loss = pipe.train_step(x, y, LOSS)
            assert abs(loss.item() - ref_loss.item()) < 1e-12
            assert max_diff([p.grad for p in ref.parameters()], [p.grad for p in pipe.parameters()]) < 1e-12
            ref_opt.step()
            opt.step()
        assert max_diff(list(ref.parameters()), list(pipe.parameters())) < 1e-12


def test_split_size_instead_of_chunks():
    model = make_mlp()
    x, y = data(10)
    ref_grads, _ = reference_training(model, [(x, y)], LOSS)
    with pipeddp.Pipeline(copy.deepcopy(model), DEVICES[2], split_size=4, sample=x) as pipe:
        # profiled at the real micro-batch size: 4 samples of 12 float64 features out of the first layer
        assert pipe.partition.method == "time" and pipe.partition.layers[0].activation_bytes == 4 * 12 * 8
        pipe.train_step(x, y, LOSS)
        assert max_diff(ref_grads[0], [p.grad for p in pipe.parameters()]) < 1e-12


def test_chunks_do_not_change_gradients():
    model = make_mlp()
    x, y = data(16)
    grads = []
    for chunks in (1, 8):
        with pipeddp.Pipeline(copy.deepcopy(model), DEVICES[2], chunks=chunks) as pipe:
            pipe.train_step(x, y, LOSS)
            grads.append([p.grad for p in pipe.parameters()])
    assert max_diff(*grads) < 1e-12


def test_in_place_op_at_start_of_a_stage():
    # stage 1 begins with ReLU(inplace=True), as a cut inside torchvision's ResNet stem would
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 6), nn.ReLU(inplace=True),
                          nn.Linear(6, 3)).double()
    x = torch.randn(9, 6, dtype=torch.float64)
    y = torch.randn(9, 3, dtype=torch.float64)
    ref_grads, ref_params = reference_training(model, [(x, y)] * 3, LOSS)
    for checkpoint in ("never", "always"):
        with pipeddp.Pipeline(copy.deepcopy(model), DEVICES[3], balance=[1, 2, 2], chunks=3,
                              checkpoint=checkpoint) as pipe:
            assert [type(st.module[0]) for st in pipe.stages] == [nn.Linear, nn.ReLU, nn.ReLU]
            opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
            for (xb, yb), grads in zip([(x, y)] * 3, ref_grads):
                opt.zero_grad()
                pipe.train_step(xb, yb, LOSS)
                assert max_diff(grads, [p.grad for p in pipe.parameters()]) < 1e-12
                opt.step()
            assert max_diff(ref_params, list(pipe.parameters())) < 1e-12


def _dropout_run(checkpoint, schedule="1f1b", seed=123):
    model = make_mlp(dropout=0.3)
    torch.manual_seed(seed)
    with pipeddp.Pipeline(model, DEVICES[3], chunks=4, checkpoint=checkpoint, schedule=schedule) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = []
        for x, y in batches():
            opt.zero_grad()
            losses.append(pipe.train_step(x, y, LOSS).item())
            opt.step()
        return losses, [p.detach().clone() for p in pipe.parameters()]


def test_dropout_recompute_replays_the_same_masks():
    base_losses, base = _dropout_run("never")
    for checkpoint in ("always", "except_last"):
        losses, params = _dropout_run(checkpoint)
        assert losses == base_losses
        assert max_diff(base, params) == 0.0
    # and the masks really are random: another seed trains differently
    other_losses, _ = _dropout_run("never", seed=7)
    assert other_losses != base_losses


def test_dropout_is_inactive_in_eval():
    model = make_mlp(dropout=0.5)
    x, _ = data(6)
    ref = copy.deepcopy(model).eval()
    with pipeddp.Pipeline(model, DEVICES[2], chunks=3) as pipe:
        pipe.eval()
        with torch.no_grad():
            assert (pipe(x) - ref(x)).abs().max().item() < 1e-12


class Recorder(nn.Module):
    """Sleeps (releasing the GIL like a real kernel) so two stages can visibly overlap."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x * 1.0


def test_stages_really_run_concurrently():
    model = nn.Sequential(Recorder(0.03), Recorder(0.03))
    x = torch.randn(8, 2, requires_grad=True)
    with pipeddp.Pipeline(model, DEVICES[2], chunks=4, balance=[1, 1], trace=True) as pipe:
        pipe.train_step(x, torch.zeros(8, 2), LOSS)
        spans = [s for s in pipe.trace.spans if s.kind == "F"]
    f = {(s.stage, s.mb): s for s in spans}
    overlaps = [i for i in range(3)
                if f[(0, i + 1)].start < f[(1, i)].end and f[(1, i)].start < f[(0, i + 1)].end]
    assert overlaps, "stage 0 never worked on micro-batch i+1 while stage 1 worked on micro-batch i"
    # each (stage, micro-batch, F) exactly once
    assert sorted(f) == [(s, i) for s in range(2) for i in range(4)]


def test_state_dict_keys_are_the_plain_models():
    model = make_mlp()
    plain = copy.deepcopy(model)
    with pipeddp.Pipeline(copy.deepcopy(model), DEVICES[3], balance=[3, 4, 4]) as pipe:
        assert list(pipe.state_dict()) == list(plain.state_dict())
        for p in pipe.parameters():
            p.data.add_(1.0)
        plain.load_state_dict(pipe.state_dict())
        assert max_diff(list(plain.parameters()), list(pipe.parameters())) == 0
        other = pipeddp.Pipeline(make_mlp(seed=5), DEVICES[2], balance=[5, 6])
        other.load_state_dict(pipe.state_dict())
        assert max_diff(list(other.parameters()), list(pipe.parameters())) == 0
        other.close()


def test_workers_stop_on_close_and_on_collection():
    pipe = pipeddp.Pipeline(make_mlp(), DEVICES[2])
    threads = pipe.worker_threads
    assert all(t.is_alive() for t in threads)
    pipe.close()
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="closed"):
        pipe.train_step(*data(), LOSS)
    pipe = pipeddp.Pipeline(make_mlp(), DEVICES[2])
    threads = pipe.worker_threads
    del pipe
    gc.collect()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)


class Boom(nn.Module):
    def forward(self, x):
        raise ValueError("boom in stage 1")


def test_worker_error_reaches_the_caller_and_pipeline_recovers():
    model = nn.Sequential(nn.Linear(4, 4), Boom(), nn.Linear(4, 4))
    with pipeddp.Pipeline(model, DEVICES[3], chunks=4) as pipe:
        with pytest.raises(ValueError, match="boom in stage 1") as info:
            pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), LOSS)
        assert any("forward" in str(entry.name) for entry in info.traceback)
        pipe.stages[1].module[0] = nn.Identity()  # swap the broken layer out
        pipe.train_step(torch.randn(8, 4), torch.randn(8, 4), LOSS)


def test_bad_input_errors():
    model = make_mlp(depth=2)  # 3 layers
    with pytest.raises(ValueError, match="at most 3 stages"):
        pipeddp.Pipeline(model, ["cpu"] * 4)
    with pytest.raises(ValueError, match="sums to 2"):
        pipeddp.Pipeline(model, DEVICES[2], balance=[1, 1])
    with pytest.raises(ValueError, match="one entry per device"):
        pipeddp.Pipeline(model, DEVICES[2], balance=[1, 1, 1])
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        pipeddp.Pipeline(model, DEVICES[2], chunks=0)
    with pytest.raises(TypeError, match="nn.Sequential"):
        pipeddp.Pipeline(nn.Linear(2, 2), DEVICES[2])
    with pytest.raises(ValueError, match="does not exist"):
        pipeddp.Pipeline(model, ["cpu", "cuda:7"])
    with pytest.raises(ValueError, match="not a device"):
        pipeddp.Pipeline(model, ["cpu", "gpu0"])
    with pytest.raises(ValueError, match="checkpoint"):
        pipeddp.Pipeline(model, DEVICES[2], checkpoint="sometimes")
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        pipeddp.Pipeline(model, DEVICES[2], schedule="zigzag")
    with pytest.raises(ValueError, match="2 devices x 2 virtual stages"):
        pipeddp.Pipeline(model, DEVICES[2], schedule="interleaved")
    with pipeddp.Pipeline(model, DEVICES[2], chunks=2) as pipe:
        with pytest.raises(ValueError, match="empty batch"):
            pipe.train_step(torch.zeros(0, 12, dtype=torch.float64), torch.zeros(0, 12, dtype=torch.float64), LOSS)
        with pytest.raises(ValueError, match="y has 5"):
            pipe.train_step(torch.zeros(4, 12, dtype=torch.float64), torch.zeros(5, 12, dtype=torch.float64), LOSS)
        with pytest.raises(TypeError, match="cannot be moved"):
            pipe.to("cpu")
        with pytest.raises(ValueError, match="scalar"):
            pipe.train_step(*data(), lambda out, y: (out - y) ** 2)


class SlowCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        time.sleep(0.1)
        return x


def test_a_forward_only_call_stops_when_a_stage_fails():
    """Stage 0 only sends in a forward-only call, so nothing made it wait; it must still stop early."""
    counter = SlowCounter()
    model = nn.Sequential(counter, Boom())
    with pipeddp.Pipeline(model, DEVICES[2], chunks=8, balance=[1, 1]) as pipe:
        with torch.no_grad(), pytest.raises(ValueError, match="boom in stage 1"):
            pipe(torch.randn(8, 4))
    assert counter.calls <= 3, counter.calls  # before: all 8 micro-batches ran


def test_devices_auto_as_in_hybrid_parallel():
    """devices="auto" with stages=p picks what HybridParallel(devices="auto") picks: here (the suite hides the
    GPUs) the CPU p times; the pipeline it builds trains as the plain model does."""
    model = make_mlp()
    steps = batches(steps=1)
    ref_grads, _ = reference_training(model, steps, LOSS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no GPU at all: the CPU is what "auto" means, quietly (README)
        pipe = pipeddp.Pipeline(copy.deepcopy(model), "auto", stages=3, chunks=3, balance="uniform")
    with pipe:
        assert pipe.devices == [torch.device("cpu")] * 3 and len(pipe.balance) == 3
        (x, y), = steps
        pipe.train_step(x, y, LOSS)
        assert max_diff(ref_grads[0], [p.grad for p in pipe.parameters()]) < 1e-12
    with pipeddp.Pipeline(make_mlp(), ["cpu", "cpu"], stages=2) as pipe:  # stages= may repeat len(devices)
        assert len(pipe.balance) == 2


def test_devices_auto_errors_say_what_to_pass():
    with pytest.raises(ValueError, match=r"devices='auto' needs the number of stages.*stages=2"):
        pipeddp.Pipeline(make_mlp(), "auto")
    with pytest.raises(ValueError, match=r"stages=3 but 2 devices were given"):
        pipeddp.Pipeline(make_mlp(), ["cpu", "cpu"], stages=3)
    for bad in (0, True, "2"):  # checked as HybridParallel's stages are, with explicit devices too
        with pytest.raises(ValueError, match="stages must be an int >= 1"):
            pipeddp.Pipeline(make_mlp(), "auto", stages=bad)
        with pytest.raises(ValueError, match="stages must be an int >= 1"):
            pipeddp.Pipeline(make_mlp(), ["cpu"], stages=bad)
    with pytest.raises(TypeError, match="one device per stage"):
        pipeddp.Pipeline(make_mlp(), "cpu")  # a single device name is still not a list of devices


class InterruptOnce(nn.Module):
    """The identity, which on its ``at``-th call interrupts the caller's thread (Ctrl-C in a notebook) and then
    goes on computing for a while, as a stage in the middle of a long forward does."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.calls, self.at = 0, at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import _thread

        self.calls += 1
        if self.calls == self.at:
            _thread.interrupt_main()
            time.sleep(1.5)  # the caller has long given up on this step when this micro-batch's output leaves
        return x


@pytest.mark.timeout(120)
def test_the_step_after_an_interrupted_one_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), InterruptOnce(at=6), nn.Linear(12, 12), nn.Tanh(),
                          nn.Linear(12, 12)).double()
    plain = copy.deepcopy(model)
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=4, balance=[3, 3], schedule="gpipe") as pipe:
        pipe.train_step(*data(8, seed=1), LOSS)  # calls 1-4 of the layer
        with pytest.raises(KeyboardInterrupt):
            pipe.train_step(*data(8, seed=2), LOSS)  # interrupted at its second micro-batch
        for p in pipe.parameters():
            p.grad = None
        x, y = data(8, seed=3)
        pipe.train_step(x, y, LOSS)
        LOSS(plain(x), y).backward()
        assert max_diff([p.grad for p in pipe.parameters()], [p.grad for p in plain.parameters()]) < 1e-12


def test_a_training_step_keeps_no_output_of_the_last_stage():
    """train_step reads only the losses: no micro-batch's logits may outlive its backward, nor the step."""
    import gc

    width = 37  # the logits' last dimension, found nowhere else
    alive = []

    def count_logits():
        gc.collect()
        with warnings.catch_warnings():  # isinstance on every live object touches torch's deprecated aliases
            warnings.simplefilter("ignore", FutureWarning)
            return sum(1 for o in gc.get_objects()
                       if isinstance(o, torch.Tensor) and o.dim() == 2 and o.shape[1] == width)

    class Head(nn.Linear):
        def forward(self, x):
            out = super().forward(x)
            alive.append(count_logits())  # at each forward: what is still alive of the earlier micro-batches
            return out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), Head(12, width)).double()
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=4, balance=[2, 1], schedule="gpipe") as pipe:
        x = data(8)[0]
        y = torch.randn(8, width, dtype=torch.float64)
        before = count_logits()
        pipe.train_step(x, y, LOSS)
        assert count_logits() == before
    # GPipe runs every forward before any backward: each forward sees the earlier ones' logits still needed by
    # their losses' graphs (one each), but no second, detached copy kept as an output
    assert alive == [alive[0] + i for i in range(4)], alive
