"""``Pipeline``: an ``nn.Sequential`` cut into stages on several devices, run as a pipeline.

::

    pipe = Pipeline(model, devices=["cuda:0", "cuda:1"], chunks=8, sample=x)

    out = pipe(x)                      # forward pipelined over micro-batches
    loss_fn(out, y).backward()         # backward pipelined too

    loss = pipe.train_step(x, y, loss_fn)   # GPipe / 1F1B forward+backward in one go

The layers stay registered under their original names, so ``state_dict()``
has the keys of the plain model (``"0.weight"``, ...) and a state dict moves
freely between the plain model and any partition. ``parameters()`` come in
the model's order, so an optimizer built on the pipeline steps exactly like
one built on the plain model.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from . import bridge
from .devices import DeviceLike, resolve_devices
from .executor import StageResults, Workers, run_actions
from .microbatch import batch_size, merge, split, split_sizes, tree_map, tree_tensors
from .partition import Partition, check_balance, partition
from .rng import draw_base_seed, is_random
from .schedule import Schedule, ScheduleFn, backward_only, forward_only, get_schedule
from .stage import Grads, Stage, StepSpec
from .trace import Trace
from .transport import Inbox, LocalChannel

__all__ = ["Pipeline", "CHECKPOINT_MODES"]

CHECKPOINT_MODES = ("never", "except_last", "always")


def check_model(model: Any) -> nn.Sequential:
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"pipeddp pipelines an nn.Sequential, got {type(model).__name__}. Wrap the parts of your model in "
            "order, e.g. nn.Sequential(model.features, nn.Flatten(), model.classifier), or use "
            "pipeddp.models.flatten_sequential(model) for torchvision-style models"
        )
    if len(model) == 0:
        raise ValueError("the model is an empty nn.Sequential")
    return model


def check_chunks(chunks: Optional[int], split_size: Optional[int], stages: int) -> Tuple[Optional[int], Optional[int]]:
    """Validate the micro-batch settings; default: 2 micro-batches per stage."""
    if chunks is not None and split_size is not None:
        raise ValueError("give chunks= (number of micro-batches) or split_size= (samples per micro-batch), not both")
    if chunks is None and split_size is None:
        return 2 * stages, None
    if chunks is not None and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(f"chunks must be an int >= 1 (the number of micro-batches), got {chunks!r}")
    if split_size is not None and (not isinstance(split_size, int) or isinstance(split_size, bool) or split_size < 1):
        raise ValueError(f"split_size must be an int >= 1 (samples per micro-batch), got {split_size!r}")
    return chunks, split_size


def profile_chunks(sample: Any, chunks: Optional[int], split_size: Optional[int]) -> int:
    """How many pieces to cut ``sample`` into so that it is profiled at the real micro-batch size."""
    if sample is None or split_size is None:
        return chunks or 1
    return max(1, -(-batch_size(sample, name="sample") // split_size))


def recompute_policy(checkpoint: str, chunks: int) -> Callable[[int], bool]:
    """Which micro-batches drop their activations and recompute them in backward.

    ``except_last`` keeps the last micro-batch: its backward comes right after
    its forward, so recomputing it would buy no memory.
    """
    if checkpoint == "always":
        return lambda i: True
    if checkpoint == "except_last":
        return lambda i: i != chunks - 1
    return lambda i: False


def _device_arg(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether a ``Module.to`` call names a device (as opposed to only a dtype)."""
    if "device" in kwargs or "tensor" in kwargs:
        return True
    for a in args:
        if isinstance(a, (str, torch.device, int, torch.Tensor)):
            return True
    return False


class Pipeline(nn.Module):
    """Run an ``nn.Sequential`` as a pipeline over ``devices`` (one stage each).

    Args:
        model: the model; its children are the layers the partitioner cuts between.
            The layers are moved to their stage's device (the pipeline owns them).
        devices: one device per stage, e.g. ``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``.
        chunks: number of micro-batches per batch (default ``2 * stages``). A batch
            smaller than ``chunks`` gives one micro-batch per sample.
        split_size: samples per micro-batch, instead of ``chunks``.
        balance: ``"time"`` (profile ``sample``), ``"params"``, ``"memory"``,
            ``"uniform"``, or a list of layers per stage. Default: ``"time"`` when
            a ``sample`` is given, else ``"params"``.
        sample: one input batch, used to profile the layers.
        schedule: ``"1f1b"`` (default) or ``"gpipe"`` for ``train_step``, or a
            function ``(stages, chunks) -> per-stage action lists``.
        checkpoint: ``"never"``, ``"except_last"`` or ``"always"``: recompute
            activations in backward instead of keeping them (dropout replays the
            same random numbers).
        threads: intra-op threads per CPU stage (default: the caller's thread
            count divided among the CPU stages, at least 1).
        trace: record a timeline of every action (``pipe.trace``).
        timeout: how long a stage waits for a neighbour before raising.
    """

    def __init__(
        self,
        model: nn.Sequential,
        devices: Sequence[DeviceLike],
        *,
        chunks: Optional[int] = None,
        split_size: Optional[int] = None,
        balance: Union[None, str, Sequence[int]] = None,
        sample: Optional[Any] = None,
        schedule: Union[str, ScheduleFn] = "1f1b",
        checkpoint: str = "never",
        threads: Optional[int] = None,
        trace: bool = False,
        timeout: Union[float, timedelta] = timedelta(minutes=30),
    ) -> None:
        super().__init__()
        model = check_model(model)
        devs = resolve_devices(devices)
        n_stages = len(devs)
        if n_stages > len(model):
            raise ValueError(
                f"{n_stages} devices but the model has only {len(model)} layers; every stage needs at least one "
                f"layer: use at most {len(model)} devices or split the model into more layers"
            )
        self.chunks, self.split_size = check_chunks(chunks, split_size, n_stages)
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
        get_schedule(schedule, n_stages, 1)  # fail now on an unknown schedule, not at the first step
        self.schedule = schedule
        self.checkpoint = checkpoint
        self.timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        self.devices = devs

        if balance is None:
            balance = "time" if sample is not None else "params"
        if isinstance(balance, str):
            self.partition: Partition = partition(model, n_stages, method=balance, sample=sample,
                                                  chunks=profile_chunks(sample, self.chunks, self.split_size),
                                                  device=devs[0])
        else:
            self.partition = partition(model, n_stages, method=check_balance(balance, len(model), n_stages))
        self.balance: List[int] = list(self.partition.balance)

        named = list(model.named_children())
        for name, layer in named:
            self.add_module(name, layer)
        self._stages: List[Stage] = []
        start = 0
        for s, (count, dev) in enumerate(zip(self.balance, devs)):
            part = nn.Sequential(OrderedDict(named[start:start + count]))
            part.to(dev)
            self._stages.append(Stage(s, part, dev, last=s == n_stages - 1))
            start += count

        cpu_stages = sum(1 for d in devs if d.type == "cpu")
        if threads is None and cpu_stages > 0:
            threads = max(1, torch.get_num_threads() // cpu_stages)
        self.threads = threads
        self._inboxes = [Inbox(s) for s in range(n_stages)]
        self._links: List[Tuple[Optional[LocalChannel], Optional[LocalChannel]]] = []
        for s, st in enumerate(self._stages):
            prev = LocalChannel(st.streams, self._stages[s - 1].streams, self._inboxes[s], self._inboxes[s - 1],
                                self.timeout) if s > 0 else None
            nxt = LocalChannel(st.streams, self._stages[s + 1].streams, self._inboxes[s], self._inboxes[s + 1],
                               self.timeout) if s < n_stages - 1 else None
            self._links.append((prev, nxt))
        self._workers = Workers(n_stages, threads=threads)
        self._finalizer = weakref.finalize(self, self._workers.close)
        self.trace: Optional[Trace] = Trace() if trace else None
        #: The process's rank, named in errors (set by HybridParallel; 0 on its own).
        self.rank = 0
        self._schedules: Dict[Tuple[int, int], Schedule] = {}

    # -- structure ---------------------------------------------------------------------------------

    @property
    def stages(self) -> List[Stage]:
        """The stages, in order (each has ``.module``, ``.device``)."""
        return list(self._stages)

    def stage_parameters(self, stage: int) -> Iterator[nn.Parameter]:
        return self._stages[stage].module.parameters()

    def to(self, *args: Any, **kwargs: Any) -> "Pipeline":  # type: ignore[override]
        if _device_arg(args, kwargs):
            raise TypeError(
                "a Pipeline places each stage on its own device; it cannot be moved with .to(device). "
                "Build a new Pipeline with other devices= instead (dtype conversions like .to(torch.float64) work)"
            )
        return super().to(*args, **kwargs)

    def cuda(self, device: Any = None) -> "Pipeline":  # type: ignore[override]
        raise TypeError("a Pipeline places each stage on its own device; build it with devices=[...] instead of .cuda()")

    def cpu(self) -> "Pipeline":  # type: ignore[override]
        raise TypeError("a Pipeline places each stage on its own device; build it with devices=['cpu', ...] instead of .cpu()")

    def close(self) -> None:
        """Stop and join the stage threads. The pipeline cannot run afterwards."""
        self._finalizer()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def worker_threads(self) -> List[Any]:
        return self._workers.threads

    # -- running -----------------------------------------------------------------------------------

    def _sizes(self, n: int) -> List[int]:
        return split_sizes(n, self.chunks, self.split_size)

    def _schedule(self, chunks: int) -> Schedule:
        key = (len(self._stages), chunks)
        if key not in self._schedules:
            self._schedules[key] = get_schedule(self.schedule, *key)
        return self._schedules[key]

    def _seed(self) -> Optional[int]:
        if any(st.module.training and is_random(st.module) for st in self._stages):
            return draw_base_seed()
        return None

    def _to_first(self, x: Any) -> Any:
        dev = self._stages[0].device
        return tree_map(lambda t: t.to(dev, non_blocking=True) if t.device != dev else t, x)

    def _to_last(self, y: Any) -> Any:
        dev = self._stages[-1].device
        return tree_map(lambda t: t.to(dev, non_blocking=True) if t.device != dev else t, y)

    def execute(
        self,
        rows: Schedule,
        spec: StepSpec,
        *,
        inputs: Optional[Sequence[Any]] = None,
        output_grads: Optional[Sequence[Optional[Grads]]] = None,
        grad_event: Any = None,
    ) -> List[StageResults]:
        """Run one action list per stage on the stage threads and return each stage's results."""
        for inbox in self._inboxes:
            inbox.reset()
        for st in self._stages:
            st.streams.enter()
        if grad_event is not None and self._stages[-1].streams.cuda:
            self._stages[-1].streams.compute.wait_event(grad_event)
        fns = []
        last = len(self._stages) - 1
        for s, st in enumerate(self._stages):
            prev, nxt = self._links[s]
            fns.append(functools.partial(
                run_actions, st, rows[s], spec, prev=prev, next=nxt,
                inputs=inputs if s == 0 else None,
                output_grads=output_grads if s == last else None,
                trace=self.trace, rank=self.rank,
            ))

        def abort(exc: BaseException) -> None:
            for inbox in self._inboxes:
                inbox.abort(exc)

        try:
            return self._workers.run(fns, abort)
        finally:
            for st in self._stages:
                st.streams.leave()

    def forward(self, x: Any) -> Any:  # type: ignore[override]
        """Run ``x`` through the pipeline; the output lives on the last device.

        With autograd on, the result is connected to the graph: ``backward`` on
        anything computed from it runs every stage's backward, pipelined, and
        accumulates into ``.grad``.
        """
        x = self._to_first(x)
        sizes = self._sizes(batch_size(x, name="input"))
        mbs = split(x, sizes)
        m = len(sizes)
        need_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters()) or any(t.requires_grad for t in tree_tensors(x))
        )
        spec = StepSpec(grad=need_grad, recompute=recompute_policy(self.checkpoint, m), seed=self._seed())
        results = self.execute(forward_only(len(self._stages), m), spec, inputs=mbs)
        outputs = [results[-1].outputs[i] for i in range(m)]
        if not need_grad:
            return merge(outputs)

        def run_backward(grads: List[Optional[Grads]], event: Any) -> List[Grads]:
            res = self.execute(backward_only(len(self._stages), m), spec, output_grads=grads, grad_event=event)
            return [res[0].input_grads[i] for i in range(m)]

        return bridge.attach(run_backward, sizes, outputs, x)

    def train_step(self, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *, sync: bool = False) -> torch.Tensor:
        """Forward and backward of one batch under the schedule; returns the detached mean loss.

        ``loss_fn(output, target)`` must return the *mean* loss of its
        micro-batch. Each micro-batch's loss is weighted by its share of the
        batch, so the accumulated ``.grad`` equals that of
        ``loss_fn(model(x), y).backward()`` on one device, uneven micro-batches
        included. Gradients accumulate into ``.grad`` (zero them as usual).
        """
        n = batch_size(x, name="x")
        ny = batch_size(y, name="y")
        if n != ny:
            raise ValueError(f"x has {n} samples but y has {ny}; inputs and targets must have the same batch size")
        sizes = self._sizes(n)
        xs = split(self._to_first(x), sizes)
        ys = split(self._to_last(y), sizes)
        m = len(sizes)
        spec = StepSpec(
            grad=True, recompute=recompute_policy(self.checkpoint, m), seed=self._seed(),
            loss_fn=loss_fn, targets=ys, weights=[k / n for k in sizes], sync=sync,
        )
        results = self.execute(self._schedule(m), spec, inputs=xs)
        losses = results[-1].losses
        return torch.stack([losses[i] for i in range(m)]).sum()

    def extra_repr(self) -> str:
        devs = ", ".join(str(d) for d in self.devices)
        return f"devices=[{devs}], balance={self.balance}, chunks={self.chunks}, split_size={self.split_size}, " \
               f"schedule={self.schedule!r}, checkpoint={self.checkpoint!r}"
