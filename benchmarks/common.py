"""Helpers shared by the benchmark scripts.

The host's speed drifts (by ~25 % over minutes on the CI machines), so a
benchmark never compares medians taken minutes apart. Configurations are
interleaved step by step (A B C, B C A, C A B, ...) and compared by the median
of per-round ratios, which cancels any drift slower than one round.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from rich.console import Console
from rich.table import Table

__all__ = [
    "interleaved", "median_ratio", "median_ms", "parallel_probe", "machine_info", "pipeddp_commit", "write_json",
    "print_table", "fmt", "grad_snapshot", "grad_rel_diff", "LossFn", "Workload", "bubble_bound",
    "host_cpu_seconds",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Workload:
    """One benchmark model: how to build it and its batch, its loss, and the defaults of a full run.

    ``batch`` takes no argument (a fixed batch) or, where the script varies it,
    the batch size; ``batch_size`` is then the default.
    """

    describe: str
    build: Callable[[], torch.nn.Sequential]
    batch: Callable[..., Tuple[torch.Tensor, torch.Tensor]]
    loss_fn: LossFn
    rounds: int
    warmup: int = 1
    max_retries: int = 0
    batch_size: Optional[int] = None


def bubble_bound(m: int, p: int) -> float:
    """Best possible speedup of p equal stages over m micro-batches: the fill/drain bubble costs p-1 slots."""
    return m * p / (m + p - 1)


def interleaved(fns: Mapping[str, Callable[[], Any]], rounds: int, warmup: int = 1) -> Dict[str, List[float]]:
    """Time every configuration once per round; return seconds per call, by name.

    The order rotates by one each round (round r starts at configuration
    r mod k) so that no configuration always runs right after the same
    neighbour (caches, allocator state, CPU boost). The first ``warmup`` rounds
    are run but dropped: they pay for lazy initialisation and allocator growth.
    Round i of every list comes from the same stretch of time, which is what
    ``median_ratio`` relies on.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    names = list(fns)
    if not names:
        raise ValueError("no configuration to time")
    times: Dict[str, List[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            start = time.perf_counter()
            fns[name]()
            elapsed = time.perf_counter() - start
            if r >= warmup:
                times[name].append(elapsed)
    return times


def median_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of ``a[i] / b[i]`` over rounds (a speedup of b over a when a is the baseline).

    Per-round ratios compare two runs made seconds apart, so a drift of the
    host's speed cancels; the median drops rounds hit by a hiccup.
    """
    if len(a) != len(b):
        raise ValueError(f"the two series have different lengths ({len(a)} and {len(b)}); they must come from the same rounds")
    if not a:
        raise ValueError("empty series")
    return statistics.median(x / y for x, y in zip(a, b))


def median_ms(seconds: Sequence[float]) -> float:
    """Median of a list of durations in seconds, in milliseconds (for tables and JSON)."""
    return statistics.median(seconds) * 1e3


def parallel_probe(workers: int = 2, size: int = 256, reps: int = 50) -> Tuple[Callable[[], None], Callable[[], None]]:
    """A fixed 1-thread matmul kernel: ``(solo, together)`` runs it once, or once on each of ``workers`` threads.

    Why: a VM's cores are not always all there (neighbours, SMT siblings,
    steal). Timed inside ``interleaved``, ``workers * t_solo / t_together`` is
    the parallel speedup the host really offered in that round, the ceiling of
    any multi-core speedup measured next to it. The kernel fits in L2, so this
    measures cores, not memory bandwidth.
    """
    a, b = torch.randn(size, size), torch.randn(size, size)
    outs = [torch.empty(size, size) for _ in range(workers)]

    def kernel(out: torch.Tensor) -> None:
        torch.set_num_threads(1)  # OpenMP settings are per thread: a new thread would use every core
        for _ in range(reps):
            torch.mm(a, b, out=out)

    def solo() -> None:
        kernel(outs[0])

    def together() -> None:
        threads = [threading.Thread(target=kernel, args=(o,)) for o in outs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return solo, together


def machine_info() -> Dict[str, Any]:
    """What a reader needs to judge a number later: software versions, cores, platform, date."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable,
        "torch_threads": torch.get_num_threads(),
        "argv": sys.argv,
    }


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def host_cpu_seconds() -> Tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat ((0, 0) where there is none).

    The host is shared: busy time beyond a benchmark's own processes' CPU time
    during a step is other processes competing for the cores, and steal is the
    hypervisor taking them away. Both mark a step as disturbed.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / _TICK, steal / _TICK


def pipeddp_commit() -> str:
    """The checkout's commit, with "-dirty" if pipeddp/ has local changes: the code a figure measured."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "pipeddp"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("-dirty" if dirty else "")


def grad_snapshot(model: torch.nn.Module) -> List[Optional[torch.Tensor]]:
    """Copies of the gradients: the next step's zero_grad would free them."""
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def grad_rel_diff(ref: Sequence[Optional[torch.Tensor]], model: torch.nn.Module) -> float:
    """max |g - g_ref| / max |g_ref| over all parameters (a pipeline keeps the model's parameter order).

    A benchmark that times a wrong result measures nothing: the scripts that time
    training steps check their configurations' gradients against a reference
    (the plain model, or accumulation over the same micro-batches) with this.
    """
    params = list(model.parameters())
    if len(params) != len(ref):
        return float("inf")
    diff = scale = 0.0
    for r, p in zip(ref, params):
        if (r is None) != (p.grad is None):
            return float("inf")
        if r is not None:
            diff = max(diff, (p.grad - r).abs().max().item())
            scale = max(scale, r.abs().max().item())
    return diff / (scale or 1.0)


def write_json(path: Union[str, os.PathLike], payload: Any) -> Path:
    """Write ``payload`` (with ``"machine": machine_info()`` and ``"pipeddp_commit"`` added) as indented JSON.

    Parent directories are created, so a fresh checkout can write to
    ``results/...`` directly. Returns the path written.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: Dict[str, Any] = {"machine": machine_info(), "pipeddp_commit": pipeddp_commit()}
    if isinstance(payload, Mapping):
        doc.update(payload)
    else:
        doc["data"] = payload
    out.write_text(json.dumps(doc, indent=2, default=_jsonable) + "\n")
    return out


def _jsonable(value: Any) -> Any:
    """Fallback for json.dump: tensors, torch sizes/devices and paths become plain values."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (torch.Size, tuple, set)):
        return list(value)
    return str(value)


def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: floats with ``digits`` decimals, None as a dash, the rest as str."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    console: Optional[Console] = None,
    caption: Optional[str] = None,
    digits: int = 2,
) -> Table:
    """Print ``rows`` as a rich table (numbers right-aligned) and return it.

    Cells go through ``fmt``; pass pre-formatted strings for anything else.
    The console is at least 160 columns wide so that wide tables stay one line
    per row when the output is a file or a pipe (rich assumes 80 there).
    """
    console = console or Console(width=max(160, Console().width))
    table = Table(title=title, caption=caption)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(fmt(c, digits) for c in row))
    console.print(table)
    return table
