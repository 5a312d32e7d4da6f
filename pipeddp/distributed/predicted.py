"""The header-free path: an activation sent in the slots both ends predicted, and a flag that says whether it fits.

Where every rank's batch has the shapes of the previous call (``Agreement.repeated``), both ends of a link predict
each activation from what crossed at the same (stage, micro-batch) in that call, and the receiver posts receives of
those shapes at once, without a header. What crosses a cut may still depend on the input's values (transformers
builds an attention mask only for a micro-batch with padding), so the prediction can be wrong, and only the sender
knows. It says so in-band, at no extra message: over gloo one element appended to the smallest predicted tensor
(a separate one-byte message first where even that one is large: a copy of it would cost more than a message),
read on the host where gloo's buffers are; over nccl the header, on the pipeline's gloo twin as every header there
(a flag in a GPU buffer would take a synchronisation to read). When the activation differs, the sender still fills
every predicted slot (with the tensor where its dtype and shape are the predicted ones, else with an unwritten
tensor of the predicted shape: a receive cannot be withdrawn), then sends the header and the tensors the slots did
not carry: over gloo on a group of their own (``p2p``'s side group), where the receiver posts their receives when it
reads the flag, so that no later receive waits for a flag; over nccl in the link's order, after the twin's header
was read. No round trip: the sender never waits for the receiver to learn of the change.

Everything that depends on an activation's ``Meta`` alone is worked out once, in its ``Plan`` (``plan``, cached),
and both ends keep the plans of what crossed (``Shapes``), so an activation as predicted costs no lookup at all:
shapes that repeat ask the same questions at every message of every step, and answering them anew cost a small
model's step more than its sends. The sender checks its activation against the plan without describing it
(``Plan.fits``) and copies the flagged tensor into a buffer kept per message of the link's order, its flag element
already zero (``staging``): every send of a step has completed when the step ends (``P2PChannel.flush``), so the
next step's send of that message may fill it again.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .headers import Meta, specs, wants_grad

__all__ = ["INLINE_BYTES", "Plan", "buffers", "flag_byte", "missing", "outgoing", "plan", "raised", "staging", "taken",
           "unpack"]

#: the flag rides on the smallest predicted tensor up to this size; a separate byte goes ahead of larger ones
INLINE_BYTES = 64 << 10


def _strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


class Plan:
    """What an activation's ``meta`` fixes, for every activation of that meta: its tensors' specs and bytes, what
    its gradient is, which tensor carries the flag where it is predicted (``inline``; None: a byte of its own goes
    ahead of them) and where in that tensor's buffer the flag lies."""

    __slots__ = ("meta", "container", "members", "specs", "nbytes", "tensor", "wants", "grads", "grad_bytes",
                 "every_grad", "inline", "alone", "flagged_bytes", "first", "body", "flag_numel", "flag_at",
                 "flag_size", "zero")

    def __init__(self, meta: Meta) -> None:
        self.meta = meta
        self.container, self.members = meta
        self.specs = specs(meta)
        sizes = [math.prod(s) * d.itemsize for d, s in self.specs]
        self.nbytes = sum(sizes)
        #: a tensor alone, the common case: it crosses and is handed over without a container
        self.tensor = self.container == 0 and bool(self.members) and self.members[0][0] is not None
        #: per tensor whether it takes a gradient; the gradient's tensors (specs) and their bytes
        self.wants = tuple(wants_grad(d) for d, _ in self.specs)
        self.grads = tuple(s for s, w in zip(self.specs, self.wants) if w)
        self.grad_bytes = sum(n for n, w in zip(sizes, self.wants) if w)
        self.every_grad = all(self.wants)
        smallest = min(range(len(sizes)), key=sizes.__getitem__, default=None)
        self.inline = smallest if smallest is not None and sizes[smallest] <= INLINE_BYTES else None
        #: a tensor alone that carries the flag where it is predicted
        self.alone = self.tensor and self.inline == 0
        #: the bytes sent in the predicted slots with the flag (an element of the flagged tensor, or a byte)
        self.flagged_bytes = self.nbytes + (1 if self.inline is None else self.specs[self.inline][0].itemsize)
        #: the first tag slot of the predicted tensors where they carry a flag: 1 after the header's slot 0, or 0
        #: where a flag byte goes ahead of them (the header, sent only after it, then takes slot 0 too, one message
        #: later in the link's order); without a flag (nccl) they take slots from 1
        self.first = 0 if self.inline is None else 1
        #: the flagged tensor's shape and strides in its buffer, the buffer's elements, and its flag element's byte
        #: offset and size
        self.body: Tuple[Tuple[int, ...], Tuple[int, ...]] = ((), ())
        self.flag_numel = self.flag_at = self.flag_size = 0
        self.zero = b""
        if self.inline is not None:
            d, s = self.specs[self.inline]
            self.body, self.flag_numel, self.flag_size = (s, _strides(s)), math.prod(s) + 1, d.itemsize
            self.flag_at, self.zero = math.prod(s) * d.itemsize, bytes(d.itemsize)

    def fits(self, value: Any) -> bool:
        """Whether a stage's output is an activation of this plan (container, dtypes, shapes), found without
        describing it; False also where only the general path can tell (a subclass of a tensor or a tuple)."""
        if self.tensor:
            d, s = self.specs[0]
            return type(value) is torch.Tensor and value.dtype is d and value.shape == s
        if type(value) is not (list if self.container == 2 else tuple) or self.container == 0 \
                or len(value) != len(self.members):
            return False
        for v, (dtype, shape) in zip(value, self.members):
            if v is None:
                if dtype is not None:
                    return False
            elif dtype is None or type(v) is not torch.Tensor or v.dtype is not dtype or v.shape != shape:
                return False
        return True

    def value(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The activation as its sender gave it, from its tensors: in its container, None where a member was."""
        if self.tensor:
            return tensors[0]
        got = iter(tensors)
        members = [None if d is None else next(got) for d, _ in self.members]
        if self.container == 0:
            return members[0]
        return tuple(members) if self.container == 1 else members

    def gradient(self, bufs: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """The gradient of an activation of this plan from the tensors received: one per tensor of the activation,
        None where it takes none."""
        if self.every_grad:
            return list(bufs)
        got = iter(bufs)
        return [next(got) if w else None for w in self.wants]


@functools.lru_cache(maxsize=1024)
def plan(meta: Meta) -> Plan:
    """``meta``'s ``Plan``, made once (a step's predictions are the last step's activations, again and again)."""
    return Plan(meta)


def _carried(known: Plan, actual: Plan, k: int) -> bool:
    """Whether the activation's tensor ``k`` fills predicted slot ``k`` (same dtype and shape)."""
    return k < len(known.specs) and k < len(actual.specs) and known.specs[k] == actual.specs[k]


def missing(known: Plan, actual: Plan) -> List[int]:
    """The activation's tensors that no predicted slot carried: they cross after its header."""
    if known is actual:
        return []
    return [k for k in range(len(actual.specs)) if not _carried(known, actual, k)]


#: the flag sent, per (dtype, raised): one tensor each, never written (an element to append, or the byte of its own)
_FLAGS: Dict[Tuple[torch.dtype, bool], torch.Tensor] = {}


def _flag(dtype: torch.dtype, up: bool) -> torch.Tensor:
    got = _FLAGS.get((dtype, up))
    if got is None:
        got = _FLAGS[(dtype, up)] = torch.full((1,), int(up), dtype=dtype)
    return got


def flag_byte(up: bool) -> torch.Tensor:
    """The flag of its own, sent ahead of the predicted tensors where none is small enough to carry it."""
    return _flag(torch.uint8, up)


def staging(known: Plan, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """A sender's buffer for the flagged tensor of an activation as predicted (``known.inline`` is not None): the
    buffer, its flag element zero, and the view of the tensor's place in it, to copy the tensor into."""
    d, _ = known.specs[known.inline if known.inline is not None else 0]
    full = torch.zeros((known.flag_numel,), dtype=d, device=device)
    return full, full.as_strided(*known.body)


def outgoing(known: Plan, actual: Plan, tensors: Sequence[torch.Tensor], flag: bool,
             device: torch.device) -> List[torch.Tensor]:
    """What the sender of an activation of plan ``actual`` puts in the slots of the prediction ``known`` (after a
    flag of its own where ``known.inline`` is None); ``flag``: the flag travels here (gloo, on the host), raised
    where the activation is not the predicted one. (``p2p`` sends one as predicted from ``staging`` instead.)"""
    up = known is not actual
    out = [tensors[k] if _carried(known, actual, k) else torch.empty(s, dtype=d, device=device)
           for k, (d, s) in enumerate(known.specs)]
    if not flag:
        return out
    f = known.inline
    if f is None:
        return [flag_byte(up).to(device)] + out
    out[f] = torch.cat([out[f].reshape(-1), _flag(out[f].dtype, up).to(device)])
    return out


def buffers(known: Plan, flag: bool, device: torch.device) -> List[torch.Tensor]:
    """The receiver's buffers for the predicted slots, in the order of the sender's tensors (a flag byte first
    where ``known.inline`` is None, else the flagged tensor with its element more)."""
    f = known.inline if flag else -1
    bufs = [torch.empty((known.flag_numel,) if k == f else s, dtype=d, device=device)
            for k, (d, s) in enumerate(known.specs)]
    return [torch.empty((1,), dtype=torch.uint8, device=device)] + bufs if flag and f is None else bufs


def taken(known: Plan, flag: bool, bufs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The activation's tensors in ``buffers`` where it was the predicted one (the flagged tensor a view of its
    buffer without the flag element)."""
    if not flag:
        return list(bufs)
    f = known.inline
    if f is None:
        return list(bufs[1:])
    out = list(bufs)
    out[f] = out[f].as_strided(*known.body)
    return out


def raised(known: Plan, bufs: Sequence[torch.Tensor]) -> bool:
    """Whether the sender raised the flag: its bytes, read from host memory (gloo's buffers are there) as they are,
    in one call and no tensor op."""
    if known.inline is None:
        return ctypes.string_at(bufs[0].data_ptr(), 1) != b"\0"
    return ctypes.string_at(bufs[known.inline].data_ptr() + known.flag_at, known.flag_size) != known.zero


def unpack(known: Plan, actual: Plan, bufs: Sequence[torch.Tensor], extra: Sequence[torch.Tensor],
           flag: bool) -> List[torch.Tensor]:
    """The tensors of an activation of plan ``actual`` predicted as ``known``, in order: from the predicted slots
    where they carried them, else from ``extra`` (the receives posted after the header, in ``missing``'s order)."""
    slots = taken(known, flag, bufs)
    if known is actual:
        return slots
    late = iter(extra)
    return [slots[k] if _carried(known, actual, k) else next(late) for k in range(len(actual.specs))]
