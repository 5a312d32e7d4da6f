"""Functions run inside spawned processes by the sharded-checkpoint tests (importable by the children)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

import pipeddp
from conftest import make_mlp
from hybrid_jobs import global_batches, init, train
from pipeddp.checkpoints import optim_state, sharded

LR = 0.01
#: what a data loader might keep in ``extra``: nested dicts, an empty one, int keys, a list, a tensor
EXTRA = {"epoch": 1, "sampler": {"seed": 3, "consumed": 40, "per_replica": {0: 20, 1: 20}}, "empty": {},
         "order": [3, 1, 2], "note": "half way", "mask": torch.tensor([1, 0, 1])}


def adam(engine: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(engine.parameters(), lr=LR)


def save_both_job(directory: str) -> None:
    """2 stages x 2 replicas in stage mode, Adam: 2 steps, then the same state saved in both formats."""
    init()
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=3, balance=[5, 6])
    opt = adam(engine)
    train(engine, global_batches(2, 4)[:2], local=10, optimizer=opt)
    engine.save(os.path.join(directory, "one.pt"), optimizer=opt, extra=EXTRA)
    engine.save(os.path.join(directory, "sharded"), optimizer=opt, extra=EXTRA, sharded=True)
    engine.close()


def load_and_train_job(paths: List[str], stages: int, mode: str) -> List[Dict[str, Any]]:
    """Load each checkpoint into a fresh engine of this layout, then train the last 2 of the 4 steps."""
    init()
    out = []
    for path in paths:
        engine = pipeddp.HybridParallel(make_mlp(seed=99), stages=stages, mode=mode, chunks=2)
        opt = adam(engine)
        extra = engine.load(path, optimizer=opt)
        loaded = {"model": engine.state_dict(), "optimizer": optim_state.named_optimizer_state(engine, opt)}
        train(engine, global_batches(2, 4)[2:], local=20 // engine.topology.replicas, optimizer=opt)
        out.append({"extra": extra, "loaded": loaded, "final": engine.state_dict()})
        engine.close()
    return out


# -- a writer killed mid-save ------------------------------------------------------------------------------------


class _KillAfter:
    """A file object that SIGKILLs its own process once ``limit`` bytes have been written."""

    def __init__(self, f: Any, limit: int) -> None:
        self.f, self.limit, self.written = f, limit, 0

    def write(self, data: Any) -> int:
        data = bytes(data)
        if self.written + len(data) > self.limit:
            self.f.write(data[: max(self.limit - self.written, 0)])
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        self.written += len(data)
        return self.f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


class _Dies(FileSystem):
    """DCP's file system, but this process dies: after ``limit`` bytes of its shard file (``"data"``), or
    when it would rename the finished metadata into place (``"metadata"``: every shard is on disk by then)."""

    def __init__(self, when: str, limit: int = 0) -> None:
        super().__init__()
        self.when, self.limit = when, limit

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as f:
            yield _KillAfter(f, self.limit) if self.when == "data" and str(path).endswith(".distcp") else f

    def rename(self, path: Any, new_path: Any) -> None:
        if self.when == "metadata":
            os.kill(os.getpid(), signal.SIGKILL)
        super().rename(path, new_path)


def killed_writer_job(directory: str, reference: str, victim: int, when: str) -> None:
    """2 stages in stage mode: a sharded checkpoint at step 2 (and the same state as one file, ``reference``),
    one more step, then a sharded save at step 3 during which rank ``victim`` is SIGKILLed."""
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance=[5, 6],
                                    timeout=timedelta(seconds=30))
    opt = adam(engine)
    batches = global_batches(1, 3)
    train(engine, batches[:2], local=10, optimizer=opt)
    engine.save_checkpoint(directory, 2, opt, sharded=True, extra={"epoch": 0})
    engine.save(reference, optimizer=opt, extra={"epoch": 0, "step": 2})
    train(engine, batches[2:], local=10, optimizer=opt)
    if engine.topology.rank == victim:
        def dying_writer(path: str) -> FileSystemWriter:
            writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True)
            writer.fs = _Dies(when, limit=2000)
            return writer

        sharded._storage_writer = dying_writer
    engine.save_checkpoint(directory, 3, opt, sharded=True, extra={"epoch": 0})
    engine.close()


# -- an asynchronous save that overlaps a step -----------------------------------------------------------------------


class _Slow(FileSystem):
    """DCP's file system, opening every shard file ``delay`` seconds late: a slow disk."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if str(path).endswith(".distcp"):
            time.sleep(self.delay)
        with super().create_stream(path, mode) as f:
            yield f


def async_overlap_job(directory: str, delay: float) -> Dict[str, Any]:
    """Save asynchronously on a slow disk, train a step meanwhile, close; report what was seen when."""
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance=[5, 6])
    opt = adam(engine)
    batches = global_batches(1, 2)
    train(engine, batches[:1], local=10, optimizer=opt)

    def slow_writer(path: str) -> FileSystemWriter:
        writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True)
        writer.fs = _Slow(delay)
        return writer

    sharded._storage_writer = slow_writer
    saved = {k: v.clone() for k, v in engine.local_state_dict().items()}
    t0 = time.perf_counter()
    path = engine.save_checkpoint(directory, 1, opt, sharded=True, async_save=True)
    returned_after = time.perf_counter() - t0
    train(engine, batches[1:], local=10, optimizer=opt)  # this step runs while the files are written
    stepped_after = time.perf_counter() - t0
    complete_after_step = sharded.is_complete(path)
    after_step = {k: v.clone() for k, v in engine.local_state_dict().items()}
    engine.close()
    return {"path": path, "returned_after": returned_after, "stepped_after": stepped_after,
            "complete_after_step": complete_after_step, "complete_after_close": sharded.is_complete(path),
            "saved": saved, "after_step": after_step}


# -- every rank gives the same error -------------------------------------------------------------------------------


def refusals_job(directory: str) -> Dict[str, str]:
    """Each mistake of loading, on a 2-process stage-mode job: what this rank raised."""
    engine = pipeddp.HybridParallel(make_mlp(depth=2), stages=2, mode="stage", chunks=2, balance=[1, 2])
    out: Dict[str, str] = {}
    attempts = {
        "sgd for adam": lambda: engine.load(os.path.join(directory, "adam"),
                                            torch.optim.SGD(engine.parameters(), lr=0.1)),
        "other model (one file)": lambda: engine.load(os.path.join(directory, "other.pt")),
        "other model (sharded)": lambda: engine.load(os.path.join(directory, "other")),
        "unsafe newest": lambda: engine.resume(os.path.join(directory, "unsafe-run")),
        "narrower head (one file)": lambda: engine.load(os.path.join(directory, "narrow.pt"), adam(engine)),
        "narrower head (sharded)": lambda: engine.load(os.path.join(directory, "narrow"), adam(engine)),
    }
    before = {k: v.clone() for k, v in engine.local_state_dict().items()}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
            out[name] = f"{type(exc).__name__}: {exc}"
    after = engine.local_state_dict()
    out["unchanged"] = str(sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before))
    engine.close()
    return out


def narrow_model() -> nn.Sequential:
    """The keys of ``make_mlp(depth=2)``, its last layer 6 wide instead of 12."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 6)).double()


def other_model() -> nn.Sequential:
    """Keys 0, 1, 3 where ``make_mlp(depth=2)`` has 0 and 2."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 12), nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 12)).double()



def replica_mode_job(directory: str) -> Dict[str, Any]:
    """2 replicas x 2 stages in replica mode (each process holds every stage): one step, a sharded save."""
    init()
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="replica", chunks=2)
    opt = adam(engine)
    train(engine, global_batches(2, 1), local=10, optimizer=opt)
    engine.save(os.path.join(directory, "sharded"), optimizer=opt, sharded=True)
    engine.save(os.path.join(directory, "one.pt"), optimizer=opt)
    state = engine.state_dict()
    engine.close()
    return state
