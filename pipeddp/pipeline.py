"""``Pipeline``: an ``nn.Sequential`` cut into stages on several devices, run as a pipeline.

::

    pipe = Pipeline(model, devices=["cuda:0", "cuda:1"], chunks=8, sample=x)

    out = pipe(x)                      # forward pipelined over micro-batches
    loss_fn(out, y).backward()         # backward pipelined too

    loss = pipe.train_step(x, y, loss_fn)   # GPipe / 1F1B forward+backward in one go

The layers stay registered under their original names, so ``state_dict()``
has the keys of the plain model (``"0.weight"``, ...) and a state dict moves
freely between the plain model and any partition. A model flattened by
``flatten_sequential`` keeps the names of the model it came from
(``layer1.0.conv1.weight``, not ``layer1_0.conv1.weight``: see ``runtime.names``). ``parameters()`` come in
the model's order, so an optimizer built on the pipeline steps exactly like
one built on the plain model.
"""

from __future__ import annotations

import weakref
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch import nn

from ._engine import StepModule
from ._settings import check_log_every, check_settings, choose_partition
from .checkpoints import export
from .checkpoints.checkpointable import Checkpointable
from .checkpoints.saving import Saver
from .distributed.build import build_replica
from .distributed.groups import local_devices
from .distributed.topology import Topology
from .partitioning.report import Partition
from .runtime.devices import DeviceLike, resolve_devices
from .runtime.executor import ThreadRunner
from .runtime.microbatch import batch_size, tree_tensors
from .runtime.names import Names
from .runtime.schedule.actions import ScheduleFn

__all__ = ["Pipeline"]


def _device_arg(args: Any, kwargs: Any) -> bool:
    """Whether a ``Module.to`` call names a device (as opposed to only a dtype)."""
    if "device" in kwargs or "tensor" in kwargs:
        return True
    return any(isinstance(a, (str, torch.device, int, torch.Tensor)) for a in args)


def pipeline_devices(devices: Union[str, Sequence[DeviceLike]], stages: Optional[int]) -> List[torch.device]:
    """The devices of a one-process pipeline: as listed, or ``"auto"`` chosen as ``HybridParallel`` chooses them.

    ``"auto"`` with ``stages=p`` is the hybrid engine's rule for one process
    (``groups.local_devices``): ``cuda:0`` .. ``cuda:p-1`` where there are GPUs
    (stages share them, with a warning, when there are fewer), else the CPU p
    times, so that one script runs on a GPU box and on a laptop.
    """
    one = None if stages is None else Topology(0, 1, 0, 1, stages)  # checks stages as HybridParallel does
    if isinstance(devices, str) and devices == "auto":
        if one is None:
            raise ValueError("devices='auto' needs the number of stages: Pipeline(model, devices='auto', stages=2) "
                             "(one device each, GPUs where there are any, else the CPU)")
        return local_devices(one, "auto")
    devs = resolve_devices(devices)
    if stages is not None and stages != len(devs):
        raise ValueError(f"stages={stages} but {len(devs)} devices were given ({[str(d) for d in devs]}); "
                         "a pipeline has one stage per device: drop stages= or give that many devices")
    return devs


class Pipeline(Checkpointable, StepModule):
    """Run an ``nn.Sequential`` as a pipeline over ``devices`` (one stage each).

    Args:
        model: the model; its children are the layers the partitioner cuts between.
            The layers are moved to their stage's device (the pipeline owns them).
        devices: one device per stage, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``; or
            ``"auto"`` with ``stages=p``: as ``HybridParallel``'s ``devices="auto"``, ``p`` GPUs where
            there are any (shared, with a warning, if fewer), else the CPU ``p`` times.
        stages: the number of stages; needed with ``devices="auto"``, else ``len(devices)`` (checked).
        chunks: number of micro-batches per batch (default ``2 * stages``). A batch
            smaller than ``chunks`` gives one micro-batch per sample.
        split_size: samples per micro-batch, instead of ``chunks``.
        balance: ``"time"`` (profile ``sample``), ``"params"``, ``"memory"``,
            ``"uniform"``, or a list of layers per stage. Default: ``"time"`` when
            a ``sample`` is given, else ``"params"``.
        sample: one input batch, used to profile the layers.
        schedule: for ``train_step``: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved"``
            (interleaved 1F1B over ``virtual_stages`` stages per device) or ``"zb"``
            (zero-bubble: each backward split into its input and weight halves), or a
            function ``(stages, chunks) -> per-device action lists`` (see ``pipeddp.runtime.schedule``);
            ``"auto"`` builds the order from the stages' measured costs (``docs/schedules.md``).
        max_activations: ``schedule="auto"`` only: the most micro-batches a device may hold at once
            (default 1F1B's); more lets the order hide more of the bubble.
        seed: for a model built under ``torch.device("meta")``: each layer is materialized on its stage's
            device and initialised from ``(seed, its name)``, the weights ``pipeddp.materialize(model, seed)``
            gives in every layout (``docs/big_models.md``). Ignored for a model that already has its weights.
        init: how such a model's modules are initialised, ``init(module)`` (default: each module's own
            ``reset_parameters()``), under the same per-module seeds.
        virtual_stages: stages per device (default 2 for ``"interleaved"``, else 1): the
            model is cut into ``len(devices) * virtual_stages`` stages and device r holds
            stages r, r + len(devices), ...; ``balance`` then lists that many stages.
            ``"auto"`` (with ``schedule="auto"`` and a ``sample``): one or two, whichever plays shorter on
            the profile, each on its own cut, every action priced at what the engine spends on it beside its
            compute, chosen when the engine is built (``pipeddp.runtime.schedule.placing``;
            ``pipe.virtual_stages`` says which).
        placement: with virtual stages, which device holds which: ``"loop"`` (default; as above) or ``"v"``,
            down the devices and back up (two devices, two stages each: device 0 holds stages 0 and 3),
            so the first and the last stage (an embedding and a head) share a device, a cut with a light
            first stage and a heavy last one adds up more evenly on the devices, and the turn between
            passes sends nothing (torch's ``ScheduleZBVZeroBubble`` places its stages so);
            ``"auto"``: the one in which the schedule plays shorter on the profile's costs, chosen when the
            engine is built (``pipeddp.runtime.schedule.placing``; ``pipe.placement`` says which).
        checkpoint: ``"never"``, ``"except_last"`` or ``"always"``: recompute
            activations in backward instead of keeping them (dropout replays the
            same random numbers).
        threads: intra-op threads per CPU stage (default: the caller's thread
            count divided among the CPU stages, at least 1).
        trace: record a timeline of every action (``pipe.trace``).
        timeout: how long a stage waits for a neighbour before raising (seconds or a timedelta).
        deferred_batch_norm: update BatchNorm running statistics once per batch, as one
            whole-batch forward would, instead of once per micro-batch.
        compile: ``True`` or a dict of ``torch.compile`` options: each stage's module is
            compiled once (lazily, on its first call in each mode). The partitioner
            profiles the eager layers.
        log_every: every that many training steps, an INFO record of the ``"pipeddp"`` logger with the
            step's figures (``pipe.last_step``; shown once logging is configured, e.g.
            ``logging.basicConfig(level=logging.INFO)``; None or 0: none). See ``pipeddp.watch``.

    Mixed precision: ``torch.autocast`` around ``pipe(x)`` or ``train_step`` reaches
    every stage (forward, loss and recompute); ``train_step(..., scaler=GradScaler)``
    scales the loss for backward.

    A parameter that several stages use (an embedding tied to the output head,
    a module placed twice) gets a copy on each later stage; the copies are kept
    one weight (see ``pipeddp.runtime.tied``), and ``parameters()`` lists each:
    clip with ``pipe.clip_grad_norm_``, which counts them once.

    Checkpoints: ``save``, ``save_checkpoint``, ``wait_for_save``, ``load`` and
    ``resume`` write and read the formats of ``HybridParallel`` (one file, or
    sharded), by the same code (``pipeddp.checkpoints.checkpointable``), so
    each class loads the other's checkpoints; ``save_pretrained`` writes a
    Hugging Face directory, as ``HybridParallel``'s does.
    """

    def __init__(
        self,
        model: nn.Sequential,
        devices: Union[str, Sequence[DeviceLike]],
        *,
        stages: Optional[int] = None,
        chunks: Optional[int] = None,
        split_size: Optional[int] = None,
        balance: Union[None, str, Sequence[int]] = None,
        sample: Optional[Any] = None,
        schedule: Union[str, ScheduleFn] = "1f1b",
        checkpoint: str = "never",
        threads: Optional[int] = None,
        trace: bool = False,
        timeout: Union[float, timedelta] = timedelta(minutes=30),
        deferred_batch_norm: bool = False,
        compile: Union[bool, Dict[str, Any]] = False,
        virtual_stages: Union[None, int, str] = None,
        placement: str = "loop",
        max_activations: Optional[int] = None,
        seed: int = 0,
        init: Optional[Callable[[nn.Module], None]] = None,
        log_every: Optional[int] = 100,
    ) -> None:
        super().__init__()
        log_every = check_log_every(log_every)
        devs = pipeline_devices(devices, stages)
        settings = check_settings(model, len(devs), chunks=chunks, split_size=split_size, schedule=schedule,
                                  checkpoint=checkpoint, timeout=timeout, compile=compile,
                                  virtual_stages=virtual_stages, threads=threads,
                                  flags={"trace": trace, "deferred_batch_norm": deferred_batch_norm},
                                  balance=balance, sample=sample, max_activations=max_activations, seed=seed,
                                  init=init, placement=placement)
        self.key_names = Names.of(model)
        self._export_source = export.source_of(model)  # what save_pretrained writes the configuration of
        self.devices = devs
        n_stages = len(devs) * settings.virtual_stages
        # one builder for both engines: a Pipeline is a one-process, one-replica job in replica mode
        wired = build_replica(self, model, Topology(0, 1, 0, 1, len(devs)), settings,
                              partition=partial(choose_partition, model, n_stages, balance, sample, settings),
                              devices=devs, threads=threads, trace=trace, deferred_batch_norm=deferred_batch_norm)
        self.partition: Partition = wired.partition
        self.balance: List[int] = list(self.partition.balance)
        assert isinstance(wired.runner, ThreadRunner)  # replica mode: the stages run on this process's threads
        self._runner, self._step = wired.runner, wired.step
        self._finalizer = weakref.finalize(self, self._runner.close)
        self.settings = wired.settings  # virtual_stages and placement as built, where "auto" left them to the profile
        #: one process, one replica: what checkpoints record of the layout, and what their functions take
        self.topology, self.agreement = wired.topology, wired.agreement
        self._saver = Saver(self.topology, settings.timeout_delta)
        self._start_watch(log_every, rank=0)

    # -- structure ---------------------------------------------------------------------------------

    @property
    def chunks(self) -> Optional[int]:
        return self.settings.chunks

    @property
    def split_size(self) -> Optional[int]:
        return self.settings.split_size

    @property
    def schedule(self) -> Union[str, ScheduleFn]:
        return self.settings.schedule

    @property
    def checkpoint(self) -> str:
        return self.settings.checkpoint

    @property
    def timeout(self) -> float:
        return self.settings.timeout

    @property
    def threads(self) -> Optional[int]:
        """Intra-op threads of each CPU stage's worker thread."""
        return self._runner.threads


    def stage_parameters(self, stage: int) -> Iterator[nn.Parameter]:
        return self._step.stages[stage].module.parameters()

    def to(self, *args: Any, **kwargs: Any) -> "Pipeline":
        if _device_arg(args, kwargs):
            raise TypeError(
                "a Pipeline places each stage on its own device; it cannot be moved with .to(device). "
                "Build a new Pipeline with other devices= instead (dtype conversions like .to(torch.float64) work)"
            )
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> "Pipeline":
        raise TypeError("a Pipeline places each stage on its own device; build it with devices=[...] instead of "
                        ".cuda()")

    def cpu(self) -> "Pipeline":
        raise TypeError("a Pipeline places each stage on its own device; build it with devices=['cpu', ...] instead "
                        "of .cpu()")

    def close(self) -> None:
        """Wait for a save in flight, stop and join the stage threads, give the model back its tied weights (one
        parameter where stages held copies). The pipeline cannot run afterwards."""
        try:
            self._saver.close()  # a failed background save raises here, after the threads are stopped
        finally:
            self._finalizer()
            self._step.ties.restore()

    @property
    def worker_threads(self) -> List[Any]:
        return self._runner.worker_threads

    # -- running -----------------------------------------------------------------------------------

    def forward(self, x: Any) -> Any:
        """Run ``x`` through the pipeline; the output lives on the last device.

        With autograd on, the result is connected to the graph: ``backward`` on
        anything computed from it runs every stage's backward, pipelined, and
        accumulates into ``.grad``.
        """
        need_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters()) or any(t.requires_grad for t in tree_tensors(x))
        )
        return self._step.forward(x, batch_size(x, name="input"), need_grad=need_grad)

    def train_step(self, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                   scaler: Optional[torch.amp.GradScaler] = None) -> torch.Tensor:
        """Forward and backward of one batch under the schedule; returns the detached mean loss.

        ``loss_fn(output, target)`` returns the *mean* loss of its
        micro-batch. Each micro-batch's loss is weighted by its share of the
        batch, so the accumulated ``.grad`` equals that of
        ``loss_fn(model(x), y).backward()`` on one device, uneven micro-batches
        included. A loss over tokens (padding ignored) returns ``(total, count)``
        instead, the micro-batch's sum and how many items it counted: the step's
        loss and gradients are then those of sum(totals) / sum(counts) over the
        whole batch (``pipeddp.runtime.counted``). Gradients accumulate into ``.grad`` (zero them as usual).
        With ``scaler`` (``torch.amp.GradScaler``) backward starts from the
        scaled loss; then ``scaler.step(optimizer); scaler.update()`` as usual.
        """
        n = batch_size(x, name="x")
        ny = batch_size(y, name="y")
        if n != ny:
            raise ValueError(f"x has {n} samples but y has {ny}; inputs and targets must have the same batch size")
        loss = self._step.train_passes(x, y, loss_fn, n, loss_scale=scaler.scale if scaler is not None else None)
        if loss is None:  # cannot happen: a Pipeline runs every stage, the last one included
            raise RuntimeError("the pipeline's last stage returned no loss")
        count = self._step.count
        self._step.finish_counted(count is not None, 0.0 if count is None else count)
        return loss if count is None else (loss / count).to(loss.dtype)

    def extra_repr(self) -> str:
        devs = ", ".join(str(d) for d in self.devices)
        virtual = f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else ""
        virtual += f", placement={self.placement!r}" if self.placement != "loop" else ""
        return f"devices=[{devs}], balance={self.balance}, chunks={self.chunks}, split_size={self.split_size}, " \
               f"schedule={self.schedule!r}{virtual}, checkpoint={self.checkpoint!r}"
