"""Wrap a stage in DDP so that its gradients are averaged exactly once per step.

DDP arms its gradient reducer in *forward*: a forward run with sync enabled
makes the next backward all-reduce. Pipelines break the usual recipe
("``no_sync()`` for every micro-batch but the last"): under 1F1B a stage
runs its last forward *before* several earlier backwards::

    stage 0 (p=2, m=4):  F0 F1 B0 F2 B1 F3 B2 B3
                                        ^^ last forward armed here ...
                                           ^^ ... so B2 all-reduces, too early,
                                              with B3's gradient missing

pipeddp instead runs every micro-batch on the bare stage module (DDP never
sees it, gradients simply accumulate) and arms DDP right before the stage's
*last backward*, whatever the schedule: the backward roots of that
micro-batch (its outputs, or its loss) are passed through the DDP module's
forward, which arms the reducer and returns them unchanged. The backward
that follows fires DDP's hooks once per parameter, on gradients that
already hold every other micro-batch, and the buckets' all-reduce overlaps
with the rest of that backward and with the backwards still running on the
stages before it.

Recompute is safe: it is a plain forward of the bare module, so DDP hooks
(which fire in backward) run once per parameter per step.

Buffers (``broadcast_buffers``, DDP's default): DDP would broadcast them from
the group's first rank in that arming forward, in place, *before* the last
backward; where autograd saved a buffer for that backward (BatchNorm's running
statistics, in some torch releases) the backward then refuses a tensor changed
since. So DDP is built without it and the stage broadcasts its buffers itself
right *after* its last backward (``DDPSync.finish``), coalesced per dtype: the
same values (nothing runs a forward in between), and every replica starts the
next step with the first rank's, as under DDP.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from ..runtime.gradsync import GradSync
from ..runtime.stage import Stage
from ..runtime.trace import Span, Trace

__all__ = ["attach_ddp", "attach_stages", "check_ddp_kwargs", "with_sync_batchnorm", "COMM_HOOKS"]


#: DDP's options that sync buffers: ``broadcast_buffers`` (at init and before every forward) and, in newer torch,
#: ``forward_sync_buffers`` (before every forward only); the one that turns the per-forward sync off alone
_BUFFER_SYNC = ("broadcast_buffers", "forward_sync_buffers")
_FORWARD_SYNC = next((k for k in reversed(_BUFFER_SYNC) if k in inspect.signature(DistributedDataParallel).parameters),
                     "broadcast_buffers")


class _Arm:
    """Sentinel first argument: 'return the second argument unchanged'."""


_ARM = _Arm()


class _Armable(nn.Module):
    """The stage's layers, plus a pass-through call used to arm DDP."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        if args and args[0] is _ARM:
            return args[1]
        return self.module(*args)


def _hook(name: str, group: Any) -> tuple:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "fp16":
        return group, default_hooks.fp16_compress_hook
    if name == "bf16":
        return group, default_hooks.bf16_compress_hook
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, min_compression_rate=2)
        return state, powerSGD_hook.powerSGD_hook
    raise ValueError(f"unknown comm_hook {name!r}; choose one of {COMM_HOOKS} or pass a function(state, bucket)")


COMM_HOOKS = ("fp16", "bf16", "powersgd")

CommHook = Union[str, Callable[..., Any]]


def check_ddp_kwargs(ddp_kwargs: Optional[Dict[str, Any]], comm_hook: Optional[CommHook] = None) -> Dict[str, Any]:
    """Validate the user's DDP options up front (also in a one-replica job, where no DDP is built)."""
    if isinstance(comm_hook, str) and comm_hook not in COMM_HOOKS:
        raise ValueError(f"unknown comm_hook {comm_hook!r}; choose one of {COMM_HOOKS} or pass a hook function")
    if comm_hook is not None and not isinstance(comm_hook, str) and not callable(comm_hook):
        raise TypeError(f"comm_hook must be one of {COMM_HOOKS} or a DDP communication hook function(state, bucket), "
                        f"got {type(comm_hook).__name__}")
    if ddp_kwargs is not None and not isinstance(ddp_kwargs, dict):
        raise TypeError(f"ddp_kwargs must be a dict of DistributedDataParallel options, got "
                        f"{type(ddp_kwargs).__name__}")
    kwargs = dict(ddp_kwargs or {})
    known = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"ddp_kwargs has {unknown}, which DistributedDataParallel does not take; its options are "
                         f"{sorted(known - {'module', 'process_group', 'device_ids', 'output_device'})}")
    if kwargs.get("static_graph"):
        raise ValueError(
            "ddp_kwargs static_graph=True is not supported: DDP's static-graph mode assumes one forward per "
            "backward, and a pipeline stage runs one per micro-batch; drop static_graph"
        )
    for key in ("process_group", "device_ids", "output_device", "module"):
        if key in kwargs:
            raise ValueError(f"ddp_kwargs may not set {key!r}: pipeddp chooses it for every stage")
    return kwargs


def _traced(fn: Callable[..., Any], trace: Trace, stage: int) -> Callable[..., Any]:
    """Wrap a comm hook so each bucket's all-reduce becomes a span (issue -> result ready)."""

    def hook(state, bucket):  # no annotations: DDP inspects them
        start = time.perf_counter()
        fut = fn(state, bucket)

        def done(f: Any) -> Any:
            trace.add(Span(stage, "allreduce", bucket.index(), start, time.perf_counter(), "comm", trace.rank))
            return f.value()

        return fut.then(done)

    return hook


def attach_ddp(stage: Stage, group: Any, *, ddp_kwargs: Optional[Dict[str, Any]] = None,
               comm_hook: Optional[CommHook] = None,
               trace: Optional[Trace] = None) -> Optional[DistributedDataParallel]:
    """Wrap ``stage`` in DDP over ``group`` and make its last backward of a step reduce.

    Returns the DDP module (None for a stage without trainable parameters,
    which has nothing to average). ``comm_hook`` is one of ``COMM_HOOKS`` or a
    DDP communication hook ``fn(state, bucket) -> Future``, which gets the
    stage's process group as its state. With ``trace``, every bucket's
    all-reduce is recorded as an ``"allreduce"`` span of the stage.
    """
    kwargs = check_ddp_kwargs(ddp_kwargs)
    if not any(p.requires_grad for p in stage.module.parameters()):
        return None
    device_ids = [stage.device.index] if stage.device.type == "cuda" else None
    asked = {k: kwargs.pop(k) for k in _BUFFER_SYNC if k in kwargs}
    broadcast = all(asked.values())
    if not broadcast:
        kwargs.update(asked)  # the user's own choice, as given
    else:  # DDP syncs the buffers at init (torch's newer option) or not at all (older): then the sync below does
        kwargs[_FORWARD_SYNC] = False
    ddp = DistributedDataParallel(_Armable(stage.module), device_ids=device_ids, process_group=group, **kwargs)
    if comm_hook is not None or trace is not None:
        if comm_hook is None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            comm_hook = default_hooks.allreduce_hook
        state, fn = _hook(comm_hook, group) if isinstance(comm_hook, str) else (group, comm_hook)
        ddp.register_comm_hook(state, _traced(fn, trace, stage.index) if trace is not None else fn)

    ignored = set(getattr(stage.module, "_ddp_params_and_buffers_to_ignore", ()))
    buffers = [b for name, b in stage.module.named_buffers() if name not in ignored] if broadcast else []
    stage.grad_sync = sync = DDPSync(ddp, group, buffers)
    if _FORWARD_SYNC == "broadcast_buffers":
        sync.broadcast()  # what DDP's init does with broadcast_buffers=True: every replica starts from the first's
    return ddp


class DDPSync(GradSync):
    """DDP's reduction at the stage's last weight action: the roots go through one forward of the wrapper, which
    arms the reducer, so the backward that follows all-reduces every bucket once; after it, the stage's
    ``buffers`` are broadcast from the group's first rank (see the module docstring)."""

    def __init__(self, ddp: DistributedDataParallel, group: Any = None,
                 buffers: Sequence[torch.Tensor] = ()) -> None:
        self.ddp = ddp
        self.group = group
        self.buffers = list(buffers)

    def arm(self, roots: List[torch.Tensor]) -> List[torch.Tensor]:
        with torch.enable_grad():  # DDP arms its reducer only when grad mode is on
            return list(self.ddp(_ARM, roots))

    def finish(self) -> None:
        self.broadcast()

    def broadcast(self) -> None:
        """The stage's buffers from the group's first rank to the others (a collective of the group)."""
        if not self.buffers:
            return
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        by_kind: Dict[Any, List[torch.Tensor]] = {}
        for b in self.buffers:
            by_kind.setdefault((b.dtype, b.device), []).append(b)
        with torch.no_grad():
            for same in by_kind.values():
                flat = _flatten_dense_tensors(same)
                dist.broadcast(flat, src=src, group=self.group)
                if dist.get_rank() != src:
                    for b, value in zip(same, _unflatten_dense_tensors(flat, same)):
                        b.copy_(value)


def attach_stages(stages: Sequence[Stage], groups: Dict[int, Any], *, ddp_kwargs: Optional[Dict[str, Any]] = None,
                  comm_hook: Optional[CommHook] = None,
                  trace: Optional[Trace] = None) -> List[Optional[DistributedDataParallel]]:
    """``attach_ddp`` for each of a process's stages over its stage group (``groups[stage index]``).

    SyncBatchNorm layers are pointed at the same group first: a stage's copies
    share batch statistics with each other, never with another stage.
    """
    out = []
    for st in stages:
        for layer in st.module.modules():
            if isinstance(layer, nn.SyncBatchNorm):
                layer.process_group = groups[st.index]
        out.append(attach_ddp(st, groups[st.index], ddp_kwargs=ddp_kwargs, comm_hook=comm_hook, trace=trace))
    return out


def with_sync_batchnorm(model: nn.Sequential, devices: Sequence[torch.device], replicas: int,
                        rank: int) -> nn.Sequential:
    """``model`` with its BatchNorm layers as ``SyncBatchNorm`` (before the stages take the layers).

    torch's SyncBatchNorm runs only on GPUs; with one replica there is nothing to synchronise.
    """
    if any(d.type != "cuda" for d in devices):
        raise ValueError(f"rank {rank}: sync_batchnorm=True needs CUDA devices (torch's SyncBatchNorm runs only "
                         "on GPUs); on CPU, BatchNorm buffers follow DDP's broadcast_buffers instead")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if replicas > 1 else model
