"""``HybridParallel``: replicas of a pipeline, joined by DDP over stage-specific groups.

::

    engine = pipeddp.HybridParallel(model, stages=2, chunks=8)
    loss = engine.train_step(x_local, y_local, loss_fn)   # same global-mean loss on every rank
    optimizer.step()                                      # optimizer over engine.parameters()

Each stage is wrapped in DDP over a process group holding exactly that
stage's copies, so identical stages average gradients once per step::

    mode="replica", 4 processes x 2 devices          mode="stage", layout="pipeline"
      rank 0: [s0 cuda:0] -> [s1 cuda:1]               rank 0: s0 --send/recv--> rank 1: s1
      rank 1: [s0 cuda:2] -> [s1 cuda:3]               rank 2: s0 --send/recv--> rank 3: s1
      ...                                              stage groups {0,2} and {1,3}
      stage groups: {0,1,2,3} for s0, another for s1

Training on R replicas with local batches of n gives the same model as one
device training on the concatenated global batch of R*n (mean loss).

The class is the public face; the work is done below it::

    HybridParallel --build_replica--> Replica (distributed.replica): agreement, step, groups, DDP
         |  train_step / forward / evaluate --> Replica --> Step (runtime.step): passes, schedule, runner
         |  checkpoints, data position --> checkpoints.state
"""

from __future__ import annotations

import os
import warnings
import weakref
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ._engine import Combine, StepModule
from ._settings import check_log_every, check_settings, choose_partition
from .checkpoints import export, saving, state
from .checkpoints.checkpointable import Checkpointable
from .distributed.build import build_replica
from .distributed.ddp import CommHook
from .distributed.elastic import DataPosition, GlobalBatch, plan_global_batch
from .distributed.groups import current_topology
from .distributed.mesh import mesh_parts
from .distributed.shard import check_shard, shard_like, split_backward, whole_tensors
from .partitioning.report import Partition
from .runtime.devices import DeviceLike
from .runtime.names import Names
from .runtime.schedule.actions import ScheduleFn

__all__ = ["HybridParallel", "resume"]


class HybridParallel(Checkpointable, StepModule):
    """Pipeline replicas x DDP, for one script run by ``torchrun`` (or ``pipeddp.spawn``, or alone).

    Args:
        model: the ``nn.Sequential`` (built identically on every rank; DDP copies rank 0's weights to the others).
        stages: pipeline stages per replica.
        chunks, split_size, balance, sample, schedule, checkpoint, timeout, deferred_batch_norm, compile,
            virtual_stages, placement, max_activations, seed, init: as in ``Pipeline`` (tied weights, autocast and
            a model built on the meta device too, each process materializing only its own layers; across processes in
            stage mode). A measured balance is computed on rank 0 and sent to every rank. With
            ``virtual_stages=v`` the model has ``stages * v`` stages; device r of each replica (a
            thread in replica mode, a process in stage mode) holds stages r, r + stages, ... (with
            ``placement="v"``: r, 2 * stages - 1 - r, ...); ``virtual_stages="auto"`` and ``placement="auto"``
            are chosen on rank 0 from its profile, the same for every rank (``engine.virtual_stages`` and
            ``engine.placement`` say what).
        mode: ``"replica"`` (one process per replica, driving ``stages`` devices with threads) or ``"stage"``.
        devices: this process's devices (``stages`` of them in replica mode, one in stage mode).
            Default: consecutive CUDA devices by local rank, else CPU (one process with fewer GPUs
            than stages shares them); ``"auto"``: the CPU on a machine without GPUs (a node whose GPUs
            are too few for its processes is refused, naming ``CUDA_VISIBLE_DEVICES``).
        backend: ``"nccl"`` or ``"gloo"``; default nccl for CUDA, gloo for CPU.
        layout: stage mode only: ``"pipeline"`` (ranks 0..S-1 are replica 0) or ``"data"`` (0..R-1 hold stage 0).
        ddp_kwargs: passed to every stage's DDP (``bucket_cap_mb``, ``gradient_as_bucket_view``,
            ``find_unused_parameters``, ``broadcast_buffers``, ...).
        comm_hook: ``"fp16"``, ``"bf16"``, ``"powersgd"`` or a DDP comm hook function.
        sync_batchnorm: convert BatchNorm layers to ``SyncBatchNorm`` over each stage's group
            (CUDA only, as torch's SyncBatchNorm; no effect with one replica).
        trace: record a timeline (``engine.trace``), gradient all-reduces included.
        threads: intra-op threads per CPU stage thread (replica mode).
        skip_nonfinite: skip (on every rank together) a step whose loss or gradients are not finite anywhere;
            with accumulation over calls, every call up to the next ``optimizer.step()`` is skipped with it
            (``distributed/skipped.py``).
        global_batch: samples per optimizer step, all replicas together, fixed whatever the replica count
            (an elastic job restarted with fewer replicas trains the same math): ``train_step`` then takes
            ``engine.replica_batch`` = global_batch / replicas samples and runs them as ``engine.accumulation``
            passes of ``batch_size``. Checkpoints record the data position (``engine.position``), which
            ``pipeddp.data.loader(dataset, engine=engine)`` follows. See ``distributed/elastic.py``.
            (``out = engine(x); loss.backward()`` is not accumulated: it reduces every call.)
        batch_size: with ``global_batch``, the samples per pass of one replica (the memory a pass needs);
            default: the whole replica batch in one pass.
        shard: ``"none"`` (DDP), ``"optimizer"`` or ``"full"``: each stage's optimizer state, gradients and
            parameters split over its replicas with FSDP2; see ``distributed/shard.py`` and docs/sharding.md.
        mesh: a ``DeviceMesh`` of the job's (two dimensions named ``"dp"`` and ``"pp"``, or such a slice of a larger
            one) to place the engine on, in stage mode, instead of taking the whole world from the environment:
            the engine's groups and collectives then involve the mesh's ranks alone, beside another parallelism
            over the rest of the world. A mesh of three dimensions, ``"dp"``, ``"pp"`` and ``"tp"``, with ``tp_plan``
            shards each stage over ``tp`` too. See ``distributed/mesh.py``.
        tp_plan: with a mesh that has a ``"tp"`` dimension: ``"auto"`` (a transformers model's own plan) or
            ``{module-name pattern: "colwise" | "rowwise" | "colwise_gather_output" | "embedding_rowwise" |
            ParallelStyle}`` in the model's own names; each process shards its stages' modules over ``tp`` with
            torch's ``parallelize_module``. See ``distributed/tensor_parallel.py``.
        log_every: as in ``Pipeline``: the step's figures (``engine.last_step``: samples and tokens of every
            replica together) logged every that many steps, by rank 0 alone.
    """

    def __init__(self, model: nn.Sequential, *, stages: int, chunks: Optional[int] = None,
                 split_size: Optional[int] = None, balance: Union[None, str, Sequence[int]] = None,
                 sample: Optional[Any] = None, schedule: Union[str, ScheduleFn] = "1f1b", checkpoint: str = "never",
                 mode: str = "replica", devices: Union[None, str, Sequence[DeviceLike]] = None,
                 backend: Optional[str] = None, layout: str = "pipeline", ddp_kwargs: Optional[Dict[str, Any]] = None,
                 comm_hook: Optional[CommHook] = None, sync_batchnorm: bool = False,
                 timeout: Union[float, timedelta] = timedelta(minutes=30), trace: bool = False,
                 threads: Optional[int] = None, skip_nonfinite: bool = False, deferred_batch_norm: bool = False,
                 compile: Union[bool, Dict[str, Any]] = False, virtual_stages: Union[None, int, str] = None,
                 placement: str = "loop", global_batch: Optional[int] = None, batch_size: Optional[int] = None,
                 shard: str = "none", max_activations: Optional[int] = None, seed: int = 0,
                 init: Optional[Callable[[nn.Module], None]] = None, mesh: Optional[Any] = None,
                 log_every: Optional[int] = 100, tp_plan: Union[None, str, Dict[str, Any]] = None) -> None:
        super().__init__()
        log_every = check_log_every(log_every)
        self.topology, tp_mesh = mesh_parts(mesh, stages, mode, tp_plan,
                                            partial(current_topology, stages, mode, layout))
        self.tp_mesh = tp_mesh  # checkpoints are written once for every tp slice's job, and read per block
        topo = self.topology
        self.global_batch_plan: Optional[GlobalBatch] = plan_global_batch(global_batch, batch_size, topo.replicas)
        #: the epoch and samples of it consumed; checkpoints record it, resume restores it, loaders follow it
        self.position = DataPosition()
        self.settings = settings = check_settings(model, stages, chunks=chunks, split_size=split_size,
                                                  schedule=schedule, checkpoint=checkpoint, timeout=timeout,
                                                  compile=compile, virtual_stages=virtual_stages, threads=threads,
                                                  flags={"trace": trace, "deferred_batch_norm": deferred_batch_norm,
                                                         "sync_batchnorm": sync_batchnorm,
                                                         "skip_nonfinite": skip_nonfinite},
                                                  balance=balance, sample=sample, max_activations=max_activations,
                                                  seed=seed, init=init, placement=placement)
        self.key_names = Names.of(model)
        self._export_source = export.source_of(model)  # what save_pretrained writes the configuration of
        self._model_keys = [self.key_names.original(k) for k in model.state_dict()]
        self.skip_nonfinite = skip_nonfinite
        self.shard = check_shard(shard, replicas=topo.replicas, model=model,
                                 split_backward=shard == "full" and split_backward(settings.schedule, stages,
                                                                                   settings.virtual_stages,
                                                                                   settings.placement),
                                 sync_batchnorm=sync_batchnorm, ddp_options=bool(ddp_kwargs) or comm_hook is not None)
        cut = partial(choose_partition, model, stages * settings.virtual_stages, balance, sample, settings)
        self._replica = wired = build_replica(self, model, topo, settings, partition=cut, devices=devices,
                                              backend=backend, ddp_kwargs=ddp_kwargs, comm_hook=comm_hook,
                                              sync_batchnorm=sync_batchnorm, trace=trace, threads=threads,
                                              deferred_batch_norm=deferred_batch_norm, shard=self.shard,
                                              tp_mesh=tp_mesh, tp_plan=tp_plan)
        self.devices, self.backend, self.agreement = wired.devices, wired.backend, wired.agreement
        self.settings = wired.settings  # virtual_stages and placement as built, where "auto" left them to the profile
        self.partition: Partition = wired.partition
        self.balance: List[int] = list(self.partition.balance)
        self._step, self._ddps = wired.step, wired.ddps
        self._finalizer = weakref.finalize(self, wired.runner.close)  # threads, never the group, at collection
        self.topology = wired.topology  # on a mesh: with the job's own group now
        self._saver = saving.Saver(self.topology, settings.timeout_delta)
        self._start_watch(log_every, self.topology.rank)

    # -- structure ---------------------------------------------------------------------------------

    @property
    def is_first(self) -> bool:
        """Whether this process feeds inputs (holds stage 0)."""
        return self._step.first is not None

    @property
    def is_last(self) -> bool:
        """Whether this process sees outputs and targets (holds the last stage)."""
        return self._step.last is not None

    @property
    def global_batch(self) -> Optional[int]:
        """Samples per optimizer step, all replicas together (None: not fixed, each call is one pass)."""
        return self.global_batch_plan.total if self.global_batch_plan is not None else None

    @property
    def replica_batch(self) -> Optional[int]:
        """Samples ``train_step`` takes on each replica: ``global_batch / replicas`` (None without global_batch)."""
        return self.global_batch_plan.replica_batch if self.global_batch_plan is not None else None

    @property
    def accumulation(self) -> int:
        """Forward + backward passes per ``train_step`` on each replica (1 without global_batch)."""
        return self.global_batch_plan.accumulation if self.global_batch_plan is not None else 1

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on every rank because their loss or gradients were not finite (``skip_nonfinite``)."""
        return self._replica.skipped_steps

    # -- running -----------------------------------------------------------------------------------

    def train_step(self, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                   scaler: Optional[torch.amp.GradScaler] = None) -> torch.Tensor:
        """One training step on this rank's local batch; returns the global mean loss (same on every rank).

        In stage mode the rank of stage 0 needs ``x`` and the rank of the last stage needs ``y``; the others
        may pass None. Gradients land in ``.grad`` of ``engine.parameters()``, already averaged over replicas.
        A non-finite step is skipped on every rank alike, with ``skip_nonfinite=True`` (counted in
        ``engine.skipped_steps``) or by each rank's ``scaler`` (a GradScaler: then ``scaler.step(optimizer);
        scaler.update()``); see ``Agreement.finish_step``.

        With ``global_batch``, the local batch is ``engine.replica_batch`` samples, run as
        ``engine.accumulation`` passes; the gradients are still those of the mean loss over the whole global
        batch, reduced across replicas once.
        """
        return self._replica.train(x, y, loss_fn, self.parameters(), plan=self.global_batch_plan, scaler=scaler,
                                   skip_nonfinite=self.skip_nonfinite)

    def forward(self, x: Any) -> Any:
        """Run ``x`` through this replica's pipeline, as ``Pipeline.forward`` does.

        With autograd on (replica mode), the output answers ``backward`` (gradients averaged over replicas).
        Under ``torch.no_grad()`` (or ``eval_step``) it evaluates in both modes: the output on the last stage's
        rank, None on the others; only the replica's processes communicate (replicas may run different numbers
        of batches).
        """
        need_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        return self._replica.forward(x, need_grad=need_grad)

    @torch.no_grad()
    def eval_step(self, x: Any) -> Any:
        """``forward`` without gradients: evaluation in either mode."""
        return self(x)

    def evaluate(self, loader: Any, metric_fn: Callable[[Any, Any], Dict[str, Any]]) -> Dict[str, float]:
        """Metrics over a whole evaluation set, each sample counted exactly once.

        ``loader`` yields ``(x, y)`` for this replica (``pipeddp.data.loader(..., train=False)`` shards without
        the padding ``DistributedSampler`` adds). ``metric_fn(output, y)`` returns a dict of *means over the
        batch*, or of ``(total, count)`` pairs (a loss over non-padding tokens); the result is the sample-weighted
        mean over the whole set (for a pair: the sum of totals over the sum of counts), plus ``"samples"``. Every
        rank returns the same dict.
        """
        return self._replica.evaluate(self, loader, metric_fn)

    def check_replicas(self) -> None:
        """None when every stage's copies agree bit for bit (a CRC32 per parameter), else ``RuntimeError``
        naming the stage, parameter and ranks. A collective: call it on every rank. With ``shard=`` each replica
        holds a different part of every parameter, so there is nothing to compare and it returns at once."""
        if self.shard != "none":  # each replica holds its own part of every parameter: nothing to compare
            return
        self.agreement.check_replicas(self._step.stages, rename=self.key_names.original)

    def _norm_scope(self) -> Tuple[List[nn.Parameter], torch.device, Optional[Combine]]:
        return self._replica.norm_scope()

    # -- state -------------------------------------------------------------------------------------

    # mypy: nn.Module.state_dict is a set of overloads; one keyword-only signature cannot match them all
    def state_dict(self, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        """The whole model's state dict with the plain model's keys (a collective in stage mode, and with shard=;
        in replica mode without shard= every process holds the whole model, and one rank may call it alone)."""
        if self.topology.world_size > 1 and (self.topology.mode == "stage" or self.shard != "none"):
            self.agreement.enter("state_dict")
        return state.gather_state_dict(whole_tensors(super().state_dict(**kwargs)), self.topology, self.agreement)

    # mypy: nn.Module.load_state_dict's Mapping type is narrower than the state dicts both classes take
    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load the entries of a full (or partial) state dict that belong to this process (all or nothing; with
        ``strict``, a key the whole model lacks is refused too)."""
        targets = super().state_dict()
        if strict:
            self.check_keys(state_dict, targets)  # missing and unknown keys alike, before anything is copied
        entries = state.own_entries(state_dict, list(targets), strict=False, rank=self.topology.rank)
        entries = {k: shard_like(v, targets[k]) if k in targets else v for k, v in entries.items()}  # with shard=
        return super().load_state_dict(entries, strict=strict, assign=assign)

    def model_keys(self) -> List[str]:
        """Every key of the whole model's state dict, as the model had them when the engine was built."""
        return list(self._model_keys)

    # -- life cycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for a save in flight, stop stage threads, give the model back its tied weights (one parameter where
        stages held copies) and, if this engine started it, end the process group."""
        try:
            self._saver.close()  # a failed background save raises here, after everything below is stopped
        finally:
            self._finalizer()
            self._replica.step.ties.restore()
            self._replica.close()

    def extra_repr(self) -> str:
        t = self.topology
        return (f"mode={t.mode!r}, replicas={t.replicas}, stages={t.stages}, rank={t.rank}, "
                f"devices={[str(d) for d in self.devices]}, balance={self.balance}, backend={self.backend!r}")


def resume(engine: Checkpointable, directory: str,
           optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[Dict[str, Any]]:
    """``engine.resume(directory, optimizer)`` (a ``HybridParallel`` or a ``Pipeline``): load the newest complete
    checkpoint, or return None.

    The arguments come in the order of ``engine.resume``, ``load`` and
    ``save_checkpoint``; the 0.1 order ``(engine, optimizer, directory)`` still
    works, with a ``DeprecationWarning``.
    """
    if isinstance(directory, torch.optim.Optimizer) or isinstance(optimizer, (str, os.PathLike)):
        warnings.warn("pipeddp.resume(engine, optimizer, directory) is deprecated; write "
                      "pipeddp.resume(engine, directory, optimizer)", DeprecationWarning, stacklevel=2)
        # mypy: the deprecated argument order is swapped here on purpose
        directory, optimizer = optimizer, directory  # type: ignore[assignment]
    return engine.resume(directory, optimizer)
