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


def failing_evaluate_job(how):
    """2 x 2 stage mode (ranks 0, 1: replica 0; 2, 3: replica 1); one rank fails in the evaluation: ``forward``: the
    second batch of replica 1 holds a NaN, which rank 3's stage 1 refuses in its forward; ``metric``: rank 1's
    ``metric_fn`` raises on the first batch, while replica 1 goes through all its batches and waits in the closing
    gather of the metrics, and rank 0 in its next forward. Every rank reports what it raised and when."""
    model = make_mlp(depth=4)
    model.insert(4, NanGuard())  # in stage 1 with balance [4, 4]
    engine = pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=2, balance=[4, 4], timeout=60)
    rank = engine.topology.rank
    batches = []
    for k in range(4):
        x, y = data(8, seed=k)
        if how == "forward" and rank == 2 and k == 1:
            x[3, 0] = float("nan")
        batches.append((x if engine.is_first else None, y if engine.is_last else None))

    def metric_fn(out, y):
        if how == "metric" and rank == 1:
            raise KeyError("metric_fn: no such class")
        return {"mse": nn.functional.mse_loss(out, y)}

    out = {"error": "", "type": "", "at": 0.0}
    try:
        engine.evaluate(batches, metric_fn)
    except Exception as exc:  # noqa: BLE001 - what each rank raised
        out.update(at=time.time(), type=type(exc).__name__, error=str(exc))
    engine.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how,lazy", [("forward", False), ("metric", False), ("metric", True)])
def test_a_rank_failing_inside_an_evaluation_stops_every_rank_at_once_naming_it(how, lazy):
    """``metric``: the ranks that fail by a peer's cut cut their own connections in turn, though the peer that
    cut first already closed one of them, so that rank 3, blocked in the metrics' gather on rank 0, learns too.
    With ``lazy`` (``PIPEDDP_LAZY_GROUPS=1``) the gather's pairs may never have been connected: before the lazy
    groups' watcher (and the cut's receive from any rank), rank 2 was still in it 110 s after rank 1 failed."""
    results = pipeddp.spawn(failing_evaluate_job, 4, args=(how,), timeout=110,
                            env={"PIPEDDP_LAZY_GROUPS": "1"} if lazy else None)
    failed, call, said = (3, "forward", "ValueError: NanGuard: the input holds a NaN") if how == "forward" else \
        (1, "evaluate", "KeyError: 'metric_fn: no such class'")
    own = results[failed]
    assert f"{own['type']}: {own['error']}" == said, own
    for rank, res in enumerate(results):
        if rank == failed:
            continue
        assert res["type"] == "PeerFailed", (rank, res)
        assert res["error"].startswith(f"rank {rank} (stage {rank % 2}) stopped its evaluate: rank {failed} "
                                       f"(stage 1) failed in its {call} with {said}"), (rank, res)
        assert "gloo" not in res["error"], res["error"]
        assert res["at"] - own["at"] < 10, (rank, res["at"] - own["at"])
