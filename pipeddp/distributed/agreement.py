"""What the ranks of a job must agree on, and how they find out together.

A rank that raises on its own while the others enter a collective leaves
them waiting forever. So every check here is a collective that *every* rank
of the group enters: each rank reports what it has (or what went wrong), and
then all ranks raise, or proceed, alike::

    the call        which of the engine's collectives each rank entered, carried by the first
                    collective of every one of them: a rank that called save while another
                    called train_step gets an error naming both, never a mismatched collective
    batch sizes     one int64 row per rank, gathered (``rows``) once per step: (call, x size, y size, error
                    flag, shapes, flag); where every rank's row equals the previous call's, the shapes repeat
                    (``repeated``) and activations cross between processes without a header; ``flagged``:
                    whether any rank raised its flag (a tied weight changed since the processes last synchronised it)
    the loss        one float64 row per rank, gathered: (local loss, grads not finite, count, counted)
                    (``step_end``; the call check is ``calls``)
    replicas        a CRC32 of every parameter, gathered once, compared between each stage's copies
    a partition     rank 0 measures, every rank uses rank 0's cut (DDP needs identical replicas)
    metrics         sample-weighted sums, gathered once after an evaluation
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from ..runtime.microbatch import batch_size
from .calls import COLLECTIVES, CallCheck, CollectiveError
from .step_end import StepEnd
from .topology import Topology

__all__ = ["Agreement", "CallCheck", "CollectiveError", "COLLECTIVES", "shapes_of"]

T = TypeVar("T")

def shapes_of(x: Any, y: Any) -> int:
    """A digest of the batch's structure, shapes and dtypes, and of the autocast state (which sets the dtypes at a
    cut): equal for two batches whose activations have the same shapes (a model whose shapes depend on its input's
    values aside, which the sender catches)."""
    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), str(value.dtype))
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(walk(v) for v in value))
        if isinstance(value, dict):
            return tuple((k, walk(v)) for k, v in value.items())
        return type(value).__name__
    cast = tuple((kind, torch.is_autocast_enabled(kind), str(torch.get_autocast_dtype(kind)))
                 for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind))
    digest = hashlib.blake2b(repr((walk(x), walk(y), cast)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _means(parts: Sequence[Tuple[int, Dict[str, float], Dict[str, float]]]) -> Dict[str, float]:
    """Every rank's ``(count, sums, counts)`` merged into means (see ``Agreement.mean_metrics``)."""
    total = sum(c for c, _, _ in parts)
    merged: Dict[str, float] = {}
    denominators: Dict[str, float] = {}
    for _, s, c in parts:
        for k, v in s.items():
            merged[k] = merged.get(k, 0.0) + v
        for k, v in c.items():
            denominators[k] = denominators.get(k, 0.0) + v
    result = {k: v / denominators.get(k, total) for k, v in merged.items()} if total else {}
    result["samples"] = float(total)
    return result


class Agreement(StepEnd):
    """The collectives of one engine (``comm_device``: where the job's backend wants its tensors; ``last_row``: the
    pipeline's device row that holds the last stage, whose rank passes the targets in stage mode; ``host_group``:
    the job's ranks over gloo for its tables and objects of host values, default the job's group; see
    ``groups.host_group``: over nccl an object crosses to the GPU, padded there to the largest, once per rank)."""

    def __init__(self, topology: Topology, comm_device: torch.device, last_row: Optional[int] = None, *,
                 host_group: Any = None) -> None:
        self.topology = topology
        self.comm_device = comm_device
        self.host_group = topology.group if host_group is None else host_group
        self.last_row = topology.stages - 1 if last_row is None else last_row
        #: whether the last batch check found every rank's call and batch shapes as in the one before it
        self.repeated = False
        #: whether some rank raised the flag of the last batch check (see ``local_batch``)
        self.flagged = True
        self._previous: Dict[Tuple[str, int], List[Any]] = {}

    # -- rank 0's choice -----------------------------------------------------------------------------

    def from_rank0(self, make: Callable[[], T]) -> T:
        """``make()`` on rank 0, sent to every rank (the others do not call it).

        If ``make`` raises on rank 0, every rank raises (rank 0 its own error),
        instead of the others waiting for a value that never comes.
        """
        if not self.distributed:
            return make()
        box: List[Any] = [None, ""]
        error: BaseException | None = None
        if self.topology.is_root:
            try:
                box[0] = make()
            except Exception as exc:  # noqa: BLE001 - re-raised below, after the others are told
                error, box[1] = exc, f"{type(exc).__name__}: {exc}"
        dist.broadcast_object_list(box, src=self.topology.root, group=self.host_group)
        if error is not None:
            raise error
        if box[1]:
            raise RuntimeError(f"rank {self.topology.rank}: rank 0 failed: {box[1]}")
        return box[0]

    # -- batch sizes ---------------------------------------------------------------------------------

    def _gather_sizes(self, x: Any, y: Any, group: Any, ranks: List[int],
                      call: str = "train_step", flag: bool = True) -> List[Tuple[int, int, str]]:
        """Every rank's (x size, y size, error) in ``group``; never raises before the collective."""

        def size(v: Any, name: str) -> Tuple[int, str]:
            if v is None:
                return -1, ""
            try:
                return batch_size(v, name=name), ""
            except ValueError as exc:
                return -2, str(exc)

        nx, ex = size(x, "x")
        ny, ey = size(y, "y")
        mine = (nx, ny, ex or ey)
        self.repeated, self.flagged = False, flag
        if not self.distributed:
            return [mine]
        # One small tensor collective per step; messages travel only when some rank has one.
        rows = self._calls(call, [nx, ny, 1 if mine[2] else 0, shapes_of(x, y), int(flag)], group, ranks)
        self.flagged = any(r[4] for r in rows)
        rows = [r[:4] for r in rows]
        key = (call, id(group))
        self.repeated = not mine[2] and self._previous.get(key) == rows
        self._previous[key] = rows
        messages: List[Any] = [""] * len(ranks)
        if any(r[2] for r in rows):
            dist.all_gather_object(messages, mine[2], group=group)
        return [(r[0], r[1], m) for r, m in zip(rows, messages)]

    def local_batch(self, x: Any, y: Any, *, need_y: bool, group: Any = None, call: str = "train_step",
                    flag: bool = True) -> int:
        """Check every rank's batch (the ranks of ``group``, default all) and return the common local size.

        The rank of stage 0 must pass ``x``, the rank of the last stage ``y``
        when ``need_y``; every replica the same number of samples. ``flag`` rides
        along at no cost: ``flagged`` then tells whether any rank raised it.
        ``group`` gathers host values (``groups.host_group``).
        """
        topo = self.topology
        group = self.host_group if group is None else group
        ranks = dist.get_process_group_ranks(group) if (group is not None and self.distributed) \
            else topo.job_ranks
        infos = self._gather_sizes(x, y, group, ranks, call, flag)
        for r, (_, _, err) in zip(ranks, infos):
            if err:
                raise ValueError(f"rank {r}: {err}")
        needs = []  # (rank, size, what)
        for r, (nx, ny, _) in zip(ranks, infos):
            stage = None if topo.mode == "replica" else topo.stage_of(r)
            if stage is None or stage == 0:
                if nx < 0:
                    raise ValueError(f"rank {r} holds stage 0 and must pass the inputs x, but passed None")
                needs.append((r, nx, "x"))
            if need_y and (stage is None or stage == self.last_row):
                if ny < 0:
                    raise ValueError(f"rank {r} holds the last stage and must pass the targets y, but passed None")
                needs.append((r, ny, "y"))
        sizes = {n for _, n, _ in needs}
        if len(sizes) > 1:
            votes = {n: sum(1 for _, k, _ in needs if k == n) for n in sizes}
            common = max(votes, key=lambda n: votes[n])
            advice = ("every replica must pass the same local batch size and x and y must match "
                      "(pipeddp.data.loader shards a dataset so that they do)")
            if list(votes.values()).count(votes[common]) == 1:
                r, n, what = next(item for item in needs if item[1] != common)
                raise ValueError(f"rank {r} passed {what} with {n} samples but the others have {common}; {advice}")
            listing = ", ".join(f"rank {r} {what}={n}" for r, n, what in needs)
            raise ValueError(f"the ranks disagree on the local batch size ({listing}); {advice}")
        return sizes.pop()

    # -- a gradient norm over stages --------------------------------------------------------------------

    def join_norm(self, part: torch.Tensor, is_max: bool, *, group: Any) -> torch.Tensor:
        """The norm's shares of ``group``'s processes (None: the job's), summed (the max for the inf-norm), after the
        call check of every rank of the job; on the host the shares ride on that check, joined alike on each rank."""
        bits = int(part.to("cpu", torch.float64).reshape(1).view(torch.int64)) if self.comm_device.type == "cpu" else 0
        rows = self._calls("clip_grad_norm_", [bits, 0, 0, 0, 0], self.host_group, self.topology.job_ranks)
        if self.comm_device.type == "cpu":  # the shares came with the check: the same sum, in one order, on each
            members = set(self.topology.job_ranks if group is None else dist.get_process_group_ranks(group))
            shares = torch.tensor([row[0] for r, row in zip(self.topology.job_ranks, rows) if r in members])
            return shares.view(torch.float64).max() if is_max else shares.view(torch.float64).sum()
        buf = part.to(self.comm_device, copy=True)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM, group=group)
        return buf

    # -- identical replicas ----------------------------------------------------------------------------

    def check_replicas(self, stages: Sequence[Any], rename: Callable[[str], str] = str) -> None:
        """Raise if any stage's parameters differ between its replicas (a collective: every rank calls it).

        Every rank's checksums travel in one gathering on the host group; every rank then compares each stage's
        copies alike. ``rename`` gives a parameter's name in the model (``Names.original``) for the message.
        """
        if not self.distributed or self.topology.replicas == 1:
            return
        self.enter("check_replicas")
        mine = {st.index: [(n, zlib.crc32(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()))
                           for n, p in st.module.named_parameters()] for st in stages}
        holders: Dict[int, List[Tuple[int, List[Tuple[str, int]]]]] = {}
        for r, sums in zip(self.topology.job_ranks, self.gather_to_all(mine)):
            for index, named in sums.items():
                holders.setdefault(index, []).append((r, named))
        for index in sorted(holders):
            ranks = [r for r, _ in holders[index]]
            for i, (name, first) in enumerate(holders[index][0][1]):
                odd = [r for r, named in holders[index] if named[i][1] != first]
                if odd:
                    raise RuntimeError(f"stage {index}: parameter {rename(name)!r} differs between replicas "
                                       f"(ranks {odd} disagree with rank {ranks[0]})")

    def mean_metrics(self, count: int, sums: Dict[str, float],
                     counts: Optional[Dict[str, float]] = None) -> Dict[str, float]:
        """Sample-weighted means over every rank's ``(count, sums)``, plus ``"samples"`` (same on every rank).

        A metric in ``counts`` (one returned as ``(total, count)``) is its summed totals over its summed counts.
        """
        return _means(self.gather_to_all((count, sums, counts or {})))

    def gather_to_all(self, value: Any) -> List[Any]:
        """Every rank's ``value``, on every rank (one ``all_gather_object``)."""
        if not self.distributed:
            return [value]
        parts: List[Any] = [None] * self.topology.world_size
        dist.all_gather_object(parts, value, group=self.host_group)
        return parts

