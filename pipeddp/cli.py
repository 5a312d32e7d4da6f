"""The ``pipeddp`` command line.

    pipeddp demo                       train plain vs pipeline and compare
    pipeddp partition --model resnet50 --stages 4
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional

from rich.console import Console

__all__ = ["main"]


def _demo(args: argparse.Namespace, console: Console) -> int:
    from .demo import run_demo

    run_demo(steps=args.steps, batch=args.batch, chunks=args.chunks, layers=args.layers, width=args.width,
             schedule=args.schedule, replicas=args.replicas, stages=args.stages, mode=args.mode, console=console)
    return 0


def _partition(args: argparse.Namespace, console: Console) -> int:
    import torch

    from .models import build
    from .partition import partition

    torch.set_num_threads(args.threads)
    model, make_sample = build(args.model)
    sample = make_sample(args.batch)
    plan = partition(model, args.stages, method=args.method, sample=sample, chunks=args.chunks)
    console.print(plan.table())
    console.print(f"bottleneck / ideal (total / stages): {plan.bottleneck / plan.ideal:.3f}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeddp", description="pipeline + data parallel training for nn.Sequential")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a small MLP plainly, as a pipeline and as a hybrid job on CPU; compare")
    d.add_argument("--steps", type=int, default=30)
    d.add_argument("--batch", type=int, default=256)
    d.add_argument("--chunks", type=int, default=8)
    d.add_argument("--layers", type=int, default=8)
    d.add_argument("--width", type=int, default=512)
    d.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    d.add_argument("--replicas", type=int, default=2, help="pipeline replicas (spawned processes, gloo)")
    d.add_argument("--stages", type=int, default=2, help="stages per replica")
    d.add_argument("--mode", default="replica", choices=["replica", "stage"])
    d.set_defaults(fn=_demo)

    q = sub.add_parser("partition", help="print the balanced partition of a model")
    q.add_argument("--model", default="mlp", choices=["mlp", "resnet18", "resnet50"])
    q.add_argument("--stages", type=int, default=2)
    q.add_argument("--method", default="time", choices=["time", "params", "memory", "uniform"])
    q.add_argument("--batch", type=int, default=32, help="sample batch size (profiled at batch/chunks)")
    q.add_argument("--chunks", type=int, default=1)
    q.add_argument("--threads", type=int, default=1, help="intra-op threads while profiling")
    q.set_defaults(fn=_partition)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    fn: Callable[[argparse.Namespace, Console], int] = args.fn
    try:
        return fn(args, console)
    except (ValueError, TypeError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
