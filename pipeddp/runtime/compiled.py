"""A stage's layers under ``torch.compile``: one compiled function per mode, so modes never evict each other."""

from __future__ import annotations

import threading
import types
from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn

from .rng import is_checkpointing, is_recomputing

__all__ = ["Compiled"]


class Compiled:
    """A stage's layers under ``torch.compile``, compiled once per mode, each mode a cache of its own.

    Dynamo keeps its compiled graphs, and counts recompiles against its limit
    (8), per *code object*. Every stage is an ``nn.Sequential`` and runs in up
    to three modes (a forward that keeps the graph, a forward without grad, a
    recompute replay), which differ in grad mode, in whether the input
    requires grad and in the BatchNorm flags: one code object for all of them
    recompiles on every switch and, past the limit, silently falls back to
    eager. So each (stage, mode) gets a function with a code object of its
    own, compiled the first time that mode runs::

        mode (grad enabled, recomputing, checkpointing, layers' training flags) -> torch.compile(run_<stage>_<k>)
    """

    def __init__(self, module: nn.Sequential, options: Dict[str, Any], index: int) -> None:
        self.module = module
        self.options = options
        self.index = index
        self.by_mode: Dict[Tuple[Any, ...], Callable[[Any], Any]] = {}
        self._lock = threading.Lock()

    def mode(self) -> Tuple[Any, ...]:
        return (torch.is_grad_enabled(), is_recomputing(), is_checkpointing(), tuple(m.training for m in self.module))

    def __call__(self, value: Any) -> Any:
        key = self.mode()
        fn = self.by_mode.get(key)
        if fn is None:
            with self._lock:
                fn = self.by_mode.get(key)
                if fn is None:
                    fn = self.by_mode[key] = self._compile(len(self.by_mode))
        return fn(value)

    def _compile(self, k: int) -> Callable[[Any], Any]:
        module = self.module

        def run(value: Any) -> Any:
            return module(value)

        code = run.__code__.replace(co_name=f"pipeddp_stage{self.index}_mode{k}")
        own = types.FunctionType(code, run.__globals__, code.co_name, run.__defaults__, run.__closure__)
        return torch.compile(own, **self.options)
