"""Shard each stage's training state over its replicas with FSDP2, and reduce exactly once per step.

With DDP every replica of a stage holds the stage's whole parameters, whole
gradients and whole optimizer state: R replicas store it R times. Here each
stage module is handed to ``torch.distributed.fsdp.fully_shard`` over a 1-D
``DeviceMesh`` of that stage's replica group (the group DDP would use), so its
parameters become ``DTensor`` shards and an optimizer built over
``engine.parameters()`` holds 1/R of the state::

    shard="optimizer"                               shard="full" (one FSDP group per layer)
      F0: all-gather once, params stay whole          F: all-gather the layer, free it after
      F1 B0 F2 B1 ...  grads accumulate whole         B: all-gather again, free after
      last B/W: reduce-scatter once, reshard          last B/W: reduce-scatter once
      between steps: 1/R params, grads, state         peak params: 1/R of the stage + one layer

The trap is FSDP's own hooks. Left alone, FSDP reduce-scatters in the
post-backward hook of every micro-batch (R-fold the communication, and under
1F1B the hook of a backward that is not the last). Worse, a split backward's
weight half (``torch.autograd.grad`` / ``backward(inputs=...)``, schedule
``"zb"``) never fires those hooks at all, so FSDP would never reduce the
gradients that half accumulates. torch's pipelining learned both the hard way:
it turns FSDP's sync off for every micro-batch and then runs each parameter
group's post-backward by hand, and shipped wrong gradients until it also ran
the root's final callback, which finishes the reduce-scatter.

pipeddp does what it does for DDP (``ddp.py``), explicitly: gradient sync,
"last backward" and (with ``"optimizer"``) resharding after backward are off
for every micro-batch, so gradients accumulate unsharded in every B and W.
The schedule's step that arms DDP (the stage's last B or W of the step,
whatever the schedule: built-in, virtual stages, or a user's function) runs
``StageShard.reduce`` right after that action: every parameter group's
post-backward with sync on (the reduce-scatter into the sharded ``.grad``,
averaged over the replicas, and the reshard) and then the root's final
callback, which waits for the reduce-scatter. It runs in the stage's own
thread, inside ``train_step``, so the gradients are final when ``train_step``
returns. Recompute is a plain forward of the stage module: FSDP unshards for
it, and the reduction still happens once.

On gloo (CPU) FSDP's all-gather and reduce-scatter are handed to one
all-reduce each (``GlooAllGather``, ``GlooReduceScatter``): gloo's all-reduce
is its fast collective, and the pair cost 4x DDP's one all-reduce otherwise.

FSDP2 exposes no public call for "reduce now"; the two reach-ins
(``post_backward`` of each group and ``_root_post_backward_final_callback``)
are the ones torch's own pipelining makes, checked once at build time so a
torch that renames them fails with a clear message rather than silently.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.dtensors import is_dtensor, local
from ..runtime.gradsync import GradSync
from ..runtime.stage import Stage
from ..runtime.trace import Span, Trace

__all__ = ["SHARD_MODES", "StageShard", "attach_shards", "check_shard", "split_backward",
           "whole_tensors", "shard_like"]

#: the ``shard=`` settings: DDP (nothing sharded), optimizer state + gradients (+ params between steps), everything
SHARD_MODES = ("none", "optimizer", "full")


def _api() -> Any:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    needed = ("set_requires_gradient_sync", "set_is_last_backward", "set_reshard_after_backward")
    if not all(hasattr(FSDPModule, n) for n in needed) or not hasattr(fully_shard, "state"):
        raise RuntimeError(f"shard= needs torch's FSDP2 (torch.distributed.fsdp.fully_shard) with "
                           f"{needed}; this torch {torch.__version__} lacks them: use shard='none' or a newer torch")
    return fully_shard


class StageShard(GradSync):
    """One stage's FSDP2 wrapping and its once-per-step reduction: the stage's gradient sync, whose ``finish``
    (after its last B or W) reduce-scatters."""

    def __init__(self, stage: Stage, group: Any, mode: str, trace: Optional[Trace] = None) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        fully_shard = _api()
        self.stage = stage
        self.mode = mode
        self.group = group
        self.trace = trace
        device_type = stage.device.type
        module = stage.module
        mesh = _replica_mesh(module, group)
        if mesh is None:
            mesh = DeviceMesh.from_group(group, device_type)
        full = mode == "full"
        _same_as_first(module, group)
        if full:  # one FSDP group per layer: the peak holds one gathered layer, not the whole stage
            for layer in _own_layers(module):
                fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(module, mesh=mesh, reshard_after_forward=full)
        self.root: Any = module
        state = fully_shard.state(module)
        if not hasattr(state, "_root_post_backward_final_callback") or not hasattr(state, "_state_ctx"):
            raise RuntimeError(f"shard= cannot drive this torch's FSDP2 ({torch.__version__}): its state has no "
                               "post-backward final callback; use shard='none'")
        self._state = state
        if dist.get_backend(group) == "gloo" and device_type == "cpu":
            from torch.distributed.fsdp import FSDPModule

            for m in module.modules():
                if isinstance(m, FSDPModule):
                    # mypy: torch types these hooks with a private protocol that our gloo collectives implement
                    m.set_custom_all_gather(GlooAllGather())  # type: ignore[arg-type]
                    m.set_custom_reduce_scatter(GlooReduceScatter())  # type: ignore[arg-type]
        self.micro_batch_settings()
        stage.grad_sync = self

    def micro_batch_settings(self) -> None:
        """FSDP's own sync off for every micro-batch; params kept whole through the step unless ``"full"``."""
        root = self.root
        root.set_requires_gradient_sync(False)
        root.set_is_last_backward(False)
        root.set_reshard_after_backward(self.mode == "full")

    def finish(self) -> None:
        """Reduce-scatter the accumulated gradients into the sharded ``.grad`` once, reshard, and wait for it."""
        root = self.root
        start = time.perf_counter()
        root.set_requires_gradient_sync(True)
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        try:
            state = self._state
            for st in state._state_ctx.all_states:
                for group in _param_groups(st):
                    group.post_backward()
            state._root_post_backward_final_callback()
        finally:
            self.micro_batch_settings()
        if self.trace is not None:
            self.trace.add(Span(self.stage.index, "reduce_scatter", 0, start, time.perf_counter(), "comm",
                                self.trace.rank))

    def reshard(self) -> None:
        """Free the gathered parameters (after an evaluation forward, which keeps them with ``"optimizer"``:
        an ``optimizer.step()`` before the next step would otherwise leave them stale)."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.root.modules():
            if isinstance(m, FSDPModule):
                m.reshard()


    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter gathered once and kept whole in the body, then freed: forwards in it (an evaluation)
        run no collective, so replicas that hold different numbers of batches never wait for each other."""
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in self.root.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m in modules:  # as built: every layer reshards after its forward with "full", the root then too
                m.set_reshard_after_forward(self.mode == "full" or m is not self.root, recurse=False)
            self.reshard()


class GlooAllGather:
    """FSDP's all-gather as one all-reduce (a SUM of zeros and each rank's own piece: exact), for gloo on CPU.

    gloo's all-reduce is its fast collective: for 128 MB between two CPU processes it took 0.18 s where its
    all-gather took 0.31 s and its reduce-scatter 0.41 s, so FSDP's pair (0.72 s) cost 4x DDP's one all-reduce.
    """

    calls = 0

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        GlooAllGather.calls += 1
        n = input_tensor.numel()
        k = dist.get_rank(group)
        flat = output_tensor.view(-1)
        flat[k * n:(k + 1) * n].copy_(input_tensor.view(-1))  # FSDP's input may already be that slot: copy first
        flat[:k * n].zero_()
        flat[(k + 1) * n:].zero_()
        dist.all_reduce(output_tensor, group=group)


class GlooReduceScatter:
    """FSDP's reduce-scatter as one all-reduce of the whole input, of which each rank keeps its piece (gloo, CPU)."""

    calls = 0

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        GlooReduceScatter.calls += 1
        n = output_tensor.numel()
        k = dist.get_rank(group)
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.view(-1).copy_(input_tensor.view(-1)[k * n:(k + 1) * n])


def _param_groups(state: Any) -> List[Any]:
    """The parameter groups of one FSDP2 state: a list in the torch this is developed on (``_fsdp_param_groups``),
    at most one in older releases (``_fsdp_param_group``; torch 2.11 has it)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = getattr(state, "_fsdp_param_group", None)
    return [] if one is None else [one]


def _own_layers(module: nn.Module) -> List[nn.Module]:
    """The layers that can be an FSDP group of their own: with parameters, each once, sharing none with another
    layer (a weight tied inside the stage stays in the stage's root group, as FSDP requires)."""
    layers = list({id(layer): layer for layer in module.children()}.values())
    users: Dict[int, int] = {}
    for layer in layers:
        for p in {id(p) for p in layer.parameters()}:
            users[p] = users.get(p, 0) + 1
    return [layer for layer in layers if any(True for _ in layer.parameters())
            and all(users[id(p)] == 1 for p in layer.parameters())]


def _replica_mesh(module: nn.Module, group: Any) -> Optional[Any]:
    """With tensor-parallel parameters (DTensors over a ``tp`` mesh, ``tp_plan=``): the mesh of ``group``'s ranks cut
    from the same root mesh, else None. FSDP2 joins the two into 2-D DTensors over (dp, tp), which it can do only for
    meshes of one root (as torchtitan passes ``world_mesh["dp"]``); a mesh made from the group would be refused."""
    from torch.distributed.tensor import DTensor

    tp = next((p.device_mesh for p in module.parameters() if isinstance(p, DTensor)), None)
    if tp is None:
        return None
    root: Any = tp._get_root_mesh() if hasattr(tp, "_get_root_mesh") else None
    ranks = sorted(dist.get_process_group_ranks(group))
    for name in (root.mesh_dim_names or ()) if root is not None else ():
        if sorted(root[name].mesh.flatten().tolist()) == ranks:
            return root[name]
    raise RuntimeError(f"shard= with tensor-parallel stages needs the replicas' dimension in the tp mesh's root "
                       f"mesh (ranks {ranks}); this torch {torch.__version__} or this mesh has none: use shard='none'")


def _same_as_first(module: nn.Module, group: Any) -> None:
    """Every replica starts from the group's first rank's weights and buffers (what DDP does at wrapping); a
    tensor-parallel parameter's own shard."""
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(local(t.data), src=src, group=group)


def attach_shards(stages: Sequence[Stage], groups: Dict[int, Any], mode: str,
                  trace: Optional[Trace] = None) -> List[Optional[StageShard]]:
    """``StageShard`` for each of this process's stages over its stage group (None: nothing to train there).

    With ``trace``, each stage's reduction is a ``"reduce_scatter"`` span on its comm lane."""
    out: List[Optional[StageShard]] = []
    for st in stages:
        if not any(p.requires_grad for p in st.module.parameters()):
            out.append(None)
            continue
        out.append(StageShard(st, groups[st.index], mode, trace))
    return out


def whole_tensors(state: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` with every ``DTensor`` gathered whole (a collective over each tensor's mesh, on every replica)."""
    out: Dict[str, Any] = {}
    for key, value in state.items():
        out[key] = value.full_tensor().detach() if is_dtensor(value) else value
    return out


def shard_like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A whole tensor cut like the ``DTensor`` ``target`` (no communication: every rank holds the whole)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(value, DTensor) or not isinstance(target, DTensor):
        return value
    return distribute_tensor(value.to(target.device, target.dtype), target.device_mesh, target.placements,
                             src_data_rank=None)


def check_shard(shard: Any, *, replicas: int, model: nn.Module, split_backward: bool, sync_batchnorm: bool,
                ddp_options: bool) -> str:
    """The ``shard=`` setting to use: refused with the choices when unknown, with the way out when it cannot work.

    With one replica there is nothing to shard over: the setting is accepted,
    does nothing (``"none"`` is returned) and says so once.
    """
    if not isinstance(shard, str) or shard not in SHARD_MODES:
        raise ValueError(f"unknown shard={shard!r}; choose one of {SHARD_MODES} (\"none\": DDP, every replica holds "
                         "the whole stage; \"optimizer\": optimizer state, gradients and, between steps, parameters "
                         "split over the replicas; \"full\": parameters also freed after each forward and backward)")
    if shard == "none":
        return shard
    if replicas == 1:
        from ..runtime.warn import warn

        warn(f"pipeddp: shard={shard!r} has nothing to shard over with one replica; each stage keeps its whole "
             "state (as shard='none')", UserWarning)
        return "none"
    conflicts = []
    if ddp_options:
        conflicts.append("ddp_kwargs / comm_hook configure DDP, which shard= replaces with FSDP2: drop them, or "
                         "use shard='none'")
    if sync_batchnorm or any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        conflicts.append("BatchNorm running statistics are not kept equal over the replicas by FSDP2 (DDP "
                         "broadcasts them): use shard='none', or a model with LayerNorm/GroupNorm")
    if shard == "full" and split_backward:
        conflicts.append("shard='full' frees a layer's parameters after its input-gradient half, and a split "
                         "backward's weight half (schedule 'zb', schedule 'auto', which splits backwards to fill its "
                         "bubbles, or a schedule with W actions) would run on the freed shards: use "
                         "shard='optimizer' with that schedule, or schedule='1f1b' or 'interleaved'")
    if conflicts:
        raise ValueError(f"shard={shard!r} cannot be used here: " + "; ".join(conflicts))
    return shard


def split_backward(schedule: Any, stages: int, virtual_stages: int, placement: str = "loop") -> bool:
    """Whether ``schedule`` splits backward into input (I) and weight (W) halves (``placement="auto"``: as placed
    round robin; a schedule of pipeddp's splits it, or not, in either placement)."""
    from ..runtime.schedule import Kind, get_schedule

    plan = get_schedule(schedule, stages, 2 * stages, virtual_stages, placement="loop" if placement == "auto"
                        else placement)
    return any(a.kind is Kind.W for row in plan for a in row)
