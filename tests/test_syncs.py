"""Device-to-host copies in a training step: each one would stall a GPU's stream (``.item()``, ``.tolist()``,
``.cpu()``, ``bool(tensor)``), so a step makes one, where the loss and the non-finite vote cross to the host
together at its end; the agreements' tables (the batch check's, the losses') hold host values and are gathered on
the host (over gloo: on an nccl job a gloo twin of its groups, ``groups.host_group``), so reading them syncs with
no device. A step whose batch has the shapes of the step before sends no headers between processes, so the
transport reads none. Counted here on the CPU by the calls that would sync; on a GPU ``tests/cuda_checks.py syncs``
runs a step under ``torch.cuda.set_sync_debug_mode``."""

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import pipeddp
from pipeddp.distributed.headers import HEADER
from conftest import data, make_mlp, max_diff, reference_training
from hybrid_jobs import LOSS, global_batches, train
from nccl_rules import as_on_nccl

SYNCS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"}
TRANSPORT = "p2p.py"  # an activation's header is read where it arrives (its shapes size the receives)


class CountSyncs(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCS:
            caller = next(f for f in reversed(traceback.extract_stack()[:-1])
                          if "torch" + os.sep not in f.filename and not f.filename.endswith("test_syncs.py"))
            self.calls.append((func.__name__, os.path.basename(caller.filename), caller.lineno))
        return func(*args, **(kwargs or {}))


def counted_mse(out, y):
    """A loss over counted items (``(total, count)``): the rows whose first target is positive, counted on the
    loss's device as a token loss counts its tokens."""
    keep = y[:, 0] > 0
    return (((out - y) ** 2) * keep[:, None]).sum(), keep.sum()


def device_calls(calls):
    """The calls that would sync a device: all but the step's base seed, drawn from the CPU generator (a host
    value on every machine, ``rng.draw_base_seed``)."""
    return [c for c in calls if c[:2] != ("item", "rng.py")]


LOSSES = {"mean": torch.nn.functional.mse_loss, "counted": counted_mse}


def step_job(skip_nonfinite: bool, loss: str = "mean"):
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance="uniform",
                                    skip_nonfinite=skip_nonfinite)
    x, y = data(10)
    args = (x if engine.is_first else None, y if engine.is_last else None, LOSSES[loss])
    engine.train_step(*args)
    with CountSyncs() as counted:
        loss = engine.train_step(*args)
    engine.close()
    return {"calls": device_calls(counted.calls), "loss": loss}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("skip_nonfinite,loss", [(False, "mean"), (True, "mean"), (False, "counted")])
def test_a_step_crosses_from_its_device_to_the_host_once(skip_nonfinite, loss):
    """A counted loss's count joins the crossing: no sync per micro-batch for it."""
    results = pipeddp.spawn(step_job, 4, args=(skip_nonfinite, loss), timeout=100)  # 2 replicas x 2 stages
    for rank, res in enumerate(results):
        assert [c for c in res["calls"] if c[1] != TRANSPORT] == res["calls"], res["calls"]  # shapes repeat: no header
        names = [name for name, where, _ in res["calls"] if where in ("calls.py", "step_end.py")]  # the agreements
        assert len(names) == len(res["calls"]), res["calls"]
        # the batch check's table; the loss and vote crossing (where this rank has a loss or votes); the losses'
        # table
        last = rank % 2 == 1
        assert names == (["tolist", "cpu", "tolist"] if last or skip_nonfinite else ["tolist", "tolist"]), names
        assert isinstance(res["loss"], torch.Tensor) and torch.isfinite(res["loss"])


def test_a_pipeline_s_counted_step_syncs_nowhere():
    """A one-process ``Pipeline`` keeps a counted loss's count on the loss's device: the step's loss, divided by
    it, comes back as a tensor and the gradients are divided by it there, without a sync (before: one per
    micro-batch). Its loss and gradients are the plain model's sum over counted items divided by their count."""
    model = make_mlp()
    x, y = data(12)
    with pipeddp.Pipeline(model, ["cpu", "cpu"], chunks=4, balance="uniform") as pipe:
        pipe.train_step(x, y, counted_mse)
        pipe.zero_grad()
        with CountSyncs() as counted:
            loss = pipe.train_step(x, y, counted_mse)
        grads = [p.grad.clone() for p in pipe.parameters()]
    assert device_calls(counted.calls) == [], counted.calls
    model.zero_grad(set_to_none=True)  # the pipeline's stages hold the model's own parameters
    total, count = counted_mse(model(x), y)
    (total / count).backward()
    assert loss.dtype == torch.float64 and torch.allclose(loss, total / count, rtol=1e-12)
    assert max_diff(grads, [p.grad for p in model.parameters()]) < 1e-12


def spy_headers(twin):
    """Count the int64 headers sent ahead of activations by the group they go on (the pipeline's gloo ``twin`` or
    another); returns the counts and the real ``isend``, to be put back."""
    headers = {"twin": 0, "elsewhere": 0}
    real_isend = dist.isend

    def isend(tensor, dst=None, group=None, tag=0, **kw):
        if tensor.dtype == torch.int64 and tuple(tensor.shape) == (HEADER,):
            headers["twin" if group is twin else "elsewhere"] += 1
        return real_isend(tensor, dst, group, tag, **kw)

    dist.isend = isend
    return headers, real_isend


def twin_job(path: str):
    """Stage mode as on an nccl job: the agreements (their objects too: the cut, the state dict, a saved file's
    shares) on gloo twins of the job's group and of the pipeline's."""
    as_on_nccl()
    dist.init_process_group("gloo")
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance="uniform")
    wired = engine._replica.groups
    twins = [engine.agreement.host_group, wired.pipeline_host]
    headers, real_isend = spy_headers(wired.pipeline_host)
    facts = {"backends": [dist.get_backend(g) for g in twins],
             "members": [dist.get_process_group_ranks(g) for g in twins],
             "distinct": twins[0] is not dist.group.WORLD and twins[1] is not wired.pipeline}
    batches = global_batches(2, 3) + [data(16, seed=7)]  # the last one larger: a changed shape
    losses = train(engine, batches[:3], local=10) + train(engine, batches[3:], local=8)
    x, y = data(10, seed=9)
    wrong = engine.topology.rank == 3  # the last stage of replica 1 passes 6 targets for 10 inputs
    try:
        engine.train_step(x if engine.is_first else None, (y[:6] if wrong else y) if engine.is_last else None, LOSS)
        facts["refused"] = "no error"
    except ValueError as exc:
        facts["refused"] = str(exc)
    with torch.no_grad():
        out = engine(x[:5] if engine.is_first else None)
    engine.save(path)  # replica 0's shares gathered on rank 0 over the twin
    dist.isend = real_isend
    facts.update(losses=losses, state=engine.state_dict(), out=out, headers=headers,
                 counted=sum(ch.headers for ch in engine._replica.runner.channels))
    engine.close()
    return facts


@pytest.mark.timeout(180)
def test_agreements_on_a_gloo_twin_train_the_plain_model_s_weights(tmp_path):
    path = str(tmp_path / "model.pt")
    results = pipeddp.spawn(twin_job, 4, args=(path,), timeout=150)
    batches = global_batches(2, 3) + [data(16, seed=7)]
    model = make_mlp()
    _, params = reference_training(model, batches, LOSS)
    names = [n for n, _ in model.named_parameters()]
    pipelines = [[0, 1], [2, 3]]
    for rank, res in enumerate(results):
        assert res["backends"] == ["gloo", "gloo"] and res["distinct"], res
        assert res["members"] == [[0, 1, 2, 3], pipelines[rank // 2]]
        assert max_diff([res["state"][n] for n in names], params) < 1e-12
        assert "rank 3 passed y with 6 samples but the others have 10" in res["refused"], res["refused"]
        # a changed shape sends headers (the first step, the larger batch, the forward): all on the gloo twin,
        # none beside the activations on the group that carries them (on nccl each would cross host and GPU)
        if rank % 2 == 0:
            assert res["headers"] == {"twin": res["counted"], "elsewhere": 0} and res["counted"] >= 3 * 2, res
    saved = torch.load(path, weights_only=False)["model"]
    assert list(saved) == list(model.state_dict())
    assert max_diff([saved[n] for n in names], params) < 1e-12
    final = make_mlp()
    final.load_state_dict(results[0]["state"])
    for rank in (1, 3):  # the last stages give the trained model's output
        torch.testing.assert_close(results[rank]["out"], final(data(10, seed=9)[0][:5]), rtol=0, atol=1e-12)


def unreachable_twin_job():
    as_on_nccl()
    dist.init_process_group("gloo")
    os.environ["GLOO_SOCKET_IFNAME"] = "nosuch0"  # gloo finds no such interface for the twin
    try:
        pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance="uniform")
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
def test_a_twin_gloo_cannot_make_names_the_fix():
    for rank, message in enumerate(pipeddp.spawn(unreachable_twin_job, 2, timeout=100)):
        assert message.startswith(f"rank {rank}: could not make the gloo group"), message
        assert "GLOO_SOCKET_IFNAME" in message and "nosuch0" in message, message


SIZES = [8, 8, 6, 10]  # local batch sizes, step by step: every change sends headers


def twin_virtual_job(schedule: str, placement: str):
    """Two stages per process, activations crossing both ways, batch sizes changing: headers on the twin."""
    as_on_nccl()
    dist.init_process_group("gloo")
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, virtual_stages=2,
                                    placement=placement, schedule=schedule, balance="uniform")
    headers, real_isend = spy_headers(engine._replica.groups.pipeline_host)
    losses = []
    for i, n in enumerate(SIZES):
        losses += train(engine, [data(n, seed=20 + i)], local=n)
    dist.isend = real_isend
    facts = {"losses": losses, "state": engine.state_dict(), "headers": headers,
             "counted": sum(ch.headers for ch in engine._replica.runner.channels)}
    engine.close()
    return facts


@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule,placement", [("interleaved", "loop"), ("zb", "v")])
def test_headers_both_ways_on_a_gloo_twin_train_the_plain_model_s_weights(schedule, placement):
    """Under NCCL's rules on the activations' group (tags stripped, one stream per pair), with the headers on the
    gloo twin beside them: each process sends activations to the other, and a step whose shapes changed sends a
    header per activation; the weights are the plain model's on the same batches."""
    results = pipeddp.spawn(twin_virtual_job, 2, args=(schedule, placement), timeout=150)
    model = make_mlp()  # the plain model, on the same batches
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i, n in enumerate(SIZES):
        x, y = data(n, seed=20 + i)
        opt.zero_grad()
        loss = LOSS(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    for res in results:
        assert res["headers"] == {"twin": res["counted"], "elsewhere": 0} and res["counted"] >= 3 * 2, res
        assert max_diff([res["state"][n] for n, _ in model.named_parameters()], list(model.parameters())) < 1e-12
        assert max(abs(a - b) for a, b in zip(res["losses"], losses)) < 1e-12
