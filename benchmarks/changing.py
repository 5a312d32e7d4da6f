"""What an activation whose structure changes costs a pipeline step: the same chain, its cut's activation repeated,
changing between steps by turns, and of a shorter batch every other step, interleaved in one job.

One spawned gloo job of 2 processes (2 stages, stage mode, 1F1B, one intra-op thread each). An 8-layer 64-wide
chain whose first layer emits ``(h, mask)`` where its input's first column is positive and ``(h, None)`` otherwise,
every layer after it carrying the pair, so the activation at the cut is a tuple whose second member comes and goes
with the batch's values (as transformers' default attention builds a mask only for a batch with padding). Three
engines of that chain, each fed its own batches: ``repeat`` (the mask every step: what repeats crosses without a
header), ``by turns`` (present and absent every other step: every activation flagged and followed by its header),
``shorter`` (the mask every step, the batch 4 rows shorter every other step: a header ahead of every activation).
Blocks of consecutive steps are timed round by round between barriers, the order rotated each round; the table is
each engine's median ms per step and the median of per-round ratios over ``repeat``.
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks import common
from benchmarks.common import BARRIER, Run, at_least, barrier_rounds, median_ratio

WIDTH, LAYERS, BATCH, SHORTER = 64, 8, 32, 4
ARMS = ("repeat", "by turns", "shorter")


class Emit(nn.Module):
    """The first layer: ``(h, mask)`` where the input's first column is positive, else ``(h, None)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        h = torch.relu(self.lin(x))
        return h, ((x[:, :1] > 0).expand_as(h).contiguous() if bool(x[0, 0] > 0) else None)


class Carry(nn.Module):
    """A layer of the chain: the pair through, the mask (where it is) applied; the last returns ``h`` alone."""

    def __init__(self, last: bool = False) -> None:
        super().__init__()
        self.lin, self.last = nn.Linear(WIDTH, WIDTH), last

    def forward(self, pair: Tuple[torch.Tensor, Optional[torch.Tensor]]) -> Any:
        h, mask = pair
        h = torch.relu(self.lin(h if mask is None else h * mask))
        return h if self.last else (h, mask)


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Emit(), *[Carry() for _ in range(LAYERS - 2)], Carry(last=True))


def batches(arm: str) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """The arm's two batches, taken by turns (``repeat``: two batches alike in structure)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for turn in (0, 1):
        rows = BATCH - SHORTER if arm == "shorter" and turn else BATCH
        x, y = torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)
        x[:, 0] = -1.0 if arm == "by turns" and turn else 1.0
        out.append((x, y))
    return out


def job(settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    rank = common.init_job(settings["timeout"], "cpu")
    results: Dict[str, Any] = {}
    for m in settings["ms"]:
        engines, runs = [], {}
        for arm in ARMS:
            engine = pipeddp.HybridParallel(chain(), stages=2, mode="stage", devices=["cpu"], chunks=m,
                                            schedule="1f1b", balance="uniform")
            engines.append(engine)
            data, first, last = batches(arm), engine.is_first, engine.is_last
            turn = [0]

            def run(engine: Any = engine, data: Any = data, first: bool = first, last: bool = last,
                    turn: List[int] = turn) -> Any:
                for _ in range(settings["block"]):
                    x, y = data[turn[0] % 2]
                    turn[0] += 1
                    engine.zero_grad(set_to_none=True)
                    loss = engine.train_step(x if first else None, y if last else None, nn.functional.mse_loss)
                return loss

            runs[arm] = run
        times, _ = barrier_rounds(runs, settings["rounds"], settings["warmup"])
        for engine in engines:
            engine.close()
        walls = {k: [t.wall / settings["block"] for t in v] for k, v in times.items()}
        results[str(m)] = {"median_ms": {k: 1e3 * statistics.median(v) for k, v in walls.items()},
                           "over_repeat": {k: median_ratio(walls[k], walls["repeat"]) for k in ARMS[1:]},
                           "times_s": walls}
    dist.barrier()
    return results if rank == 0 else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = common.parser(__doc__, "2 rounds of 2 steps", spawns=True, device=False)
    p.add_argument("--ms", type=at_least(2), nargs="+", default=[4, 8], help="micro-batches per step")
    p.add_argument("--rounds", type=at_least(1), default=12)
    p.add_argument("--warmup", type=at_least(0), default=2)
    p.add_argument("--block", type=at_least(2), default=10, help="consecutive steps per timed reading")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.block, args.ms = 2, 1, 2, [4]
    run = Run("changing", args, BARRIER)
    res = pipeddp.spawn(job, 2, args=(vars(args),), timeout=args.timeout, threads=1)[0]
    rows = []
    for m, got in res.items():
        for arm in ARMS:
            ratio = got["over_repeat"].get(arm)
            rows.append([m, arm, got["median_ms"][arm], "-" if ratio is None else f"{ratio:.2f}x"])
    run.table("1F1B, 2 processes, the chain's cut activation repeated or changing",
              ["m", "activation", "median ms per step", "over repeat (median of per-round ratios)"], rows)
    run.finish({"ms": args.ms}, results=res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
