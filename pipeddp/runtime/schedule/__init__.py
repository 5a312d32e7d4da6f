"""Pipeline schedules as plain data: built, checked and replayed without any device.

::

    actions    the vocabulary: Kind (F B I W), Action, a row of them per device, what each waits for
       ^
    replay     play: run a schedule on paper (durations, transfers) -> Played; peak_held
       ^
    messages   crossings: the messages between two devices, in the one order both ends issue them
       ^
    checks     validate (complete, ordered, placed, deadlock-free), format_schedule
       ^
    builders   gpipe, one_f_one_b, list_schedule -> interleaved, zero_bubble
       ^
    costed     "auto": an order built from measured F / I / W costs under a cap on held activations
       ^
    registry   schedules by name; get_schedule builds, normalises and validates any of them

Each module imports only those below it. This face hands their names on (so
``from pipeddp.runtime.schedule import play`` keeps working); inside pipeddp,
import from the submodule that owns the name.
"""

from .actions import (
    PLACEMENTS,
    Action,
    Event,
    Kind,
    Schedule,
    ScheduleFn,
    check_placement,
    deps,
    normalize,
    produces,
    releases,
    row_of,
    stage_count,
    stages_on,
)
from .builders import (
    backward_only,
    forward_only,
    gpipe,
    interleaved,
    interleaved_limit,
    list_schedule,
    one_f_one_b,
    zero_bubble,
)
from .checks import format_schedule, validate
from .costed import AutoSchedule, Costs
from .messages import Message, crossings, in_order
from .registry import SCHEDULES, VIRTUAL, accepts_virtual_stages, get_schedule, schedule_name
from .replay import Played, peak_held, play, ready_time

__all__ = ["Kind", "Action", "Schedule", "ScheduleFn", "Event", "PLACEMENTS", "check_placement", "row_of", "stages_on",
           "stage_count", "produces", "deps", "releases", "normalize", "gpipe", "one_f_one_b", "list_schedule",
           "interleaved_limit", "interleaved",
           "zero_bubble", "forward_only", "backward_only", "SCHEDULES", "VIRTUAL", "schedule_name", "get_schedule",
           "accepts_virtual_stages", "AutoSchedule", "Costs", "validate", "format_schedule", "Played", "play",
           "peak_held", "ready_time", "Message", "crossings", "in_order"]
