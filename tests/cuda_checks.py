"""CUDA checks of pipeddp against the plain model on the CPU, run as a script by ``test_cuda.py``.

    python tests/cuda_checks.py one-gpu       # several stages on one GPU: streams, events, record_stream
    python tests/cuda_checks.py cut           # a GPU-to-CPU cut and a CPU-to-GPU cut
    python tests/cuda_checks.py autocast      # torch.autocast("cuda", bfloat16) reaches every stage
    python tests/cuda_checks.py dropout       # dropout on GPU stages: the same masks under every schedule and recompute
    python tests/cuda_checks.py syncs         # a step syncs with the device only where its loss comes (needs a GPU)
    python tests/cuda_checks.py two-gpus      # real cross-device stages (needs 2 GPUs)
    python tests/cuda_checks.py nccl          # stage mode, one process per GPU, over nccl (needs 2 GPUs)

Each prints ``ok <check>`` and exits 0, or raises. Run under ``TORCH_CUDA_SANITIZER=1`` the same checks
must find no unsynchronised access between streams. ``--fake-cpu`` maps every CUDA device to the CPU (and
nccl to gloo): the checks' own logic, runnable anywhere.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
from typing import Any, Dict, List, Sequence

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pipeddp  # noqa: E402

LOSS = nn.functional.mse_loss
FAKE = "--fake-cpu" in sys.argv


def dev(name: str) -> str:
    return "cpu" if FAKE else name


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: List[nn.Module] = []
    for i in range(4):
        layers += [nn.Linear(12, 12), nn.Tanh() if i % 2 else nn.ReLU()]
    return nn.Sequential(*layers[:-1]).double()


def batches(steps: int = 3, n: int = 10) -> List[Any]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 12, generator=g, dtype=torch.float64), torch.randn(n, 12, generator=g,
                                                                              dtype=torch.float64))
            for _ in range(steps)]


def reference(model: nn.Module, data: Sequence[Any]) -> Dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        LOSS(model(x), y).backward()
        opt.step()
    return model.state_dict()


def assert_close(expect: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor], what: str) -> None:
    assert sorted(expect) == sorted(got), what
    worst = max((got[k].detach().cpu() - v).abs().max().item() for k, v in expect.items())
    assert worst < 1e-10, f"{what}: max difference {worst}"


def train_pipeline(devices: Sequence[str], **kw: Any) -> None:
    data = batches()
    expect = reference(mlp(), data)
    for schedule in ("gpipe", "1f1b"):
        for checkpoint in ("never", "always"):
            with pipeddp.Pipeline(mlp(), [dev(d) for d in devices], chunks=3, schedule=schedule,
                                  checkpoint=checkpoint, balance="uniform", **kw) as pipe:
                opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
                for x, y in data:
                    opt.zero_grad()
                    pipe.train_step(x, y, LOSS)
                    opt.step()
                assert_close(expect, pipe.state_dict(), f"{devices} {schedule} {checkpoint}")
    # the autograd bridge: pipe(x), then loss.backward() outside
    x, y = data[0]
    ref = mlp()
    LOSS(ref(x), y).backward()
    with pipeddp.Pipeline(mlp(), [dev(d) for d in devices], chunks=4, balance="uniform") as pipe:
        out = pipe(x)
        LOSS(out, y.to(out.device)).backward()
        worst = max((p.grad.cpu() - q.grad).abs().max().item() for p, q in zip(pipe.parameters(), ref.parameters()))
        assert worst < 1e-10, f"bridge {devices}: {worst}"
    if not FAKE:
        torch.cuda.synchronize()


def check_one_gpu() -> None:
    train_pipeline(["cuda:0", "cuda:0"])
    train_pipeline(["cuda:0", "cuda:0", "cuda:0"])


def check_cut() -> None:
    train_pipeline(["cuda:0", "cpu"])
    train_pipeline(["cpu", "cuda:0"])


def tied(seed: int = 0) -> nn.Sequential:
    """An embedding tied to the output head: one parameter at both ends of the model."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(10, 12), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 10)).double()
    model[3].weight = model[0].weight
    return model


def train_tied(devices: Sequence[str]) -> None:
    """The tied model on stages of different devices trains as the plain model: each stage computes with the
    weight on its own device, whichever stage moved the one parameter last."""
    g = torch.Generator().manual_seed(2)
    data = [(torch.randint(0, 10, (9,), generator=g), torch.randint(0, 10, (9,), generator=g)) for _ in range(3)]
    loss = nn.functional.cross_entropy
    model = tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    with pipeddp.Pipeline(tied(), [dev(d) for d in devices], chunks=3, balance=[1, 3]) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            pipe.train_step(x, y, loss)
            opt.step()
        assert_close(model.state_dict(), pipe.state_dict(), f"tied {devices}")


def check_tied() -> None:
    train_tied(["cuda:0", "cpu"])
    train_tied(["cpu", "cuda:0"])


def check_autocast() -> None:
    class Sees(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.seen: List[torch.dtype] = []

        def forward(self, x):
            out = self.lin(x)
            self.seen.append(out.dtype)
            return out

    torch.manual_seed(0)
    model = nn.Sequential(Sees(), nn.Tanh(), Sees(), nn.Tanh(), Sees())
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    device_type = "cpu" if FAKE else "cuda"
    ref = copy.deepcopy(model).to(dev("cuda:0"))
    with torch.autocast(device_type, dtype=torch.bfloat16):
        ref_loss = LOSS(ref(x.to(dev("cuda:0"))), y.to(dev("cuda:0")))
    with pipeddp.Pipeline(model, [dev("cuda:0")] * 3, chunks=2, balance=[1, 2, 2], checkpoint="always") as pipe:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = pipe.train_step(x, y, LOSS)
    seen = {d for layer in model if isinstance(layer, Sees) for d in layer.seen}
    assert seen == {torch.bfloat16}, seen
    assert abs(loss.item() - ref_loss.item()) < 3e-2, (loss.item(), ref_loss.item())


def check_dropout() -> None:
    """Each stage seeds each micro-batch, so dropout draws the same masks whatever the schedule or recompute policy,
    bit for bit, on CUDA generators as on the CPU's; and the masks are drawn (the gradients differ without them)."""
    def grads(devices: Sequence[str], schedule: str, checkpoint: str, p: float = 0.3) -> List[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 32), nn.Dropout(p), nn.ReLU(), nn.Linear(32, 32), nn.Dropout(p),
                              nn.Tanh(), nn.Linear(32, 12))
        x, y = batches(1, n=16)[0]
        with pipeddp.Pipeline(model.double(), devices, chunks=4, schedule=schedule, checkpoint=checkpoint,
                              balance=[3, 4]) as pipe:
            torch.manual_seed(7)
            for _ in range(2):
                pipe.train_step(x, y, LOSS)
            return [q.grad.detach().cpu().clone() for q in pipe.parameters()]

    for devices in ([dev("cuda:0"), dev("cuda:0")], [dev("cuda:0"), "cpu"]):
        base = grads(devices, "gpipe", "never")
        for schedule, checkpoint in (("gpipe", "always"), ("1f1b", "never"), ("1f1b", "always"), ("1f1b", "always")):
            got = grads(devices, schedule, checkpoint)
            assert all(torch.equal(a, b) for a, b in zip(base, got)), (devices, schedule, checkpoint)
        assert not all(torch.equal(a, b) for a, b in zip(base, grads(devices, "gpipe", "never", p=0.0)))


def check_syncs() -> None:
    """No device-to-host synchronisation inside a training step on GPU stages (the loss comes back as a tensor):
    under ``set_sync_debug_mode("error")`` any synchronising call in any stage thread raises. A ``HybridParallel``
    step agrees on its loss and non-finite vote: the one copy that brings them to the host is its first sync."""
    assert not FAKE, "syncs needs a GPU"
    torch.manual_seed(0)
    engine = pipeddp.HybridParallel(mlp(), stages=2, mode="replica", devices=["cuda:0", "cuda:0"], chunks=4,
                                    balance="uniform", skip_nonfinite=True)
    x, y = (torch.randn(32, 12, dtype=torch.float64, device="cuda:0") for _ in range(2))
    engine.train_step(x, y, LOSS)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.train_step(x, y, LOSS)
        raise AssertionError("the step's loss never came to the host")
    except RuntimeError as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "pipeddp" in f.filename]
        assert frames[-1].name == "finish_step", (exc, frames[-1])  # nothing synced before the crossing
    finally:
        torch.cuda.set_sync_debug_mode(0)
        engine.close()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for schedule in ("gpipe", "1f1b"):
        with pipeddp.Pipeline(model, ["cuda:0", "cuda:0"], chunks=4, schedule=schedule, balance="uniform") as pipe:
            pipe.train_step(x, y, nn.functional.cross_entropy)  # the first step may sync (lazy init, profiling)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss = pipe.train_step(x, y, nn.functional.cross_entropy)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert isinstance(loss, torch.Tensor) and torch.isfinite(loss).item()


def check_two_gpus() -> None:
    train_pipeline(["cuda:0", "cuda:1"])
    train_pipeline(["cuda:1", "cuda:0", "cpu"])
    train_tied(["cuda:0", "cuda:1"])


def nccl_job(fake: bool, placement: str = "loop") -> Dict[str, torch.Tensor]:
    """Runs in each of 2 spawned processes: 1 replica x 2 devices (4 interleaved stages, round robin or in the V),
    one GPU each; the last batch is smaller (the messages' shapes change). On the CPU (``--fake-cpu``) gloo runs it
    under NCCL's rules for point-to-point messages (``nccl_rules``)."""
    if fake:
        import nccl_rules

        nccl_rules.install()
    engine = pipeddp.HybridParallel(mlp(), stages=2, mode="stage", chunks=3, balance="uniform",
                                    schedule="interleaved", virtual_stages=2, placement=placement,
                                    **({"devices": ["cpu"], "backend": "gloo"} if fake else {}))
    assert fake or engine.backend == "nccl"
    # every process is bound to its own GPU before its first collective
    assert fake or torch.cuda.current_device() == int(os.environ["LOCAL_RANK"])
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    for x, y in batches() + batches(1, n=7):
        opt.zero_grad()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        opt.step()
    state = engine.state_dict()
    engine.close()
    return state


def check_nccl() -> None:
    from cuda_checks import nccl_job as job  # importable by the spawned children

    expect = reference(mlp(), batches() + batches(1, n=7))
    for placement in ("loop", "v"):
        for state in pipeddp.spawn(job, 2, args=(FAKE, placement), timeout=300):
            assert_close(expect, state, f"nccl stage mode, placement={placement!r}")


CHECKS = {"one-gpu": check_one_gpu, "cut": check_cut, "tied": check_tied, "autocast": check_autocast,
          "dropout": check_dropout, "syncs": check_syncs, "two-gpus": check_two_gpus, "nccl": check_nccl}

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    for name in names:
        CHECKS[name]()
        print(f"ok {name}", flush=True)
