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
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Tuple

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


_SLOTS = 7  # bits: a header and up to 127 tensors per message
_STAGES = 8  # bits: up to 256 stages


def _tag(kind: str, stage: int, mb: int, slot: int) -> int:
    """A message's tag: unique per (kind, receiving stage, micro-batch, tensor slot); fits gloo's 32 bits."""
    if not 0 <= stage < 1 << _STAGES or not 0 <= mb < 1 << (31 - _STAGES - 1 - _SLOTS):
        raise ValueError(f"cannot tag a message of stage {stage}, micro-batch {mb} between processes: at most "
                         f"{1 << _STAGES} stages and {1 << (31 - _STAGES - 1 - _SLOTS)} micro-batches per step")
    return ((((mb << _STAGES) | stage) << 1 | (kind == "B")) << _SLOTS) + slot


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


class P2PChannel:
    """Messages to and from the stage held by ``peer`` (a global rank)."""

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
        self._meta: Dict[Tuple[int, int], Meta] = {}
        self._inflight: List[Tuple[Any, List[torch.Tensor]]] = []

    # -- sending -----------------------------------------------------------------------------------

    def _isend(self, tensors: List[torch.Tensor], kind: str, stage: int, mb: int, first_slot: int) -> None:
        out = [t.detach().to(self.comm_device).contiguous() for t in tensors]
        for i, t in enumerate(out):
            work = dist.isend(t, self.peer, tag=_tag(kind, stage, mb, first_slot + i))
            self._inflight.append((work, [t]))
        self._prune()

    def send(self, kind: str, stage: int, mb: int, value: Any) -> None:
        """Send ``stage`` its input (``"F"``) or the gradient of its output (``"B"``) for micro-batch ``mb``."""
        if kind == "F":
            container, tensors = _flatten(value)
            header = _encode(container, tensors)
            self._meta[_activation(kind, stage, mb)] = _decode(header)
            self._isend([header] + tensors, kind, stage, mb, 0)
            return
        # Gradients of the activation this process received: one per floating tensor, zeros where unused.
        _, metas = self._meta.pop(_activation(kind, stage, mb))
        grads = []
        for (dtype, shape), g in zip(metas, value):
            if _wants_grad(dtype):
                grads.append(g if g is not None else torch.zeros(shape, dtype=dtype, device=self.device))
        self._isend(grads, kind, stage, mb, 1)

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

    def _irecv(self, shapes: List[Tuple[torch.dtype, Tuple[int, ...]]], kind: str, stage: int, mb: int,
               first_slot: int) -> List[torch.Tensor]:
        bufs = [torch.empty(shape, dtype=dtype, device=self.comm_device) for dtype, shape in shapes]
        try:
            works = [dist.irecv(buf, self.peer, tag=_tag(kind, stage, mb, first_slot + i)) for i, buf in enumerate(bufs)]
            for work in works:
                work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._error(f"got no {describe(kind)} of micro-batch {mb} for stage {stage} from", exc) from exc
        return [b.to(self.device) for b in bufs]

    def recv(self, kind: str, stage: int, mb: int) -> Any:
        """``stage``'s input (``"F"``) or the gradient of its output (``"B"``) for micro-batch ``mb``."""
        if kind == "F":
            (header,) = self._irecv([(torch.int64, (_HEADER,))], kind, stage, mb, 0)
            container, metas = _decode(header.cpu())
            self._meta[_activation(kind, stage, mb)] = (container, metas)
            tensors = self._irecv(metas, kind, stage, mb, 1)
            if container == 0:
                return tensors[0]
            return tuple(tensors) if container == 1 else list(tensors)
        _, metas = self._meta.pop(_activation(kind, stage, mb))
        wanted = [(d, s) for d, s in metas if _wants_grad(d)]
        got = iter(self._irecv(wanted, kind, stage, mb, 1))
        return [next(got) if _wants_grad(d) else None for d, _ in metas]

    def _error(self, what: str, exc: BaseException) -> PeerError:
        return PeerError(
            f"rank {self.rank} (stage {self.stage}) {what} rank {self.peer} (stage {self.peer_stage}) "
            f"within {self.timeout.total_seconds():.0f} s: that process died, stalled or timed out ({exc})"
        )

    def reset(self) -> None:
        """Forget per-step state (after a failed step)."""
        self._meta.clear()
        self._inflight = []
