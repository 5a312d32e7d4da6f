"""Draw a recorded timeline as a Gantt chart, and measure its bubble.

One row per device (and per lane: compute, communication), one bar per
action, coloured by kind (with virtual stages a bar also names its stage);
the gaps are the bubble::

    stage 0 compute  [F0][F1][F2][F3]      [B0]  [B1]  [B2]  [B3]
    stage 1 compute      [F0][F1][F2][F3][B0][B1][B2][B3]

matplotlib is optional (``pip install pipeddp[plot]``); everything else here
works without it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from ..runtime.trace import Span

__all__ = ["measured_bubble", "draw", "have_matplotlib", "COLORS", "WORK"]

#: the kinds of span that are compute (the rest is waiting, communication)
WORK = ("F", "B", "I", "W")

COLORS: Dict[str, str] = {
    "F": "#4C72B0",
    "B": "#DD8452",
    "I": "#DA8BC3",
    "W": "#937860",
    "recv": "#BBBBBB",
    "send": "#999999",
    "copy": "#8172B3",
    "allreduce": "#55A868",
}


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401 - imported only to learn whether it is installed
    except ImportError:
        return False
    return True


def measured_bubble(spans: Sequence[Span]) -> Tuple[float, float]:
    """``(bubble, makespan)`` of the compute work (F, B, I and W) in ``spans``.

    The bubble is the idle share of all devices' time between the first start
    and the last end: ``1 - busy / (devices * makespan)``, the quantity whose
    ideal is ``(p - 1) / (m + p - 1)`` under GPipe and 1F1B.
    """
    work = [s for s in spans if s.kind in WORK]
    if not work:
        return 0.0, 0.0
    start = min(s.start for s in work)
    end = max(s.end for s in work)
    rows = {(s.rank, s.device) for s in work}
    busy = sum(s.duration for s in work)
    span = end - start
    return (1.0 - busy / (len(rows) * span) if span > 0 else 0.0), span


def draw(spans: Sequence[Span], path: str, *, title: Optional[str] = None, bound: Optional[float] = None) -> str:
    """Save a Gantt chart of ``spans`` to ``path`` (PNG); returns the path.

    ``bound`` (the ideal bubble, e.g. (p-1)/(m+p-1)) goes into the title next to
    the measured bubble.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not spans:
        raise ValueError("no spans to draw: run the pipeline with trace=True first")
    t0 = min(s.start for s in spans)
    rows: List[Tuple[int, int, str]] = sorted({(s.rank, s.device, s.lane) for s in spans})
    index = {r: i for i, r in enumerate(rows)}
    virtual = any(s.row is not None and s.row != s.stage for s in spans)  # a device holds several stages
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.6))
    for s in spans:
        y = index[(s.rank, s.device, s.lane)]
        ax.broken_barh([((s.start - t0) * 1e3, max(s.duration * 1e3, 1e-3))], (y - 0.4, 0.8),
                       facecolors=COLORS.get(s.kind, "#C44E52"), edgecolor="white", linewidth=0.5)
        if s.kind in WORK and s.mb >= 0:
            label = f"{s.kind}{s.mb}" + (f"@s{s.stage}" if virtual else "")
            ax.text((s.start - t0 + s.duration / 2) * 1e3, y, label, ha="center", va="center",
                    fontsize=7 if not virtual else 6, color="white")
    ranks = {r for r, _, _ in rows}
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([(f"rank {r} " if len(ranks) > 1 else "") + f"{'device' if virtual else 'stage'} {d} {lane}"
                        for r, d, lane in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    bubble, span = measured_bubble(spans)
    head = title or "pipeline timeline"
    head += f"\nmeasured bubble {bubble:.1%}" + (f" (bound {bound:.1%})" if bound is not None else "")
    head += f", step {span * 1e3:.1f} ms"
    ax.set_title(head)
    kinds = sorted({s.kind for s in spans}, key=lambda k: list(COLORS).index(k) if k in COLORS else 99)
    ax.legend(handles=[Patch(color=COLORS.get(k, "#C44E52"), label=k) for k in kinds], loc="upper right",
              fontsize=8, ncol=len(kinds))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
