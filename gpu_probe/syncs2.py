import os, sys, traceback, warnings
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from torch import nn
import pipeddp

torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 10))
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
shown = []
def show(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" in str(message):
        shown.append("".join(traceback.format_stack()[-9:-1]))
warnings.showwarning = show
for chunks in (4, 8):
    with pipeddp.Pipeline(model, ["cuda:0", "cuda:0"], chunks=chunks, balance="uniform") as pipe:
        for _ in range(3):
            pipe.train_step(x, y, nn.functional.cross_entropy)
        torch.cuda.synchronize()
        for step in range(3):
            shown.clear()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            loss = pipe.train_step(x, y, nn.functional.cross_entropy)
            torch.cuda.set_sync_debug_mode(0)
            print(f"chunks={chunks} step {step}: {len(shown)} syncs", flush=True)
            for s in shown[:3]:
                print(s)
        shown.clear(); torch.cuda.set_sync_debug_mode("warn"); loss.item(); torch.cuda.set_sync_debug_mode(0)
        print("loss.item():", len(shown), "sync(s) (the detector works)")
