"""``schedule.messages.crossings``: the order both ends of a link issue its messages in, checked on paper.

Between processes messages are paired by order (as NCCL pairs them), and the operations of one pair of ranks
run one after another. Here every schedule is walked by every device with the link orders ``crossings`` gives,
under those rules at their strictest: the k-th message of a link completes only after the k-1 before it, and a
device that sends message k first waits until every message it receives before k on that link is in (what the
transport does for an activation's header). No schedule may get stuck.
"""

from typing import Dict, List, Set, Tuple

import pytest

from pipeddp.runtime.schedule import (Action, Kind, Message, Schedule, crossings, forward_only, in_order,
                                      get_schedule, normalize, row_of, stage_count)


def outgoing(a: Action, rows: int, n_stages: int) -> Tuple[str, int, int, int]:
    """The message action ``a`` sends, as (kind, receiving stage, mb, destination row), or None."""
    if a.kind is Kind.F and a.at < n_stages - 1:
        return ("F", a.at + 1, a.mb, row_of(a.at + 1, rows))
    if a.kind.backward and a.at > 0:
        return ("B", a.at - 1, a.mb, row_of(a.at - 1, rows))
    return None


def incoming(a: Action, n_stages: int) -> Tuple[str, int, int]:
    if a.kind is Kind.F and a.at > 0:
        return ("F", a.at, a.mb)
    if a.kind.backward and a.at < n_stages - 1:
        return ("B", a.at, a.mb)
    return None


def walk(schedule: Schedule) -> None:
    """Run every device's row under in-order pairing with ``crossings``' orders; fail if any device gets stuck."""
    schedule = normalize(schedule)
    rows, n_stages = len(schedule), stage_count(schedule)
    links = crossings(schedule)
    where: Dict[Tuple[str, int, int], Tuple[Tuple[int, int], int]] = {}
    for link, order in links.items():
        for k, m in enumerate(order):
            where[(m.kind, m.stage, m.mb)] = (link, k)
    produced: Set[Tuple[Tuple[int, int], int]] = set()
    done = {link: 0 for link in links}  # messages completed per link, in order
    pos = [0] * rows
    local: Set[Tuple[str, int, int]] = set()  # messages between stages of one device
    while any(pos[r] < len(schedule[r]) for r in range(rows)):
        progressed = False
        for link, order in links.items():
            while done[link] < len(order) and (link, done[link]) in produced:
                done[link] += 1
                progressed = True
        for r in range(rows):
            if pos[r] >= len(schedule[r]):
                continue
            a = schedule[r][pos[r]]
            need = incoming(a, n_stages)
            if need is not None and need not in local:
                link, k = where[need]
                if done[link] <= k:
                    continue
            out = outgoing(a, rows, n_stages)
            if out is not None and out[3] == r:
                local.add(out[:3])
            elif out is not None:
                link, k = where[out[:3]]
                order = links[link]
                before = [j for j in range(k) if order[j].dst == r]
                if before and done[link] <= before[-1]:
                    continue  # its header waits: everything it receives before k on this link must be in
                produced.add((link, k))
            pos[r] += 1
            progressed = True
        assert progressed, f"stuck at {[(r, schedule[r][pos[r]]) for r in range(rows) if pos[r] < len(schedule[r])]}"


CASES = [(name, p, m, v) for name in ("gpipe", "1f1b") for p in (2, 3, 4) for m in (1, 2, 3, 4, 8) for v in (1,)]
CASES += [(name, p, m, v) for name in ("interleaved", "zb", "auto") for p in (1, 2, 3, 4) for m in (1, 2, 4, 5, 8)
          for v in (1, 2, 3)]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_schedule_runs_under_in_order_pairing(name, p, m, v):
    schedule = get_schedule(name, p, m, v)
    walk(schedule)
    n_stages = p * v
    for link, order in crossings(schedule).items():
        assert link[0] < link[1]
        for src, dst in (link, link[::-1]):  # each end sends in the order its row runs the actions that send
            mine = [(m_.kind, m_.stage, m_.mb) for m_ in order if m_.src == src]
            row = [outgoing(a, p, n_stages) for a in normalize(schedule)[src]]
            assert mine == [o[:3] for o in row if o is not None and o[3] == dst]


def test_forward_only_steps_and_a_schedule_written_by_hand():
    for p, m, v in ((2, 3, 1), (3, 4, 2), (4, 1, 1)):
        walk(forward_only(p, m, v))  # evaluation (a backward-only step runs in one process only)
    by_hand = [["F0", "F1", "B1", "B0"], ["F0", "F1", "B1", "B0"]]  # backwards in the reverse order
    walk([[(s[0], int(s[1:])) for s in row] for row in by_hand])


def test_the_order_of_one_f_one_b_on_two_devices():
    order: List[Message] = crossings(get_schedule("1f1b", 2, 4))[(0, 1)]
    assert [f"{m.kind}{m.mb}>{m.dst}" for m in order] == [
        "F0>1", "F1>1", "B0>0", "F2>1", "B1>0", "F3>1", "B2>0", "B3>0"]


def test_a_one_device_pipeline_of_virtual_stages_crosses_no_link():
    assert crossings(get_schedule("interleaved", 1, 4, 2)) == {}


def walk_one_stream(schedule: Schedule) -> None:
    """As ``walk``, but every device runs the operations of all its links on one stream, in ``in_order``'s order:
    an operation completes only after every earlier one of both its ends."""
    schedule = normalize(schedule)
    rows, n_stages = len(schedule), stage_count(schedule)
    order = in_order(schedule)
    ops = {r: [m for m in order if r in (m.src, m.dst)] for r in range(rows)}
    at = {(r, (m.kind, m.stage, m.mb)): i for r in ops for i, m in enumerate(ops[r])}
    head = {r: 0 for r in range(rows)}  # operations completed, in order
    produced: Set[Tuple[str, int, int]] = set()
    pos = [0] * rows
    while any(pos[r] < len(schedule[r]) for r in range(rows)):
        progressed = False
        for r in range(rows):  # complete what both ends have reached
            while head[r] < len(ops[r]):
                m = ops[r][head[r]]
                key = (m.kind, m.stage, m.mb)
                other = m.dst if m.src == r else m.src
                if key in produced and head[other] < len(ops[other]) and ops[other][head[other]] == m:
                    head[r] += 1
                    head[other] += 1
                    progressed = True
                else:
                    break
        for r in range(rows):
            if pos[r] >= len(schedule[r]):
                continue
            a = schedule[r][pos[r]]
            need = incoming(a, n_stages)
            if need is not None and (r, need) in at and head[r] <= at[(r, need)]:
                continue
            out = outgoing(a, rows, n_stages)
            if out is not None and out[3] != r:
                k = at[(r, out[:3])]
                earlier_in = [i for i in range(k) if ops[r][i].dst == r]
                if earlier_in and head[r] <= earlier_in[-1]:
                    continue  # its header waits for every earlier receive
                produced.add(out[:3])
            pos[r] += 1
            progressed = True
        assert progressed, f"stuck at {[(r, schedule[r][pos[r]]) for r in range(rows) if pos[r] < len(schedule[r])]}"


@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if c[1] >= 3])
def test_every_schedule_runs_with_one_stream_per_device(name, p, m, v):
    walk_one_stream(get_schedule(name, p, m, v))
