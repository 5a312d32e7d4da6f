"""skip_nonfinite with gradient accumulation over calls: a step with a non-finite call is skipped whole.

Two ``train_step`` calls per ``optimizer.step()``; a NaN in one replica's batch at the first call of one step
and at the second call of another. Both steps must leave the weights (and the optimizer's momentum) untouched,
and every other step must equal the plain model on one device, which never sees the skipped steps.
"""

import copy
import warnings
from typing import Any, Dict, List, Optional

import pytest
import torch

import pipeddp
from conftest import make_mlp, max_diff
from hybrid_jobs import LOSS, global_batches, init, local_slice

BAD_CALL: List[Optional[int]] = [None, 0, None, 1, None]  # per step: the call whose batch holds a NaN
CALLS = 2


def batches(replicas: int) -> List[List[Any]]:
    steps = global_batches(replicas, len(BAD_CALL) * CALLS)
    return [steps[i:i + CALLS] for i in range(0, len(steps), CALLS)]


def accumulation_job() -> Dict[str, Any]:
    """The same 5 steps on a 2-process job in each mode: 2 replicas of 2 threads, and 1 replica of 2 processes."""
    init()
    out: Dict[str, Any] = {}
    for mode in ("replica", "stage"):
        engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode=mode, chunks=2, skip_nonfinite=True)
        replica, replicas = engine.topology.replica, engine.topology.replicas
        opt = torch.optim.SGD(engine.parameters(), lr=0.1, momentum=0.9)
        steps = []
        for bad, step_batches in zip(BAD_CALL, batches(replicas)):
            opt.zero_grad()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for call, batch in enumerate(step_batches):
                    x, y = local_slice(batch, replica, 10)
                    if call == bad and replica == replicas - 1:
                        x = x.clone()
                        x[0, 0] = float("nan")
                    engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
            opt.step()
            steps.append({"state": copy.deepcopy(engine.state_dict()), "warnings": [str(w.message) for w in caught]})
        engine.check_replicas()
        engine.close()
        out[mode] = {"steps": steps, "skipped": engine.skipped_steps, "replicas": replicas}
    return out


def plain_states(replicas: int) -> List[Dict[str, torch.Tensor]]:
    """The plain model's state after each step: the same optimizer, the skipped steps left out."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states = []
    for bad, step_batches in zip(BAD_CALL, batches(replicas)):
        if bad is None:
            opt.zero_grad()
            for x, y in step_batches:
                LOSS(model(x), y).backward()
            opt.step()
        states.append(copy.deepcopy(model.state_dict()))
    return states


@pytest.mark.timeout(150)
def test_a_step_with_a_nonfinite_accumulation_call_is_skipped_whole():
    results = pipeddp.spawn(accumulation_job, 2, timeout=120)
    for mode in ("replica", "stage"):
        replicas = results[0][mode]["replicas"]
        expected = plain_states(replicas)
        for rank, res in enumerate(r[mode] for r in results):
            assert res["skipped"] == 2, (mode, rank)
            for i, (step, want) in enumerate(zip(res["steps"], expected)):
                assert list(step["state"]) == list(want)
                assert max_diff(want.values(), step["state"].values()) < 1e-12, (mode, rank, i)
            messages = [s["warnings"] for s in res["steps"]]
            assert messages[0] == messages[2] == messages[4] == [], (mode, rank)
            assert len(messages[1]) == 2 and "non-finite loss" in messages[1][0], messages[1]
            assert "an earlier call since the last optimizer.step() was skipped" in messages[1][1]
            assert "(1 skipped so far)" in messages[1][1]
            assert len(messages[3]) == 1 and "non-finite loss" in messages[3][0], messages[3]
            assert "(2 skipped so far)" in messages[3][0]
