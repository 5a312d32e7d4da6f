import pytest
import torch

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


def test_auto_devices_refuse_a_node_whose_gpus_are_too_few(monkeypatch):
    """devices='auto' on a node with GPUs, too few for its processes, names what it found and the mask. (The GPU
    count is the only thing faked: this host has none, and the decision reads nothing else.)"""
    from pipeddp.distributed.groups import local_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    four_stage_processes = Topology(1, 4, 1, 4, 2, "stage", "pipeline")
    with pytest.raises(ValueError, match=r"rank 1: devices='auto' found 3 CUDA device\(s\) on this node, but 4 "
                                         r"processes x 1 device\(s\) each need 4 \(CUDA_VISIBLE_DEVICES='0,1,2'\)"):
        local_devices(four_stage_processes, "auto")
    two_replicas = Topology(0, 2, 0, 2, 2, "replica", "pipeline")
    with pytest.raises(ValueError, match="need 4"):
        local_devices(two_replicas, "auto")
    # enough GPUs: one each, by local rank; one process alone shares the GPUs it has
    assert local_devices(Topology(2, 3, 2, 3, 3, "stage", "pipeline"), "auto") == [torch.device("cuda", 2)]
    with pytest.warns(RuntimeWarning, match="stages share devices"):
        assert len(local_devices(Topology(0, 1, 0, 1, 4, "replica", "pipeline"), "auto")) == 4
    # no GPU at all: the CPU, without a word
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert local_devices(four_stage_processes, "auto") == [torch.device("cpu")]
