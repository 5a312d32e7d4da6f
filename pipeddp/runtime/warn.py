"""Warnings that point at the user's line, however deep in pipeddp they are raised.

``warnings.warn(..., stacklevel=n)`` names the frame ``n`` levels up, but
the same check is reached from the user's code through different depths
(``Pipeline(...)`` -> settings -> partition, or ``partition(...)`` directly;
``engine.resume`` or ``pipeddp.resume``), so a fixed ``n`` names a line of
pipeddp in some of them. ``warn`` walks up to the first frame outside the
package and names that one, so the filename and line a user sees (and a
``warnings`` filter by module matches) are their own.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Type

__all__ = ["warn"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn(message: str, category: Type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the nearest caller outside pipeddp.

    Raised on a thread that pipeddp started (no user frame above), it names
    the outermost frame there is.
    """
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
