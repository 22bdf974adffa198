"""A consumer's recv makes the next set's tensors while it waits, from the
last set whose layout the C library keeps, and hands them over when a set
of that layout comes with every member where it was; any other set is made
anew. One test per argument:

    test_set_ahead.py NAME

A recv(timeout=0) that finds nothing makes the tensors ahead too, so most
tests step through it in one thread and know exactly which set comes made
ahead. TSHARE_SET_AHEAD=0 turns it off: the tests then expect nothing made
ahead and every set still intact.
"""
import gc
import os
import threading
import time

import harness
from harness import memfds, pair

import torch
import tshare
from tshare import _sets, _torch
from test_set_reuse import model_of_290, odd_set

test = harness.Tests("test_set_ahead.py")
ON = _sets.AHEAD  # the C++ maker is built and TSHARE_SET_AHEAD is not 0
if os.environ.get("TSHARE_EXPECT_SET_AHEAD") == "1":
    assert ON, "tshare._torch_native is built, yet recv makes no tensors ahead"
if os.environ.get("TSHARE_SET_AHEAD") == "0":
    assert not ON, "TSHARE_SET_AHEAD=0 did not turn it off"


def counts(c):
    """(sets whose tensors c's recv made ahead, sets handed over from them)."""
    return c._c._ahead_counts


def wait_ahead(c):
    """A recv that finds nothing: it makes the next set's tensors first."""
    try:
        tshare.recv(c, timeout=0)
    except tshare.TimeoutError:
        return
    raise AssertionError("recv found something")


def expect_intact(r, sent, meta):
    assert r.meta == meta and list(r.tensors) == list(sent), (r.meta, meta)
    for name, t in sent.items():
        got = r.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.stride(), (meta, name)
        assert torch.equal(got, t), (meta, name)
        assert _torch._memory_kind_of(got) == "view", (meta, name, "not known as received")


def release(p, c, set_id):
    c.poll(0)
    p.wait_released(set_id, timeout=10)
    assert p.outstanding() == 0


def step(p, c, sent, meta, ahead):
    """Send sent; the consumer, having made tensors ahead or not, gets it
    intact; handed over from them exactly when want says."""
    if ahead:
        wait_ahead(c)
    made, handed = counts(c)
    set_id = tshare.send(p, sent, meta=meta, timeout=10)
    r = tshare.recv(c, timeout=10)
    expect_intact(r, sent, meta)
    del r
    release(p, c, set_id)
    return counts(c)[1] - handed


def send_versions(p, sent, versions, pause_s):
    """Versions 0..versions-1 of sent (every value v), each sent and its
    release awaited (so a consumer checks that version's values), then
    pause_s(v) seconds, the consumer waiting meanwhile; then the bye."""
    for v in range(versions):
        with torch.no_grad():
            for t in sent.values():
                t.fill_(v)
        p.wait_released(tshare.send(p, sent, meta=b"%d" % v, timeout=30), timeout=30)
        time.sleep(pause_s(v))
    p.send_bye()


def differences(r, sent):
    """What of received set r differs from sent, as messages naming its version."""
    return ["version %s: %s differs" % (r.meta, name) for name, t in r.tensors.items() if not torch.equal(t, sent[name])]


@test
def each_version_of_a_state_dict_comes_as_the_tensors_made_while_recv_waited():
    m = model_of_290()
    separate = {"w%d" % k: tshare.empty_shared(3, 2 + k % 3) for k in range(40)}  # a memory per member
    odd = odd_set()  # members with capsules of their own, bool, odd offsets, views of views
    p, c = pair()
    for sent in (m.state_dict(), separate, odd):
        base = counts(c)
        assert step(p, c, sent, b"first", ahead=False) == 0
        for version in range(1, 6):
            with torch.no_grad():
                for t in sent.values():
                    if t.is_contiguous() and t.dtype != torch.bool:  # (an expanded view cannot be written)
                        t.add_(1)
            assert step(p, c, sent, b"version %d" % version, ahead=True) == (1 if ON else 0), version
        made, handed = counts(c)
        assert (made - base[0], handed - base[1]) == ((5, 5) if ON else (0, 0)), counts(c)
    p.close()
    c.close()


@test
def writes_through_tensors_made_ahead_reach_the_producer_and_they_are_sent_on_as_its_memory():
    m = model_of_290()
    sent = m.state_dict()
    p, c = pair()
    p2, c2 = pair()
    step(p, c, sent, b"0", ahead=False)
    for version in range(1, 4):
        wait_ahead(c)
        set_id = tshare.send(p, sent, meta=b"%d" % version, timeout=10)
        r = tshare.recv(c, timeout=10)
        name = "%d.weight" % (version * 10)
        r.tensors[name][1, 2] = -version
        tshare.send(p2, r.tensors[name], tag=name)  # a received tensor goes on as the producer's memory
        r2 = tshare.recv(c2, timeout=5)
        assert torch.equal(r2.tensor, sent[name]) and sent[name][1, 2].item() == -version
        r2.tensor[0, 0] = 100 + version  # written by the third party, seen by the producer
        assert sent[name][0, 0].item() == 100 + version
        del r, r2
        c2.poll(0)
        p2.wait_released(timeout=5)
        release(p, c, set_id)
    assert counts(c)[1] == (3 if ON else 0), counts(c)
    for ch in (p, c, p2, c2):
        ch.close()


@test
def a_set_changed_in_any_way_is_made_anew_and_never_from_the_tensors_made_ahead():
    m = model_of_290()
    sent = m.state_dict()
    p, c = pair()
    step(p, c, sent, b"v0", ahead=False)
    assert step(p, c, sent, b"v1", ahead=True) == (1 if ON else 0)
    other = model_of_290()  # same names and shapes, other memory
    transposed = dict(sent, **{"0.weight": sent["0.weight"].t()})  # one member's strides
    fewer = dict(list(sent.items())[:-1])  # one member less
    renamed = {("x" + k if k == "5.bias" else k): t for k, t in sent.items()}
    retyped = dict(sent, **{"7.bias": tshare.empty_shared(3, dtype=torch.float64)})
    for k, changed in enumerate((other.state_dict(), transposed, fewer, renamed, retyped)):
        assert step(p, c, changed, b"changed %d" % k, ahead=True) == 0, k
        # And the set sent again after it, of the changed set's layout, comes made ahead.
        assert step(p, c, changed, b"again %d" % k, ahead=True) == (1 if ON else 0), k
    made, handed = counts(c)
    assert (made, handed) == ((11, 6) if ON else (0, 0)), counts(c)
    p.close()
    c.close()


@test
def tensors_made_ahead_hold_no_memory_and_a_fork_or_close_drops_them():
    m = model_of_290()
    sent = m.state_dict()
    p, c = pair()
    fds = memfds()
    step(p, c, sent, b"0", ahead=False)
    wait_ahead(c)
    assert counts(c) == ((1, 0) if ON else (0, 0))
    assert p.outstanding() == 0  # the tensors made ahead hold none of the set before
    gc.collect()
    pid = os.fork()
    if pid == 0:  # the child's copy of the channel and of the tensors made ahead go without a word to the peer
        c.close()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    set_id = tshare.send(p, sent, meta=b"1", timeout=10)  # the parent's recv hands them over still
    r = tshare.recv(c, timeout=10)
    expect_intact(r, sent, b"1")
    assert counts(c)[1] == (1 if ON else 0)
    del r
    release(p, c, set_id)
    wait_ahead(c)
    c.close()  # with tensors made ahead
    assert tshare.recv(p, timeout=10) is None  # the consumer's bye
    p.close()
    gc.collect()
    assert memfds() == fds, (memfds(), fds)  # the model's own buffer alone: the consumer's mapping went


@test
def a_producer_alternating_two_models_costs_two_sets_made_for_nothing_then_none():
    a, b = model_of_290().state_dict(), model_of_290().state_dict()
    p, c = pair()
    step(p, c, a, b"a", ahead=False)
    for k in range(10):  # b, a, b, a...: what was made never fits
        assert step(p, c, (b, a)[k % 2], b"%d" % k, ahead=True) == 0, k
    assert counts(c) == ((2, 0) if ON else (0, 0)), counts(c)  # after two misses in a row it stops making them
    # The last was a: a again is of the recipe's layout, so they are made again, and handed over from then on.
    for k in range(5):
        assert step(p, c, a, b"a again %d" % k, ahead=True) == (1 if ON and k >= 1 else 0), k
    assert counts(c) == ((6, 4) if ON else (0, 0)), counts(c)
    p.close()
    c.close()


@test
def a_recv_in_inference_mode_makes_nothing_ahead_that_a_recv_outside_it_could_not_write():
    m = model_of_290()
    sent = m.state_dict()
    p, c = pair()
    step(p, c, sent, b"0", ahead=False)
    with torch.inference_mode():
        wait_ahead(c)  # inference tensors made here would be refused a write outside
    assert counts(c) == (0, 0), counts(c)
    set_id = tshare.send(p, sent, meta=b"1", timeout=10)
    r = tshare.recv(c, timeout=10)
    t = r.tensors["0.weight"]
    assert not t.is_inference()
    t.add_(1)  # outside inference mode: a normal tensor takes it
    assert torch.equal(sent["0.weight"], t)
    del r, t
    release(p, c, set_id)
    wait_ahead(c)  # outside: made, and handed over to a recv inside inference mode, where they work too
    with torch.inference_mode():
        assert step(p, c, sent, b"2", ahead=False) == (1 if ON else 0)
    p.close()
    c.close()


@test
def an_asyncio_consumer_gets_the_versions_as_tensors_made_while_its_await_slept():
    import asyncio
    from tshare import aio

    m = model_of_290()
    sent = m.state_dict()
    p, c = pair()
    versions, errors = 12, []

    def producer():
        try:
            send_versions(p, sent, versions, lambda v: 0.02)  # the consumer's await sleeps meanwhile
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    async def consume():
        got = []
        async for r in aio.iterate(c):
            errors.extend(differences(r, sent))
            got.append(int(r.meta))
            del r
        return got

    th = threading.Thread(target=producer)
    th.start()
    got = asyncio.run(consume())
    th.join()
    assert not errors, errors[:3]
    assert got == list(range(versions)), got
    made, handed = counts(c)
    # The await's first try finds nothing and makes them (in the loop); the set that wakes it takes them.
    assert (handed >= versions // 2 and made <= handed + 1) if ON else made == handed == 0, counts(c)
    p.close()
    c.close()


@test
def two_threads_receiving_on_one_channel_get_each_version_once_and_intact():
    m = model_of_290()
    sent = m.state_dict()
    p, c = pair()
    versions = 60
    got, errors = [], []

    def consumer():
        try:
            while True:
                r = tshare.recv(c, timeout=30)
                if r is None:
                    return
                errors.extend(differences(r, sent))
                got.append(int(r.meta))
                del r  # and with it the set: the producer waits for its release
                c.poll(0)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=consumer) for _ in range(2)]
    for th in threads:
        th.start()
    send_versions(p, sent, versions, lambda v: 0.002 * (v % 3))
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors[:3]
    assert sorted(got) == list(range(versions)), got
    made, handed = counts(c)
    assert handed <= made and (handed > 0) == ON, counts(c)
    p.close()
    c.close()


if __name__ == "__main__":
    test.main()
