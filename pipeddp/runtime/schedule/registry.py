"""Schedules by name: the registry that ``schedule="..."`` reads, and the one call that builds any schedule.

It sits above the builders and ``costed`` (``"auto"``, built from measured
costs on top of them), so a name can reach every builder without any builder
knowing the registry.
"""

from __future__ import annotations

import inspect
from typing import Dict, Union

from .actions import Schedule, ScheduleFn, check_placement, normalize
from .builders import check_counts, gpipe, interleaved, one_f_one_b, zero_bubble
from .checks import validate
from .costed import build as build_auto

__all__ = ["SCHEDULES", "VIRTUAL", "schedule_name", "get_schedule", "accepts_virtual_stages"]

SCHEDULES: Dict[str, ScheduleFn] = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
                                    "zb": zero_bubble, "auto": build_auto}
_ALIASES = {"interleaved1f1b": "interleaved", "zerobubble": "zb", "zbh1": "zb"}
#: Schedules that run several stages per device when asked to (``virtual_stages > 1``).
VIRTUAL = ("interleaved", "zb", "auto")


def schedule_name(schedule: str) -> str:
    """The registered name for ``schedule`` (case, dashes and underscores ignored), or ValueError."""
    key = schedule.lower().replace("-", "").replace("_", "")
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)} or pass a function")
    return key


def get_schedule(schedule: Union[str, ScheduleFn], stages: int, chunks: int, virtual_stages: int = 1, *,
                 placement: str = "loop") -> Schedule:
    """Build, normalise and validate a schedule from a name or a function.

    ``stages`` is the number of devices (rows); the model has ``stages *
    virtual_stages`` stages, placed on the devices as ``placement`` says
    (``actions.PLACEMENTS``). A function is called as ``fn(stages, chunks)``,
    or ``fn(stages, chunks, virtual_stages)`` when there are virtual stages,
    and must place them so (``validate`` says where it does not); a named
    schedule is built for the placement.
    """
    check_counts(stages, chunks, virtual_stages)
    check_placement(placement)
    if isinstance(schedule, str):
        name = schedule_name(schedule)
        if virtual_stages > 1 and name not in VIRTUAL:
            raise ValueError(f"schedule {schedule!r} runs one stage per device; with virtual_stages={virtual_stages} "
                             f"choose one of {list(VIRTUAL)}")
        fn = SCHEDULES[name]
        plan = fn(stages, chunks) if name not in VIRTUAL else fn(stages, chunks, virtual_stages, placement=placement)
    elif callable(schedule):
        plan = schedule(stages, chunks) if virtual_stages == 1 else schedule(stages, chunks, virtual_stages)
    else:
        raise TypeError("schedule must be a name or a function(stages, chunks[, virtual_stages]), got "
                        f"{type(schedule).__name__}")
    plan = normalize(plan, stages * virtual_stages)
    validate(plan, chunks, training=True, placement=placement)
    return plan


def accepts_virtual_stages(schedule: Union[str, ScheduleFn]) -> bool:
    """Whether ``schedule`` can run several stages per device (a name in ``VIRTUAL``, or a 3-argument function)."""
    if isinstance(schedule, str):
        return schedule_name(schedule) in VIRTUAL
    try:
        inspect.signature(schedule).bind(1, 1, 1)
    except (TypeError, ValueError):
        return False
    return True

