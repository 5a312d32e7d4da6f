"""One contiguous slice of the model on one device.

The stage is the only place that calls the layers. For every micro-batch it
keeps what its backward will need and nothing more::

    forward(i):   input -> [leaf: requires_grad] -> layers -> output (detached for the next stage)
                  keeps (input leaves, output)          (checkpoint: input only)
    backward(i):  (recompute output) -> autograd.backward(output, grad)       B: whole backward
                  returns input.grad, frees micro-batch i
    or, split:    I(i): (recompute) -> input grads only, returned          zero-bubble schedules
                  W(i): weight grads into .grad, frees micro-batch i       (see ``split``)

Cutting the autograd graph at every stage boundary (the output sent detached, its receiver's own leaf) is what
lets each stage run its own backward on its own thread: autograd's CPU
backward is single-threaded, so one ``loss.backward()`` across all stages
would run every stage's backward one after another.

Gradients are summed over micro-batches by autograd itself (``.grad``
accumulates); the last stage multiplies each micro-batch's loss by its share
of the batch (``n_i / N``) before backward, so the sum *is* the mean-loss
gradient, uneven micro-batches included, and nothing is rescaled afterwards.

What a step asks of the stage and what it keeps per micro-batch are in
``spec``; the layers run as they are or through ``compiled``.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
from torch import nn

from .autograd_call import backward as run_backward
from .batchnorm import batch_norms, frozen_statistics
from .compiled import Compiled
from .gradsync import NO_SYNC, GradSync
from .microbatch import tree_map, tree_tensors
from .quiet import loss_draws_nothing, read, run_layers
from .rng import Replay, checkpointing, recomputing
from .spec import Grads, Saved, StepSpec
from .split import backward_input
from .streams import StageStreams

# StepSpec and Grads are handed on: callers that drive a stage name them with it
__all__ = ["Stage", "StepSpec", "Grads"]

#: A backward root and the gradient it starts from (None: a loss, or no gradient given).
Pair = Tuple[torch.Tensor, Optional[torch.Tensor]]

_NOTHING = contextlib.nullcontext()  # reusable no-op context: entered on every action where nothing is needed


_clone = torch.Tensor.clone


def _clone_writable(t: torch.Tensor) -> torch.Tensor:
    return t if t.requires_grad else t.clone()


_detach = torch.Tensor.detach


def _may_write_its_input(module: nn.Module) -> bool:
    """Whether ``module`` may write into the stage's input in place: it holds a layer with ``inplace=True``.

    The plain model hands such a layer the output of the layer before it; a stage hands its first layers the
    received input, a leaf that requires grad (autograd refuses an in-place op on it) and that recompute needs
    unchanged. The in-place layer need not come first: ``Flatten`` of an already flat tensor or ``Identity`` pass
    the very tensor on. So a stage with any in-place layer gives its layers a copy of each micro-batch's input.
    """
    return any(getattr(m, "inplace", False) for m in module.modules())


def _scalar(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise ValueError(f"loss_fn must return {what}, got "
                         f"{type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
    return value


def _writes(spec: StepSpec, index: int) -> bool:
    """Whether a layer of stage ``index`` may write its input in place this step (``quiet``; unknown: it may)."""
    return spec.writing is None or index in spec.writing


def _first_leaf(t: torch.Tensor) -> torch.Tensor:
    """Stage 0's input as it is; a leaf of its own where it requires grad (``pipe(x)`` with ``x`` that does)."""
    return t.detach().requires_grad_(True) if t.requires_grad else t


def _first_leaf_copied(t: torch.Tensor) -> torch.Tensor:
    """Stage 0's input, copied where it wants no gradient (see ``Stage._leaves``)."""
    return t.detach().requires_grad_(True) if t.requires_grad else t.clone()


def _received_leaf(t: torch.Tensor) -> torch.Tensor:
    """A received activation as a leaf whose ``.grad`` is the gradient to send back. What a channel hands over is
    the stage's own (a fresh detached tensor, or a receive buffer): marked as it is, without another detach."""
    if not t.is_floating_point() and not t.is_complex():
        return t
    return t.requires_grad_(True) if not t.requires_grad else t.detach().requires_grad_(True)


def _pairs(index: int, roots: Any, grads: Optional[Grads]) -> List[Pair]:
    """(root tensor, its gradient) for every root that stage ``index``'s backward must start from."""
    if grads is None and type(roots) is torch.Tensor:  # a loss, or one output: no tree to walk
        return [(roots, None)] if roots.requires_grad else []
    tensors = tree_tensors(roots)
    if grads is None:
        return [(t, None) for t in tensors if t.requires_grad]
    if len(grads) != len(tensors):
        raise RuntimeError(f"stage {index}: got {len(grads)} output gradients for {len(tensors)} outputs")
    return [(t, g) for t, g in zip(tensors, grads) if t.requires_grad and g is not None]


def _input_grads(saved: Saved) -> Grads:
    """The gradients of a micro-batch's input leaves, to send back (None where a leaf has none)."""
    inputs = saved.inputs
    if type(inputs) is torch.Tensor:  # one input: no tree to walk
        return [inputs.grad if inputs.requires_grad else None]
    return [t.grad if t.requires_grad else None for t in tree_tensors(inputs)]


class Stage:
    """A slice of the model (``module``, an ``nn.Sequential``) placed on ``device``."""

    def __init__(self, index: int, module: nn.Sequential, device: torch.device, *, last: bool,
                 compile: Optional[Dict[str, Any]] = None) -> None:
        self.index = index
        self.module = module
        #: what runs the layers: the module itself, or ``Compiled`` (one ``torch.compile`` per mode, compiled
        #: lazily on the first call in that mode; it shares the module's parameters)
        self.call: Callable[[Any], Any] = module if compile is None else Compiled(module, compile, index)
        self.device = device
        self.last = last
        self.streams = StageStreams(device)
        self.clone_input = _may_write_its_input(module)
        self.replay = Replay(device, own_cpu=compile is None)  # a dispatch mode cannot reach compiled ops
        self.batch_norms = batch_norms(module)
        #: how gradients meet the other replicas' at the stage's last weight action (DDP, FSDP2; ``gradsync``)
        self.grad_sync: GradSync = NO_SYNC

    # -- helpers -----------------------------------------------------------------------------------

    def _mode(self) -> Tuple[bool, ...]:
        """The training flags of the stage's layers (``train()``/``eval()`` on the owner reach the layers,
        not the stage's own container)."""
        return tuple(layer.training for layer in self.module)

    def read_step(self, loss_fn: Optional[Callable[..., Any]] = None) -> Tuple[bool, Callable[[Any], Any], bool]:
        """What the layers need this step, read once at its start (``quiet``): whether the forward (and, on the last
        stage, ``loss_fn``) may draw random numbers (not where only torch's layers that never draw make it; else an
        eager stage always may, a compiled one unless its first forward in this mode drew nothing: ``rng``), what
        runs the layers (their ``forward`` calls in a row where no hook needs ``Module.__call__``), and whether a
        layer may write its input in place (``_leaves``)."""
        quiet, calls, writes = read(self.module)
        call = self.call if calls is None or self.call is not self.module else partial(run_layers, calls)
        if quiet and (not self.last or loss_draws_nothing(loss_fn)):
            return False, call, writes
        return self.replay.own_cpu or self.replay.may_draw(self._mode()), call, writes

    def _step_mode(self, spec: StepSpec) -> Tuple[bool, ...]:
        """The training flags for this step, read at its first action (a step's layers keep one mode throughout;
        read per action it walked the layers every time, and a backward replays the mode its forward ran in)."""
        mode = spec.modes.get(self.index)
        if mode is None:
            mode = spec.modes[self.index] = self._mode()
        return mode

    def _seeded(self, spec: StepSpec, mb: int) -> ContextManager[None]:
        if spec.seed is None or (spec.drawing is not None and self.index not in spec.drawing):
            return _NOTHING  # no stage of this step draws, or not this one: nothing to seed (no per-action cost)
        mode = self._step_mode(spec)
        if not self.replay.may_draw(mode):
            return _NOTHING
        return self.replay.seeded(spec.seed + 1_000_003 * self.index + mb, mode)

    def _layers(self, spec: StepSpec) -> Callable[[Any], Any]:
        """What runs the layers this step (``read_step``; read here, once, where the step's maker did not)."""
        call = spec.calls.get(self.index)
        if call is None:
            call = spec.calls[self.index] = self.read_step()[1]
        return call

    def _leaves(self, value: Any, spec: StepSpec) -> Any:
        """A micro-batch's input as the stage's layers take it and its backward finds it (``_first_leaf``,
        ``_received_leaf``). Stage 0 copies the user's tensors where a layer may write them in place (where
        ``clone_input``, ``_run`` copies them anyway): the micro-batches are views of one batch and share its version
        counter, so an in-place op on one (``mask.add_(1)``) would invalidate what another saved (a replay, which
        runs on the kept input itself, included)."""
        if self.index == 0:
            copy = not self.clone_input and _writes(spec, self.index)
            leaf = _first_leaf_copied if copy else _first_leaf
        else:
            leaf = _received_leaf
        return leaf(value) if type(value) is torch.Tensor else tree_map(leaf, value)

    def _run(self, value: Any, spec: StepSpec, keep: bool = False) -> Any:
        """The layers on ``value``: on a copy of it where a layer may write its input in place; with ``keep``
        (a forward that recompute will replay from ``value``), where a layer may write it (``_writes``), on a copy of
        every tensor the layers could change (one that requires grad is a leaf, which autograd refuses to write in
        place). One copy at most."""
        if self.clone_input:
            value = tree_map(_clone, value)
        elif keep and _writes(spec, self.index):
            value = tree_map(_clone_writable, value)
        return self._layers(spec)(value)

    def _root(self, loss: torch.Tensor, spec: StepSpec) -> torch.Tensor:
        """What backward starts from: the weighted loss, scaled for mixed precision when asked."""
        return spec.loss_scale(loss) if spec.loss_scale is not None else loss

    def _loss(self, out: Any, saved: Saved, spec: StepSpec, mb: int) -> torch.Tensor:
        """The micro-batch's loss as backward takes it: a mean weighted by the micro-batch's share of the batch,
        or, where ``loss_fn`` returns ``(total, count)``, the total as it is (the step divides by the count of the
        whole batch once every micro-batch has counted: ``spec.counts``)."""
        if spec.loss_fn is None:
            raise RuntimeError(f"stage {self.index} was asked for a loss without a loss_fn")
        loss = spec.loss_fn(out, saved.target)
        if isinstance(loss, tuple) and len(loss) == 2:
            total, count = loss
            spec.count(mb, count)
            return _scalar(total, "the total of (total, count) as a scalar tensor")
        spec.count(mb, None)
        return _scalar(loss, "a scalar tensor (the mean loss of the micro-batch) or (total, count)") * saved.weight

    # -- forward ----------------------------------------------------------------------------------------

    def forward(self, mb: int, value: Any, spec: StepSpec) -> Tuple[Any, Optional[torch.Tensor]]:
        """Run micro-batch ``mb``; return (output detached for sending, weighted loss or None). A last stage that
        made a loss sends nothing (None); its loss is the one backward starts from where it is kept until then (read
        its value, never backward it), else detached."""
        seeded = self._seeded(spec, mb)
        if seeded is _NOTHING and not (self.streams.cuda or spec.autocast.regions):
            return self._forward(mb, value, spec)  # the rule on a CPU stage: no context entered per forward
        with self.streams.computing(), spec.autocast(), seeded:  # a stream to make current, autocast, the draws
            return self._forward(mb, value, spec)

    def _forward(self, mb: int, value: Any, spec: StepSpec) -> Tuple[Any, Optional[torch.Tensor]]:
        target = spec.targets[mb] if spec.targets is not None else None
        weight = spec.weights[mb] if spec.weights is not None else 1.0
        wants_loss = self.last and spec.loss_fn is not None
        if not spec.grad:
            with torch.no_grad():
                out = self._run(value, spec)
                loss = self._loss(out, Saved(value, None, target, weight), spec, mb) if wants_loss else None
            return out, loss

        inputs = self._leaves(value, spec)
        saved = Saved(inputs, None, target, weight)
        if spec.recompute(mb):
            # on copies: an in-place op must not change what the replay will see; with grad, as the replay
            # runs (a kernel may take another path without: an LSTM's oneDNN inference kernel differs by 3e-8)
            with torch.enable_grad(), checkpointing(), self.replay.host.first(mb):
                out = self._run(inputs, spec, keep=True)
                loss = self._loss(out, saved, spec, mb) if wants_loss else None
        else:
            if torch.is_grad_enabled():
                out = self._run(inputs, spec)
                loss = self._loss(out, saved, spec, mb) if wants_loss else None
            else:  # a training step called under no_grad: the graph backward needs is built all the same
                with torch.enable_grad():
                    out = self._run(inputs, spec)
                    loss = self._loss(out, saved, spec, mb) if wants_loss else None
            saved.roots = self._root(loss, spec) if loss is not None else out
        spec.store(self.index)[mb] = saved
        if loss is not None:  # nothing to send; the loss as it is where backward keeps it anyway (read at the end)
            return None, loss if saved.roots is not None else loss.detach()
        return (out.detach() if type(out) is torch.Tensor else tree_map(_detach, out)), None

    # -- backward: whole (B), or input half (I) then weight half (W) ----------------------------------

    def _take(self, spec: StepSpec, mb: int, *, keep: bool) -> Saved:
        """What forward kept for micro-batch ``mb`` (removed from the step unless ``keep``)."""
        store = spec.store(self.index)
        if mb not in store:
            raise RuntimeError(
                f"stage {self.index} has no saved forward for micro-batch {mb}: its backward ran twice, or "
                "without its forward (call backward once per forward; a W needs its I)"
            )
        return store[mb] if keep else store.pop(mb)

    def _roots(self, saved: Saved, spec: StepSpec, mb: int) -> Any:
        """What backward starts from; recomputed here, once, where forward dropped the activations.

        The replay runs from the micro-batch's own seed (the same random numbers
        as the first forward), marked as a recompute, without a second update
        of BatchNorm statistics, under the caller's autocast. Its result is kept
        on ``saved`` so a split backward's I and W share one replay.
        """
        if saved.roots is None:
            with self._seeded(spec, mb), self.replay.host.again(mb), recomputing(), \
                    frozen_statistics(self.batch_norms), spec.autocast(), torch.enable_grad():
                out = self._run(saved.inputs, spec)
                saved.roots = self._root(self._loss(out, saved, spec, mb), spec) \
                    if (self.last and spec.loss_fn is not None) else out
        return saved.roots

    def _arm(self, pairs: List[Pair]) -> List[Pair]:
        """Pass the roots through the gradient sync's ``arm`` (see ``gradsync``)."""
        if self.grad_sync is NO_SYNC:
            return pairs
        synced = self.grad_sync.arm([t for t, _ in pairs])
        return [(t, g) for t, (_, g) in zip(synced, pairs)]

    def backward(self, mb: int, grads: Optional[Grads], spec: StepSpec, *, sync: bool = False) -> Grads:
        """The whole backward (B) of micro-batch ``mb`` given the gradients of its outputs.

        ``grads`` is aligned with the output's tensor leaves (None where an output
        got no gradient); the last stage in a loss step passes None and starts from
        its loss. ``sync`` marks the stage's last backward of the step, the one
        that must carry the data-parallel gradient reduction. Returns the
        gradients of the input leaves (None where there is none).
        """
        saved = self._take(spec, mb, keep=False)
        if self.streams.cuda or not self.replay.holds_nothing():
            with self.streams.computing(), self.replay.backward_guard(self._step_mode(spec)):
                self._whole(saved, grads, spec, mb, sync)
        else:
            self._whole(saved, grads, spec, mb, sync)  # the rule on a CPU stage: no context entered per backward
        return _input_grads(saved)

    def _whole(self, saved: Saved, grads: Optional[Grads], spec: StepSpec, mb: int, sync: bool) -> None:
        roots = self._roots(saved, spec, mb)
        if not sync and type(roots) is torch.Tensor and (grads is None or (len(grads) == 1 and grads[0] is not None)):
            if roots.requires_grad:  # one root (a loss, or one output): no pairs to make
                run_backward([roots], grads)
            return
        pairs = _pairs(self.index, roots, grads)
        if sync:
            pairs = self._arm(pairs)
        if pairs:
            run_backward([t for t, _ in pairs], [g for _, g in pairs] if grads is not None else None)
        if sync:
            self.grad_sync.finish()

    def backward_input(self, mb: int, grads: Optional[Grads], spec: StepSpec) -> Grads:
        """The input-gradient half (I): the gradients to send to the previous stage, and nothing into ``.grad``.

        What the weight half needs stays with the micro-batch until its
        ``backward_weight`` (see ``split``); the activations stay held until then.
        """
        saved = self._take(spec, mb, keep=True)
        if saved.weight_grads is not None:
            raise RuntimeError(f"stage {self.index}: the input-gradient backward of micro-batch {mb} ran twice")
        with self.streams.computing(), self.replay.backward_guard(self._step_mode(spec)):
            pairs = _pairs(self.index, self._roots(saved, spec, mb), grads)
            got, saved.weight_grads = backward_input(pairs, tree_tensors(saved.inputs), list(self.module.parameters()),
                                                     loss=grads is None)
        return got

    def backward_weight(self, mb: int, spec: StepSpec, *, sync: bool = False) -> None:
        """The weight-gradient half (W) of micro-batch ``mb``, after its I: accumulates into ``.grad``.

        ``sync`` marks the stage's last W of the step: the data-parallel
        reduction is armed here, so it fires once every micro-batch's weight
        gradient is in.
        """
        saved = self._take(spec, mb, keep=True)
        if saved.weight_grads is None:
            raise RuntimeError(f"stage {self.index}: the weight-gradient backward of micro-batch {mb} ran before its "
                               "input-gradient backward (a W needs its I)")
        del spec.store(self.index)[mb]
        with self.streams.computing(), self.replay.backward_guard(self._step_mode(spec)):
            if sync and saved.roots is not None:
                self._arm([(t, None) for t in tree_tensors(saved.roots) if t.requires_grad])
            saved.weight_grads.run()
            if sync:
                self.grad_sync.finish()
        saved.weight_grads = None
