"""One step, built once: what both runners run, whether stages are threads or processes.

A step is the same recipe wherever the stages live::

    batch --split--> micro-batches --\
    seed (one draw, in the caller) ---+--> StepSpec --> schedule rows --> runner.run(...)
    targets, weights n_i / N --------/                                     |
                                                                           v
                                    losses / outputs of the last stage, input grads of the first

``Step`` holds the stages this process runs (all of them, or the one it owns),
the total number of stages, the micro-batch settings and a *runner*:

* ``ThreadRunner`` (``executor``): every stage of one process, on threads;
* ``ProcessRunner`` (``pipeddp.distributed.stage_runner``): the one stage
  this process owns, its neighbours in other processes.

Splitting, seeding, the recompute policy, choosing the schedule, reading
the results and accumulating several passes into one optimizer step
(``train_passes``) are written here and nowhere else, so ``Pipeline`` and both modes
of ``HybridParallel`` train, evaluate and recompute with the same code.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import torch

from . import _bridge
from .amp import Autocast
from .batchnorm import DeferredStatistics
from .counted import Baseline, Count, parameters_of, per_count, summed
from .executor import StageResults
from .microbatch import Pieces, merge, split, split_sizes, tree_map
from .rng import draw_base_seed
from .schedule.actions import Action, Schedule, ScheduleFn, row_of
from .schedule.builders import backward_only, forward_only
from .schedule.registry import get_schedule
from .spec import Grads, StepSpec
from .split import watch_hooks
from .stage import Stage
from .stats import Recorder
from .tied import LocalTies, Tie
from .trace import Trace

__all__ = ["Runner", "Step", "recompute_policy"]

LossFn = Callable[[Any, Any], torch.Tensor]


class Runner(Protocol):
    """Runs one action list per local device (schedule row) of a step and returns each device's results."""

    def run(self, rows: Sequence[Sequence[Action]], spec: StepSpec, *, plan: Optional[Schedule] = None,
            inputs: Optional[Sequence[Any]] = None, output_grads: Optional[Sequence[Optional[Grads]]] = None,
            grad_event: Any = None, trace: Optional[Trace] = None) -> List[StageResults]: ...

    def close(self) -> None: ...


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


class Step:
    """Train or evaluate one batch on ``stages`` (this process's share of ``n_stages``) with ``runner``.

    The pipeline has ``n_stages // virtual_stages`` devices (schedule rows);
    stage s runs on device ``row_of(s, rows, placement)``. ``sync`` makes each stage's last
    weight-gradient action of a training step (its last B or W) carry the
    data-parallel gradient all-reduce (set when there are several replicas).
    """

    def __init__(self, stages: Sequence[Stage], n_stages: int, runner: Runner, *, chunks: Optional[int],
                 split_size: Optional[int], schedule: Union[str, ScheduleFn], checkpoint: str,
                 ties: Sequence[Tie] = (), deferred_batch_norm: bool = False, virtual_stages: int = 1,
                 placement: str = "loop") -> None:
        watch_hooks()  # a split backward (zb, auto) must see which activations carry hooks
        self.stages = sorted(stages, key=lambda st: st.index)
        self.n_stages = n_stages
        self.virtual_stages = virtual_stages
        self.rows = n_stages // virtual_stages
        self.placement = placement
        #: the schedule rows this process runs (its devices), in the runner's order
        self.local_rows = sorted({row_of(st.index, self.rows, placement) for st in self.stages})
        self.runner = runner
        self.chunks = chunks
        self.split_size = split_size
        self.schedule = schedule
        self.checkpoint = checkpoint
        self.sync = False
        self.trace: Optional[Trace] = None
        #: Weights several local stages use: copies refreshed before the forwards, gradients summed after.
        self.ties = LocalTies(ties, self.stages)
        #: BatchNorm updates held back over the micro-batches and applied once per batch.
        self.deferred = [DeferredStatistics(st.module) for st in self.stages] if deferred_batch_norm else []
        #: Called before a step's forwards, after them, and after its backwards (a distributed
        #: engine adds its own, e.g. the exchange of tied weights between processes).
        #: (A process with no tie among its stages keeps none of the ties' hooks: each is a call under no_grad per
        #: step that would find nothing to do.)
        self._tied = bool(self.ties.entries)
        self.before_forward: List[Callable[[], None]] = ([self.ties.refresh] if self._tied else []) + \
            [d.reset for d in self.deferred]
        self.after_forward: List[Callable[[], None]] = [d.commit for d in self.deferred]
        self.after_backward: List[Callable[[], None]] = [self.ties.fold] if self._tied else []
        #: called when a training step is over: after the engine's agreement at its end (``finish_counted``), or
        #: after the backwards of a forward's output (``refine`` times whole steps by it)
        self.after_step: List[Callable[[], None]] = []
        #: when the current (or last) training step began: its first pass, or a forward that backward will follow
        #: (what ``refine`` times the candidate orders by, nothing the caller runs between steps included)
        self.started = 0.0
        self._plans: Dict[Tuple[str, int], Tuple[List[Tuple[Action, ...]], Schedule]] = {}
        #: a call's micro-batch sizes, loss weights and recompute policy, built once per batch size (``_layout``)
        self._layouts: Dict[Tuple[Any, ...], Layout] = {}
        #: the stages that take the inputs and see the targets, and which result is the last stage's: the stages
        #: are fixed when the step is built, so these are read once
        self._first: Optional[Stage] = self.stages[0] if self.stages[0].index == 0 else None
        self._last: Optional[Stage] = self.stages[-1] if self.stages[-1].last else None
        self._last_result = self.local_rows.index(row_of(n_stages - 1, self.rows, placement)) \
            if self._last is not None else -1
        #: whether the last training step's loss_fn returned (total, count) (None: no step yet), and that step's
        #: count and the gradients it started from (see ``counted``)
        self.counting: Optional[bool] = None
        self.count: Optional[Count] = None
        self.baseline: Optional[Baseline] = None
        #: the training steps' figures (``stats.last``: the last one's)
        self.stats = Recorder(self.stages, self.rows, placement)

    @property
    def first(self) -> Optional[Stage]:
        """Stage 0 when this process runs it (it takes the inputs), else None."""
        return self._first

    @property
    def last(self) -> Optional[Stage]:
        """The last stage when this process runs it (it sees outputs and targets), else None."""
        return self._last

    def _of_last(self, results: Sequence[StageResults]) -> StageResults:
        """What the device of the last stage returned (the runner returns one result per local row, in order)."""
        return results[self._last_result]

    def sizes(self, n: int) -> List[int]:
        """Micro-batch sizes for a batch of ``n`` (uneven where ``n`` does not divide)."""
        return split_sizes(n, self.chunks, self.split_size)

    def _plan(self, kind: str, m: int) -> Tuple[List[Tuple[Action, ...]], Schedule]:
        """This process's rows of the ``kind`` step over ``m`` micro-batches, and the whole schedule they come from
        (a runner between processes orders its messages by it); built once per (kind, m)."""
        key = (kind, m)
        if key not in self._plans:
            if kind == "train":
                plan: Schedule = get_schedule(self.schedule, self.rows, m, self.virtual_stages,
                                              placement=self.placement)
            else:
                plan = (forward_only if kind == "forward" else backward_only)(self.rows, m, self.virtual_stages,
                                                                              placement=self.placement)
            self._plans[key] = ([tuple(plan[r]) for r in self.local_rows], plan)  # tuples: read once (executor)
        return self._plans[key]

    def reschedule(self) -> None:
        """Forget the rows built so far: the schedule function has new costs (``schedule="auto"``)."""
        self._plans.clear()

    def _read(self, loss_fn: Optional[LossFn] = None) -> Dict[str, Any]:
        """One base seed per step, drawn in the caller's thread (so ``torch.manual_seed`` rules it), where any stage
        may draw; which stages may, what runs each stage's layers and which may write their input
        (``Stage.read_step``, once a step): the step's ``StepSpec`` fields."""
        drawing, writing = set(), set()
        calls: Dict[int, Any] = {}
        for st in self.stages:
            draws, calls[st.index], writes = st.read_step(loss_fn)
            if draws:
                drawing.add(st.index)
            if writes:
                writing.add(st.index)
        return {"seed": draw_base_seed() if drawing else None, "drawing": frozenset(drawing), "calls": calls,
                "writing": frozenset(writing)}

    def _split_to(self, stage: Optional[Stage], value: Any, sizes: List[int]) -> Optional[List[Any]]:
        moved = _to(stage, value)
        return None if moved is None else split(moved, sizes)

    def train(self, x: Any, y: Any, loss_fn: LossFn, n: int, *,
              loss_scale: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, share: float = 1.0,
              first: bool = True, final: bool = True) -> Optional[torch.Tensor]:
        """Forward and backward of a batch of ``n`` under the schedule; gradients accumulate into ``.grad``.

        Each micro-batch's mean loss is weighted by its share of the batch, so
        the gradients are those of the whole batch's mean loss. Returns that
        loss (detached) where this process runs the last stage, else None.
        The caller's autocast state reaches every stage; ``loss_scale`` (a
        GradScaler's ``scale``) scales what backward starts from, not the loss returned.

        Gradient accumulation over several calls (one optimizer step): each
        call's loss weighs ``share`` of the step, and only the ``final`` call
        reduces gradients across replicas and sums the tied copies' gains since
        the ``first`` call (one collective per step, not per pass). A user's own
        accumulation (calls with first and final both set) is exact too: each
        fold sums only what its own calls added.
        """
        sizes, weights, recompute = _layout(self._layouts, n, share, self.chunks, self.split_size,
                                            self.checkpoint)
        m = len(sizes)
        last = self._last
        spec = StepSpec(grad=True, recompute=recompute, **self._read(loss_fn if last is not None else None),
                        loss_fn=loss_fn if last is not None else None, targets=_pieces(last, y, sizes),
                        weights=weights, sync=self.sync and final, autocast=Autocast.capture(), loss_scale=loss_scale)
        if first:
            self.started = time.perf_counter()
            if self._tied:
                self.ties.begin()
        _call(self.before_forward)
        rows, plan = self._plan("train", m)
        results = self.runner.run(rows, spec, plan=plan, inputs=self._split_to(self._first, x, sizes),
                                  trace=self.stats.timeline(self.trace))
        _call(self.after_forward)
        if final:
            _call(self.after_backward)
        if spec.counted:
            part = summed(spec.counts.values())  # on the loss's device where it counted there: no sync
            self.count = part if self.count is None else self.count + part
        if last is None:
            return None
        return self._of_last(results).total

    def train_passes(self, x: Any, y: Any, loss_fn: LossFn, n: int, passes: int = 1, *,
                     loss_scale: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Optional[torch.Tensor]:
        """One optimizer step's gradients from a batch of ``n`` run as ``passes`` equal passes (accumulation).

        A pass is a ``train`` of ``n / passes`` samples weighing ``1 / passes``
        of the step; only the last one reduces across replicas. The passes'
        losses are summed, so the result is the whole batch's mean loss, as
        one pass of ``n`` would give (where this process runs the last stage).
        """
        self.baseline = Baseline(parameters_of([st.module for st in self.stages]), self.counting, unique=True)
        self.count = None
        self.stats.begin(n)
        if passes == 1:
            return self.train(x, y, loss_fn, n, loss_scale=loss_scale)
        if passes < 1 or n % passes:
            raise ValueError(f"a batch of {n} does not divide into {passes} equal accumulation passes")
        sizes = [n // passes] * passes
        xs = split(x, sizes) if x is not None else [None] * passes
        ys = split(y, sizes) if y is not None else [None] * passes
        total: Optional[torch.Tensor] = None
        for i, (xi, yi) in enumerate(zip(xs, ys)):
            loss = self.train(xi, yi, loss_fn, sizes[i], loss_scale=loss_scale, share=1.0 / passes, first=i == 0,
                              final=i == passes - 1)
            if loss is not None:
                total = loss if total is None else total + loss
        return total

    def finish_counted(self, counted: bool, count: Count, replicas: int = 1) -> None:
        """End a training step: where its loss_fn returned ``(total, count)`` (in any process: ``counted``), divide
        what the step added to the gradients by ``count``, the count of the whole batch over every replica (data
        parallelism already divided by ``replicas``). See ``counted``."""
        self.counting = counted
        if counted and self.baseline is not None:
            self.baseline.scale(per_count(replicas, count))
        self.baseline = None
        self.stats.end(count if counted else None)
        _call(self.after_step)

    def forward(self, x: Any, n: int, *, need_grad: bool) -> Any:
        """Forward of a batch of ``n``; the merged output where this process runs the last stage, else None.

        With ``need_grad`` (only where this process runs every stage) the output
        is wired into autograd: a ``backward`` through it runs every stage's
        backward on the runner, pipelined, and returns the input's gradient.
        """
        sizes, _, recompute = _layout(self._layouts, n, 1.0, self.chunks, self.split_size, self.checkpoint)
        m = len(sizes)
        if need_grad and (self.first is None or self.last is None):
            raise RuntimeError("an output that carries autograd back through the pipeline needs every stage in "
                               "this process; train with train_step(x, y, loss_fn), or evaluate under torch.no_grad()")
        spec = StepSpec(grad=need_grad, recompute=recompute, **self._read(), autocast=Autocast.capture())
        if need_grad:
            self.started = time.perf_counter()
            self.stats.begin(n)
        x = _to(self.first, x)  # the graph hangs on the moved input, whose grad lives on stage 0's device
        xs = None if x is None else split(x, sizes)
        _call(self.before_forward)
        rows, plan = self._plan("forward", m)
        results = self.runner.run(rows, spec, plan=plan, inputs=xs,  # an evaluation is no step: not timed
                                  trace=self.stats.timeline(self.trace) if need_grad else self.trace)
        _call(self.after_forward)
        if self.last is None:
            return None
        outputs = [self._of_last(results).outputs[i] for i in range(m)]
        if not need_grad:
            return merge(outputs)
        spec.sync = self.sync

        def run_backward(grads: List[Optional[Grads]], event: Any) -> List[Grads]:
            if self._tied:
                self.ties.begin()  # here, not at the forward: the user may zero_grad in between
            rows, plan = self._plan("backward", m)
            res = self.runner.run(rows, spec, plan=plan, output_grads=grads, grad_event=event,
                                  trace=self.stats.timeline(self.trace))
            _call(self.after_backward)
            self.stats.end(None)
            _call(self.after_step)
            return [res[0].input_grads[i] for i in range(m)]

        return _bridge.attach(run_backward, sizes, outputs, x)


Layout = Tuple[List[int], List[float], Callable[[int], bool]]


def _layout(layouts: Dict[Tuple[Any, ...], Layout], n: int, share: float, chunks: Optional[int],
            split_size: Optional[int], checkpoint: str) -> Layout:
    """A call's micro-batch sizes for a batch of ``n``, each one's loss weight (its share of the batch, times the
    call's ``share`` of the step; a forward reads none) and which of them recompute: the same every step of the same
    batch size, so built once into ``layouts`` (keyed by the settings too: whoever changes them gets the new
    layout)."""
    key = (n, share, chunks, split_size, checkpoint)
    got = layouts.get(key)
    if got is None:
        sizes = split_sizes(n, chunks, split_size)
        if len(layouts) >= 64:  # batch sizes no longer seen: forgotten
            layouts.clear()
        got = layouts[key] = (sizes, [k / n * share for k in sizes], recompute_policy(checkpoint, len(sizes)))
    return got


def _call(hooks: List[Callable[[], None]]) -> None:
    for hook in hooks:
        hook()


def _pieces(stage: Optional[Stage], value: Any, sizes: List[int]) -> Optional[Pieces]:
    """``value`` on ``stage``'s device, cut into micro-batches where its first piece is read (None where this process
    does not run that stage)."""
    moved = _to(stage, value)
    return None if moved is None else Pieces(moved, sizes)


def _to(stage: Optional[Stage], value: Any) -> Any:
    """``value`` on ``stage``'s device (None where this process does not run that stage)."""
    if stage is None:
        return None
    dev = stage.device
    if type(value) is torch.Tensor and value.device == dev:  # the rule: one tensor, already there
        return value
    return tree_map(lambda t: t.to(dev, non_blocking=True) if t.device != dev else t, value)
