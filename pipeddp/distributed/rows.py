"""Every rank's row of a small table on every rank: how the agreements gather what each rank reports.

The rows are host values (CPU tensors) and travel over gloo (on an nccl job a gloo twin of its group,
``groups.host_group``), as a ping-pong through the group's first rank: each other rank sends it its row and waits
for the whole table back. A gloo all-gather sends both ways at once, and on shared cores its socket thread polls
while the other side writes: a 2-rank all-gather took 0.5-0.6 ms on a 2-core host, a message there and back 0.17
ms; with each process pinned to one core a small model's training step fell from 8.1 to 6.2 ms. Two members
sending their rows to each other at once made that step 27% slower again, for the same reason.

The messages carry tags that no pipeline message has (``p2p.spare_tag``), so on gloo they never meet one.

Beyond ``STAR_UP_TO`` members the first rank would send and receive a message per member, one after another on
its core: the rows then climb a binomial tree to it and the table comes back down the same tree, 2 log2(n)
messages deep and at most log2(n) per rank, as an nccl job's agreements need on their gloo group at scale.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .p2p import spare_tag

__all__ = ["gather_rows", "tree_links", "STAR_UP_TO"]

#: the most members gathered through the first rank directly; a larger group gathers over a tree
STAR_UP_TO = 16


def gather_rows(out: List[torch.Tensor], mine: torch.Tensor, *, group: Any, ranks: Sequence[int], rank: int,
                kind: int) -> None:
    """Fill ``out`` (one tensor like ``mine`` per member of ``group``, in the order of ``ranks``, its global ranks)
    with every member's ``mine``; ``rank``: this process's global rank; ``kind``: which gathering (its tag).

    Every member calls it together, as a collective; a member that never comes leaves the others the process
    group's timeout error.
    """
    if mine.device.type != "cpu":
        raise ValueError(f"gather_rows gathers host values over gloo; got a row on {mine.device}")
    tag, root = spare_tag(kind), ranks[0]
    if len(ranks) > STAR_UP_TO:
        _tree(out, mine, group=group, ranks=list(ranks), rank=rank, tag=tag)
        return
    if rank == root:
        works: List[Any] = [dist.irecv(row, r, group=group, tag=tag) for row, r in zip(out, ranks) if r != root]
        out[0].copy_(mine)
        for work, r in zip(works, ranks[1:]):
            _wait(work, "no row came from", r)
        table = torch.stack(out)
        sends: List[Any] = [dist.isend(table, r, group=group, tag=tag) for r in ranks[1:]]
        for work, r in zip(sends, ranks[1:]):
            _wait(work, "the table could not be sent to", r)
        return
    table = torch.empty((len(ranks), *mine.shape), dtype=mine.dtype)
    send: Any = dist.isend(mine.contiguous(), root, group=group, tag=tag)
    recv: Any = dist.irecv(table, root, group=group, tag=tag)
    _wait(recv, "no table came from", root)
    _wait(send, "this rank's row could not be sent to", root)
    for row, got in zip(out, table):
        row.copy_(got)


def _tree(out: List[torch.Tensor], mine: torch.Tensor, *, group: Any, ranks: List[int], rank: int, tag: int) -> None:
    """``gather_rows`` over a binomial tree of the members in ``ranks`` order: member i takes the rows of i + k
    (k = 1, 2, 4, ... while i % 2k == 0) and passes its rows i .. to i - k at the first k where i % 2k == k; the
    first member sends the whole table back down the same edges, in reverse."""
    n, i = len(ranks), ranks.index(rank)
    table = torch.empty((n, *mine.shape), dtype=mine.dtype)
    table[i].copy_(mine)
    children, parent, k = tree_links(n, i)
    works: List[Any] = [dist.irecv(table[i + c:min(i + 2 * c, n)], ranks[i + c], group=group, tag=tag)
                        for c in children]
    for work, c in zip(works, children):
        _wait(work, "no rows came from", ranks[i + c])
    if parent is not None:
        up: Any = dist.isend(table[i:min(i + k, n)].contiguous(), ranks[parent], group=group, tag=tag)
        _wait(up, "the rows could not be sent to", ranks[parent])
        down: Any = dist.irecv(table, ranks[parent], group=group, tag=tag)
        _wait(down, "no table came from", ranks[parent])
    sends: List[Any] = [dist.isend(table, ranks[i + c], group=group, tag=tag) for c in reversed(children)]
    for work, c in zip(sends, reversed(children)):
        _wait(work, "the table could not be sent to", ranks[i + c])
    for row, got in zip(out, table):
        row.copy_(got)


def _wait(work: Any, what: str, peer: int) -> None:
    """``work.wait()``; a failure names the peer (``what`` rank ``peer``): gloo's own error names an address and
    port, and the rank that waited on a dead peer is the one that can tell the others which rank it was."""
    try:
        work.wait()
    except RuntimeError as exc:
        raise RuntimeError(f"{what} rank {peer}: that process died, stalled or stopped its step ({exc})") from exc


def tree_links(n: int, i: int) -> Tuple[List[int], Optional[int], int]:
    """Member ``i``'s place in ``_tree``'s binomial tree of ``n`` members: the offsets k of its children (it takes
    the rows of i + k .. i + 2k - 1 from each), its parent's index (None for member 0) and the k of its own subtree
    (it holds rows i .. i + k - 1 when it sends them up). A plain function of (n, i), so that a job of any size
    can be played from it in one process (``benchmarks/scale.py``) with the plan the real gathering follows."""
    k, children = 1, []
    while k < n and i % (2 * k) == 0:
        if i + k < n:
            children.append(k)
        k *= 2
    return children, (i - k if i else None), k  # the loop stops at the first k where i % 2k == k (member 0: never)
