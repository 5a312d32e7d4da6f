"""``runtime.executor``: one stage's action list over in-memory channels, the worker threads, the threaded runner."""

import copy
import sys
import threading
import time
import traceback

import pytest
import torch
from torch import nn

from conftest import data, make_mlp, max_diff
from pipeddp.runtime.channels import Channel, Inbox, PipelineAborted
from pipeddp.runtime.executor import Device, ThreadRunner, Workers, run_actions
from pipeddp.runtime.microbatch import split, split_sizes
from pipeddp.runtime.schedule import Action, gpipe, one_f_one_b
from pipeddp.runtime.slicing import build_stages
from pipeddp.runtime.stage import Stage, StepSpec

CPU = torch.device("cpu")
LOSS = nn.functional.mse_loss
notes = pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes (add_note) need Python 3.11")


class FakeChannel:
    """A ``Channel`` in memory: ``recv`` hands out what the test stored, ``send`` keeps what the stage sent.

    Every call is appended to the shared ``log`` as ``(name, "send" | "recv", kind, mb)``; the receiving
    stage of each message is checked against ``expect_stage`` (the stage the channel serves).
    """

    def __init__(self, name, log, incoming=None, fail=None, on_send=None, stages=None):
        self.name = name
        self.stages = stages  # {"F": stage, "B": stage}: which stage each kind of message names
        self.log = log
        self.incoming = dict(incoming or {})
        self.sent = {}
        self.fail = fail
        self.on_send = on_send

    def _check(self, kind, stage):
        if self.stages is not None and kind in self.stages:
            assert stage == self.stages[kind], (self.name, kind, stage)

    def send(self, kind, stage, mb, value):
        self._check(kind, stage)
        self.log.append((self.name, "send", kind, mb))
        self.sent[(kind, mb)] = value
        if self.on_send is not None:
            self.on_send(kind, mb)

    def recv(self, kind, stage, mb):
        self._check(kind, stage)
        self.log.append((self.name, "recv", kind, mb))
        if self.fail == (kind, mb):
            raise ConnectionError(f"the peer sent no {kind}{mb}")
        return self.incoming.pop((kind, mb))


def channels(log, **kw):
    """Two fake channels typed as the executor sees them."""
    prev: Channel = FakeChannel("prev", log, **kw.get("prev", {}))
    nxt: Channel = FakeChannel("next", log, **kw.get("next", {}))
    return prev, nxt


def run_stage(stage, actions, spec, *, prev=None, next=None, **kw):
    """``run_actions`` for one stage on a device of its own, in a pipeline of one stage per device."""
    n = stage.index + (1 if stage.last else 2)
    links = {}
    if prev is not None:
        prev.stages = {"F": stage.index, "B": stage.index - 1}  # receives its input, sends its input's gradient
        links[stage.index - 1] = prev
    if next is not None:
        next.stages = {"F": stage.index + 1, "B": stage.index}  # sends its output, receives its output's gradient
        links[stage.index + 1] = next
    device = Device(stage.index, n, n, {stage.index: stage})
    return run_actions(device, [a._replace(stage=stage.index) for a in actions], spec, links=links, **kw)


def micro_batches(sizes, seed):
    x, g = data(sum(sizes), seed=seed)
    return list(x.split(sizes)), list(g.split(sizes))


def test_run_actions_runs_the_list_in_order_and_sends_what_it_computes():
    part = nn.Sequential(*list(make_mlp())[3:8])
    stage = Stage(1, copy.deepcopy(part), CPU, last=False)
    sizes = [3, 3, 2, 2]
    xs, gs = micro_batches(sizes, seed=3)
    actions = one_f_one_b(3, 4)[1]
    assert [str(a) for a in actions] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    log = []
    prev, nxt = channels(log, prev={"incoming": {("F", i): x for i, x in enumerate(xs)}},
                         next={"incoming": {("B", i): [g] for i, g in enumerate(gs)}})
    results = run_stage(stage, actions, StepSpec(grad=True), prev=prev, next=nxt)

    expected_log = []
    for a in actions:
        if a.kind == "F":
            expected_log += [("prev", "recv", "F", a.mb), ("next", "send", "F", a.mb)]
        else:
            expected_log += [("next", "recv", "B", a.mb), ("prev", "send", "B", a.mb)]
    assert log == expected_log
    assert not prev.incoming and not nxt.incoming  # every stored value was consumed
    for i, (x, g) in enumerate(zip(xs, gs)):
        assert torch.equal(nxt.sent[("F", i)], part(x))
        leaf = x.detach().clone().requires_grad_(True)
        torch.autograd.backward(part(leaf), g)
        (sent_grad,) = prev.sent[("B", i)]
        assert (sent_grad - leaf.grad).abs().max().item() < 1e-12
    assert max_diff([p.grad for p in part.parameters()], [p.grad for p in stage.module.parameters()]) < 1e-12
    # a middle stage keeps nothing for the caller
    assert results.outputs == {} and results.losses == {} and results.input_grads == {}


def test_first_and_last_stage_take_inputs_and_return_losses_and_input_grads():
    model = make_mlp()
    first_part, last_part = nn.Sequential(*list(model)[:5]), nn.Sequential(*list(model)[5:])
    first = Stage(0, copy.deepcopy(first_part), CPU, last=False)
    last = Stage(1, copy.deepcopy(last_part), CPU, last=True)
    x, y = data(10)
    x.requires_grad_(True)
    sizes = split_sizes(10, 3)
    xs, ys = split(x, sizes), split(y, sizes)
    weights = [n / 10 for n in sizes]
    spec = StepSpec(grad=True, loss_fn=LOSS, targets=ys, weights=weights)
    rows = gpipe(2, 3)

    log = []
    # the last stage first: it receives the first stage's activations (computed here on the plain slice)
    acts = {("F", i): first_part(xi).detach() for i, xi in enumerate(xs)}
    to_first, _ = channels(log, prev={"incoming": acts})
    res_last = run_stage(last, rows[1], spec, prev=to_first, next=None)
    assert res_last.outputs == {} and sorted(res_last.losses) == [0, 1, 2]  # a loss step keeps no output
    for i in range(3):
        ref = weights[i] * LOSS(last_part(acts[("F", i)]), ys[i])
        assert abs(res_last.losses[i].item() - ref.item()) < 1e-15
    # ... and the first stage gets the gradients the last one sent back
    _, to_last = channels(log, next={"incoming": {("B", i): to_first.sent[("B", i)] for i in range(3)}})
    res_first = run_stage(first, rows[0], spec, prev=None, next=to_last, inputs=xs)
    assert res_first.outputs == {} and res_first.losses == {}
    assert all(torch.equal(to_last.sent[("F", i)], acts[("F", i)]) for i in range(3))

    ref_model = copy.deepcopy(model)
    ref_x = x.detach().clone().requires_grad_(True)
    LOSS(ref_model(ref_x), y).backward()
    got = [p.grad for p in first.module.parameters()] + [p.grad for p in last.module.parameters()]
    assert max_diff([p.grad for p in ref_model.parameters()], got) < 1e-12
    dx = torch.cat([res_first.input_grads[i][0] for i in range(3)])
    assert (dx - ref_x.grad).abs().max().item() < 1e-12
    assert x.grad is None  # the caller's tensor is not touched: its gradient is returned


def test_last_stage_without_loss_starts_from_the_given_output_gradients():
    part = nn.Sequential(*list(make_mlp())[7:])
    stage = Stage(1, copy.deepcopy(part), CPU, last=True)
    xs, gs = micro_batches([2, 2], seed=5)
    log = []
    prev, _ = channels(log, prev={"incoming": {("F", i): x for i, x in enumerate(xs)}})
    res = run_stage(stage, gpipe(2, 2)[1], StepSpec(grad=True), prev=prev, next=None,
                      output_grads=[[g] for g in gs])
    assert res.losses == {}
    for x, g in zip(xs, gs):
        torch.autograd.backward(part(x), g)
    assert max_diff([p.grad for p in part.parameters()], [p.grad for p in stage.module.parameters()]) < 1e-12


class FailOn(nn.Module):
    """Raises in the forward of a micro-batch of ``size`` samples."""

    def __init__(self, size):
        super().__init__()
        self.size = size
        self.armed = True

    def forward(self, x):
        if self.armed and x.shape[0] == self.size:
            raise ValueError(f"bad micro-batch of {self.size}")
        return x


@notes
def test_an_error_in_forward_keeps_its_type_and_names_rank_stage_and_action():
    stage = Stage(1, nn.Sequential(nn.Linear(12, 12).double(), FailOn(2)), CPU, last=False)
    xs, _ = micro_batches([4, 3, 2, 1], seed=2)
    log = []
    prev, nxt = channels(log, prev={"incoming": {("F", i): x for i, x in enumerate(xs)}},
                         next={"incoming": {("B", i): [torch.ones(4 - i, 12, dtype=torch.float64)] for i in range(4)}})
    with pytest.raises(ValueError, match="bad micro-batch of 2") as info:
        run_stage(stage, one_f_one_b(3, 4)[1], StepSpec(grad=True), prev=prev, next=nxt, rank=7)
    assert type(info.value) is ValueError
    assert info.value.__notes__ == ["pipeddp: rank 7, stage 1, while running F2 (forward of micro-batch 2)"]
    # the traceback still reaches the layer that raised
    assert "forward" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)][-1:]
    assert log[-1] == ("prev", "recv", "F", 2)  # nothing was sent for the failed micro-batch


@notes
def test_an_error_in_a_receive_names_the_backward_it_interrupted():
    stage = Stage(2, nn.Sequential(nn.Linear(12, 12).double()), CPU, last=False)
    xs, gs = micro_batches([3, 3, 3], seed=4)
    log = []
    prev, nxt = channels(log, prev={"incoming": {("F", i): x for i, x in enumerate(xs)}},
                         next={"incoming": {("B", i): [g] for i, g in enumerate(gs)}, "fail": ("B", 1)})
    with pytest.raises(ConnectionError) as info:
        run_stage(stage, gpipe(4, 3)[2], StepSpec(grad=True), prev=prev, next=nxt, rank=3)
    assert type(info.value) is ConnectionError
    assert info.value.__notes__ == ["pipeddp: rank 3, stage 2, while running B1 (backward of micro-batch 1)"]


def test_a_set_stop_event_ends_the_list_before_the_next_action():
    stage = Stage(0, nn.Sequential(nn.Linear(12, 12).double()), CPU, last=False)
    xs, _ = micro_batches([2, 2, 2], seed=6)
    stop = threading.Event()
    log = []
    _, nxt = channels(log, next={"on_send": lambda kind, mb: stop.set() if mb == 1 else None})
    with pytest.raises(PipelineAborted, match="device 0 stopped before F2@s0 because another stage failed"):
        run_stage(stage, [Action("F", i) for i in range(3)], StepSpec(grad=False), prev=None, next=nxt,
                    inputs=xs, stop=stop)
    assert log == [("next", "send", "F", 0), ("next", "send", "F", 1)]


@notes
def test_a_stop_is_not_reported_as_interrupting_the_finished_action():
    stage = Stage(0, nn.Sequential(nn.Linear(12, 12).double()), CPU, last=False)
    xs, _ = micro_batches([2, 2, 2], seed=6)
    stop = threading.Event()
    _, nxt = channels([], next={"on_send": lambda kind, mb: stop.set() if mb == 1 else None})
    with pytest.raises(PipelineAborted) as info:
        run_stage(stage, [Action("F", i) for i in range(3)], StepSpec(grad=False), prev=None, next=nxt,
                    inputs=xs, stop=stop)
    assert not any("while running F1" in n for n in getattr(info.value, "__notes__", []))


# -- Workers ---------------------------------------------------------------------------------------------------


def never_called(exc):
    raise AssertionError(f"on_error called with {exc!r}")


def test_workers_run_each_function_on_its_own_thread():
    workers = Workers(3, threads=1, name="pipeddp-test")
    try:
        threads = workers.threads
        assert [t.name for t in threads] == ["pipeddp-test-stage0", "pipeddp-test-stage1", "pipeddp-test-stage2"]
        assert len(workers) == 3 and all(t.daemon and t.is_alive() for t in threads)

        def probe(i):
            return lambda: (i, threading.current_thread(), torch.is_grad_enabled(), torch.get_num_threads())

        out = workers.run([probe(i) for i in range(3)], never_called)
        assert [o[0] for o in out] == [0, 1, 2]
        assert [o[1] for o in out] == threads
        assert all(o[2] for o in out) and all(o[3] == 1 for o in out)
        with torch.no_grad():  # the caller's grad mode reaches the workers
            assert [o[2] for o in workers.run([probe(i) for i in range(3)], never_called)] == [False] * 3
        # the same threads serve every run
        assert [o[1] for o in workers.run([probe(i) for i in range(3)], never_called)] == threads
    finally:
        workers.close()


def test_workers_reraise_the_real_error_after_waking_the_waiters():
    workers = Workers(2, name="pipeddp-test")
    inbox = Inbox(0)
    real = ValueError("stage 1 failed")
    seen = []

    def waiting():  # blocks until on_error aborts the inbox
        return inbox.take(("B", 0, 0), 60.0, 1)

    def failing():
        time.sleep(0.1)
        raise real

    def on_error(exc):
        seen.append(exc)
        inbox.abort(exc)

    try:
        began = time.monotonic()
        with pytest.raises(ValueError) as info:
            workers.run([waiting, failing], on_error)
        assert time.monotonic() - began < 30
        assert info.value is real
        assert seen == [real]
    finally:
        workers.close()


def test_workers_prefer_a_real_error_to_an_earlier_pipeline_aborted():
    workers = Workers(3, name="pipeddp-test")
    real = KeyError("late")
    seen = []

    def aborted():
        raise PipelineAborted("stopped")

    def late():
        time.sleep(0.3)
        raise real

    try:
        with pytest.raises(KeyError) as info:
            workers.run([aborted, late, lambda: 3], seen.append)
        assert info.value is real
        assert len(seen) == 1 and type(seen[0]) is PipelineAborted  # on_error had the first failure
        # only aborts: the first of them is raised
        with pytest.raises(PipelineAborted, match="stopped"):
            workers.run([aborted, lambda: 1, aborted], lambda exc: None)
        assert workers.run([lambda: 1, lambda: 2, lambda: 3], never_called) == [1, 2, 3]  # still usable
    finally:
        workers.close()


def test_workers_run_the_first_function_on_the_caller_when_asked():
    """``caller_first``: the first job on the calling thread, the others on their workers; the caller's failure
    wakes a worker waiting on it and is raised, and the workers serve the next run."""
    workers = Workers(2, name="pipeddp-test")
    inbox = Inbox(0)
    real = ValueError("the caller's stage failed")

    def failing():
        time.sleep(0.1)
        raise real

    try:
        out = workers.run([threading.current_thread, threading.current_thread], never_called, caller_first=True)
        assert out == [threading.main_thread(), workers.threads[1]]
        with pytest.raises(ValueError) as info:
            workers.run([failing, lambda: inbox.take(("B", 0, 0), 60.0, 1)], inbox.abort, caller_first=True)
        assert info.value is real
        assert workers.run([lambda: 1, lambda: 2], never_called, caller_first=True) == [1, 2]
    finally:
        workers.close()


class Where(nn.Module):
    """The identity, noting which thread runs it."""

    def __init__(self):
        super().__init__()
        self.threads = set()

    def forward(self, x):
        self.threads.add(threading.current_thread())
        return x


@pytest.mark.parametrize("threads", [1, 2])
def test_the_first_device_runs_on_the_caller_where_it_wants_the_caller_s_threads(threads):
    """Two CPU stages of ``threads`` intra-op threads each, the caller at one: the first device's actions run on the
    caller's thread where the counts agree (two hand-offs a step fewer), on its worker otherwise; the gradients
    are the plain model's either way."""
    torch.manual_seed(0)
    first, second = Where(), Where()
    model = nn.Sequential(nn.Linear(12, 12), first, nn.Tanh(), nn.Linear(12, 12), second).double()
    ref = copy.deepcopy(model)
    stages = build_stages(model, [2, 3], [CPU, CPU])
    runner = ThreadRunner(stages, threads=threads, timeout=60)
    x, y = data(8)
    sizes = [2, 2, 2, 2]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner.run(one_f_one_b(2, 4), spec_for(y, sizes), inputs=split(x, sizes))
    finally:
        torch.set_num_threads(before)
        runner.close()
    workers = runner.worker_threads
    assert first.threads == ({threading.main_thread()} if threads == 1 else {workers[0]})
    assert second.threads == {workers[1]}
    LOSS(ref(x), y).backward()
    assert max_diff([p.grad for p in ref.parameters()], [p.grad for p in model.parameters()]) < 1e-12


def test_closed_workers_refuse_to_run_and_every_thread_is_joined():
    workers = Workers(3, name="pipeddp-test")
    threads = workers.threads
    workers.run([lambda: None] * 3, never_called)
    workers.close()
    assert not any(t.is_alive() for t in threads)
    workers.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        workers.run([lambda: None] * 3, never_called)


# -- ThreadRunner ----------------------------------------------------------------------------------------------


def spec_for(y, sizes):
    n = sum(sizes)
    return StepSpec(grad=True, loss_fn=LOSS, targets=split(y, sizes), weights=[k / n for k in sizes])


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_thread_runner_on_two_cpu_stages_equals_the_plain_model(schedule):
    model = make_mlp()
    ref = copy.deepcopy(model)
    stages = build_stages(model, [5, 6], [CPU, CPU])
    runner = ThreadRunner(stages, threads=1, timeout=60)
    try:
        assert all(t.name.startswith("pipeddp") for t in runner.worker_threads)
        for step in range(2):
            x, y = data(10, seed=20 + step)
            x.requires_grad_(True)
            sizes = split_sizes(10, 4)  # uneven: 3 3 2 2
            for p in model.parameters():
                p.grad = None
            ref.zero_grad()
            results = runner.run(schedule(2, 4), spec_for(y, sizes), inputs=split(x, sizes))
            ref_x = x.detach().clone().requires_grad_(True)
            ref_loss = LOSS(ref(ref_x), y)
            ref_loss.backward()
            assert len(results) == 2
            loss = torch.stack([results[1].losses[i] for i in range(4)]).sum()
            assert abs(loss.item() - ref_loss.item()) < 1e-12
            assert max_diff([p.grad for p in ref.parameters()], [p.grad for p in model.parameters()]) < 1e-12
            dx = torch.cat([results[0].input_grads[i][0] for i in range(4)])
            assert (dx - ref_x.grad).abs().max().item() < 1e-12
    finally:
        runner.close()
    assert not any(t.is_alive() for t in runner.worker_threads)


@notes
def test_thread_runner_recovers_from_a_failed_step():
    torch.manual_seed(0)
    fail = FailOn(2)
    model = nn.Sequential(nn.Linear(12, 12), nn.Tanh(), fail, nn.Linear(12, 12)).double()
    ref = copy.deepcopy(model)
    stages = build_stages(model, [2, 2], [CPU, CPU])
    runner = ThreadRunner(stages, threads=1, timeout=60)
    x, y = data(9)
    sizes = [3, 2, 2, 2]
    try:
        with pytest.raises(ValueError, match="bad micro-batch of 2") as info:
            runner.run(one_f_one_b(2, 4), spec_for(y, sizes), inputs=split(x, sizes))
        assert info.value.__notes__ == ["pipeddp: rank 0, stage 1, while running F1 (forward of micro-batch 1)"]
        fail.armed = False
        for p in model.parameters():
            p.grad = None
        # the failed step's leftovers (activations already sent, an aborted inbox) do not leak into this one
        runner.run(one_f_one_b(2, 4), spec_for(y, sizes), inputs=split(x, sizes))
        LOSS(ref(x), y).backward()
        assert max_diff([p.grad for p in ref.parameters()], [p.grad for p in model.parameters()]) < 1e-12
    finally:
        runner.close()


def test_a_worker_whose_setup_failed_fails_every_call_at_once():
    # torch.set_num_threads(0) raises in the worker's setup, outside any action
    workers = Workers(2, threads=0, name="pipeddp-test")
    try:
        for _ in range(2):  # the current call and every later one
            began = time.monotonic()
            with pytest.raises(RuntimeError, match="could not start") as info:
                workers.run([lambda: 1, lambda: 2], lambda exc: None)
            assert time.monotonic() - began < 2
            assert info.value.__cause__ is not None
    finally:
        workers.close()


def test_a_worker_thread_that_died_is_reported_not_waited_for():
    workers = Workers(2, threads=1, name="pipeddp-test")
    try:
        workers._workers[1].jobs.put(None)  # the thread ends, as if it had died outside an action
        workers._workers[1].thread.join(5)
        seen = []
        began = time.monotonic()
        with pytest.raises(RuntimeError, match=r"worker thread\(s\) \['pipeddp-test-stage1'\] died"):
            workers.run([lambda: 1, lambda: 2], seen.append)
        assert time.monotonic() - began < 5
        assert len(seen) == 1  # the other devices were told to stop waiting
    finally:
        workers.close()
