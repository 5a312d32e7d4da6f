"""Device-to-host syncs in one train_step of a 2-stage Pipeline on cuda:0 (torch.cuda.set_sync_debug_mode)."""
import collections, os, sys, warnings
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from torch import nn
import pipeddp

torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 10))
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
for chunks in (4, 8):
    with pipeddp.Pipeline(model, ["cuda:0", "cuda:0"], chunks=chunks, balance="uniform") as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for _ in range(3):
            pipe.train_step(x, y, nn.functional.cross_entropy); opt.step(); opt.zero_grad()
        torch.cuda.synchronize()
        where = collections.Counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            loss = pipe.train_step(x, y, nn.functional.cross_entropy)
            torch.cuda.set_sync_debug_mode(0)
        for w in caught:
            if "synchroniz" in str(w.message):
                where[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1
        print(f"chunks={chunks}: {sum(where.values())} syncs in one train_step (loss {type(loss).__name__})")
        for k, v in where.most_common():
            print(f"  {v:3d}  {k}")
