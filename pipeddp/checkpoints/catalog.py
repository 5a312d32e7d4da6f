"""A directory of checkpoints (``save_checkpoint``'s): step names, the newest complete one, pruning.

::

    run/
        step-000000040.pt      one file (complete: it is renamed into place only when whole)
        step-000000042/        sharded (complete: DCP's .metadata is in it; written last)
        .tmp-k3j2x.pt          debris of a writer killed mid-save: never taken for a checkpoint

``newest`` walks the steps from the newest down and returns the first that
is complete and readable, in either format, naming every one it skips and
why. A file the safe loader refuses as unsafe is not skipped: it raises,
because resuming from an older file would hide it. ``prune`` keeps the
newest ``keep`` complete checkpoints and removes the rest, with the debris.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import checkpoint as files
from . import sharded
from .checkpoint import UnsafeCheckpointError

__all__ = ["step_path", "list_checkpoints", "is_complete", "newest", "prune", "sync_directory"]

_STEP = re.compile(r"^step-(\d+)(\.pt)?$")

#: ``on_skip(path, why)``: told of every checkpoint ``newest`` passes over.
OnSkip = Callable[[str, str], None]


def step_path(directory: str, step: int, sharded_format: bool = False) -> str:
    """``directory/step-000000042.pt``, or ``directory/step-000000042`` for a sharded checkpoint."""
    return os.path.join(directory, f"step-{step:09d}" + ("" if sharded_format else ".pt"))


def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """``(step, path)`` of every checkpoint file and directory in ``directory``, complete or not, newest first.

    For one step, a sharded directory comes before a file.
    """
    found = []
    for path in glob.glob(os.path.join(glob.escape(directory), "step-*")):
        m = _STEP.match(os.path.basename(path))
        if m and (os.path.isdir(path) != bool(m.group(2))):
            found.append((int(m.group(1)), os.path.isdir(path), path))
    return [(step, path) for step, _, path in sorted(found, reverse=True)]


def is_complete(path: str) -> bool:
    """A file is complete once it is there (atomic rename); a directory once DCP's metadata is in it."""
    return sharded.is_complete(path) if os.path.isdir(path) else os.path.isfile(path)


def newest(directory: str, on_skip: Optional[OnSkip] = None) -> Optional[Tuple[str, Optional[Dict[str, Any]]]]:
    """The newest complete checkpoint of ``directory`` that reads: ``(path, contents)``, or None.

    A file is read whole (``contents`` is what it holds); a sharded checkpoint
    is checked (metadata, every shard file there and long enough, its header)
    and ``contents`` is None. Raises ``UnsafeCheckpointError`` on a file the
    safe loader refuses as unsafe.
    """
    for _, path in list_checkpoints(directory):
        try:
            if os.path.isdir(path):
                sharded.header(path, sharded.read_metadata(path))
                return path, None
            return path, files.load(path)
        except UnsafeCheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - damaged, half-written, unreadable: an older one is used
            if on_skip is not None:
                on_skip(path, str(exc))
    return None


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def prune(directory: str, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, incomplete sharded directories and temporaries.

    Call it only when no save into ``directory`` is in flight (an incomplete
    directory is taken for a killed writer's).
    """
    complete = 0
    for _, path in list_checkpoints(directory):
        if is_complete(path) and complete < keep:
            complete += 1
            continue
        _remove(path)
    for path in glob.glob(os.path.join(glob.escape(directory), ".tmp-*")):
        _remove(path)


def sync_directory(path: str) -> None:
    """``fsync`` a directory, so that the names in it (a rename, a new file) survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
