"""``pipeddp plan``: its arguments checked, the tensor-parallel degrees it sweeps, its table and first choice.

The command measures the model here (``fit_layers``), works out what each
tensor-parallel degree splits (``tp_costs``), ranks every layout by a
simulated step (``plan``) and prints the call and command that run the
first. The sweep shows a bar on rank 0's terminal and nothing in a log.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple, Union

from rich.console import Console
from rich.markup import escape

__all__ = ["run_plan", "check_plan_arguments", "tp_degrees"]

Progress = Callable[[Console, str], ContextManager[Callable[[int, int], None]]]


def check_plan_arguments(args: argparse.Namespace) -> Optional[float]:
    """Every argument of ``plan`` checked before the minutes of profiling; returns ``--memory`` in bytes."""
    from .plan import parse_bytes
    from .simulate import LINKS

    for flag, value, least in (("--devices", args.devices, 1), ("--batch", args.batch, 1),
                               ("--profile-batch", args.profile_batch, 2), ("--threads", args.threads, 1),
                               ("--top", args.top, 1), ("--optimizer-slots", args.optimizer_slots, 0)):
        if value is not None and value < least:  # --optimizer-slots may be left to --optimizer
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.devices_per_node is not None and (args.devices_per_node < 1 or args.devices % args.devices_per_node):
        raise ValueError(f"--devices-per-node {args.devices_per_node} must be >= 1 and divide --devices "
                         f"{args.devices}")
    degrees = tp_degrees(args.tp)
    for t in degrees:
        if args.devices % t or (args.devices_per_node is not None and args.devices_per_node % t):
            raise ValueError(f"--tp {t} must divide --devices {args.devices}"
                             + (f" and --devices-per-node {args.devices_per_node} (a tp group sits on one machine)"
                                if args.devices_per_node is not None else ""))
    for flag, name in (("--link", args.link), ("--allreduce-link", args.allreduce_link), ("--tp-link", args.tp_link)):
        if name is not None and name not in LINKS:
            raise ValueError(f"{flag} {name!r} is not a link this command knows; choose one of "
                             f"{', '.join(sorted(LINKS))}")
    try:
        budget = parse_bytes(args.memory)
    except ValueError:
        raise ValueError(f"--memory {args.memory!r} is not a size; write e.g. 80GB, 40GiB or 512MiB") from None
    if budget is not None and budget <= 0:
        raise ValueError(f"--memory must be more than nothing, got {args.memory!r}")
    return budget


def tp_degrees(text: str) -> List[int]:
    """``--tp``: ``auto`` (every degree the devices and the model allow: an empty list here), or numbers."""
    if text == "auto":
        return []
    try:
        degrees = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise ValueError(f"--tp {text!r}: give tensor-parallel degrees such as 2 or 1,2,4, or auto") from None
    if degrees[0] < 1:
        raise ValueError(f"--tp must be >= 1, got {text!r}")
    return degrees


def _tp_plan(args: argparse.Namespace, model: Any) -> Tuple[Union[None, str, Dict[str, Any]], str]:
    """``--tp-plan``: "auto" where the model carries a plan (else None) or a JSON object; with the text the
    engine's call takes."""
    import json

    from .tp_costs import model_tp_plan

    if args.tp_plan == "auto":
        return ("auto" if model_tp_plan(model) is not None else None), "'auto'"
    try:
        given = json.loads(args.tp_plan)
    except json.JSONDecodeError:
        given = None
    if not isinstance(given, dict) or not all(isinstance(v, str) for v in given.values()):
        raise ValueError(f"--tp-plan {args.tp_plan!r}: give auto or a JSON object of module patterns to styles, "
                         "e.g. '{\"blocks.*.fc1\": \"colwise\", \"blocks.*.fc2\": \"rowwise\"}'")
    return given, repr(given)


def _tensor_parallel(args: argparse.Namespace, console: Console, model: Any,
                     make_sample: Callable[[int], Any]) -> Tuple[List[int], Any, str]:
    """The tp degrees to sweep, what each layer splits (None without tp), and the plan's text for the call."""
    from .tp_costs import sharded_layers, tp_refusals

    asked = tp_degrees(args.tp)
    if asked == [1]:
        return [1], None, ""
    tp_plan, text = _tp_plan(args, model)
    if tp_plan is None:
        if asked:
            raise ValueError(f"--tp {args.tp}: {args.model} carries no tensor-parallel plan (a transformers model "
                             "has one in its config); give --tp-plan as a JSON object of module patterns to styles")
        console.print(f"{args.model} carries no tensor-parallel plan: tp=1 only (--tp-plan gives one)")
        return [1], None, ""
    try:
        sharded = sharded_layers(model, tp_plan, make_sample(2))  # refused as HybridParallel(tp_plan=) refuses
    except ValueError as exc:
        if asked:
            raise
        console.print(escape(f"tp=1 only: {exc}"))
        return [1], None, ""
    if asked:
        return asked, sharded, text
    node = args.devices_per_node or args.devices
    degrees = []
    for t in (t for t in range(1, node + 1) if node % t == 0 and args.devices % t == 0):
        bad = tp_refusals(sharded, t)
        if bad:
            console.print(escape(f"tp={t} left out: it does not divide the model's {', '.join(bad[:3])}"))
        else:
            degrees.append(t)
    return degrees, sharded, text


def run_plan(args: argparse.Namespace, console: Console, profiling: Progress) -> int:
    """Run ``pipeddp plan``; ``profiling(console, what)`` shows the profile's progress (the command line's own)."""
    import torch
    from rich.table import Table

    from ..runtime.progress import shown
    from .models import MODELS, build
    from .plan import fit_layers, optimizer_slots, plan

    budget = check_plan_arguments(args)
    torch.set_num_threads(args.threads)
    model, make_sample = build(args.model)
    shape = "x".join(str(d) for d in make_sample(1).shape[1:]) or "a scalar"
    console.print(f"{args.model}: planned for inputs of {shape} per sample"
                  + (" (the built-in model's sample; for your own input size, plan your own model: --model "
                     "package.module:function)" if args.model in MODELS else ""))
    degrees, sharded, tp_text = _tensor_parallel(args, console, model, make_sample)
    sizes = (max(1, args.profile_batch // 4), args.profile_batch)
    with profiling(console, f"profiling {args.model} at micro-batches {sizes[0]} and {sizes[1]}") as progress:
        layers = fit_layers(model, make_sample, sizes=sizes, progress=progress)
    with shown(f"simulating the layouts of {args.devices} devices") as advance:  # a bar on rank 0's terminal only
        found = plan(layers, args.devices, args.batch, link=args.link, allreduce_link=args.allreduce_link,
                     memory=budget, optimizer_slots=optimizer_slots(args.optimizer, args.optimizer_slots),
                     tp=degrees, sharded=sharded, tp_link=args.tp_link, progress=advance)
    if not found:
        memory = escape(str(args.memory))
        console.print(f"[red]no configuration of {args.devices} devices fits {memory} per device[/red]; "
                      "raise --memory, add devices, or use a smaller batch")
        return 1
    three = max(degrees) > 1
    table = Table(title=f"{args.model} on {args.devices} devices, global batch {args.batch}, link {args.link}"
                        + (f", replicas over {args.allreduce_link}" if args.allreduce_link else "")
                        + (f", tp over {args.tp_link}" if three else "")
                        + (f", {args.memory} per device" if args.memory else ""))
    for col in ("#", "replicas x stages" + (" x tp" if three else ""), "what", "micro-batches (size)", "schedule",
                "shard", "step ms", "bubble", "memory/device"):
        table.add_column(col, justify="right", overflow="fold")
    for i, c in enumerate(found[:args.top]):
        table.add_row(str(i + 1), c.grid if three else c.layout, c.kind, f"{c.chunks} ({c.micro_batch})",
                      c.schedule_text, c.shard, f"{c.step_time * 1e3:.1f}", f"{c.prediction.bubble:.0%}",
                      f"{max(c.memory) / 2**30:.2f} GiB")
    console.print(table)
    for i, c in enumerate(found[:args.top]):
        console.print(escape(f"{i + 1}: cut {c.balance}; {c.why}"))
    console.print(f"{len(found)} configurations fit; layer costs were measured on this machine "
                  f"({'cuda' if torch.cuda.is_available() else 'cpu'}), link and all-reduce costs are modelled.")
    best = found[0]
    per_node = args.devices_per_node or args.devices
    batches = f"{best.chunks} micro-batch{'es' if best.chunks > 1 else ''} of {best.micro_batch}"
    console.print(f"\nfirst choice: {best.layout} ({best.kind}), {batches}"
                  + (f", {best.schedule_text}" if best.stages > 1 else "")
                  + f"; each replica takes a local batch of {best.chunks * best.micro_batch} (global {args.batch})")
    if best.stages == 1 and best.replicas > 1 and best.tp == 1:
        alone = "torch.nn.parallel.DistributedDataParallel" if best.shard == "none" else \
            "torch.distributed.fsdp.fully_shard"
        console.print(f"plain data parallelism wins: {alone} does this alone; with pipeddp:")
    if best.tp > 1:
        console.print(escape(f"  mesh = {best.mesh()}"))
    console.print(escape(f"  engine = {best.arguments(tp_text)}" if best.tp > 1 else f"  engine = {best.arguments()}"))
    console.print(escape(f"  {best.command(per_node)}"))
    return 0
