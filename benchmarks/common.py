"""The harness every benchmark's figures rest on: timing, spawned jobs, gradient checks, machine stamp, report.

The host's speed drifts, so configurations are interleaved round by round and compared by medians of per-round
ratios (benchmarks/README.md, "How a figure is timed"): ``interleaved`` in one process, ``barrier_rounds`` in a job.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Grads = Dict[str, torch.Tensor]
ROOT = Path(__file__).resolve().parent.parent
INTERLEAVED = "one process; every configuration once per round, rotating order; ratios: medians of per-round ratios"
BARRIER = ("one spawned gloo job; every configuration once per round, rotating order, timed on rank 0 between "
           "barriers; ratios: medians of per-round ratios")


#: Where the configurations run: "cpu", or "cuda" (``--device cuda``: one GPU per process of a job).
DEVICE = "cpu"
#: On CUDA, per configuration timed in this process: the most memory it allocated on any device (bytes).
PEAK_MEMORY: Dict[str, int] = {}


def use_device(kind: str) -> None:
    global DEVICE
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this machine has no usable CUDA device")
    DEVICE = kind


def devices(n: int, first: int = 0) -> List[str]:
    """``n`` stage devices: the CPU, or GPUs from ``first`` on (stages share GPUs where there are few)."""
    return ["cpu"] * n if DEVICE == "cpu" else [f"cuda:{(first + i) % torch.cuda.device_count()}" for i in range(n)]


def here() -> torch.device:
    """This process's device: the CPU, or its rank's GPU."""
    return torch.device(devices(1, dist.get_rank() if dist.is_initialized() else 0)[0])


@contextlib.contextmanager
def without_tf32() -> Iterator[None]:
    """TF32 off for a gradient check. On Ampere and later GPUs torch runs convolutions in TF32 by default, whose
    10-bit mantissa moves resnet50's gradients by ~1e-3 between any two orders of summation (an H200: 1e-3 between
    accumulation and the pipeline with it, 2e-6 without), which would drown a real difference; timing keeps the
    defaults."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def synced() -> float:
    """The clock, after the GPUs have finished what was queued (on the CPU: the clock)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def timed_call(fn: Callable[[], Any], name: str = "") -> Tuple[float, Any]:
    """Seconds of one call and its result: a monotonic clock on the CPU; on CUDA, events on every device's
    current stream (pipeddp's steps end with those streams waiting for the stages), the longest span."""
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out
    gpus = range(torch.cuda.device_count())
    begin, end = ([torch.cuda.Event(enable_timing=True) for _ in gpus] for _ in range(2))
    for d in gpus:
        torch.cuda.reset_peak_memory_stats(d)
        begin[d].record(torch.cuda.current_stream(d))
    out = fn()
    for d in gpus:
        end[d].record(torch.cuda.current_stream(d))
        end[d].synchronize()
    PEAK_MEMORY[name] = max([PEAK_MEMORY.get(name, 0)] + [torch.cuda.max_memory_allocated(d) for d in gpus])
    return max(b.elapsed_time(e) for b, e in zip(begin, end)) / 1e3, out


def interleaved(fns: Mapping[str, Callable[[], Any]], rounds: int, warmup: int = 1) -> Dict[str, List[float]]:
    """Seconds per call by name: every configuration once per round, in an order rotated by one each round (none
    always follows the same neighbour); the first ``warmup`` rounds pay for lazy initialisation and are dropped."""
    names = list(fns)
    if rounds < 1 or warmup < 0 or not names:
        raise ValueError(f"need rounds >= 1, warmup >= 0 and a configuration, got {rounds}, {warmup}, {names}")
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            elapsed = timed_call(fns[name], name)[0]
            if r >= warmup:
                times[name].append(elapsed)
    return times


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of ``a[i] / b[i]`` over rounds (b's speedup when a is the baseline): within a round the host's
    drift cancels, and the median drops rounds hit by a hiccup."""
    if len(a) != len(b) or not a:
        raise ValueError(f"series of {len(a)} and {len(b)} rounds: they must come from the same rounds")
    return statistics.median(x / y for x, y in zip(a, b))


def median_ms(seconds: Sequence[float]) -> float:
    """Median of durations in seconds, in milliseconds."""
    return statistics.median(seconds) * 1e3


def fmt(value: Optional[float], spec: str = ".0f", suffix: str = "") -> str:
    """A table cell: ``value`` formatted, or "-" where there is none."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def host_busy_seconds() -> float:
    """Busy CPU seconds of the whole machine since boot, from /proc/stat (0 where there is none): busy time
    beyond a benchmark's own CPU time is other processes competing for the cores."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq = (fields + [0] * 7)[:7]
    return (user + nice + system + irq + softirq) / _TICK


def proc_status() -> Dict[str, int]:
    """This process's /proc/self/status numbers (VmRSS and VmHWM in kB, Threads, ...)."""
    with open("/proc/self/status") as f:
        fields = (line.split(":", 1) for line in f if ":" in line)
        return {k: int(v.split()[0]) for k, v in fields if v.split() and v.split()[0].isdigit()}


def parser(doc: str, quick: str, out: Optional[str] = None, out_help: str = "", spawns: bool = False,
           device: bool = True) -> argparse.ArgumentParser:
    """The flags every script has: --quick (a smoke run), --seed, --out (default results/<script>[_quick].json),
    --device unless it measures CPU effects only, and --timeout where it spawns a job: each job is bounded."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=out, help="JSON path (default "
                   f"{out or out_help or 'results/<script>[_quick].json'})")
    if device:
        p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the configurations run")
    if spawns:
        p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole spawned job")
    return p


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``least`` (anything else is the parser's error)."""
    def parse(text: str) -> int:
        if int(text) < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {text}")
        return int(text)
    return parse


def init_job(timeout: float, device: str = "cpu") -> int:
    """Join the spawned job's group (gloo; nccl too on CUDA), every collective bounded by ``timeout`` seconds."""
    use_device(device)
    dist.init_process_group("gloo" if device == "cpu" else "cpu:gloo,cuda:nccl",
                            timeout=datetime.timedelta(seconds=timeout))
    if device == "cuda":
        torch.cuda.set_device(here())
    torch.set_num_threads(1)
    return dist.get_rank()


def log0(msg: str) -> None:
    """Print from rank 0 only (or from the one process outside a job): one line per event, not per rank."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def gather(obj: Any) -> Optional[List[Any]]:
    """Every rank's ``obj`` on rank 0 (None on the other ranks; ``[obj]`` outside a job)."""
    if not dist.is_initialized():
        return [obj]
    out: Optional[List[Any]] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def check_same(*tensors: Any) -> None:
    """Raise unless every rank holds the same values (models and data built from the same seed): a checksum."""
    with torch.no_grad():
        mine = tuple(float(sum(p.double().sum() for p in t.parameters())) if isinstance(t, nn.Module)
                     else float(t.double().sum()) for t in tensors)
    sums = gather(mine)
    if sums is not None and len(set(sums)) != 1:  # rank 0 fails, and spawn stops the job
        raise RuntimeError(f"ranks built different models or data: {sums}")


def on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on rank 0 and sent to every rank (a cut profiled once, as HybridParallel does)."""
    got = [fn() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(got, src=0)
    return got[0]


@dataclass
class StepTime:
    """One barrier-timed step on one rank (seconds): ``wall`` from the common start to every rank done,
    ``own`` this rank's step alone, ``cpu`` this process's CPU time, ``busy`` the whole machine's busy CPU time."""

    wall: float
    own: float
    cpu: float
    busy: float


def barrier_timed(step: Optional[Callable[[], Any]], name: str = "") -> Tuple[StepTime, Any]:
    """All ranks barrier, ``step()`` runs (None: this rank sits the step out), all ranks barrier again: the wall
    time counts until the slowest rank is done (a waiting rank's ``cpu`` shows whether it spins)."""
    barrier = dist.barrier if dist.is_initialized() else (lambda: None)
    barrier()
    busy0, cpu0 = host_busy_seconds(), time.process_time()
    t0 = time.perf_counter()
    own, result = timed_call(step, name) if step is not None else (0.0, None)
    barrier()
    wall = time.perf_counter() - t0
    return StepTime(wall, own, time.process_time() - cpu0, host_busy_seconds() - busy0), result


def barrier_rounds(
    steps: Mapping[str, Optional[Callable[[], Any]]], rounds: int, warmup: int = 0, *, extra: int = 0,
    before: Optional[Callable[[str], None]] = None,
    after_round: Optional[Callable[[Dict[str, StepTime]], bool]] = None,
) -> Tuple[Dict[str, List[StepTime]], Dict[str, List[Any]]]:
    """``interleaved`` for a job (every rank calls it alike), each step timed by ``barrier_timed``, ``before(name)``
    before each; after each timed round ``after_round`` sees this rank's readings and says whether to stop (alike
    on every rank), so up to ``extra`` rounds may replace disturbed ones. The readings and results by name."""
    names = list(steps)
    times: Dict[str, List[StepTime]] = {n: [] for n in names}
    results: Dict[str, List[Any]] = {n: [] for n in names}
    start = time.perf_counter()
    total = warmup + rounds + (extra if after_round is not None else 0)
    for r in range(total):
        timed_round, got = r >= warmup, {}
        k = r % len(names)
        for name in names[k:] + names[:k]:
            if before is not None:
                before(name)
            got[name], result = barrier_timed(steps[name], name)
            if timed_round:
                times[name].append(got[name])
                results[name].append(result)
        log0(f"    round {r + 1}/{total}{'' if timed_round else ' (warm-up)'}: {time.perf_counter() - start:.0f} s")
        if timed_round and after_round is not None and after_round(got):
            break
    return times, results


def machine_info() -> Dict[str, Any]:
    """What a reader needs to judge a number later: software versions, cores, platform, date."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "usable_cpus": usable, "torch_threads": torch.get_num_threads(), "argv": sys.argv}


def pipeddp_commit() -> str:
    """The checkout's commit, with "-dirty" if pipeddp/ has local changes: the code a figure measured."""
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "pipeddp"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("-dirty" if dirty else "")


def grad_snapshot(module: nn.Module) -> Grads:
    """Copies of the gradients by parameter name (the next zero_grad frees them); every configuration keeps the
    plain model's parameter names, so snapshots of different configurations compare name by name."""
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def grad_rel_diff(ref: Grads, got: Union[nn.Module, Grads]) -> float:
    """max |g - g_ref| / max |g_ref| over all parameters; inf if the sets of parameters with a gradient differ
    (a benchmark that times a wrong result measures nothing)."""
    grads = grad_snapshot(got) if isinstance(got, nn.Module) else got
    if set(ref) != set(grads):
        return float("inf")
    diff = scale = 0.0
    for k, r in ref.items():
        diff = max(diff, (grads[k] - r).abs().max().item())
        scale = max(scale, r.abs().max().item())
    return diff / (scale or 1.0)


def write_json(path: Union[str, os.PathLike], payload: Any, commit: Optional[str] = None) -> Path:
    """Write ``payload`` with ``machine_info()`` and the commit (taken when the run started; default now)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: Dict[str, Any] = {"machine": machine_info(), "pipeddp_commit": commit or pipeddp_commit()}
    doc.update(payload if isinstance(payload, Mapping) else {"data": payload})
    # tensors become lists, anything else JSON has no type for (a LayerCost, a set) its string
    out.write_text(json.dumps(doc, indent=2, default=lambda v: v.tolist() if isinstance(v, torch.Tensor) else str(v))
                   + "\n")
    return out


class Run:
    """One run of a script, the one report writer: its clock, tables and JSON. The commit is read at the start (the
    spawned processes import the code as it was then); tables are 160 wide (in a pipe rich would assume 80)."""

    def __init__(self, benchmark: str, args: argparse.Namespace, timing: str = INTERLEAVED) -> None:
        use_device(getattr(args, "device", "cpu"))
        args.out = args.out or f"results/{benchmark}{'_quick' if args.quick else ''}.json"
        self.benchmark, self.out = benchmark, args.out
        self.settings: Dict[str, Any] = {**vars(args), "timing": timing}  # every flag, as resolved
        self.commit = pipeddp_commit()
        self.started = time.perf_counter()
        self.console = Console(width=160)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
              caption: Optional[str] = None) -> None:
        """Print a table (first column left, the rest right-aligned); cells: None as "-", floats with 2 decimals."""
        table = Table(title=title, caption=caption)
        for i, col in enumerate(columns):
            table.add_column(col, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*("-" if c is None else f"{c:.2f}" if isinstance(c, float) else str(c) for c in row))
        self.console.print(table)

    def targets(self, rows: Sequence[Sequence[Any]], title: str = "against the targets") -> List[Dict[str, Any]]:
        """Print (target, measured, goal[, met]) rows as one table; return them as JSON records."""
        self.table(title, ["target", "measured", "goal", "met"],
                   [list(r[:3]) + ["-" if len(r) < 4 else "met" if r[3] else "NOT met"] for r in rows])
        return [dict(zip(("target", "measured", "goal", "met"), r)) for r in rows]

    def finish(self, settings: Optional[Mapping[str, Any]] = None, **payload: Any) -> Path:
        """Write the JSON (benchmark, the flags and ``settings``, elapsed_s, payload, machine, commit); say where."""
        elapsed = time.perf_counter() - self.started
        doc = {"benchmark": self.benchmark, "settings": {**self.settings, **(settings or {})}, "elapsed_s": elapsed,
               **({"peak_cuda_memory_bytes": PEAK_MEMORY} if PEAK_MEMORY else {}), **payload}
        path = write_json(self.out, doc, commit=self.commit)
        self.console.print(f"wrote {path} ({elapsed / 60:.1f} min)")
        return path
