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

__all__ = ["Gathering", "gather_rows", "tree_links", "STAR_UP_TO"]

#: the most members gathered through the first rank directly; a larger group gathers over a tree
STAR_UP_TO = 16


def gather_rows(out: List[torch.Tensor], mine: torch.Tensor, *, group: Any, ranks: Sequence[int], rank: int,
                kind: int, ahead: Optional["Gathering"] = None) -> torch.Tensor:
    """Fill ``out`` (one tensor like ``mine`` per member of ``group``, in the order of ``ranks``, its global ranks)
    with every member's ``mine``; ``rank``: this process's global rank; ``kind``: which gathering (its tag);
    ``ahead``: the same gathering made before (``Gathering``: its receives maybe posted already). Returns the
    table, the rows stacked (``out`` may be empty where that is all the caller wants).

    Every member calls it together, as a collective; a member that never comes leaves the others the process
    group's timeout error.
    """
    gathering = ahead if ahead is not None else Gathering(mine, group=group, ranks=ranks, rank=rank, kind=kind)
    return gathering.finish(out, mine)


class Gathering:
    """One ``gather_rows`` of rows like ``like``, whose receives a member may post ahead of its own row (``post``).

    gloo pairs a send with its receive by a rendezvous: a send whose receive is not posted yet only announces
    itself, and the receiver, once it posts, asks for the data and waits for it, a round trip. A member that
    finishes its part of a step last (the first stage's, after its last backward) and only then posts the receives
    of rows the others sent earlier waits two hops where one would do: posted ahead, those rows arrive while it
    still computes. Only the rows a member takes from others are posted ahead (the first rank's, or in the tree
    its children's); a row it sends, and the table it takes back, keep their places after its own work, so that
    both ends issue their operations in one order, as NCCL's rules want where the rows share a group with the
    pipeline's messages: the caller posts ahead only once every message of its step has been issued
    (``ordering.when_issued``).
    """

    def __init__(self, like: torch.Tensor, *, group: Any, ranks: Sequence[int], rank: int, kind: int) -> None:
        if like.device.type != "cpu":
            raise ValueError(f"gather_rows gathers host values over gloo; got a row on {like.device}")
        self.group, self.ranks, self.rank = group, list(ranks), rank
        self.tag = spare_tag(kind)
        n, self.i = len(self.ranks), self.ranks.index(rank)
        self.tree = n > STAR_UP_TO
        self.table = torch.empty((n, *like.shape), dtype=like.dtype)
        #: (first row, end row, member index) of each block of rows this member takes from another, and its work
        if self.tree:
            children, _, _ = tree_links(n, self.i)
            self._takes = [(self.i + c, min(self.i + 2 * c, n), self.i + c) for c in children]
        else:
            self._takes = [(j, j + 1, j) for j in range(1, n)] if self.i == 0 else []
        self._works: Optional[List[Any]] = None

    def post(self) -> None:
        """Post this member's receives of the others' rows now (once; nothing for a member that takes none)."""
        if self._works is None:
            self._works = [dist.irecv(self.table[a:b], self.ranks[j], group=self.group, tag=self.tag)
                           for a, b, j in self._takes]

    def finish(self, out: List[torch.Tensor], mine: torch.Tensor) -> torch.Tensor:
        """Gather: ``mine`` in, every member's row into ``out``, and the table returned (see ``gather_rows``)."""
        if mine.device.type != "cpu":
            raise ValueError(f"gather_rows gathers host values over gloo; got a row on {mine.device}")
        self.table[self.i].copy_(mine)
        self.post()
        if self.tree:
            self._tree()
        else:
            self._star(mine)
        for row, got in zip(out, self.table):
            row.copy_(got)
        return self.table

    def _star(self, mine: torch.Tensor) -> None:
        """Through the first member: each other member sends it its row and waits for the whole table back."""
        ranks, group, tag, root = self.ranks, self.group, self.tag, self.ranks[0]
        if self.i == 0:
            for work, r in zip(self._works or [], ranks[1:]):
                _wait(work, "no row came from", r)
            sends: List[Any] = [dist.isend(self.table, r, group=group, tag=tag) for r in ranks[1:]]
            for work, r in zip(sends, ranks[1:]):
                _wait(work, "the table could not be sent to", r)
            return
        send: Any = dist.isend(mine.contiguous(), root, group=group, tag=tag)
        recv: Any = dist.irecv(self.table, root, group=group, tag=tag)
        _wait(recv, "no table came from", root)
        _wait(send, "this rank's row could not be sent to", root)

    def _tree(self) -> None:
        """Over a binomial tree of the members in ``ranks`` order: member i takes the rows of i + k (k = 1, 2, 4, ...
        while i % 2k == 0) and passes its rows i .. to i - k at the first k where i % 2k == k; the first member
        sends the whole table back down the same edges, in reverse."""
        ranks, group, tag, table, i = self.ranks, self.group, self.tag, self.table, self.i
        children, parent, k = tree_links(len(ranks), i)
        for work, c in zip(self._works or [], children):
            _wait(work, "no rows came from", ranks[i + c])
        if parent is not None:
            up: Any = dist.isend(table[i:min(i + k, len(ranks))].contiguous(), ranks[parent], group=group, tag=tag)
            _wait(up, "the rows could not be sent to", ranks[parent])
            down: Any = dist.irecv(table, ranks[parent], group=group, tag=tag)
            _wait(down, "no table came from", ranks[parent])
        sends: List[Any] = [dist.isend(table, ranks[i + c], group=group, tag=tag) for c in reversed(children)]
        for work, c in zip(sends, reversed(children)):
            _wait(work, "the table could not be sent to", ranks[i + c])


def _wait(work: Any, what: str, peer: int) -> None:
    """``work.wait()``; a failure names the peer (``what`` rank ``peer``): gloo's own error names an address and
    port, and the rank that waited on a dead peer is the one that can tell the others which rank it was."""
    try:
        work.wait()
    except RuntimeError as exc:
        raise RuntimeError(f"{what} rank {peer}: that process died, stalled or stopped its step ({exc})") from exc


def tree_links(n: int, i: int) -> Tuple[List[int], Optional[int], int]:
    """Member ``i``'s place in ``Gathering``'s binomial tree of ``n`` members: the offsets k of its children (it takes
    the rows of i + k .. i + 2k - 1 from each), its parent's index (None for member 0) and the k of its own subtree
    (it holds rows i .. i + k - 1 when it sends them up). A plain function of (n, i), so that a job of any size
    can be played from it in one process (``benchmarks/scale.py``) with the plan the real gathering follows."""
    k, children = 1, []
    while k < n and i % (2 * k) == 0:
        if i + k < n:
            children.append(k)
        k *= 2
    return children, (i - k if i else None), k  # the loop stops at the first k where i % 2k == k (member 0: never)
