"""Zero-bubble schedules with tensor parallelism: pp2 x tp2, a meta-built MLP under a dict plan and a tiny Llama
under ``tp_plan="auto"``, in ``"zb"`` (round robin) and in the V (two stages a device, ``placement="v"``), each equal
to the plain model materialized from the same seed on one device (initial weights, loss, every gradient clipped by
the whole model's norm, the weights after a step, the evaluated outputs); the MLP with ``compile=`` too, its split
layers' collectives inside the compiled graphs; compile= with a split embedding, or with dropout, refused."""

import pytest
from test_tensor_parallel import check_layout
from tp_zb_jobs import CASES, tp_zb_job

import pipeddp


@pytest.mark.timeout(240)
def test_pp2_tp2_zero_bubble_schedules_and_a_compiled_mlp_equal_the_plain_model():
    results = pipeddp.spawn(tp_zb_job, 4, timeout=200)
    kinds = [name for name, _ in CASES] + ["mlp-compiled"]
    check_layout(results, (1, 2, 2), kinds)
    for res in results:
        # forward: the row-wise layers' all-reduces; backward: the column-wise layers' input gradients'
        assert res["collectives"].get("forward", 0) > 0 and res["collectives"].get("backward", 0) > 0
        assert "compile= with an Embedding split over tp" in res["refused"]["llama"]
        assert "embed" in res["refused"]["llama"]
        assert "block1.drop (p=0.1)" in res["refused"]["mlp-dropout"]
