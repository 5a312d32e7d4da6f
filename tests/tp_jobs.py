"""Jobs of ``test_tensor_parallel.py``: engines on a (dp, pp, tp) mesh, each stage sharded over tp."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Dict, List, Tuple

import nccl_rules
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import pipeddp
from pipeddp.tools.models import flatten_sequential

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

SEED, LR, MAX_NORM = 5, 0.1, 0.05
VOCAB, T = 40, 6
MLP_PLAN = {"block*.fc1": "colwise", "block*.fc2": "rowwise", "head": "colwise_gather_output"}


class Block(nn.Module):
    """A residual MLP block: the pair a tensor-parallel plan shards (fc1 by columns, fc2 by rows)."""

    def __init__(self, width: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def mlp(meta: bool = True) -> nn.Sequential:
    with torch.device("meta" if meta else "cpu"):
        return nn.Sequential(OrderedDict([("embed", nn.Linear(5, 8)), ("block0", Block()), ("block1", Block()),
                                          ("block2", Block()), ("head", nn.Linear(8, 10))])).double()


def llama(meta: bool = True, heads: int = 4, tied: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=heads // 2 or 1, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tied)
    with torch.device("meta" if meta else "cpu"):
        return LlamaForCausalLM(config).double()


def qwen2(meta: bool = True) -> nn.Module:
    """Qwen2: biases on q, k and v (sharded with their columns)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    with torch.device("meta" if meta else "cpu"):
        return Qwen2ForCausalLM(config).double()


def mlp_batches(n: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 10, generator=g,
                                                                              dtype=torch.float64))]


def lm_batches(n: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(1, VOCAB, (n, T), generator=g), torch.randint(0, VOCAB, (n, T), generator=g))]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    out = getattr(out, "logits", out)
    return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def whole(named: Any) -> Dict[str, torch.Tensor]:
    """Every tensor whole (a DTensor gathered over tp: a collective, in one order on every tp rank)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in named}


def momenta(engine: pipeddp.HybridParallel, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Each parameter's SGD momentum buffer, whole."""
    return whole((k, opt.state[p]["momentum_buffer"]) for k, p in engine.named_parameters())


def train_once(engine: pipeddp.HybridParallel, batch: Tuple[torch.Tensor, torch.Tensor], loss_fn: Any,
               local: int, save_to: str = "") -> Dict[str, Any]:
    """The engine's weights at the start, then one step: loss, gradients (clipped), norm, weights, eval output.
    With ``save_to``: SGD with momentum (the first step's the same; its buffers hold the gradients), saved there
    after the step as one file and as a sharded checkpoint."""
    r = engine.topology.replica
    x, y = (t[r * local:(r + 1) * local] for t in batch)
    out: Dict[str, Any] = {"start": whole(engine.named_parameters())}
    opt = torch.optim.SGD(engine.parameters(), lr=LR, momentum=0.9 if save_to else 0.0)
    out["loss"] = engine.train_step(x if engine.is_first else None, y if engine.is_last else None, loss_fn).item()
    out["norm"] = engine.clip_grad_norm_(MAX_NORM).item()
    out["grads"] = whole((k, p.grad) for k, p in engine.named_parameters())
    opt.step()
    out["after"] = whole(engine.named_parameters())
    if save_to:
        engine.save(os.path.join(save_to, "one.pt"), optimizer=opt)
        engine.save(os.path.join(save_to, "sharded"), optimizer=opt, sharded=True)
    logits = engine.eval_step(x if engine.is_first else None)
    out["logits"] = getattr(logits, "logits", logits) if engine.is_last else None
    out["sharded"] = sorted(k for k, p in engine.named_parameters() if isinstance(p, DTensor))
    out["meshes"] = sorted({str(p.device_mesh.mesh_dim_names) for p in engine.parameters()
                            if isinstance(p, DTensor)})
    out["local_numel"] = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in engine.parameters())
    return out


def tp_job(shape: Tuple[int, int, int], kinds: List[str], tmp: str = "") -> Dict[str, Any]:
    """Each of ``kinds`` ("mlp", "llama") meta-built, cut in ``shape[1]`` stages and sharded over ``shape[2]``.
    With ``tmp``, an "mlp-full" engine saves its step there, and fresh engines of other weights load each checkpoint
    (``"loaded"``: their weights and momenta)."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "pp", "tp"))
    out: Dict[str, Any] = {"rank": dist.get_rank(), "place": tuple(mesh.get_coordinate() or ())}
    local = 4
    for kind in kinds:
        extra: Dict[str, Any] = {}
        for shard in ("optimizer", "full"):
            if kind.endswith("-" + shard):  # FSDP2 over dp of the tp stages
                extra = {"shard": shard}
        if kind.startswith("mlp"):
            model, plan, batch, loss_fn = mlp(), MLP_PLAN, mlp_batches(local * shape[0])[0], mse
            if kind == "mlp-v2":  # two stages per process, each forward replayed in backward
                extra = {"virtual_stages": 2, "schedule": "interleaved", "checkpoint": "always", "balance": "uniform"}
            if kind == "mlp-whole":  # built with values, different on each tp rank: tp rank 0's are taken
                torch.manual_seed(mesh.get_local_rank("tp"))
                model = mlp(meta=False)
        else:
            batch, loss_fn = lm_batches(local * shape[0])[0], lm_loss
            model, plan = flatten_sequential(qwen2() if kind.startswith("qwen2") else llama(), batch[0][:1]), "auto"
        kwargs = {"chunks": 2, "balance": "params", **extra}
        save_to = os.path.join(tmp, kind) if tmp and kind == "mlp-full" else ""
        if save_to:
            os.makedirs(save_to, exist_ok=True)
        with pipeddp.HybridParallel(model, stages=shape[1], mode="stage", seed=SEED, mesh=mesh, tp_plan=plan,
                                    **kwargs) as engine:
            out[kind] = train_once(engine, batch, loss_fn, local, save_to)
        if save_to:
            out[kind]["loaded"] = {}
            for name in ("one.pt", "sharded"):
                with pipeddp.HybridParallel(mlp(), stages=shape[1], mode="stage", seed=SEED + 1, mesh=mesh,
                                            tp_plan=plan, **kwargs) as engine:
                    opt = torch.optim.SGD(engine.parameters(), lr=LR, momentum=0.9)
                    engine.load(os.path.join(save_to, name), optimizer=opt)
                    out[kind]["loaded"][name] = (whole(engine.named_parameters()), momenta(engine, opt))
    return out


def refusal_job(cases: List[Tuple[str, Dict[str, Any]]]) -> Dict[str, str]:
    """What each (model kind, HybridParallel's arguments) is told, on a (1, 1, 2) mesh: nothing is built."""
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("dp", "pp", "tp"))
    told = {}
    for name, kwargs in cases:
        model = mlp()
        if name.startswith("llama"):
            model = flatten_sequential(llama(heads=3 if "heads" in name else 4, tied="tied" in name),
                                       lm_batches(1)[0][0])
        kwargs = {"stages": 1, "mode": "stage", "mesh": mesh, "tp_plan": MLP_PLAN, **kwargs}
        if kwargs["mesh"] == "2d":
            kwargs["mesh"] = mesh["dp", "pp"]
        try:
            pipeddp.HybridParallel(model, **kwargs).close()
            told[name] = "built"
        except (ValueError, TypeError) as exc:
            told[name] = str(exc)
    return told
