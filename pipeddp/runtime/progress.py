"""Long setup work shown on a terminal: a ``rich`` bar on rank 0 when stderr is one, and nothing otherwise.

Profiling the layers for ``balance="time"`` or reading a pretrained directory
can take minutes before the first step; a user at a terminal should see it
move. In a log file, a pipe or a test nothing is printed (a library does not
write to a stream its user did not hand it), and only rank 0 draws, so that a
job's processes do not fight over one terminal::

    with shown("profiling 48 layers") as advance:
        for ...:
            advance(done, total)
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress

__all__ = ["on_terminal", "shown"]

Report = Callable[[int, int], None]


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def on_terminal() -> bool:
    """Whether this process draws progress: rank 0, with stderr a terminal."""
    return _rank() == 0 and Console(stderr=True).is_terminal


def _nothing(done: int, total: int) -> None:
    return None


@contextlib.contextmanager
def shown(what: str) -> Iterator[Report]:
    """A ``report(done, total)`` callback that moves a transient bar labelled ``what`` (see module docstring)."""
    if not on_terminal():
        yield _nothing
        return
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)
