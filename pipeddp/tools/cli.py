"""The ``pipeddp`` command line.

    pipeddp demo                       train plain vs pipeline vs hybrid and compare
    pipeddp partition --model resnet50 --stages 4
    pipeddp timeline --stages 2 --chunks 8        a traced step as Chrome trace JSON and a PNG
    pipeddp plan --model resnet50 --devices 8 --link nvlink --memory 80GB
    pipeddp plan --model mymodels:llama --devices 16 --devices-per-node 8 --tp auto   pp x tp x dp
    pipeddp convert run/step-000000042 model.pt   a sharded checkpoint as one file (torch.load opens it)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from typing import Callable, Iterator, List, Optional, Tuple, Union

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

__all__ = ["main"]


def _demo(args: argparse.Namespace, console: Console) -> int:
    from .demo import run_demo

    run_demo(steps=args.steps, batch=args.batch, chunks=args.chunks, layers=args.layers, width=args.width,
             schedule=args.schedule, replicas=args.replicas, stages=args.stages, mode=args.mode, console=console)
    return 0


@contextlib.contextmanager
def _progress(console: Console, what: str) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done, total)`` callback: a bar on a terminal, a line per quarter in a log or a pipe."""
    if console.is_terminal:
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(what, total=None)
            yield lambda done, total: bar.update(task, completed=done, total=total)
        return
    console.print(f"{escape(what)} ...")
    shown = [0]

    def report(done: int, total: int) -> None:
        quarter = 4 * done // total
        if quarter > shown[0]:
            shown[0] = quarter
            console.print(f"  {escape(what)}: {25 * quarter}% ({done}/{total} layer runs)")

    yield report


def _partition(args: argparse.Namespace, console: Console) -> int:
    import torch

    from ..partitioning.report import partition
    from ..partitioning.solve import check_stage_count
    from .models import build

    torch.set_num_threads(args.threads)
    model, make_sample = build(args.model)
    check_stage_count(args.stages, len(model))  # refused before anything is measured
    sample = make_sample(args.batch)
    with _progress(console, f"profiling {args.model} ({len(model)} layers) for method={args.method}") as progress:
        plan = partition(model, args.stages, method=args.method, sample=sample, chunks=args.chunks,
                         progress=progress)
    console.print(plan.table())
    console.print(f"bottleneck / ideal (total / stages): {plan.bottleneck / plan.ideal:.3f}")
    return 0


#: the suffixes ``timeline --out`` writes; given on ``--out``, one is taken as the stem's own, never doubled
_TIMELINE_SUFFIXES = (".json", ".png")


def timeline_paths(out: str) -> Tuple[str, str]:
    """``(json path, png path)`` for ``timeline --out``, with the folder they go in created.

    ``--out docs/tl`` writes ``docs/tl.json`` and ``docs/tl.png``; ``--out x.png`` (or ``x.json``) writes
    ``x.json`` and ``x.png``, not ``x.png.png``. The folder is made (with its parents) and checked before
    the traced steps run, so a typo costs an error at once rather than a traceback after the whole run.
    """
    stem, suffix = os.path.splitext(out)
    if suffix.lower() not in _TIMELINE_SUFFIXES:
        stem = out
    if not os.path.basename(stem):
        raise ValueError(f"--out {out!r} names a folder, not a file: give a path such as "
                         f"{os.path.join(out, 'timeline')!r}")
    folder = os.path.dirname(os.path.abspath(stem))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {out!r}: cannot create the folder {folder!r} ({exc.strerror}); "
                         "choose another path") from exc
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--out {out!r}: the folder {folder!r} is not writable; choose another path")
    return stem + ".json", stem + ".png"


def _virtual_stages(text: str) -> Union[int, str]:
    """``--virtual-stages``: a number, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of stages per device, or auto") from None


def _timeline(args: argparse.Namespace, console: Console) -> int:
    import copy

    import torch
    from torch import nn

    from ..pipeline import Pipeline
    from ..runtime.trace import Trace
    from .models import build
    from .simulate import StageCost, simulate
    from .timeline import draw, have_matplotlib, measured_bubble

    json_path, png_path = timeline_paths(args.out)  # before the long part: a bad path fails at once
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, make_sample = build(args.model, small=True)
    x = make_sample(args.batch)
    with torch.no_grad():
        y = copy.deepcopy(model)(x)
    pipe = Pipeline(model, ["cpu"] * args.stages, chunks=args.chunks, sample=x, schedule=args.schedule,
                    checkpoint=args.checkpoint, threads=1, virtual_stages=args.virtual_stages,
                    placement=args.placement)
    trace = pipe.trace = Trace()
    with pipe:
        for _ in range(args.steps):
            trace.clear()
            pipe.train_step(x, torch.randn_like(y), nn.functional.mse_loss)
        spans = trace.spans
        trace.save(json_path)
    p, m, v = args.stages, min(args.chunks, args.batch), pipe.virtual_stages
    # the schedule's own bubble with equal stages (F = 1, B = 2): (p - 1) / (m + p - 1) for GPipe and 1F1B
    theory = simulate([StageCost(1.0, 2.0)] * (p * v), args.schedule, stages=p, chunks=m, virtual_stages=v,
                      placement=pipe.placement)
    bound = theory.bubble
    bubble, span = measured_bubble(spans)
    what = f"{args.schedule}" + (f" (virtual_stages={v}" + (", in the V)" if pipe.placement == "v" else ")")
                                 if v > 1 else "")
    console.print(f"{args.model}: {p} devices {pipe.balance}, {m} micro-batches, {what}: step {span * 1e3:.1f} ms, "
                  f"measured bubble {bubble:.1%} (equal stages: {bound:.1%})")
    held = [trace.peak_in_flight.get(r, 0) for r in range(p)]
    console.print(f"micro-batches of activations held at peak, per device: measured {held}, predicted "
                  f"{theory.peak_activations}")
    console.print(f"wrote {escape(str(json_path))} (open in ui.perfetto.dev or chrome://tracing)")
    if have_matplotlib():
        draw(spans, png_path, title=f"{args.model}, {p} devices, {m} micro-batches, {what}", bound=bound)
        console.print(f"wrote {escape(str(png_path))}")
    else:
        console.print(escape("for the PNG picture install matplotlib: pip install 'pipeddp[plot]'"))
    return 0


def _plan(args: argparse.Namespace, console: Console) -> int:
    from .plan_command import run_plan

    return run_plan(args, console, _progress)


def _convert(args: argparse.Namespace, console: Console) -> int:
    from ..checkpoints.sharded import to_file

    meta = to_file(args.directory, args.out)
    console.print(escape(f"wrote {args.out} (format pipeddp/2) from {args.directory}, saved by {meta['stages']} "
                         f"stage(s) x {meta['replicas']} replica(s); open it with torch.load: its 'model' loads into "
                         "the plain model"))
    return 0


#: the links ``plan`` models (``pipeddp.tools.simulate.LINKS``)
LINK_NAMES = "nvlink, pcie, infiniband, ethernet, local"

#: what ``--model`` takes, for every subcommand's help
MODEL_HELP = ("mlp, resnet18, resnet50, lm, or your own as package.module:function, a function returning "
              "(nn.Sequential, one input batch), importable from the current folder")


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.ArgumentDefaultsHelpFormatter  # every option's help ends with its default
    from .. import __version__

    p = argparse.ArgumentParser(prog="pipeddp", description="pipeline + data parallel training for nn.Sequential",
                                formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"pipeddp {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    schedules = ["1f1b", "gpipe", "interleaved", "zb", "auto"]

    d = sub.add_parser("demo", formatter_class=fmt,
                       help="train a small MLP plainly, as a pipeline and as a hybrid job on CPU; compare",
                       description="train a small MLP plainly, as a pipeline and as a hybrid job on CPU; compare "
                                   "their speed and the trained weights")
    d.add_argument("--steps", type=int, default=30, help="training steps of each run")
    d.add_argument("--batch", type=int, default=256, help="global batch size")
    d.add_argument("--chunks", type=int, default=8, help="micro-batches per batch")
    d.add_argument("--layers", type=int, default=8, help="Linear + ReLU blocks in the MLP")
    d.add_argument("--width", type=int, default=512, help="features of each hidden layer")
    d.add_argument("--schedule", default="1f1b", choices=schedules, help="pipeline schedule")
    d.add_argument("--replicas", type=int, default=2,
                   help="pipeline replicas of the hybrid run (spawned processes, gloo)")
    d.add_argument("--stages", type=int, default=2, help="stages per replica")
    d.add_argument("--mode", default="replica", choices=["replica", "stage"],
                   help="hybrid run: one process per replica (stage threads) or one process per stage")
    d.set_defaults(fn=_demo)

    q = sub.add_parser("partition", formatter_class=fmt, help="print the balanced partition of a model",
                       description="profile a model and print its balanced cut into stages, with the costs measured")
    q.add_argument("--model", default="mlp", metavar="MODEL", help="the model to cut; " + MODEL_HELP)
    q.add_argument("--stages", type=int, default=2, help="stages to cut the model into")
    q.add_argument("--method", default="time", choices=["time", "params", "memory", "uniform"],
                   help="what to balance: fwd+bwd time, parameters, parameter + activation bytes, or layer count")
    q.add_argument("--batch", type=int, default=32, help="sample batch size (profiled at batch/chunks)")
    q.add_argument("--chunks", type=int, default=1, help="micro-batches the batch is split into when profiling")
    q.add_argument("--threads", type=int, default=1, help="intra-op threads while profiling")
    q.set_defaults(fn=_partition)

    t = sub.add_parser("timeline", formatter_class=fmt,
                       help="trace one training step of a CPU pipeline; write Chrome JSON and a PNG",
                       description="trace training steps of a CPU pipeline; write the last one as Chrome trace "
                                   "JSON and (with matplotlib) a PNG")
    t.add_argument("--model", default="mlp", metavar="MODEL",
                   help="the model to run (a built-in one in its small version); " + MODEL_HELP)
    t.add_argument("--stages", type=int, default=2, help="devices (CPU stage threads) of the pipeline")
    t.add_argument("--chunks", type=int, default=8, help="micro-batches per batch")
    t.add_argument("--batch", type=int, default=128, help="batch size")
    t.add_argument("--schedule", default="1f1b", choices=schedules, help="pipeline schedule")
    t.add_argument("--virtual-stages", type=_virtual_stages, default=None,
                   help="stages per device; None: 2 for interleaved, else 1; auto (with --schedule auto): 1 or 2, "
                   "from the profile")
    t.add_argument("--placement", default="loop", choices=["loop", "v", "auto"],
                   help="with virtual stages: round robin (loop), down the devices and back up (v), or the one "
                   "that plays shorter on the profile (auto)")
    t.add_argument("--checkpoint", default="never", choices=["never", "except_last", "always"],
                   help="which micro-batches recompute their activations in backward")
    t.add_argument("--steps", type=int, default=3, help="steps to run; the last one is drawn")
    t.add_argument("--out", default="timeline",
                   help="output path: writes OUT.json and OUT.png (a .json or .png suffix is not doubled); "
                        "its folder is created")
    t.set_defaults(fn=_timeline)

    n = sub.add_parser("plan", formatter_class=fmt,
                       help="rank stages x replicas x micro-batches x schedule by simulation",
                       description="measure a model's layers here, then rank layouts of it on DEVICES devices "
                                   "by a simulated step time")
    n.add_argument("--model", default="resnet50", metavar="MODEL", help="the model to plan for; " + MODEL_HELP)
    n.add_argument("--devices", type=int, default=8, help="devices in all (replicas x stages)")
    n.add_argument("--batch", type=int, default=256, help="global batch")
    n.add_argument("--link", default="pcie", help="between stages: " + LINK_NAMES)
    n.add_argument("--allreduce-link", default=None, help="between replicas; None: the same as --link")
    n.add_argument("--memory", default=None, help="memory per device, e.g. 80GB; None: no limit")
    n.add_argument("--optimizer", default="adam", choices=["adam", "sgd"],
                   help="the optimizer whose state the memory model counts: adam (2 slots per parameter), sgd "
                        "(1: momentum)")
    n.add_argument("--optimizer-slots", type=int, default=None,
                   help="optimizer state per parameter, in parameter sizes; overrides --optimizer")
    n.add_argument("--profile-batch", type=int, default=16, help="largest micro-batch profiled")
    n.add_argument("--threads", type=int, default=1, help="intra-op threads while profiling")
    n.add_argument("--top", type=int, default=8, help="configurations to show")
    n.add_argument("--devices-per-node", type=int, default=None,
                   help="devices on each machine, for the torchrun command; None: all on one")
    n.add_argument("--tp", default="1",
                   help="tensor-parallel degrees to rank (devices = replicas x stages x tp): a number, a list such "
                        "as 1,2,4, or auto (every one that divides the devices of a machine and the model's heads "
                        "and split dimensions)")
    n.add_argument("--tp-link", default="nvlink", help="between the devices of a tp group: " + LINK_NAMES)
    n.add_argument("--tp-plan", default="auto",
                   help="what tensor parallelism splits: auto (the model's own, a transformers config's "
                        "base_model_tp_plan) or a JSON object of module patterns to colwise, rowwise, ...")
    n.set_defaults(fn=_plan)

    c = sub.add_parser("convert", formatter_class=fmt,
                       help="write a sharded checkpoint (a directory) as one file that torch.load opens",
                       description="write a sharded checkpoint (a directory) as one file that torch.load opens")
    c.add_argument("directory", help="the sharded checkpoint, e.g. run/step-000000042")
    c.add_argument("out", help="the file to write, e.g. model.pt (its folder is created)")
    c.set_defaults(fn=_convert)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    if not console.is_terminal:  # a log or a pipe: rich would assume 80 columns and cut table cells
        console = Console(width=max(console.width, 160))
    fn: Callable[[argparse.Namespace, Console], int] = args.fn
    try:
        with warnings.catch_warnings():
            # a warning meant for the user (HeavyLayerWarning, a device fallback) reads as one line of the
            # report, not as a source location and a line of this module's code
            warnings.showwarning = _warning_printer(console)
            return fn(args, console)
    except (ValueError, TypeError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2


def _warning_printer(console: Console) -> Callable[..., None]:
    """``warnings.showwarning`` for the command line: ``warning (Category): message``, without the code line."""

    def show(message: Warning, category: type, filename: str, lineno: int, file: object = None,
             line: Optional[str] = None) -> None:
        console.print(f"[yellow]warning[/yellow] ({category.__name__}): {escape(str(message))}", highlight=False)

    return show


if __name__ == "__main__":
    sys.exit(main())
