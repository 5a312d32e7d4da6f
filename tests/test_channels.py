"""``runtime.channels``: the device mailbox, the in-process channel and the CPU device copy.

Messages are keyed ``(kind, receiving stage, micro-batch)``.
"""

import threading
import time

import pytest
import torch

from pipeddp.runtime.channels import Inbox, LocalChannel, PipelineAborted, device_copy
from pipeddp.runtime.streams import StageStreams

CPU = torch.device("cpu")


def start(fn, *args):
    """Run ``fn`` on a thread of its own; the returned dict gets its ``result`` or ``error``."""
    box = {}

    def body():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            box["error"] = exc

    t = threading.Thread(target=body, name="test-channels", daemon=True)
    t.start()
    box["thread"] = t
    return box


def test_take_waits_for_the_item():
    inbox = Inbox(1)
    waiter = start(inbox.take, ("F", 1, 0), 10.0, 0)
    time.sleep(0.2)
    assert waiter["thread"].is_alive()  # nothing there yet: it waits
    inbox.put(("F", 1, 0), "activation")
    waiter["thread"].join(5)
    assert not waiter["thread"].is_alive()
    assert waiter == {"result": "activation", "thread": waiter["thread"]}


def test_keys_make_the_order_of_arrival_irrelevant():
    inbox = Inbox(0)
    inbox.put(("F", 2, 2), "f2")
    inbox.put(("B", 0, 0), "b0")
    inbox.put(("F", 2, 0), "f0")
    inbox.put(("F", 0, 0), "stage 0's f0")  # two stages of one device (virtual stages) never mix
    inbox.put(("F", 2, 1), "f1")
    keys = [("F", 2, 0), ("F", 2, 1), ("B", 0, 0), ("F", 2, 2), ("F", 0, 0)]
    assert [inbox.take(k, 1.0, 1) for k in keys] == ["f0", "f1", "b0", "f2", "stage 0's f0"]
    # each item is taken once
    with pytest.raises(TimeoutError):
        inbox.take(("F", 2, 0), 0.05, 1)


def test_abort_wakes_every_waiter_with_pipeline_aborted():
    inbox = Inbox(3)
    keys = [("F", 3, 0), ("F", 3, 1), ("B", 3, 4)]
    waiters = [start(inbox.take, k, 60.0, 2) for k in keys]
    time.sleep(0.2)
    assert all(w["thread"].is_alive() for w in waiters)
    began = time.monotonic()
    inbox.abort(ValueError("stage 2 broke"))
    for w in waiters:
        w["thread"].join(5)
    assert time.monotonic() - began < 5
    for (kind, _, mb), w in zip(keys, waiters):
        assert not w["thread"].is_alive()
        err = w["error"]
        assert type(err) is PipelineAborted and isinstance(err, RuntimeError)
        what = "activation" if kind == "F" else "gradient"
        assert f"stage 3 stopped waiting for the {what} of micro-batch {mb}" in str(err)
        assert "ValueError('stage 2 broke')" in str(err)
    # a later take fails at once too
    with pytest.raises(PipelineAborted):
        inbox.take(("F", 3, 9), 60.0, 2)


def test_timeout_names_the_stage_and_the_micro_batch():
    inbox = Inbox(1)
    began = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        inbox.take(("B", 1, 3), 0.3, 2)
    assert time.monotonic() - began >= 0.3
    assert "stage 1 waited" in str(info.value)
    assert "for the gradient of micro-batch 3 from the device of stage 2 (device 2)" in str(info.value)
    with pytest.raises(TimeoutError, match="stage 4 waited .* for the activation of micro-batch 0 from the device "
                                           "of stage 3"):
        Inbox(4).take(("F", 4, 0), 0.05, 3)


def test_reset_forgets_leftovers_and_errors():
    inbox = Inbox(0)
    inbox.put(("F", 0, 0), "stale")
    inbox.put(("F", 0, 2), "stashed")
    assert inbox.take(("F", 0, 2), 1.0, 1) == "stashed"  # takes "stale" into the stash on the way
    inbox.abort(RuntimeError("previous step failed"))
    with pytest.raises(PipelineAborted):
        inbox.take(("F", 0, 1), 1.0, 1)
    inbox.reset()
    with pytest.raises(TimeoutError):  # the leftover is gone, and the error no longer fires
        inbox.take(("F", 0, 0), 0.05, 1)
    inbox.put(("F", 0, 0), "fresh")
    assert inbox.take(("F", 0, 0), 1.0, 1) == "fresh"


def pair(timeout=5.0):
    s0, s1 = StageStreams(CPU), StageStreams(CPU)
    in0, in1 = Inbox(0), Inbox(1)
    return LocalChannel(s0, s1, in0, in1, timeout), LocalChannel(s1, s0, in1, in0, timeout)


def test_local_channel_delivers_values_unchanged():
    to_next, to_prev = pair()
    x = torch.randn(4, 3, dtype=torch.float64)
    value = (x, torch.arange(4), [torch.ones(4, 2, dtype=torch.float16)], {"mask": torch.zeros(4, dtype=torch.bool)},
             "tag")
    to_next.send("F", 1, 0, value)
    got = to_prev.recv("F", 1, 0)
    assert type(got) is tuple and len(got) == 5 and got[4] == "tag"
    assert torch.equal(got[0], x) and got[0].dtype == torch.float64
    assert torch.equal(got[1], torch.arange(4))
    assert type(got[2]) is list and torch.equal(got[2][0], value[2][0]) and got[2][0].dtype == torch.float16
    assert list(got[3]) == ["mask"] and torch.equal(got[3]["mask"], value[3]["mask"])
    # CPU to CPU nothing moves: the very tensors arrive
    assert got[0] is x
    grads = [torch.full((4, 3), 2.0, dtype=torch.float64), None]
    to_prev.send("B", 0, 0, grads)
    back = to_next.recv("B", 0, 0)
    assert back[1] is None and torch.equal(back[0], grads[0])


def test_local_channel_between_threads_in_any_order():
    to_next, to_prev = pair()
    sent = [torch.full((2, 2), float(i), dtype=torch.float64) for i in range(4)]
    producer = start(lambda: [to_next.send("F", 1, i, t) for i, t in enumerate(sent)])
    got = {i: to_prev.recv("F", 1, i) for i in (3, 1, 0, 2)}
    producer["thread"].join(5)
    assert "error" not in producer
    assert all(torch.equal(got[i], sent[i]) for i in range(4))


def test_local_channel_recv_times_out_naming_both_stages():
    to_next, to_prev = pair(timeout=0.1)
    with pytest.raises(TimeoutError, match="stage 1 waited .* activation of micro-batch 5 from the device of stage 0"
                                           r" \(device 0\)"):
        to_prev.recv("F", 1, 5)
    with pytest.raises(TimeoutError, match="stage 0 waited .* gradient of micro-batch 2 from the device of stage 1"
                                           r" \(device 1\)"):
        to_next.recv("B", 0, 2)


def test_device_copy_on_cpu():
    src, dst = StageStreams(CPU), StageStreams(CPU)
    assert not src.cuda and src.record_event() is None
    value = {"x": torch.randn(3, 2), "rest": (torch.arange(3), "label", 7)}
    out, event = device_copy(value, src, dst)
    assert event is None
    assert out is value  # same device: nothing is copied
    assert dst.adopt(out, event) is out
    # another spelling of the CPU: values arrive equal, structure and non-tensor leaves kept
    other = StageStreams(torch.device("cpu", 0))
    out2, event2 = device_copy(value, src, other)
    assert event2 is None
    assert set(out2) == {"x", "rest"} and out2["rest"][1:] == ("label", 7)
    assert torch.equal(out2["x"], value["x"]) and torch.equal(out2["rest"][0], value["rest"][0])
    assert out2["x"].device.type == "cpu"
