"""Jobs of ``test_tp_dropout.py``: dropout under tensor parallelism, replicated and split activations, with and
without recompute, on a pp2 x tp2 mesh; and the plain model's steps the engine must equal."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, List, Tuple

import nccl_rules
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from tp_jobs import SEED, VOCAB, lm_loss, mse, whole

import pipeddp
from pipeddp.runtime import step as step_module
from pipeddp.tools.models import flatten_sequential

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

SHAPE = (1, 2, 2)  # dp, pp, tp
N, CHUNKS, STEPS, LR, T = 4, 2, 2, 0.5, 6
BASES = [1234, 98765]  # the steps' base seeds (the engine draws them from the process's generator)
STAGE = 1_000_003  # seed(stage s, micro-batch i) = base + STAGE * s + i (runtime/rng.py)
MLP_PLAN = {"block*.fc1": "colwise", "block*.fc2": "rowwise", "head": "colwise_gather_output"}
BALANCE = {"mlp": [3, 3], "llama": [2, 3]}  # llama: embed, layer 0 | layer 1, norm, head


class Block(nn.Module):
    """A residual MLP block with dropout on its hidden features (split over tp between fc1 and fc2) and on its
    output (replicated over tp, after fc2's all-reduce)."""

    def __init__(self, width: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.hidden_drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(hidden, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(self.hidden_drop(torch.tanh(self.fc1(self.norm(x))))))


def mlp(p: float = 1.0) -> nn.Sequential:
    """Meta-built; ``p`` scales every dropout probability (0: none)."""
    with torch.device("meta"):
        model = nn.Sequential(OrderedDict([("embed", nn.Linear(5, 8)), ("embed_drop", nn.Dropout(0.25)),
                                           ("block0", Block()), ("block1", Block()), ("block2", Block()),
                                           ("head", nn.Linear(8, 10))])).double()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p *= p
    return model


def llama(p: float = 1.0) -> nn.Sequential:
    """A tiny Llama with attention dropout (its heads split over tp by the q, k, v projections), flattened."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.3 * p, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).double()
    return flatten_sequential(model, batches("llama")[0][0][:1])


def batches(kind: str) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    if kind == "mlp":
        return [(torch.randn(N, 5, generator=g, dtype=torch.float64),
                 torch.randn(N, 10, generator=g, dtype=torch.float64)) for _ in range(STEPS)]
    return [(torch.randint(1, VOCAB, (N, T), generator=g), torch.randint(0, VOCAB, (N, T), generator=g))
            for _ in range(STEPS)]


MODELS: Dict[str, Tuple[Callable[..., nn.Sequential], Any, Callable[..., torch.Tensor]]] = {
    "mlp": (mlp, MLP_PLAN, mse), "llama": (llama, "auto", lm_loss)}


def reference(kind: str, p: float = 1.0) -> Dict[str, Any]:
    """The plain model materialized from SEED on one device, trained on the same micro-batches, each stage's layers
    run from the seed the engine gives that stage and micro-batch: each step's loss and gradients, the weights
    after."""
    make, _, loss_fn = MODELS[kind]
    model = make(p)
    pipeddp.materialize(model, seed=SEED)
    layers = list(model)
    cut = BALANCE[kind][0]
    stages = [nn.Sequential(*layers[:cut]), nn.Sequential(*layers[cut:])]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: Dict[str, Any] = {"loss": [], "grads": []}
    for base, (x, y) in zip(BASES, batches(kind)):
        opt.zero_grad()
        total = 0.0
        for i, (xi, yi) in enumerate(zip(x.chunk(CHUNKS), y.chunk(CHUNKS))):
            h = xi
            for s, stage in enumerate(stages):
                torch.manual_seed(base + STAGE * s + i)
                h = stage(h)
            loss = loss_fn(h, yi) / CHUNKS
            loss.backward()
            total += loss.item()
        out["loss"].append(total)
        out["grads"].append({k: q.grad.clone() for k, q in model.named_parameters()})
        opt.step()
    out["after"] = {k: q.detach().clone() for k, q in model.named_parameters()}
    return out


def train(engine: pipeddp.HybridParallel, kind: str) -> Dict[str, Any]:
    """The engine's steps: each step's loss and gradients (whole), the weights after (whole), and this rank's
    tensors the plan leaves whole (the same on every tp rank, if the ranks drew alike)."""
    _, _, loss_fn = MODELS[kind]
    seeds = iter(BASES)
    step_module.draw_base_seed = lambda: next(seeds)  # type: ignore[attr-defined]
    opt = torch.optim.SGD(engine.parameters(), lr=LR)
    out: Dict[str, Any] = {"loss": [], "grads": []}
    for x, y in batches(kind):
        opt.zero_grad()
        loss = engine.train_step(x if engine.is_first else None, y if engine.is_last else None, loss_fn)
        out["loss"].append(loss.item())
        out["grads"].append(whole((k, q.grad) for k, q in engine.named_parameters()))
        opt.step()
    out["after"] = whole(engine.named_parameters())
    out["replicated"] = {k: q.detach().clone() for k, q in engine.named_parameters() if not isinstance(q, DTensor)}
    out["sharded"] = sorted(k for k, q in engine.named_parameters() if isinstance(q, DTensor))
    return out


def dropout_job() -> Dict[str, Any]:
    """The MLP under a dict plan and the Llama under 'auto', meta-built, two steps each without recompute and with
    every forward replayed in backward (``checkpoint="always"``)."""
    from pipeddp.runtime.rng import draw_base_seed

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=("dp", "pp", "tp"))
    out: Dict[str, Any] = {"rank": dist.get_rank(), "place": tuple(mesh.get_coordinate() or ())}
    try:
        for kind, (make, plan, _) in MODELS.items():
            for checkpoint in ("never", "always"):
                with pipeddp.HybridParallel(make(), stages=SHAPE[1], mode="stage", seed=SEED, mesh=mesh,
                                            tp_plan=plan, chunks=CHUNKS, balance=BALANCE[kind],
                                            checkpoint=checkpoint) as engine:
                    out[(kind, checkpoint)] = train(engine, kind)
        torch.manual_seed(dist.get_rank())  # seeded apart: every rank refuses the build alike
        try:
            pipeddp.HybridParallel(mlp(), stages=SHAPE[1], mode="stage", seed=SEED, mesh=mesh, tp_plan=MODELS["mlp"][1],
                                   chunks=CHUNKS, balance=BALANCE["mlp"])
        except ValueError as exc:
            out["seeded apart"] = str(exc)
    finally:
        step_module.draw_base_seed = draw_base_seed  # type: ignore[attr-defined]
    return out
