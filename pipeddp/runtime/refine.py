"""Refine ``schedule="auto"`` from the first steps' own action times, the same on every rank.

The profile times each layer alone, at the partitioner's leisure. In the
pipeline the actions run beside their neighbours on shared cores, receive and
send, and split the backward into its two halves; so after the first steps
the engine times one step's actions and rebuilds the order from those costs::

    step 1            step 2 (traced)          step 3 ...
    profile's order   profile's order          measured order
                      F/I/W/B medians per stage, the quickest receive
                      -> gathered from every process -> rank 0 decides
                      -> the same costs (so the same order) everywhere

The costs are a model: two orders within a few percent of each other on
paper (``costed.CLOSE``) may come out the other way round on the machine.
So when several are that close, each runs whole steps, in the order
A B C C B A (a drift in the host's speed weighs on each alike), repeated
where steps are short (``trial_samples``: a step of milliseconds is within
the host's noise of its neighbour, a step of seconds is not); each timed
step comes after a step of the same order (an untimed one where the step
before ran another), since a step run right after another order's is not
what that order's steps take in a row
(resnet50, 2 processes, m = 4: one order's two trial steps 1256 and 1347
ms, 1291-1351 in a row). The one whose quickest step (``quickest``: each
step as long as its slowest process took) was shortest, as rank 0 finds
from every process's times, is kept; the fixed orders (1F1B and
zero-bubble, or their interleaved forms) are always among them. Every order
is exact, so the steps of the trial train the model as any other step would.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from .schedule.costed import AutoSchedule, Costs, is_auto
from .trace import Span, Trace

__all__ = ["Refiner", "attach_auto", "action_samples", "action_overhead", "fastest", "quickest", "trial_samples",
           "trial_steps", "MOST_SAMPLES"]

T = TypeVar("T")
#: Per (stage, action kind): the measured seconds of each such action of a step.
Samples = Dict[Tuple[int, str], List[float]]
#: the steps a trial gives each candidate: at least a quarter second of them, at least 2, at most ``MOST_SAMPLES``
TRIAL_S = 0.25
MOST_SAMPLES = 24


def trial_samples(step_s: float) -> int:
    """How many timed steps each candidate of a trial runs, for steps of ``step_s`` seconds: an even number (the
    candidates run A B .. B A, then again), 2 for steps of an eighth of a second or more, up to ``MOST_SAMPLES``
    for steps of milliseconds, whose differences are of the order of the host's noise.

    Steps of a few milliseconds on shared cores vary by 2x from one to the next. Judged on the first 8 of each
    one's 24 steps, ``fastest`` kept zero-bubble over 1F1B in 12 of 200 trials (a 2-process gloo job, m = 4 and
    8, where zero-bubble's steps took 13-26% longer in blocks of consecutive steps), on the first 16 in 2, on
    all 24 in none. 24 steps of milliseconds cost a tenth of a second or two per candidate. Each timed step comes
    after a step of its order (``trial_steps``), so a candidate runs up to twice as many steps."""
    k = math.ceil(TRIAL_S / step_s) if step_s > 0 else 2
    return max(2, min(MOST_SAMPLES, k + k % 2))


def trial_steps(order: Sequence[int]) -> List[Tuple[int, bool]]:
    """The trial's steps for candidates timed in ``order``: ``(candidate, timed)``, each timed step right after a
    step of the same candidate. Where the candidate before was another, an untimed step of it comes first; at the
    turns of A B .. B A (B B, and A A where the pattern repeats) the timed step before serves, so a trial of two
    candidates timed twice runs 7 steps, not 8, and one timed 24 times each 73, not 96."""
    steps: List[Tuple[int, bool]] = []
    for i, c in enumerate(order):
        if i == 0 or order[i - 1] != c:
            steps.append((c, False))
        steps.append((c, True))
    return steps


def action_samples(spans: Sequence[Span]) -> Samples:
    """Per (stage, action kind), the seconds of each F, I, W or B action in ``spans`` (what ``Costs.measured``
    takes)."""
    samples: Samples = {}
    for s in spans:
        if s.lane == "compute" and s.kind in ("F", "B", "I", "W"):
            samples.setdefault((s.stage, s.kind), []).append(s.duration)
    return samples


def action_overhead(spans: Sequence[Span]) -> List[float]:
    """Per device in ``spans`` (one step), its seconds per action outside the actions' compute and its waits.

    From the device's first action or receive to its last action, what is
    neither an action's compute nor a wait for a message (a receive) is the
    engine's own: dispatching the action, posting its sends, the Python in
    between. Divided by the device's actions, it is what one more action costs
    (``Costs.overhead``), whatever the order.
    """
    out = []
    for row in sorted({s.device for s in spans if s.lane == "compute"}):
        mine = [s for s in spans if s.device == row and (s.lane == "compute" or s.kind == "recv")]
        actions = [s for s in mine if s.lane == "compute"]
        end = max(s.end for s in actions)
        busy = sum(s.duration for s in mine if s.end <= end)
        out.append(max(0.0, end - min(s.start for s in mine) - busy) / len(actions))
    return out


def _alone(local: Any) -> List[Any]:
    return [local]


def _here(choose: Callable[[], T]) -> T:
    return choose()


class Refiner:
    """An ``after_backward`` hook of a step: times one early training step, then rebuilds the schedule from it;
    where orders come out close, ``ended`` (an ``after_step`` hook) times each on whole steps.

    The profile times each layer alone; the pipeline's actions run with their
    neighbours on the same cores, receive and send, and split the backward, so
    the first steps' own action times are the better costs. After the
    ``after``-th step the next one is traced (on a trace of its own when the
    engine records none); after it, every process's times are gathered
    (``gather``), the costs are decided once (``on_rank0``: on rank 0, sent to
    every rank, so every process runs the same schedule) and the step forgets
    the rows it built, so the following steps run the new schedule.
    """

    def __init__(self, auto: AutoSchedule, step: Any, *, after: int = 1,
                 gather: Callable[[Any], List[Any]] = _alone,
                 on_rank0: Callable[[Callable[[], Any]], Any] = _here) -> None:
        self.auto, self.after = auto, after
        self._step = weakref.ref(step)  # the step holds this hook: no reference cycle keeps a dropped engine alive
        self.gather, self.on_rank0 = gather, on_rank0
        self.seen = 0
        self.since = 0.0
        self.own: Optional[Trace] = None
        #: the costs the schedule was rebuilt from (None until then)
        self.refined: Optional[Costs] = None
        #: the close candidates still to run, one per step (with whether that step is timed), and each one's step times
        self.trial: List[Tuple[int, bool]] = []
        self.times: Dict[int, List[float]] = {}
        self.running: Optional[int] = None
        #: whether the step now running is timed (the step before it ran the same candidate)
        self.timing = False
        self._starting = False
        #: the candidate kept after the trial (None: no trial, or not yet over)
        self.chosen: Optional[int] = None
        #: the timed steps each candidate runs in the trial (``trial_samples`` of the traced step, rank 0's choice)
        self.samples = 2

    def __call__(self) -> None:
        step = self._step()
        if step is None:
            return
        self.seen += 1
        if self.seen == self.after:
            self.since = time.perf_counter()
            if step.trace is None:
                self.own = step.trace = Trace()
        elif self.seen == self.after + 1:
            spans = [s for s in step.trace.spans if s.start >= self.since] if step.trace is not None else []
            if self.own is not None and step.trace is self.own:
                step.trace = None
            self.own = None
            receives = [s.duration for s in spans if s.kind == "recv"]
            took = time.perf_counter() - step.started  # this step so far: its forwards and backwards
            parts = self.gather((action_samples(spans), min(receives) if receives else None, action_overhead(spans),
                                 took))
            self.refined, self.samples = self.on_rank0(
                lambda: (self._decide(parts, step.n_stages), trial_samples(max(part[3] for part in parts))))
            self.auto.update(self.refined)
            step.reschedule()
            key = self.auto.last
            tried = len(self.auto.close(key)) if key is not None else 0
            if tried > 1:
                order = (list(range(tried)) + list(range(tried - 1, -1, -1))) * (self.samples // 2)
                self.trial = trial_steps(order)
                self._starting = True  # the first candidate runs from the next step on (see ``ended``)

    def ended(self) -> None:
        """A step is over (``Step.after_step``: after the agreement at its end, which waits for every process, so
        a step's time is the slowest process's): the trial's next candidate, timed from the step's first forward
        to here, not what the caller ran between steps."""
        step = self._step()
        if step is None:
            return
        if self._starting:
            self._starting = False
            self._next(step)
        elif self.running is not None:
            if self.timing:
                self.times.setdefault(self.running, []).append(time.perf_counter() - step.started)
            self._next(step)

    def _next(self, step: Any) -> None:
        """Run the next candidate of the trial, or keep the fastest once every one has run; the step's rows are
        rebuilt only where the candidate changes, so a timed step runs its order as steps in a row do."""
        before = self.auto.pick
        if self.trial:
            self.running, self.timing = self.trial.pop(0)
            self.auto.pick = self.running
        else:
            self.running, self.timing = None, False
            parts = self.gather(self.times)
            self.chosen = self.auto.pick = self.on_rank0(lambda: fastest(parts))
        if self.auto.pick != before:
            step.reschedule()

    def _decide(self, parts: Sequence[Tuple[Samples, Optional[float], List[float], float]], stages: int) -> Costs:
        merged: Samples = {}
        for samples, _, _, _ in parts:
            for key, times in samples.items():
                merged.setdefault(key, []).extend(times)
        base = self.auto.costs or Costs.unit(stages)
        overheads = [o for _, _, extra, _ in parts for o in extra]
        return base.measured(merged, [t for _, t, _, _ in parts if t is not None], overheads)


def quickest(times: Sequence[Sequence[float]]) -> float:
    """A candidate's step time from every process's times of its steps (``times[process][k]``, the k-th step on
    each alike): each step as long as its slowest process took (a step ends when its last process does), and of
    those the quickest.

    The host only ever adds to a step (another thread on the core, a socket's
    stall), never takes from what the step's work needs, so the quickest step is
    the one least disturbed. Steps of milliseconds on shared cores spread over
    2x, and often in two modes (quick, and slowed by a stall); a median lands
    in whichever mode held half of a candidate's steps. Measured on trials of
    1F1B against zero-bubble 13-26% slower (2-process gloo job, m = 4 and 8,
    200 trials): with 24 steps each the lower median kept the slower one in 15,
    the quickest step in none.
    """
    return min(max(step) for step in zip(*times)) if times else math.inf


def fastest(parts: Sequence[Dict[int, List[float]]]) -> int:
    """The candidate whose ``quickest`` step took least, from every process's step times per candidate."""
    candidates = set().union(*parts) if parts else set()
    if not candidates:
        return 0
    return min(sorted(candidates), key=lambda c: quickest([p[c] for p in parts if p.get(c)]))


def attach_auto(step: Any, layers: Sequence[Any], balance: Sequence[int], max_activations: Optional[int], *,
                gather: Callable[[Any], List[Any]] = _alone,
                on_rank0: Callable[[Callable[[], Any]], Any] = _here) -> Optional[Refiner]:
    """Where ``step`` runs ``schedule="auto"``: its schedule becomes an ``AutoSchedule`` costed by the profile's
    ``layers`` cut by ``balance``, refined after the first steps (see ``Refiner``). None for any other schedule."""
    if not is_auto(step.schedule):
        return None
    auto = AutoSchedule(Costs.from_layers(layers, balance), max_activations, step.placement)
    step.schedule = auto
    refiner = Refiner(auto, step, gather=gather, on_rank0=on_rank0)
    step.after_backward.append(refiner)
    step.after_step.append(refiner.ended)
    return refiner
