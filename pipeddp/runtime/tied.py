"""Weights shared by several stages: an embedding tied to the output head, a module used twice.

In the plain model one ``Parameter`` serves several places. Cut into stages,
those places may land on different devices (or in different processes),
where one tensor cannot live. So every stage that uses it holds a copy, and
the copies are kept one weight::

    plain model:  0.weight (embedding) ---- same Parameter ---- 7.weight (head)
    2 stages:     stage 0: 0.weight (the original)         stage 1: 7.weight (a copy)

    before the step's backward:  note each .grad as it is (b, or None)    (``begin``)
    after the step's backward:   both .grad = b + gain(stage 0) + gain(stage 1),
                                 gain = .grad - b, what the step added    (``fold``)
    before the next forward:     copy <- original                          (``refresh``)
                                 where either changed since: an optimizer step, a load, a
                                 backward (not between an evaluation's forwards)

Summing only the gains makes a user's own accumulation exact: two calls
without ``zero_grad`` between give each copy ``g1 + g2`` of the plain model,
not ``2 g1 + g2`` (after the first call each copy already holds the sum of
both stages; summing whole ``.grad`` again would count it twice). Whatever the
user did to ``.grad`` between calls (dropped it, zeroed it in place, scaled
it) is what ``b`` holds, so no reset needs detecting.

With both ``.grad`` equal to the plain model's gradient, an optimizer over
``parameters()`` (which lists the original and each copy) gives all of them
the plain model's update, and the refresh removes any rounding difference
between devices. ``state_dict()`` has the plain model's keys, each name with
its value. With several replicas, DDP first averages each copy's gradient over
its stage group, and the sum of averages is the average of sums (DDP, too,
reduces each backward's own addition). Between processes the gains are summed
by a collective (``pipeddp.distributed.ties``, set as ``LocalTies.across``).

``find_ties`` works on the plain model and its balance, so every process of a
job finds the same ties in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

import torch
from torch import nn

from .dtensors import is_dtensor, local

__all__ = ["Tie", "find_ties", "LocalTies", "Across", "layers_of", "stage_of_layers"]


def layers_of(model: nn.Sequential) -> List[Tuple[str, nn.Module]]:
    """``(name, layer)`` for every position of ``model``, a module used twice included.

    ``named_children()`` lists a module object once, however many positions
    it fills; ``len(model)`` and ``model(x)`` count every position.
    """
    return list(model._modules.items())


def stage_of_layers(balance: Sequence[int]) -> List[int]:
    """The stage of each layer position."""
    return [s for s, count in enumerate(balance) for _ in range(count)]


@dataclass(frozen=True)
class Tie:
    """One parameter used by several stages: its names in the plain model and the stage of each."""

    names: Tuple[str, ...]
    stages: Tuple[int, ...]

    @property
    def owner(self) -> int:
        """The first stage that uses it: its copy is the one the others are refreshed from."""
        return min(self.stages)


def find_ties(model: nn.Sequential, balance: Sequence[int]) -> List[Tie]:
    """The parameters of ``model`` that the cut ``balance`` puts in more than one stage."""
    where = stage_of_layers(balance)
    seen: Dict[int, List[Tuple[str, int]]] = {}
    for (name, layer), stage in zip(layers_of(model), where):
        for pname, p in layer.named_parameters(prefix=name, remove_duplicate=False):
            seen.setdefault(id(p), []).append((pname, stage))
    ties = []
    for uses in seen.values():
        if len({s for _, s in uses}) > 1:
            ties.append(Tie(tuple(n for n, _ in uses), tuple(s for _, s in uses)))
    return ties


class StageLike(Protocol):
    """What ``LocalTies`` needs of a stage (``runtime.stage.Stage`` has it): read only, so any module type does."""

    @property
    def index(self) -> int: ...

    @property
    def module(self) -> nn.Module: ...

    @property
    def device(self) -> torch.device: ...


class Synced:
    """Whether some tensors may have changed since they were last synchronised (``mark``), by each one's (version,
    address): that changes where a tensor is written in place (an optimizer step moves the version counter) or
    replaced, so an unchanged fingerprint means values not written since, except through ``.data``, which no
    counter sees; ``forget`` (after a backward, which such an update follows) makes the next check say changed."""

    def __init__(self) -> None:
        self._at: Optional[Tuple[Tuple[int, int], ...]] = None  # None: nothing marked since the last forget

    @staticmethod
    def _fingerprint(tensors: Iterable[torch.Tensor]) -> Tuple[Tuple[int, int], ...]:
        return tuple((local(t)._version, local(t).data_ptr()) for t in tensors)

    def changed(self, tensors: Iterable[torch.Tensor]) -> bool:
        return self._at is None or self._at != self._fingerprint(tensors)

    def mark(self, tensors: Iterable[torch.Tensor]) -> None:
        self._at = self._fingerprint(tensors)

    def forget(self) -> None:
        self._at = None


def _resolve(root: nn.Module, dotted: str) -> Tuple[nn.Module, str]:
    parts = dotted.split(".")
    module = root
    for part in parts[:-1]:
        module = getattr(module, part)
    return module, parts[-1]


class Across(Protocol):
    """The sum of a tie's gains over the processes that hold its other uses (``distributed.ties.TieExchange``)."""

    def shares(self, tie: Tie) -> bool:
        """Whether other processes hold uses of ``tie`` (then ``sum`` must be called for it, in tie order)."""
        ...

    def sum(self, tie: Tie, gain: torch.Tensor) -> torch.Tensor:
        """``gain`` summed over those processes (a collective), on ``gain``'s device."""
        ...


def _laid_out(p: nn.Parameter) -> None:
    """``p``'s gradient laid out as ``p`` (a DTensor): a vocabulary-split embedding's backward gives the whole table
    on every tp rank, its head's a shard of rows, and every use's gain must be the same piece."""
    grad = p.grad
    if is_dtensor(p) and is_dtensor(grad) and grad.placements != p.placements:  # type: ignore[union-attr, attr-defined]
        p.grad = grad.redistribute(p.device_mesh, p.placements)  # type: ignore[union-attr, attr-defined]


class LocalTies:
    """The copies of tied parameters among the stages of this process, and the two steps that keep them one.

    ``stages`` are this process's stages (modules whose children carry the
    plain model's layer names). Where a tie's uses fall in several of them,
    each stage after the first gets a copy of its own on its device.
    """

    def __init__(self, ties: Sequence[Tie], stages: Sequence[StageLike]) -> None:
        by_index = {st.index: st for st in stages}
        #: per tie with a use here: the tie and this process's parameters for it, first stage first
        self.entries: List[Tuple[Tie, List[nn.Parameter]]] = []
        #: (module, attribute, what the model held there, the copy put in its place): undone by ``restore``
        self._placed: List[Tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        holders: Dict[int, Tuple[str, int]] = {}  # id(module holding a tied parameter) -> (a use's name, stage)
        for tie in ties:
            group: Dict[int, nn.Parameter] = {}
            for name, stage in zip(tie.names, tie.stages):
                st = by_index.get(stage)
                if st is None:
                    continue
                module, attr = _resolve(st.module, name)
                other = holders.setdefault(id(module), (name, stage))
                if other[1] != stage:  # one module object inside layers of two stages: a copy cannot be put there
                    raise ValueError(
                        f"{other[0]} and {name} are one {type(module).__name__} module used inside layers of stages "
                        f"{other[1]} and {stage}; each stage needs its own module to hold its copy of the weight. "
                        "Share the parameter instead of the module (e.g. head.weight = embed.weight), or cut where "
                        "both uses fall in one stage"
                    )
                current = getattr(module, attr)
                if stage not in group:
                    original = next(iter(group.values()), None)
                    if original is None and current.device != st.device:
                        # every stage moved the one parameter to its device in turn, the last one winning: it
                        # belongs on the first stage's
                        current.data = current.data.to(st.device)
                    elif original is not None and (current is original or current.device != st.device):
                        current = nn.Parameter(original.detach().to(st.device, copy=True),
                                               requires_grad=original.requires_grad)
                    group[stage] = current
                before = getattr(module, attr)
                if before is not group[stage]:
                    self._placed.append((module, attr, before, group[stage]))
                setattr(module, attr, group[stage])
            if group:
                self.entries.append((tie, [group[s] for s in sorted(group)]))
        #: the processes holding other uses of these ties (None: every use is in this process)
        self.across: Optional[Across] = None
        #: each tied parameter's gradient before the step's backwards (``begin``); None outside a step
        self._before: Optional[Dict[int, Optional[torch.Tensor]]] = None  # by id(parameter)
        #: every use as it was at the last refresh
        self.synced = Synced()

    def rebind(self, stages: Sequence[StageLike]) -> None:
        """Take the stages' current parameters for every tie (after a sharding engine replaced them).

        The lists are updated in place, so whoever holds them (``TieExchange``) sees the new ones too.
        """
        by_index = {st.index: st for st in stages}
        for tie, group in self.entries:
            seen: Dict[int, nn.Parameter] = {}
            for name, stage in zip(tie.names, tie.stages):
                if stage in by_index and stage not in seen:
                    module, attr = _resolve(by_index[stage].module, name)
                    seen[stage] = getattr(module, attr)
            group[:] = [seen[s] for s in sorted(seen)]

    def restore(self) -> None:
        """Give the model back its shared parameters in place of the copies (when the engine closes).

        The copies live in the user's modules while the engine runs; left
        there, a model trained on afterwards (or by another engine) would have
        two weights where it had one. The first use's parameter holds the
        trained values (each copy is refreshed from it). A place whose
        parameter was replaced since (a sharding engine's) is left as it is.
        """
        for module, attr, before, placed in reversed(self._placed):
            if getattr(module, attr) is placed:
                setattr(module, attr, before)
        self._placed = []

    @property
    def groups(self) -> List[List[nn.Parameter]]:
        return [params for _, params in self.entries]

    def copies(self) -> List[nn.Parameter]:
        """Every parameter here but each tie's first: what a norm over the plain model's weights leaves out."""
        return [c for _, (first, *rest) in self.entries for c in rest]

    def _uses(self) -> List[nn.Parameter]:
        """Every use of every tie, first ones included (what ``synced`` fingerprints)."""
        return [p for group in self.groups for p in group]

    def changed(self) -> bool:
        """Whether a use may differ from its tie's first since the last ``refresh``: one was written in place (an
        optimizer step) or replaced since, or a backward folded gradients in (an update through ``.data``, which
        no version counter sees, follows one), or none has been made yet."""
        return self.synced.changed(self._uses())

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy each tie's first parameter into the others (before a step's forwards), where they may differ:
        not again for the forwards of an evaluation, or the passes of one step, that nothing changed between."""
        if not self.changed():
            return
        for first, *copies in self.groups:
            for c in copies:
                local(c).copy_(local(first))
        self.synced.mark(self._uses())

    @torch.no_grad()
    def begin(self) -> None:
        """Note every tied parameter's gradient before a step's first backward adds to it.

        Call it once per exchange: before the first of several passes that
        one ``fold`` closes (``HybridParallel``'s own accumulation), and where
        a backward starts (the user's ``loss.backward()`` through the pipeline
        reaches it then, after any ``zero_grad`` in between).

        The note costs a copy of each use's gradient while the step runs, but
        only where ``.grad`` is not None at its start (accumulating, or
        ``zero_grad(set_to_none=False)``); after ``zero_grad()`` it is free.
        """
        self._before = {id(p): None if p.grad is None else local(p.grad.detach()).clone()
                        for _, group in self.entries for p in group}

    def _gain(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        """What the step's backwards added to ``p.grad`` (None: nothing, or no gradient at all)."""
        before = None if self._before is None else self._before.get(id(p))
        if p.grad is None:
            return None
        grad = local(p.grad.detach())
        return grad if before is None else grad - before

    @torch.no_grad()
    def fold(self) -> None:
        """Give every use of a tie its gradient before the step plus the gains of all uses (after the backwards).

        Uses in other processes join through ``across`` (a collective per
        shared tie, in tie order, whether or not this process gained anything).
        """
        for tie, group in self.entries:
            across = self.across
            shared = across is not None and across.shares(tie)
            if len(group) < 2 and not shared:
                continue
            for p in group:
                _laid_out(p)
            gains = [g for g in (self._gain(p) for p in group) if g is not None]
            if not gains and not shared:
                continue
            total = gains[0].clone() if gains else torch.zeros_like(local(group[0]))
            for g in gains[1:]:
                total.add_(g.to(total.device))
            if shared and across is not None:
                total = across.sum(tie, total)
            for p in group:
                before = None if self._before is None else self._before.get(id(p))
                mine = total.to(p.device, copy=True)
                mine = mine if before is None else mine.add_(before)
                if is_dtensor(p):  # a shard: every use's shard is the same piece (the replica's index)
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    local(p.grad).copy_(mine)
                else:
                    p.grad = mine
        self._before = None
        self.synced.forget()  # an optimizer step may follow, maybe through .data: the next forward refreshes
