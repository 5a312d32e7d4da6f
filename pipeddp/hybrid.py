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
"""

from __future__ import annotations

import os
import warnings
import weakref
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from ._engine import Combine, StepModule
from ._settings import check_settings, choose_partition
from .distributed import state
from .distributed.agreement import Agreement
from .distributed.elastic import POSITION_KEY, DataPosition, GlobalBatch, plan_global_batch
from .distributed.ddp import CommHook, attach_stages, check_ddp_kwargs, with_sync_batchnorm
from .distributed.groups import choose_backend, current_topology, init_process_group, local_devices, make_groups
from .distributed.stage_runner import ProcessRunner
from .distributed.ties import TieExchange
from .partitioning.report import Partition
from .runtime.devices import DeviceLike
from .runtime.executor import ThreadRunner
from .runtime.microbatch import batch_size as samples_of, split, tree_map
from .runtime.names import Names
from .runtime.refine import attach_auto
from .runtime.schedule import ScheduleFn, row_of
from .runtime.stage import build_stages, register_layers
from .runtime.step import Runner, Step
from .runtime.tied import find_ties
from .runtime.trace import Trace
from .runtime.warn import warn

__all__ = ["HybridParallel", "resume"]


class HybridParallel(StepModule):
    """Pipeline replicas x DDP, for one script run by ``torchrun`` (or ``pipeddp.spawn``, or alone).

    Args:
        model: the ``nn.Sequential`` (built identically on every rank; DDP
            copies rank 0's weights to the other replicas at start).
        stages: pipeline stages per replica.
        chunks, split_size, balance, sample, schedule, checkpoint, timeout, deferred_batch_norm, compile,
            virtual_stages, max_activations: as in ``Pipeline`` (tied weights and autocast too, across processes in
            stage mode). A measured balance is computed on rank 0 and sent to every rank. With
            ``virtual_stages=v`` the model has ``stages * v`` stages; device r of each replica (a
            thread in replica mode, a process in stage mode) holds stages r, r + stages, ...
        mode: ``"replica"`` (one process per replica, driving ``stages`` devices
            with threads) or ``"stage"`` (one process per stage).
        devices: this process's devices (``stages`` of them in replica mode, one in stage mode).
            Default: consecutive CUDA devices by local rank, else CPU (one process with fewer GPUs
            than stages shares them); ``"auto"``: the CPU too where the GPUs are too few.
        backend: ``"nccl"`` or ``"gloo"``; default nccl for CUDA, gloo for CPU.
        layout: stage mode only: ``"pipeline"`` (ranks 0..S-1 are replica 0) or
            ``"data"`` (ranks 0..R-1 hold stage 0).
        ddp_kwargs: passed to every stage's DDP (``bucket_cap_mb``, ``gradient_as_bucket_view``,
            ``find_unused_parameters``, ``broadcast_buffers``, ...).
        comm_hook: ``"fp16"``, ``"bf16"``, ``"powersgd"`` or a DDP comm hook function.
        sync_batchnorm: convert BatchNorm layers to ``SyncBatchNorm`` over each stage's group
            (CUDA only, as torch's SyncBatchNorm; no effect with one replica).
        trace: record a timeline (``engine.trace``), gradient all-reduces included.
        threads: intra-op threads per CPU stage thread (replica mode).
        skip_nonfinite: skip (on every rank together) a step whose loss or
            gradients are not finite anywhere; see ``train_step``.
        global_batch: samples per optimizer step, all replicas together, fixed
            whatever the replica count (an elastic job restarted with fewer
            replicas trains the same math): ``train_step`` then takes
            ``engine.replica_batch`` = global_batch / replicas samples and runs
            them as ``engine.accumulation`` passes of ``batch_size``. Checkpoints
            record the data position (``engine.position``), which
            ``pipeddp.data.loader(dataset, engine=engine)`` follows. See ``distributed/elastic.py``.
            (``out = engine(x); loss.backward()`` is not accumulated: it reduces every call.)
        batch_size: with ``global_batch``, the samples per pass of one replica (the
            memory a pass needs); default: the whole replica batch in one pass.
    """

    def __init__(
        self,
        model: nn.Sequential,
        *,
        stages: int,
        chunks: Optional[int] = None,
        split_size: Optional[int] = None,
        balance: Union[None, str, Sequence[int]] = None,
        sample: Optional[Any] = None,
        schedule: Union[str, ScheduleFn] = "1f1b",
        checkpoint: str = "never",
        mode: str = "replica",
        devices: Union[None, str, Sequence[DeviceLike]] = None,
        backend: Optional[str] = None,
        layout: str = "pipeline",
        ddp_kwargs: Optional[Dict[str, Any]] = None,
        comm_hook: Optional[CommHook] = None,
        sync_batchnorm: bool = False,
        timeout: Union[float, timedelta] = timedelta(minutes=30),
        trace: bool = False,
        threads: Optional[int] = None,
        skip_nonfinite: bool = False,
        deferred_batch_norm: bool = False,
        compile: Union[bool, Dict[str, Any]] = False,
        virtual_stages: Optional[int] = None,
        global_batch: Optional[int] = None,
        batch_size: Optional[int] = None,
        max_activations: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.topology = topo = current_topology(stages, mode, layout)
        self.global_batch_plan: Optional[GlobalBatch] = plan_global_batch(global_batch, batch_size, topo.replicas)
        #: the epoch and samples of it consumed; checkpoints record it, resume restores it, loaders follow it
        self.position = DataPosition()
        self.settings = settings = check_settings(model, stages, chunks=chunks, split_size=split_size,
                                                  schedule=schedule, checkpoint=checkpoint, timeout=timeout,
                                                  compile=compile, virtual_stages=virtual_stages, threads=threads,
                                                  flags={"trace": trace, "deferred_batch_norm": deferred_batch_norm,
                                                         "sync_batchnorm": sync_batchnorm,
                                                         "skip_nonfinite": skip_nonfinite},
                                                  balance=balance, sample=sample, max_activations=max_activations)
        n_stages = stages * settings.virtual_stages
        check_ddp_kwargs(ddp_kwargs, comm_hook)
        self.key_names = Names.of(model)
        self.skip_nonfinite = skip_nonfinite
        self.skipped_steps = 0
        self.devices = devs = local_devices(topo, devices)
        self.backend = choose_backend(backend, devs, topo)
        self._owns_group = topo.world_size > 1 and not dist.is_initialized()
        if self._owns_group:
            init_process_group(self.backend, settings.timeout_delta)
        self.agreement = Agreement(topo, devs[0] if self.backend == "nccl" else torch.device("cpu"))
        self.partition: Partition = self.agreement.from_rank0(
            lambda: choose_partition(model, n_stages, balance, sample, settings, devs[0]))
        self.balance: List[int] = list(self.partition.balance)
        self._groups = make_groups(topo, self.backend, settings.timeout_delta, settings.virtual_stages)
        if sync_batchnorm:  # after profiling: a SyncBatchNorm would wait for the other ranks there
            model = with_sync_batchnorm(model, devs, topo.replicas, topo.rank)
        if mode == "replica":
            indices = list(range(n_stages))
            placed = [devs[row_of(s, stages)] for s in indices]
        else:
            indices = list(range(topo.stage, n_stages, stages))
            placed = [devs[0]] * len(indices)
        local = build_stages(model, self.balance, placed, indices, compile=settings.compile)
        register_layers(self, local)
        runner: Runner
        if mode == "replica":
            runner = ThreadRunner(local, threads=threads, timeout=settings.timeout, rank=topo.rank, rows=stages,
                                  n_stages=n_stages)
        else:
            runner = ProcessRunner.connect(local, topo, n_stages=n_stages, comm_device=self.agreement.comm_device,
                                           timeout=settings.timeout_delta)
        ties = find_ties(model, self.balance)
        self._step = step = Step(local, n_stages, runner, chunks=settings.chunks, split_size=settings.split_size,
                                 schedule=settings.schedule, checkpoint=settings.checkpoint, ties=ties,
                                 deferred_batch_norm=deferred_batch_norm, virtual_stages=settings.virtual_stages)
        step.sync = topo.replicas > 1
        attach_auto(step, self.partition.layers, self.balance, settings.max_activations,
                    gather=self.agreement.gather_to_all, on_rank0=self.agreement.from_rank0)
        self._ties = exchange = TieExchange(ties, step.ties, topo, backend=self.backend,
                                            timeout=settings.timeout_delta, comm_device=self.agreement.comm_device)
        step.before_forward.append(exchange.refresh)
        step.ties.across = exchange  # the gains of ties' uses in other processes join the step's fold
        self._finalizer = weakref.finalize(self, runner.close)
        self._saver = state.Saver(topo, settings.timeout_delta)
        self.trace = Trace(topo.rank) if trace else None
        self._ddps = attach_stages(local, self._groups.stage, ddp_kwargs=ddp_kwargs, comm_hook=comm_hook,
                                   trace=self.trace) if topo.replicas > 1 else []

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
        plan = self.global_batch_plan
        return plan.total if plan is not None else None

    @property
    def replica_batch(self) -> Optional[int]:
        """Samples ``train_step`` takes on each replica: ``global_batch / replicas`` (None without global_batch)."""
        plan = self.global_batch_plan
        return plan.replica_batch if plan is not None else None

    @property
    def accumulation(self) -> int:
        """Forward + backward passes per ``train_step`` on each replica (1 without global_batch)."""
        plan = self.global_batch_plan
        return plan.accumulation if plan is not None else 1

    # -- running -----------------------------------------------------------------------------------

    def train_step(self, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                   scaler: Optional[torch.amp.GradScaler] = None) -> torch.Tensor:
        """One training step on this rank's local batch; returns the global mean loss (same on every rank).

        In stage mode the rank of stage 0 needs ``x`` and the rank of the last
        stage needs ``y``; the others may pass None. Gradients land in ``.grad``
        of ``engine.parameters()``, already averaged over replicas. A non-finite
        step is skipped on every rank alike, with ``skip_nonfinite=True`` (counted
        in ``engine.skipped_steps``) or by each rank's ``scaler`` (a GradScaler:
        then ``scaler.step(optimizer); scaler.update()``); see ``Agreement.finish_step``.

        With ``global_batch``, the local batch is ``engine.replica_batch`` samples,
        run as ``engine.accumulation`` passes; the gradients are still those of
        the mean loss over the whole global batch, reduced across replicas once.
        """
        n = self.agreement.local_batch(x, y, need_y=True)  # a collective: every rank sees the same n
        if scaler is not None:
            scaler.scale(torch.ones((), device=self.devices[0]))  # every rank's scaler is set up, not only the last's
        scale = scaler.scale if scaler is not None else None
        plan = self.global_batch_plan
        if plan is None:
            loss = self._step.train(x, y, loss_fn, n, loss_scale=scale)
        else:
            if n != plan.replica_batch:
                raise ValueError(f"rank {self.topology.rank}: train_step got {n} samples per replica, but "
                                 f"global_batch={plan.total} over {plan.replicas} replica(s) makes "
                                 f"{plan.replica_batch} per replica (engine.replica_batch); "
                                 "pipeddp.data.loader(dataset, engine=engine) yields batches of that size")
            loss = self._accumulate(x, y, loss_fn, plan, scale)
        loss, skipped = self.agreement.finish_step(0.0 if loss is None else loss.item(), self.parameters(),
                                                   skip_nonfinite=self.skip_nonfinite, skipped=self.skipped_steps,
                                                   overflow_to_scaler=scaler is not None)
        self.skipped_steps += skipped
        return loss

    def _accumulate(self, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor], plan: GlobalBatch,
                    scale: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> Optional[torch.Tensor]:
        """``plan.accumulation`` passes of ``plan.batch_size``; each weighs its share, the last one reduces."""
        passes = plan.accumulation
        sizes = [plan.batch_size] * passes
        xs = split(x, sizes) if x is not None else [None] * passes
        ys = split(y, sizes) if y is not None else [None] * passes
        total: Optional[torch.Tensor] = None
        for i, (xi, yi) in enumerate(zip(xs, ys)):
            loss = self._step.train(xi, yi, loss_fn, plan.batch_size, loss_scale=scale, share=1.0 / passes,
                                    first=i == 0, final=i == passes - 1)
            if loss is not None:
                total = loss if total is None else total + loss
        return total

    def forward(self, x: Any) -> Any:  # type: ignore[override]
        """Run ``x`` through this replica's pipeline, as ``Pipeline.forward`` does.

        With autograd on (replica mode), the output answers ``backward`` (gradients
        averaged over replicas). Under ``torch.no_grad()`` (or ``eval_step``) it
        evaluates in both modes: the output on the last stage's rank, None on the
        others; only the replica's processes communicate (replicas may run different
        numbers of batches).
        """
        need_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        if self.topology.mode == "replica":
            n = samples_of(x, name="input")
        else:
            n = self.agreement.local_batch(x, None, need_y=False, group=self._groups.pipeline)
        return self._step.forward(x, n, need_grad=need_grad)

    @torch.no_grad()
    def eval_step(self, x: Any) -> Any:
        """``forward`` without gradients: evaluation in either mode."""
        return self(x)

    def evaluate(self, loader: Any, metric_fn: Callable[[Any, Any], Dict[str, Any]]) -> Dict[str, float]:
        """Metrics over a whole evaluation set, each sample counted exactly once.

        ``loader`` yields ``(x, y)`` for this replica (``pipeddp.data.loader(...,
        train=False)`` shards without the padding ``DistributedSampler`` adds).
        ``metric_fn(output, y)`` returns a dict of *means over the batch*; the
        result is the sample-weighted mean over the whole set, plus ``"samples"``.
        Every rank returns the same dict.
        """
        was_training = self.training
        self.eval()
        sums: Dict[str, float] = {}
        count = 0
        try:
            for x, y in loader:
                out = self.eval_step(x)
                if self.is_last:
                    n = samples_of(y, name="y")
                    for k, v in metric_fn(out, tree_map(lambda t: t.to(self._step.stages[-1].device), y)).items():
                        sums[k] = sums.get(k, 0.0) + float(v) * n
                    count += n
        finally:
            self.train(was_training)
        return self.agreement.mean_metrics(count, sums)

    def check_replicas(self) -> None:
        """None when every stage's copies agree bit for bit (a CRC32 per parameter), else ``RuntimeError``
        naming the stage, parameter and ranks. A collective: call it on every rank."""
        self.agreement.check_replicas(self._step.stages, self._groups.stage, rename=self.key_names.original)

    def _norm_scope(self) -> Tuple[List[nn.Parameter], torch.device, Optional[Combine]]:
        """In stage mode the norm is joined over this replica's processes (replicas agree after DDP)."""
        if self.topology.mode == "replica" or not self.agreement.distributed:
            return [], self.agreement.comm_device, None
        return self._ties.copies(), self.agreement.comm_device, partial(self.agreement.join_norm,
                                                                         group=self._groups.pipeline)

    # -- state -------------------------------------------------------------------------------------

    def local_state_dict(self) -> Dict[str, Any]:
        """This process's part of the model, with the model's keys."""
        return super().state_dict()

    def state_dict(self, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        """The whole model's state dict with the plain model's keys (a collective in stage mode)."""
        return state.gather_state_dict(super().state_dict(**kwargs), self.topology, self.agreement)

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load the entries of a full (or partial) state dict that belong to this process."""
        own = list(super().state_dict().keys())
        return super().load_state_dict(state.own_entries(state_dict, own, strict=strict, rank=self.topology.rank),
                                       strict=strict, assign=assign)

    def save(self, path: str, optimizer: Optional[torch.optim.Optimizer] = None,
             extra: Optional[Dict[str, Any]] = None, *, sharded: bool = False, async_save: bool = False) -> None:
        """One checkpoint (call on every rank). ``extra``: plain values.

        By default one file, gathered on rank 0 and written there atomically.
        ``sharded=True``: ``path`` is a directory that every process writes its
        own share into, in parallel (torch.distributed.checkpoint), nothing
        gathered; ``async_save=True`` then returns once the share is copied and
        writes it in the background (the next save, load or ``close`` waits).
        """
        state.save(self, path, optimizer, self._with_position(extra), sharded=sharded, async_save=async_save,
                   saver=self._saver)

    def save_checkpoint(self, directory: str, step: int, optimizer: Optional[torch.optim.Optimizer] = None, *,
                        keep: int = 3, extra: Optional[Dict[str, Any]] = None, sharded: bool = False,
                        async_save: bool = False) -> str:
        """``directory/step-<step>.pt`` (atomic; with ``sharded=True`` the directory ``step-<step>``), keeping the
        newest ``keep`` complete ones, with every rank's RNG states; ``sharded`` and ``async_save`` as in ``save``."""
        return state.save_checkpoint(self, directory, step, optimizer, keep=keep, extra=self._with_position(extra),
                                     sharded=sharded, async_save=async_save, saver=self._saver)

    def wait_for_save(self) -> Optional[str]:
        """Wait until the asynchronous save in flight is complete; returns its path (None if there was none)."""
        return self._saver.wait()

    def load(self, path: str, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """Load a checkpoint, a file or a sharded directory, written by any stages/replicas layout; returns its
        ``extra``."""
        return self._restore_position(state.load(self, path, optimizer, saver=self._saver))

    def resume(self, directory: str, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[Dict[str, Any]]:
        """Load the newest complete checkpoint of ``directory`` (either format); returns its ``extra`` (with
        ``step``), or None, with a warning, when there is none."""
        return self._restore_position(state.resume(self, directory, optimizer, saver=self._saver))

    def _with_position(self, extra: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """``extra`` plus the data position, with a fixed global batch (so a restart resumes the epoch)."""
        if self.global_batch_plan is None:
            return extra
        if extra and POSITION_KEY in extra:
            raise ValueError(f"extra may not use the key {POSITION_KEY!r}: with global_batch the engine records the "
                             "data position there; rename your entry")
        return dict(extra or {}, **{POSITION_KEY: dict(self.position.state(), global_batch=self.global_batch)})

    def _restore_position(self, extra: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """Take the data position a loaded checkpoint recorded (with a fixed global batch)."""
        if extra is None or self.global_batch_plan is None:
            return extra
        if POSITION_KEY not in extra:
            warn("pipeddp: the checkpoint holds no data position (it was saved without global_batch), so "
                 "the loader starts epoch 0 from its beginning; set engine.position.epoch/.consumed "
                 "yourself if you know where the job stood", RuntimeWarning)
            return extra
        self.position.restore(extra[POSITION_KEY])
        return extra

    # -- life cycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for a save in flight, stop stage threads and, if this engine started it, the process group."""
        try:
            self._saver.close()  # a failed background save raises here, after everything below is stopped
        finally:
            self._finalizer()
            if self._owns_group and dist.is_initialized():
                dist.destroy_process_group()
                self._owns_group = False


    def extra_repr(self) -> str:
        t = self.topology
        return (f"mode={t.mode!r}, replicas={t.replicas}, stages={t.stages}, rank={t.rank}, "
                f"devices={[str(d) for d in self.devices]}, balance={self.balance}, backend={self.backend!r}")


def resume(engine: HybridParallel, directory: str,
           optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[Dict[str, Any]]:
    """``engine.resume(directory, optimizer)``: load the newest complete checkpoint, or return None.

    The arguments come in the order of ``engine.resume``, ``load`` and
    ``save_checkpoint``; the 0.1 order ``(engine, optimizer, directory)`` still
    works, with a ``DeprecationWarning``.
    """
    if isinstance(directory, torch.optim.Optimizer) or isinstance(optimizer, (str, os.PathLike)):
        warnings.warn("pipeddp.resume(engine, optimizer, directory) is deprecated; write "
                      "pipeddp.resume(engine, directory, optimizer)", DeprecationWarning, stacklevel=2)
        directory, optimizer = optimizer, directory  # type: ignore[assignment]
    return engine.resume(directory, optimizer)
