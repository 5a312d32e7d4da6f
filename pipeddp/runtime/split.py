"""Split one backward into its input-gradient half (I) and its weight-gradient half (W).

Zero-bubble schedules send the previous stage its gradient as early as
possible and compute the weight gradients later, in time the device would
otherwise spend waiting. Autograd computes only what a call asks for, so the
input half is ``torch.autograd.grad(roots, inputs)``: for ``y = x @ W.T`` it
computes ``dy @ W`` and skips the ``dy.T @ x`` that the weight needs. The
weight half must then start where the two paths part, not from the roots
again (that would compute every activation gradient a second time)::

    roots --> ... --> [addmm] --(x side)--> ... --> stage input     (I: autograd.grad to the input)
                          \\--(W side)--> [t] --> W.grad                (W: from [addmm] again, W side only)

So before I runs, the backward graph is read once: a node is on the *input
side* when a stage input is reachable from it, on the *weight side* when a
parameter is. A node on both sides with a child only on the weight side is a
*split point*; a pre-hook records the gradient that reaches it during I. W
re-enters each split point with that gradient and asks only for the
parameters its weight-side children lead to; the node recomputes only those
outputs. Roots with no path to an input (a stage whose input needs no
gradient, such as the first) are all weight side: W runs their whole backward.

W accumulates into ``.grad`` through the parameters' own accumulators, so
DDP's gradient hooks fire there: a data-parallel engine arms its reduction
before the stage's last W.

Hooks on a split point. I runs a split point through the engine, with its
hooks: those of the tensor it made (``register_hook``, ``retain_grad``) and
its node's own (module backward hooks sit on such nodes). Entering the node
again in W would run them again: a hook that halves the gradient would
quarter the weight's, a counter would count twice. Of the two exact answers,
a whole backward wherever a split point carries hooks is not taken: it moves
that micro-batch's weight gradient into I (its split lost) and accumulates it
before the stage's last W arms DDP's reducer, which would then miss it. W
enters such a node *below* it instead: at its weight-side children, with what
the node passed on to them in I after its post-hooks, or, where I computed
nothing for them (an ``addmm`` computes only its input side), with the node's
backward called directly, outside the engine and so without hooks, on the
gradient I recorded after the tensor hooks. Every hook runs once, in I, as in
the plain backward, and the weight gradient is still computed in W; the cost
is that node's input-side gradient computed a second time and dropped.
autograd does not say which nodes carry hooks, so ``watch_hooks`` marks them
as they are made, process-wide from the first engine's construction on: the node
of every tensor given a hook through ``Tensor.register_hook`` or
``retain_grad`` (``register_multi_grad_hook`` and FSDP2's hooks go through
these), and module backward hooks' nodes by name. A hook put on a node
directly (``grad_fn.register_hook``) is not seen.

A parameter reachable from a split point through both sides (the same weight
used twice within one stage, one use feeding the other) is entered below the
node too: W then starts only at the node's weight-side children, so the inner
use, which has a split point of its own, is not counted twice. A parameter
that several of W's starting points reach (two uses, nested or side by side)
is accumulated once, as in one backward (``_once``), so its hooks and DDP's
"ready" fire once, not once per point. Where torch cannot start a backward at
a node (before 2.5) W runs a whole backward restricted to the parameters
instead, correct at the cost of recomputing the activation gradients (and of
running the hooks above the split points twice).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, cast

import torch

from . import autograd_call

__all__ = ["WeightGrads", "backward_input", "watch_hooks"]

Node = torch.autograd.graph.Node
#: the node that accumulates into a leaf's ``.grad`` (its ``variable`` is the leaf)
_ACCUMULATE = torch._C._functions.AccumulateGrad

_EDGE_BACKWARD: Optional[bool] = None

#: the key ``watch_hooks`` sets in the ``metadata`` of a node that carries a tensor hook
HOOKED = "pipeddp.hooked"
#: the nodes through which module backward hooks (``register_full_backward_hook``, ``..._pre_hook``) run
_MODULE_HOOK_NODES = ("BackwardHookFunctionBackward",)
_WATCH_LOCK = threading.Lock()


def _edges_supported() -> bool:
    """Whether ``torch.autograd.backward`` takes gradient edges as its starting points (torch >= 2.5)."""
    global _EDGE_BACKWARD
    if _EDGE_BACKWARD is None:
        import inspect

        _EDGE_BACKWARD = "GradientEdge" in str(inspect.signature(torch.autograd.backward))
    return _EDGE_BACKWARD


def _metadata(node: Node) -> Dict[str, Any]:
    """The node's own dict (a property at run time; torch's stubs call it a method)."""
    return cast(Dict[str, Any], node.metadata)


def _marking(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def marked(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        node = self.grad_fn
        if node is not None:
            _metadata(node)[HOOKED] = True
        return result

    marked.__pipeddp_marks__ = True  # type: ignore[attr-defined]  # installed once, whoever asks
    return marked


def watch_hooks() -> None:
    """Mark, from now on, the node of every tensor given a hook (see the module docstring); idempotent.

    ``Tensor.register_hook`` and ``Tensor.retain_grad`` are wrapped, process-wide:
    each still does what it did, and then sets a key in the tensor's node's
    ``metadata``. Called when a step is built (``Step``), so it is in place
    before any stage's first forward and importing pipeddp changes nothing in torch.
    """
    with _WATCH_LOCK:
        for name in ("register_hook", "retain_grad"):
            original = getattr(torch.Tensor, name)
            if not getattr(original, "__pipeddp_marks__", False):
                setattr(torch.Tensor, name, _marking(original))


def _carries_hooks(node: Node) -> bool:
    """Whether running ``node`` again would run hooks that I already ran (as far as ``watch_hooks`` can see)."""
    return node.name() in _MODULE_HOOK_NODES or HOOKED in _metadata(node)


class Point(NamedTuple):
    """A split point as I left it for W."""

    node: Node
    #: the parameters its weight-side children lead to (what W asks for)
    params: List[torch.Tensor]
    #: the gradients that reached it in I (after its tensor hooks)
    got: List[Optional[torch.Tensor]]
    #: where W enters it: None at the node, else below it, at these indices of its ``next_functions``
    below: Optional[List[int]]
    #: entered below: what it passed on in I (after its post-hooks), per ``next_functions`` entry (None: not computed)
    made: Sequence[Optional[torch.Tensor]] = ()


def _call(node: Node, got: Sequence[Optional[torch.Tensor]]) -> Sequence[Optional[torch.Tensor]]:
    """``node``'s backward on ``got``, one gradient per ``next_functions`` entry, as the engine would call it."""
    if not isinstance(node, torch.autograd.function.BackwardCFunction):
        outs = cast(Any, node)(*got)
        return (outs,) if isinstance(outs, torch.Tensor) else outs
    # a Python autograd.Function: the engine hands it zeros for missing gradients and drops the gradients of its
    # forward's non-tensor arguments; which arguments those were is not visible here, so only a match is taken
    metas = node._input_metadata
    outs = node.apply(*[g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                        for g, m in zip(got, metas)])
    outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
    if len(outs) != len(node.next_functions):
        raise RuntimeError(
            f"a split backward cannot run {node.name()} below its hooks: it returned {len(outs)} gradients for "
            f"{len(node.next_functions)} tensor inputs (a non-tensor argument of an autograd.Function that sits "
            "where a stage's input and weight paths part and carries a hook); move the hook, or use a schedule "
            "without split backwards (schedule='1f1b')")
    return outs


#: where one backward of W starts: (gradient edges or roots, their gradients (None: a loss), the parameters it asks for)
Piece = Tuple[List[Any], Optional[List[torch.Tensor]], List[torch.Tensor]]


def _at(point: Point) -> Piece:
    """W of a split point entered at the node, with the gradients that reached it in I."""
    from torch.autograd.graph import GradientEdge

    got = point.got
    return ([GradientEdge(point.node, k) for k, g in enumerate(got) if g is not None],
            [g for g in got if g is not None], point.params)


def _below(point: Point) -> Piece:
    """W of a split point entered below it: its children, from what it passed on in I or from its backward called
    directly (no hooks) where I computed nothing for them.

    The engine would reduce a broadcast gradient to its input's shape and cast
    it to its dtype after the node (``validate_outputs``); a direct call does
    neither, so it is done here before the children take the gradients.
    """
    from torch.autograd.graph import GradientEdge

    node, below = point.node, point.below or []
    outs = point.made
    if any(k >= len(outs) or outs[k] is None for k in below):
        with torch.no_grad():
            outs = _call(node, point.got)
    edges, grads = [], []
    for k in below:
        g = outs[k]
        child, nr = node.next_functions[k]
        if g is None or child is None:
            continue
        meta = child._input_metadata[nr]
        if g.shape != meta.shape:
            g = g.sum_to_size(meta.shape)
        if g.dtype != meta.dtype:
            g = g.to(meta.dtype)
        edges.append(GradientEdge(child, nr))
        grads.append(g)
    return edges, grads, point.params


@contextlib.contextmanager
def _hooks_held(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """The parameters' own tensor hooks, emptied for a while (and put back in their order)."""
    held = []
    for p in params:
        hooks = p._backward_hooks
        if hooks:
            held.append((hooks, list(hooks.items())))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, items in held:
            hooks.update(items)


def _once(pieces: List[Piece]) -> None:
    """Run ``pieces`` that share parameters so that each parameter's accumulator runs once, as in one backward.

    A parameter reached by several pieces (a weight used twice in the stage)
    would otherwise be accumulated once per piece, and its hooks and DDP's
    "gradient ready" would fire as often. So the pieces' gradients are taken
    first (as ``autograd.grad``, with the parameters' own hooks held back: it runs
    them where it takes a gradient) and summed, then handed to the parameters'
    accumulators in one backward.
    """
    total: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # by id: tensors compare by value
    with _hooks_held([p for _, _, ps in pieces for p in ps]):
        for starts, grads, params in pieces:
            got = autograd_call.grad(starts, grads, params, keep_graph=True)
            for p, g in zip(params, got):
                if g is not None:
                    total[id(p)] = (p, g if id(p) not in total else total[id(p)][1] + g)
    if total:
        autograd_call.backward([torch.autograd.graph.get_gradient_edge(p) for p, _ in total.values()],
                               [g for _, g in total.values()])


class WeightGrads:
    """What the W half of one micro-batch's backward needs, recorded during its I half."""

    def __init__(self) -> None:
        #: the split points, as I left them (``Point``)
        self.points: List[Point] = []
        #: roots with no path to an input, with their gradients (W runs their whole backward)
        self.roots: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        #: W runs one backward from every root, to the parameters only (the fallback; see the module docstring)
        self.whole: Optional[List[Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None
        #: every trainable parameter of the stage (what the fallback asks for)
        self.params: List[torch.Tensor] = []
        #: per root in ``roots``, the parameters its backward reaches
        self.reachable: Dict[Node, List[torch.Tensor]] = {}

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad`` (once)."""
        if self.whole is not None:
            pairs = [(t, g) for t, g in self.whole if t.requires_grad]
            if pairs and self.params:
                grads = [g for _, g in pairs]
                torch.autograd.backward([t for t, _ in pairs], None if all(g is None for g in grads) else grads,
                                        inputs=self.params)
        else:
            pieces = [_below(p) if p.below is not None else _at(p) for p in self.points]
            pieces += [([root], None if grad is None else [grad], self.reachable.get(root.grad_fn, []))
                       for root, grad in self.roots if root.grad_fn is not None]
            pieces = [piece for piece in pieces if piece[0] and piece[2]]
            seen: Set[int] = set()
            shared = False
            for _, _, params in pieces:
                shared = shared or any(id(p) in seen for p in params)
                seen.update(id(p) for p in params)
            if shared:
                _once(pieces)
            else:
                for starts, given, params in pieces:
                    autograd_call.backward(starts, given, params, keep_graph=True)
        self.points, self.roots, self.whole, self.params, self.reachable = [], [], None, [], {}


def _graph(roots: Sequence[torch.Tensor]) -> Tuple[List[Node], Dict[int, Node]]:
    """Every node of the backward graph from ``roots``, children before parents, and its leaves' accumulators by
    the leaf's ``id`` (read off the graph: ``get_gradient_edge`` makes a view of each leaf to find its own)."""
    order: List[Node] = []
    accumulators: Dict[int, Node] = {}
    seen: Set[Node] = set()
    stack: List[Tuple[Node, bool]] = [(r.grad_fn, False) for r in roots if r.grad_fn is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        if type(node) is _ACCUMULATE:
            accumulators[id(cast(Any, node).variable)] = node
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append((child, False))
    return order, accumulators


def backward_input(pairs: Sequence[Tuple[torch.Tensor, Optional[torch.Tensor]]], inputs: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor], *, loss: bool) -> Tuple[List[Optional[torch.Tensor]], WeightGrads]:
    """The I half: gradients of ``inputs`` from ``pairs`` (root, its gradient), and what the W half needs.

    ``loss``: the roots are a loss (backward starts from 1, not from given
    gradients). Nothing is accumulated into any ``.grad`` here.
    """
    roots = [t for t, _ in pairs]
    grads = None if loss else [g for _, g in pairs]
    wants = [t for t in inputs if t.requires_grad]
    trainable = [p for p in params if p.requires_grad]
    w = WeightGrads()
    w.params = trainable
    if not roots:
        return [None] * len(inputs), w
    order, accumulators = _graph(roots)
    # a leaf the graph does not reach is on no side; a tensor with a node is reached through that node
    input_side: Set[Node] = {t.grad_fn if t.grad_fn is not None else accumulators[id(t)] for t in wants
                             if t.grad_fn is not None or id(t) in accumulators}
    param_of = {accumulators[id(p)]: p for p in trainable if id(p) in accumulators}
    weight_side: Dict[Node, Set[Node]] = {a: {a} for a in param_of}
    for node in order:  # children first, so each node sees its children's sides
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child in input_side:
                input_side.add(node)
            reach = weight_side.get(child)
            if reach is not None:
                weight_side.setdefault(node, set()).update(reach)
    split_ok = _edges_supported()
    hooks = []
    captured: List[Optional[Tuple[Optional[torch.Tensor], ...]]] = []
    made: Dict[int, Tuple[Optional[torch.Tensor], ...]] = {}
    for node in order if split_ok else ():
        if node not in input_side or node not in weight_side:
            continue
        own: Set[Node] = set()
        through_input: Set[Node] = set()
        below: List[int] = []
        for k, (child, _) in enumerate(node.next_functions):
            if child is None or child not in weight_side:
                continue
            if child in input_side:
                through_input.update(weight_side[child])
            else:
                own.update(weight_side[child])
                below.append(k)
        if not own:
            continue
        k = len(captured)
        captured.append(None)
        hooks.append(node.register_prehook(lambda got, k=k: captured.__setitem__(k, got)))
        enter_below = bool(own & through_input) or _carries_hooks(node)
        if enter_below:  # registered after the node's own post-hooks: sees what it passes on
            hooks.append(node.register_hook(lambda outs, _, k=k: made.__setitem__(k, outs)))
        w.points.append(Point(node, [param_of[a] for a in own], [], below if enter_below else None))
    for root, grad in pairs:
        if root.grad_fn is not None and root.grad_fn not in input_side and root.grad_fn in weight_side:
            w.roots.append((root, None if loss else grad))
            w.reachable[root.grad_fn] = [param_of[a] for a in weight_side[root.grad_fn]]
    try:
        if wants:
            got = autograd_call.grad(roots, grads, wants, keep_graph=True)
        else:
            got = ()
    finally:
        for h in hooks:
            h.remove()
    if not split_ok:
        w.points, w.roots, w.reachable = [], [], {}
        w.whole = [(t, None if loss else g) for t, g in pairs]
    else:
        w.points = [p._replace(got=list(c), made=made.get(k, ())) for k, (p, c) in enumerate(zip(w.points, captured))
                    if c is not None]
    it = iter(got)
    return [next(it) if t.requires_grad else None for t in inputs], w
