"""``rows.gather_rows``: every rank's row on every rank, as the agreements gather it (over gloo a ping-pong through
the group's first rank, or over a binomial tree beyond ``rows.STAR_UP_TO`` members, in place of an all-gather).
Compared with torch's own all-gather of the same rows, on the whole job and on a group of some of its ranks, under
NCCL's rules for messages (tags stripped) and gloo's, with its receives posted ahead (``Gathering.post``) or not; and
its messages carry tags no pipeline message has, whatever the schedule."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import pipeddp
from pipeddp.distributed import rows
from pipeddp.distributed.rows import gather_rows
from pipeddp.distributed.tags import spare_tag
from pipeddp.distributed.tags import tag as _tag
from pipeddp.runtime.schedule import SCHEDULES, accepts_virtual_stages, crossings, get_schedule


def rows_job(star_up_to: int = rows.STAR_UP_TO):
    rows.STAR_UP_TO = star_up_to  # 1: every group gathers over the tree
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    some = list(range(1, world))
    sub = dist.new_group(some)  # every rank of the world creates it; only its members gather on it
    out = {}
    for name, group, ranks in [("all", None, list(range(world))), ("some", sub, some)]:
        if rank not in ranks:
            continue
        for dtype in (torch.int64, torch.float64):
            mine = (torch.arange(6, dtype=dtype) + 7 * rank) * (-1) ** rank
            got = [torch.zeros_like(mine) for _ in ranks]
            ahead = None
            if dtype == torch.float64:  # its receives posted first, as the loss agreement's are (``step_end``)
                ahead = rows.Gathering(mine, group=group, ranks=ranks, rank=rank, kind=3)
                ahead.post()
            gather_rows(got, mine, group=group, ranks=ranks, rank=rank, kind=3, ahead=ahead)
            expected = [torch.zeros_like(mine) for _ in ranks]
            dist.all_gather(expected, mine, group=group)
            out[(name, str(dtype))] = (torch.stack(got), torch.stack(expected))
    dist.barrier()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rules,world,star_up_to", [("nccl", 3, rows.STAR_UP_TO), ("tags", 3, rows.STAR_UP_TO),
                                                    ("nccl", 6, 1), ("tags", 5, 1)])
def test_every_rank_gets_every_row_in_the_group_s_order(rules, world, star_up_to):
    results = pipeddp.spawn(rows_job, world, args=(star_up_to,), timeout=90, env={"PIPEDDP_P2P_RULES": rules})
    for rank, res in enumerate(results):
        assert {name for name, _ in res} == ({"all", "some"} if rank else {"all"})  # "some": every rank but 0
        for got, expected in res.values():
            assert torch.equal(got, expected)
    assert torch.equal(results[1][("some", "torch.int64")][0], results[2][("some", "torch.int64")][0])


def test_spare_tags_are_no_pipeline_message_s_tag():
    spare = {spare_tag(k) for k in range(32)}
    assert len(spare) == 32
    seen = 0
    for name in SCHEDULES:
        for stages in (2, 3, 4):
            for virtual in ((1, 2) if accepts_virtual_stages(name) else (1,)):
                schedule = get_schedule(name, stages, 4, virtual)
                for link in crossings(schedule).values():
                    for m in link:
                        seen += 1
                        assert not spare & {_tag(m.kind, m.stage, m.mb, slot) for slot in range(32)}, (name, m)
    assert seen > 100
    with pytest.raises(ValueError, match="spare tag"):
        spare_tag(32)
