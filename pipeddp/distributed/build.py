"""Wiring one process's part of a replicated pipeline: what ``HybridParallel(...)`` builds, in order.

::

    topology (torchrun's env, or the user's mesh) -> devices, backend -> the current CUDA device (this process's
        first) -> process group (unless one exists; a mesh's job: a group of its ranks) -> Agreement
        -> partition: measured on rank 0, the same on every rank (with tp_plan: every tp slice takes t = 0's)
        -> stage groups (and pipeline groups in stage mode), then the roll call: every rank there (``rollcall``)
        -> [SyncBatchNorm] -> this process's stages, registered on the owner under the model's names (with
           tp_plan: each layer sharded over tp as it is built, ``tp_stages``)
        -> runner: ThreadRunner (replica mode: every stage, on threads) | ProcessRunner (stage mode: one stage)
        -> Step, with the exchange of tied weights between processes (and schedule="auto"'s order)
        -> DDP over each stage's group (several replicas), or FSDP2's fully_shard with shard= (with tp_plan:
           the shards' gradients averaged over the group by ``TPGradSync``)

Every rank runs these steps in the same order, because several are
collectives (``new_group``, the partition's broadcast, DDP's first broadcast
of the weights): a rank that skipped one would leave the others waiting. The
arguments are checked before (``pipeddp._settings`` for what ``Pipeline``
shares, ``check_ddp_kwargs`` here, first thing), so a mistake raises on every
rank before any group or thread exists.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..partitioning.report import Partition
from ..runtime.devices import DeviceLike
from ..runtime.executor import ThreadRunner
from ..runtime.owned import register_layers
from ..runtime.refine import attach_auto
from ..runtime.schedule.actions import row_of, stages_on
from ..runtime.schedule.costed import Costs
from ..runtime.schedule.placing import VIRTUAL_CHOICES, choose_layout, choose_placement
from ..runtime.settings import Settings
from ..runtime.slicing import build_stages
from ..runtime.stage import Stage
from ..runtime.step import Runner, Step
from ..runtime.tied import Tie, find_ties
from ..runtime.trace import Trace
from .agreement import Agreement
from .ddp import CommHook, attach_stages, check_ddp_kwargs, with_sync_batchnorm
from .groups import Groups, choose_backend, host_group, init_process_group, local_devices, make_groups, with_job_group
from .replica import Replica
from .rollcall import Rollcall
from .shard import StageShard, attach_shards
from .stage_runner import ProcessRunner
from .tensor_parallel import PlanArg
from .ties import TieExchange
from .topology import Topology
from .tp_stages import TensorParallel, check_seeded_alike, tensor_parallel

__all__ = ["build_replica"]


def build_replica(owner: nn.Module, model: nn.Sequential, topology: Topology, settings: Settings, *,
                  partition: Callable[[torch.device], Partition],
                  devices: Union[None, str, Sequence[DeviceLike]] = None, backend: Optional[str] = None,
                  ddp_kwargs: Optional[Dict[str, Any]] = None, comm_hook: Optional[CommHook] = None,
                  sync_batchnorm: bool = False, trace: bool = False, threads: Optional[int] = None,
                  deferred_batch_norm: bool = False, shard: str = "none", tp_mesh: Optional[Any] = None,
                  tp_plan: PlanArg = None) -> Replica:
    """Wire this process's stages of ``model`` into ``topology``; their layers are registered on ``owner``.

    ``partition(device)`` cuts the model (``stages x virtual_stages`` stages);
    it runs on rank 0 only, on its first device, and every rank takes its
    result. The other arguments are ``HybridParallel``'s (``shard`` already
    checked by ``shard.check_shard``; ``tp_mesh``, ``tp_plan``: tensor parallelism
    over the mesh's ``tp`` dimension). A ``Pipeline`` is built here too: a
    job of one process and one replica in replica mode, where every
    collective is a local call and no process group is made.
    """
    check_ddp_kwargs(ddp_kwargs, comm_hook)
    topo, virtual = topology, settings.virtual_stages
    tp = tensor_parallel(model, tp_mesh, tp_plan, settings, stages=topo.stages, shard=shard,
                         ddp_options=bool(ddp_kwargs) or comm_hook is not None) if tp_mesh is not None else None
    n_stages = topo.stages * virtual
    devs = local_devices(topo, devices)
    backend = choose_backend(backend, devs, topo)
    if devs[0].type == "cuda" and topo.world_size > 1:  # before the first collective: NCCL's object
        torch.cuda.set_device(devs[0])                   # collectives use the current device
    owns_group = topo.world_size > 1 and not dist.is_initialized()
    if owns_group:
        init_process_group(backend, settings.timeout_delta)
    topo = with_job_group(topo, settings.timeout_delta)  # placed on a mesh: the job's collectives on its own ranks
    agreement = Agreement(topo, devs[0] if backend == "nccl" and topo.world_size > 1 else torch.device("cpu"),
                          host_group=host_group(topo, None, backend, topo.group, settings.timeout_delta))
    if tp is not None:
        check_seeded_alike(model, tp, agreement.gather_to_all)
    from_rank0 = tp.on_first(agreement.from_rank0) if tp is not None else agreement.from_rank0
    cut = from_rank0(lambda: partition(devs[0]))
    if settings.choose_virtual or settings.placement == "auto":  # from the profile, on rank 0 for every rank
        virtual, placement = from_rank0(lambda: _layout(cut, settings, topo.stages, len(model)))
        settings = replace(settings, virtual_stages=virtual, choose_virtual=False, placement=placement)
        n_stages = topo.stages * virtual
        cut = cut.recut(n_stages)  # the same solve on every rank
    balance = list(cut.balance)
    placement = settings.placement
    agreement.last_row = row_of(n_stages - 1, topo.stages, placement)
    groups = _groups(topo, backend, settings, virtual, placement)
    if sync_batchnorm:  # after profiling: a SyncBatchNorm would wait for the other ranks there
        model = with_sync_batchnorm(model, devs, topo.replicas, topo.rank)
    if topo.mode == "replica":
        indices = list(range(n_stages))
        placed = [devs[row_of(s, topo.stages, placement)] for s in indices]
    else:
        indices = stages_on(topo.stage, topo.stages, n_stages, placement)
        placed = [devs[0]] * len(indices)
    ties = find_ties(model, balance)  # by identity, before tp_plan replaces a tied weight at one place only
    local = build_stages(model, balance, placed, indices, compile=settings.compile, seed=settings.seed,
                         init=settings.init, distribute=tp.distribute if tp is not None else None)
    if tp is not None:
        tp.settle(local)
    register_layers(owner, local)
    runner: Runner
    if topo.mode == "replica":
        runner = ThreadRunner(local, threads=threads, timeout=settings.timeout, rank=topo.rank, rows=topo.stages,
                              n_stages=n_stages, placement=placement)
    else:
        twin = groups.pipeline_host if groups.pipeline_host is not groups.pipeline else None  # nccl: gloo headers
        runner = ProcessRunner.connect(local, topo, n_stages=n_stages, comm_device=agreement.comm_device,
                                       timeout=settings.timeout_delta, placement=placement, header_group=twin,
                                       side_group=groups.pipeline if twin is None else None)  # gloo: changes
    try:
        step, exchange, ddps, shards = _step_over(ties, topo, settings, local, balance, runner, agreement, groups,
                                                  backend, ddp_kwargs=ddp_kwargs, comm_hook=comm_hook, trace=trace,
                                                  deferred_batch_norm=deferred_batch_norm, shard=shard, tp=tp)
        attach_auto(step, cut.layers, balance, settings.max_activations, gather=agreement.gather_to_all,
                    on_rank0=from_rank0)  # schedule="auto": costs measured, one order for every rank
    except BaseException:
        runner.close()  # its threads (or links) must not outlive a construction that failed
        raise
    return Replica(topo, devs, backend, owns_group=owns_group, agreement=agreement, partition=cut, groups=groups,
                   step=step, runner=runner, ties=exchange, ddps=ddps, shards=shards, settings=settings, tp=tp)


def _groups(topo: Topology, backend: str, settings: Settings, virtual: int, placement: str) -> Groups:
    """``make_groups``, then the roll call (``rollcall``): a rank lost while the groups are made is named by every
    other rank, within the timeout, instead of leaving them waiting on it where nothing names it."""
    if len(topo.job_ranks) == 1:
        return make_groups(topo, backend, settings.timeout_delta, virtual, placement)
    call = Rollcall(topo, settings.timeout_delta)
    try:
        groups = make_groups(topo, backend, settings.timeout_delta, virtual, placement)
    except Exception as exc:  # noqa: BLE001 - told to the others, and raised again naming who is missing
        call.failed(exc)
        raise
    call.made()
    return groups


def _layout(cut: Partition, settings: Settings, devices: int, layers: int) -> Tuple[int, str]:
    """``(virtual stages, placement)`` where ``virtual_stages="auto"`` or ``placement="auto"`` leave them to the
    profile (``schedule.placing``): each number of stages per device played on the measured ``cut`` recut for it."""
    chunks = settings.chunks or 2 * devices  # with split_size, the default: two micro-batches per device

    def costs_of(v: int) -> Costs:
        return Costs.from_layers(cut.layers, cut.recut(devices * v).balance)

    if settings.choose_virtual:
        return choose_layout(devices, chunks, layers, costs_of, settings.placement, settings.max_activations,
                             VIRTUAL_CHOICES)
    v = settings.virtual_stages
    return v, choose_placement(settings.schedule, devices, chunks, v, costs_of(v), settings.max_activations)


def _step_over(ties: List[Tie], topo: Topology, settings: Settings, local: List[Stage], balance: List[int],
            runner: Runner, agreement: Agreement, groups: Groups, backend: str, *,
            ddp_kwargs: Optional[Dict[str, Any]], comm_hook: Optional[CommHook], trace: bool,
            deferred_batch_norm: bool, shard: str,
            tp: Optional[TensorParallel]) -> Tuple[Step, TieExchange, List[Optional[DistributedDataParallel]],
                                                   List[Optional[StageShard]]]:
    """The step over ``runner``, tied weights exchanged between processes, DDP (or FSDP2 with ``shard``) over each
    stage's group."""
    step = Step(local, topo.stages * settings.virtual_stages, runner, chunks=settings.chunks,
                split_size=settings.split_size, schedule=settings.schedule, checkpoint=settings.checkpoint, ties=ties,
                deferred_batch_norm=deferred_batch_norm, virtual_stages=settings.virtual_stages,
                placement=settings.placement)
    step.sync = topo.replicas > 1
    exchange = TieExchange(ties, step.ties, topo, backend=backend, timeout=settings.timeout_delta,
                           comm_device=agreement.comm_device, placement=settings.placement)
    step.before_forward += [exchange.refresh] if exchange.items else []  # no tie with another process: none due
    step.ties.across = exchange  # the gains of ties' uses in other processes join the step's fold
    step.trace = Trace(topo.rank) if trace else None
    if tp is not None and topo.replicas > 1:
        tp.attach(local, groups.stage)  # DDP's part, for DTensor parameters
    ddps = attach_stages(local, groups.stage, ddp_kwargs=ddp_kwargs, comm_hook=comm_hook,
                         trace=step.trace) if topo.replicas > 1 and shard == "none" and tp is None else []
    shards = attach_shards(local, groups.stage, shard, step.trace) if shard != "none" else []
    if shards:
        step.ties.rebind(local)  # the tied uses are the sharded parameters now
    return step, exchange, ddps, shards
