"""This process's devices and backend, the process group, and the stage-specific groups.

Everything here is decided the same way on every rank, from the same inputs
(the topology and the user's arguments), so that a mistake raises on every
rank with the rank named instead of leaving some ranks waiting in a
collective::

    devices      replica mode: ``stages`` consecutive CUDA devices by local rank; stage mode: one
                 (CPU when there is no GPU; one process with too few GPUs shares them between stages)
    backend      nccl for CUDA, gloo for CPU (checked against the devices and the mode)
    groups       per stage, the ranks holding a copy of it (its DDP group); in stage mode, per
                 replica, the ranks of its pipeline. Created on every rank in the same order,
                 as ``torch.distributed.new_group`` requires.
    host groups  where the job runs nccl, a gloo twin of the job's group and of each pipeline's, for
                 the agreements' tables and objects of host values (``host_group``)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..runtime.devices import DeviceLike, resolve_devices
from ..runtime.schedule.actions import row_of
from ..runtime.warn import warn
from .lazy import made_lazily
from .topology import Topology, env_world

__all__ = ["Groups", "current_topology", "local_devices", "choose_backend", "host_group", "init_process_group",
           "make_groups", "subgroup", "with_job_group"]


def current_topology(stages: int, mode: str, layout: str) -> Topology:
    """The grid as this process sees it: an initialised process group's rank and size win over the environment."""
    if dist.is_available() and dist.is_initialized():
        _, _, local_rank, local_world = env_world()
        return Topology(dist.get_rank(), dist.get_world_size(), local_rank, local_world, stages, mode, layout)
    rank, world, local_rank, local_world = env_world()
    return Topology(rank, world, local_rank, local_world, stages, mode, layout)


def local_devices(topo: Topology, devices: Union[None, str, Sequence[DeviceLike]]) -> List[torch.device]:
    """This process's devices: as given (checked), else by local rank (see the module docstring).

    ``devices="auto"``: the GPUs, or the CPU on a machine without any, so that one script runs on any
    machine. A node with GPUs, but too few for its processes, is refused (naming ``CUDA_VISIBLE_DEVICES``):
    a mis-set mask would otherwise train on the CPU for hours without a word.
    """
    want = topo.stages if topo.mode == "replica" else 1
    if devices == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            return [torch.device("cpu")] * want
        if count < topo.local_world_size * want and topo.local_world_size > 1:
            raise ValueError(
                f"rank {topo.rank}: devices='auto' found {count} CUDA device(s) on this node, but "
                f"{topo.local_world_size} processes x {want} device(s) each need {topo.local_world_size * want} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<not set>')!r}); make the GPUs "
                "visible, start fewer processes per node, or pass devices=['cpu'] to train on the CPU on purpose"
            )
        devices = None
    if devices is not None:
        devs = resolve_devices(devices)
        if len(devs) != want:
            raise ValueError(
                f"rank {topo.rank}: mode={topo.mode!r} with stages={topo.stages} needs {want} device(s) per "
                f"process, got {len(devs)}: {[str(d) for d in devs]}"
            )
        return devs
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * want
    count = torch.cuda.device_count()
    need = topo.local_world_size * want
    if need > count and topo.local_world_size == 1:
        # one process: its stages share the GPUs there are (several stages on one GPU run on streams)
        devs = [torch.device("cuda", s % count) for s in range(want)]
        warn(f"pipeddp: {want} stage(s) on {count} CUDA device(s): stages share devices "
             f"{[str(d) for d in devs]}; pass devices= to choose", RuntimeWarning)
        return devs
    if need > count:
        raise ValueError(
            f"rank {topo.rank}: {topo.local_world_size} processes on this node x {want} device(s) each need "
            f"{need} CUDA devices, but there are {count}; start fewer processes per node, use fewer stages, "
            "or pass devices= explicitly"
        )
    return [torch.device("cuda", topo.local_rank * want + s) for s in range(want)]


def choose_backend(backend: Optional[str], devs: Sequence[torch.device], topo: Topology) -> str:
    """nccl for CUDA devices, gloo for CPU; refuse a backend that cannot serve the devices."""
    cuda = all(d.type == "cuda" for d in devs)
    chosen = backend or ("nccl" if cuda else "gloo")
    if chosen == "nccl" and not cuda:
        raise ValueError(
            f"rank {topo.rank}: backend 'nccl' cannot serve CPU devices {[str(d) for d in devs]}; use backend='gloo' "
            "(or leave backend=None to choose automatically)"
        )
    if chosen == "gloo" and cuda and topo.mode == "stage":
        raise ValueError(
            f"rank {topo.rank}: backend 'gloo' cannot send CUDA tensors between stages; use backend='nccl' "
            "(or leave backend=None) for mode='stage' on GPUs"
        )
    if chosen not in ("nccl", "gloo"):
        raise ValueError(f"rank {topo.rank}: backend must be 'nccl' or 'gloo', got {chosen!r}")
    return chosen


def init_process_group(backend: str, timeout: timedelta) -> None:
    """``init_process_group`` from torchrun's (or ``spawn``'s) environment, safe across torchrun restarts.

    The caller has made this process's GPU the current device (``torch.cuda.set_device``), which NCCL's
    object collectives and barriers use. The group is not bound to it with ``device_id``: that eager
    initialisation may make single point-to-point operations share the group's one communicator and stream,
    where the stage-mode transport relies on torch's one communicator per pair of ranks (``p2p``).

    torchrun (``--max-restarts``) restarts every worker on the same store
    (the agent's, shared with the rendezvous); the keys the previous attempt's
    process groups left there point at dead processes, and the new group may
    connect to them and fail (pytorch/pytorch#135712). Under torchrun the group's
    keys are therefore put under a prefix of the restart attempt.

    Made here, the group is pipeddp's: with ``PIPEDDP_LAZY_GROUPS=1`` a gloo group connects each pair of ranks on
    first use (``lazy``).
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    with made_lazily(timeout):
        if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            dist.init_process_group(backend, timeout=timeout)
            return
        rank, world, _, _ = env_world()
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                              is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore(f"pipeddp/attempt-{attempt}", store), rank=rank,
                                world_size=world, timeout=timeout)


@dataclass
class Groups:
    """The process groups of a job: ``stage[s]`` holds the copies of stage s; ``pipeline`` this replica's ranks.

    With virtual stages every stage has a group of its own, although the
    stages of one device have the same members: each stage's DDP then reduces
    on its own communicator, and never waits behind another stage's buckets.
    """

    stage: Dict[int, Any] = field(default_factory=dict)
    pipeline: Any = None
    #: ``pipeline``'s ranks over gloo, for the agreements' tables (``host_group``); ``pipeline`` on a gloo job
    pipeline_host: Any = None


def subgroup(topo: Topology, ranks: Optional[Sequence[int]], backend: Optional[str], timeout: timedelta) -> Any:
    """A process group of ``ranks`` (None: the job's), called on every rank of the job in the same order.

    torch wants every rank of the world in ``new_group``; a job placed on a mesh may share its world with ranks
    of another parallelism that never call it, so there the members create it alone
    (``use_local_synchronization``) and any other rank gets None. With ``PIPEDDP_LAZY_GROUPS=1`` a gloo group
    connects each pair of its ranks when they first exchange something (``lazy``), not all of them now.
    """
    if topo.table is None:
        with made_lazily(timeout):
            return dist.new_group(None if ranks is None else list(ranks), timeout=timeout, backend=backend)
    members = sorted(topo.job_ranks if ranks is None else ranks)
    if topo.rank not in members:
        return None
    with made_lazily(timeout):
        return dist.new_group(members, timeout=timeout, backend=backend, use_local_synchronization=True)


def host_group(topo: Topology, ranks: Optional[Sequence[int]], backend: str, group: Any, timeout: timedelta) -> Any:
    """``group`` (of ``ranks``; None: the job's), or where ``backend`` is nccl a gloo group of the same ranks, for
    the agreements' tables (sizes, flags and votes that start and end on the host) and objects (a cut, the shares
    of a state dict).

    Over nccl such a table would cross to the GPU and back, two synchronisations of the host with the device at
    each agreement, and the first of them waits for every kernel queued before it (the last step's optimizer
    included) before the host may queue the next step's; over gloo it never touches a device. An object
    gathered over nccl is padded on the GPU to the largest rank's, once per rank: a state dict's shares would
    take the whole model's size on a GPU that may not have it.
    """
    if backend != "nccl" or topo.world_size == 1:
        return group
    try:
        return subgroup(topo, ranks, "gloo", timeout)
    except RuntimeError as exc:
        raise RuntimeError(
            f"rank {topo.rank}: could not make the gloo group that carries pipeddp's agreements beside nccl ({exc}); "
            "gloo must reach every rank of the job, as the gloo half of torch's default group does: set "
            "GLOO_SOCKET_IFNAME to the network interface the hosts reach each other on"
        ) from exc


def with_job_group(topo: Topology, timeout: timedelta) -> Topology:
    """``topo`` with a process group of its own for the job's collectives where it is placed on a mesh."""
    if topo.table is None or topo.group is not None or topo.world_size == 1:
        return topo
    return replace(topo, group=subgroup(topo, None, None, timeout))


def make_groups(topo: Topology, backend: str, timeout: timedelta, virtual_stages: int = 1,
                placement: str = "loop") -> Groups:
    """Stage groups (and pipeline groups in stage mode), created on every rank in the same order.

    ``virtual_stages``: stages per device; stage s lives on device ``row_of(s, topo.stages, placement)``.
    """
    groups = Groups()
    if topo.world_size == 1:
        return groups
    for s in range(topo.stages * virtual_stages):
        groups.stage[s] = subgroup(topo, topo.stage_ranks(row_of(s, topo.stages, placement)), backend, timeout)
    if topo.mode == "stage":
        for r in range(topo.replicas):
            g = subgroup(topo, topo.pipeline_ranks(r), backend, timeout)
            host = host_group(topo, topo.pipeline_ranks(r), backend, g, timeout)
            if r == topo.replica:
                groups.pipeline, groups.pipeline_host = g, host
    return groups
