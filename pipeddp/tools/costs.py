"""What the simulator is fed: a stage's measured costs, the links between devices, a ring all-reduce.

::

    StageCost   seconds of F / B (I, W) of one micro-batch, bytes it sends, bytes it owns
    Link        latency + bytes / bandwidth, per message; LINKS names the usual ones
    ring        2 (R-1) steps of nbytes / R each, cut into DDP-like buckets when asked

Plain numbers and formulas: nothing here plays a schedule (``simulate``
does), so a plan can build and compare costs without running anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

from ..runtime.schedule.actions import Kind

__all__ = ["StageCost", "Link", "LINKS", "resolve_link", "ring_allreduce_time", "bubble_bound", "split_buckets",
           "contention_factor"]


@dataclass(frozen=True)
class StageCost:
    """One stage at one micro-batch size: seconds per micro-batch, bytes it sends, bytes it owns.

    ``backward_input`` is the input-gradient half of ``backward`` (what a
    zero-bubble schedule's I costs; W costs the rest). Unknown (None), it is
    taken as half, except on the first stage, which has no input gradient.
    """

    forward: float
    backward: float
    activation_bytes: int = 0
    param_bytes: int = 0
    backward_input: Optional[float] = None

    def cost(self, kind: Kind, first: bool) -> float:
        """Seconds of one action of ``kind`` on this stage (``first``: the pipeline's first stage)."""
        if kind is Kind.F:
            return self.forward
        if kind is Kind.B:
            return self.backward
        i = self.backward_input if self.backward_input is not None else (0.0 if first else self.backward / 2)
        i = min(max(i, 0.0), self.backward)
        return i if kind is Kind.I else self.backward - i


@dataclass(frozen=True)
class Link:
    """A connection: ``bandwidth`` in bytes/s, ``latency`` in seconds per message."""

    bandwidth: float
    latency: float = 0.0

    def time(self, nbytes: float) -> float:
        if math.isinf(self.bandwidth) and self.latency == 0.0:
            return 0.0
        return self.latency + nbytes / self.bandwidth


#: Typical links (per direction). "local" is two stages sharing one memory (CPU threads).
LINKS: Dict[str, Link] = {
    "local": Link(math.inf, 0.0),
    "nvlink": Link(150e9, 5e-6),
    "pcie": Link(12e9, 10e-6),
    "infiniband": Link(25e9, 5e-6),
    "ethernet": Link(1.25e9, 50e-6),
}


def ring_allreduce_time(nbytes: float, replicas: int, link: Link) -> float:
    """A ring all-reduce of ``nbytes`` over ``replicas``: 2 (R-1) steps of nbytes/R each."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (replicas - 1)
    return steps * link.latency + steps / replicas * nbytes / link.bandwidth


def bubble_bound(stages: int, chunks: int) -> float:
    """The ideal speedup of p stages over one with m micro-batches: m p / (m + p - 1)."""
    return chunks * stages / (chunks + stages - 1)


def contention_factor(contention: Optional[Sequence[float]], workers: int) -> float:
    """How much slower compute runs with ``workers`` computing at once (see the module docstring)."""
    if not contention or workers < 1:
        return 1.0
    if workers <= len(contention):
        return float(contention[workers - 1])
    return float(contention[-1]) * workers / len(contention)


def split_buckets(nbytes: float, bucket_bytes: Optional[float]) -> List[float]:
    """``nbytes`` of gradients as DDP-like buckets of ``bucket_bytes`` (one piece without a size)."""
    if nbytes <= 0:
        return []
    if bucket_bytes is None or nbytes <= bucket_bytes:
        return [float(nbytes)]
    full = int(nbytes // bucket_bytes)
    rest = nbytes - full * bucket_bytes
    return [float(bucket_bytes)] * full + ([float(rest)] if rest > 0 else [])


def resolve_link(value: Union[None, str, Link]) -> Link:
    if value is None:
        return LINKS["local"]
    if isinstance(value, Link):
        return value
    if value not in LINKS:
        raise ValueError(f"unknown link {value!r}; choose one of {sorted(LINKS)} or pass a Link(bandwidth, latency)")
    return LINKS[value]
