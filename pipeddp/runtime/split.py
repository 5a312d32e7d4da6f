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
before the stage's last W. A parameter reachable from a split point through
both sides (the same weight used twice within one stage, one use feeding the
other) cannot be split this way without counting the inner use twice; then W
runs a whole backward restricted to the parameters instead, correct at the
cost of recomputing the activation gradients.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

__all__ = ["WeightGrads", "backward_input"]

_EDGE_BACKWARD: Optional[bool] = None


def _edges_supported() -> bool:
    """Whether ``torch.autograd.backward`` takes gradient edges as its starting points (torch >= 2.5)."""
    global _EDGE_BACKWARD
    if _EDGE_BACKWARD is None:
        import inspect

        _EDGE_BACKWARD = "GradientEdge" in str(inspect.signature(torch.autograd.backward))
    return _EDGE_BACKWARD


def _accumulator(t: torch.Tensor) -> torch.autograd.graph.Node:
    return torch.autograd.graph.get_gradient_edge(t).node


class WeightGrads:
    """What the W half of one micro-batch's backward needs, recorded during its I half."""

    def __init__(self) -> None:
        #: (split point, its weight-side parameters, the gradients that reached it in I)
        self.points: List[Tuple[torch.autograd.graph.Node, List[torch.Tensor], List[Optional[torch.Tensor]]]] = []
        #: roots with no path to an input, with their gradients (W runs their whole backward)
        self.roots: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        #: W runs one backward from every root, to the parameters only (the fallback; see the module docstring)
        self.whole: Optional[List[Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None
        #: every trainable parameter of the stage (what the fallback asks for)
        self.params: List[torch.Tensor] = []
        #: per root in ``roots``, the parameters its backward reaches
        self.reachable: Dict[torch.autograd.graph.Node, List[torch.Tensor]] = {}

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad`` (once)."""
        if self.whole is not None:
            pairs = [(t, g) for t, g in self.whole if t.requires_grad]
            if pairs and self.params:
                grads = [g for _, g in pairs]
                torch.autograd.backward([t for t, _ in pairs], None if all(g is None for g in grads) else grads,
                                        inputs=self.params)
        else:
            from torch.autograd.graph import GradientEdge

            for node, params, got in self.points:
                edges = [GradientEdge(node, k) for k, g in enumerate(got) if g is not None]
                if edges:
                    torch.autograd.backward(edges, [g for g in got if g is not None], inputs=params,
                                            retain_graph=True)
            for root, grad in self.roots:
                params = self.reachable.get(root.grad_fn, []) if root.grad_fn is not None else []
                if params:
                    torch.autograd.backward([root], None if grad is None else [grad], inputs=params,
                                            retain_graph=True)
        self.points, self.roots, self.whole, self.params, self.reachable = [], [], None, [], {}


def _graph(roots: Sequence[torch.Tensor]) -> List[torch.autograd.graph.Node]:
    """Every node of the backward graph from ``roots``, children before parents."""
    order: List[torch.autograd.graph.Node] = []
    seen: Set[torch.autograd.graph.Node] = set()
    stack: List[Tuple[torch.autograd.graph.Node, bool]] = [(r.grad_fn, False) for r in roots if r.grad_fn is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append((child, False))
    return order


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
    order = _graph(roots)
    input_side: Set[torch.autograd.graph.Node] = {_accumulator(t) for t in wants}
    param_of = {_accumulator(p): p for p in trainable}
    weight_side: Dict[torch.autograd.graph.Node, Set[torch.autograd.graph.Node]] = {a: {a} for a in param_of}
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
    for node in order:
        if node not in input_side or node not in weight_side:
            continue
        own: Set[torch.autograd.graph.Node] = set()
        through_input: Set[torch.autograd.graph.Node] = set()
        for child, _ in node.next_functions:
            if child is None or child not in weight_side:
                continue
            (through_input if child in input_side else own).update(weight_side[child])
        if not own:
            continue
        if own & through_input:
            split_ok = False
            break
        k = len(captured)
        captured.append(None)
        hooks.append(node.register_prehook(lambda got, k=k: captured.__setitem__(k, got)))
        w.points.append((node, [param_of[a] for a in own], []))
    for root, grad in pairs:
        if root.grad_fn is not None and root.grad_fn not in input_side and root.grad_fn in weight_side:
            w.roots.append((root, None if loss else grad))
            w.reachable[root.grad_fn] = [param_of[a] for a in weight_side[root.grad_fn]]
    try:
        if wants:
            got = torch.autograd.grad(roots, wants, grads, retain_graph=True, allow_unused=True)
        else:
            got = ()
    finally:
        for h in hooks:
            h.remove()
    if not split_ok:
        w.points, w.roots, w.reachable = [], [], {}
        w.whole = [(t, None if loss else g) for t, g in pairs]
    else:
        w.points = [(node, ps, list(c)) for (node, ps, _), c in zip(w.points, captured) if c is not None]
    it = iter(got)
    return [next(it) if t.requires_grad else None for t in inputs], w
