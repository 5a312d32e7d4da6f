"""What grows with the number of processes: sockets, rendezvous-store operations, messages per step, agreement bytes.

Counted, not timed (counts do not depend on the host's load): N processes on this host (``pipeddp.spawn``, gloo,
one intra-op thread each), a tiny MLP, three configurations per N: ``stage`` (2 stages x N/2 replicas, one stage per
process), ``replica`` (every process holds both stages, N replicas) and plain DDP of the whole model over N. The
engine starts the process group itself (``env://``, as a script that leaves it to the engine), so its groups are
made as the engine makes them: full meshes by default, connected on first use with ``--lazy-groups``
(``PIPEDDP_LAZY_GROUPS=1``, ``distributed.lazy``); the DDP script starts its own (a full mesh; ``--lazy`` sets
``TORCH_GLOO_LAZY_INIT=1`` in every process, for every group). Per process:

    sockets     /proc/self/fd entries that are sockets after the engine is built, less those held once the
                store's TCPStore exists (its client), on every rank but 0 (which also serves the store)
    store ops   set/get/add/wait/compare_set/check/delete calls on the job's store (a counting
                ``torch.distributed.Store`` wrapped around the TCPStore: handed to ``init_process_group`` by the
                ``env://`` rendezvous, or passed to it by the DDP script; every group's ``PrefixStore`` goes through
                it) from the store made to the engine built ("setup"), then during the steps (connections made late)
    per step    calls into torch.distributed's messages and collectives during one training step (the functions
                wrapped in the job process; DDP's all-reduces counted by a comm hook that runs the default one)
                and the bytes the agreements (``rows``) send
    peak rss    the process's peak resident memory (``ru_maxrss``): whether a larger N fits on the host

``--simulate`` plays the agreements' plan (``rows.tree_links``: a star up to ``rows.STAR_UP_TO`` members, a
binomial tree above) and the group layout (``groups.make_groups`` over ``Topology``) in one process for thousands
of ranks: messages and rounds per rank per agreement, connections per rank (docs/scale.md).
"""

from __future__ import annotations

import datetime
import importlib
import math
import os
import resource
import statistics
import sys
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks.common import Run, parser
from pipeddp.distributed import rows
from pipeddp.distributed.topology import Topology

CONFIGS = ("stage", "replica", "ddp")
WRAPPED = ("isend", "irecv", "send", "recv", "batch_isend_irecv", "all_reduce", "broadcast", "all_gather",
           "all_gather_object", "broadcast_object_list", "gather_object", "barrier", "reduce_scatter_tensor",
           "all_gather_into_tensor", "all_to_all_single")
#: counts that follow the agreements' shape (a star up to ``rows.STAR_UP_TO`` members): fitted over those N alone
STAR_SHAPED = ("p2p_per_step", "agreement_p2p_per_step", "agreement_bytes")
STORE_OPS = ("set", "get", "add", "wait", "compare_set", "check", "delete_key")


class CountingStore(dist.Store):
    """A store that counts the calls made on it and passes them to ``inner`` (the job's TCPStore)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.calls = inner, Counter()  # type: Counter[str]

    def set(self, key: str, value: Any) -> None:
        self.calls["set"] += 1
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.calls["get"] += 1
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self.calls["add"] += 1
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        self.calls["compare_set"] += 1
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: List[str], timeout: Optional[datetime.timedelta] = None) -> None:
        self.calls["wait"] += 1
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys: List[str]) -> bool:
        self.calls["check"] += 1
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        self.calls["delete_key"] += 1
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    def clone(self) -> "CountingStore":
        """A second client of the same store (the lazy groups' watcher waits on one), counted with this one."""
        twin = CountingStore(self.inner.clone())
        twin.calls = self.calls
        return twin


def sockets() -> int:
    """This process's open file descriptors that are sockets."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


class CallCount:
    """Calls into torch.distributed's communication functions, by function and calling module, while ``on``; the
    bytes sent by ``rows`` (the agreements' gatherings) in ``agreement_bytes``."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.agreement_bytes = 0
        self.on = False
        for name in WRAPPED:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                caller = sys._getframe(1).f_globals.get("__name__", "?")
                if caller.startswith("torch.distributed"):  # torch's own helpers (an object collective's parts)
                    return fn(*args, **kwargs)
                self.calls[f"{name}@{caller}"] += 1
                if name == "isend" and caller == rows.__name__:
                    self.agreement_bytes += args[0].numel() * args[0].element_size()
            return fn(*args, **kwargs)
        return counted


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _counted_rendezvous(box: List[Any]) -> None:
    """The ``env://`` rendezvous of ``init_process_group`` (what the engine calls where it starts the process
    group) hands out a counting store, put in ``box`` with the sockets held once the TCPStore exists."""
    rendezvous: Any = importlib.import_module("torch.distributed.rendezvous")  # the module, not dist.rendezvous
    real = rendezvous._create_c10d_store

    def create(*args: Any, **kwargs: Any) -> dist.Store:
        box[:] = [CountingStore(real(*args, **kwargs)), sockets()]
        return box[0]

    rendezvous._create_c10d_store = create


def job(config: str, steps: int) -> Dict[str, Any]:
    """One process's counts for ``config`` (see the module docstring)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=120)
    count = CallCount()
    hook_calls = [0]

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses a hook whose bucket is not annotated
        hook_calls[0] += count.on
        return default_hooks.allreduce_hook(state, bucket)

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    t0 = time.perf_counter()
    loss = nn.functional.mse_loss
    box: List[Any] = []
    if config == "ddp":  # the script starts the process group (eager unless TORCH_GLOO_LAZY_INIT=1, --lazy)
        box[:] = [CountingStore(dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                              rank == 0, timeout=timeout)), sockets()]
        dist.init_process_group("gloo", store=box[0], rank=rank, world_size=world, timeout=timeout)
        engine: Any = nn.parallel.DistributedDataParallel(model())
        engine.register_comm_hook(None, hook)
        opt = torch.optim.SGD(engine.parameters(), lr=0.01)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss(engine(x), y).backward()
    else:  # the engine starts it, as a torchrun or spawn script that leaves it to the engine does
        _counted_rendezvous(box)
        engine = pipeddp.HybridParallel(model(), stages=2, mode=config, chunks=2, balance="uniform", comm_hook=hook,
                                        devices=["cpu"] * (2 if config == "replica" else 1), log_every=None,
                                        timeout=timeout)
        opt = torch.optim.SGD(engine.parameters(), lr=0.01)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            engine.train_step(x if engine.is_first else None, y if engine.is_last else None, loss)
    store, before = box  # before: the store's client (and on rank 0 its server, whose clients' sockets come later)
    setup_s = time.perf_counter() - t0
    built, store_setup = sockets(), dict(store.calls)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    per_step: List[Dict[str, Any]] = []
    for s in range(steps + 1):  # the first step warms up (schedule="auto", headers): the later ones are counted
        opt.zero_grad()
        count.calls.clear()
        count.agreement_bytes, hook_calls[0] = 0, 0
        count.on = s > 0
        step(x, y)
        count.on = False
        opt.step()
        if s > 0:
            per_step.append({"calls": dict(count.calls), "ddp_allreduces": hook_calls[0],
                             "agreement_bytes": count.agreement_bytes})
    after_steps, store_steps = sockets(), sum(store.calls.values()) - sum(store_setup.values())
    if config != "ddp":
        engine.close()  # it started the process group: rank 0, which serves the store, waits for every rank first
    else:
        dist.barrier()
        store.add("left", 1)  # rank 0 serves the store: it stays until every rank is past the barrier, which with
        while rank == 0 and store.add("left", 0) < world:  # TORCH_GLOO_LAZY_INIT may still connect through it
            time.sleep(0.01)
        dist.destroy_process_group()
    return {"rank": rank, "sockets_before": before, "sockets_built": built - before,
            "sockets_after_steps": after_steps - before, "store_setup": sum(store_setup.values()),
            "store_steps": store_steps, "store_by_op": store_setup,
            "setup_s": setup_s, "steps": per_step,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def summarise(ranks: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Per configuration and N: each count's largest and median over the ranks (the last counted step)."""
    def stat(values: Sequence[float]) -> Dict[str, float]:
        return {"max": max(values), "median": statistics.median(values)}

    others = [r for r in ranks if r["rank"] != 0] or list(ranks)  # rank 0 also holds the store's N clients
    last = [r["steps"][-1] for r in ranks]
    msgs = [sum(v for k, v in s["calls"].items() if k.split("@")[0] in ("isend", "irecv", "send", "recv"))
            for s in last]
    agreement = [sum(v for k, v in s["calls"].items() if k.endswith("@" + rows.__name__)) for s in last]
    collectives = [sum(v for k, v in s["calls"].items() if k.split("@")[0] not in ("isend", "irecv", "send", "recv"))
                   + s["ddp_allreduces"] for s in last]
    return {"sockets_built": stat([r["sockets_built"] for r in others]),
            "sockets_after_steps": stat([r["sockets_after_steps"] for r in others]),
            "store_setup": stat([r["store_setup"] for r in ranks]),
            "store_steps": stat([r["store_steps"] for r in ranks]),
            "p2p_per_step": stat(msgs), "agreement_p2p_per_step": stat(agreement),
            "collectives_per_step": stat(collectives), "agreement_bytes": stat([s["agreement_bytes"] for s in last]),
            "setup_s": stat([r["setup_s"] for r in ranks]), "peak_rss_mb": stat([r["peak_rss_mb"] for r in ranks]),
            "calls_rank0": last[0]["calls"], "store_by_op_rank0": ranks[0]["store_by_op"]}


def fit(ns: Sequence[int], values: Sequence[float]) -> Dict[str, Any]:
    """Least squares of ``values`` against a + b N and against a + b log2 N; the better one's projection."""
    def line(xs: Sequence[float]) -> Tuple[float, float, float]:
        mx, my = statistics.mean(xs), statistics.mean(values)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (v - my) for x, v in zip(xs, values)) / sxx if sxx else 0.0
        a = my - b * mx
        return a, b, sum((a + b * x - v) ** 2 for x, v in zip(xs, values))

    lin, log = line([float(n) for n in ns]), line([math.log2(n) for n in ns])
    kind, (a, b, _) = ("N", lin) if lin[2] <= log[2] else ("log2 N", log)
    project = {n: a + b * (n if kind == "N" else math.log2(n)) for n in (1024, 4096, 16384)}
    return {"form": f"{a:.1f} + {b:.2f} {kind}", "projection": project}


# -- the simulated job ----------------------------------------------------------------------------------------


def agreement_plan(n: int) -> Dict[str, Any]:
    """One gathering of ``n`` members (``rows.gather_rows``), played from its plan: per member the messages it sends
    and receives, and the rounds (message latencies one after another) until every member holds the table."""
    if n <= rows.STAR_UP_TO:
        per = [2 * (n - 1)] + [2] * (n - 1)  # the first member: a row from each and the table to each
        return {"rounds": 2 if n > 1 else 0, "messages_max": max(per), "messages_median": statistics.median(per),
                "peers_max": n - 1}
    up = [0] * n  # when member i holds its subtree's rows (its children's rows have arrived)
    links = [rows.tree_links(n, i) for i in range(n)]
    for i in reversed(range(n)):  # children have larger indices than their parent
        children, _, _ = links[i]
        up[i] = max((up[i + c] + 1 for c in children), default=0)
    down = [0] * n
    for i in range(n):  # the table comes back down the same edges, one latency per edge
        parent = links[i][1]
        down[i] = up[0] if parent is None else down[parent] + 1
    per = [2 * (len(c) + (p is not None)) for c, p, _ in links]
    return {"rounds": max(down), "messages_max": max(per), "messages_median": statistics.median(per),
            "peers_max": max(len(c) + (p is not None) for c, p, _ in links)}


def layout(n: int, stages: int, mode: str = "stage") -> Dict[str, Any]:
    """The groups ``groups.make_groups`` makes for ``n`` ranks (the world, a group per stage, one per pipeline in
    stage mode; on nccl a gloo twin of the world and of each pipeline): per rank the gloo connections of a full
    mesh per group, and the peers a step talks to (the agreements' tree, the pipeline's neighbours, DDP's ring)."""
    worst: Dict[str, int] = {"gloo_job": 0, "nccl_job_gloo_twins": 0, "step_peers": 0}
    for rank in range(n):
        topo = Topology(rank, n, 0, 1, stages, mode)
        groups = [topo.job_ranks, topo.stage_ranks(topo.stage if mode == "stage" else 0)]
        pipes = [topo.pipeline_ranks(topo.replica)] if mode == "stage" else []
        gloo = sum(len(g) - 1 for g in groups + pipes)
        twins = len(topo.job_ranks) - 1 + sum(len(p) - 1 for p in pipes)
        children, parent, _ = rows.tree_links(n, topo.job_ranks.index(rank)) if n > rows.STAR_UP_TO else ([], 0, 0)
        tree = len(children) + (parent is not None) if n > rows.STAR_UP_TO else (n - 1 if rank == 0 else 1)
        neighbours = min(2, stages - 1) if mode == "stage" else 0
        ring = min(2, topo.replicas - 1)
        for key, value in (("gloo_job", gloo), ("nccl_job_gloo_twins", twins),
                           ("step_peers", tree + neighbours + ring)):
            worst[key] = max(worst[key], value)
        if rank >= 2 * stages and n > 64:  # the ranks' counts repeat per pipeline beyond the first ones: sample
            break
    return worst


def simulate(ns: Sequence[int], stages: int) -> Dict[int, Dict[str, Any]]:
    """Per N: one agreement's plan and the layout's connections (2 agreements per training step)."""
    out: Dict[int, Dict[str, Any]] = {}
    for n in ns:
        plan = agreement_plan(n)
        out[n] = {**plan, "agreements_per_step": 2, "log2_n": math.log2(n), **layout(n, stages)}
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser(__doc__, "N = 4, 8; one counted step", spawns=True, device=False)
    p.add_argument("--ns", default="4,8,16", help="the numbers of processes, comma-separated")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"some of {CONFIGS}")
    p.add_argument("--steps", type=int, default=2, help="counted steps after one warm-up step")
    p.add_argument("--lazy", action="store_true", help="TORCH_GLOO_LAZY_INIT=1 in every process (ddp's group too)")
    p.add_argument("--lazy-groups", action="store_true", help="PIPEDDP_LAZY_GROUPS=1: the engine's groups lazily")
    p.add_argument("--simulate", default="4096,16384", help="N of the simulated job (P = 8 stages); '' for none")
    args = p.parse_args(argv)
    ns = [4, 8] if args.quick else [int(n) for n in args.ns.split(",")]
    steps = 1 if args.quick else args.steps
    run = Run("scale", args, "counts per process (not timed); one spawned gloo job per (configuration, N)")
    env = {**({"TORCH_GLOO_LAZY_INIT": "1"} if args.lazy else {}),
           **({"PIPEDDP_LAZY_GROUPS": "1"} if args.lazy_groups else {})}
    results: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for config in args.configs.split(","):
        for n in ns:
            ranks = pipeddp.spawn(job, n, args=(config, steps), timeout=args.timeout, threads=1, env=env)
            results.setdefault(config, {})[n] = {**summarise(ranks), "ranks": ranks}
            print(f"  {config} N={n}: done", flush=True)
    keys = ("sockets_built", "sockets_after_steps", "store_setup", "store_steps", "p2p_per_step",
            "agreement_p2p_per_step", "collectives_per_step", "agreement_bytes", "peak_rss_mb")
    table, fits = [], {}
    star = [n for n in ns if n <= rows.STAR_UP_TO]  # the agreements' shape changes above: a fit over both is neither
    for config, by_n in results.items():
        for key in keys:
            table.append([f"{config}: {key} (max)", *(by_n[n][key]["max"] for n in ns)])
            over = star if key in STAR_SHAPED and len(star) >= 2 else ns
            fits[f"{config}/{key}"] = {**fit(over, [by_n[n][key]["max"] for n in over]), "ns": over}
    how = "".join(f" ({v})" for k, v in (("lazy", "TORCH_GLOO_LAZY_INIT=1"), ("lazy_groups", "PIPEDDP_LAZY_GROUPS=1"))
                  if getattr(args, k))
    run.table(f"per process, counted{how}", ["count", *map(str, ns)], table)
    run.table("fits and projections", ["count", "fit", "over N", "1,024", "4,096", "16,384"],
              [[k, f["form"], ",".join(map(str, f["ns"])), *(f"{v:.0f}" for v in f["projection"].values())]
               for k, f in fits.items()])
    sim = simulate([int(n) for n in args.simulate.split(",")], 8) if args.simulate else {}
    if sim:
        run.table("simulated job, P = 8 stages (one agreement; 2 per step)",
                  ["N", "rounds", "msgs max", "2 log2 N", "gloo conns (gloo job)", "gloo conns (nccl job)",
                   "step peers"],
                  [[n, s["rounds"], s["messages_max"], f"{2 * s['log2_n']:.0f}", s["gloo_job"],
                    s["nccl_job_gloo_twins"], s["step_peers"]] for n, s in sim.items()])
    run.finish({"lazy": args.lazy, "lazy_groups": args.lazy_groups, "ns": ns}, counted=results, fits=fits,
               simulated=sim)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
