"""A split backward runs every gradient hook once, as the plain backward does (``runtime.split``, "Hooks").

The model (``split_hooks_jobs.hooked_model``) has tensor hooks on layer outputs, both module backward hooks, and
weights used twice in a stage (nested and side by side) with hooks of their own, each hook halving the gradient and
counting its calls: a hook run twice or not at all changes the gradients (checked against the plain model on one
device, float64, 1e-12) and the counts (each hook fires once per micro-batch's backward, as often as in the plain
backward of that micro-batch). Zero-bubble in one stage per device, two interleaved (``zb-v2``) and in the V (ZBV),
``auto`` (whose timed candidates include split orders), recompute, the threads of ``Pipeline``, the processes of
``HybridParallel(mode="stage")`` and DDP replicas; below them, ``split`` on a ``retain_grad`` and on a module hook
whose node is where the paths part.
"""

import copy
from collections import Counter

import pytest
import torch
from torch import nn

import pipeddp
from conftest import max_diff
from pipeddp.runtime.stage import Stage, StepSpec
from split_hooks_jobs import WIDTH, hooked_model, reference, train, two_process_job

CPU = torch.device("cpu")
CHUNKS = 4


def check(steps_got, ref_grads, per_backward: Counter, chunks: int = CHUNKS, names=None) -> None:
    """Every step's gradients equal the plain model's, and every hook fired once per micro-batch's backward."""
    for step, (grads, calls) in enumerate(steps_got):
        ref = ref_grads[step]
        keys = list(grads) if names is None else names
        assert max_diff([grads[n] for n in keys], [ref[n] for n in keys]) < 1e-12, f"step {step}"
        assert calls == Counter({k: chunks * v for k, v in per_backward.items() if k in calls or names is None}), \
            f"step {step}: hook calls {dict(calls)}, the plain backward's {dict(per_backward)} per micro-batch"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule,virtual,placement,checkpoint", [
    ("zb", 1, "loop", "never"), ("zb", 1, "loop", "always"), ("zb", 2, "loop", "never"), ("zb", 2, "v", "never"),
    ("zb", 2, "v", "except_last"), ("auto", 1, "loop", "never"), ("auto", 2, "v", "never")])
def test_a_split_backward_runs_every_hook_once(schedule, virtual, placement, checkpoint):
    steps = 6 if schedule == "auto" else 2  # auto times its candidate orders in its first steps
    ref_grads, per_backward = reference(steps)
    assert set(per_backward) == {"h0", "h1", "h2", "h3", "w0", "w1", "pre:a", "full:b"} and per_backward["h1"] == 2
    with pipeddp.Pipeline(hooked_model(), ["cpu"] * 2, chunks=CHUNKS, schedule=schedule, virtual_stages=virtual,
                          placement=placement, checkpoint=checkpoint, balance="uniform") as pipe:
        got = train(pipe, steps, local=10)
    check(got, ref_grads, per_backward)


def test_one_f_one_b_is_the_reference_the_split_must_meet():
    # the same model and checks under 1F1B (whole backwards): what the split backwards above must equal
    ref_grads, per_backward = reference(1)
    with pipeddp.Pipeline(hooked_model(), ["cpu"] * 2, chunks=CHUNKS, schedule="1f1b", balance="uniform") as pipe:
        check(train(pipe, 1, local=10), ref_grads, per_backward)


@pytest.mark.timeout(200)
def test_stage_and_replica_mode_processes_run_every_hook_once():
    # one job of two processes, NCCL's rules for the messages: one stage each, two each in the V, then two DDP
    # replicas (each replica's hooks fire once per micro-batch; DDP sees each weight ready once per step)
    layouts = [("stage", 1, "loop"), ("stage", 2, "v"), ("replica", 1, "loop")]
    results = pipeddp.spawn(two_process_job, 2, args=(layouts, CHUNKS, 2), timeout=150)
    for layout, (mode, _, _) in enumerate(layouts):
        ref_grads, per_backward = reference(2, replicas=2 if mode == "replica" else 1)
        if mode == "replica":
            for per_rank in results:
                check(per_rank[layout], ref_grads, per_backward)
            continue
        joined = []
        for step in range(2):
            grads, calls = {}, Counter()
            for per_rank in results:
                grads.update(per_rank[layout][step][0])
                calls.update(per_rank[layout][step][1])
            joined.append((grads, calls))
        check(joined, ref_grads, per_backward)


def test_a_retained_gradient_at_a_split_point_is_the_plain_ones():
    # retain_grad puts a hook on the node where the paths part: W must not add the gradient to .grad again
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double()
    kept = {}

    class Keep(nn.Module):
        def __init__(self, layer: nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x):
            y = self.layer(x)
            y.retain_grad()
            kept["y"] = y
            return y

    module = nn.Sequential(Keep(copy.deepcopy(plain[0])), nn.Tanh())
    stage = Stage(1, module, CPU, last=False)
    spec = StepSpec(grad=True)
    x = torch.randn(5, WIDTH, dtype=torch.float64)
    g = torch.randn(5, WIDTH, dtype=torch.float64)
    stage.forward(0, x, spec)
    stage.backward_input(0, [g], spec)
    stage.backward_weight(0, spec)
    leaf = x.detach().clone().requires_grad_(True)
    y = plain[0](leaf)
    y.retain_grad()
    plain[1](y).backward(g)
    assert (kept["y"].grad - y.grad).abs().max().item() < 1e-12
    assert max_diff([p.grad for p in module.parameters()], [p.grad for p in plain.parameters()]) < 1e-12


class Shift(nn.Module):
    """``x + b``: called with a tensor made from a parameter, so its backward hook's node is where the paths part."""

    def forward(self, x, b):
        return x + b


class Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.linspace(-1, 1, WIDTH, dtype=torch.float64))
        self.shift = Shift()
        self.shift.register_full_backward_hook(self._hook)
        self.lin = nn.Linear(WIDTH, WIDTH).double()
        self.seen = []

    def _hook(self, module, grad_input, grad_output):
        self.seen.append([g.sum().item() for g in grad_input])
        return tuple(g * 0.5 for g in grad_input)

    def forward(self, x):
        return self.lin(self.shift(x, self.b * 2))


def test_a_module_hook_where_the_paths_part_runs_once_with_the_plain_gradients():
    torch.manual_seed(0)
    module = Shifted()
    plain = copy.deepcopy(module)
    stage = Stage(1, nn.Sequential(module), CPU, last=False)
    spec = StepSpec(grad=True)
    x = torch.randn(5, WIDTH, dtype=torch.float64)
    g = torch.randn(5, WIDTH, dtype=torch.float64)
    stage.forward(0, x, spec)
    dx = stage.backward_input(0, [g], spec)
    stage.backward_weight(0, spec)
    leaf = x.detach().clone().requires_grad_(True)
    plain(leaf).backward(g)
    assert (dx[0] - leaf.grad).abs().max().item() < 1e-12
    assert max_diff([p.grad for p in module.parameters()], [p.grad for p in plain.parameters()]) < 1e-12
    assert len(module.seen) == 1 and max_diff([torch.tensor(module.seen)], [torch.tensor(plain.seen)]) < 1e-12
