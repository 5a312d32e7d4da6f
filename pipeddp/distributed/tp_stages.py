"""Tensor parallelism inside this process's stages: sharding the layers, and what the engine does around it.

The plan (``tensor_parallel.resolve_plan``) says which module takes which
style; this applies it and keeps the rest of the engine exact with DTensor
parameters::

    build       each layer, once it has its values (a meta build: the whole layer on the CPU from the
                layout-independent seed, then sharded at once, so a process never holds more than one
                layer whole), goes through parallelize_module(layer, mesh["tp"], its part of the plan)
    partition   profiled by the first rank of the slice at t = 0 alone; its cut (and schedule="auto"'s
                order) is taken by every slice, so the stages are the same in each
    replicas    the stage's gradients, each rank's shards, averaged over the stage's dp group in one
                coalesced all-reduce after the step's last weight action (DDP's reducer takes no DTensor);
                with shard=, FSDP2's fully_shard over mesh["dp"] (``shard.StageShard``), as torch composes
                them: each tp shard split again over dp, 2-D DTensors over (dp, tp), reduce-scattered once
    clipping    a shard over tp counts on every tp rank, a tensor replicated over tp on t = 0 alone; the
                shares are summed over tp (and, with shard=, over the job: dp's shards), so every rank clips
                by the whole model's norm
    skipping    a non-finite gradient in one tp rank's shard marks the others' too: the slices skip together

The tp ranks of a stage run the same actions in the same order (the same
schedule on the same cut), so the sharded layers' collectives over ``tp``
pair up as the pipeline's messages do.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..runtime.clip import Combine
from ..runtime.dtensors import local
from ..runtime.gradsync import GradSync
from ..runtime.materialize import is_meta
from ..runtime.names import recorded_source
from ..runtime.settings import Settings
from ..runtime.stage import Stage
from .tensor_parallel import PlanArg, layer_plan, resolve_plan

__all__ = ["TensorParallel", "TPGradSync", "tensor_parallel"]

T = TypeVar("T")


def _nothing() -> Any:
    """What a slice at t > 0 computes for ``on_first``: nothing, t = 0's result replaces it."""
    return None


def _over_tp(p: torch.Tensor) -> bool:
    """Whether ``p`` is split over tp (a shard on each rank), not the same on every tp rank: a shard on the mesh's
    ``tp`` dimension (with ``shard=`` FSDP2 shards every parameter over ``dp`` too; those over dp alone are not)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return False
    names = p.device_mesh.mesh_dim_names or ()
    return "tp" in names and isinstance(p.placements[names.index("tp")], Shard)


def tensor_parallel(model: nn.Sequential, mesh: Any, tp_plan: PlanArg, settings: Settings, *, stages: int,
                    shard: str, ddp_options: bool) -> "TensorParallel":
    """This process's ``TensorParallel`` for ``tp_plan`` over ``mesh`` (the 1-D tp mesh); refuses, before anything is
    allocated and on every rank alike, a plan that cannot apply and what is not made to work with it yet.

    Zero-bubble schedules need nothing of their own: a split layer's collectives sit on the input side of its
    backward (the all-reduce of a column-wise layer's input gradient, in the backward of its input's
    ``from_local``), so they run in the input half (I); the weight half (W) computes local shards from what I left,
    with no collective, except on a stage whose input takes no gradient (the first), whose whole backward, its
    collectives with it, is W's. Either way every tp rank of a stage runs the same actions in the same order, so
    the collectives pair up as in a whole backward."""
    if ddp_options:
        raise ValueError("with tp_plan the replicas' gradients are averaged by pipeddp itself (DDP takes no DTensor "
                         "parameters), so ddp_kwargs and comm_hook have nothing to configure: leave them out")
    styles = resolve_plan(model, tp_plan, mesh.size())
    if settings.compile is not None:
        _check_compile(model, styles)
    return TensorParallel(mesh, styles, built_whole=not is_meta(model), sharded=shard != "none")


def _dropouts(model: nn.Sequential) -> List[str]:
    """Where the model may draw dropout masks: its dropout modules with p > 0, and a config's dropout above 0 (a
    transformers model's attention dropout is a functional call, no module)."""
    from torch.nn.modules.dropout import _DropoutNd

    config = getattr(recorded_source(model), "config", None)
    settings: Dict[str, Any] = config.to_dict() if config is not None and hasattr(config, "to_dict") else {}
    drops = [f"{k} (p={m.p})" for k, m in model.named_modules() if isinstance(m, _DropoutNd) and m.p > 0]
    return drops + [f"config.{k}={v}" for k, v in settings.items()
                    if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, float) and v > 0]


def check_seeded_alike(model: nn.Sequential, tp: "TensorParallel", gather: Callable[[Any], List[Any]]) -> None:
    """Refuse tp ranks whose CPU generators differ where the model drops: each step's base seed is drawn from the
    process's generator, so tp ranks seeded apart (``torch.manual_seed(rank)``) would draw different masks on a
    replicated activation and train apart without a word. Checked once at build over the tp group, each group's
    verdict then told through ``gather`` (every rank of this tp slice's value on each), so every rank refuses alike."""
    if tp.size == 1 or not _dropouts(model):
        return
    state = hashlib.sha1(torch.random.get_rng_state().numpy().tobytes()).hexdigest()
    states: List[Optional[str]] = [None] * tp.size
    dist.all_gather_object(states, state, group=tp.group)
    ranks = dist.get_process_group_ranks(tp.group)
    apart = sorted({tuple(r for r, s in zip(ranks, states) if s == one) for one in states})
    told = [a for a in gather(apart if len(apart) > 1 else []) if a]  # each tp group's verdict, through this slice
    if told:
        raise ValueError(f"tensor-parallel ranks of one stage start from different random states (ranks grouped by "
                         f"state: {told[0]}), and the model drops: their dropout masks on the activations they share "
                         "would differ and the ranks would train apart. Seed every rank alike "
                         "(torch.manual_seed(same_seed) on every process before building), and draw what must differ "
                         "by rank from a torch.Generator of its own")


def _check_compile(model: nn.Sequential, styles: Dict[str, Any]) -> None:
    """``compile=`` with tp: refused where a compiled stage would not compute the plain model's numbers.

    An Embedding split by rows of the vocabulary returns a partial sum with a mask (DTensor's ``MaskPartial``),
    reduced by its module's hook; a flattened model's stage breaks its graph above the embedding, so the layer's
    forward is compiled alone, and torch 2.14 fails tracing it ("Mixing fake modes": the mask made under one fake
    mode is read under AOT autograd's). Dropout between split layers draws each part from the whole tensor's
    numbers through pipeddp's kernels (``runtime.shard_draws``), which a compiled graph's ops do not reach.
    """
    split = [k for k in styles if isinstance(model.get_submodule(k), nn.Embedding)]
    if split:
        raise ValueError(f"compile= with an Embedding split over tp ({', '.join(split)}) fails in torch's tracing of "
                         "the vocabulary-split lookup (its masked partial sum): leave compile out, or the embedding "
                         "out of tp_plan")
    drops = _dropouts(model)
    if drops:
        raise ValueError(f"compile= with tp_plan and dropout ({', '.join(drops)}) would draw each tp rank's part of a "
                         "split activation from the start of the numbers, not the plain model's: a compiled graph's "
                         "random ops do not reach the kernels that draw the whole tensor and keep the part; leave "
                         "compile out, or set the dropout to 0")


class TensorParallel:
    """This process's tp mesh (``mesh["tp"]``) and the resolved ``styles`` (``{flattened module path: style}``);
    ``built_whole``: the model's layers have values on every rank already (not a meta build), so shards and the
    tensors the plan leaves whole are taken from tp rank 0, as DDP takes the first replica's; ``sharded``: FSDP2
    (``shard=``) shards the stages over their replicas too, and reduces their gradients (``shard.StageShard``)."""

    def __init__(self, mesh: Any, styles: Dict[str, Any], *, built_whole: bool, sharded: bool = False) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.styles = styles
        self.built_whole = built_whole
        self.sharded = sharded

    def distribute(self, name: str, layer: nn.Module) -> None:
        """Shard the model's layer ``name`` by its part of the plan (nothing where the plan names none of it)."""
        from torch.distributed.tensor.parallel import parallelize_module

        plan = layer_plan(self.styles, name)
        if plan is None:
            return
        # a meta build's values are the same on every rank: each keeps its own shard
        parallelize_module(layer, self.mesh, plan, src_data_rank=0 if self.built_whole else None)


    def settle(self, stages: Sequence[Stage]) -> None:
        """A model built whole on each rank: the tensors the plan leaves whole take tp rank 0's values."""
        if not self.built_whole or self.size == 1:
            return
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for st in stages:
                for t in list(st.module.parameters()) + list(st.module.buffers()):
                    if not _over_tp(t) and t.numel():
                        dist.broadcast(local(t.data), src=src, group=self.group)

    def agree(self, value: T) -> T:
        """``value`` as tp rank 0 holds it, on every tp rank (the cut profiled at t = 0)."""
        if self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

    def on_first(self, from_rank0: Callable[[Callable[[], T]], T]) -> Callable[[Callable[[], T]], T]:
        """``from_rank0`` (the job's: its first rank's result for every rank), then tp rank 0's for every slice;
        ``fn`` (a profile, say) runs on the slice at t = 0 alone, since the others' results would be replaced."""
        return lambda fn: self.agree(from_rank0(fn if self.rank == 0 else _nothing))

    def attach(self, stages: Sequence[Stage], groups: Dict[int, Any]) -> None:
        """Each stage's gradients averaged over its replicas (``groups[stage index]``), its values first made the
        group's first rank's, as DDP's construction does. Nothing with ``shard=``: FSDP2 does both there."""
        for st in stages if not self.sharded else ():
            if any(p.requires_grad for p in st.module.parameters()):
                st.grad_sync = sync = TPGradSync(st.module, groups[st.index])
                sync.broadcast(list(st.module.parameters()) + list(st.module.buffers()))

    def norm_scope(self, params: Sequence[nn.Parameter], copies: List[nn.Parameter], device: torch.device,
                   combine: Optional[Combine]) -> Tuple[List[nn.Parameter], torch.device, Combine]:
        """For clipping: what a tp rank leaves out (on t > 0 every tensor replicated over tp) and how the shares
        join (the job's ``combine``, then a sum over tp)."""
        if self.rank:
            copies = copies + [p for p in params if not _over_tp(p)]

        def joined(part: torch.Tensor, is_max: bool) -> torch.Tensor:
            part = combine(part, is_max) if combine is not None else part
            buf = part.to(device, torch.float64, copy=True)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM, group=self.group)
            return buf

        return copies, device, joined

    def after_backward(self, params: Sequence[nn.Parameter], device: torch.device, vote: bool) -> None:
        """Once a step's backwards are done: every gradient laid out as its parameter; with ``vote`` (a step that
        may be skipped), a non-finite gradient on one tp rank shared with the others (``share_nonfinite``)."""
        for p in params:
            _placed_like(p)
        if vote:
            self.share_nonfinite(params, device)

    def share_nonfinite(self, params: Sequence[nn.Parameter], device: torch.device) -> None:
        """A non-finite gradient on any tp rank of the stage makes one of this rank's non-finite too, so every
        slice's vote (``Agreement.finish_step``) finds it and the slices skip, or scale, together."""
        grads = [local(p.grad) for p in params if p.grad is not None]
        flag = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            if g.numel() and not bool(torch.isfinite(g).all()):
                flag.fill_(1.0)
                break
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        held = [g for g in grads if g.numel()]  # with shard=, a small tensor's shard may be empty on this rank
        if flag.item() and held and all(bool(torch.isfinite(g).all()) for g in held):
            held[0].view(-1)[0] = float("nan")


class TPGradSync(GradSync):
    """A stage's gradients (each rank's shards, and the tensors the plan leaves whole) averaged over its replicas'
    ``group`` once the step's last weight action is done, coalesced per dtype and device; then its buffers from
    the group's first rank, as ``DDPSync`` does."""

    def __init__(self, module: nn.Module, group: Any) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = list(module.buffers())
        self.group = group

    def finish(self) -> None:
        n = dist.get_world_size(self.group)
        grads = []
        for p in self.params:
            if p.grad is None:  # every replica reduces the same list
                p.grad = torch.zeros_like(p)
            grads.append(local(p.grad))
        with torch.no_grad():
            for same in _by_kind(grads).values():
                flat = _flatten_dense_tensors(same)
                dist.all_reduce(flat, group=self.group)
                flat.div_(n)
                for g, value in zip(same, _unflatten_dense_tensors(flat, same)):
                    g.copy_(value)
        self.broadcast(self.buffers)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """``tensors`` (this rank's shards) from the group's first rank to the others."""
        src = dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            for same in _by_kind([local(t.data) for t in tensors if t.numel()]).values():
                flat = _flatten_dense_tensors(same)
                dist.broadcast(flat, src=src, group=self.group)
                if dist.get_rank() != src:
                    for t, value in zip(same, _unflatten_dense_tensors(flat, same)):
                        t.copy_(value)


def _by_kind(tensors: Sequence[torch.Tensor]) -> Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]]:
    out: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.dtype, t.device), []).append(t)
    return out


def _placed_like(p: torch.Tensor) -> None:
    """A gradient laid out as its parameter: a vocabulary-sharded embedding's backward gives a replicated one (the
    whole table on every rank), which the shard's optimizer state and clipping would take for a shard."""
    from torch.distributed.tensor import DTensor

    grad = p.grad
    if isinstance(p, DTensor) and isinstance(grad, DTensor) and grad.placements != p.placements:
        p.grad = grad.redistribute(p.device_mesh, p.placements)
