"""``distributed.ddp``: DDP per stage on a real (one-rank, gloo) process group, armed for the last backward only."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from conftest import data, make_mlp, max_diff
from pipeddp.distributed.ddp import COMM_HOOKS, DDPSync, attach_ddp, check_ddp_kwargs
from pipeddp.runtime.executor import ThreadRunner
from pipeddp.runtime.gradsync import NO_SYNC
from pipeddp.runtime.microbatch import split, split_sizes
from pipeddp.runtime.schedule import Action, one_f_one_b, zero_bubble
from pipeddp.runtime.slicing import build_stages
from pipeddp.runtime.stage import Stage, StepSpec

CPU = torch.device("cpu")
LOSS = nn.functional.mse_loss


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one rank in this process, destroyed afterwards."""
    assert not dist.is_initialized()
    store = dist.FileStore(os.path.join(str(tmp_path), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def backwards_reversed(stages, chunks):
    """Every forward, then the backwards from the last micro-batch to the first: the last backward is B0."""
    return [[Action("F", i) for i in range(chunks)] + [Action("B", i) for i in reversed(range(chunks))]
            for _ in range(stages)]


class Recorder:
    """A DDP comm hook (an all-reduce) that records, per call, the stage, the backward running and the bucket."""

    def __init__(self, stages, groups):
        self.stage_of = {id(g): st.index for st, g in zip(stages, groups)}
        self.running = {}
        self.calls = []
        for st in stages:
            self._watch(st)

    def _watch(self, stage):
        original, original_weight = stage.backward, stage.backward_weight

        def backward(mb, grads, spec, *, sync=False):
            self.running[stage.index] = (mb, sync)
            try:
                return original(mb, grads, spec, sync=sync)
            finally:
                self.running[stage.index] = None

        def backward_weight(mb, spec, *, sync=False):  # zero-bubble: the weight half accumulates, so it reduces
            self.running[stage.index] = (mb, sync)
            try:
                return original_weight(mb, spec, sync=sync)
            finally:
                self.running[stage.index] = None

        stage.backward = backward
        stage.backward_weight = backward_weight

    def hook(self, state, bucket):  # no annotations: DDP inspects them
        s = self.stage_of[id(state)]
        self.calls.append({"stage": s, "running": self.running.get(s), "index": bucket.index(),
                           "is_last": bucket.is_last(), "params": list(bucket.parameters()),
                           "grads": [g.detach().clone() for g in bucket.gradients()]})
        return default_hooks.allreduce_hook(state, bucket)


@pytest.mark.parametrize("schedule,recompute", [(one_f_one_b, False), (one_f_one_b, True),
                                                (backwards_reversed, False), (zero_bubble, False),
                                                (zero_bubble, True)])
def test_the_all_reduce_runs_once_per_bucket_in_the_last_backward(one_rank_group, schedule, recompute):
    model = make_mlp()
    ref = copy.deepcopy(model)
    stages = build_stages(model, [5, 6], [CPU, CPU])
    groups = [dist.new_group([0]), dist.new_group([0])]  # one DDP group per stage, as HybridParallel makes them
    rec = Recorder(stages, groups)
    # tiny buckets: several per stage (from the second step on, after DDP has rebuilt them in backward order)
    ddps = [attach_ddp(st, g, ddp_kwargs={"bucket_cap_mb": 0.001}, comm_hook=rec.hook) for st, g in zip(stages, groups)]
    assert all(d is not None for d in ddps) and all(isinstance(st.grad_sync, DDPSync) for st in stages)
    rows = schedule(2, 4)
    # the last action that accumulates weight gradients: a B, or with a split backward a W
    last_backward = [[a for a in row if a.kind in ("B", "W")][-1].mb for row in rows]
    runner = ThreadRunner(stages, threads=1, timeout=60)
    try:
        for step in range(2):
            x, y = data(10, seed=30 + step)
            sizes = split_sizes(10, 4)
            for p in model.parameters():
                p.grad = None
            ref.zero_grad()
            rec.calls.clear()
            spec = StepSpec(grad=True, recompute=lambda i: recompute, loss_fn=LOSS, targets=split(y, sizes),
                            weights=[n / 10 for n in sizes], sync=True)
            runner.run(rows, spec, inputs=split(x, sizes))
            LOSS(ref(x), y).backward()
            ref_grad = {id(p): q.grad for p, q in zip(model.parameters(), ref.parameters())}
            assert max_diff([p.grad for p in ref.parameters()], [p.grad for p in model.parameters()]) < 1e-12

            for st in stages:
                calls = [c for c in rec.calls if c["stage"] == st.index]
                # once per bucket: every bucket index exactly once, the last bucket flagged once
                indices = sorted(c["index"] for c in calls)
                assert indices == list(range(len(calls))), (step, st.index, indices)
                assert [c["is_last"] for c in calls].count(True) == 1
                if step == 1:
                    assert len(calls) > 1  # the rebuilt buckets: the check above covers several
                # every parameter of the stage is reduced exactly once
                reduced = [id(p) for c in calls for p in c["params"]]
                assert sorted(reduced) == sorted(id(p) for p in st.module.parameters())
                # only within the stage's last backward of the schedule, the one run with sync
                assert all(c["running"] == (last_backward[st.index], True) for c in calls), \
                    [c["running"] for c in calls]
                # ... when the gradients already hold every micro-batch
                for c in calls:
                    for p, g in zip(c["params"], c["grads"]):
                        assert (g - ref_grad[id(p)]).abs().max().item() < 1e-12
    finally:
        runner.close()


def test_no_all_reduce_in_a_step_without_sync(one_rank_group):
    model = make_mlp()
    ref = copy.deepcopy(model)
    (stage,) = build_stages(model, [11], [CPU])
    group = dist.new_group([0])
    rec = Recorder([stage], [group])
    attach_ddp(stage, group, comm_hook=rec.hook)
    runner = ThreadRunner([stage], threads=1, timeout=60)
    try:
        x, y = data(8)
        sizes = [4, 4]
        runner.run(one_f_one_b(1, 2), StepSpec(grad=True, loss_fn=LOSS, targets=split(y, sizes), weights=[0.5, 0.5]),
                   inputs=split(x, sizes))
    finally:
        runner.close()
    assert rec.calls == []
    LOSS(ref(x), y).backward()
    assert max_diff([p.grad for p in ref.parameters()], [p.grad for p in model.parameters()]) < 1e-12


def test_a_stage_without_trainable_parameters_gets_no_ddp(one_rank_group):
    group = dist.new_group([0])
    plain = Stage(1, nn.Sequential(nn.ReLU(), nn.Tanh()), CPU, last=False)
    assert attach_ddp(plain, group) is None and plain.grad_sync is NO_SYNC
    frozen = nn.Sequential(nn.Linear(3, 3))
    frozen.requires_grad_(False)
    stage = Stage(2, frozen, CPU, last=False)
    assert attach_ddp(stage, group) is None and stage.grad_sync is NO_SYNC


def test_check_ddp_kwargs_refusals():
    with pytest.raises(ValueError, match="static_graph=True is not supported"):
        check_ddp_kwargs({"static_graph": True})
    for key in ("process_group", "device_ids", "output_device", "module"):
        with pytest.raises(ValueError, match=f"ddp_kwargs may not set '{key}': pipeddp chooses it"):
            check_ddp_kwargs({key: None})
    with pytest.raises(ValueError, match="unknown comm_hook 'int8'; choose one of"):
        check_ddp_kwargs(None, "int8")
    # what is allowed comes back as a new dict
    given = {"bucket_cap_mb": 1, "static_graph": False, "find_unused_parameters": True}
    checked = check_ddp_kwargs(given, COMM_HOOKS[0])
    assert checked == given and checked is not given
    assert check_ddp_kwargs(None, default_hooks.allreduce_hook) == {}
