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
from .headers import HEADER, Meta, decode, specs, wants_grad
from .shapes import Shapes
from .tags import activation_of, tag

__all__ = ["Posted", "Posting"]

#: waits for receives of a message, raising the channel's error where its peer does not deliver
Wait = Callable[[List[Any], Message], None]


class Posted:
    """The receives of one incoming message: a gradient's tensors; an activation's header, then its tensors; or its
    predicted slots, then, where it differs, its header and the tensors they did not carry (``predicted``)."""

    def __init__(self) -> None:
        self.started = False
        self.done = False  # every receive of the message is posted
        self.known: Optional[Meta] = None  # the prediction the slots were posted for
        self.header: Optional[Tuple[Any, torch.Tensor]] = None
        self.meta: Optional[Meta] = None
        self.works: List[Any] = []
        self.bufs: List[torch.Tensor] = []  # a gradient's tensors, or the predicted slots
        self.late: List[torch.Tensor] = []  # the tensors posted once the header was in


class Posting:
    """The receives of the messages from ``peer`` on one link, for ``P2PChannel`` (see the module's docstring)."""

    def __init__(self, peer: int, *, rank: int, shapes: Shapes, comm_device: torch.device, header_group: Any,
                 side_group: Any, flag: bool, wait: Wait) -> None:
        self.peer = peer
        self.rank = rank
        self.shapes = shapes
        self.comm_device = comm_device
        #: where headers travel (the gloo twin beside nccl), None: in the link's order
        self.header_group = header_group
        #: a predicted activation's flag travels in-band (gloo), a changed one's header and tensors on
        #: ``side_group``; else its header on ``header_group`` says it
        self.flag = flag
        self.side_group = side_group
        self.wait = wait
        self.order: Sequence[Message] = ()
        self.posted: Dict[int, Posted] = {}
        self._flagged: Deque[int] = collections.deque()  # predicted activations whose flag is not read yet, in order

    def begin(self, order: Sequence[Message]) -> None:
        """A step whose messages on this link are ``order``."""
        self.order = order
        self.clear()

    def clear(self) -> None:
        """Forget every receive posted (a step ended, or failed)."""
        self.posted.clear()
        self._flagged.clear()

    def post(self, i: int, *, block: bool) -> bool:
        """Post the receives of incoming message ``i``; False where that needs what is not in yet and not ``block``
        (an activation's header or flag, or the gradient of an activation not sent yet)."""
        m = self.order[i]
        posted = self.posted.setdefault(i, Posted())
        if posted.done:
            return True
        if m.kind == "B":
            meta = self.shapes.sent(activation_of(m.kind, m.stage, m.mb))
            if meta is None:
                if not block:
                    return False
                raise RuntimeError(f"pipeddp: rank {self.rank} expects the gradient of micro-batch {m.mb} from rank "
                                   f"{self.peer} before it sent that activation")
            posted.bufs = [torch.empty(s, dtype=d, device=self.comm_device) for d, s in specs(meta) if wants_grad(d)]
            posted.works, posted.done = self._irecv(posted.bufs, m, range(1, 1 + len(posted.bufs))), True
            return True
        known = posted.known
        if not posted.started:  # the predicted slots at once (a flag of their own first, where it goes apart)
            posted.started, known = True, self.shapes.predicted((m.stage, m.mb))
            if known is not None:
                posted.known, posted.bufs = known, predicted.buffers(known, self.flag, self.comm_device)
                posted.works = self._irecv(posted.bufs, m, predicted.slots(known, self.flag, len(posted.bufs)))
                if self.flag:  # the flag is read when the activation is taken (``resolve``): the next one at once
                    self._flagged.append(i)
                    posted.done = True
                    return True
            self._post_header(posted, m)
        if posted.meta is None and posted.header is not None:
            work, buf = posted.header
            if not self._ready(work, m, block):
                return False
            posted.meta = decode(buf if buf.device.type == "cpu" else buf.cpu())
        if posted.meta is None:  # post reads every activation's header or flag before its tensors
            raise RuntimeError(f"pipeddp: the header of micro-batch {m.mb} for stage {m.stage} was never read")
        self.shapes.crossed((m.stage, m.mb), posted.meta)
        have = specs(posted.meta)
        late = range(len(have)) if known is None else predicted.missing(known, posted.meta)
        posted.late = [torch.empty(have[k][1], dtype=have[k][0], device=self.comm_device) for k in late]
        posted.works += self._irecv(posted.late, m, [1 + k for k in late])
        posted.done = True
        return True

    def arrived(self, i: int) -> Posted:
        """Incoming message ``i`` once all of it is in (every receive of it posted first)."""
        if self.order[i].kind == "F":
            self.resolve(i)
        posted = self.posted.pop(i)
        self.wait(posted.works, self.order[i])
        return posted

    def resolve(self, upto: int) -> None:
        """Read the flags of the predicted activations up to message ``upto``, in the link's order (waiting for
        their tensor that carries it), and post the receives of each changed one's header and of the tensors its
        predicted receives did not carry, on ``side_group``: the peer sent them there right after its predicted
        slots. In the link's order at both ends, so they meet under NCCL's rules too (the peer reads the flags that
        come before a changed activation of its own before it sends that one's header)."""
        while self._flagged and self._flagged[0] <= upto:
            j = self._flagged.popleft()
            posted, m = self.posted[j], self.order[j]
            known = posted.known
            assert known is not None  # only predicted activations are flagged
            self.wait([posted.works.pop(predicted.flag_index(known))], m)  # a gloo receive is not waited twice
            meta = known
            if predicted.raised(known, posted.bufs):
                buf = torch.empty((HEADER,), dtype=torch.int64)
                self.wait(self._irecv([buf], m, [0], self.side_group), m)
                meta = decode(buf)
                have, late = specs(meta), predicted.missing(known, meta)
                posted.late = [torch.empty(have[k][1], dtype=have[k][0], device=self.comm_device) for k in late]
                posted.works += self._irecv(posted.late, m, [1 + k for k in late], self.side_group)
            posted.meta = meta
            self.shapes.crossed((m.stage, m.mb), meta)

    def value(self, i: int, posted: Posted, device: torch.device) -> Any:
        """What ``arrived`` message ``i`` carries, on ``device``: an activation as its sender gave it, or a gradient
        per tensor of the activation (None where that takes none)."""
        m = self.order[i]
        if m.kind == "F":
            container, members = posted.meta if posted.meta is not None else (0, ())
            tensors = posted.late if posted.known is None else \
                predicted.unpack(posted.known, (container, members), posted.bufs, posted.late, self.flag)
            if device != self.comm_device:
                tensors = [t.to(device) for t in tensors]
            if container == 0 and members[0][0] is not None:  # a tensor alone, the common case
                return tensors[0]
            got = iter(tensors)
            value = [None if d is None else next(got) for d, _ in members]
            if container == 0:
                return value[0]
            return tuple(value) if container == 1 else list(value)
        grads = iter(posted.bufs if device == self.comm_device else [b.to(device) for b in posted.bufs])
        return [next(grads) if wants_grad(d) else None for d, _ in
                specs(self.shapes.take(activation_of(m.kind, m.stage, m.mb)))]

    def _irecv(self, bufs: Sequence[torch.Tensor], m: Message, slots: Sequence[int], group: Any = None) -> List[Any]:
        return [dist.irecv(b, self.peer, group=group, tag=tag(m.kind, m.stage, m.mb, k)) for b, k in zip(bufs, slots)]

    def _post_header(self, posted: Posted, m: Message) -> None:
        """Post the receive of message ``m``'s header: on ``header_group``, else in the link's order."""
        buf = torch.empty((HEADER,), dtype=torch.int64, device=self.comm_device if self.header_group is None else "cpu")
        posted.header = (self._irecv([buf], m, [0], self.header_group)[0], buf)

    def _ready(self, work: Any, m: Message, block: bool) -> bool:
        """Whether ``work`` (a receive of message ``m``) is in: waited for where ``block``, else looked at."""
        if not block and not work.is_completed():
            return False
        self.wait([work], m)
        return True
