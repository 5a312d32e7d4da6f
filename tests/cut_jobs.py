"""A model whose activations change structure between micro-batches and steps, and the job that trains it.

The first layer emits ``(h, mask)``: the mask of the padded positions where a micro-batch has padding, None where it
has none (what transformers' attention does with its mask), so what crosses a cut depends on the input's values;
the sequence length changes between steps (dynamic padding).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

import pipeddp
from hybrid_jobs import init

import nccl_rules

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

WIDTH = 6
Pair = Tuple[torch.Tensor, Optional[torch.Tensor]]


class Open(nn.Module):
    """``x`` (n, T, WIDTH + 1), its last channel 0 at padded positions -> (h, mask or None)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> Pair:
        pad = x[..., -1] == 0
        h = torch.tanh(self.lin(x[..., :-1]))
        return (h, pad) if bool(pad.any()) else (h, None)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair: Pair) -> Pair:
        h, pad = pair
        h = torch.tanh(self.lin(h)) + h
        return (h if pad is None else h.masked_fill(pad[..., None], 0.0)), pad


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair: Pair) -> torch.Tensor:
        h, pad = pair
        return self.lin(h.sum(1) if pad is None else h.masked_fill(pad[..., None], 0.0).sum(1))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Open(), Block(), Block(), Block(), Head()).double()


#: per step: the sequence length and which rows are padded (2 replicas x 4 rows, micro-batches of 2 rows): the
#: shapes repeat from step 0 to step 1 while the micro-batches with a mask change; step 2 is shorter
STEPS = [(6, [0, 1, 5]), (6, [2, 3, 4]), (4, [0, 1, 2, 3])]
N = 8


def batches() -> List[Tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step, (t, padded) in enumerate(STEPS):
        g = torch.Generator().manual_seed(300 + step)
        x = torch.randn(N, t, WIDTH + 1, generator=g, dtype=torch.float64)
        x[..., -1] = 1.0
        for row in padded:
            x[row, t - 2:] = 0.0
        out.append((x, torch.randn(N, WIDTH, generator=g, dtype=torch.float64)))
    return out


def reference() -> Dict[str, torch.Tensor]:
    """The plain model trained on the same global batches."""
    plain = model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        opt.step()
    return plain.state_dict()


#: (schedule, virtual stages, placement, balance)
COMBOS = [("1f1b", None, "loop", [2, 3]), ("zb", None, "loop", [2, 3]), ("interleaved", 2, "loop", [1, 1, 1, 2]),
          ("zb", 2, "v", [1, 1, 1, 2])]


def changing_structure_job(combos: List[Any]) -> List[Dict[str, Any]]:
    """Stage mode, 2 replicas x 2 stages: train 3 steps per combination; the consolidated weights, and the headers
    this rank sent at each step."""
    init()
    out = []
    for schedule, virtual, placement, balance in combos:
        engine = pipeddp.HybridParallel(model(), stages=2, mode="stage", chunks=2, schedule=schedule,
                                        virtual_stages=virtual, placement=placement, balance=balance)
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        local = N // engine.topology.replicas
        channels, headers = engine._replica.runner.channels, []
        for x, y in batches():
            part = slice(engine.topology.replica * local, (engine.topology.replica + 1) * local)
            opt.zero_grad()
            before = sum(ch.headers for ch in channels)
            engine.train_step(x[part] if engine.is_first else None, y[part] if engine.is_last else None,
                              nn.functional.mse_loss)
            headers.append(sum(ch.headers for ch in channels) - before)
            opt.step()
        out.append({"combo": (schedule, virtual, placement), "state": engine.state_dict(), "headers": headers,
                    "replica": engine.topology.replica, "first": engine.is_first})
        engine.close()
    return out


# -- a transformers Llama with its default (sdpa) attention: a mask crosses only for a micro-batch with padding ------

#: per step: the sequence length and the padded rows (4 rows, micro-batches of 2): step 1 has step 0's shapes and
#: its mask in the other micro-batch; step 2 is longer
LLAMA_STEPS = [(6, [0]), (6, [3]), (8, [1, 2])]


def llama_batches() -> List[Tuple[Dict[str, torch.Tensor], torch.Tensor]]:
    """Right-padded token batches (a padded row loses its last 2 tokens) and their targets."""
    from hf_jobs import VOCAB

    out = []
    for step, (t, padded) in enumerate(LLAMA_STEPS):
        g = torch.Generator().manual_seed(500 + step)
        ids = torch.randint(1, VOCAB, (4, t), generator=g)
        mask = torch.ones(4, t, dtype=torch.long)
        for row in padded:
            mask[row, t - 2:] = 0
        out.append(({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask},
                    torch.randint(0, VOCAB, (4, t), generator=g)))
    return out


def llama_reference() -> Dict[str, torch.Tensor]:
    """Plain transformers training on the same batches (the loss over the whole batch at once)."""
    from hf_jobs import llama, logits, loss_fn

    model = llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in llama_batches():
        opt.zero_grad()
        loss_fn(logits(model, x), y).backward()
        opt.step()
    return model.state_dict()


def llama_job() -> List[Dict[str, Any]]:
    """Stage mode, 2 stages: the flattened Llama trained 3 steps, then again with the headers on a gloo twin of the
    pipeline's group (as on an nccl job, where the twin's header says whether an activation is the predicted one);
    the consolidated weights of each."""
    from hf_jobs import batch, llama, loss_fn

    from pipeddp.tools.models import flatten_sequential

    init()
    out = []
    for twin in (False, True):
        if twin:
            nccl_rules.as_on_nccl()
        flat = flatten_sequential(llama(), batch("llama", 4, 0, True)[0])
        engine = pipeddp.HybridParallel(flat, stages=2, mode="stage", chunks=2, balance=[2, len(flat) - 2])
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        for x, y in llama_batches():
            opt.zero_grad()
            engine.train_step(x if engine.is_first else None, y if engine.is_last else None, loss_fn)
            opt.step()
        out.append({"twin": twin, "state": engine.state_dict()})
        engine.close()
    return out
