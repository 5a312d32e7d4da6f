"""A rank that fails inside ``engine.evaluate`` stops every rank at once, naming it (``distributed.notice``).

In an evaluation the ranks go through the batches each at its own pace: when one fails, the others may be in a
forward's messages, in the next batch's agreement or in the closing gather of the metrics, and each must raise
``PeerFailed`` naming the rank that failed and its error within seconds, not the transport's words.
"""

import time

import pytest
import torch
from torch import nn

import pipeddp
from conftest import data, make_mlp


class NanGuard(nn.Module):
    """The identity, which refuses an input holding a NaN (a layer that checks what it is given)."""

    def forward(self, x):
        if torch.isnan(x).any():
            raise ValueError("NanGuard: the input holds a NaN")
        return x


def failing_evaluate_job():
    """2 x 2 stage mode (ranks 0, 1: replica 0; 2, 3: replica 1); the evaluation's second batch of replica 1 holds a
    NaN, which rank 3's stage 1 refuses in its forward. Every rank reports what it raised and when."""
    model = make_mlp(depth=4)
    model.insert(4, NanGuard())  # in stage 1 with balance [4, 4]
    engine = pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=2, balance=[4, 4], timeout=60)
    rank = engine.topology.rank
    batches = []
    for k in range(4):
        x, y = data(8, seed=k)
        if rank == 2 and k == 1:
            x[3, 0] = float("nan")
        batches.append((x if engine.is_first else None, y if engine.is_last else None))
    out = {"error": "", "type": "", "at": 0.0}
    try:
        engine.evaluate(batches, lambda o, y: {"mse": nn.functional.mse_loss(o, y)})
    except Exception as exc:  # noqa: BLE001 - what each rank raised
        out.update(at=time.time(), type=type(exc).__name__, error=str(exc))
    engine.close()
    return out


@pytest.mark.timeout(120)
def test_a_rank_failing_inside_an_evaluation_stops_every_rank_at_once_naming_it():
    results = pipeddp.spawn(failing_evaluate_job, 4, timeout=110)
    own = results[3]
    assert own["type"] == "ValueError" and "NanGuard: the input holds a NaN" in own["error"], own
    for rank, res in enumerate(results[:3]):
        assert res["type"] == "PeerFailed", (rank, res)
        assert res["error"].startswith(f"rank {rank} (stage {rank % 2}) stopped its evaluate: rank 3 (stage 1) "
                                       "failed in its forward with ValueError: NanGuard"), (rank, res)
        assert "gloo" not in res["error"], res["error"]
        assert res["at"] - own["at"] < 10, (rank, res["at"] - own["at"])
