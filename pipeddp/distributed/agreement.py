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
    the loss        one float64 row per rank, gathered: (local loss, loss not finite, grads not finite)
    replicas        a CRC32 of every parameter, gathered once, compared between each stage's copies
    a partition     rank 0 measures, every rank uses rank 0's cut (DDP needs identical replicas)
    metrics         sample-weighted sums, gathered once after an evaluation
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import zlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.counted import Count, scalar_on
from ..runtime.dtensors import local
from ..runtime.microbatch import batch_size
from ..runtime.warn import warn
from .rows import gather_rows
from .topology import Topology

__all__ = ["Agreement", "CallCheck", "CollectiveError", "COLLECTIVES", "shapes_of"]

T = TypeVar("T")

#: The engine's calls that are collectives: every rank must make them together.
COLLECTIVES = ("train_step", "forward", "save", "save_checkpoint", "state_dict", "load", "resume", "evaluate",
               "save_pretrained", "clip_grad_norm_", "check_replicas")


class CollectiveError(RuntimeError):
    """The ranks did not enter the same collective call (or one never came)."""


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


def _not_finite(grads: Sequence[torch.Tensor], dev: torch.device) -> torch.Tensor:
    """1.0 where any of ``grads`` holds a NaN or an infinity, else 0.0 (float64 on ``dev``; no host sync).

    One fused inf-norm per device and dtype (a largest magnitude is finite exactly when every element is, and
    NaN propagates through it), not two ops per gradient. A sharded gradient votes with its own shard (the gather
    joins every rank's); an empty one has nothing to vote with.
    """
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for g in grads:
        t = local(g)
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    if not groups:
        return torch.zeros((), dtype=torch.float64, device=dev)
    largest = torch.cat([torch.stack(torch._foreach_norm(ts, math.inf)).to(dev, torch.float64)
                         for ts in groups.values()])
    return (~largest.isfinite().all()).to(torch.float64)


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


class CallCheck:
    """Which of the engine's collective calls each rank is in: checked by the first collective of every one.

    ``topology`` and ``host_group`` are the agreement's (``Agreement`` is one).
    """

    topology: Topology
    host_group: Any

    @property
    def distributed(self) -> bool:
        return self.topology.world_size > 1

    def enter(self, call: str) -> None:
        """Every rank enters the collective ``call`` together (see ``_calls``); nothing else is exchanged."""
        if self.distributed:
            self._calls(call, [0, 0, 0, 0, 0], self.host_group, self.topology.job_ranks)

    def _calls(self, call: str, payload: List[int], group: Any, ranks: List[int]) -> List[List[int]]:
        """Every rank's ``payload`` (five ints), gathered with the name of the collective call each rank is in.

        The same small gathering (``gather_rows``) opens every collective call, so a rank in
        ``save`` meets a rank in ``train_step`` here and both raise naming the
        calls, instead of entering collectives that do not match (a gloo abort,
        or a hang). A rank that never comes leaves the others an error after the
        process group's timeout that says what to do.
        """
        t = torch.tensor([COLLECTIVES.index(call), *payload], dtype=torch.int64)  # host values, gathered on the host
        gathered = [torch.zeros_like(t) for _ in ranks]
        with self._waiting(f"entered {call}, a collective, and not every rank came: each must call {call} too, "
                           "together (not under `if rank == 0:`); or a rank stalled or died"):
            gather_rows(gathered, t, group=group, ranks=ranks, rank=self.topology.rank, kind=0)
        rows = [[int(v) for v in row] for row in torch.stack(gathered).tolist()]
        calls = [COLLECTIVES[row[0]] if 0 <= row[0] < len(COLLECTIVES) else "?" for row in rows]
        if len(set(calls)) > 1:
            listing = ", ".join(f"rank {r} {c}" for r, c in zip(ranks, calls))
            raise CollectiveError(
                f"rank {self.topology.rank}: the ranks entered different collective calls ({listing}). "
                f"{', '.join(COLLECTIVES[:1] + COLLECTIVES[2:])} (and state_dict in stage mode or with shard=) run "
                "on every rank together: call each on every rank, not under `if rank == 0:`"
            )
        return [row[1:] for row in rows]

    @contextlib.contextmanager
    def _waiting(self, what: str) -> Iterator[None]:
        """A collective whose failure (a timeout, a peer gone) becomes a ``CollectiveError`` naming this rank (and
        its stage) and ``what`` it was doing, the process group's own error kept as the cause."""
        try:
            yield
        except RuntimeError as exc:
            topo = self.topology
            where = f"rank {topo.rank}" + (f" (stage {topo.stage})" if topo.mode == "stage" else "")
            raise CollectiveError(f"{where} {what} ({exc})") from exc


class Agreement(CallCheck):
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

    # -- the loss and non-finite steps -----------------------------------------------------------------

    def finish_step(self, local_loss: Optional[torch.Tensor], params: Iterable[nn.Parameter], *, skip_nonfinite: bool,
                    skipped: int, overflow_to_scaler: bool = False, count: Optional[Count] = None,
                    carried: bool = False) -> Tuple[torch.Tensor, bool, Optional[float]]:
        """Average the loss over replicas (one collective); vote on non-finite gradients.

        ``local_loss``: this rank's loss, a tensor (None where it runs no last stage); it, the vote and the count
        come to the host in one copy, the step's one synchronisation with a device, and travel in one row.

        ``count``: where the loss_fn returned ``(total, count)``, ``local_loss``
        is this rank's sum of totals and ``count`` its sum of counts; the loss is
        then the sum of totals over the sum of counts of every rank, and that
        global count is returned (else None) for the gradients to be divided by.

        With ``overflow_to_scaler`` (a GradScaler judges the step): if any rank's
        gradients are not finite, every rank marks one of its own gradients inf,
        so that every rank's scaler skips the step and backs off its scale alike
        (each scaler sees only its own process's gradients). Otherwise, with
        ``skip_nonfinite``: a step with a non-finite loss or gradients anywhere is
        skipped, every rank drops its gradients (set to None, so
        ``optimizer.step()`` changes nothing) and a warning names the ranks.
        ``carried``: an earlier call of this optimizer step was skipped on this
        rank (``skipped.OpenSkip``); then this call is skipped on every rank too.
        Returns the global mean loss, whether the step was skipped and the global count.
        """
        params = list(params)
        grads = [p.grad for p in params if p.grad is not None]
        f64, vote = torch.float64, (skip_nonfinite or overflow_to_scaler) and bool(grads) and not carried
        on = [t.device for t in (local_loss, count) if isinstance(t, torch.Tensor)]
        dev = on[0] if on else local(grads[0]).device if vote else torch.device("cpu")
        # (loss, grads not finite, count): on the device until one copy brings them to the host (none: all numbers)
        bad = _not_finite(grads, dev) if vote else scalar_on(2.0 if carried else 0.0, dev)
        head = torch.stack([scalar_on(local_loss, dev), bad, scalar_on(count, dev)])
        mine = torch.cat([head.cpu() if on or vote else head, torch.tensor([count is not None], dtype=f64)])
        if self.distributed:
            everyone = [torch.zeros_like(mine) for _ in range(self.topology.world_size)]
            with self._waiting("waited for every rank's loss at the end of a step: a rank stalled or died in its "
                               "step, or skipped train_step (a collective: call it on every rank)"):
                gather_rows(everyone, mine, group=self.host_group, ranks=self.topology.job_ranks,
                            rank=self.topology.rank, kind=1)
        else:
            everyone = [mine]
        table = torch.stack(everyone).tolist()  # every rank's row (loss, bad grads, count, counted), on the host
        total = sum(t[0] for t in table)
        counted = any(t[3] > 0 for t in table)
        n = sum(t[2] for t in table) if counted else None
        loss = torch.tensor(total / self.topology.replicas if n is None else (total / n if n else float("nan")),
                            dtype=torch.float64)
        ranks = self.topology.job_ranks if self.distributed else [self.topology.rank]
        losses = [r for r, t in zip(ranks, table) if skip_nonfinite and not math.isfinite(t[0])]
        grads_bad = [r for r, t in zip(ranks, table) if t[1] == 1]
        held = any(t[1] == 2 for t in table)  # the step was skipped at an earlier call: this one goes with it
        if overflow_to_scaler and grads_bad:
            if grads:
                grads[0].fill_(float("inf"))  # any layout; the scaler only needs to find one inf
            return loss, False, n
        if not (losses or grads_bad or held):
            return loss, False, n
        for p in params:
            p.grad = None
        where = "; ".join(part for part in (
            f"non-finite loss on rank(s) {losses}" if losses else "",
            f"non-finite gradients on rank(s) {grads_bad}" if grads_bad else "",
            "an earlier call since the last optimizer.step() was skipped" if held else "") if part)
        warn(f"pipeddp: skipped a training step: {where}; gradients were dropped on every rank "
             f"({skipped + (0 if held else 1)} skipped so far)", RuntimeWarning)
        return loss, True, n

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

