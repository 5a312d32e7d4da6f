"""``distributed.p2p``: the activation header, message tags, and a real exchange between two gloo processes."""

import itertools
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import pipeddp
from pipeddp.distributed.p2p import _DTYPES, _HEADER, P2PChannel, PeerError, _decode, _encode, _flatten, _tag

CPU = torch.device("cpu")


def round_trip(value):
    container, tensors = _flatten(value)
    header = _encode(container, tensors)
    assert header.dtype == torch.int64 and header.shape == (_HEADER,)
    return _decode(header)


def test_header_round_trip_of_a_tensor_of_every_supported_dtype():
    assert len(_DTYPES) == 11
    for dtype in _DTYPES:
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
            _flatten(bad)
    with pytest.raises(TypeError, match="cannot send a tensor of dtype torch.complex128 between stages"):
        _encode(0, [torch.zeros(2, dtype=torch.complex128)])
    with pytest.raises(TypeError, match="too many tensors or dimensions"):
        _encode(1, [torch.zeros(2) for _ in range(40)])
    with pytest.raises(TypeError, match="too many tensors or dimensions"):
        _encode(0, [torch.zeros([1] * 61)])
    assert round_trip(torch.zeros([1] * 60)) == (0, [(torch.float32, (1,) * 60)])  # the largest that fits


def test_channel_refuses_a_dict_before_sending_anything():
    ch = P2PChannel(1, rank=0, stage=0, peer_stage=1, device=CPU, comm_device=CPU, timeout=timedelta(seconds=1))
    with pytest.raises(TypeError, match="got dict; restructure the layer at the cut"):
        ch.send("F", 1, 0, {"h": torch.zeros(2, 3)})  # no process group is needed to refuse it
    assert ch._meta == {} and ch._inflight == []


def test_tags_are_unique_per_kind_stage_micro_batch_and_slot():
    max_slots = (_HEADER - 2) // 2 + 1  # a header describes at most 31 tensors: slots 0 (header) .. 31
    keys = list(itertools.product("FB", (0, 1, 5, 255), range(300), range(max_slots), range(4)))
    tags = [_tag(kind, stage, mb, slot, gen) for kind, stage, mb, slot, gen in keys]
    assert len(set(tags)) == len(keys)
    assert min(tags) >= 0 and max(tags) < 2**31
    assert _tag("B", 255, 2**15 - 1, max_slots - 1, 3) < 2**31  # the largest tag fits gloo's 32 bits
    assert _tag("F", 0, 0, 0, 4) == _tag("F", 0, 0, 0, 0)  # four generations, then the first again
    with pytest.raises(ValueError, match="at most 256 stages"):
        _tag("F", 256, 0, 0)
    with pytest.raises(ValueError, match="32768 micro-batches"):
        _tag("F", 0, 2**15, 0)


# -- a real exchange over gloo ----------------------------------------------------------------------------------

STEPS = [[5, 3, 4], [2, 6, 1]]  # micro-batch sizes: the batch size changes between calls and steps


def activation(step, mb, n):
    """Stage 0's output of micro-batch ``mb``: a tensor, a tuple or a list of mixed dtypes and shapes."""
    g = torch.Generator().manual_seed(1000 * step + mb)
    if mb % 3 == 0:
        return torch.randn(4, n, generator=g, dtype=torch.float64).t()  # not contiguous
    if mb % 3 == 1:
        return (torch.randn(n, 2, 3, generator=g), torch.randint(0, 9, (n,), generator=g),
                torch.randint(0, 2, (n, 1), generator=g).bool(), torch.randn(n, 5, generator=g).bfloat16(),
                torch.randn(n, 2, generator=g, dtype=torch.complex64))
    return [torch.randn(n, 3, generator=g).half(), torch.randint(0, 255, (n,), generator=g).to(torch.uint8)]


def gradient(step, mb, n):
    """Stage 1's input gradients for ``activation(step, mb, n)``: one per tensor, None where there is none.

    The bfloat16 activation gets no gradient although it could have one: the channel sends zeros for it.
    """
    g = torch.Generator().manual_seed(5000 + 1000 * step + mb)
    if mb % 3 == 0:
        return [torch.randn(n, 4, generator=g, dtype=torch.float64)]
    if mb % 3 == 1:
        return [torch.randn(n, 2, 3, generator=g), None, None, None,
                torch.randn(n, 2, generator=g, dtype=torch.complex64)]
    return [torch.randn(n, 3, generator=g).half(), None]


def exchange_job():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    peer = 1 - rank
    ch = P2PChannel(peer, rank=rank, stage=rank, peer_stage=peer, device=CPU, comm_device=CPU,
                    timeout=timedelta(seconds=30))
    got = []
    for step, sizes in enumerate(STEPS):
        order = list(range(len(sizes)))
        if rank == 0:  # device 0 holds stages 0 and 2 (virtual stages), device 1 stages 1 and 3
            for mb in order:  # the gradients of stage 0's outputs: received as soon as each activation is sent
                ch.expect("B", 0, mb)
            for mb in order:
                ch.send("F", 1, mb, activation(step, mb, sizes[mb]))
                ch.send("F", 3, mb, activation(step + 10, mb, sizes[mb]))  # same micro-batch, another stage
            for mb in order:
                got.append((step, mb, ch.recv("B", 0, mb)))
                assert same(ch.recv("B", 2, mb)[0], gradient(step + 10, mb, sizes[mb])[0])
        else:
            for mb in order:  # received ahead, as a runner asks at the start of a step
                ch.expect("F", 1, mb)
            for mb in reversed(order):  # consumed in another order than sent: tags, not arrival order, match them
                other = ch.recv("F", 3, mb)
                got.append((step, mb, ch.recv("F", 1, mb)))
                ch.send("B", 2, mb, gradient(step + 10, mb, sizes[mb]))
                ch.send("B", 0, mb, gradient(step, mb, sizes[mb]))
                expected = activation(step + 10, mb, sizes[mb])
                assert type(other) is type(expected)
        ch.flush()
    # a failed step leaves a receive posted ahead (rank 1); both sides reset, and the next step's message with the
    # same (kind, stage, micro-batch) goes to the new receive, not to the stale one
    if rank == 1:
        ch.expect("F", 1, 50)
    ch.reset()
    after_reset = None
    if rank == 0:
        ch.send("F", 1, 50, torch.full((2, 2), 7.0))
    else:
        after_reset = ch.recv("F", 1, 50)
    ch.flush()
    # a message that never comes: a PeerError naming both sides (rank 0 stays up meanwhile, sending nothing)
    error = ""
    if rank == 1:
        short = P2PChannel(0, rank=1, stage=1, peer_stage=0, device=CPU, comm_device=CPU,
                           timeout=timedelta(seconds=1))
        began = time.monotonic()
        try:
            short.recv("F", 1, 99)
        except PeerError as exc:
            error = f"{exc} after {time.monotonic() - began:.1f} s"
    else:
        time.sleep(2.5)
    return {"got": got, "error": error, "after_reset": after_reset}


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.timeout(120)
def test_activations_and_gradients_cross_between_processes_intact():
    sent_back, received = pipeddp.spawn(exchange_job, 2, timeout=90)
    # rank 1 got every activation: container, dtypes, shapes and values
    assert [(s, mb) for s, mb, _ in received["got"]] == [(s, mb) for s, sizes in enumerate(STEPS)
                                                           for mb in reversed(range(len(sizes)))]
    for step, mb, value in received["got"]:
        expected = activation(step, mb, STEPS[step][mb])
        assert type(value) is type(expected)
        if isinstance(expected, torch.Tensor):
            assert same(value, expected.contiguous())
        else:
            assert len(value) == len(expected) and all(same(a, b) for a, b in zip(value, expected))
    # rank 0 got the gradients, aligned with its activation's tensors: None for the ones that take no gradient,
    # zeros for a floating tensor the peer left without one
    assert [(s, mb) for s, mb, _ in sent_back["got"]] == [(s, mb) for s, sizes in enumerate(STEPS)
                                                          for mb in range(len(sizes))]
    for step, mb, grads in sent_back["got"]:
        n = STEPS[step][mb]
        acts = activation(step, mb, n)
        acts = [acts] if isinstance(acts, torch.Tensor) else list(acts)
        expected = gradient(step, mb, n)
        assert isinstance(grads, list) and len(grads) == len(acts)
        for act, g, want in zip(acts, grads, expected):
            if not (act.is_floating_point() or act.is_complex()):
                assert g is None
            elif want is None:
                assert same(g, torch.zeros_like(act))
            else:
                assert same(g, want)
    assert sent_back["error"] == ""
    assert torch.equal(received["after_reset"], torch.full((2, 2), 7.0))
    assert received["error"].startswith("rank 1 (stage 1) got no activation of micro-batch 99 for stage 1 from rank 0 "
                                        "(stage 0) within 1 s")
    assert 0.9 <= float(received["error"].split(" after ")[-1][:-2]) < 2.5  # it waited its timeout, not longer
