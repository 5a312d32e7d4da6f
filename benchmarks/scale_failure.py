"""A rank killed in a 16-process job: how every other rank ends, how long it takes, and what it says.

A stage-mode job (2 stages x N/2 replicas, gloo, one intra-op thread per process, a tiny MLP) is started as N
plain processes (as ``tests/fault_job.py`` is at N = 4: ``pipeddp.spawn`` and torchrun stop the survivors
themselves), and one rank, the victim, SIGKILLs itself:

    batch       in step 2's first agreement (the call and batch check, ``rows.gather_rows`` kind 0), before its row
    loss        in step 2's second agreement (the loss and the non-finite vote, kind 1), before its row
    compute     in step 2's forward of micro-batch 1 (the suite's own case, ``tests/test_reliability.py``)
    groups      while the process groups are made (``groups.make_groups``): at its ``--at``-th ``new_group``

Every other rank must end within the engine's ``timeout`` (plus a margin for 16 processes on a few cores), with an
error that names the rank that died. Per case and rank: how it ended (the error's type and first words, or a hang:
still running ``timeout + margin`` after the victim died), and how long after the victim's death.

    flock /tmp/pipeddp-mp.lock python benchmarks/scale_failure.py            # N = 16, every case
    flock /tmp/pipeddp-mp.lock python benchmarks/scale_failure.py --quick   # N = 4, the batch case
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence

CASES = ("batch", "loss", "compute", "groups")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _die(rank: int, what: str) -> None:
    """Say when, then SIGKILL this process (the parent measures the others from this moment)."""
    print("DIED " + json.dumps({"rank": rank, "at": time.time(), "what": what}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def worker(case: str, victim: int, timeout: float, at: int) -> int:
    """One process of the job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the parent)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipeddp
    from pipeddp.distributed import rows

    torch.set_num_threads(1)
    if os.environ.get("PIPEDDP_NCCL_RULES_FROM"):  # the suite's run: point-to-point messages under NCCL's rules
        sys.path.insert(0, os.environ["PIPEDDP_NCCL_RULES_FROM"])
        import nccl_rules
        nccl_rules.install()
    rank = int(os.environ["RANK"])
    step = [0]
    if rank == victim and case in ("batch", "loss"):
        kind, real = CASES.index(case), rows.gather_rows

        def gather(*args: Any, **kwargs: Any) -> Any:
            if step[0] == 2 and kwargs["kind"] == kind:
                _die(rank, f"step 2, agreement kind {kind}")
            return real(*args, **kwargs)
        rows.gather_rows = gather  # type: ignore[assignment]  # this process's own engine only
    if rank == victim and case == "groups":
        calls, new_group = [0], dist.new_group

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == at:
                _die(rank, f"new_group call {at}")
            return new_group(*args, **kwargs)
        dist.new_group = counted  # type: ignore[assignment]

    class Tripwire(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if case == "compute" and rank == victim and step[0] == 2 and self.calls == 2:
                _die(rank, "step 2, forward of micro-batch 1")
            return x

    torch.manual_seed(0)
    wire = Tripwire()
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), wire, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    started = time.time()
    try:
        engine = pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=2, balance=[2, 4],
                                        timeout=timedelta(seconds=timeout), log_every=None)
        built = time.time()
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        for step[0] in range(5):
            wire.calls = 0
            x, y = torch.randn(8, 8), torch.randn(8, 8)
            opt.zero_grad()
            engine.train_step(x, y, nn.functional.mse_loss)
            opt.step()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then raised as any script would
        notes = [n for n in getattr(exc, "__notes__", [])]
        print("ENDED " + json.dumps({"rank": rank, "at": time.time(), "type": type(exc).__name__,
                                     "error": str(exc), "notes": notes, "started": started}), flush=True)
        raise
    print("ENDED " + json.dumps({"rank": rank, "at": time.time(), "type": "", "error": "finished", "notes": [],
                                 "started": started, "built": built}), flush=True)
    engine.close()
    return 0


def run_case(case: str, n: int, victim: int, timeout: float, margin: float, at: int,
             env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Start the job, wait for the victim's death, then for every other rank; what each said and when (``env``:
    more of the processes' environment)."""
    sys.path.insert(0, ROOT)
    from pipeddp.distributed.launch import free_port

    port, procs = free_port(), []
    for rank in range(n):
        each = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                    **(env or {}))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", case, str(victim),
                                       str(timeout), str(at)], env=each, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    t0 = time.time()
    deadline = t0 + 300
    while procs[victim].poll() is None and time.time() < deadline:
        time.sleep(0.05)
    ended: Dict[int, float] = {}
    hard = time.time() + timeout + margin
    while len(ended) < n - 1 and time.time() < hard:
        for rank, p in enumerate(procs):
            if rank != victim and rank not in ended and p.poll() is not None:
                ended[rank] = time.time()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    outs = [p.communicate() for p in procs]
    died_line = [ln for ln in outs[victim][0].splitlines() if ln.startswith("DIED ")]
    died = json.loads(died_line[0][5:]) if died_line else None
    ranks: List[Dict[str, Any]] = []
    for rank, (out, err) in enumerate(outs):
        if rank == victim:
            continue
        line = [ln for ln in out.splitlines() if ln.startswith("ENDED ")]
        said = json.loads(line[0][6:]) if line else {"type": "", "error": "", "notes": []}
        since = died["at"] if died else t0
        ranks.append({
            "rank": rank, "exit": procs[rank].returncode, "hung": rank not in ended,
            "raised_after_s": round(said["at"] - since, 2) if "at" in said else None,
            "exited_after_s": round(ended[rank] - since, 2) if rank in ended else None,
            "type": said["type"], "error": said["error"], "notes": said["notes"],
            "names_victim": f"rank {victim}" in said["error"] + " ".join(said["notes"]),
            "stderr_tail": err[-1500:]})
    return {"case": case, "n": n, "victim": victim, "timeout": timeout, "died": died,
            "victim_stderr": outs[victim][1][-1500:], "ranks": ranks}


def summary(result: Dict[str, Any]) -> str:
    """A few lines per case: the kinds of ending, the slowest, and the distinct first words."""
    rs = result["ranks"]
    lines = [f"case {result['case']}: N = {result['n']}, victim rank {result['victim']} "
             f"({result['died']['what'] if result['died'] else 'did not die'}), timeout {result['timeout']:.0f} s"]
    hung = [r["rank"] for r in rs if r["hung"]]
    named = [r["rank"] for r in rs if r["names_victim"]]
    took = [r["exited_after_s"] for r in rs if r["exited_after_s"] is not None]
    lines.append(f"  ended: {len(rs) - len(hung)}/{len(rs)}; hung: {hung or 'none'}; victim named by "
                 f"{len(named)}/{len(rs)}; exited after {min(took, default=0):.1f} to {max(took, default=0):.1f} s")
    kinds = Counter((r["type"], r["error"][:150]) for r in rs)
    for (kind, words), count in kinds.most_common():
        who = [r["rank"] for r in rs if (r["type"], r["error"][:150]) == (kind, words)]
        lines.append(f"  {count} x ranks {who}: {kind}: {words}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1], int(argv[2]), float(argv[3]), int(argv[4]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=16, help="processes (even: 2 stages x n/2 replicas)")
    p.add_argument("--cases", default=",".join(CASES), help=f"some of {CASES}")
    p.add_argument("--victim", type=int, default=5, help="the rank that dies")
    p.add_argument("--timeout", type=float, default=30.0, help="the engine's timeout, seconds")
    p.add_argument("--margin", type=float, default=30.0, help="beyond the timeout before a rank counts as hung")
    p.add_argument("--at", type=int, default=3, help="groups: the victim dies at its at-th new_group call")
    p.add_argument("--out", default=None, help="default results/scale_failure[_quick].json")
    p.add_argument("--quick", action="store_true", help="smoke run: N = 4, the batch case, victim rank 3")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.cases, args.victim = 4, "batch", 3
    args.out = args.out or os.path.join(ROOT, "results", f"scale_failure{'_quick' if args.quick else ''}.json")
    results = []
    for case in args.cases.split(","):
        result = run_case(case, args.n, args.victim, args.timeout, args.margin, args.at)
        results.append(result)
        print(summary(result), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"n": args.n, "victim": args.victim, "timeout": args.timeout, "results": results}, f, indent=1)
    print(f"-> {args.out}")
    return 0 if all(not r["hung"] and r["names_victim"] for res in results for r in res["ranks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
