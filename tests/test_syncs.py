"""Device-to-host copies in a training step: each one would stall a GPU's stream (``.item()``, ``.tolist()``,
``.cpu()``, ``bool(tensor)``), so the step's agreements make at most two, the batch check and the table of losses
and votes at the end, whatever the number of ranks, and the loss stays a tensor until then; and a step whose batch
has the shapes of the step before sends no headers between processes, so the transport reads none. Counted here
on the CPU by the calls that would sync; on a GPU ``tests/cuda_checks.py syncs`` runs a step under
``torch.cuda.set_sync_debug_mode("error")``."""

import os
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

import pipeddp
from conftest import data, make_mlp

SYNCS = {"item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"}
TRANSPORT = "p2p.py"  # an activation's header is read where it arrives (its shapes size the receives)


class CountSyncs(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNCS:
            caller = next(f for f in reversed(traceback.extract_stack()[:-1])
                          if "torch" + os.sep not in f.filename and not f.filename.endswith("test_syncs.py"))
            self.calls.append((func.__name__, os.path.basename(caller.filename), caller.lineno))
        return func(*args, **(kwargs or {}))


def step_job(skip_nonfinite: bool):
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=2, balance="uniform",
                                    skip_nonfinite=skip_nonfinite)
    x, y = data(10)
    args = (x if engine.is_first else None, y if engine.is_last else None, torch.nn.functional.mse_loss)
    engine.train_step(*args)
    with CountSyncs() as counted:
        loss = engine.train_step(*args)
    engine.close()
    return {"calls": counted.calls, "loss": loss}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_a_step_s_agreements_copy_to_the_host_twice(skip_nonfinite):
    results = pipeddp.spawn(step_job, 4, args=(skip_nonfinite,), timeout=100)  # 2 replicas x 2 stages
    for res in results:
        agreements = [c for c in res["calls"] if c[1] != TRANSPORT]
        assert len(agreements) == 2, agreements
        assert [c for c in res["calls"] if c[1] == TRANSPORT] == []  # the shapes repeat: no header to read
        assert all(name == "tolist" for name, _, _ in agreements), agreements
        assert isinstance(res["loss"], torch.Tensor) and torch.isfinite(res["loss"])
