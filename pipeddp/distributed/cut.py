"""Closing a rank's gloo connections at once (``cut``), so that every peer waiting on this rank fails there now.

gloo closes every connection of a group's context when a wait posted there expires (it signals the timeout to
every pair of the context, ``unbound_buffer.cc``). So the cut posts a receive that nothing ever sends and waits
1 ms for it: on a connected pair the receive is posted at once, the wait expires, and the whole group is closed.

On a group made lazily (``lazy``) a pair of ranks connects when one of them first posts something to the other,
and the posting itself waits for the connection: gloo makes one side of each pair (by the listening addresses)
connect to the other, which only accepts. Where this rank is the connecting side, the connection is made at once
(the peer's listener accepts it whatever the peer is doing); where it is the accepting side of a pair never
connected, the posting waits until the peer connects, which a peer that has cut already, or never talks to this
rank, never does: up to the group's timeout. Such a pair holds nothing to close and nobody waits on it through
this rank's connections, so the cut posts each receive on a thread of its own and moves on to the next peer
when the posting has not returned within ``POSTING`` seconds (the thread is left behind: the next wait that
expires, or the group's timeout, ends it). Where no peer's receive could be posted, a receive from any rank
(posted on the group's context, no pair's connection awaited) is waited 1 ms for instead, which closes the group
all the same: a wait of this process's own on a pair never connected (the lazy groups' watcher cuts this rank's
groups for that, ``lazy``) fails there at once.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist

from .p2p import spare_tag

__all__ = ["cut", "CUT_TAG", "POSTING"]

#: the tag of the receive that cuts a gloo group's connections (nothing ever sends it)
CUT_TAG = spare_tag(31)
#: how long the cut lets the posting of its receive from one peer take before it takes that pair for one never
#: connected, waiting for the peer (a posting on a connected pair takes microseconds; connecting, milliseconds)
POSTING = 0.25


def cut(groups: Sequence[Any], rank: int) -> None:
    """Close this process's connections of every gloo group in ``groups`` (see the module's docstring): every
    operation posted there, here or by a peer with this process, fails at once. The groups are unusable after."""
    seen: List[Any] = []
    for group in groups:
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER or any(group is g for g in seen):
            continue
        seen.append(group)
        try:
            if dist.get_backend(group) != "gloo":
                continue
            members = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):  # destroyed: nothing left to close
            continue
        if rank in members:
            cut_group(group, [r for r in members if r != rank])


def cut_group(group: Any, peers: Sequence[int], posting: float = POSTING) -> bool:
    """Wait 1 ms for the cut's receive from each of ``peers`` in turn, until one such wait expires: gloo closes the
    group's every connection then (True). A receive from a peer that cut its connections first fails at once, on
    that closed connection alone, and leaves this process's others open (a rank blocked on one of them, in a
    collective that the peers' cuts do not reach, would wait out the timeout): so the next peer is tried; so is
    the next where the posting waits for a pair never connected (``posting`` seconds); where none was posted, a
    receive from any rank (``_expire_any``). False where no wait expired: the group was closed already."""
    for peer in peers:
        posted: Dict[str, Any] = {}
        thread = threading.Thread(target=_post, args=(group, peer, posted), name="pipeddp-cut", daemon=True)
        thread.start()
        thread.join(posting)
        if "work" not in posted:  # a pair never connected (still waiting), or closed already (it raised)
            continue
        try:
            posted["work"].wait(timedelta(milliseconds=1))
        except (RuntimeError, ValueError) as exc:
            if "Timed out" in str(exc):  # the wait expired: every connection is closed (no need to try the rest)
                return True
            continue  # that peer's connection was closed already (or closed while waiting): try the next
        return True
    return _expire_any(group)


def _expire_any(group: Any) -> bool:
    """Wait 1 ms for a receive from any rank of ``group``: gloo posts it on the group's context, not on a pair, so
    its posting never waits for a connection, and the wait expiring closes every pair of the context, those being
    connected included: a thread of this process waiting to accept a peer's connection fails there at once. True
    where the wait expired (False: the group is closed already, or destroyed)."""
    try:
        group.recv_anysource([torch.empty(1)], CUT_TAG).wait(timedelta(milliseconds=1))
    except (RuntimeError, ValueError) as exc:
        return "Timed out" in str(exc)
    return False  # something was sent with the cut's tag: nothing of pipeddp's


def _post(group: Any, peer: int, posted: Dict[str, Any]) -> None:
    """Post the cut's receive from ``peer`` into ``posted["work"]`` (on a thread: see ``cut_group``). The receive is
    posted on the process group object, as ``dist.irecv`` posts it, but past whatever wraps ``dist.irecv`` to order
    the pipeline's messages (NCCL's one stream per pair of ranks, as the tests emulate it on gloo, queues a receive
    behind the pair's earlier operations and waits for it on a thread: there this wait would expire on the queue,
    and the connections would stay open). It is no message of the pipeline and must act at once."""
    try:
        posted["work"] = group.recv([torch.empty(1)], dist.get_group_rank(group, peer), CUT_TAG)
    except Exception:  # noqa: BLE001 - a connection closed already (or the group's timeout): nothing to post on
        pass
