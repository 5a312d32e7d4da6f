"""The settings ``Pipeline`` and ``HybridParallel`` share, checked in one place, with one message each.

Both classes take the same model and micro-batch settings; checking them
twice is how the copies drift apart (a misspelt ``checkpoint=`` refused by
one class and silently taken as "never" by the other). So both call
``check_settings`` and keep the ``Settings`` it returns (plain data, defined
in ``runtime.settings`` so that the distributed builder can read it too).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Sequence, Union

import torch
from torch import nn

from .partitioning.report import METHODS, Partition, check_balance, check_model, partition
from .partitioning.solve import check_stage_count
from .runtime.microbatch import batch_size
from .runtime.schedule.actions import ScheduleFn, check_placement
from .runtime.schedule.costed import check_max_activations, is_auto
from .runtime.schedule.registry import accepts_virtual_stages, get_schedule, schedule_name
from .runtime.settings import Settings

__all__ = ["Settings", "check_settings", "check_log_every", "CHECKPOINT_MODES", "choose_partition"]

CHECKPOINT_MODES = ("never", "except_last", "always")

Timeout = Union[float, int, timedelta]


def _positive_int(value: Any, name: str, meaning: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 ({meaning}), got {value!r}")


def check_settings(
    model: Any,
    stages: int,
    *,
    chunks: Optional[int],
    split_size: Optional[int],
    schedule: Union[str, ScheduleFn],
    checkpoint: str,
    timeout: Timeout,
    compile: Union[bool, Dict[str, Any]] = False,
    virtual_stages: Union[None, int, str] = None,
    threads: Optional[int] = None,
    flags: Optional[Dict[str, Any]] = None,
    balance: Union[None, str, Sequence[int]] = None,
    sample: Any = None,
    max_activations: Optional[int] = None,
    seed: int = 0,
    init: Optional[Callable[[nn.Module], None]] = None,
    placement: str = "loop",
) -> Settings:
    """Check everything that does not need a device or a process group; raise naming the fix.

    ``stages`` is the number of devices of a pipeline. ``chunks`` defaults to
    two micro-batches per device. ``timeout`` is seconds or a ``timedelta``.
    ``compile``: True or a dict of ``torch.compile`` options.
    ``virtual_stages``: stages per device (default 2 for ``schedule="interleaved"``, else 1), or ``"auto"``
    (with ``schedule="auto"`` and a profile: chosen when the engine is built, ``schedule.placing``).
    ``threads``: intra-op threads per stage thread (None or an int >= 1). ``flags``: the
    constructor's on/off arguments by name, each must be a bool. ``balance`` (with ``sample``):
    a method name or one number of layers per stage. ``max_activations``: ``schedule="auto"``'s cap.
    ``seed``: what a model built on the meta device is initialised from (an int >= 0), ``init`` how (a callable).
    ``placement``: ``"loop"``, ``"v"`` (``schedule.actions.PLACEMENTS``; ``"v"`` needs virtual stages) or
    ``"auto"`` (chosen from the profile when the engine is built: ``schedule.placing``; a named schedule only).

    Everything here runs before any thread or process starts, so a mistake
    raises at once, naming the argument, instead of failing in a stage thread.
    """
    if threads is not None:
        _positive_int(threads, "threads", "intra-op threads per stage thread, or None for the default")
    for name, value in (flags or {}).items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    check_model(model)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0 (what a model built on the meta device is initialised from), "
                         f"got {seed!r}")
    if init is not None and not callable(init):
        raise ValueError(f"init must be a callable init(module) for a model built on the meta device, got {init!r}")
    check_stage_count(stages, len(model))
    choose_virtual = virtual_stages == "auto"
    if choose_virtual:
        check_virtual_auto(schedule, placement, balance, sample)
    virtual = check_virtual_stages(None if choose_virtual else virtual_stages, schedule)  # "auto": 1 until built
    if placement != "auto":
        check_placement(placement)
    elif callable(schedule):
        raise ValueError("placement='auto' chooses between the placements pipeddp builds its own schedules for; a "
                         "schedule function places its stages itself: pass placement='loop' or 'v' to match it")
    if placement == "v" and virtual == 1:
        raise ValueError("placement='v' runs down the devices and back up, which needs at least two stages per device: "
                         "pass virtual_stages=2 (with schedule='interleaved', 'zb' or 'auto'), or leave placement out")
    if balance is not None:
        check_balance_arg(balance, sample, stages, virtual, len(model))
    if virtual > 1 and stages * virtual > len(model):
        raise ValueError(f"cannot cut {len(model)} layers into {stages} devices x {virtual} virtual stages = "
                         f"{stages * virtual} stages: every stage needs at least one layer; use fewer "
                         "virtual_stages or devices, or split the model into finer layers, e.g. with "
                         "pipeddp.tools.models.flatten_sequential(model, sample)")
    if chunks is not None and split_size is not None:
        raise ValueError("give chunks= (number of micro-batches) or split_size= (samples per micro-batch), not both")
    if chunks is not None:
        _positive_int(chunks, "chunks", "the number of micro-batches")
    if split_size is not None:
        _positive_int(split_size, "split_size", "samples per micro-batch")
    if chunks is None and split_size is None:
        chunks = 2 * stages
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    # an unknown or broken schedule fails now, not at the first step
    get_schedule(schedule, stages, 1, virtual, placement="loop" if placement == "auto" else placement)
    if max_activations is not None and not is_auto(schedule):
        raise ValueError(f"max_activations={max_activations!r} caps what schedule='auto' builds; schedule={schedule!r} "
                         "holds what its pattern holds: use schedule='auto' or leave max_activations out")
    check_max_activations(max_activations, virtual)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
    if not isinstance(compile, (bool, dict)):
        raise ValueError(f"compile must be True, False or a dict of torch.compile options, got {compile!r}")
    options = dict(compile) if isinstance(compile, dict) else ({} if compile else None)
    return Settings(chunks, split_size, schedule, checkpoint, float(seconds), options, virtual, choose_virtual,
                    max_activations, placement, seed, init)


def check_log_every(log_every: Optional[int]) -> Optional[int]:
    """Steps between two log records of the ``"pipeddp"`` logger (``watch``); None or 0: none."""
    if log_every is None or (isinstance(log_every, int) and not isinstance(log_every, bool) and log_every == 0):
        return None
    _positive_int(log_every, "log_every", "training steps between two INFO records of the 'pipeddp' logger, "
                  "or None for none")
    return log_every


def check_virtual_auto(schedule: Union[str, ScheduleFn], placement: str, balance: Union[None, str, Sequence[int]],
                       sample: Any) -> None:
    """``virtual_stages="auto"`` is chosen by playing ``schedule="auto"`` on the layers' measured times, each
    number of stages per device on its own cut: it needs that schedule, a profile, and a placement it may pick."""
    if not is_auto(schedule):
        raise ValueError(f"virtual_stages='auto' chooses the stages per device for the order schedule='auto' builds "
                         f"from measured costs; schedule={schedule!r} has its own pattern: pass schedule='auto', or a "
                         "number of virtual stages")
    if placement not in ("loop", "auto"):
        raise ValueError(f"virtual_stages='auto' may choose one stage per device, where placement={placement!r} has "
                         "no meaning: pass placement='auto' (the V where it plays shorter) or leave placement out")
    if not isinstance(balance, str) and balance is not None:
        raise ValueError(f"balance {list(balance)} fixes the number of stages, so virtual_stages='auto' has nothing to "
                         "choose: give virtual_stages=len(balance) // devices, or balance='time' with a sample")
    if balance not in (None, "time") or sample is None:
        raise ValueError("virtual_stages='auto' chooses from the layers' measured times: pass sample=<one input "
                         "batch> (and balance='time' or no balance), or a number of virtual stages")


def check_balance_arg(balance: Union[str, Sequence[int]], sample: Any, devices: int, virtual: int,
                      layers: int) -> None:
    """A balance method that exists (and has the sample it measures), or a list of layers per stage."""
    if isinstance(balance, str):
        if balance not in METHODS:
            raise ValueError(f"unknown balance {balance!r}; choose one of {METHODS} or give a list of layers per stage")
        if balance in ("time", "memory") and sample is None:
            raise ValueError(f"balance={balance!r} measures the model on a sample batch: pass sample=<one input "
                             "batch>, or use balance='params' / 'uniform', which need none")
        return
    if virtual > 1 and isinstance(balance, (list, tuple)) and len(balance) != devices * virtual:
        raise ValueError(f"balance {list(balance)} has {len(balance)} stages but the pipeline has {devices} devices x "
                         f"{virtual} virtual stages = {devices * virtual} stages; give one entry per stage")
    check_balance(balance, layers, devices * virtual)


def check_virtual_stages(virtual_stages: Union[None, int, str], schedule: Union[str, ScheduleFn]) -> int:
    """Stages per device: given, or 2 for the interleaved schedule and 1 for the others (``"auto"`` is
    ``check_virtual_auto``'s)."""
    if isinstance(schedule, str):
        schedule_name(schedule)  # an unknown name is refused here, with the list of names
    if virtual_stages is None:
        return 2 if isinstance(schedule, str) and schedule_name(schedule) == "interleaved" else 1
    _positive_int(virtual_stages, "virtual_stages", "stages per device, or 'auto' with schedule='auto'")
    assert isinstance(virtual_stages, int)
    if virtual_stages > 1 and not accepts_virtual_stages(schedule):
        raise ValueError(f"virtual_stages={virtual_stages} needs a schedule that runs several stages per device: "
                         "schedule='interleaved', 'zb' or 'auto', or a function (stages, chunks, virtual_stages); got "
                         f"schedule={schedule!r}")
    return virtual_stages


def choose_partition(model: nn.Sequential, stages: int, balance: Union[None, str, Sequence[int]], sample: Any,
                     settings: Settings, device: torch.device) -> Partition:
    """The cut for ``balance``: measured on ``sample`` at the real micro-batch size, or as given.

    ``stages`` is the number of stages to cut (devices x virtual stages).
    ``balance=None`` means ``"time"`` with a sample and ``"params"`` without. A model on the meta device is
    measured one layer at a time (``profile``), so no process ever holds it whole.
    """
    if balance is None:
        balance = "time" if sample is not None else "params"
    pieces = settings.chunks or 1
    if sample is not None and settings.split_size is not None:
        pieces = max(1, -(-batch_size(sample, name="sample") // settings.split_size))
    return partition(model, stages, method=balance, sample=sample, chunks=pieces, device=device, init=settings.init)
