import pytest

from pipeddp.distributed.topology import Topology


def grid(world, stages, mode, layout="pipeline"):
    return [Topology(r, world, r % 4, 4, stages, mode, layout) for r in range(world)]


def test_replica_mode_is_the_8_gpu_fusion_scheme():
    topos = grid(4, 2, "replica")
    assert [t.replica for t in topos] == [0, 1, 2, 3]
    assert topos[0].replicas == 4
    assert topos[0].stage_ranks(0) == topos[0].stage_ranks(1) == [0, 1, 2, 3]
    with pytest.raises(AttributeError):
        topos[0].stage  # noqa: B018


@pytest.mark.parametrize("layout,stage0,replica0", [("pipeline", [0, 2], [0, 1]), ("data", [0, 1], [0, 2])])
def test_stage_mode_layouts(layout, stage0, replica0):
    topos = grid(4, 2, "stage", layout)
    t = topos[0]
    assert t.replicas == 2
    assert t.stage_ranks(0) == stage0
    assert t.pipeline_ranks(0) == replica0
    for r, topo in enumerate(topos):
        assert t.rank_of(topo.replica, topo.stage) == r
        assert (topo.replica, topo.stage) == (t.replica_of(r), t.stage_of(r))


def test_bad_grids():
    with pytest.raises(ValueError, match="rank 2: .*not divisible by stages=2"):
        Topology(2, 3, 2, 3, 2, "stage")
    with pytest.raises(ValueError, match="mode"):
        Topology(0, 1, 0, 1, 1, "hybrid")
    with pytest.raises(ValueError, match="layout"):
        Topology(0, 1, 0, 1, 1, "stage", "ring")


def test_stage_mode_names_the_process_counts_that_would_work():
    with pytest.raises(ValueError, match=r"start 2 or 4 processes"):
        Topology(0, 3, 0, 3, 2, "stage")
    with pytest.raises(ValueError, match=r"start 2 processes, or use mode='replica'"):
        Topology(0, 1, 0, 1, 2, "stage")
