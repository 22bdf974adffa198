"""A consumer that keeps one set's tensors across versions: r.release()
gives a version back while r's tensors stay (their memory stays mapped),
and recv(ch, into=r) brings the next version of the same layout into those
same tensor objects. One test per argument:

    test_set_into.py NAME
"""
import gc
import os
import threading
import traceback

import harness
from harness import pair

import torch
import tshare
from test_set_ahead import counts, expect_intact
from test_set_reuse import model_of_290, odd_set

test = harness.Tests("test_set_into.py")


def update(sent, v):
    with torch.no_grad():
        for t in sent.values():
            if t.is_contiguous() and t.dtype != torch.bool:  # (an expanded view cannot be written)
                t.fill_(v)


def released_soon(p, c, set_id):
    c.poll(0)
    p.wait_released(set_id, timeout=10)


@test
def each_version_comes_into_the_same_tensors_and_goes_back_at_release():
    m = model_of_290()
    separate = {"w%d" % k: tshare.empty_shared(3, 2 + k % 3) for k in range(40)}  # a memory per member
    p, c = pair()
    for sent in (m.state_dict(), separate, odd_set()):
        set_id = tshare.send(p, sent, meta=b"v0", timeout=10)
        r = tshare.recv(c, timeout=10)
        expect_intact(r, sent, b"v0")
        first = r.tensors
        objects = [id(t) for t in first.values()]
        handed = counts(c)[1]
        for v in range(1, 6):
            r.release()
            released_soon(p, c, set_id)  # back with the producer while r's tensors live
            assert p.outstanding() == 0
            update(sent, v)
            set_id = tshare.send(p, sent, meta=b"v%d" % v, timeout=10)
            r = tshare.recv(c, timeout=10, into=r)
            assert r.tensors is first and [id(t) for t in r.tensors.values()] == objects, v
            assert r.share_id == set_id and r.meta == b"v%d" % v
            expect_intact(r, sent, b"v%d" % v)
        assert counts(c)[1] - handed == 5, counts(c)
        first["%s" % next(iter(first))].view(-1)[0] = -1  # a write lands in the producer's memory
        assert next(iter(sent.values())).reshape(-1)[0].item() in (-1, True), "write not seen"
        del r, first
        gc.collect()
        released_soon(p, c, set_id)
    p.close()
    c.close()


def memfd_mappings():
    """Mappings of tshare memfds in this process (both ends of a pair)."""
    with open("/proc/self/maps") as f:
        return sum("memfd:tshare" in line for line in f)


@test
def a_released_sets_memory_stays_mapped_after_the_producer_drops_it_and_goes_with_the_tensors():
    p, c = pair()
    base = memfd_mappings()
    sent = {"w%d" % k: tshare.empty_shared(64, 1024) for k in range(4)}  # 256 KiB memfds of their own
    update(sent, 7)
    set_id = tshare.send(p, sent, timeout=10)
    r = tshare.recv(c, timeout=10)
    r.release()
    released_soon(p, c, set_id)
    del sent
    gc.collect()
    p.forget_set()  # the channel's kept set held them too
    p.poll(0)  # the producer retires the memfds it dropped
    c.poll(0)  # the consumer reads the retire
    assert memfd_mappings() >= base + 4, "the released tensors' memory was unmapped under them"
    assert all(t.sum().item() == 7 * 64 * 1024 for t in r.tensors.values()), "mapped memory lost its bytes"
    tensors = r.tensors
    del r
    gc.collect()
    assert all(t.sum().item() == 7 * 64 * 1024 for t in tensors.values())
    del tensors
    gc.collect()
    c.poll(0)  # a turn: the retired mappings go now
    assert memfd_mappings() == base, "the retired memory stayed mapped after its tensors went"
    p.close()
    c.close()


@test
def a_set_of_another_layout_comes_as_new_tensors_and_the_released_ones_stay_valid():
    p, c = pair()
    a = {"x": tshare.empty_shared(8), "y": tshare.empty_shared(4)}
    b = {"x": tshare.empty_shared(8)}  # another layout
    update(a, 1)
    update(b, 2)
    set_id = tshare.send(p, a, timeout=10)
    r = tshare.recv(c, timeout=10)
    r.release()
    released_soon(p, c, set_id)
    set_id = tshare.send(p, b, timeout=10)
    r2 = tshare.recv(c, timeout=10, into=r)
    assert r2.tensors is not r.tensors and list(r2.tensors) == ["x"] and r2.tensors["x"].sum().item() == 16
    assert r.tensors["y"].sum().item() == 4  # still mapped: a stale version, not freed memory
    del r2
    gc.collect()
    released_soon(p, c, set_id)
    r.release()  # again: nothing to do
    del r
    p.close()
    c.close()


@test
def an_offer_no_set_took_pins_nothing_once_the_caller_drops_its_tensors():
    """recv(into=r) offers r's tensors to the channel; a recv that timed out,
    or got a set of another layout, leaves the channel without a hold on
    them: once the caller drops r, the retired memory goes at the next idle
    turn, with no other recv in between."""
    p, c = pair()
    base = memfd_mappings()
    for ending in ("timed out", "another layout"):
        sent = {"w%d" % k: tshare.empty_shared(64, 1024) for k in range(4)}
        other = {"x": tshare.empty_shared(8)}
        update(sent, 3)
        set_id = tshare.send(p, sent, timeout=10)
        r = tshare.recv(c, timeout=10)
        r.release()
        released_soon(p, c, set_id)
        if ending == "timed out":
            harness.expect_error(tshare.E_TIMEOUT, "", tshare.recv, c, timeout=0.05, into=r)
            r2 = None
        else:
            other_id = tshare.send(p, other, timeout=10)
            r2 = tshare.recv(c, timeout=10, into=r)
            assert r2.tensors is not r.tensors
            del r2
            gc.collect()
            released_soon(p, c, other_id)
        del sent, other
        gc.collect()
        p.forget_set()
        p.poll(0)  # the producer retires the memfds it dropped
        c.poll(0)  # the consumer reads the retires
        assert memfd_mappings() >= base + 4, ending
        del r
        gc.collect()
        c.poll(0)  # a turn of the channel: retired memory no one holds goes
        assert memfd_mappings() == base, "%s: the offered tensors' memory stayed mapped after they went" % ending
    p.close()
    c.close()


@test
def release_and_into_refuse_what_they_cannot_do():
    p, c = pair()
    p2, c2 = pair()
    t = tshare.empty_shared(8)
    tshare.send(p, t, tag="single", timeout=10)
    single = tshare.recv(c, timeout=10)
    harness.expect_error(tshare.E_INVALID_ARG, "not a received tensor set", single.release)
    harness.expect_error(tshare.E_INVALID_ARG, "into=", tshare.recv, c, timeout=0, into=single)
    harness.expect_error(tshare.E_INVALID_ARG, "into=", tshare.recv, c, timeout=0, into="x")
    del single
    gc.collect()
    sent = {"a": tshare.empty_shared(8), "b": tshare.empty_shared(8)}
    set_id = tshare.send(p, sent, timeout=10)
    r = tshare.recv(c, timeout=10)
    fwd = tshare.send(p2, r.tensors["a"], tag="on", timeout=10)  # sent on: its consumer reads this memory
    third = tshare.recv(c2, timeout=10)
    try:
        r.release()
        raise AssertionError("released while a share of it was out")
    except RuntimeError as e:
        assert "still out" in str(e), e
    assert not p.is_released(set_id)
    del third
    gc.collect()
    c2.poll(0)
    p2.wait_released(fwd, timeout=10)
    r.release()  # the forward is back: now it goes
    released_soon(p, c, set_id)
    # Released tensors are the producer's to change: sending them on is refused, alone or in a set.
    harness.expect_error(tshare.E_STATE, "Received.release()", tshare.send, p2, r.tensors["a"], timeout=5)
    harness.expect_error(tshare.E_STATE, "Received.release()", tshare.send, p2, {"a": r.tensors["a"]}, timeout=5)
    # into= takes a set of this channel only; another channel's is refused before anything is released.
    harness.expect_error(tshare.E_INVALID_ARG, "another channel", tshare.recv, c2, timeout=0, into=r)
    # A recv into r that times out leaves nothing offered: the next plain recv makes its own tensors.
    harness.expect_error(tshare.E_TIMEOUT, "", tshare.recv, c, timeout=0.05, into=r)
    set_id = tshare.send(p, sent, timeout=10)
    r2 = tshare.recv(c, timeout=10)
    assert r2.tensors is not r.tensors, "a plain recv took the tensors a timed-out recv(into=) offered"
    del r2
    gc.collect()
    released_soon(p, c, set_id)
    for ch in (p, c, p2, c2):
        ch.close()


@test
def a_worker_thread_receives_each_version_into_its_tensors_while_the_main_thread_sends():
    """The weight-sync loop with the worker on a thread of its own: the
    main thread sends each version and waits for its release, the worker
    takes each into the same tensors and checks them."""
    worker_thread_loop()


@test
def the_worker_thread_loop_on_one_cpu():
    """The same with the process held to one CPU (a container's quota, a
    small VM): the two threads take turns on it."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    worker_thread_loop()


def worker_thread_loop():
    m = model_of_290()
    sent = m.state_dict()
    p, c = pair()
    errors = []
    versions = 30

    def worker():
        try:
            r = first = None
            for v in range(versions):
                r = tshare.recv(c, timeout=20, into=r) if r is not None else tshare.recv(c, timeout=20)
                first = first if first is not None else r.tensors
                if r.tensors is not first:
                    errors.append("version %d: came as new tensors" % v)
                if any(t.reshape(-1)[0].item() != v for t in r.tensors.values()):
                    errors.append("version %d: a tensor holds another version" % v)
                r.release()  # goes with the next recv (as a drop does), the last one with the poll
            c.poll(0)
            del r
        except BaseException as e:  # reported by the main thread
            errors.append(repr(e))

    th = threading.Thread(target=worker)
    th.start()
    for v in range(versions):
        update(sent, v)
        p.wait_released(tshare.send(p, sent, meta=b"%d" % v, timeout=20), timeout=20)
    th.join(30)
    assert not th.is_alive() and not errors, errors
    p.close()
    c.close()


@test
def an_asyncio_worker_awaits_each_version_into_its_tensors():
    import asyncio
    from tshare import aio

    m = model_of_290()
    sent = m.state_dict()
    p, c = pair()
    versions = 10
    errors = []

    def trainer():
        try:
            for v in range(versions):
                update(sent, v)
                p.wait_released(tshare.send(p, sent, meta=b"%d" % v, timeout=20), timeout=20)
        except BaseException as e:  # reported by the main thread
            errors.append(repr(e))

    async def worker():
        r = first = None
        for v in range(versions):
            r = await aio.recv(c, timeout=20, into=r) if r is not None else await aio.recv(c, timeout=20)
            if first is None:
                first = r.tensors
            assert r.tensors is first, "version %d came as new tensors" % v
            assert r.meta == b"%d" % v and all(t.reshape(-1)[0].item() == v for t in r.tensors.values()), v
            r.release()
        c.poll(0)  # the last release

    th = threading.Thread(target=trainer)
    th.start()
    asyncio.run(worker())
    th.join(30)
    assert not th.is_alive() and not errors, errors
    p.close()
    c.close()


def in_child(fn):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "child ended with 0x%x" % status


@test
def a_forked_child_releasing_or_dropping_the_tensors_leaves_the_parents_set_held_and_mapped():
    p, c = pair()
    sent = {"a": tshare.empty_shared(1024), "b": tshare.empty_shared(1024)}
    update(sent, 1)
    set_id = tshare.send(p, sent, timeout=10)
    r = tshare.recv(c, timeout=10)

    def child_releases():  # the child's release pins its own copy and sends nothing
        r.release()
        assert r.tensors["a"].sum().item() == 1024
        r.release()

    in_child(child_releases)
    c.poll(0.1)
    p.poll(0.1)
    assert not p.is_released(set_id), "a forked child's release() reached the producer"
    r.release()
    released_soon(p, c, set_id)

    def child_drops():  # the child's copies of the pinned mappings go; nothing of the parent's unmapped
        nonlocal r
        assert r.tensors["a"].sum().item() == 1024
        del r
        gc.collect()

    in_child(child_drops)
    update(sent, 2)
    set_id = tshare.send(p, sent, timeout=10)
    r2 = tshare.recv(c, timeout=10, into=r)
    assert r2.tensors is r.tensors and r2.tensors["b"].sum().item() == 2048
    del r, r2
    gc.collect()
    released_soon(p, c, set_id)
    p.close()
    c.close()


if __name__ == "__main__":
    test.main()
