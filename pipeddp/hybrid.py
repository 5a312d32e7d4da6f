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

import math
import os
import warnings
import zlib
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import (FORMAT, atomic_save, check_plain, load_named_optimizer_state, merge_optimizer_states,
                         named_optimizer_state, newest, prune, rng_state, set_rng_state, step_path)
from .checkpoint import UnsafeCheckpointError
from .checkpoint import load as load_checkpoint
from .ddp import COMM_HOOKS, CommHook, attach_ddp, check_ddp_kwargs
from .devices import DeviceLike, resolve_devices
from .executor import run_actions
from .microbatch import batch_size, merge, split, split_sizes, tree_map
from .p2p import P2PChannel
from .partition import Partition, check_balance, partition
from .pipeline import Pipeline, check_chunks, check_model, profile_chunks, recompute_policy
from .rng import draw_base_seed, is_random
from .schedule import ScheduleFn, forward_only, get_schedule
from .stage import Stage, StepSpec
from .topology import Topology, env_world, init_process_group
from .trace import Trace

__all__ = ["HybridParallel", "resume"]


class HybridParallel(nn.Module):
    """Pipeline replicas x DDP, for one script run by ``torchrun`` (or ``pipeddp.spawn``, or alone).

    Args:
        model: the ``nn.Sequential`` (built identically on every rank; DDP
            copies rank 0's weights to the other replicas at start).
        stages: pipeline stages per replica.
        chunks, split_size, balance, sample, schedule, checkpoint: as in ``Pipeline``.
            A measured balance is computed on rank 0 and sent to every rank.
        mode: ``"replica"`` (one process per replica, driving ``stages`` devices
            with threads) or ``"stage"`` (one process per stage).
        devices: this process's devices (``stages`` of them in replica mode, one in
            stage mode). Default: consecutive CUDA devices by local rank, else CPU; a
            single process with fewer GPUs than stages puts several stages on one GPU.
        backend: ``"nccl"`` or ``"gloo"``; default nccl for CUDA, gloo for CPU.
        layout: stage mode only: ``"pipeline"`` (ranks 0..S-1 are replica 0) or
            ``"data"`` (ranks 0..R-1 hold stage 0).
        ddp_kwargs: passed to every stage's DDP (``bucket_cap_mb``,
            ``gradient_as_bucket_view``, ``find_unused_parameters``,
            ``broadcast_buffers``, ...).
        comm_hook: ``"fp16"``, ``"bf16"``, ``"powersgd"`` or a DDP comm hook function.
        sync_batchnorm: convert BatchNorm layers to ``SyncBatchNorm`` over each stage's group
            (CUDA only, as torch's SyncBatchNorm; no effect with one replica).
        timeout: for the process groups and every wait of the engine.
        trace: record a timeline (``engine.trace``).
        threads: intra-op threads per CPU stage thread (replica mode).
        skip_nonfinite: skip (on every rank together) a step whose loss or
            gradients are not finite anywhere; see ``train_step``.
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
        devices: Optional[Sequence[DeviceLike]] = None,
        backend: Optional[str] = None,
        layout: str = "pipeline",
        ddp_kwargs: Optional[Dict[str, Any]] = None,
        comm_hook: Optional[CommHook] = None,
        sync_batchnorm: bool = False,
        timeout: timedelta = timedelta(minutes=30),
        trace: bool = False,
        threads: Optional[int] = None,
        skip_nonfinite: bool = False,
    ) -> None:
        super().__init__()
        model = check_model(model)
        if dist.is_available() and dist.is_initialized():
            _, _, local_rank, local_world = env_world()
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world, local_rank, local_world = env_world()
        self.topology = topo = Topology(rank, world, local_rank, local_world, stages, mode, layout)
        if stages > len(model):
            raise ValueError(f"rank {rank}: stages={stages} but the model has only {len(model)} layers; "
                             f"use at most {len(model)} stages")
        self.chunks, self.split_size = check_chunks(chunks, split_size, stages)
        get_schedule(schedule, stages, 1)
        check_ddp_kwargs(ddp_kwargs)
        if isinstance(comm_hook, str) and comm_hook not in COMM_HOOKS:
            raise ValueError(f"unknown comm_hook {comm_hook!r}; choose one of {COMM_HOOKS} or pass a hook function")
        self.schedule = schedule
        self.checkpoint = checkpoint
        self.timeout = timeout
        self.skip_nonfinite = skip_nonfinite
        self.skipped_steps = 0
        devs = self._local_devices(devices)
        self.devices = devs
        self.backend = self._backend(backend, devs)
        if sync_batchnorm and any(d.type != "cuda" for d in devs):
            raise ValueError(f"rank {rank}: sync_batchnorm=True needs CUDA devices (torch's SyncBatchNorm runs only "
                             "on GPUs); on CPU, BatchNorm buffers follow DDP's broadcast_buffers instead")
        self._owns_group = False
        if world > 1 and not dist.is_initialized():
            init_process_group(self.backend, timeout)
            self._owns_group = True
        self._comm_device = devs[0] if self.backend == "nccl" else torch.device("cpu")

        self.partition: Partition = self._agree_partition(model, balance, sample, devs[0])
        self.balance = list(self.partition.balance)
        self._ddps: List[Any] = []
        self._groups = self._make_groups()
        self.trace = Trace(rank) if trace else None
        if sync_batchnorm and topo.replicas > 1:
            # convert before anything holds the layers; each stage's group is set below
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        named = list(model.named_children())

        if mode == "replica":
            pipe = Pipeline(model, devs, chunks=chunks, split_size=split_size, balance=self.balance,
                            schedule=schedule, checkpoint=checkpoint, threads=threads, trace=False,
                            timeout=timeout)
            pipe.partition = self.partition
            pipe.trace = self.trace
            pipe.rank = rank
            self.__dict__["_pipe"] = pipe  # not registered: the layers are registered below, by name
            self._stages: List[Stage] = pipe.stages
            self._prev: Optional[P2PChannel] = None
            self._next: Optional[P2PChannel] = None
        else:
            self.__dict__["_pipe"] = None
            s = topo.stage
            a, b = self.partition.ranges()[s]
            part = nn.Sequential(OrderedDict(named[a:b])).to(devs[0])
            self._stages = [Stage(s, part, devs[0], last=s == stages - 1)]
            self._prev = self._channel(s - 1) if s > 0 else None
            self._next = self._channel(s + 1) if s < stages - 1 else None
        local_names = {name for st in self._stages for name, _ in st.module.named_children()}
        for name, layer in named:
            if name in local_names:
                self.add_module(name, layer)

        if topo.replicas > 1:
            for st in self._stages:
                group = self._groups["stage"][st.index]
                for layer in st.module.modules():
                    if isinstance(layer, nn.SyncBatchNorm):
                        layer.process_group = group  # statistics are shared by this stage's copies only
                self._ddps.append(attach_ddp(st, group, ddp_kwargs=ddp_kwargs, comm_hook=comm_hook, trace=self.trace))

    # -- set-up ------------------------------------------------------------------------------------

    @property
    def trace(self) -> Optional[Trace]:
        """The timeline being recorded (None when off). Assigning one also reaches the stage threads;
        gradient all-reduce spans are recorded only when the engine was built with ``trace=True``."""
        return self.__dict__.get("_trace")

    @trace.setter
    def trace(self, value: Optional[Trace]) -> None:
        self.__dict__["_trace"] = value
        pipe = self.__dict__.get("_pipe")
        if pipe is not None:
            pipe.trace = value

    def _local_devices(self, devices: Optional[Sequence[DeviceLike]]) -> List[torch.device]:
        topo = self.topology
        want = topo.stages if topo.mode == "replica" else 1
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
            warnings.warn(f"pipeddp: {want} stage(s) on {count} CUDA device(s): stages share devices "
                          f"{[str(d) for d in devs]}; pass devices= to choose", RuntimeWarning, stacklevel=3)
            return devs
        if need > count:
            raise ValueError(
                f"rank {topo.rank}: {topo.local_world_size} processes on this node x {want} device(s) each need "
                f"{need} CUDA devices, but there are {count}; start fewer processes per node, use fewer stages, "
                "or pass devices= explicitly"
            )
        return [torch.device("cuda", topo.local_rank * want + s) for s in range(want)]

    def _backend(self, backend: Optional[str], devs: List[torch.device]) -> str:
        cuda = all(d.type == "cuda" for d in devs)
        chosen = backend or ("nccl" if cuda else "gloo")
        rank = self.topology.rank
        if chosen == "nccl" and not cuda:
            raise ValueError(
                f"rank {rank}: backend 'nccl' cannot serve CPU devices {[str(d) for d in devs]}; use backend='gloo' "
                "(or leave backend=None to choose automatically)"
            )
        if chosen == "gloo" and cuda and self.topology.mode == "stage":
            raise ValueError(
                f"rank {rank}: backend 'gloo' cannot send CUDA tensors between stages; use backend='nccl' "
                "(or leave backend=None) for mode='stage' on GPUs"
            )
        if chosen not in ("nccl", "gloo"):
            raise ValueError(f"rank {rank}: backend must be 'nccl' or 'gloo', got {chosen!r}")
        return chosen

    @property
    def _distributed(self) -> bool:
        return self.topology.world_size > 1

    def _agree_partition(self, model: nn.Sequential, balance: Any, sample: Any, device: torch.device) -> Partition:
        """Rank 0 measures and cuts; every rank uses rank 0's cut (replicas must match for DDP)."""
        stages = self.topology.stages
        if balance is None:
            balance = "time" if sample is not None else "params"
        if not isinstance(balance, str):
            return partition(model, stages, method=check_balance(balance, len(model), stages))
        chunks = profile_chunks(sample, self.chunks, self.split_size)
        plan = [partition(model, stages, method=balance, sample=sample, chunks=chunks, device=device)
                if self.topology.rank == 0 or not self._distributed else None]
        if self._distributed:
            dist.broadcast_object_list(plan, src=0)
        assert plan[0] is not None
        return plan[0]

    def _make_groups(self) -> Dict[str, Any]:
        """Stage groups (and pipeline groups in stage mode), created on every rank in the same order."""
        topo = self.topology
        groups: Dict[str, Any] = {"stage": {}, "pipeline": None}
        if not self._distributed:
            return groups
        for s in range(topo.stages):
            g = dist.new_group(topo.stage_ranks(s), timeout=self.timeout, backend=self.backend)
            groups["stage"][s] = g
        if topo.mode == "stage":
            for r in range(topo.replicas):
                g = dist.new_group(topo.pipeline_ranks(r), timeout=self.timeout, backend=self.backend)
                if r == topo.replica:
                    groups["pipeline"] = g
        return groups

    def _channel(self, peer_stage: int) -> P2PChannel:
        topo = self.topology
        return P2PChannel(topo.rank_of(topo.replica, peer_stage), rank=topo.rank, stage=topo.stage,
                          peer_stage=peer_stage, device=self.devices[0], comm_device=self._comm_device,
                          timeout=self.timeout)

    # -- helpers -----------------------------------------------------------------------------------

    @property
    def is_first(self) -> bool:
        """Whether this process feeds inputs (holds stage 0)."""
        return self.topology.mode == "replica" or self.topology.stage == 0

    @property
    def is_last(self) -> bool:
        """Whether this process sees outputs and targets (holds the last stage)."""
        return self.topology.mode == "replica" or self.topology.stage == self.topology.stages - 1

    def _gather_sizes(self, x: Any, y: Any, group: Any) -> List[Tuple[int, int, str]]:
        """Every rank's (x size, y size, error) in ``group``; never raises before the collective.

        A rank that raised on its own would leave the others waiting in the
        collective forever; so every rank reports, then all raise together.
        """
        def size(v: Any, name: str) -> Tuple[int, str]:
            if v is None:
                return -1, ""
            try:
                return batch_size(v, name=name), ""
            except ValueError as exc:
                return -2, str(exc)

        nx, ex = size(x, "x")
        ny, ey = size(y, "y")
        mine = (nx, ny, ex or ey)
        if not self._distributed:
            return [mine]
        # One small tensor collective per step; messages travel only when some rank has one.
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.topology.world_size))
        t = torch.tensor([nx, ny, 1 if mine[2] else 0], dtype=torch.int64, device=self._comm_device)
        gathered = [torch.zeros_like(t) for _ in ranks]
        dist.all_gather(gathered, t, group=group)
        rows = [tuple(int(v) for v in g.tolist()) for g in gathered]
        messages: List[Any] = [""] * len(ranks)
        if any(r[2] for r in rows):
            dist.all_gather_object(messages, mine[2], group=group)
        return [(r[0], r[1], m) for r, m in zip(rows, messages)]

    def _local_batch(self, x: Any, y: Any, *, need_y: bool, group: Any = None) -> int:
        """Check every rank's batch and return the common local batch size."""
        topo = self.topology
        infos = self._gather_sizes(x, y, group)
        ranks = dist.get_process_group_ranks(group) if (group is not None and self._distributed) \
            else list(range(len(infos)))
        for r, (nx, ny, err) in zip(ranks, infos):
            if err:
                raise ValueError(f"rank {r}: {err}")
        needs = []  # (rank, size, what)
        for r, (nx, ny, _) in zip(ranks, infos):
            stage = None if topo.mode == "replica" else topo.stage_of(r)
            if stage is None or stage == 0:
                if nx < 0:
                    raise ValueError(f"rank {r} holds stage 0 and must pass the inputs x, but passed None")
                needs.append((r, nx, "x"))
            if need_y and (stage is None or stage == topo.stages - 1):
                if ny < 0:
                    raise ValueError(f"rank {r} holds the last stage and must pass the targets y, but passed None")
                needs.append((r, ny, "y"))
        sizes = {n for _, n, _ in needs}
        if len(sizes) > 1:
            votes = {n: sum(1 for _, k, _ in needs if k == n) for n in sizes}
            common = max(votes, key=lambda n: votes[n])
            advice = ("every replica must pass the same local batch size and x and y must match "
                      "(pipeddp.data.loader shards a dataset so that they do)")
            if list(votes.values()).count(votes[common]) == 1:
                r, n, what = next(item for item in needs if item[1] != common)
                raise ValueError(f"rank {r} passed {what} with {n} samples but the others have {common}; {advice}")
            listing = ", ".join(f"rank {r} {what}={n}" for r, n, what in needs)
            raise ValueError(f"the ranks disagree on the local batch size ({listing}); {advice}")
        return sizes.pop()

    def _seed(self) -> Optional[int]:
        if any(st.module.training and is_random(st.module) for st in self._stages):
            return draw_base_seed()
        return None

    def _run_stage(self, rows: List[Any], spec: StepSpec, xs: Optional[List[Any]]) -> Any:
        st = self._stages[0]
        st.streams.enter()
        try:
            return run_actions(st, rows, spec, prev=self._prev, next=self._next, inputs=xs, trace=self.trace,
                               rank=self.topology.rank)
        except BaseException:
            for ch in (self._prev, self._next):
                if ch is not None:
                    ch.reset()
            raise
        finally:
            for ch in (self._prev, self._next):
                if ch is not None:
                    ch.flush()
            st.streams.leave()

    # -- training ----------------------------------------------------------------------------------

    def train_step(self, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """One training step on this rank's local batch; returns the global mean loss (same on every rank).

        In stage mode the rank of stage 0 needs ``x`` and the rank of the last
        stage needs ``y``; the others may pass None. Gradients land in ``.grad``
        of ``engine.parameters()``, already averaged over replicas.

        With ``skip_nonfinite=True``, a step whose loss or gradients are not
        finite on any rank is skipped on every rank alike: gradients are dropped
        (set to None, so ``optimizer.step()`` changes nothing), a warning names the
        ranks, and ``engine.skipped_steps`` counts it.
        """
        n = self._local_batch(x, y, need_y=True)
        topo = self.topology
        sync = topo.replicas > 1
        if topo.mode == "replica":
            local = self._pipe.train_step(x, y, loss_fn, sync=sync).item()
        else:
            sizes = split_sizes(n, self.chunks, self.split_size)
            st = self._stages[0]
            xs = split(tree_map(lambda t: t.to(st.device), x), sizes) if self.is_first else None
            ys = split(tree_map(lambda t: t.to(st.device), y), sizes) if self.is_last else None
            m = len(sizes)
            spec = StepSpec(grad=True, recompute=recompute_policy(self.checkpoint, m), seed=self._seed(),
                            loss_fn=loss_fn if self.is_last else None, targets=ys,
                            weights=[k / n for k in sizes], sync=sync)
            rows = get_schedule(self.schedule, topo.stages, m)[topo.stage]
            results = self._run_stage(rows, spec, xs)
            local = float(sum(v.item() for v in results.losses.values())) if self.is_last else 0.0
        return self._finish_step(local)

    def _finish_step(self, local_loss: float) -> torch.Tensor:
        """Average the loss over replicas (one collective) and apply the non-finite guard."""
        bad_loss = bad_grads = 0.0
        if self.skip_nonfinite:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            bad_loss = 0.0 if math.isfinite(local_loss) else 1.0
            bad_grads = 0.0 if all(bool(torch.isfinite(g).all()) for g in grads) else 1.0
        mine = torch.tensor([local_loss, bad_loss, bad_grads], dtype=torch.float64, device=self._comm_device)
        if self._distributed:
            everyone = [torch.zeros_like(mine) for _ in range(self.topology.world_size)]
            dist.all_gather(everyone, mine)
        else:
            everyone = [mine]
        loss = sum(t[0].item() for t in everyone) / self.topology.replicas
        losses = [r for r, t in enumerate(everyone) if t[1].item() > 0]
        grads_bad = [r for r, t in enumerate(everyone) if t[2].item() > 0]
        if losses or grads_bad:
            for p in self.parameters():
                p.grad = None
            self.skipped_steps += 1
            where = "; ".join(part for part in (
                f"non-finite loss on rank(s) {losses}" if losses else "",
                f"non-finite gradients on rank(s) {grads_bad}" if grads_bad else "") if part)
            warnings.warn(f"pipeddp: skipped a training step: {where}; gradients were dropped on every rank "
                          f"({self.skipped_steps} skipped so far)", RuntimeWarning, stacklevel=3)
        return torch.tensor(loss, dtype=torch.float64)

    def forward(self, x: Any) -> Any:  # type: ignore[override]
        """Forward only (no gradients): the output on the last stage, None on other stage-mode ranks."""
        return self.eval_step(x)

    @torch.no_grad()
    def eval_step(self, x: Any) -> Any:
        """Run ``x`` forward through this replica's pipeline without gradients.

        Only the replica's own processes communicate, so replicas may run a
        different number of evaluation batches.
        """
        topo = self.topology
        if topo.mode == "replica":
            return self._pipe(x)
        n = self._local_batch(x, None, need_y=False, group=self._groups["pipeline"])
        sizes = split_sizes(n, self.chunks, self.split_size)
        st = self._stages[0]
        xs = split(tree_map(lambda t: t.to(st.device), x), sizes) if self.is_first else None
        rows = forward_only(topo.stages, len(sizes))[topo.stage]
        results = self._run_stage(rows, StepSpec(grad=False, seed=self._seed()), xs)
        if not self.is_last:
            return None
        return merge([results.outputs[i] for i in range(len(sizes))])

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
                    n = batch_size(y, name="y")
                    for k, v in metric_fn(out, tree_map(lambda t: t.to(self._stages[-1].device), y)).items():
                        sums[k] = sums.get(k, 0.0) + float(v) * n
                    count += n
        finally:
            self.train(was_training)
        parts: List[Any] = [(count, sums)]
        if self._distributed:
            parts = [None] * self.topology.world_size
            dist.all_gather_object(parts, (count, sums))
        total = sum(c for c, _ in parts)
        merged: Dict[str, float] = {}
        for _, s in parts:
            for k, v in s.items():
                merged[k] = merged.get(k, 0.0) + v
        result = {k: v / total for k, v in merged.items()} if total else {}
        result["samples"] = float(total)
        return result

    # -- consistency -------------------------------------------------------------------------------

    def check_replicas(self) -> None:
        """Raise if any stage's parameters differ between its replicas (names the stage and parameter).

        Compares a CRC32 of every parameter's bytes across the stage's group, so
        it detects any difference, down to the last bit. A collective: call it on
        every rank.
        """
        if not self._distributed or self.topology.replicas == 1:
            return
        problem = ""
        for st in self._stages:
            names = [n for n, _ in st.module.named_parameters()]
            sums = [zlib.crc32(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
                    for p in st.module.parameters()]
            group = self._groups["stage"][st.index]
            everyone: List[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, sums, group=group)
            ranks = dist.get_process_group_ranks(group)
            for i, name in enumerate(names):
                values = [e[i] for e in everyone]
                if len(set(values)) > 1 and not problem:
                    odd = [r for r, v in zip(ranks, values) if v != values[0]]
                    problem = (f"stage {st.index}: parameter {name!r} differs between replicas "
                               f"(ranks {odd} disagree with rank {ranks[0]})")
        problems: List[Any] = [None] * self.topology.world_size
        dist.all_gather_object(problems, problem)
        first = next((p for p in problems if p), "")
        if first:
            raise RuntimeError(first)

    # -- state -------------------------------------------------------------------------------------

    def local_state_dict(self) -> Dict[str, Any]:
        """This process's part of the model, with the model's keys."""
        return super().state_dict()

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:  # type: ignore[override]
        """The whole model's state dict with the plain model's keys (a collective in stage mode)."""
        local = super().state_dict(*args, **kwargs)
        if self.topology.mode == "replica" or not self._distributed:
            return local
        mine = {k: v.detach().cpu() for k, v in local.items()} if self.topology.replica == 0 else None
        parts: List[Any] = [None] * self.topology.world_size
        dist.all_gather_object(parts, mine)
        full: Dict[str, Any] = {}
        for p in parts:
            if p:
                full.update(p)
        return full

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """Load the entries of a full (or partial) state dict that belong to this process."""
        own = set(super().state_dict().keys())
        if strict:
            missing = sorted(own - set(state_dict))
            if missing:
                raise KeyError(f"rank {self.topology.rank}: the state dict lacks {missing[:5]}"
                               f"{' ...' if len(missing) > 5 else ''}")
        return super().load_state_dict({k: v for k, v in state_dict.items() if k in own}, strict=strict, assign=assign)

    def _optimizer_state(self, optimizer: Optional[torch.optim.Optimizer]) -> Optional[Dict[str, Any]]:
        if optimizer is None:
            return None
        local = named_optimizer_state(self, optimizer)
        if self.topology.mode == "replica" or not self._distributed:
            return local
        parts: List[Any] = [None] * self.topology.world_size
        dist.all_gather_object(parts, local if self.topology.replica == 0 else None)
        return merge_optimizer_states(parts)

    def _payload(self, optimizer: Optional[torch.optim.Optimizer], extra: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """Everything a checkpoint holds (collectives: call on every rank; complete on rank 0)."""
        check_plain(extra or {}, "extra")  # on every rank, before any collective: all raise alike
        model = self.state_dict()
        optim = self._optimizer_state(optimizer)
        rngs: List[Any] = [rng_state()]
        if self._distributed:
            rngs = [None] * self.topology.world_size
            dist.all_gather_object(rngs, rng_state())
        return {"format": FORMAT, "model": model, "optimizer": optim, "extra": extra or {}, "rng": rngs,
                "meta": {"stages": self.topology.stages, "replicas": self.topology.replicas,
                         "world_size": self.topology.world_size, "balance": self.balance,
                         "mode": self.topology.mode}}

    def save(self, path: str, optimizer: Optional[torch.optim.Optimizer] = None,
             extra: Optional[Dict[str, Any]] = None) -> None:
        """Write one consolidated checkpoint (rank 0 writes, atomically; every rank waits for it).

        Call on every rank. ``extra`` is stored as is (step counters, epochs).
        """
        payload = self._payload(optimizer, extra)
        if self.topology.rank == 0:
            atomic_save(payload, path)
        if self._distributed:
            dist.barrier()

    def save_checkpoint(self, directory: str, step: int, optimizer: Optional[torch.optim.Optimizer] = None, *,
                        keep: int = 3, extra: Optional[Dict[str, Any]] = None) -> str:
        """Save ``directory/step-<step>.pt`` (atomic) and keep only the newest ``keep`` checkpoints.

        Besides model and optimizer, the file records ``step``, every rank's random
        generator states, and ``extra`` (e.g. the epoch and batch index: where the
        data loader stands). ``resume`` restores all of it.
        """
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        payload = self._payload(optimizer, dict(extra or {}, step=step))
        path = step_path(directory, step)
        if self.topology.rank == 0:
            os.makedirs(directory, exist_ok=True)
            atomic_save(payload, path)
            prune(directory, keep)
        if self._distributed:
            dist.barrier()
        return path

    def resume(self, directory: str, optimizer: Optional[torch.optim.Optimizer] = None) -> Optional[Dict[str, Any]]:
        """Load the newest complete checkpoint of ``directory``; returns its ``extra`` (with ``step``) or None.

        Rank 0 picks the file (a damaged or half-written one is skipped) and every
        rank loads the same one. Random generator states are restored when the job
        has the same number of ranks as the one that saved.
        """
        chosen: List[Any] = [None, ""]
        if self.topology.rank == 0 or not self._distributed:
            try:
                found = newest(directory) if os.path.isdir(directory) else None
                chosen = [found[0] if found else None, ""]
            except ValueError as exc:  # an unsafe file: every rank must raise, none may wait for rank 0
                chosen = [None, str(exc)]
        if self._distributed:
            dist.broadcast_object_list(chosen, src=0)
        if chosen[1]:
            raise UnsafeCheckpointError(f"rank {self.topology.rank}: {chosen[1]}")
        if chosen[0] is None:
            return None
        payload = self._load_payload(chosen[0], optimizer)
        rngs = payload.get("rng") or []
        if len(rngs) == self.topology.world_size:
            set_rng_state(rngs[self.topology.rank])
        return payload.get("extra", {})

    def load(self, path: str, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, Any]:
        """Load a checkpoint written by ``save`` (any stages/replicas layout); returns its ``extra``.

        Tensors are read onto the CPU and copied into this rank's parameters and
        optimizer state on their own devices.
        """
        return self._load_payload(path, optimizer).get("extra", {})

    def _load_payload(self, path: str, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, Any]:
        ckpt = load_checkpoint(path)
        self.load_state_dict(ckpt["model"])
        if optimizer is not None:
            if ckpt.get("optimizer") is None:
                raise ValueError(f"{path} holds no optimizer state (it was saved without optimizer=)")
            load_named_optimizer_state(self, optimizer, ckpt["optimizer"])
        return ckpt

    # -- life cycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop stage threads and, if this engine started it, the process group."""
        if self._pipe is not None:
            self._pipe.close()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def __enter__(self) -> "HybridParallel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def extra_repr(self) -> str:
        t = self.topology
        return (f"mode={t.mode!r}, replicas={t.replicas}, stages={t.stages}, rank={t.rank}, "
                f"devices={[str(d) for d in self.devices]}, balance={self.balance}, backend={self.backend!r}")


def resume(engine: HybridParallel, optimizer: Optional[torch.optim.Optimizer], directory: str) -> Optional[Dict[str, Any]]:
    """``engine.resume(directory, optimizer)``: load the newest complete checkpoint, or return None."""
    return engine.resume(directory, optimizer)
