"""A job placed on the user's ``DeviceMesh``, beside whatever else the mesh's world runs.

By default a job reads its grid from torchrun's environment and owns the
world: every rank is one of its replicas x stages. A job that composes
pipeddp with another parallelism (tensor or expert parallelism over a third
dimension, say) already has a ``DeviceMesh``; ``HybridParallel(...,
mesh=mesh)`` takes its two dimensions named ``"dp"`` (replicas) and ``"pp"``
(stages), in stage mode::

    mesh = init_device_mesh("cuda", (2, 2, 4), mesh_dim_names=("dp", "pp", "tp"))
    engine = HybridParallel(model, stages=2, mode="stage", mesh=mesh["dp", "pp"])

A mesh of three dimensions named ``"dp"``, ``"pp"`` and ``"tp"`` adds tensor
parallelism inside each stage (``tp_plan=``, see ``tensor_parallel``)::

    mesh = init_device_mesh("cuda", (2, 2, 4), mesh_dim_names=("dp", "pp", "tp"))
    engine = HybridParallel(model, stages=2, mode="stage", mesh=mesh, tp_plan="auto")

Each tp coordinate t is then a pipeline-and-replicas job of its own on
``mesh["dp", "pp"]`` at t: rank (dp, pp, t) sends to (dp, pp + 1, t), and the
replicas of (stage, t) reduce together; the tp ranks of a stage hold the same
activations and meet in the sharded layers' collectives over ``mesh["tp"]``.

The mesh says which global rank holds each (replica, stage): point-to-point
messages go to those ranks, each stage's DDP (or FSDP2) group holds that
stage's copies, and the job's own collectives (the batch check, the mean
loss, rank 0's choices, saving) run on a group of the job's ranks alone, so a
rank of another slice of the world is never waited for. The groups are made
by their members only (``use_local_synchronization``): the other slices
build their own engines in their own time.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from .tensor_parallel import PlanArg, check_tp_plan_arg
from .topology import Topology, env_world

__all__ = ["mesh_topology", "mesh_parts"]

_NAMES = ("dp", "pp")


def mesh_parts(mesh: Any, stages: int, mode: str, tp_plan: PlanArg,
               default: Callable[[], Topology]) -> Tuple[Topology, Optional[Any]]:
    """``(this process's place in the (dp, pp) job, the 1-D tp mesh or None)`` for ``mesh`` (2-D, or 3-D with
    ``tp``) and ``tp_plan``; refuses a plan without a ``tp`` dimension, and a ``tp`` dimension without a plan.
    Without a mesh, ``default()`` (the job read from the environment)."""
    from torch.distributed.device_mesh import DeviceMesh

    names = tuple(mesh.mesh_dim_names or ()) if isinstance(mesh, DeviceMesh) else ()
    has_tp = len(names) == 3 and sorted(names) == sorted(_NAMES + ("tp",))
    check_tp_plan_arg(tp_plan, has_tp=has_tp, mode=mode)
    if mesh is None:
        return default(), None
    if has_tp and tp_plan is None:
        raise ValueError("the mesh has a 'tp' dimension, but no tp_plan says what to shard over it: pass tp_plan="
                         "'auto' or {pattern: style}, or pass mesh['dp', 'pp'] to run each tp slice as a job of its "
                         "own")
    if has_tp:
        return mesh_topology(mesh["dp", "pp"], stages, mode), mesh["tp"]
    return mesh_topology(mesh, stages, mode), None


def mesh_topology(mesh: Any, stages: int, mode: str) -> Topology:
    """This process's place in ``mesh`` (a 2-D ``DeviceMesh`` named ``dp`` and ``pp``); refuses any other with the
    way out. The job's group is made later, with the others (``groups.with_job_group``)."""
    from torch.distributed.device_mesh import DeviceMesh

    example = "init_device_mesh('cuda', (replicas, stages), mesh_dim_names=('dp', 'pp'))"
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or sorted(names) != sorted(_NAMES):
        raise ValueError(
            f"mesh must have two dimensions named 'dp' (replicas) and 'pp' (stages), or three with 'tp' (and tp_plan="
            f"), got {mesh.ndim} named {names or 'nothing'}: build it as {example}, or pass a slice of a larger one, "
            "mesh['dp', 'pp']"
        )
    if mode != "stage":
        raise ValueError(f"mesh= places one stage per process: use mode='stage' (got mode={mode!r})")
    grid = mesh.mesh if names == _NAMES else mesh.mesh.transpose(0, 1)
    if grid.shape[1] != stages:
        raise ValueError(f"stages={stages}, but the mesh's 'pp' dimension has {grid.shape[1]} ranks: "
                         "pass stages equal to it")
    table: Tuple[Tuple[int, ...], ...] = tuple(tuple(int(r) for r in row) for row in grid.tolist())
    if mesh.get_coordinate() is None:
        raise ValueError(f"this process is not in the mesh (its ranks are {sorted(r for row in table for r in row)})")
    rank = mesh.get_rank()
    _, _, local_rank, local_world = env_world()
    return Topology(rank, len(table) * stages, local_rank, local_world, stages, mode, "pipeline", table=table)
