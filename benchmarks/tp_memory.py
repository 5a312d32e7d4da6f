"""Memory of tensor parallelism inside the stages: what each process of a pp2 x tp2 job holds. See benchmarks/README.md.

One spawned gloo job of 4 processes (a (1, 2, 2) mesh: dp, pp, tp) builds a Llama on the meta device (its decoder
layers hold most of the parameters), flattened, under ``tp_plan="auto"``; the engine materializes each layer from
the seed and shards it at once. Per process: the bytes of its parameters (a DTensor's local shard) against its
stage's whole bytes, and its peak RSS from before the engine is built until after one training step (SGD), against
its own parameters and gradients. The peak is the kernel's high-water mark (VmHWM), reset through
/proc/self/clear_refs where that is allowed (``hwm_reset``), else ``ru_maxrss``: then the peak since the process
started, an upper bound.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # started as a script
import pipeddp
from benchmarks.common import Run, gather, init_job, parser, proc_status

MB = 1 << 20
#: the targets: a process's parameters at most this share of its stage's; its peak RSS growth at most
#: GROWTH x (its parameters + gradients) + SLACK bytes
SHARE, GROWTH, SLACK = 0.55, 1.25, 200 * MB


def llama(args: Any) -> nn.Module:
    """A Llama on the meta device, float32, no dropout, untied head (``tp_plan="auto"`` refuses a tied one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.seq, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _local_bytes(tensors: Any) -> int:
    """Bytes this process holds for ``tensors`` (a DTensor: its local shard; None: nothing)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if type(t).__name__ == "DTensor" else t
        total += t.numel() * t.element_size()
    return total


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux's clear_refs "5"); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def job(args: Any) -> Dict[str, Any]:
    """Build the engine on the (1, 2, 2) mesh from a meta model, one SGD step; this process's figures."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipeddp.tools.models import flatten_sequential

    rank = init_job(args.timeout)
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    model = flatten_sequential(llama(args), x[:1])
    whole_model = sum(p.numel() * p.element_size() for p in model.parameters())
    hwm_reset = _reset_hwm()
    before = proc_status()["VmRSS"] * 1024
    start = time.perf_counter()
    engine = pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=args.chunks, balance="params",
                                    seed=args.seed, mesh=mesh, tp_plan="auto")
    built = proc_status()["VmRSS"] * 1024
    opt = torch.optim.SGD(engine.parameters(), lr=1e-3)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    engine.train_step(x if engine.is_first else None, y if engine.is_last else None, loss_fn)
    opt.step()
    elapsed = time.perf_counter() - start
    st = proc_status()
    peak = st["VmHWM"] * 1024 if hwm_reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = list(engine.parameters())
    out = {"rank": rank, "place": list(mesh.get_coordinate() or ()), "whole_model": whole_model,
           "stage": sum(p.numel() * p.element_size() for p in params),  # a DTensor's numel is its whole tensor's
           "params": _local_bytes(params), "grads": _local_bytes(p.grad for p in params),
           "rss_before": before, "rss_built": built - before, "rss_after": st["VmRSS"] * 1024 - before,
           "peak_growth": peak - before, "hwm_reset": hwm_reset, "build_and_step_s": elapsed,
           "sharded": sum(1 for p in params if type(p).__name__ == "DTensor"), "tensors": len(params)}
    engine.close()
    got = gather(out)
    return {"ranks": got} if got is not None else {}


def report(ranks: List[Dict[str, Any]], args: Any, run: Run) -> Dict[str, Any]:
    rows, checks = [], []
    for r in ranks:
        own = r["params"] + r["grads"]
        bound = GROWTH * own + SLACK
        r.update(share=r["params"] / r["stage"], bound=bound)
        rows.append([r["rank"], f"pp{r['place'][1]} tp{r['place'][2]}", f"{r['sharded']}/{r['tensors']}",
                     r["stage"] / MB, r["params"] / MB, r["share"], r["grads"] / MB, r["rss_before"] / MB,
                     r["rss_built"] / MB, r["peak_growth"] / MB, bound / MB])
        checks.append([f"rank {r['rank']}: parameters / its stage's whole", r["share"], f"<= {SHARE}",
                       r["share"] <= SHARE])
        checks.append([f"rank {r['rank']}: peak RSS growth MB, before building to after a step",
                       r["peak_growth"] / MB, f"<= {bound / MB:.0f} ({GROWTH} x own + {SLACK // MB})",
                       r["peak_growth"] <= bound])
    total = ranks[0]["whole_model"] / MB
    run.table(f"pp2 x tp2, Llama {args.layers} x hidden {args.hidden} (intermediate {args.intermediate}, vocab "
              f"{args.vocab}), {total:.1f} MB float32 in all, tp_plan='auto', meta-built: MB per process",
              ["rank", "place", "sharded tensors", "stage whole", "params", "params / stage", "grads",
               "RSS before", "RSS growth built", "peak RSS growth", "1.25 x own + 200"], rows,
              caption=f"peak: VmHWM reset by clear_refs {'yes' if all(r['hwm_reset'] for r in ranks) else 'no '}"
                      f"{'' if all(r['hwm_reset'] for r in ranks) else '(ru_maxrss: an upper bound)'}; batch "
                      f"{args.batch} x {args.seq} tokens, {args.chunks} micro-batches, SGD")
    return {"ranks": ranks, "targets": run.targets(checks)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = parser(__doc__, "a Llama of 2 x hidden 128 (about 2 MB)", spawns=True, device=False)
    p.add_argument("--hidden", type=int, default=None, help="default 512 (--quick 128)")
    p.add_argument("--intermediate", type=int, default=None, help="default 1536 (--quick 384)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 6; --quick 2)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=None, help="default 2048 (--quick 512)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--chunks", type=int, default=2)
    args: argparse.Namespace = p.parse_args(argv)
    for key, full, quick in (("hidden", 512, 128), ("intermediate", 1536, 384), ("layers", 6, 2),
                             ("vocab", 2048, 512)):
        setattr(args, key, getattr(args, key) or (quick if args.quick else full))
    run = Run("tp_memory", args, "one spawned gloo job of 4 processes; not timed; RSS from /proc")
    ranks = pipeddp.spawn(job, 4, args=(args,), timeout=args.timeout)[0]["ranks"]
    run.finish(**report(ranks, args, run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
