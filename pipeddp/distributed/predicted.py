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

Everything that depends on the prediction alone (which tensor carries the flag, the slots' tags, the buffers'
shapes) is worked out once per predicted ``Meta`` (``plan``, cached): shapes that repeat ask the same questions at
every message of every step, and answering them anew cost a small model's interleaved step more than its sends.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .headers import Meta, specs

__all__ = ["INLINE_BYTES", "Plan", "buffers", "flag_index", "flag_slot", "missing", "outgoing", "plan", "raised",
           "slots", "unpack"]

#: the flag rides on the smallest predicted tensor up to this size; a separate byte goes ahead of larger ones
INLINE_BYTES = 64 << 10
Specs = Sequence[Tuple[torch.dtype, Tuple[int, ...]]]


class Plan:
    """What a prediction ``known`` fixes for every activation predicted by it: its tensors' specs, which one carries
    the flag in-band (``inline``; None: a byte of its own goes ahead of them), and the slots' tags."""

    __slots__ = ("known", "specs", "inline", "first")

    def __init__(self, known: Meta) -> None:
        self.known = known
        self.specs = specs(known)
        sizes = [math.prod(s) * d.itemsize for d, s in self.specs]
        smallest = min(range(len(sizes)), key=sizes.__getitem__, default=None)
        self.inline = smallest if smallest is not None and sizes[smallest] <= INLINE_BYTES else None
        #: the first tag slot of the flagged tensors: 1 after the header's slot 0, or 0 where a flag byte goes first
        self.first = 0 if self.inline is None else 1

    def slots(self, flag: bool, count: int) -> range:
        """The tag slots of the ``count`` predicted tensors (see ``slots``)."""
        start = self.first if flag else 1
        return range(start, start + count)


@functools.lru_cache(maxsize=1024)
def plan(known: Meta) -> Plan:
    """``known``'s ``Plan``, made once (a step's predictions are the last step's activations, again and again)."""
    return Plan(known)


def flag_slot(known: Meta) -> Optional[int]:
    """Which predicted tensor carries the flag (one element more); None: a separate byte, sent ahead of them."""
    return plan(known).inline


def slots(known: Meta, flag: bool, count: int) -> range:
    """The tag slots of the ``count`` predicted tensors (``outgoing``'s, ``buffers``'): after the header's slot 0,
    or from 0 where a separate flag byte goes ahead of them (the header, sent only after it, then takes slot 0 too,
    one message later in the link's order)."""
    return plan(known).slots(flag, count)


def _carried(known: Specs, actual: Specs, k: int) -> bool:
    """Whether the activation's tensor ``k`` fills predicted slot ``k`` (same dtype and shape)."""
    return k < len(known) and k < len(actual) and known[k] == actual[k]


def missing(known: Meta, meta: Meta) -> List[int]:
    """The activation's tensors that no predicted slot carried: they cross after its header."""
    if known == meta:
        return []
    ks, actual = specs(known), specs(meta)
    return [k for k in range(len(actual)) if not _carried(ks, actual, k)]


#: the flag element appended on the sender, per (dtype, raised): one tensor each, never written
_FLAGS: Dict[Tuple[torch.dtype, bool], torch.Tensor] = {}


def _flag(dtype: torch.dtype, up: bool) -> torch.Tensor:
    got = _FLAGS.get((dtype, up))
    if got is None:
        got = _FLAGS[(dtype, up)] = torch.full((1,), int(up), dtype=dtype)
    return got


def outgoing(known: Meta, meta: Meta, tensors: Sequence[torch.Tensor], flag: bool,
             device: torch.device) -> List[torch.Tensor]:
    """What the sender puts in the predicted slots (after a flag of its own where ``flag_slot`` is None); ``flag``:
    the flag travels here (gloo, on the host), raised where the activation is not the predicted one."""
    p, up = plan(known), known != meta
    if not up:
        out = list(tensors)
    else:
        actual = specs(meta)
        out = [tensors[k] if _carried(p.specs, actual, k) else torch.empty(s, dtype=d, device=device)
               for k, (d, s) in enumerate(p.specs)]
    if not flag:
        return out
    f = p.inline
    if f is None:
        return [torch.full((1,), int(up), dtype=torch.uint8, device=device)] + out
    out[f] = torch.cat([out[f].reshape(-1), _flag(out[f].dtype, up)])
    return out


def buffers(known: Meta, flag: bool, device: torch.device) -> List[torch.Tensor]:
    """The receiver's buffers for ``outgoing``'s tensors, in the same order."""
    p = plan(known)
    bufs = [torch.empty(s, dtype=d, device=device) for d, s in p.specs]
    if not flag:
        return bufs
    f = p.inline
    if f is None:
        return [torch.empty((1,), dtype=torch.uint8, device=device)] + bufs
    d, s = p.specs[f]
    bufs[f] = torch.empty((math.prod(s) + 1,), dtype=d, device=device)
    return bufs


def flag_index(known: Meta) -> int:
    """Which of ``buffers``' holds the flag: once its receive is in, the receiver knows."""
    f = plan(known).inline
    return 0 if f is None else f


def raised(known: Meta, bufs: Sequence[torch.Tensor]) -> bool:
    """Whether the sender raised the flag: its element's bytes, read from host memory (gloo's buffers are there)
    as they are, in one call and no tensor op."""
    buf = bufs[flag_index(known)]
    size = buf.element_size()
    return ctypes.string_at(buf.data_ptr() + (buf.numel() - 1) * size, size) != bytes(size)


def unpack(known: Meta, meta: Meta, bufs: Sequence[torch.Tensor], extra: Sequence[torch.Tensor],
           flag: bool) -> List[torch.Tensor]:
    """The activation's tensors, in order: from the predicted slots where they carried them, else from ``extra``
    (the receives posted after the header, in ``missing``'s order)."""
    p = plan(known)
    f = p.inline if flag else -1
    slots = list(bufs[1:]) if flag and f is None else list(bufs)
    if known == meta:
        if f is not None and f >= 0:
            slots[f] = slots[f].narrow(0, 0, slots[f].numel() - 1).view(p.specs[f][1])
        return slots
    actual = specs(meta)
    late = iter(extra)
    out = []
    for k, (_, s) in enumerate(actual):
        if not _carried(p.specs, actual, k):
            out.append(next(late))
        elif k == f:
            out.append(slots[k][:-1].view(s))
        else:
            out.append(slots[k])
    return out
