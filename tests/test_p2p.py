"""``distributed.p2p``: the activation header, message tags, and real exchanges between two gloo processes.

The suite runs every job under NCCL's rules (``nccl_rules``: no tags, one stream per pair of ranks); the jobs
here also run on the ordinary tagged path, and show that the rules catch a transport that relies on tags or
posts its operations out of order.
"""

import itertools
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import pipeddp
from pipeddp.distributed.headers import DTYPES, HEADER, decode, encode, flatten, meta_of
from pipeddp.distributed.p2p import EAGER_BYTES, P2PChannel, PeerError
from pipeddp.distributed.predicted import plan
from pipeddp.distributed.tags import tag as _tag
from pipeddp.runtime.schedule import Kind, crossings, interleaved, one_f_one_b

import nccl_rules

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

CPU = torch.device("cpu")


def round_trip(value):
    container, tensors = flatten(value)
    header = encode(container, tensors)
    assert header.dtype == torch.int64 and header.shape == (HEADER,)
    container, members = decode(header)
    return container, list(members)


def test_header_round_trip_of_a_tensor_of_every_supported_dtype():
    assert len(DTYPES) == 11
    for dtype in DTYPES:
        assert round_trip(torch.zeros(5, 3, 2, dtype=dtype)) == (0, [(dtype, (5, 3, 2))])


def test_header_round_trip_of_tuples_and_lists():
    value = (torch.zeros(4, 7), torch.zeros(4, dtype=torch.int64), torch.zeros(4, 1, 2, 3, dtype=torch.bfloat16),
             torch.zeros((), dtype=torch.bool))
    assert round_trip(value) == (1, [(torch.float32, (4, 7)), (torch.int64, (4,)), (torch.bfloat16, (4, 1, 2, 3)),
                                     (torch.bool, ())])
    assert round_trip([torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, 0, dtype=torch.uint8)]) == (
        2, [(torch.float16, (2, 3)), (torch.uint8, (2, 0))])
    assert round_trip(()) == (1, [])


def test_header_follows_a_batch_size_that_changes_between_calls():
    for n in (8, 3, 1, 8, 5):
        value = (torch.zeros(n, 12, dtype=torch.float64), torch.zeros(n, dtype=torch.int64))
        assert round_trip(value) == (1, [(torch.float64, (n, 12)), (torch.int64, (n,))])
    # a non-contiguous tensor is described by its logical shape
    assert round_trip(torch.zeros(6, 4).t()) == (0, [(torch.float32, (4, 6))])


def test_unsupported_values_are_refused_with_a_clear_message():
    for bad in ({"x": torch.zeros(2)}, (torch.zeros(2), (torch.zeros(2),)), [torch.zeros(2), "mask"], 3.0):
        with pytest.raises(TypeError, match="must output a tensor or a flat tuple/list of tensors, got "
                                            f"{type(bad).__name__}"):
            flatten(bad)
    with pytest.raises(TypeError, match="cannot send a tensor of dtype torch.complex128 between stages"):
        encode(0, [torch.zeros(2, dtype=torch.complex128)])
    with pytest.raises(TypeError, match="too many tensors or dimensions"):
        encode(1, [torch.zeros(2) for _ in range(40)])
    with pytest.raises(TypeError, match="too many tensors or dimensions"):
        encode(0, [torch.zeros([1] * 61)])
    assert round_trip(torch.zeros([1] * 60)) == (0, [(torch.float32, (1,) * 60)])  # the largest that fits


def test_channel_refuses_a_dict_before_sending_anything():
    ch = P2PChannel(1, rank=0, stage=0, peer_stage=1, device=CPU, comm_device=CPU, timeout=timedelta(seconds=1))
    ch.begin(crossings(interleaved(2, 1))[(0, 1)])  # it starts with a send: nothing is posted, no group is needed
    with pytest.raises(TypeError, match="got dict; restructure the layer at the cut"):
        ch.send("F", 1, 0, {"h": torch.zeros(2, 3)})
    assert ch.shapes.pending == 0 and ch._inflight == [] and ch._next == 0


def test_a_plan_fits_exactly_the_activations_of_its_header():
    """``Plan.fits`` (the sender's check of an activation against its prediction, without a header) says yes
    exactly where the activation's header would describe the predicted one."""
    t, u = torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64)
    values = [t, t.t(), torch.zeros(4, 3, dtype=torch.float64), torch.zeros(5, 3), (t, u), (t, None), (None, u),
              (t, u, None), [t, u], [t, None], (t,), [t], (None,), (), torch.zeros(()), (torch.zeros(4, 3), u)]
    for predicted_value in values:
        known = plan(meta_of(*flatten(predicted_value)))
        for value in values:
            assert known.fits(value) == (meta_of(*flatten(value)) == known.meta), (predicted_value, value)
    assert not plan(meta_of(*flatten(t))).fits(torch.nn.Parameter(t))  # a subclass: the path with its header


def test_tags_are_unique_per_kind_stage_micro_batch_and_slot():
    max_slots = 32
    keys = list(itertools.product("FB", (0, 1, 7, 255), (0, 1, 2**16, 2**17 - 1), (0, 1, max_slots - 1)))
    tags = [_tag(*key) for key in keys]
    assert len(set(tags)) == len(keys)
    assert _tag("B", 255, 2**17 - 1, max_slots - 1) < 2**31  # the largest tag fits gloo's 32 bits
    with pytest.raises(ValueError, match="at most 256 stages"):
        _tag("F", 256, 0, 0)
    with pytest.raises(ValueError, match="131072 micro-batches"):
        _tag("F", 0, 2**17, 0)


# -- a real exchange over gloo ----------------------------------------------------------------------------------

# micro-batch sizes: the batch size changes between calls and steps; in the last step most messages are larger
# than p2p.EAGER_BYTES (sends kept in flight on gloo), the half-precision ones smaller (waited for at once)
STEPS = [[5, 3, 4], [2, 6, 1], [3000, 2500]]


def activation(step, stage, mb, n):
    """The input of ``stage`` for micro-batch ``mb``: a tensor, a tuple or a list of mixed dtypes and shapes."""
    g = torch.Generator().manual_seed(1000 * step + 100 * stage + mb)
    if (mb + stage) % 3 == 0:
        return torch.randn(4, n, generator=g, dtype=torch.float64).t()  # not contiguous
    if (mb + stage) % 3 == 1:
        return (torch.randn(n, 2, 3, generator=g), torch.randint(0, 9, (n,), generator=g),
                torch.randint(0, 2, (n, 1), generator=g).bool(), torch.randn(n, 5, generator=g).bfloat16(),
                torch.randn(n, 2, generator=g, dtype=torch.complex64))
    return [torch.randn(n, 3, generator=g).half(), torch.randint(0, 255, (n,), generator=g).to(torch.uint8)]


def gradient(step, stage, mb, n):
    """The gradients for ``activation(step, stage, mb, n)``: one per tensor, None where there is none.

    The bfloat16 activation gets no gradient although it could have one: the channel sends zeros for it.
    """
    g = torch.Generator().manual_seed(50000 + 1000 * step + 100 * stage + mb)
    if (mb + stage) % 3 == 0:
        return [torch.randn(n, 4, generator=g, dtype=torch.float64)]
    if (mb + stage) % 3 == 1:
        return [torch.randn(n, 2, 3, generator=g), None, None, None,
                torch.randn(n, 2, generator=g, dtype=torch.complex64)]
    return [torch.randn(n, 3, generator=g).half(), None]


def walk(ch, row, step, sizes, got):
    """One rank's row of a 4-stage schedule on 2 processes: send known activations and gradients (micro-batch i of
    ``sizes[i]`` rows), append what arrives to ``got``."""
    for a in row:
        n = sizes[a.mb]
        if a.kind is Kind.F:
            if a.stage > 0:
                got.append(("F", step, a.stage, a.mb, ch.recv("F", a.stage, a.mb)))
            if a.stage < 3:
                ch.send("F", a.stage + 1, a.mb, activation(step, a.stage + 1, a.mb, n))
        else:
            if a.stage < 3:
                got.append(("B", step, a.stage, a.mb, ch.recv("B", a.stage, a.mb)))
            if a.stage > 0:
                ch.send("B", a.stage - 1, a.mb, gradient(step, a.stage, a.mb, n))


def exchange_job():
    """Both ranks walk their rows of an interleaved schedule (4 stages on 2 processes: messages both ways on one
    link), sending known activations and gradients and recording what they receive; then a failed step, then a
    message that never comes."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    ch = P2PChannel(1 - rank, rank=rank, stage=rank, peer_stage=1 - rank, device=CPU, comm_device=CPU,
                    timeout=timedelta(seconds=30))
    got = []
    for step, sizes in enumerate(STEPS):
        plan = interleaved(2, len(sizes), 2)
        ch.begin(crossings(plan)[(0, 1)])
        walk(ch, plan[rank], step, sizes, got)
        ch.flush()
        ch.finish()
    # a step fails on rank 0 before it sends anything (the caller's interrupt), and rank 0 stays up meanwhile,
    # sending nothing: rank 1 gets a PeerError naming both sides after its timeout; both refuse the next step
    ch.timeout = timedelta(seconds=1)
    plan = interleaved(2, 2, 2)
    ch.begin(crossings(plan)[(0, 1)])
    error = refused = ""
    began = time.monotonic()
    try:
        if rank == 1:
            ch.recv("F", 1, 0)
        else:
            raise KeyboardInterrupt
    except PeerError as exc:
        error = f"{exc} after {time.monotonic() - began:.1f} s"
        ch.fail(exc)
    except KeyboardInterrupt as exc:
        ch.fail(exc)
        time.sleep(2.5)
    try:
        ch.begin(crossings(plan)[(0, 1)])
    except PeerError as exc:
        refused = str(exc)
    return {"got": got, "error": error, "refused": refused}


def large_send_job(n):
    """Rank 0 sends an activation of ``n`` floats, then tells rank 1 on another group that ``send`` returned; only
    then does rank 1 post its receive. A gloo send completes only once its receive is posted, so a ``send`` that
    waited for its message would wait for a receive that waits for it: the channel's timeout, an error."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    side = dist.new_group([0, 1])
    ch = P2PChannel(1 - rank, rank=rank, stage=rank, peer_stage=1 - rank, device=CPU, comm_device=CPU,
                    timeout=timedelta(seconds=10))
    ch.begin(crossings(one_f_one_b(2, 1))[(0, 1)])
    x = torch.arange(n, dtype=torch.float32)
    if rank == 0:
        ch.send("F", 1, 0, x)
        dist.send(torch.ones(1), 1, group=side)
        got = ch.recv("B", 0, 0)[0]
    else:
        dist.recv(torch.empty(1), 0, group=side)
        got = ch.recv("F", 1, 0)
        ch.send("B", 0, 0, [got * 2])
    ch.flush()
    ch.finish()
    return got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rules", ["nccl", "tags"])
@pytest.mark.parametrize("n", [EAGER_BYTES // 4 + 1, 1 << 22])
def test_a_send_larger_than_eager_bytes_returns_before_its_receive_is_posted(rules, n):
    """Over gloo a large activation stays in flight while the sender computes on (``p2p.EAGER_BYTES``)."""
    got = pipeddp.spawn(large_send_job, 2, (n,), timeout=90, env={"PIPEDDP_P2P_RULES": rules})
    x = torch.arange(n, dtype=torch.float32)
    assert torch.equal(got[1], x) and torch.equal(got[0], x * 2)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rules", ["nccl", "tags"])
def test_activations_and_gradients_cross_between_processes_intact(rules):
    results = pipeddp.spawn(exchange_job, 2, timeout=90, env={"PIPEDDP_P2P_RULES": rules})
    for rank, res in enumerate(results):
        plan = [interleaved(2, len(sizes), 2)[rank] for sizes in STEPS]
        want = [(a.kind.value, step, a.stage, a.mb) for step, row in enumerate(plan) for a in row
                if (a.kind is Kind.F and a.stage > 0) or (a.kind is not Kind.F and a.stage < 3)]
        assert [g[:4] for g in res["got"]] == want  # every message, each where the schedule takes it
        for kind, step, stage, mb, value in res["got"]:
            n = STEPS[step][mb]
            if kind == "F":  # container, dtypes, shapes and values
                expected = activation(step, stage, mb, n)
                assert type(value) is type(expected)
                if isinstance(expected, torch.Tensor):
                    assert same(value, expected.contiguous())
                else:
                    assert len(value) == len(expected) and all(same(a, b) for a, b in zip(value, expected))
                continue
            # gradients aligned with the activation's tensors: None for the ones that take no gradient, zeros
            # for a floating tensor the peer left without one
            acts = activation(step, stage + 1, mb, n)
            acts = [acts] if isinstance(acts, torch.Tensor) else list(acts)
            expected = gradient(step, stage + 1, mb, n)
            assert isinstance(value, list) and len(value) == len(acts)
            for act, g, w in zip(acts, value, expected):
                if not (act.is_floating_point() or act.is_complex()):
                    assert g is None
                elif w is None:
                    assert same(g, torch.zeros_like(act))
                else:
                    assert same(g, w)
        assert "cannot exchange messages with rank" in res["refused"] and "Restart the job" in res["refused"]
    assert "KeyboardInterrupt" in results[0]["refused"]  # the reason given is this rank's own failure
    assert "got no activation of micro-batch 0 for stage 1" in results[1]["refused"]
    assert results[0]["error"] == ""
    assert results[1]["error"].startswith("rank 1 (stage 1) got no activation of micro-batch 0 for stage 1 from "
                                          "rank 0 (stage 0) within 1 s")
    assert 0.9 <= float(results[1]["error"].split(" after ")[-1][:-2]) < 2.5  # it waited its timeout, not longer


def misordered_job():
    """What a transport that relies on tags does: rank 1 posts the receive of the second message first; and both
    ranks post a receive before their send."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    out = {}
    if rank == 0:
        dist.isend(torch.full((3,), 1.0), 1, tag=1).wait()
        dist.isend(torch.full((3,), 2.0), 1, tag=2).wait()
    else:
        second, first = torch.zeros(3), torch.zeros(3)
        w2 = dist.irecv(second, 0, tag=2)
        w1 = dist.irecv(first, 0, tag=1)
        w1.wait(), w2.wait()
        out["first"], out["second"] = first.tolist(), second.tolist()
    # both directions at once: each rank posts its receive, then sends
    mine, theirs = torch.full((2,), float(rank)), torch.zeros(2)
    recv = dist.irecv(theirs, 1 - rank, tag=7)
    send = dist.isend(mine, 1 - rank, tag=7)
    try:
        recv.wait(timedelta(seconds=2))
        send.wait(timedelta(seconds=2))
        out["crossed"] = theirs.tolist()
    except RuntimeError as exc:
        out["crossed"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_the_nccl_rules_catch_what_only_tags_made_right():
    tagged = pipeddp.spawn(misordered_job, 2, timeout=60, env={"PIPEDDP_P2P_RULES": "tags"})
    assert tagged[1]["first"] == [1.0] * 3 and tagged[1]["second"] == [2.0] * 3
    assert tagged[0]["crossed"] == [1.0] * 2 and tagged[1]["crossed"] == [0.0] * 2
    ruled = pipeddp.spawn(misordered_job, 2, timeout=60, env={"PIPEDDP_P2P_RULES": "nccl"})
    assert ruled[1]["first"] == [2.0] * 3 and ruled[1]["second"] == [1.0] * 3  # paired by order: swapped
    # a receive posted before a send on both sides: each waits for the other's send, queued behind it
    assert "did not complete" in ruled[0]["crossed"] and "did not complete" in ruled[1]["crossed"]


def stream_context_job():
    """A stage-mode job that records, for every call into its transport, whether the stage's compute stream
    context (``StageStreams.computing``) was entered around it: where NCCL needs it, on a GPU (on the CPU the steps
    are traced, which enters it too)."""
    import contextlib
    import threading

    from torch import nn

    from pipeddp.runtime.streams import StageStreams

    depth = threading.local()
    calls = []
    entered = StageStreams.computing

    @contextlib.contextmanager
    def computing(self):
        depth.n = getattr(depth, "n", 0) + 1
        try:
            with entered(self):
                yield
        finally:
            depth.n -= 1

    def recording(name, fn):
        def call(self, *args, **kwargs):
            calls.append((name, getattr(depth, "n", 0) > 0))
            return fn(self, *args, **kwargs)
        return call

    StageStreams.computing = computing
    for name in ("begin", "send", "recv"):
        setattr(P2PChannel, name, recording(name, getattr(P2PChannel, name)))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    # traced: an untraced step on the CPU enters no context around a message (nothing to order it after), a traced
    # one does, as every step on a GPU
    with pipeddp.HybridParallel(model, stages=2, mode="stage", chunks=3, balance=[2, 3], trace=True) as engine:
        for _ in range(2):
            engine.train_step(torch.randn(6, 6), torch.randn(6, 2), nn.functional.mse_loss)
    return calls


@pytest.mark.timeout(120)
def test_every_call_into_the_transport_runs_inside_the_stage_stream_context():
    for calls in pipeddp.spawn(stream_context_job, 2, timeout=90):
        assert {name for name, _ in calls} == {"begin", "send", "recv"}
        assert len(calls) == 2 * (1 + 3 + 3)  # per step: begin, 3 sends, 3 receives on each rank
        assert all(inside for _, inside in calls), calls


def repeat_job():
    """Steps whose activations have the shapes of the step before cross without headers, values intact; in the last
    one, micro-batch 1's activations come out one row longer than predicted (shapes that depend on the input's
    values): the senders flag them, and they still arrive, each header and the tensors the predicted receives did
    not carry on a side group. How far each step's receives were posted at its start, before the peer sent anything
    (``ahead``: the index of the first message of the link's order not posted yet)."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    ch = P2PChannel(1 - rank, rank=rank, stage=rank, peer_stage=1 - rank, device=CPU, comm_device=CPU,
                    timeout=timedelta(seconds=30), side_group=dist.new_group([0, 1]))
    plan = interleaved(2, len(REPEAT_SIZES[0]), 2)
    got, headers, ahead = [], [], []
    for step, repeat in enumerate(REPEATS):
        ch.begin(crossings(plan)[(0, 1)], key="train_step/0", repeat=repeat)
        ahead.append(ch._next)
        dist.barrier()  # nothing is sent before both ranks have looked
        before = ch.headers
        walk(ch, plan[rank], step, REPEAT_SIZES[step], got)
        ch.flush()
        ch.finish()
        headers.append(ch.headers - before)
    return {"got": got, "headers": headers, "ahead": ahead}


# then larger activations (above p2p.EAGER_BYTES: kept in flight), predicted twice: the flag on a tensor's buffer kept
# per message and filled again the next step, or, where every tensor is large, a byte of its own
REPEAT_SIZES = [[5, 3, 4], [5, 3, 4], [5, 3, 4], [5, 4, 4], [3000, 2500, 9], [3000, 2500, 9], [3000, 2500, 9]]
REPEATS = [False, True, True, True, False, True, True]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rules", ["nccl", "tags"])
def test_activations_whose_shapes_repeat_cross_without_headers(rules):
    results = pipeddp.spawn(repeat_job, 2, timeout=90, env={"PIPEDDP_P2P_RULES": rules})
    for rank, res in enumerate(results):
        sends = [a for a in interleaved(2, 3, 2)[rank] if a.kind is Kind.F and a.stage < 3]
        changed = sum(1 for a in sends if a.mb == 1)
        # the first step's, the changed ones, the first larger step's
        assert changed > 0 and res["headers"] == [len(sends), 0, 0, changed, len(sends), 0, 0]
        # rank 1's order starts with two activations: with shapes predicted both are posted before the first arrives
        # (no flag read first), while a header must be in before the receives of its tensors
        assert res["ahead"] == ([0, 2, 2, 2, 0, 2, 2] if rank else [0] * 7)
        for kind, step, stage, mb, value in res["got"]:
            if kind != "F":
                continue
            expected = activation(step, stage, mb, REPEAT_SIZES[step][mb])
            if isinstance(expected, torch.Tensor):
                assert same(value, expected.contiguous())
            else:
                assert type(value) is type(expected)
                assert len(value) == len(expected) and all(same(a, b) for a, b in zip(value, expected))
        assert {step for kind, step, _, _, _ in res["got"] if kind == "F"} == set(range(len(REPEATS)))
