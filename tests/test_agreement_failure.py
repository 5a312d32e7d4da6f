"""A rank killed in the agreement that opens a step (``rows.gather_rows``, the call and batch check): every other
rank stops within seconds, not the timeout, and names the rank that died: the first rank, which gathers the rows,
finds its row missing and tells the others (``benchmarks/scale_failure.py``'s job, here at N = 4; the script runs
it at 16)."""

from pathlib import Path

import pytest

from benchmarks import scale_failure

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(150)
def test_a_rank_killed_in_a_steps_first_agreement_is_named_by_every_other_rank():
    timeout, victim = 30.0, 3
    # under the suite's emulation of NCCL's rules for the pipeline's messages (the cut is posted past it)
    rules = {"PIPEDDP_NCCL_RULES_FROM": str(HERE), "PIPEDDP_P2P_RULES": "nccl"}
    result = scale_failure.run_case("batch", 4, victim, timeout, 30.0, 0, env=rules)
    assert result["died"] is not None, result["victim_stderr"]
    for r in result["ranks"]:
        said = f"rank {r['rank']}: {r['type']}: {r['error'][:600]} {r['notes']}\n{r['stderr_tail']}"
        assert not r["hung"] and r["exit"] != 0, said
        assert r["exited_after_s"] < timeout / 2, said  # told, not the timeout waited out
        if r["rank"] == 0:  # the first rank gathers the rows: it found rank 3's missing, and told the others
            assert r["type"] == "CollectiveError" and "no row came from rank 3: that process died" in r["error"], said
        else:
            assert r["type"] == "PeerFailed", said
            assert r["error"].startswith(f"rank {r['rank']} (stage {r['rank'] % 2}) stopped its train_step: rank 0 "
                                         "(stage 0) failed in its train_step with CollectiveError"), said
            assert "no row came from rank 3" in r["error"], said
