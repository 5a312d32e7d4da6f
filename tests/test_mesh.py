"""``HybridParallel(..., mesh=)``: an engine placed on the user's DeviceMesh trains the plain model, with its ranks
where the mesh puts them, and runs beside another parallelism over the rest of the world without waiting for it."""

import pytest

import pipeddp
from conftest import make_mlp, max_diff
from hybrid_jobs import global_batches
from mesh_jobs import STEPS, beside_another_dimension_job, two_by_two_job
from test_hybrid import reference_state


@pytest.mark.timeout(200)
@pytest.mark.parametrize("order", ["dp,pp", "pp,dp"])
def test_an_engine_on_a_mesh_trains_the_plain_model_with_the_meshs_ranks(order):
    results = pipeddp.spawn(two_by_two_job, 4, args=(order,), timeout=150)
    expected = reference_state(global_batches(2, STEPS))
    for res in results:
        assert list(res["state"]) == list(expected)
        assert max_diff(expected.values(), res["state"].values()) < 1e-12
    # the mesh, not the default layout, says who holds what: mesh[r][s] (dp first) or mesh[s][r] (pp first)
    places = {res["rank"]: res["place"] for res in results}
    if order == "dp,pp":
        assert places == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    else:
        assert places == {0: (0, 0), 1: (1, 0), 2: (0, 1), 3: (1, 1)}
    told = results[0]["told"]
    assert "use mode='stage'" in told[0]
    assert "stages=4, but the mesh's 'pp' dimension has 2 ranks" in told[1]
    assert "mesh must be a torch.distributed.device_mesh.DeviceMesh" in told[2]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("twins", [False, True])
def test_engines_on_two_slices_of_a_mesh_train_apart_beside_a_collective_of_the_third_dimension(twins):
    results = pipeddp.spawn(beside_another_dimension_job, 4, args=(twins,), timeout=150)
    for res in results:
        tp = res["tp"]
        batches = [(x + tp, y - tp) for x, y in global_batches(1, STEPS + tp)]
        expected = reference_state(batches, model=make_mlp(seed=tp))
        assert max_diff(expected.values(), res["state"].values()) < 1e-12, res["rank"]
        partner = res["rank"] ^ 1  # the tp group pairs ranks 0-1 and 2-3
        assert res["tp_sums"] == [float(res["rank"] + partner)] * STEPS
        assert res["twin"] == twins  # the slice's own gloo group, of its ranks alone
