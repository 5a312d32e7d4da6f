"""``checkpoints.state``: the whole model's state dict from the processes' shares, and loading one's own entries."""

import copy

import pytest
import torch
from torch import nn

import pipeddp
from conftest import data, make_mlp, reference_training
from pipeddp.checkpoints.state import gather_state_dict, own_entries
from pipeddp.distributed.topology import Topology

LOSS = nn.functional.mse_loss


class RecordingAgreement:
    """Stands in for the all-gather of ``Agreement.gather_to_all``: returns the other ranks' given shares."""

    def __init__(self, others):
        self.others = others
        self.given = []

    def gather_to_all(self, value):
        self.given.append(value)
        return [value if part == "mine" else part for part in self.others]


def test_gather_returns_the_local_share_where_there_is_nothing_to_gather():
    local = make_mlp().state_dict()
    agreement = RecordingAgreement([])
    assert gather_state_dict(local, Topology(0, 1, 0, 1, stages=1, mode="stage"), agreement) is local
    # replica mode: every process holds every stage
    assert gather_state_dict(local, Topology(1, 2, 1, 2, stages=2, mode="replica"), agreement) is local
    assert agreement.given == []


def test_gather_unites_the_shares_of_replica_0_only():
    model = make_mlp()
    for p in model.parameters():
        p.requires_grad_(True)
    plain = model.state_dict(keep_vars=True)
    keys = list(plain)
    first, second = keys[:4], keys[4:]
    share0 = {k: plain[k] for k in first}
    share1 = {k: plain[k].detach().clone() for k in second}
    stale = {k: torch.zeros_like(plain[k]) for k in keys}  # replica 1's copies must not win
    # 2 replicas x 2 stages, pipeline layout: ranks 0, 1 are replica 0
    agreement = RecordingAgreement(["mine", share1, None, None])
    full = gather_state_dict(share0, Topology(0, 4, 0, 4, stages=2, mode="stage"), agreement)
    (sent,) = agreement.given
    assert list(sent) == first
    assert all(not v.requires_grad and v.device.type == "cpu" and torch.equal(v, plain[k]) for k, v in sent.items())
    assert list(full) == keys and all(torch.equal(full[k], plain[k]) for k in keys)
    # a rank of replica 1 contributes nothing, and gets replica 0's model
    agreement = RecordingAgreement([share0, share1, "mine", None])
    full = gather_state_dict(stale, Topology(2, 4, 2, 4, stages=2, mode="stage"), agreement)
    assert agreement.given == [None]
    assert all(torch.equal(full[k], plain[k]) for k in keys)


def test_own_entries_keeps_this_process_share():
    full = {"0.weight": 1, "0.bias": 2, "2.weight": 3, "2.bias": 4}
    assert own_entries(full, ["2.weight", "2.bias"], strict=True, rank=1) == {"2.weight": 3, "2.bias": 4}
    assert own_entries({"2.weight": 3}, ["2.weight", "2.bias"], strict=False, rank=1) == {"2.weight": 3}


def test_own_entries_strict_names_the_missing_keys_and_the_rank():
    with pytest.raises(KeyError, match=r"rank 3: the state dict lacks \['2.bias', '4.weight'\]") as info:
        own_entries({"2.weight": 0}, ["2.weight", "4.weight", "2.bias"], strict=True, rank=3)
    assert "..." not in str(info.value)
    own = [f"{i}.weight" for i in range(7)]
    with pytest.raises(KeyError, match=r"rank 0: the state dict lacks \['0.weight', '1.weight', '2.weight', "
                                       r"'3.weight', '4.weight'\] \.\.\."):
        own_entries({}, own, strict=True, rank=0)


# -- a real 1 x 2 stage-mode job --------------------------------------------------------------------------------


def stage_mode_state_job(step_batch, other_state):
    engine = pipeddp.HybridParallel(make_mlp(), stages=2, mode="stage", chunks=3, balance=[5, 6],
                                    devices=["cpu"])
    try:
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        x, y = step_batch
        opt.zero_grad()
        engine.train_step(x if engine.is_first else None, y if engine.is_last else None, LOSS)
        opt.step()
        trained = engine.state_dict()  # a collective: every rank gets the whole model
        local = engine.local_state_dict()
        # a strict load of stage 0's entries only: rank 1 names what it lacks, rank 0 takes its share
        error = ""
        try:
            engine.load_state_dict({k: v for k, v in other_state.items() if int(k.split(".")[0]) < 5})
        except RuntimeError as exc:
            error = str(exc)
        # the whole plain state dict: each process takes its own entries
        engine.load_state_dict(other_state)
        reloaded = engine.state_dict()
        return {"trained": trained, "local": local, "error": error, "reloaded": reloaded}
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_consolidated_state_of_a_stage_mode_job_equals_the_plain_model():
    model = make_mlp()
    batch = data(10, seed=50)
    other = make_mlp(seed=3).state_dict()
    results = pipeddp.spawn(stage_mode_state_job, 2, args=(batch, other), timeout=90)

    _, params = reference_training(model, [batch], LOSS)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), params):
            p.copy_(q)
    expected = ref.state_dict()
    keys = list(expected)
    for res in results:
        assert list(res["trained"]) == keys
        for k in keys:
            assert (res["trained"][k] - expected[k]).abs().max().item() < 1e-12, k
        assert list(res["reloaded"]) == keys
        assert all(torch.equal(res["reloaded"][k], other[k]) for k in keys)
    # each process held its own layers only, under the plain keys
    assert list(results[0]["local"]) == [k for k in keys if int(k.split(".")[0]) < 5]
    assert list(results[1]["local"]) == [k for k in keys if int(k.split(".")[0]) >= 5]
    assert results[0]["error"] == ""
    assert "(rank 1; nothing was loaded; strict=False loads what matches):\n\tMissing key(s) in state_dict: " \
           '"6.weight", "6.bias", "8.weight", "8.bias", "10.weight", "10.bias". ' in results[1]["error"]
