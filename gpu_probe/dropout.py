"""Dropout on CUDA stages: the same masks for every recompute policy and schedule, bit for bit (the README's promise)."""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from torch import nn
import pipeddp


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.3), nn.ReLU(), nn.Linear(64, 64), nn.Dropout(0.3),
                         nn.Tanh(), nn.Linear(64, 8))


def grads(devices, schedule, checkpoint):
    torch.manual_seed(123)
    x, y = torch.randn(16, 32), torch.randn(16, 8)
    with pipeddp.Pipeline(model(), devices, chunks=4, schedule=schedule, checkpoint=checkpoint,
                          balance=[3, 4]) as pipe:
        torch.manual_seed(7)
        pipe.train_step(x, y, nn.functional.mse_loss)
        pipe.train_step(x, y, nn.functional.mse_loss)
        return [p.grad.detach().cpu().clone() for p in pipe.parameters()]


for devices in (["cuda:0", "cuda:0"], ["cuda:0", "cpu"]):
    runs = {(s, c): grads(devices, s, c) for s in ("gpipe", "1f1b") for c in ("never", "always")}
    again = grads(devices, "1f1b", "always")
    base = runs[("gpipe", "never")]
    for key, g in list(runs.items()) + [(("1f1b", "always", "again"), again)]:
        worst = max((a - b).abs().max().item() for a, b in zip(base, g))
        print(devices, key, "max diff vs gpipe/never:", worst, "BIT-EQUAL" if worst == 0 else "DIFFERENT", flush=True)
