"""CUDA streams for one stage, and no-ops for CPU.

Each CUDA stage computes on a stream of its own and copies on another, so
that while micro-batch i is being copied to the next device, micro-batch i+1
is already computing (the two-stream trick)::

    compute  | F0 | F1 | F2 | F3 |
    copy          |c0|  |c1|  |c2| ...
    next stage      | F0 | F1 | F2 | ...

``torch.cuda`` is touched only when the device is CUDA; on CPU every helper
here is a no-op and overlap comes from the stage threads instead.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch

from .microbatch import tree_map

__all__ = ["StageStreams"]

_NOTHING = contextlib.nullcontext()  # reusable: what the stream contexts are on CPU, entered on every action


class StageStreams:
    """The compute and copy streams of one stage (``None`` on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # Any, not Optional: None on CPU, but every use is behind ``self.cuda`` (which mypy cannot follow)
        self.compute: Any = torch.cuda.Stream(device) if self.cuda else None
        self.copy: Any = torch.cuda.Stream(device) if self.cuda else None

    def computing(self) -> ContextManager[Any]:
        """Make the compute stream current on this thread (no-op on CPU)."""
        return torch.cuda.stream(self.compute) if self.cuda else _NOTHING

    def copying(self) -> ContextManager[Any]:
        """Make the copy stream current on this thread (no-op on CPU)."""
        return torch.cuda.stream(self.copy) if self.cuda else _NOTHING

    def enter(self) -> None:
        """Called by the caller's thread before a step: compute waits for the caller's stream.

        The caller may have just written inputs or updated parameters on its own
        (default) stream; the stage must not read them before that work is done.
        """
        if self.cuda:
            self.compute.wait_stream(torch.cuda.current_stream(self.device))

    def leave(self) -> None:
        """Called by the caller's thread after a step: the caller's stream waits for the stage.

        Gradients, outputs and losses were produced on the stage's streams; the
        optimizer and the user's code run on the current stream.
        """
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.compute)
            current.wait_stream(self.copy)

    def record_event(self) -> Optional[Any]:
        """An event on the compute stream marking 'everything issued so far' (None on CPU)."""
        return self.compute.record_event() if self.cuda else None

    def adopt(self, value: Any, event: Optional[Any]) -> Any:
        """Make a tensor tree produced on another stream safe to use on our compute stream.

        The compute stream waits for ``event`` (the producer's 'done'), and
        every tensor is marked as used by our stream so the caching allocator
        does not hand its memory to the producer's stream too early.
        """
        if not self.cuda:
            return value
        if event is not None:
            self.compute.wait_event(event)
        stream = self.compute

        def mark(t: torch.Tensor) -> torch.Tensor:
            if t.is_cuda:
                t.record_stream(stream)
            return t

        return tree_map(mark, value)
