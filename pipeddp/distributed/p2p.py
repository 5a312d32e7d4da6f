"""``P2PChannel``: the transport between stages that live in different processes.

Same two calls as ``LocalChannel`` (``send(kind, mb, value)``,
``recv(kind, stage, mb)``), over ``torch.distributed`` point-to-point messages.
One channel links this process to one other process of its pipeline, both
ways: with virtual stages the same two processes exchange activations and
gradients of several stages, told apart by the receiving stage.

An activation crosses as a small int64 *header* (container, dtypes and
shapes) followed by its tensors, so batch sizes may change from step to step
(the receiver cannot know the shape of a last, smaller batch in advance).
Gradients need no header: they have the shapes of the activations the
receiver itself sent, which the channel remembers per (stage, micro-batch).
Every message has its own tag, derived from (kind, stage, micro-batch, slot),
so nothing depends on the order in which messages arrive.

Sends are asynchronous (``isend``): a stage does not wait for its neighbour to
take an activation before it starts the next micro-batch. ``flush`` waits
for the sends still in flight at the end of a step.

Receives are posted ahead, so that what a stage waits for is already there
when it needs it: at the start of a step the runner says which messages its
device will take (``expect``); the header of every activation is received
from then on, the tensors as soon as their header is in, and the receive of
a gradient as soon as the activation it belongs to is sent (its shapes are
known then)::

    step starts:   irecv header F1  irecv header F2 ...        (expect)
    F0 sent:       irecv gradient B0 (shapes of F0)            (send)
    header F1 in:  irecv tensors of F1                          (any later call)
    F1 needed:     wait (usually done)                          (recv)
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..runtime.channels import describe

__all__ = ["P2PChannel", "PeerError"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64]
_HEADER = 64
_CONTAINERS = {torch.Tensor: 0, tuple: 1, list: 2}

Meta = Tuple[int, List[Tuple[torch.dtype, Tuple[int, ...]]]]


class PeerError(RuntimeError):
    """A neighbouring process did not deliver (it died, stalled or timed out)."""


_SLOTS = 5  # bits: the header (slot 0) and up to 31 tensors (as many as a header can describe)
_STAGES = 8  # bits: up to 256 stages
_GENERATIONS = 2  # bits: a failed step moves both sides to the next generation of tags
_MBS = 31 - _SLOTS - 1 - _STAGES - _GENERATIONS  # bits left for the micro-batch


def _tag(kind: str, stage: int, mb: int, slot: int, generation: int = 0) -> int:
    """A message's tag: unique per (kind, receiving stage, micro-batch, tensor slot, generation); fits gloo's
    32 bits. The generation changes when a step fails, so a receive posted ahead for the failed step never takes a
    message of a later one."""
    if not 0 <= stage < 1 << _STAGES or not 0 <= mb < 1 << _MBS:
        raise ValueError(f"cannot tag a message of stage {stage}, micro-batch {mb} between processes: at most "
                         f"{1 << _STAGES} stages and {1 << _MBS} micro-batches per step")
    gen = generation % (1 << _GENERATIONS)
    return (((((mb << _GENERATIONS | gen) << _STAGES) | stage) << 1 | (kind == "B")) << _SLOTS) + slot


def _activation(kind: str, stage: int, mb: int) -> Tuple[int, int]:
    """Which activation a message belongs to: (the stage that takes it as input, micro-batch).

    An activation sent to stage s and the gradient sent back to stage s - 1
    belong to the same one: the gradient has its shapes.
    """
    return (stage + (kind == "B"), mb)


def _flatten(value: Any) -> Tuple[int, List[torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return 0, [value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return _CONTAINERS[type(value)] if type(value) in _CONTAINERS else 1, list(value)
    raise TypeError(
        "between processes a stage must output a tensor or a flat tuple/list of tensors, got "
        f"{type(value).__name__}; restructure the layer at the cut, or cut elsewhere"
    )


def _encode(container: int, tensors: List[torch.Tensor]) -> torch.Tensor:
    fields = [container, len(tensors)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages")
        fields += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(fields) > _HEADER:
        raise TypeError("the activation at this cut has too many tensors or dimensions to send between processes")
    return torch.tensor(fields + [0] * (_HEADER - len(fields)), dtype=torch.int64)


def _decode(header: torch.Tensor) -> Meta:
    f = header.tolist()
    container, n, pos = f[0], f[1], 2
    metas = []
    for _ in range(n):
        dtype, ndim = _DTYPES[f[pos]], f[pos + 1]
        metas.append((dtype, tuple(f[pos + 2:pos + 2 + ndim])))
        pos += 2 + ndim
    return container, metas


def _wants_grad(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


class _Pending:
    """A receive posted ahead: the header of an activation, then its tensors; or a gradient's tensors."""

    def __init__(self, header: Optional[Tuple[Any, torch.Tensor]] = None) -> None:
        self.header = header
        self.meta: Optional[Meta] = None
        self.works: List[Any] = []
        self.bufs: List[torch.Tensor] = []


class P2PChannel:
    """Messages to and from the stages held by ``peer`` (a global rank), both ways."""

    def __init__(self, peer: int, *, rank: int, stage: int, peer_stage: int, device: torch.device,
                 comm_device: torch.device, timeout: timedelta) -> None:
        self.peer = peer
        self.rank = rank
        #: the pipeline positions (devices) of this process and of the peer, for messages
        self.stage = stage
        self.peer_stage = peer_stage
        self.device = device
        self.comm_device = comm_device
        self.timeout = timeout
        self.generation = 0
        self._meta: Dict[Tuple[int, int], Meta] = {}
        self._inflight: List[Tuple[Any, List[torch.Tensor]]] = []
        self._pending: Dict[Tuple[str, int, int], _Pending] = {}
        self._want_grads: set = set()

    def _tag(self, kind: str, stage: int, mb: int, slot: int) -> int:
        return _tag(kind, stage, mb, slot, self.generation)

    # -- sending -----------------------------------------------------------------------------------

    def _isend(self, tensors: List[torch.Tensor], kind: str, stage: int, mb: int, first_slot: int) -> None:
        out = [t.detach().to(self.comm_device).contiguous() for t in tensors]
        for i, t in enumerate(out):
            work = dist.isend(t, self.peer, tag=self._tag(kind, stage, mb, first_slot + i))
            self._inflight.append((work, [t]))
        self._prune()

    def send(self, kind: str, stage: int, mb: int, value: Any) -> None:
        """Send ``stage`` its input (``"F"``) or the gradient of its output (``"B"``) for micro-batch ``mb``."""
        if kind == "F":
            container, tensors = _flatten(value)
            header = _encode(container, tensors)
            key = _activation(kind, stage, mb)
            self._meta[key] = _decode(header)
            self._isend([header] + tensors, kind, stage, mb, 0)
            if ("B", stage - 1, mb) in self._want_grads:
                self._post_gradient(stage - 1, mb)
            self._advance()
            return
        # Gradients of the activation this process received: one per floating tensor, zeros where unused.
        _, metas = self._meta.pop(_activation(kind, stage, mb))
        grads = []
        for (dtype, shape), g in zip(metas, value):
            if _wants_grad(dtype):
                grads.append(g if g is not None else torch.zeros(shape, dtype=dtype, device=self.device))
        self._isend(grads, kind, stage, mb, 1)
        self._advance()

    def _prune(self) -> None:
        self._inflight = [(w, ts) for w, ts in self._inflight if not w.is_completed()]

    def flush(self) -> None:
        """Wait until every send of this channel has completed."""
        try:
            for work, _ in self._inflight:
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._error("could not deliver its messages to", exc) from exc
        finally:
            self._inflight = []

    # -- receiving ---------------------------------------------------------------------------------

    def expect(self, kind: str, stage: int, mb: int) -> None:
        """This step will take the message ``(kind, stage, mb)`` from the peer: receive it as early as possible."""
        if kind == "F":
            if ("F", stage, mb) not in self._pending:
                buf = torch.empty((_HEADER,), dtype=torch.int64, device=self.comm_device)
                work = dist.irecv(buf, self.peer, tag=self._tag("F", stage, mb, 0))
                self._pending[("F", stage, mb)] = _Pending((work, buf))
            return
        self._want_grads.add(("B", stage, mb))
        if _activation("B", stage, mb) in self._meta:  # its activation was sent already (a backward-only call)
            self._post_gradient(stage, mb)

    def _post(self, pending: _Pending, metas: List[Tuple[torch.dtype, Tuple[int, ...]]], kind: str, stage: int,
              mb: int) -> None:
        pending.bufs = [torch.empty(shape, dtype=dtype, device=self.comm_device) for dtype, shape in metas]
        pending.works = [dist.irecv(b, self.peer, tag=self._tag(kind, stage, mb, 1 + i))
                         for i, b in enumerate(pending.bufs)]

    def _post_gradient(self, stage: int, mb: int) -> None:
        self._want_grads.discard(("B", stage, mb))
        _, metas = self._meta[_activation("B", stage, mb)]
        pending = _Pending()
        self._post(pending, [(d, s) for d, s in metas if _wants_grad(d)], "B", stage, mb)
        self._pending[("B", stage, mb)] = pending

    def _advance(self) -> None:
        """Post the tensors of every activation whose header is in (cheap: one completion check per header)."""
        for (_kind, stage, mb), pending in self._pending.items():
            if pending.header is not None and pending.meta is None and pending.header[0].is_completed():
                self._read_header(pending, stage, mb)

    def _read_header(self, pending: _Pending, stage: int, mb: int) -> Meta:
        if pending.header is None:  # expect() posts an activation's header first, always
            raise RuntimeError(f"pipeddp: no header was posted for micro-batch {mb} of stage {stage}")
        work, buf = pending.header
        self._wait([work], "F", stage, mb)
        meta = pending.meta = _decode(buf.cpu())
        self._meta[_activation("F", stage, mb)] = meta
        self._post(pending, meta[1], "F", stage, mb)
        return meta

    def _wait(self, works: List[Any], kind: str, stage: int, mb: int) -> None:
        try:
            for work in works:
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._error(f"got no {describe(kind)} of micro-batch {mb} for stage {stage} from", exc) from exc

    def recv(self, kind: str, stage: int, mb: int) -> Any:
        """``stage``'s input (``"F"``) or the gradient of its output (``"B"``) for micro-batch ``mb``."""
        pending = self._pending.pop((kind, stage, mb), None)
        if kind == "F":
            if pending is None:
                self.expect("F", stage, mb)
                pending = self._pending.pop(("F", stage, mb))
            meta = pending.meta if pending.meta is not None else self._read_header(pending, stage, mb)
            self._wait(pending.works, kind, stage, mb)
            self._advance()
            tensors = [b.to(self.device) for b in pending.bufs]
            container = meta[0]
            if container == 0:
                return tensors[0]
            return tuple(tensors) if container == 1 else list(tensors)
        if pending is None:
            self._post_gradient(stage, mb)
            pending = self._pending.pop(("B", stage, mb))
        _, metas = self._meta.pop(_activation(kind, stage, mb))
        self._wait(pending.works, kind, stage, mb)
        self._advance()
        got = iter(b.to(self.device) for b in pending.bufs)
        return [next(got) if _wants_grad(d) else None for d, _ in metas]

    def _error(self, what: str, exc: BaseException) -> PeerError:
        return PeerError(
            f"rank {self.rank} (stage {self.stage}) {what} rank {self.peer} (stage {self.peer_stage}) "
            f"within {self.timeout.total_seconds():.0f} s: that process died, stalled or timed out ({exc})"
        )

    def reset(self) -> None:
        """Forget per-step state after a failed step, and move to the next generation of tags.

        Receives posted for the failed step may still be waiting inside the
        process group; with another generation in their tags they can never
        take a message of a later step (both sides of a failed step fail it,
        the other one within its timeout, so both move on together).
        """
        self._meta.clear()
        self._inflight = []
        self._pending.clear()
        self._want_grads.clear()
        self.generation += 1
