"""``placement="auto"`` and ``virtual_stages="auto"``: the layout whose step plays shortest on the profile's costs.

The placement (round robin or the V) and the number of stages per device
decide which process holds which layers, so they are settled when the engine
is built, before any step runs: unlike the order of the actions (which
``refine`` times on real steps), they cannot be tried on the machine without
moving stages between processes. What is known by then is the profile
(``balance="time"`` with a ``sample``): each layer's forward and backward
seconds. Each candidate layout's schedule is built (for ``"auto"``, its best
order) and played on the costs of its own cut.

The placement: the V where it plays shorter, round robin otherwise (and
without a profile, where every stage costs the same and neither is). On the
2-core host the profile predicted the V 8-9% shorter than round robin for a
language model whose head is a third of its time (measured: 3-11% faster in
the V) and 2% shorter for resnet50 (measured: level within 1-2%).

The stages per device (``VIRTUAL_CHOICES``): a second stage per device
shortens the bubble and doubles the device's actions, and the profile times
compute only; so here every action is also priced at ``ACTION_COST``, what
the engine spends on it beside its compute (both placements run as many
actions, so the price weighs on the number of stages, not on where they sit),
and the fewest stages win a tie.
Without that price the paper put two stages per device ahead of one (2-4%,
and over 5% in another profile) on a model of tens of microseconds per layer,
where they ran twice as slow (2 gloo processes; 1.3x in one process's
threads); with it, one (two profiles, m = 4 and 8). On the models
whose compute the price does not move, the paper put one ahead for a language
model whose head outweighs five blocks (497 against 529 ms at m = 4; measured
529-539 against 573-642), and for resnet50 two at m = 8 in three profiles of
three (12-13% shorter in the two whose figures were kept; measured 6-7%
faster) and at m = 4 two in two profiles of three (2% and 7% shorter) and one
in the third (measured: two 3-4% faster).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

from .actions import PLACEMENTS, ScheduleFn
from .costed import Costs, activation_floor, build, is_auto, makespan
from .registry import get_schedule

__all__ = ["choose_layout", "choose_placement", "VIRTUAL_CHOICES", "ACTION_COST"]

#: the stages per device ``virtual_stages="auto"`` weighs (more were never measured faster than two)
VIRTUAL_CHOICES = (1, 2)
#: seconds an action costs the engine beside its compute, as ``choose_layout`` prices it: between what
#: ``refine.action_overhead`` measured on the 2-core host with stage threads (24-39 us) and with one gloo
#: process per stage (270-450 us)
ACTION_COST = 1e-4


def _span(schedule: Union[str, ScheduleFn], devices: int, chunks: int, virtual_stages: int, costs: Costs,
          placement: str, max_activations: Optional[int]) -> float:
    """The step on paper of ``schedule`` (for ``"auto"``: its best order) in this layout, on ``costs``."""
    plan = build(devices, chunks, virtual_stages, costs, max_activations, placement=placement) \
        if is_auto(schedule) else get_schedule(schedule, devices, chunks, virtual_stages, placement=placement)
    return makespan(plan, costs, devices, placement)


def choose_placement(schedule: Union[str, ScheduleFn], devices: int, chunks: int, virtual_stages: int,
                     costs: Costs, max_activations: Optional[int] = None) -> str:
    """``"v"`` where ``schedule`` (a name) plays shorter in the V than round robin on ``costs`` (one entry per
    stage), else ``"loop"`` (ties included: round robin is the default)."""
    if virtual_stages == 1:
        return "loop"
    spans = {pl: _span(schedule, devices, chunks, virtual_stages, costs, pl, max_activations) for pl in PLACEMENTS}
    return "v" if spans["v"] < spans["loop"] else "loop"


def choose_layout(devices: int, chunks: int, layers: int, costs_of: Callable[[int], Costs], placement: str,
                  max_activations: Optional[int] = None,
                  choices: Sequence[int] = VIRTUAL_CHOICES) -> Tuple[int, str]:
    """``(virtual stages, placement)`` for ``schedule="auto"`` on ``devices`` devices: the layout whose step plays
    shortest on paper, every action priced at ``ACTION_COST`` beside its compute (a tie: the fewest stages per
    device, then round robin); with ``placement="auto"`` two stages per device are weighed in both placements,
    with ``"loop"`` round robin only.

    ``costs_of(v)``: the stage costs of the model (``layers`` layers) cut into ``devices * v`` stages; a choice
    that cannot be cut (fewer layers than stages) or held (``max_activations`` under its floor) is not weighed.
    """
    spans: Dict[Tuple[int, str], float] = {}
    for v in choices:
        if devices * v > layers or (max_activations is not None and max_activations < activation_floor(v)):
            continue
        costs = replace(costs_of(v), overhead=ACTION_COST)
        for pl in PLACEMENTS if placement == "auto" and v > 1 else ("loop",):
            spans[v, pl] = _span("auto", devices, chunks, v, costs, pl, max_activations)
    if not spans:
        raise ValueError(f"no number of stages per device in {tuple(choices)} fits {layers} layers on {devices} "
                         f"devices under max_activations={max_activations}")
    return min(spans, key=lambda key: (spans[key], key[0], key[1] != "loop"))
