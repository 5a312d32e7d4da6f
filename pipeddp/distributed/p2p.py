"""``P2PChannel``: the transport between stages that live in different processes, right under NCCL's rules.

Same two calls as ``LocalChannel`` (``send(kind, stage, mb, value)``, ``recv(kind, stage, mb)``), over
``torch.distributed`` point-to-point messages. One channel links this process to one other process of its pipeline,
both ways: with virtual stages the same two processes exchange activations and gradients of several stages, told
apart by the receiving stage.

**Order, not tags, pairs messages.** NCCL ignores tags: between two ranks it pairs the n-th send with the n-th
receive, and runs the operations of the pair one after another on one stream, both directions together (torch's
ProcessGroupNCCL gives every pair of ranks a communicator and stream of its own for single sends and receives; the
process group is not bound to a device with ``device_id``, which may make them share the group's one). So both ends
of a channel issue their operations in one order, which both compute from the schedule before the step
(``crossings``; ``begin`` hands it to the channel)::

    link order:   F0->1  F1->1  B0->0  F2->1  B1->0 ...
    rank 0:       send   send   recv   send   recv  ...   (a receive is posted before any later send)
    rank 1:       recv   recv   send   recv   send  ...

A send is issued when its action has produced it, after every receive that comes before it in the link's order has been
posted; a receive is posted as early as the order and its shapes allow (``Ordering.advance``, on every call;
``posting.Posting`` posts, from the shapes ``shapes.Shapes`` keeps), so what a stage waits for is usually there
already. A process with several links issues the operations of all of them in one order for the whole pipeline
(``Ordering``, from ``in_order``), so it stays right even where every send and receive of a rank, to any peer, runs on
one stream. Tags are still set (gloo honours them, and a message that went astray then waits instead of landing in the
wrong buffer), but nothing depends on them.

An activation crosses as a small int64 *header* (container, dtypes and shapes; a member may be None) followed by its
tensors, whose receives are posted once the header is in. A header is a host value at both ends, so on an nccl job it
travels over the pipeline's gloo twin (``header_group``, ``groups.host_group``; paired by tag, no place in the link's
order): over nccl the copies to and from the GPU would each wait for the stream's queued work. Gradients need no
header: they have the shapes of the activation this process sent. Where every rank's batch has the shapes of the
previous call of its kind (``Agreement.repeated``, told every rank alike), both ends *predict* each activation from
what crossed at the same (stage, micro-batch) in that call (``begin(..., key, repeat)``) and its receives are posted
at once. What crosses may still depend on the input's values (transformers' attention builds a mask only for a
micro-batch with padding), so the sender flags whether the activation is the predicted one, and one that differs
fills the predicted receives and follows with its header and the tensors they did not carry, at no round trip
(``predicted``). Over gloo the flag is in-band (an element on its smallest tensor) and what follows goes on a gloo
group of its own (``side_group``, the pipeline's), so nothing of a change has a place in the link's order and the
receiver posts every predicted receive at once, reading a flag only when it takes that activation
(``posting.Posting.resolve``; with the flag read before the receives that follow were posted, a run of activations to
one process was posted one by one, and a small message sent after one waited for the receiver's next call; what
either costs is in benchmarks/README.md, ``schedules.py``). Both ends issue the side group's operations in the link's
order too (a process reads the flags that come before a changed activation of its own before it sends that one's
header), so they meet under NCCL's rules as well. Over nccl the twin's header is the flag, and a changed activation's
tensors follow in the link's order: the receiver reads the header before it posts later receives.

Sends are asynchronous (``isend``); a gloo send completes once the peer has posted its receive and the data has
crossed. Over gloo a small one (up to ``EAGER_BYTES``) is waited for at once, as torch's schedules do, where its
receive is mostly posted ahead (not after an activation whose header the peer reads first): the caller
sleeps while gloo's socket thread writes it rather than computing on the core that thread needs (a small model's
1F1B on 2 shared cores, messages of 1-2 KiB: 11-21% faster at m = 8 in three A/B runs, the same at m = 4). A large
one stays in flight, so the compute goes on while it crosses (resnet50, messages of 256 KiB-4 MiB, each waited for
at once: interleaved 7-11% slower, 1F1B 0-4%, in A/B runs in one job). No deadlock in waiting: the peer posts its
receive of message n before any later operation of the link's order (``catch_up``), and all it may wait for first
came before n. Over NCCL a wait would hold the compute stream, so ``flush`` waits at the step's end. A failed step
leaves operations posted that no later message may meet, so the channel refuses further steps (``fail``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..runtime.channels import describe
from ..runtime.schedule.messages import Message
from . import predicted
from .headers import encode, flatten, meta_of
from .ordering import Ordering
from .posting import Posting
from .predicted import Plan
from .shapes import Shapes
from .tags import Route, routes, spare_tag

__all__ = ["P2PChannel", "PeerError", "Ordering", "spare_tag"]


class PeerError(RuntimeError):
    """A neighbouring process did not deliver (it died, stalled or timed out), or an earlier step broke the link."""


#: over gloo, a message of at most this many bytes is waited for as soon as it is sent (see the module's docstring)
EAGER_BYTES = 64 << 10
#: a send in flight with the tensors it sends (kept alive until it completes)
Sent = Tuple[Any, torch.Tensor]


class P2PChannel:
    """Messages to and from the stages held by ``peer`` (a global rank), both ways, in the link's order."""

    def __init__(self, peer: int, *, rank: int, stage: int, peer_stage: int, device: torch.device,
                 comm_device: torch.device, timeout: timedelta, header_group: Any = None,
                 side_group: Any = None) -> None:
        self.peer = peer
        #: the gloo group the headers travel on where the tensors' backend keeps them on a device (see the module's
        #: docstring); None: the tensors' group (the default), headers in the link's order
        self.header_group = header_group
        #: over gloo, the group (not the tensors') on which a predicted activation that differs sends its header and
        #: the tensors the predicted receives did not carry, so that no receive waits for a flag (module docstring)
        self.side_group = side_group
        self.rank = rank
        #: the pipeline positions (device rows) of this process and of the peer
        self.stage = stage
        self.peer_stage = peer_stage
        self.device = device
        self.comm_device = comm_device
        self.timeout = timeout
        self._order: Sequence[Message] = ()
        self._routes: List[Route] = []
        self._index: Dict[Tuple[bool, str, int, int], int] = {}
        #: the routes of the orders this channel was given (by the order's id, the order kept so the id stays its own)
        self._known_orders: Dict[int, Tuple[Sequence[Message], List[Route], Dict[Tuple[bool, str, int, int], int]]] = {}
        self._next = 0  # the first message of the order whose operations are not all issued yet
        #: the activations' shapes of this step so far and of the last completed step of each kind
        self.shapes = Shapes()
        #: headers sent so far (one per activation whose shapes were not predicted, or not as predicted; over nccl
        #: one per activation, on the gloo twin)
        self.headers = 0
        #: the flag of a predicted activation travels in-band (gloo's buffers are on the host); else the header on
        #: the twin says it; a device buffer without a twin, or gloo without a side group, gets no prediction
        self._flag = header_group is None and side_group is not None
        self._predicts = header_group is not None or (self._flag and comm_device.type == "cpu")
        self._eager = comm_device.type == "cpu"  # gloo: a small send is waited for at once
        self._reads = -1  # the last activation sent whose header the peer reads before it posts the next message
        #: per message of the order, the buffer its flagged tensor is sent from where it is as predicted
        #: (``predicted.staging``): its plan, the buffer and the tensor's place in it
        self._staged: Dict[int, Tuple[Plan, torch.Tensor, torch.Tensor]] = {}
        self._incoming = Posting(peer, rank=rank, shapes=self.shapes, device=device, comm_device=comm_device,
                                 header_group=header_group, side_group=side_group, flag=self._flag, wait=self._wait)
        self._inflight: List[Sent] = []
        self._broken: Optional[str] = None
        #: the order in which this process issues its operations: of all its links, or of this one alone
        self.ordering = Ordering([])

    # -- the step's order --------------------------------------------------------------------------

    def begin(self, order: Sequence[Message], ordering: Optional[Ordering] = None, key: str = "",
              repeat: bool = False) -> None:
        """Start a step whose messages on this link are ``order`` (``crossings`` of its schedule); ``ordering``:
        the order of all the process's links (its ``advance`` then posts ahead, once every channel has begun;
        None: this link's order alone, posted ahead here). ``repeat``: the activations have the shapes of the last
        step of kind ``key`` (every rank was told alike), so none crosses with a header."""
        if self._broken is not None:
            raise _after_failure(self, self._broken)
        self._order, self._routes, self._index = _known(self._known_orders, order, self.stage)
        self._next, self._reads = 0, -1
        self._incoming.begin(self._routes)
        self.shapes.begin(key, repeat and self._predicts)
        self.ordering = ordering if ordering is not None else Ordering([(self, i) for i in range(len(order))])
        if ordering is None:
            self.ordering.advance()

    def _find(self, outgoing: bool, kind: str, stage: int, mb: int) -> int:
        i = self._index.get((outgoing, kind, stage, mb))
        if i is None:
            what = f"{'send' if outgoing else 'receive'} the {describe(kind)} of micro-batch {mb} for stage {stage}"
            raise RuntimeError(f"pipeddp: rank {self.rank} (stage {self.stage}) was asked to {what} "
                               f"{'to' if outgoing else 'from'} rank {self.peer}, which this step's schedule does "
                               "not send on this link")
        return i

    def post_ahead(self, j: int) -> bool:
        """Post the receives of this link's message ``j`` if it is incoming and that needs no wait; False: the
        process's order stops here for now (a send, or a header, flag or activation not in yet)."""
        if self._routes[j].outgoing or not self._incoming.post(j, block=False):
            return False
        self._next = j + 1
        return True

    def post_next(self, j: int) -> None:
        """Post the receives of this link's next message, ``j`` (a send there means the step left its order)."""
        if j != self._next or self._routes[j].outgoing:
            m = self._order[j]
            raise RuntimeError(f"pipeddp: rank {self.rank} must first send {m.kind}{m.mb} of stage {m.stage}: the "
                               "step does not run in the order of its schedule")
        self._incoming.post(j, block=True)
        self._next = j + 1

    # -- receiving ---------------------------------------------------------------------------------

    def _wait(self, works: List[Any], m: Message) -> None:
        try:
            for work in works:
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._error(f"got no {describe(m.kind)} of micro-batch {m.mb} for stage {m.stage} from",
                              exc) from exc

    def recv(self, kind: str, stage: int, mb: int) -> Any:
        """``stage``'s input (``"F"``) or the gradient of its output (``"B"``) for micro-batch ``mb``."""
        i = self._find(False, kind, stage, mb)
        if i >= self._next:
            self.ordering.catch_up(self, i)
            self._incoming.post(i, block=True)
            self._next = i + 1
            self.ordering.issued()
        posted = self._incoming.arrived(i)
        self.ordering.advance()
        return self._incoming.value(i, posted)

    # -- sending -----------------------------------------------------------------------------------

    def send(self, kind: str, stage: int, mb: int, value: Any) -> None:
        """Send ``stage`` its input (``"F"``) or the gradient of its output (``"B"``) for micro-batch ``mb``."""
        i = self._find(True, kind, stage, mb)
        r = self._routes[i]
        if not r.forward:
            self._send_gradient(i, r, value)
        else:
            known = self.shapes.predicted(r.at)
            if known is not None and self._flag and known.fits(value):
                self._send_predicted(i, r, known, value)
            else:
                self._send_activation(i, r, known, value)
        self.ordering.advance()

    def _send_predicted(self, i: int, r: Route, known: Plan, value: Any) -> None:
        """Send an activation as predicted, over gloo: in the predicted slots, the flag not raised (``predicted``);
        the flagged tensor from the buffer kept for message ``i``, its flag element already down."""
        gated = i > 0 and self._reads == i - 1  # the peer reads a header before it posts this message's receives
        self.ordering.catch_up(self, i)
        self.shapes.crossed(r.at, known)
        cd = self.comm_device
        members = [value] if known.tensor else [t for t in value if t is not None]
        f = known.inline
        if f is None:
            out = [predicted.flag_byte(False)] + [t.detach().to(cd).contiguous() for t in members]
        else:
            staged = self._staged.get(i)
            if staged is None or staged[0] is not known:
                staged = self._staged[i] = (known, *predicted.staging(known, cd))
            t = members[f]
            staged[2].copy_(t.detach() if t.requires_grad else t)
            out = [staged[1]] if len(members) == 1 else \
                [staged[1] if k == f else t.detach().to(cd).contiguous() for k, t in enumerate(members)]
        self._reads = -1
        self._issue(i, r.tag + known.first, out, known.flagged_bytes, gated)

    def _send_activation(self, i: int, r: Route, known: Optional[Plan], value: Any) -> None:
        """Send an activation with its header: none was predicted, it is not the predicted one, or its header is
        the flag (over nccl, on the twin)."""
        gated = i > 0 and self._reads == i - 1
        container, members = flatten(value)  # refuses what cannot cross before anything is posted
        actual = predicted.plan(meta_of(container, members))
        if known is not None and known.meta == actual.meta:
            actual = known
        header = encode(container, members) if known is not actual or not self._flag else None
        self.ordering.catch_up(self, i)
        self.shapes.crossed(r.at, actual)
        tensors = [t.detach().to(self.comm_device).contiguous() for t in members if t is not None]
        late = list(range(len(tensors))) if known is None else predicted.missing(known, actual)
        aside = header is not None and known is not None and self._flag  # changed, over gloo
        self.headers += header is not None
        self._reads = i if known is None or not self._flag else -1  # the peer reads its header before going on
        # in the link's order: the header (unless it goes on the twin or the side group), the predicted slots, the
        # tensors they did not carry (over gloo on the side group, after the header)
        works = [_send_header(header, r, self.header_group, self.peer, self.comm_device)] \
            if header is not None and not aside else []
        sent: List[torch.Tensor] = []
        if known is not None:
            sent = predicted.outgoing(known, actual, tensors, self._flag, self.comm_device)
            works += _isend(self.peer, sent, r.tag + (known.first if self._flag else 1))
        if not aside:
            works += [(dist.isend(tensors[k], self.peer, tag=r.tag + 1 + k), tensors[k]) for k in late]
            sent += [tensors[k] for k in late]
        self._issued(i, works, sum(t.nbytes for t in sent), gated)
        if aside and header is not None:  # the peer posts their receives once it has read the flag: in flight
            self._incoming.resolve(i - 1)  # the side group's operations in the link's order at both ends
            self._inflight.append(_send_header(header, r, self.side_group, self.peer, self.comm_device))
            self._inflight += [(dist.isend(tensors[k], self.peer, group=self.side_group, tag=r.tag + 1 + k),
                                tensors[k]) for k in late]

    def _send_gradient(self, i: int, r: Route, value: Any) -> None:
        """Send the gradient of the activation this process received: one per floating tensor, zeros where unused."""
        gated = i > 0 and self._reads == i - 1
        shapes = self.shapes.take(r.at)
        cd = self.comm_device
        out = [(g.detach() if g.requires_grad else g).to(cd).contiguous() if g is not None else
               torch.zeros(s, dtype=d, device=cd) for (d, s), w, g in zip(shapes.specs, shapes.wants, value) if w]
        self.ordering.catch_up(self, i)
        self._issue(i, r.tag + 1, out, shapes.grad_bytes, gated)

    def _issue(self, i: int, tag: int, tensors: Sequence[torch.Tensor], size: int, gated: bool) -> None:
        """Send message ``i``'s ``tensors`` (contiguous, on the channel's device, ``size`` bytes), tagged from
        ``tag`` on."""
        self._issued(i, _isend(self.peer, tensors, tag), size, gated)

    def _issued(self, i: int, works: List[Sent], size: int, gated: bool) -> None:
        """Message ``i``'s operations in the link's order are issued (``works``, of ``size`` bytes of tensors)."""
        self._next = i + 1
        self.ordering.issued()
        if self._eager and not gated and size <= EAGER_BYTES:
            self._delivered(works)  # gloo, a small message: delivered now (see the module's docstring)
        else:
            self._inflight = [s for s in self._inflight if not s[0].is_completed()] + works

    def _delivered(self, works: List[Sent]) -> None:
        """Wait for ``works`` (sends, each with the tensor it sends)."""
        try:
            for work, _ in works:
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._error("could not deliver its messages to", exc) from exc

    def flush(self) -> None:
        """Wait until every send of this channel has completed."""
        try:
            self._delivered(self._inflight)
        finally:
            self._inflight = []

    def finish(self) -> None:
        """End a step that ran to completion: every message of the link's order was sent or received."""
        if self._next != len(self._order) or self._incoming.posted:
            left = self._order[self._next] if self._next < len(self._order) else None
            raise RuntimeError(f"pipeddp: rank {self.rank} ended a step with messages to or from rank {self.peer} "
                               f"left over (the first: {left}): the step did not run its schedule")
        self.shapes.finish()  # what the next step of this kind may take, if its batch repeats

    def fail(self, exc: BaseException) -> None:
        """A step failed: no later step may use this link (see ``begin``; the first failure is the reason given)."""
        if self._broken is None:
            self._broken = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        self._incoming.clear()
        self.shapes.clear()
        self._inflight = []
        self._staged.clear()  # a send of the failed step may still read them

    def _error(self, what: str, exc: BaseException) -> PeerError:
        return PeerError(
            f"rank {self.rank} (stage {self.stage}) {what} rank {self.peer} (stage {self.peer_stage}) "
            f"within {self.timeout.total_seconds():.0f} s: that process died, stalled or timed out ({exc})"
        )


def _known(cache: Dict[int, Tuple[Sequence[Message], List[Route], Dict[Tuple[bool, str, int, int], int]]],
           order: Sequence[Message], stage: int
           ) -> Tuple[Sequence[Message], List[Route], Dict[Tuple[bool, str, int, int], int]]:
    """``order`` with its routes and their index (``tags.routes``), worked out once per order kept in ``cache`` (by
    the order's id; the order kept with them so that the id stays its own; at most 16 orders)."""
    got = cache.get(id(order))
    if got is None or got[0] is not order:
        if len(cache) >= 16:
            cache.clear()
        got = cache[id(order)] = (order, *routes(order, stage))
    return got


def _isend(peer: int, tensors: Sequence[torch.Tensor], tag: int) -> List[Sent]:
    """Send ``tensors`` to ``peer`` in the link's order, the first tagged ``tag``, the next ``tag + 1`` and so on."""
    return [(dist.isend(t, peer, tag=tag + k), t) for k, t in enumerate(tensors)]


def _send_header(header: torch.Tensor, r: Route, group: Any, peer: int, comm_device: torch.device) -> Sent:
    """Post ``header`` (built on the host) of message ``r`` to ``peer``: on ``group`` (a gloo twin or the side group)
    as it is, or where None on the tensors' device (``comm_device``) and group, ahead of its tensors."""
    if group is None:
        header = header.to(comm_device)
    return dist.isend(header, peer, group=group, tag=r.tag), header


def _after_failure(ch: P2PChannel, broken: str) -> PeerError:
    """The error of a step begun on a link whose earlier step failed mid-exchange (``broken``: that failure)."""
    return PeerError(
        f"rank {ch.rank} (stage {ch.stage}) cannot exchange messages with rank {ch.peer} (stage "
        f"{ch.peer_stage}) any more: an earlier step failed in the middle of its exchange "
        f"({broken}). Messages between processes are paired by their order (NCCL ignores tags) and "
        "that step's are still posted, so no later message could be trusted. Restart the job from its last "
        "checkpoint (torchrun --max-restarts=N restarts it by itself; pipeddp.resume picks up the newest)"
    )
