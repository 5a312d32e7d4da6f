"""Stage mode over real nccl, two processes sharing cuda:0: interleaved and 1f1b, a smaller last batch, against the
plain model on the CPU (float64)."""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
import pipeddp
from cuda_checks import mlp, batches, reference, assert_close, LOSS


def job(schedule, virtual):
    engine = pipeddp.HybridParallel(mlp(), stages=2, mode="stage", chunks=3, balance="uniform",
                                    schedule=schedule, virtual_stages=virtual, devices=["cuda:0"])
    assert engine.backend == "nccl", engine.backend
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    for x, y in batches() + batches(1, n=7):
        opt.zero_grad()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        opt.step()
    state = engine.state_dict()
    engine.close()
    return {k: v.cpu() for k, v in state.items()}


if __name__ == "__main__":
    expect = reference(mlp(), batches() + batches(1, n=7))
    for schedule, virtual in (("interleaved", 2), ("1f1b", 1), ("zb", 1), ("gpipe", 1)):
        t0 = time.perf_counter()
        for state in pipeddp.spawn(job, 2, args=(schedule, virtual), timeout=120):
            assert_close(expect, state, f"nccl stage mode {schedule}")
        print("ok nccl-shared-gpu", schedule, f"{time.perf_counter() - t0:.1f}s", flush=True)
