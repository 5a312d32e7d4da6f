"""The job of ``test_tp_checkpoints.py``: a transformers Llama in a tensor-parallel engine (``mesh`` with ``tp``,
``tp_plan="auto"``: ``DTensor`` parameters), its checkpoints saved and loaded in other layouts by 4 processes."""

from __future__ import annotations

import os
from typing import Any, Dict

import nccl_rules
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import pipeddp

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

VOCAB, T, LR = 40, 6, 0.5


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0,
                       eos_token_id=0, pad_token_id=0, tie_word_embeddings=False, attention_bias=True,
                       mlp_bias=True)  # biases: a row-parallel layer's is replicated over tp


def save_downloaded(path: str) -> None:
    """The 'pretrained' Llama: weights of its own, float64, written by transformers in several shards."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(7)
    LlamaForCausalLM(llama_config()).double().save_pretrained(path, max_shard_size="40KB")


def lm_batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n, T), generator=g), torch.randint(0, VOCAB, (n, T), generator=g)


def lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = getattr(out, "logits", out)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def sgd(engine: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(engine.parameters(), lr=LR, momentum=0.9)


def llama_engine(mesh: Any, tp: bool) -> pipeddp.HybridParallel:
    """The Llama built on the meta device, in 2 stages; ``tp``: ``mesh`` has a tp dimension and the model's own plan
    shards it."""
    from transformers import LlamaForCausalLM

    from pipeddp.tools.models import flatten_sequential

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config()).double()
    flat = flatten_sequential(model, lm_batch(1, 0)[0])
    kwargs = {"tp_plan": "auto"} if tp else {}
    return pipeddp.HybridParallel(flat, stages=2, mode="stage", chunks=2, mesh=mesh, **kwargs)


def gathered_by(fn: Any) -> list:
    """The shapes of the DTensors gathered whole while ``fn()`` runs (a whole tensor in memory each)."""
    from torch.distributed.tensor import DTensor

    shapes: list = []
    full = DTensor.full_tensor

    def counting(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        shapes.append(tuple(self.shape))
        return full(self, *args, **kwargs)

    DTensor.full_tensor = counting  # type: ignore[method-assign]
    try:
        fn()
    finally:
        DTensor.full_tensor = full  # type: ignore[method-assign]
    return shapes


def logits(engine: pipeddp.HybridParallel, probe: torch.Tensor) -> Any:
    out = engine.eval_step(probe if engine.is_first else None)
    return getattr(out, "logits", out).detach().clone() if engine.is_last else None


def llama_round_trips_job(tmp: str) -> Dict[str, Any]:
    """pp2 x tp2 loads the downloaded directory (its blocks alone), trains a step, saves the three formats;
    pp2 x tp1 (as 2 replicas) loads the one file and the tp2 sharded checkpoint and saves both again, which a fresh
    pp2 x tp2 loads in turn (the directory between them); a wrong file is refused there. Returns the logits on a
    probe after each load, and what was read."""
    from pipeddp.checkpoints import pretrained

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    read: list = []
    original = pretrained.read_tensors

    def recording(where, keys, blocks=None):
        keys = list(keys)
        read.extend((k, (blocks or {}).get(k)) for k in keys)
        return original(where, keys, blocks) if blocks else original(where, keys)

    pretrained.read_tensors = recording
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    x, y = lm_batch(4, 1)
    probe = lm_batch(3, 2)[0]
    out: Dict[str, Any] = {"rank": dist.get_rank(), "logits": {}}
    with llama_engine(mesh, tp=True) as engine:
        engine.load(os.path.join(tmp, "downloaded"))
        out["read"] = read
        out["shapes"] = {k: tuple(v.to_local().shape) for k, v in engine.local_state_dict().items()
                         if hasattr(v, "to_local")}
        opt = sgd(engine)
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, lm_loss)
        opt.step()
        engine.save(os.path.join(tmp, "tp2.pt"), optimizer=opt)
        engine.save(os.path.join(tmp, "tp2-sharded"), optimizer=opt, sharded=True)
        out["gathered"] = gathered_by(lambda: engine.save_pretrained(os.path.join(tmp, "export")))
    with llama_engine(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp")), tp=False) as engine:
        opt = sgd(engine)
        engine.load(os.path.join(tmp, "tp2.pt"), optimizer=opt)
        out["logits"]["tp1 from the file"] = logits(engine, probe)
        engine.load(os.path.join(tmp, "downloaded"))  # other weights between the two
        opt = sgd(engine)
        engine.load(os.path.join(tmp, "tp2-sharded"), optimizer=opt)
        out["logits"]["tp1 from the sharded"] = logits(engine, probe)
        engine.save(os.path.join(tmp, "tp1.pt"), optimizer=opt)
        engine.save(os.path.join(tmp, "tp1-sharded"), optimizer=opt, sharded=True)
    with llama_engine(mesh, tp=True) as engine:  # fresh weights (the meta build's), then each load in turn
        opt = sgd(engine)
        engine.load(os.path.join(tmp, "tp1.pt"), optimizer=opt)
        out["logits"]["tp2 from the tp1 file"] = logits(engine, probe)
        engine.load(os.path.join(tmp, "downloaded"))
        out["logits"]["tp2 from the directory"] = logits(engine, probe)
        opt = sgd(engine)
        engine.load(os.path.join(tmp, "tp1-sharded"), optimizer=opt)
        out["logits"]["tp2 from the tp1 sharded"] = logits(engine, probe)
        try:
            engine.load(os.path.join(tmp, "wrong.pt"), optimizer=opt)
            out["refused"] = ""
        except (ValueError, RuntimeError) as exc:
            out["refused"] = str(exc)
        out["logits"]["tp2 after the refusal"] = logits(engine, probe)
        engine.save(os.path.join(tmp, "back.pt"), optimizer=opt)
    dist.destroy_process_group()
    return out
