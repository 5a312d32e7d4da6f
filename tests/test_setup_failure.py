"""A rank killed while the process groups are made (its third ``new_group``): every other rank stops at the roll
call after the groups (``distributed.rollcall``) within the engine's timeout, naming the rank that died
(``benchmarks/scale_failure.py``'s job, here at N = 4; the script runs it at 16, and with ``PIPEDDP_LAZY_GROUPS=0``
too)."""

from pathlib import Path

import pytest

from benchmarks import scale_failure

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(120)
def test_a_rank_killed_while_the_groups_are_made_is_named_by_every_other_rank():
    timeout, victim = 4.0, 3
    env = {"PIPEDDP_NCCL_RULES_FROM": str(HERE)}
    result = scale_failure.run_case("groups", 4, victim, timeout, 30.0, 3, env=env)
    assert result["died"] is not None and "new_group call 3" in result["died"]["what"], result["victim_stderr"]
    for r in result["ranks"]:
        said = f"rank {r['rank']}: {r['type']}: {r['error'][:600]} {r['notes']}\n{r['stderr_tail']}"
        assert not r["hung"] and r["exit"] != 0, said
        assert r["exited_after_s"] < timeout + 10, said
        assert r["type"] == "SetupFailed", said
        assert r["error"].startswith(f"rank {r['rank']}: rank 3 never finished making pipeddp's process groups: "
                                     "that process died"), said
