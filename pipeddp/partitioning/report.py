"""What the partitioner found, and ``partition``, which finds it.

``partition(model, stages, method=...)`` measures the layers (``profile``),
cuts them (``solve``) and returns a ``Partition``: the balance (layers per
stage) with the per-layer and per-stage figures it was based on, printable
as a table::

    partition by time: balance [11, 12]
    stage | layers                  | params    | fwd+bwd ms | activation out | share of bottleneck
      0   | 0-10 (conv1..layer2_3)  | 1,444,928 |     412.30 |        4.0 MiB |                100%
      1   | 11-22 (layer3_0..fc)    |24,112,104 |     405.77 |      125.0 KiB |                 98%

A column that was not measured (no ``sample``, or a method that does not time
the layers) reads "not measured", and a note under the table says why and how
to measure it: a 0.00 there would read as a measured zero.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from ..runtime.warn import warn
from .profile import LayerCost, profile_layers, sample_microbatch
from .solve import check_stage_count, solve, stage_costs

__all__ = ["Partition", "partition", "check_balance", "check_model", "METHODS", "HeavyLayerWarning"]

METHODS = ("time", "params", "memory", "uniform")
#: what the table shows in a column the partitioner did not measure
NOT_MEASURED = "not measured"


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
    #: whether ``layers`` hold measured fwd+bwd times (only ``"time"`` runs the layers with a clock)
    timed: bool = False
    #: whether ``layers`` hold measured activation sizes (any method given a ``sample``)
    sized: bool = False

    @property
    def bottleneck(self) -> float:
        return max(self.stage_costs) if self.stage_costs else 0.0

    @property
    def ideal(self) -> float:
        """The bottleneck of a perfect split: total cost / stages."""
        return sum(self.stage_costs) / len(self.stage_costs) if self.stage_costs else 0.0

    def recut(self, stages: int) -> "Partition":
        """The same measurements cut into ``stages`` stages, as ``partition`` cuts them (no link priced, as the
        engines measure): ``virtual_stages="auto"`` weighs one and two stages per device without profiling
        twice. A cut of that many stages already is kept as it is (an explicit balance stays the user's)."""
        if len(self.balance) == stages:
            return self
        balance = solve(self.layer_costs, stages)
        return replace(self, balance=balance,
                       stage_costs=stage_costs(balance, self.layer_costs, [0.0] * len(self.layer_costs)))

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
            ms = f"{sum(c.time for c in chunk) * 1e3:.2f}" if self.timed else NOT_MEASURED
            act = _human_bytes(chunk[-1].activation_bytes if chunk else 0) if self.sized else NOT_MEASURED
            share = self.stage_costs[s] / bott if self.stage_costs else 0.0
            t.add_row(str(s), f"{a}-{b - 1} ({names})", f"{sum(c.params for c in chunk):,}", ms, act, f"{share:.0%}")
        note = self.unmeasured_note()
        if note:
            t.caption = note
        return t

    def unmeasured_note(self) -> str:
        """Why a column reads "not measured" and how to measure it ("" when every column was measured)."""
        missing = [what for what, have in (("fwd+bwd ms", self.timed), ("activation out", self.sized)) if not have]
        if not missing:
            return ""
        if self.method == "explicit":
            why = "an explicit balance (a list of layers per stage) measures nothing"
        elif not self.sized:
            why = f"balance {self.method!r} was given no sample"
        else:
            why = f"balance {self.method!r} does not time the layers"
        return (f"{' and '.join(missing)}: not measured, {why}; pass sample=<one input batch> with "
                "balance='time' to measure " + ("them" if len(missing) > 1 else "it"))

    def report(self) -> str:
        """The table as plain text (what ``print(partition)`` shows)."""
        buf = io.StringIO()
        Console(file=buf, width=160, force_terminal=False).print(self.table())
        return buf.getvalue()

    def __str__(self) -> str:
        return self.report()


class HeavyLayerWarning(UserWarning):
    """One layer costs more than a stage's share of the model: no cut between layers can balance the stages."""


_UNITS = {"time": "measured time", "memory": "measured memory"}
#: how far over a stage's share a layer must be to warn: its stage is then at least this much slower than a balanced one
HEAVY_MARGIN = 0.25


def warn_heavy_layers(names: Sequence[str], layers: Sequence[nn.Module], costs: Sequence[float], stages: int,
                      method: str) -> None:
    """Warn (``HeavyLayerWarning``) naming every layer that clearly holds more than 1/``stages`` of the total.

    The partitioner cuts between layers, so such a layer alone makes its stage
    the bottleneck whatever the cut; the fix is to split it, which the message
    says how to do. "Clearly": by more than ``HEAVY_MARGIN`` of a share, so
    that measuring noise does not warn where every cut is as balanced as the
    layers allow (six equal layers on six stages, one timed 10% high).
    """
    total = sum(costs)
    if stages < 2 or total <= 0:
        return
    heavy = [i for i, c in enumerate(costs) if c > (1 + HEAVY_MARGIN) * total / stages]
    if not heavy:
        return
    named = ", ".join(f"layer {i} ({names[i]!r}, {type(layers[i]).__name__}: {costs[i] / total:.1%})" for i in heavy)
    raise_to = "holds" if len(heavy) == 1 else "each hold"
    warn(
        f"{named} {raise_to} more than a stage's share ({1 / stages:.1%} for {stages} stages) of the model's "
        f"{_UNITS.get(method, method)}: no cut between layers can balance the stages. Split it into finer layers: "
        "pipeddp.tools.models.flatten_sequential(model, sample) opens nested containers, nn.ModuleList loops and "
        "nn.TransformerEncoder into their layers; or write the layer as several layers of the nn.Sequential",
        HeavyLayerWarning)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def check_model(model: Any) -> nn.Sequential:
    """The one check (and message) that a model can be cut: a non-empty ``nn.Sequential``."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"pipeddp cuts an nn.Sequential into stages, got {type(model).__name__}. Flatten it with "
            "pipeddp.tools.models.flatten_sequential(model, sample) (it opens nested containers, keeps residual "
            "blocks whole and checks the result against model(sample)), or wrap the parts of your model in "
            "order, e.g. nn.Sequential(model.features, nn.Flatten(), model.classifier)"
        )
    if len(model) == 0:
        raise ValueError("the model is an empty nn.Sequential")
    return model


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
        raise ValueError(f"balance {bal} has {len(bal)} stages but {stages} devices were given; "
                         "give one entry per device")
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
    init: Optional[Callable[[nn.Module], None]] = None,
) -> Partition:
    """Cut ``model`` into ``stages`` balanced contiguous stages.

    ``method`` is ``"time"`` (profile forward+backward of each layer on
    ``sample`` at micro-batch size, i.e. the sample's first of ``chunks``
    pieces), ``"params"`` (parameter count), ``"memory"`` (parameter bytes +
    output activation bytes; needs ``sample``), ``"uniform"`` (same number of
    layers) or an explicit list of layers per stage. ``link_bandwidth``
    (bytes/s) prices sending an activation between stages under ``"time"``;
    0 cost when it is None and the stages share a device type of CPU.
    ``progress(done, total)`` reports the profile's progress (see ``profile_layers``). ``init``: how a
    model on the meta device is initialised while each layer is profiled (as the engines' ``init=``).
    """
    check_model(model)
    n = len(model)
    check_stage_count(stages, n)
    if not isinstance(method, str):
        bal = check_balance(method, n, stages)
        layers = profile_layers(model, None)
        return Partition(bal, "explicit", layers, [1.0] * n, [float(b) for b in bal], timed=False, sized=False)
    if method not in METHODS:
        raise ValueError(f"unknown partition method {method!r}; choose one of {METHODS} or give a list of layers "
                         "per stage")
    if method in ("time", "memory") and sample is None:
        raise ValueError(
            f"method={method!r} measures the model on a sample batch: pass sample=<one input batch>, "
            "or use method='params' / 'uniform', which need none"
        )
    mb = sample_microbatch(sample, chunks) if sample is not None else None
    layers = profile_layers(model, mb, device=torch.device(device) if device is not None else None,
                            repeat=repeat, timed=method == "time", progress=progress, whole=sample, init=init)
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
    if method in _UNITS:
        warn_heavy_layers([c.name for c in layers], list(model), costs, stages, method)
    bal = solve(costs, stages, comm)
    return Partition(bal, method, layers, costs, stage_costs(bal, costs, comm), timed=method == "time",
                     sized=mb is not None)
