"""``Posting``: the receives of one link's incoming messages, posted in the link's order as early as can be.

A receive is posted as soon as its shapes are known: a gradient's at once (it has the shapes of the activation
this process sent), an activation's once its header is in, or at once where its shapes are predicted
(``predicted``), its flag then saying whether a header and more tensors follow. A class of its own beside
``p2p.P2PChannel``, which issues the link's operations and its sends: what is posted depends on what crossed before
(``Shapes``) and on how far the peer's headers and flags have come, which no send waits for.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..runtime.schedule.messages import Message
from . import predicted
from .headers import HEADER, decode
from .predicted import Plan
from .shapes import Shapes
from .tags import Route

__all__ = ["Posted", "Posting"]

#: waits for receives of a message, raising the channel's error where its peer does not deliver
Wait = Callable[[List[Any], Message], None]


class Posted:
    """The receives of one incoming message: a gradient's tensors; an activation's header, then its tensors; or its
    predicted slots, then, where it differs, its header and the tensors they did not carry (``predicted``)."""

    __slots__ = ("started", "done", "known", "header", "shapes", "works", "bufs", "late")

    def __init__(self) -> None:
        self.started = False
        self.done = False  # every receive of the message is posted
        self.known: Optional[Plan] = None  # the prediction the slots were posted for
        self.header: Optional[Tuple[Any, torch.Tensor]] = None
        self.shapes: Optional[Plan] = None  # what crossed (the prediction itself where it held)
        self.works: List[Any] = []
        self.bufs: List[torch.Tensor] = []  # a gradient's tensors, or the predicted slots
        self.late: List[torch.Tensor] = []  # the tensors posted once the header was in


class Posting:
    """The receives of the messages from ``peer`` on one link, for ``P2PChannel`` (see the module's docstring)."""

    def __init__(self, peer: int, *, rank: int, shapes: Shapes, device: torch.device, comm_device: torch.device,
                 header_group: Any, side_group: Any, flag: bool, wait: Wait) -> None:
        self.peer = peer
        self.rank = rank
        self.shapes = shapes
        self.comm_device = comm_device
        self.device = device
        self._moves = device != comm_device  # what arrives is copied to ``device``
        self._alone = flag and not self._moves  # a tensor alone as predicted is its buffer's view (``value``)
        #: where headers travel (the gloo twin beside nccl), None: in the link's order
        self.header_group = header_group
        #: a predicted activation's flag travels in-band (gloo), a changed one's header and tensors on
        #: ``side_group``; else its header on ``header_group`` says it
        self.flag = flag
        self.side_group = side_group
        self.wait = wait
        self.routes: Sequence[Route] = ()
        self.posted: Dict[int, Posted] = {}
        self._flagged: Deque[int] = collections.deque()  # predicted activations whose flag is not read yet, in order

    def begin(self, routes: Sequence[Route]) -> None:
        """A step whose messages on this link have ``routes``."""
        self.routes = routes
        self.clear()

    def clear(self) -> None:
        """Forget every receive posted (a step ended, or failed)."""
        self.posted.clear()
        self._flagged.clear()

    def post(self, i: int, *, block: bool) -> bool:
        """Post the receives of incoming message ``i``; False where that needs what is not in yet and not ``block``
        (an activation's header or flag, or the gradient of an activation not sent yet)."""
        posted = self.posted.get(i)
        if posted is None:
            posted = self.posted[i] = Posted()
        elif posted.done:
            return True
        r = self.routes[i]
        if not r.forward:
            sent = self.shapes.sent(r.at)
            if sent is None:
                if not block:
                    return False
                raise RuntimeError(f"pipeddp: rank {self.rank} expects the gradient of micro-batch {r.m.mb} from "
                                   f"rank {self.peer} before it sent that activation")
            cd = self.comm_device
            posted.bufs = bufs = [torch.empty(s, dtype=d, device=cd) for d, s in sent.grads]
            posted.works, posted.done = self._irecv(bufs, r.tag + 1), True
            return True
        known = posted.known
        if not posted.started:  # the predicted slots at once (a flag of their own first, where it goes apart)
            posted.started, known = True, self.shapes.predicted(r.at)
            if known is not None:
                posted.known = known
                posted.bufs = bufs = predicted.buffers(known, self.flag, self.comm_device)
                posted.works = self._irecv(bufs, r.tag + known.first if self.flag else r.tag + 1)
                if self.flag:  # the flag is read when the activation is taken (``resolve``): the next one at once
                    self._flagged.append(i)
                    posted.done = True
                    return True
            self._post_header(posted, r)
        if posted.shapes is None and posted.header is not None:
            work, buf = posted.header
            if not self._ready(work, r.m, block):
                return False
            posted.shapes = self._crossed(known, buf if buf.device.type == "cpu" else buf.cpu())
        if posted.shapes is None:  # post reads every activation's header or flag before its tensors
            raise RuntimeError(f"pipeddp: the header of micro-batch {r.m.mb} for stage {r.m.stage} was never read")
        self.shapes.crossed(r.at, posted.shapes)
        self._post_late(posted, r, known, posted.shapes, None)
        posted.done = True
        return True

    def arrived(self, i: int) -> Posted:
        """Incoming message ``i`` once all of it is in (every receive of it posted first)."""
        if self.routes[i].forward:
            self.resolve(i)
        posted = self.posted.pop(i)
        self.wait(posted.works, self.routes[i].m)
        return posted

    def resolve(self, upto: int) -> None:
        """Read the flags of the predicted activations up to message ``upto``, in the link's order (waiting for
        their tensor that carries it), and post the receives of each changed one's header and of the tensors its
        predicted receives did not carry, on ``side_group``: the peer sent them there right after its predicted
        slots. In the link's order at both ends, so they meet under NCCL's rules too (the peer reads the flags that
        come before a changed activation of its own before it sends that one's header)."""
        flagged = self._flagged
        while flagged and flagged[0] <= upto:
            j = flagged.popleft()
            posted, r = self.posted[j], self.routes[j]
            known = posted.known
            assert known is not None  # only predicted activations are flagged
            # the flag's receive, waited for here, is not waited for again
            self.wait([posted.works.pop(0 if known.inline is None else known.inline)], r.m)
            shapes = known
            if predicted.raised(known, posted.bufs):
                buf = torch.empty((HEADER,), dtype=torch.int64)
                self.wait(self._irecv([buf], r.tag, self.side_group), r.m)
                shapes = self._crossed(known, buf)
                self._post_late(posted, r, known, shapes, self.side_group)
            posted.shapes = shapes
            self.shapes.crossed(r.at, shapes)

    def value(self, i: int, posted: Posted) -> Any:
        """What ``arrived`` message ``i`` carries, on the channel's device: an activation as its sender gave it, or
        a gradient per tensor of the activation (None where that takes none)."""
        r = self.routes[i]
        if r.forward:
            shapes, known = posted.shapes, posted.known
            assert shapes is not None  # every activation's header or flag is read before it arrives
            if shapes is known and self._alone and shapes.alone:  # the common case: a tensor that carried its flag
                return posted.bufs[0].as_strided(*shapes.body)
            tensors = posted.late if known is None else \
                predicted.taken(known, self.flag, posted.bufs) if shapes is known else \
                predicted.unpack(known, shapes, posted.bufs, posted.late, self.flag)
            if self._moves:
                tensors = [t.to(self.device) for t in tensors]
            return shapes.value(tensors)
        bufs = posted.bufs if not self._moves else [b.to(self.device) for b in posted.bufs]
        return self.shapes.take(r.at).gradient(bufs)

    def _crossed(self, known: Optional[Plan], header: torch.Tensor) -> Plan:
        """The plan of the activation whose ``header`` came in: the prediction itself where it has its shapes."""
        meta = decode(header)
        return known if known is not None and known.meta == meta else predicted.plan(meta)

    def _post_late(self, posted: Posted, r: Route, known: Optional[Plan], shapes: Plan, group: Any) -> None:
        """Post the receives of the tensors of an activation of ``shapes`` that no predicted slot carried (all of
        them where none was predicted), after its header: on ``group``."""
        late = range(len(shapes.specs)) if known is None else predicted.missing(known, shapes)
        cd = self.comm_device
        posted.late = bufs = [torch.empty(shapes.specs[k][1], dtype=shapes.specs[k][0], device=cd) for k in late]
        posted.works += [dist.irecv(b, self.peer, group=group, tag=r.tag + 1 + k) for b, k in zip(bufs, late)]

    def _irecv(self, bufs: Sequence[torch.Tensor], tag: int, group: Any = None) -> List[Any]:
        """Post the receives of ``bufs``, the first with ``tag``, the next with ``tag + 1`` and so on."""
        peer = self.peer
        return [dist.irecv(b, peer, group=group, tag=tag + k) for k, b in enumerate(bufs)]

    def _post_header(self, posted: Posted, r: Route) -> None:
        """Post the receive of message ``r``'s header: on ``header_group``, else in the link's order."""
        buf = torch.empty((HEADER,), dtype=torch.int64, device=self.comm_device if self.header_group is None else "cpu")
        posted.header = (self._irecv([buf], r.tag, self.header_group)[0], buf)

    def _ready(self, work: Any, m: Message, block: bool) -> bool:
        """Whether ``work`` (a receive of message ``m``) is in: waited for where ``block``, else looked at."""
        if not block and not work.is_completed():
            return False
        self.wait([work], m)
        return True
