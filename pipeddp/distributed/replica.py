"""This process's part of a replicated pipeline, as one member of the job: a step the ranks agree on.

``Step`` (the runtime) trains and evaluates the stages this process holds.
Around it, a replica adds what the ranks must agree on::

    train:    batch sizes (one collective) -> Step.train_passes (accumulation, DDP on the last pass)
              -> the global mean loss, a non-finite step skipped on every rank alike (its receives posted
              as soon as the last pass's messages are issued: ``step_end``)
              (each collective an "agree" span when tracing)
    forward:  in stage mode the pipeline's processes agree on the batch size first
    evaluate: every sample counted once, metrics summed over the ranks that see outputs

``build_replica`` (``build``) wires one; ``HybridParallel`` is its public
face: the ``nn.Module`` that holds the layers, the checkpoints and the data
position.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..partitioning.report import Partition
from ..runtime.clip import Combine
from ..runtime.microbatch import batch_size as samples_of
from ..runtime.microbatch import tree_map
from ..runtime.settings import Settings
from ..runtime.step import Runner, Step
from ..runtime.trace import timed
from . import lazy
from .agreement import Agreement, CollectiveError
from .elastic import GlobalBatch
from .groups import Groups
from .notice import Notices, from_transport
from .ordering import when_issued
from .shard import StageShard
from .skipped import OpenSkip
from .ties import TieExchange
from .topology import Topology
from .tp_stages import TensorParallel

__all__ = ["Replica"]

LossFn = Callable[[Any, Any], torch.Tensor]


class Replica:
    """The wired parts of one process (see ``build``) and the steps they run together with the other ranks."""

    def __init__(self, topology: Topology, devices: List[torch.device], backend: str, *, owns_group: bool,
                 agreement: Agreement, partition: Partition, groups: Groups, step: Step, runner: Runner,
                 ties: TieExchange, ddps: List[Optional[DistributedDataParallel]], settings: Settings,
                 shards: Sequence[Optional[StageShard]] = (), tp: Optional[TensorParallel] = None) -> None:
        self.topology = topology
        #: the settings the engine was built with, the layout the profile chose included (``virtual_stages`` and
        #: ``placement`` where they were ``"auto"``)
        self.settings = settings
        self.devices = devices
        self.backend = backend
        #: whether the process group was started here (and is destroyed by ``close``)
        self.owns_group = owns_group
        self.agreement = agreement
        self.partition = partition
        self.groups = groups
        #: a failure inside a step reaches every rank at once (``notice``): its gloo groups are cut with it
        self.notices = Notices(topology, [agreement.host_group, topology.group, *groups.stage.values(),
                                          groups.pipeline, groups.pipeline_host])
        lazy.watch(self.notices.key)  # a failure posted: the exit does not wait for the ranks (``lazy``)
        self.step = step
        self.runner = runner
        self.ties = ties
        self.ddps = ddps
        #: each stage's FSDP2 state with ``shard=`` (empty under DDP)
        self.shards = list(shards)
        #: steps skipped because their loss or gradients were not finite somewhere (``skip_nonfinite``)
        self.skipped_steps = 0
        #: a skipped step held open until the optimizer steps, so that its other accumulation calls go with it
        self.open_skip = OpenSkip()
        #: tensor parallelism inside the stages (``tp_plan``), else None
        self.tp = tp
        #: whether the stages' sharded parameters are held gathered (an evaluation with shard=)
        self._gathered = False
        # a step's figures count every replica's samples, and the waits for the other processes
        step.stats.replicas, step.stats.processes = topology.replicas, topology.world_size
        step.stats.peers = topology.mode == "stage"

    def train(self, x: Any, y: Any, loss_fn: LossFn, params: Iterable[nn.Parameter], *,
              plan: Optional[GlobalBatch], scaler: Optional[torch.amp.GradScaler],
              skip_nonfinite: bool) -> torch.Tensor:
        """One optimizer step's gradients on this rank's batch; the global mean loss, the same on every rank."""
        self.step.stats.arrive()  # the step's time includes its agreements
        params = list(params)
        with self._agreeing(), self._told_if_lost("train_step"):
            n = self.agreement.local_batch(x, y, need_y=True, flag=self.ties.changed())  # a collective
        self._agreed("train_step")
        if scaler is not None:
            scaler.scale(torch.ones((), device=self.devices[0]))  # every rank's scaler is set up, not only the last's
        if plan is not None:
            plan.check(n, self.topology.rank)
        passes = plan.accumulation if plan is not None else 1
        # the loss agreement's receives posted once this process has issued the last pass's messages (``step_end``)
        end = self.agreement.gathering() if self.agreement.distributed else None
        with self.notices.guard("train_step"), when_issued(end.post if end is not None else None, passes):
            loss = self.step.train_passes(x, y, loss_fn, n, passes,
                                          loss_scale=scaler.scale if scaler is not None else None)
            if self.tp is not None:
                self.tp.after_backward(params, self.agreement.comm_device, skip_nonfinite or scaler is not None)
        with self._agreeing(), self.notices.guard("train_step"):
            mean, skipped, count = self.agreement.finish_step(loss, params,
                                                              skip_nonfinite=skip_nonfinite,
                                                              skipped=self.skipped_steps,
                                                              overflow_to_scaler=scaler is not None,
                                                              count=self.step.count,
                                                              carried=self.open_skip.open, gathering=end)
        self.step.finish_counted(count is not None, count or 0.0, self.topology.replicas)
        if skipped:
            self.skipped_steps += 0 if self.open_skip.open else 1
            self.open_skip.begin(params)
        return mean

    def _agreed(self, call: str) -> None:
        """Tell a stage-mode runner what the batch check found (activations then cross without headers where every
        rank's batch is shaped as in its previous ``call``), and the ties whether a use changed on any rank."""
        self.ties.due = self.agreement.flagged
        agreed = getattr(self.runner, "agreed", None)
        if agreed is not None:
            agreed(call, self.agreement.repeated)

    @contextlib.contextmanager
    def _told_if_lost(self, call: str) -> Iterator[None]:
        """The failure notices' guard for a step's first agreement, for a peer lost there alone (a wait that failed in
        the transport, its cause): the agreement's own errors are every rank's alike and leave the engine usable."""
        try:
            yield
        except CollectiveError as exc:
            if exc.__cause__ is None or not from_transport(exc.__cause__):
                raise
            with self.notices.guard(call):
                raise

    def _agreeing(self) -> ContextManager[Any]:
        """An ``"agree"`` span on the trace's communication lane around one of a step's two agreement collectives
        (they include waiting for the slowest rank, where that process would otherwise idle between steps)."""
        first = self.step.stages[0].index
        return self.step.stats.agreeing(timed(self.step.trace, first, "agree", 0, row=first % self.step.rows,
                                              lane="comm"))

    def forward(self, x: Any, *, need_grad: bool) -> Any:
        """``Step.forward``; in stage mode after the pipeline's processes agree on the batch size."""
        if self.topology.mode == "replica":
            n = samples_of(x, name="input")
        else:
            n = self.agreement.local_batch(x, None, need_y=False, group=self.groups.pipeline_host, call="forward",
                                           flag=self.ties.changed())
            self._agreed("forward")
        with self.notices.guard("forward"):
            out = self.step.forward(x, n, need_grad=need_grad)
        for sh in self.shards if not (need_grad or self._gathered) else ():  # an evaluation forward frees what
            if sh is not None:                                               # it gathered
                sh.reshard()
        return out

    def evaluate(self, model: nn.Module, loader: Iterable[Tuple[Any, Any]],
                 metric_fn: Callable[[Any, Any], Dict[str, Any]]) -> Dict[str, float]:
        """``metric_fn``'s means over every sample of ``loader`` (run through ``model`` in eval mode), once each.

        A metric returned as ``(total, count)`` (a loss over tokens) is the sum of totals over the sum of counts."""
        self.agreement.enter("evaluate")
        was_training = model.training
        model.eval()
        sums: Dict[str, float] = {}
        counts: Dict[str, float] = {}  # of the metrics returned as (total, count)
        count = 0
        last = self.step.last.device if self.step.last is not None else None
        gathered = contextlib.ExitStack()
        with self.notices.guard("evaluate"):  # the ranks go through the batches each at its own pace
            try:
                for sh in self.shards:  # with shard=: parameters gathered once, no collective per forward, since
                    if sh is not None:  # replicas may hold different numbers of batches
                        gathered.enter_context(sh.gathered())
                self._gathered = any(sh is not None for sh in self.shards)
                for x, y in loader:
                    with torch.no_grad():
                        out = model(x)
                    if last is not None:
                        n = samples_of(y, name="y")
                        for k, v in metric_fn(out, tree_map(partial(torch.Tensor.to, device=last), y)).items():
                            if isinstance(v, tuple):  # (total, count): a mean over what was counted, not over samples
                                sums[k] = sums.get(k, 0.0) + float(v[0])
                                counts[k] = counts.get(k, 0.0) + float(v[1])
                            else:
                                sums[k] = sums.get(k, 0.0) + float(v) * n
                        count += n
            finally:
                model.train(was_training)
                self._gathered = False
                gathered.close()
            return self.agreement.mean_metrics(count, sums, counts)

    def norm_scope(self) -> Tuple[List[nn.Parameter], torch.device, Optional[Combine]]:
        """For clipping: in stage mode the norm is joined over this replica's processes (replicas agree after DDP);
        with tensor parallelism over the tp ranks too (``TensorParallel.norm_scope``)."""
        copies, device, combine = self._job_norm_scope()
        if self.tp is None:
            return copies, device, combine
        return self.tp.norm_scope([p for st in self.step.stages for p in st.module.parameters()], copies, device,
                                  combine)

    def _job_norm_scope(self) -> Tuple[List[nn.Parameter], torch.device, Optional[Combine]]:
        if self.shards:  # every rank holds disjoint shards: the norm is summed over the whole job
            return self.ties.copies(), self.agreement.comm_device, partial(self.agreement.join_norm,
                                                                        group=self.topology.group)
        if self.topology.mode == "replica" or not self.agreement.distributed:
            return [], self.agreement.comm_device, None
        return self.ties.copies(), self.agreement.comm_device, partial(self.agreement.join_norm,
                                                                        group=self.groups.pipeline)

    def close(self) -> None:
        """Stop the runner and, if it was started here, the process group (idempotent).

        Only an explicit ``close`` ends the group: an engine collected without one stops its threads alone,
        since another engine of this process may be using the group by then.
        """
        self.runner.close()
        self.open_skip.end()
        if self.owns_group and dist.is_initialized():
            lazy.leave()  # the process that serves the store keeps it until every rank is done (``lazy``)
            dist.destroy_process_group()
            self.owns_group = False
