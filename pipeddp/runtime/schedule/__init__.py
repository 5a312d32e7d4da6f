"""Pipeline schedules as plain data: built, checked and replayed without any device.

::

    actions    the vocabulary: Kind (F B I W), Action, a row of them per device, what each waits for
       ^
    replay     play: run a schedule on paper (durations, transfers) -> Played; peak_held
       ^
    checks     validate (complete, ordered, placed, deadlock-free), format_schedule
       ^
    builders   gpipe, one_f_one_b, list_schedule -> interleaved, zero_bubble; get_schedule by name

Each module imports only those below it. This face hands their names on (so
``from pipeddp.runtime.schedule import play`` keeps working); inside pipeddp,
import from the submodule that owns the name.
"""

from .actions import Action, Event, Kind, Schedule, ScheduleFn, deps, normalize, produces, releases, row_of, stage_count
from .builders import (
    SCHEDULES,
    VIRTUAL,
    accepts_virtual_stages,
    backward_only,
    forward_only,
    get_schedule,
    gpipe,
    interleaved,
    interleaved_limit,
    list_schedule,
    one_f_one_b,
    schedule_name,
    zero_bubble,
)
from .checks import format_schedule, validate
from .replay import Played, peak_held, play, ready_time

__all__ = ["Kind", "Action", "Schedule", "ScheduleFn", "Event", "row_of", "stage_count", "produces", "deps",
           "releases", "normalize", "gpipe", "one_f_one_b", "list_schedule", "interleaved_limit", "interleaved",
           "zero_bubble", "forward_only", "backward_only", "SCHEDULES", "VIRTUAL", "schedule_name", "get_schedule",
           "accepts_virtual_stages", "validate", "format_schedule", "Played", "play", "peak_held", "ready_time"]
