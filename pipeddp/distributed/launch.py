"""``spawn``: start a local multi-process job without torchrun.

Each child gets the environment torchrun would give it (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port), so the
function it runs is written exactly like a torchrun script. Made for
notebooks, tests and the demo:

    def main(lr):
        engine = pipeddp.HybridParallel(model, stages=2)
        ...
        return engine.state_dict()

    results = pipeddp.spawn(main, nprocs=4, args=(0.1,))   # one return value per rank

The whole job is bounded by ``timeout``: if any process is still running then,
every process is killed and ``TimeoutError`` names the ranks that did not
finish. A child's exception is re-raised in the parent with the child's
traceback (and the other children are stopped). The port is free when it is
chosen, but another program may take it before rank 0 listens on it (jobs
started side by side on one machine): a job whose rank 0 found it taken is
started again on another port, up to ``ATTEMPTS`` times in all.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.multiprocessing as mp

from . import lazy

__all__ = ["spawn", "free_port"]

#: how many times a job is started where each attempt finds its port taken (see the module docstring)
ATTEMPTS = 3
#: what the forkserver imports once for every job it forks: DDP's constructor imports ``torch._dynamo`` (about 2 s
#: of CPU), which every process of a job with replicas would otherwise pay on its own
PRELOAD = ["torch", "pipeddp", "torch._dynamo"]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(fn: Callable[..., Any], args_path: str, child_env: Dict[str, str], threads: Optional[int], out_dir: str,
         nprocs: int, start_method: str, deadline: float, timeout: float) -> None:
    """Start the job's processes and wait for all of them (killed at ``deadline``)."""
    ctx = mp.start_processes(_entry, args=(fn, args_path, child_env, threads, out_dir), nprocs=nprocs,
                             join=False, start_method=start_method)
    try:
        while not ctx.join(timeout=0.2):
            if time.monotonic() > deadline:
                running = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
                raise TimeoutError(
                    f"spawned job did not finish within {timeout:.0f} s; ranks still running: {running} "
                    "(all were killed)"
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        for p in ctx.processes:
            p.join(timeout=10)


def _entry(index: int, fn: Callable[..., Any], args_path: str, env: Dict[str, str], threads: Optional[int],
           out_dir: str) -> None:
    os.environ.update(env)
    args = torch.load(args_path, weights_only=False)
    os.environ["RANK"] = str(index)
    os.environ["LOCAL_RANK"] = str(index)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        try:
            result = fn(*args)
        except BaseException:
            lazy.failed()  # the exit does not hold the others (``lazy``): the parent stops them
            raise
        tmp = os.path.join(out_dir, f".result-{index}.tmp")
        torch.save(result, tmp)
        os.replace(tmp, os.path.join(out_dir, f"result-{index}.pt"))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 600.0,
    threads: Optional[int] = 1,
    env: Optional[Dict[str, str]] = None,
    start_method: Optional[str] = None,
) -> List[Any]:
    """Run ``fn(*args)`` in ``nprocs`` local processes; return each rank's return value.

    ``threads`` sets each child's intra-op thread count (default 1: processes
    share the machine's cores). ``env`` adds environment variables. Return values
    travel by ``torch.save``, so tensors and state dicts are fine. Arguments too:
    every process gets its own copy of ``args`` (a model passed in is never shared).

    ``start_method`` defaults to ``"forkserver"`` where the platform has it: a
    server process imports torch once (and what DDP imports: ``PRELOAD``) and
    every later job forks from it, which starts a 4-process job in a fraction of
    a second instead of several seconds of imports. As with ``"spawn"``, ``fn`` must be importable (defined at
    module level).

    Where another program takes the job's port before rank 0 listens on it,
    the job is started again on a new port (``ATTEMPTS`` in all), so what
    ``fn`` does before it joins its process group may run twice.
    """
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        if start_method == "forkserver":
            mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    child_env = {
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    if threads is not None:
        child_env["OMP_NUM_THREADS"] = str(threads)
    child_env.update(env or {})
    out_dir = tempfile.mkdtemp(prefix="pipeddp-spawn-")
    try:
        # Arguments go through a file, not multiprocessing's pickler: torch.multiprocessing would hand every
        # child the *same* shared-memory tensors, and replicas updating one shared model would corrupt it.
        args_path = os.path.join(out_dir, "args.pt")
        torch.save(tuple(args), args_path)
        deadline = time.monotonic() + timeout
        for attempt in range(1, ATTEMPTS + 1):
            try:
                _run(fn, args_path, child_env, threads, out_dir, nprocs, start_method, deadline, timeout)
                break
            except mp.ProcessRaisedException as exc:
                if attempt == ATTEMPTS or "EADDRINUSE" not in str(exc) or (env or {}).get("MASTER_PORT"):
                    raise
                child_env["MASTER_PORT"] = str(free_port())  # another program took the port first: a new one
                for name in os.listdir(out_dir):  # nothing a failed attempt left is taken for the next one's
                    if name.startswith("result-"):
                        os.remove(os.path.join(out_dir, name))
        results = []
        for i in range(nprocs):
            path = os.path.join(out_dir, f"result-{i}.pt")
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        return results
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
