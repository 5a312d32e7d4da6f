"""What ``Pipeline`` and ``HybridParallel`` both are: an ``nn.Module`` that holds the layers and runs a ``Step``.

The two classes differ in how they build their stages and runner; what they
expose of the step they run is the same, so it is written here once.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Tuple, TypeVar

import torch
from torch import nn

from ._settings import check_log_every
from .runtime.clip import Combine, clip_grad_norm
from .runtime.names import Names, key_mismatch
from .runtime.stage import Stage
from .runtime.stats import StepStats
from .runtime.step import Step
from .runtime.trace import Trace
from .watch import Watch

__all__ = ["StepModule"]

Self = TypeVar("Self", bound="StepModule")


class StepModule(nn.Module):
    """An ``nn.Module`` running ``self._step``; a context manager that closes itself.

    Its state dict speaks the original model's names (``key_names``: see
    ``runtime.names``), whatever names the layers carry in the pipeline.
    """

    _step: Step
    _watch: Watch
    #: the layers' keys to and from the original model's (the identity for a plain nn.Sequential)
    key_names: Names = Names()

    # ignore: nn.Module.state_dict is overloaded on destination's type; this one takes the common keywords only
    # mypy: nn.Module.state_dict is a set of overloads; one keyword-only signature cannot match them all
    def state_dict(self, *, destination: Optional[Dict[str, Any]] = None, prefix: str = "",  # type: ignore[override]
                   keep_vars: bool = False) -> Dict[str, Any]:
        """The state of the layers held here, keyed by the original model's names."""
        own = self.key_names.to_original(super().state_dict(keep_vars=keep_vars))
        if destination is None and not prefix:
            return own
        out = destination if destination is not None else OrderedDict()
        for key, value in own.items():
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a state dict keyed by the original model's names (the pipeline's own names are taken too).

        Missing and unexpected keys are reported under the original names.
        """
        names = self.key_names
        if names.identity:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        own = list(nn.Module.state_dict(self, keep_vars=True))
        result = super().load_state_dict(names.to_own(state_dict, own), strict=False, assign=assign)
        missing = list(OrderedDict.fromkeys(names.original(k) for k in result.missing_keys))
        unexpected = list(OrderedDict.fromkeys(names.original(k) for k in result.unexpected_keys))
        if strict and (missing or unexpected):
            raise RuntimeError(key_mismatch(type(self).__name__, missing, unexpected))
        return type(result)(missing, unexpected)

    def tied_keys(self) -> List[str]:
        """This process's keys that hold a later use of a tied weight (an output head tied to the embedding): the
        places that take the first use's value at every step, and that Hugging Face checkpoints leave out."""
        return sorted(self.tied_places())

    def tied_places(self) -> Dict[str, str]:
        """The later places of each tied weight this process uses, and the weight's first place (in the model's
        order; either may sit in another process), by the model's keys.

        Both kinds: a tie across stages (each later stage holds a copy) and one whose places all sit in one stage
        of this process (one tensor under several keys), so that a checkpoint reads alike whatever the cut, the
        devices or the virtual stages; and a directory that names the weight by a later place (transformers keeps
        ``shared`` where the engine's first place is the encoder's embedding) loads into the first."""
        original = self.key_names.original
        later = {original(name): original(tie.names[0]) for tie, _ in self._step.ties.entries
                 for name in tie.names[1:]}
        first: Dict[int, str] = {}
        # this process's own tensors (not HybridParallel's state_dict, which gathers the whole model: copies, every
        # one a tensor of its own, and the whole model in every process's memory)
        for key, value in StepModule.state_dict(self, keep_vars=True).items():
            if isinstance(value, torch.Tensor) and first.setdefault(id(value), key) != key:
                later.setdefault(key, first[id(value)])
        return later

    @property
    def trace(self) -> Optional[Trace]:
        """The timeline being recorded (None when off); assign a ``Trace`` to start recording."""
        return self._step.trace

    @trace.setter
    def trace(self, value: Optional[Trace]) -> None:
        self._step.trace = value

    @property
    def last_step(self) -> Optional[StepStats]:
        """The last training step's figures on this process (None before the first): its time, samples/s,
        tokens/s for a ``(total, count)`` loss, each device's idle share and peak memory (``runtime.stats``)."""
        return self._step.stats.last

    @property
    def log_every(self) -> Optional[int]:
        """Training steps between two INFO records of the ``"pipeddp"`` logger, on rank 0 (None: none; see
        ``pipeddp.watch``)."""
        return self._watch.log_every

    @log_every.setter
    def log_every(self, value: Optional[int]) -> None:
        self._watch.log_every = check_log_every(value)

    def _start_watch(self, log_every: Optional[int], rank: int) -> None:
        """Log the steps' figures every ``log_every`` steps (checked by ``check_log_every`` before the engine was
        built) where ``rank`` is 0; called once, when built."""
        self._watch = Watch(self._step.stats, log_every, rank)
        self._step.after_step.append(self._watch)

    @property
    def placement(self) -> str:
        """How the stages sit on the devices: ``"loop"`` (round robin) or ``"v"`` (down and back up; what
        ``placement="auto"`` chose)."""
        return self._step.placement

    @property
    def virtual_stages(self) -> int:
        """Stages per device (each pipeline has ``devices * virtual_stages`` stages; what ``"auto"`` chose)."""
        return self._step.virtual_stages

    @property
    def stages(self) -> List[Stage]:
        """The stages this process runs, in order (each has ``.module``, ``.device``, ``.index``)."""
        return list(self._step.stages)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip gradients as ``torch.nn.utils.clip_grad_norm_`` on the plain model would; returns the total norm.

        Call it where you would clip the plain model: after ``train_step`` (or
        ``backward``), after ``scaler.unscale_(optimizer)`` when scaling, before
        ``optimizer.step()``; in ``HybridParallel`` on every rank (in stage mode
        it is a collective of each pipeline's processes). The norm counts every
        weight of the plain model once: a tied weight's copies are left out, and
        in stage mode the other stages' gradients are counted too, so every
        process clips by the plain model's factor. ``clip_grad_norm_`` over
        ``engine.parameters()`` would count tied copies twice and, in stage mode,
        see one stage only. Returns the norm as a float64 scalar tensor.
        """
        copies, device, combine = self._norm_scope()
        return clip_grad_norm(list(self.parameters()), self._step.ties.copies() + copies, max_norm, norm_type,
                              device=device, combine=combine, error_if_nonfinite=error_if_nonfinite)

    def _norm_scope(self) -> Tuple[List[nn.Parameter], torch.device, Optional[Combine]]:
        """For ``clip_grad_norm_``: copies of ties held for other processes, where the norm is summed, and
        how other processes' shares join it (None: this process holds every stage)."""
        return [], self._step.stages[0].device, None

    def close(self) -> None:  # pragma: no cover - each class says what it stops
        raise NotImplementedError

    def __enter__(self: Self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
