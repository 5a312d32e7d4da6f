"""Faults injected for real: dead and stalled peers, writers killed mid-save."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import pipeddp
from pipeddp.checkpoints import catalog
from pipeddp.checkpoints import checkpoint as ckpt
from pipeddp.distributed.launch import free_port
from conftest import data, make_mlp

HERE = Path(__file__).resolve().parent


def start_job(script, args, nprocs):
    port = free_port()
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, str(HERE / script), *map(str, args)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how,twins", [("kill", False), ("stall", False), ("stall", True)])
def test_survivors_fail_with_a_named_error_within_the_timeout(how, twins):
    """With ``twins`` (as on an nccl job) the survivor next to the victim waits for a header on the gloo twin.

    Every survivor's ``PeerFailed`` names the victim as the rank that stopped answering, though the first rank whose
    own wait gives up may have waited on a healthy peer (held up by the victim), or, its peer killed, on nobody named
    (a DDP all-reduce fails with gloo's address and port)."""
    timeout, margin, victim = 10.0, 25.0, 2 if twins else 3
    procs = start_job("fault_job.py", [victim, how, timeout] + (["twins"] if twins else []), 4)
    try:
        # wait for the victim to stop itself (it prints first)
        deadline = time.monotonic() + 120
        while procs[victim].poll() is None and time.monotonic() < deadline:
            if how == "stall" and _is_stopped(procs[victim].pid):
                break
            time.sleep(0.05)
        stopped_at = time.monotonic()
        outcomes = {}
        for rank, p in enumerate(procs):
            if rank == victim:
                continue
            try:
                out, err = p.communicate(timeout=timeout + margin)
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} still running {timeout + margin:.0f} s after rank {victim} {how}ed: a hang")
            outcomes[rank] = (p.returncode, err, time.monotonic() - stopped_at)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    for rank, (code, err, took) in outcomes.items():
        assert code != 0, f"rank {rank} exited 0 after its peer {how}ed"
        assert "finished" not in err
        assert took < timeout + margin
        assert f"rank {rank}" in err and "stage" in err and "micro-batch" in err, err[-3000:]
        headline = (f"PeerFailed: rank {rank} (stage {rank % 2}) stopped its train_step: rank {victim} "
                    f"(stage {victim % 2}) stopped answering")
        assert headline in err, (rank, err[-3000:])
    if twins:  # the victim's next stage waited for micro-batch 1's header
        assert "got no activation of micro-batch 1 for stage 1 from rank 2" in outcomes[3][1], outcomes[3][1][-3000:]


def _is_stopped(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "T"
    except OSError:
        return False


class _KillAfter:
    """A file object that SIGKILLs its own process once ``limit`` bytes have been written."""

    def __init__(self, f, limit):
        self.f, self.limit, self.written = f, limit, 0

    def write(self, data):
        if self.written + len(data) > self.limit:
            self.f.write(data[: max(self.limit - self.written, 0)])
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        self.written += len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.timeout(240)
def test_killed_writers_never_lose_or_corrupt_a_checkpoint(tmp_path):
    """Kill the writer at random byte offsets (and right before/after the rename), many times."""
    directory = str(tmp_path / "ckpts")
    torch.manual_seed(0)
    engine = pipeddp.HybridParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)), stages=2)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
    rng = random.Random(0)
    size = None
    completed, killed, trials = 0, 0, 40
    step = 0
    engine.save_checkpoint(directory, step, opt, keep=2)
    weights_at = {0: engine.state_dict()["0.weight"].clone()}
    for trial in range(trials):
        with torch.no_grad():
            for p in engine.parameters():
                p.add_(1.0)  # a visible change per step
        step += 1
        weights_at[step] = engine.state_dict()["0.weight"].clone()
        size = size or os.path.getsize(catalog.step_path(directory, 0))
        mode = rng.choice(["bytes", "bytes", "bytes", "before-rename", "after-rename"])
        limit = rng.randint(0, size)
        pid = os.fork()
        if pid == 0:  # the writer
            try:
                if mode == "bytes":
                    ckpt._open_for_write = lambda fd, limit=limit: _KillAfter(os.fdopen(fd, "wb"), limit)
                elif mode == "before-rename":
                    os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
                else:
                    real = os.replace
                    os.replace = lambda *a: (real(*a), os.kill(os.getpid(), signal.SIGKILL))
                engine.save_checkpoint(directory, step, opt, keep=2)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        killed += os.WIFSIGNALED(status)
        found = catalog.newest(directory)
        assert found is not None, "the last complete checkpoint was lost"
        path, payload = found
        got_step = payload["extra"]["step"]
        expect = step if mode == "after-rename" else step - 1
        if mode == "bytes" and limit >= size:
            expect = got_step  # the whole file may have been written before the limit was hit
        assert got_step == expect, (mode, limit, got_step, step)
        # the checkpoint holds exactly the weights of its step
        assert torch.equal(payload["model"]["0.weight"], weights_at[got_step])
        # no partial file is taken for a checkpoint: every step file loads completely
        for _, p in catalog.list_checkpoints(directory):
            torch.load(p)
        if got_step != step:
            with torch.no_grad():  # roll the model back to the saved step, as a restart would
                engine.load_state_dict({k: v for k, v in payload["model"].items()})
            step = got_step
        completed += 1
    engine.close()
    assert killed == trials and completed == trials
    # an honest save afterwards sweeps the temporary debris and keeps 2
    engine2 = pipeddp.HybridParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)), stages=1)
    engine2.resume(directory)
    engine2.save_checkpoint(directory, step + 1, keep=2)
    assert len(catalog.list_checkpoints(directory)) == 2
    assert not [n for n in os.listdir(directory) if n.startswith(".tmp-")]
    engine2.close()


class NanGuard(nn.Module):
    """The identity, which refuses an input holding a NaN (a layer that checks what it is given)."""

    def forward(self, x):
        if torch.isnan(x).any():
            raise ValueError("NanGuard: the input holds a NaN")
        return x


def failing_step_job(how: str):
    """2 x 2 stage mode (ranks 0, 1: replica 0; 2, 3: replica 1); step 1 fails on one rank: rank 1's loss_fn
    (``loss``), or rank 3's stage 1 in its forward, given a NaN that rank 2 feeds it (``forward``). Every rank
    reports what it raised and when (the clock is the machine's, shared by the four processes)."""
    model = make_mlp(depth=4)
    model.insert(4, NanGuard())  # in stage 1 with balance [4, 4]
    engine = pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=2, balance=[4, 4], timeout=60)
    rank = engine.topology.rank

    def loss_fn(out, y):
        if how == "loss" and rank == 1 and step == 1:
            return (out - y).pow(2).mean(dim=1)  # a vector: refused by the engine
        return nn.functional.mse_loss(out, y)

    out = {"error": "", "type": "", "at": 0.0, "steps": 0}
    try:
        for step in range(3):
            x, y = data(8, seed=step)
            if how == "forward" and rank == 2 and step == 1:
                x[3, 0] = float("nan")
            engine.train_step(x if engine.is_first else None, y if engine.is_last else None, loss_fn)
            out["steps"] += 1
    except Exception as exc:  # noqa: BLE001 - what each rank raised
        out.update(at=time.time(), type=type(exc).__name__, error=str(exc), notes=getattr(exc, "__notes__", []))
    engine.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["loss", "forward"])
def test_a_rank_failing_inside_a_step_stops_every_rank_at_once_naming_it(how):
    """No rank waits out the timeout (60 s) for a peer that failed at once, nor reports the transport's words."""
    results = pipeddp.spawn(failing_step_job, 4, args=(how,), timeout=110)
    failed, stage = (1, 1) if how == "loss" else (3, 1)
    said = ("ValueError: loss_fn must return" if how == "loss" else "ValueError: NanGuard: the input holds a NaN")
    own = results[failed]
    assert own["steps"] == 1 and own["type"] == "ValueError" and said.split(": ", 1)[1] in own["error"], own
    assert any(n.startswith(f"pipeddp: rank {failed}, stage {stage}, while running F0") for n in own["notes"]), own
    for rank, res in enumerate(results):
        if rank == failed:
            continue
        assert res["steps"] == 1 and res["type"] == "PeerFailed", (rank, res)
        assert res["error"].startswith(f"rank {rank} (stage {rank % 2}) stopped its train_step: rank {failed} "
                                       f"(stage {stage}) failed in its train_step with {said}"), (rank, res)
        assert "within" not in res["error"] and "gloo" not in res["error"], res["error"]
        assert res["at"] - own["at"] < 10, (rank, res["at"] - own["at"])
