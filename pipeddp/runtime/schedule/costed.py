"""``schedule="auto"``: a schedule built from what each stage's actions really cost.

The fixed schedules are patterns drawn for equal stages (F = I = W). Real
stages never are: the first stage has no input gradient to compute (its I is
nearly free, its W is its whole backward), a stage ending in a classifier
head may have a W twice its I, and the cut is never perfect. So the deferred
W's of a zero-bubble pattern do not fill the gaps they were drawn for. This
module plays the pipeline on paper with the measured costs, following the
zero-bubble paper's heuristic (Qi et al., ICLR 2024, section 3.1)::

    warm-up    forwards while the device holds fewer micro-batches than its cap
    steady     an I as soon as it is ready (the previous stage waits for it),
               a forward while memory allows, and a W where the device would
               otherwise idle for at least as long as the W takes, or where
               memory is full (a W frees its micro-batch)
    drain      the W's left, oldest first

Three switches of the heuristic (input gradients before forwards or 1F1B's
alternation; a W in any gap or only in a gap as long as itself; for several
stages per device, forwards depth first or in Megatron's round robin), every
activation cap from 1F1B's to ``max_activations``, and the fixed schedules
that fit the cap are candidates; each is replayed by ``schedule.play`` with
the same costs and the shortest step wins. The result is an ordinary
schedule: ``validate`` checks it, ``play``, ``simulate`` and the timeline show
it, and the executor runs it exactly like any other.

A device holds a micro-batch of one stage from its forward until its W (or
B). A forward that starts a micro-batch on the device's first stage is taken
only when the cap leaves room for the micro-batch's forwards on the device's
later stages, so the build never paints itself into a corner: with a cap of
``virtual_stages`` (one micro-batch through all of a device's stages) it still
finishes, and no schedule can hold less.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from .actions import Action, Event, Kind, Schedule, produces, row_of, stages_on
from .builders import interleaved, interleaved_limit, one_f_one_b, zero_bubble
from .replay import peak_held, play, ready_time

__all__ = ["Costs", "AutoSchedule", "build", "activation_floor", "default_activations", "check_max_activations",
           "is_auto", "fixed_schedules", "makespan"]


@dataclass(frozen=True)
class Costs:
    """Seconds of one micro-batch's F, I (input gradient) and W (weight gradient) per stage, and a transfer.

    ``transfer`` is the time an activation or a gradient takes from one device
    to the next (it occupies neither device). ``overhead`` is what the engine
    spends on a device per action beside its compute (dispatch, posting its
    messages, the Python between actions): on a model whose actions take tens
    of microseconds it is what decides whether splitting each backward into
    I and W, one action more per micro-batch, pays.
    """

    forward: Tuple[float, ...]
    input: Tuple[float, ...]
    weight: Tuple[float, ...]
    transfer: float = 0.0
    overhead: float = 0.0

    @classmethod
    def unit(cls, stages: int) -> "Costs":
        """Equal stages, F = I = W = 1: what the fixed zero-bubble schedule assumes."""
        return cls((1.0,) * stages, (1.0,) * stages, (1.0,) * stages)

    @classmethod
    def from_layers(cls, layers: Sequence[Any], balance: Sequence[int], transfer: float = 0.0) -> "Costs":
        """Stage costs from a profile's per-layer ``forward``/``backward`` seconds cut by ``balance``.

        The profile times a layer's whole backward; its input half is taken as
        half of it, except on the first stage, whose input needs no gradient
        (its W is the whole backward). Unmeasured layers (all zero) give unit costs.
        """
        if not layers or sum(b for b in balance) != len(layers) or not any(x.forward + x.backward > 0 for x in layers):
            return cls.unit(len(balance))
        fwd, inp, wgt, start = [], [], [], 0
        for s, b in enumerate(balance):
            chunk = layers[start:start + b]
            start += b
            f, back = sum(x.forward for x in chunk), sum(x.backward for x in chunk)
            i = 0.0 if s == 0 else back / 2
            fwd.append(f)
            inp.append(i)
            wgt.append(back - i)
        return cls(tuple(fwd), tuple(inp), tuple(wgt), transfer)

    def of(self, kind: Kind, stage: Optional[int]) -> float:
        """Seconds of one ``kind`` action on ``stage`` (B: its I and W together), the engine's overhead included."""
        stage = 0 if stage is None else stage
        if kind is Kind.F:
            compute = self.forward[stage]
        elif kind is Kind.I:
            compute = self.input[stage]
        elif kind is Kind.W:
            compute = self.weight[stage]
        else:
            compute = self.input[stage] + self.weight[stage]
        return compute + self.overhead

    def measured(self, samples: Dict[Tuple[int, str], List[float]], transfers: Sequence[float] = (),
                 overheads: Sequence[float] = ()) -> "Costs":
        """These costs with every (stage, kind) that was timed replaced by the median of its times.

        A stage timed as whole backwards (B) keeps its I : W proportion and
        takes the measured total. ``transfers``: times of receives whose
        message had already arrived; their median is the transfer time.
        ``overheads``: each device's time per action outside its compute and
        its waits (``refine.action_overhead``); their median is the overhead.
        """
        fwd, inp, wgt = list(self.forward), list(self.input), list(self.weight)
        for s in range(len(fwd)):
            got = {k: statistics.median(v) for (st, k), v in samples.items() if st == s and v}
            fwd[s] = got.get("F", fwd[s])
            if "I" in got and "W" in got:
                inp[s], wgt[s] = got["I"], got["W"]
            elif "B" in got:
                whole = inp[s] + wgt[s]
                share = inp[s] / whole if whole > 0 else 0.5
                inp[s], wgt[s] = got["B"] * share, got["B"] * (1 - share)
        link = statistics.median(transfers) if transfers else self.transfer
        extra = statistics.median(overheads) if overheads else self.overhead
        return Costs(tuple(fwd), tuple(inp), tuple(wgt), link, extra)


def activation_floor(virtual_stages: int) -> int:
    """The fewest micro-batches a device must be able to hold: one micro-batch through all its stages."""
    return virtual_stages


def default_activations(stages: int, chunks: int, virtual_stages: int) -> int:
    """1F1B's cap: its first device holds ``p`` micro-batches (interleaved 1F1B's with virtual stages)."""
    if virtual_stages == 1:
        return min(stages, chunks)
    return max(interleaved_limit(stages, chunks, virtual_stages))


def check_max_activations(value: Optional[int], virtual_stages: int) -> None:
    """None (1F1B's cap), or an int no smaller than what any schedule needs; ValueError naming the minimum."""
    if value is None:
        return
    floor = activation_floor(virtual_stages)
    if not isinstance(value, int) or isinstance(value, bool) or value < floor:
        raise ValueError(f"max_activations must be an int >= {floor} (micro-batches a device holds at once; with "
                         f"virtual_stages={virtual_stages} no schedule can hold fewer than {floor}: one micro-batch "
                         f"through each of a device's stages), got {value!r}")


def _stage(a: Action) -> int:
    return 0 if a.stage is None else a.stage


class _Board:
    """The pipeline on paper during one build: what ran where, when, and what each device holds."""

    def __init__(self, p: int, m: int, v: int, costs: Costs, cap: int, placement: str) -> None:
        self.p, self.m, self.v, self.n = p, m, v, p * v
        self.costs, self.cap, self.placement = costs, cap, placement
        self._local = [stages_on(r, p, self.n, placement) for r in range(p)]
        self.done: Dict[Event, float] = {}
        self.rows: Schedule = [[] for _ in range(p)]
        self.clock = [0.0] * p
        self.held = [0] * p
        self.next_f = [0] * self.n  # per stage: the next micro-batch to run forward (in order)
        self.next_i = [0] * self.n  # ... and to run its input gradient
        self.pending_w: List[List[Action]] = [[] for _ in range(p)]

    def transfer(self, src: int, dst: int, a: Action) -> float:
        return 0.0 if row_of(src, self.p, self.placement) == row_of(dst, self.p, self.placement) \
            else self.costs.transfer

    def ready(self, a: Action) -> Optional[float]:
        return ready_time(a, self.done, self.transfer, self.n)

    def local(self, r: int) -> List[int]:
        return self._local[r]

    def room(self, r: int, stage: int) -> bool:
        """Whether device ``r`` may run the next forward of ``stage`` within its cap (see the module docstring)."""
        chunk = stage // self.p
        if chunk > 0:
            return self.held[r] < self.cap  # reserved when the micro-batch entered the device
        entered = self.next_f[stage]
        owed = sum(entered - self.next_f[s] for s in self.local(r)[1:])  # later forwards of micro-batches in flight
        return self.held[r] + owed + self.v <= self.cap

    def forwards(self, r: int, depth_first: bool) -> List[Tuple[float, Action]]:
        """The device's next forwards whose input is on its way, with when it is ready, in preference order."""
        out = []
        stages = self.local(r)
        for s in reversed(stages) if depth_first else stages:
            i = self.next_f[s]
            if i < self.m and self.room(r, s):
                a = Action(Kind.F, i, s)
                t = self.ready(a)
                if t is not None:
                    out.append((t, a))
        if not depth_first:  # Megatron's order: the micro-batch that entered earliest, then the earlier stage
            out.sort(key=lambda ta: (ta[1].mb + (_stage(ta[1]) // self.p) * self.p, _stage(ta[1])))
        return out

    def inputs(self, r: int) -> List[Tuple[float, Action]]:
        """The device's next input gradients whose output gradient is on its way, later stages first."""
        out = []
        for s in reversed(self.local(r)):
            i = self.next_i[s]
            if i < self.next_f[s]:
                a = Action(Kind.I, i, s)
                t = self.ready(a)
                if t is not None:
                    out.append((t, a))
        return out

    def run(self, r: int, a: Action, now: float) -> None:
        end = now + self.costs.of(a.kind, a.stage)
        for e in produces(a):
            self.done[e] = end
        self.rows[r].append(a)
        self.clock[r] = end
        if a.kind is Kind.F:
            self.next_f[_stage(a)] += 1
            self.held[r] += 1
        elif a.kind is Kind.I:
            self.next_i[_stage(a)] += 1
            self.pending_w[r].append(Action(Kind.W, a.mb, a.stage))
        else:
            self.held[r] -= 1


def _greedy(p: int, m: int, v: int, costs: Costs, cap: int, inputs_first: bool, w_in_any_gap: bool,
            depth_first: bool, placement: str = "loop") -> Optional[Schedule]:
    """One build of the heuristic with one setting of its switches; None if it cannot finish under ``cap``."""
    board = _Board(p, m, v, costs, cap, placement)
    total = 3 * p * v * m
    count = 0
    while count < total:
        now = min(board.clock)
        acted = False
        wake: List[float] = []
        for r in range(p):
            if board.clock[r] != now:
                continue
            fs = board.forwards(r, depth_first)
            bs = board.inputs(r)
            f_now = [a for t, a in fs if t <= now]
            b_now = [a for t, a in bs if t <= now]
            last = board.rows[r][-1].kind if board.rows[r] else None
            b_before_f = inputs_first or last is Kind.F
            choice = (b_now or f_now) if b_before_f else (f_now or b_now)
            if not choice and board.pending_w[r]:
                upcoming = [t for t, _ in fs + bs if t > now]
                gap = min(upcoming) - now if upcoming else float("inf")
                w = board.pending_w[r][0]
                full = not fs and not any(board.room(r, s) for s in board.local(r))
                if w_in_any_gap or full or gap >= costs.of(Kind.W, w.stage):
                    choice = [board.pending_w[r].pop(0)]
            if choice:
                board.run(r, choice[0], now)
                count += 1
                acted = True
            else:
                wake += [t for t, _ in fs + bs if t > now]
        if acted:
            continue
        later = wake + [c for c in board.clock if c > now]
        if not later:
            return None
        nxt = min(later)
        for r in range(p):
            if board.clock[r] == now:
                board.clock[r] = nxt
    return board.rows


def fixed_schedules(p: int, m: int, v: int, placement: str = "loop") -> List[Schedule]:
    """The fixed schedules that run ``v`` stages per device (1F1B and zero-bubble, or interleaved 1F1B and
    interleaved zero-bubble, in that order): candidates too, where they fit the cap."""
    if v == 1:
        return [one_f_one_b(p, m), zero_bubble(p, m)]
    return [interleaved(p, m, v, placement=placement), zero_bubble(p, m, v, placement=placement)]


def makespan(plan: Schedule, costs: Costs, p: int, placement: str = "loop") -> float:
    """How long ``plan`` (on ``p`` devices, placed so) takes when its actions cost ``costs``."""
    def transfer(src: int, dst: int, a: Action) -> float:
        return 0.0 if row_of(src, p, placement) == row_of(dst, p, placement) else costs.transfer

    return play(plan, lambda row, a: costs.of(a.kind, a.stage), transfer).makespan


def ranked(stages: int, chunks: int, virtual_stages: int = 1, costs: Optional[Costs] = None,
           max_activations: Optional[int] = None, placement: str = "loop") -> List[Tuple[float, Schedule]]:
    """Every distinct candidate schedule with its step time on paper, shortest first (ties: fewer held
    activations first). ``build`` takes the first; ``AutoSchedule`` times the close ones on real steps."""
    p, m, v = stages, chunks, virtual_stages
    costs = costs or Costs.unit(p * v)
    if len(costs.forward) != p * v:
        raise ValueError(f"costs for {len(costs.forward)} stages given to a schedule of {p} devices x {v} virtual "
                         f"stages = {p * v} stages")
    check_max_activations(max_activations, v)
    top = default_activations(p, m, v) if max_activations is None else max_activations
    top = min(top, m * v)
    floor = min(default_activations(p, m, v), top)
    candidates: List[Schedule] = [s for s in fixed_schedules(p, m, v, placement)
                                  if all(peak_held(row) <= top for row in s)]
    switches: Iterable[Tuple[bool, bool, bool]] = itertools.product((True, False), (True, False),
                                                                     (True, False) if v > 1 else (True,))
    for cap, (first, any_gap, depth) in itertools.product(range(max(floor, v), top + 1), switches):
        got = _greedy(p, m, v, costs, cap, first, any_gap, depth, placement)
        if got is not None:
            candidates.append(got)
    scored = sorted((makespan(c, costs, p, placement), max(peak_held(row) for row in c), k)
                    for k, c in enumerate(candidates))
    seen, out = set(), []
    for span, _, k in scored:
        key = repr(candidates[k])
        if key not in seen:
            seen.add(key)
            out.append((span, candidates[k]))
    return out


def build(stages: int, chunks: int, virtual_stages: int = 1, costs: Optional[Costs] = None,
          max_activations: Optional[int] = None, *, placement: str = "loop") -> Schedule:
    """The shortest schedule the heuristic finds for ``costs`` with at most ``max_activations`` per device.

    ``costs`` has one entry per stage (``stages * virtual_stages``; default:
    unit costs); ``max_activations`` defaults to 1F1B's cap; ``placement`` says which device holds which stage.
    """
    return ranked(stages, chunks, virtual_stages, costs, max_activations, placement)[0][1]


#: candidates within this factor of the best step time on paper are timed on real steps (``AutoSchedule.close``)
CLOSE = 1.05
#: at most this many of them
MOST_TRIED = 3


class AutoSchedule:
    """The schedule function an engine runs for ``schedule="auto"``: built from ``costs``, cached per shape.

    ``update`` replaces the costs (after the first steps were measured) and
    forgets the schedules built so far. Called as ``(stages, chunks[, virtual_stages])``
    like any schedule function; it runs the ``pick``-th of the candidates that
    are ``close`` on paper (0: the shortest), so that the engine can time them
    on real steps and keep the fastest (``refine``).
    """

    def __init__(self, costs: Optional[Costs] = None, max_activations: Optional[int] = None,
                 placement: str = "loop") -> None:
        self.costs = costs
        self.max_activations = max_activations
        self.placement = placement
        self.pick = 0
        #: the shape of the last schedule asked for: ``(stages, chunks, virtual_stages)``
        self.last: Optional[Tuple[int, int, int]] = None
        self._built: Dict[Tuple[int, int, int], List[Schedule]] = {}

    def close(self, key: Tuple[int, int, int]) -> List[Schedule]:
        """The candidates for ``key`` within ``CLOSE`` of the shortest on paper (at most ``MOST_TRIED``), and the
        fixed schedules of that shape (1F1B and zero-bubble, or interleaved 1F1B and interleaved zero-bubble) that
        fit the cap: paper is a model, and auto must not run slower than a schedule a user would otherwise pick,
        so those are always timed too."""
        if key not in self._built:
            stages, chunks, v = key
            costs = self.costs if self.costs is not None and len(self.costs.forward) == stages * v else None
            options = ranked(stages, chunks, v, costs, self.max_activations, self.placement)
            best = options[0][0]
            chosen = [plan for span, plan in options if span <= best * CLOSE][:MOST_TRIED]
            for base in fixed_schedules(stages, chunks, v, self.placement):
                if base not in chosen and any(plan == base for _, plan in options):
                    chosen.append(base)
            self._built[key] = chosen
        return self._built[key]

    def __call__(self, stages: int, chunks: int, virtual_stages: int = 1) -> Schedule:
        self.last = key = (stages, chunks, virtual_stages)
        options = self.close(key)
        return [list(row) for row in options[min(self.pick, len(options) - 1)]]

    def update(self, costs: Costs) -> None:
        self.costs = costs
        self.pick = 0
        self._built.clear()

    def __repr__(self) -> str:
        return "'auto'"


def is_auto(schedule: Any) -> bool:
    """Whether ``schedule`` names the costed schedule (``"auto"``, any case)."""
    return isinstance(schedule, str) and schedule.strip().lower() == "auto"

