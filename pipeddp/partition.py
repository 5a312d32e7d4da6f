"""Cut a sequence of layers into balanced contiguous stages.

A pipeline runs at the pace of its slowest stage, so the best cut minimises
the largest stage cost (the *bottleneck*)::

    costs     1  1  1  1  1  1  1  1 10
    greedy   [1  1  1  1  1][1  1  1 10]    bottleneck 13
    optimal  [1  1  1  1  1  1  1  1][10]   bottleneck 10

``solve`` finds the optimal contiguous min-max cut with a dynamic program
(O(n^2 k) for n layers and k stages, instant for any real model). Among the
cuts that reach the optimal bottleneck it picks the one with the smallest sum
of squared stage costs, so the other stages are as even as they can be too.

The time to move an activation to the next device counts: a cut after layer i
makes the link carry ``activation_bytes[i]``, and since the copy runs beside
the compute (its own stream) the segment costs ``max(compute, copy)``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from .profile import LayerCost, profile_layers, sample_microbatch

__all__ = ["solve", "block_move", "Partition", "partition", "METHODS"]

METHODS = ("time", "params", "memory", "uniform")

#: Bytes per second assumed between two distinct CUDA devices when no figure is given (PCIe 3 x16).
DEFAULT_LINK_BANDWIDTH = 12e9


def _segment_cost(prefix: Sequence[float], comm: Sequence[float], i: int, j: int, last: bool) -> float:
    """Cost of layers i..j-1 as one stage; a non-final stage also sends layer j-1's output."""
    compute = prefix[j] - prefix[i]
    return compute if last else max(compute, comm[j - 1])


def solve(costs: Sequence[float], stages: int, comm: Optional[Sequence[float]] = None) -> List[int]:
    """Optimal contiguous split of ``costs`` into ``stages`` non-empty parts.

    Returns the number of layers per stage. ``comm[i]`` is the cost of sending
    layer i's output to the next stage (default 0). Minimises the bottleneck
    exactly, then the sum of squared stage costs.
    """
    n = len(costs)
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if stages > n:
        raise ValueError(
            f"cannot cut {n} layers into {stages} stages: every stage needs at least one layer; "
            f"use at most {n} stages (devices), or split the model into more nn.Sequential children"
        )
    if any(c < 0 for c in costs):
        raise ValueError("layer costs must be >= 0")
    comm = list(comm) if comm is not None else [0.0] * n
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")

    def run(limit: Optional[float]) -> Tuple[List[List[float]], List[List[int]]]:
        # best[k][j]: objective for the first j layers in k stages; objective is the
        # bottleneck (limit None) or the sum of squares under the bottleneck limit.
        best = [[inf] * (n + 1) for _ in range(stages + 1)]
        arg = [[-1] * (n + 1) for _ in range(stages + 1)]
        best[0][0] = 0.0
        for k in range(1, stages + 1):
            last = k == stages
            for j in range(k, n - (stages - k) + 1):
                if last and j != n:
                    continue
                for i in range(k - 1, j):
                    if best[k - 1][i] == inf:
                        continue
                    seg = _segment_cost(prefix, comm, i, j, last)
                    if limit is None:
                        val = max(best[k - 1][i], seg)
                    else:
                        if seg > limit:
                            continue
                        val = best[k - 1][i] + seg * seg
                    if val < best[k][j]:
                        best[k][j] = val
                        arg[k][j] = i
        return best, arg

    best, _ = run(None)
    bottleneck = best[stages][n]
    tol = 1e-12 * max(1.0, abs(bottleneck))
    _, arg = run(bottleneck + tol)
    cuts = []
    j = n
    for k in range(stages, 0, -1):
        i = arg[k][j]
        cuts.append(j - i)
        j = i
    return cuts[::-1]


@dataclass
class Partition:
    """A cut of a model into stages, with the figures it was based on.

    ``balance[s]`` is the number of layers of stage s; ``stage_costs[s]`` its
    cost in the unit of ``method`` (seconds for ``"time"``, parameters for
    ``"params"``, bytes for ``"memory"``, layers for ``"uniform"``).
    """

    balance: List[int]
    method: str
    layers: List[LayerCost] = field(default_factory=list)
    layer_costs: List[float] = field(default_factory=list)
    stage_costs: List[float] = field(default_factory=list)

    @property
    def bottleneck(self) -> float:
        return max(self.stage_costs) if self.stage_costs else 0.0

    @property
    def ideal(self) -> float:
        """The bottleneck of a perfect split: total cost / stages."""
        return sum(self.stage_costs) / len(self.stage_costs) if self.stage_costs else 0.0

    def ranges(self) -> List[Tuple[int, int]]:
        """``(first, last+1)`` layer index of each stage."""
        out, start = [], 0
        for b in self.balance:
            out.append((start, start + b))
            start += b
        return out

    def table(self) -> Table:
        """A rich table: stage, layers, params, fwd+bwd ms, activation bytes out, share of bottleneck."""
        t = Table(title=f"partition by {self.method}: balance {self.balance}")
        for col in ("stage", "layers", "params", "fwd+bwd ms", "activation out", "share of bottleneck"):
            t.add_column(col, justify="right", overflow="fold")  # narrow output wraps a cell, never cuts it
        bott = self.bottleneck or 1.0
        for s, (a, b) in enumerate(self.ranges()):
            chunk = self.layers[a:b]
            names = f"{chunk[0].name}..{chunk[-1].name}" if len(chunk) > 1 else (chunk[0].name if chunk else "")
            ms = sum(c.time for c in chunk) * 1e3
            act = chunk[-1].activation_bytes if chunk else 0
            share = self.stage_costs[s] / bott if self.stage_costs else 0.0
            t.add_row(str(s), f"{a}-{b - 1} ({names})", f"{sum(c.params for c in chunk):,}", f"{ms:.2f}",
                      _human_bytes(act), f"{share:.0%}")
        return t

    def report(self) -> str:
        """The table as plain text (what ``print(partition)`` shows)."""
        buf = io.StringIO()
        Console(file=buf, width=160, force_terminal=False).print(self.table())
        return buf.getvalue()

    def __str__(self) -> str:
        return self.report()


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _stage_costs(balance: Sequence[int], costs: Sequence[float], comm: Sequence[float]) -> List[float]:
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    out, start = [], 0
    for s, b in enumerate(balance):
        out.append(_segment_cost(prefix, comm, start, start + b, s == len(balance) - 1))
        start += b
    return out


def check_balance(balance: Sequence[int], n_layers: int, stages: Optional[int] = None) -> List[int]:
    """Validate an explicit balance list and return it as a list of ints."""
    bal = list(balance)
    if not bal or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in bal):
        raise ValueError(f"balance must be a list of ints >= 1 (layers per stage), got {balance!r}")
    if sum(bal) != n_layers:
        raise ValueError(
            f"balance {bal} sums to {sum(bal)} but the model has {n_layers} layers; "
            "the numbers of layers per stage must add up to len(model)"
        )
    if stages is not None and len(bal) != stages:
        raise ValueError(f"balance {bal} has {len(bal)} stages but {stages} devices were given; give one entry per device")
    return bal


def partition(
    model: nn.Sequential,
    stages: int,
    *,
    method: Union[str, Sequence[int]] = "time",
    sample: Optional[Any] = None,
    chunks: int = 1,
    device: Optional[Union[str, torch.device]] = None,
    link_bandwidth: Optional[float] = None,
    repeat: int = 3,
    progress: Optional[Callable[[int, int], None]] = None,
) -> Partition:
    """Cut ``model`` into ``stages`` balanced contiguous stages.

    ``method`` is ``"time"`` (profile forward+backward of each layer on
    ``sample`` at micro-batch size, i.e. the sample's first of ``chunks``
    pieces), ``"params"`` (parameter count), ``"memory"`` (parameter bytes +
    output activation bytes; needs ``sample``), ``"uniform"`` (same number of
    layers) or an explicit list of layers per stage. ``link_bandwidth``
    (bytes/s) prices sending an activation between stages under ``"time"``;
    0 cost when it is None and the stages share a device type of CPU.
    ``progress(done, total)`` reports the profile's progress (see ``profile_layers``).
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"pipeddp partitions an nn.Sequential, got {type(model).__name__}; "
            "wrap your model's parts in order, e.g. nn.Sequential(block1, block2, head), "
            "or flatten it with pipeddp.models.flatten_sequential"
        )
    n = len(model)
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if stages > n:
        raise ValueError(
            f"the model has {n} layers but {stages} stages were asked for; every stage needs at least one "
            f"layer: use at most {n} devices"
        )
    if not isinstance(method, str):
        bal = check_balance(method, n, stages)
        layers = profile_layers(model, None)
        return Partition(bal, "explicit", layers, [1.0] * n, [float(b) for b in bal])
    if method not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; choose one of {METHODS} or give a list of layers per stage")
    if method in ("time", "memory") and sample is None:
        raise ValueError(
            f"method={method!r} measures the model on a sample batch: pass sample=<one input batch>, "
            "or use method='params' / 'uniform', which need none"
        )
    mb = sample_microbatch(sample, chunks) if sample is not None else None
    layers = profile_layers(model, mb, device=torch.device(device) if device is not None else None,
                            repeat=repeat, timed=method == "time", progress=progress)
    comm = [0.0] * n
    if method == "time":
        costs = [c.time for c in layers]
        if link_bandwidth:
            comm = [c.activation_bytes / link_bandwidth for c in layers]
    elif method == "params":
        costs = [float(c.params) for c in layers]
    elif method == "memory":
        costs = [float(c.param_bytes + c.activation_bytes) for c in layers]
    else:
        costs = [1.0] * n
    bal = solve(costs, stages, comm)
    return Partition(bal, method, layers, costs, _stage_costs(bal, costs, comm))


def block_move(costs: Sequence[float], stages: int) -> List[int]:
    """The block-move heuristic (Bárány and Grinberg, "Block partitions of sequences").

    Kept as a baseline for comparisons (it is what torchgpipe balances with), not
    used by pipeddp: starting from equal layer counts, it moves one element at a
    time from the block beside the lightest block towards it, and stops once the
    heaviest block exceeds the lightest by at most one largest element (costs
    normalised to [0, 1]). That stop rule is where it goes wrong: on
    ``[1]*8 + [10]`` into 2 it stops at ``[4, 5]`` (bottleneck 14, optimum 10).
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} stages")
    lo, hi = min(costs), max(costs)
    norm = [0.0] * n if hi == lo else [(c - lo) / (hi - lo) for c in costs]
    ends = [n // stages * (i + 1) for i in range(stages - 1)] + [n]

    def size(i: int) -> float:
        return sum(norm[(ends[i - 1] if i else 0):ends[i]])

    while True:
        heavy = max(range(stages), key=lambda i: (size(i), i))
        while True:
            light_size = min(size(i) for i in range(stages))
            if size(heavy) <= light_size + 1:
                return [e - s for s, e in zip([0] + ends[:-1], ends)]
            light = min((i for i in range(stages) if size(i) == light_size), key=lambda i: abs(i - heavy))
            donor = light - 1 if heavy < light else light + 1
            if heavy < light:
                ends[donor] -= 1
            else:
                ends[light] += 1
            if donor == heavy:
                break
