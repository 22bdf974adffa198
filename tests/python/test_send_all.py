"""tshare.send_all: one state_dict (or tensor) to several consumers in one
call, the set built once, each consumer's outcome its own. One test per
argument:

    test_send_all.py NAME

Consumers are forked processes (CUDA ones run test_sets.py's consumer); each
checks every version it gets against the metadata and exits non-zero on the
first wrong value.
"""
import os
import signal
import sys
import threading
import time

import harness
from harness import check_error, expect_error

import torch
import tshare
from test_set_reuse import model_of_290

test = harness.Tests("test_send_all.py")


def version_of(meta):
    return int(meta.split(b"=")[1])


def intact(r):
    """Every tensor of r holds the version its metadata (or a lone
    tensor's tag) names."""
    want = float(version_of(r.meta)) if r.tensor is None else float(r.tag)
    for name, t in r.tensors.items():
        if not torch.all(t == want):
            print("consumer %d: %s is not %s" % (os.getpid(), name, want), flush=True)
            return False
    return True


def consumer_loop(fd, hold_first_s):
    """Each set: every tensor of it filled with the version its metadata
    names (1000 + version for a lone tensor's tag); held hold_first_s
    seconds the first time."""
    with tshare.open_socket(fd, name="consumer %d" % os.getpid()) as ch:
        first = True
        while True:
            r = tshare.recv(ch, timeout=30)
            if r is None:
                return 0
            if not intact(r):
                return 1
            if first and hold_first_s:
                time.sleep(hold_first_s)
            first = False
            del r


def consumers(n, hold_first_s=0.0):
    """n forked consumers: their channels and pids."""
    chs, pids = [], []
    for _ in range(n):
        a, b = tshare.socketpair()
        pid = os.fork()
        if pid == 0:
            os.close(a)
            for c in chs:
                c.close()
            code = 1
            try:
                code = consumer_loop(b, hold_first_s)
            finally:
                os._exit(code)
        os.close(b)
        pids.append(pid)
        chs.append(tshare.open_socket(a, name="producer"))
    return chs, pids


def end(chs, pids, killed=()):
    for c in chs:
        c.close()
    for pid in pids:
        status = os.waitpid(pid, 0)[1]
        if pid not in killed:
            assert os.waitstatus_to_exitcode(status) == 0, "a consumer saw a wrong value"


def builds(chs):
    """Sets built, over every channel's kept builder."""
    return sum(c._c._set_cache_counts[1] for c in chs)


def model_at(model, version):
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(float(version))
    return model.state_dict()


@test
def a_state_dict_goes_to_three_consumers_built_once_and_every_version_comes_back():
    chs, pids = consumers(3)
    model = model_of_290()
    for version in range(6):
        results = tshare.send_all(chs, model_at(model, version), meta=b"v=%d" % version, timeout=30)
        assert [r.channel for r in results] == chs
        assert all(r.ok and r.released and r.id > 0 for r in results), results
    assert builds(chs) == 1, [c._c._set_cache_counts for c in chs]  # built once, sent again 5 times, to all
    assert all(c.outstanding() == 0 for c in chs)
    end(chs, pids)


@test
def a_dead_consumer_a_closed_channel_and_one_listed_twice_fail_alone():
    chs, pids = consumers(3)
    os.kill(pids[1], signal.SIGKILL)
    os.waitpid(pids[1], 0)
    a, b = harness.pair()
    b.close()
    a.close()  # a closed channel, as a caller may pass one
    # A dead consumer whose name the wire cut mid-character (32 bytes): its
    # error still says what happened, never a decoding error instead.
    x, y = tshare.socketpair()
    gone = {}
    th = threading.Thread(target=lambda: gone.setdefault("c", tshare.open_socket(y, name="x" + "работник" * 4)))
    th.start()
    cut = tshare.open_socket(x, name="producer")
    th.join()
    gone["c"].close()
    listed = [chs[0], chs[1], chs[2], chs[0], a, cut]
    model = model_at(model_of_290(), 3)
    results = tshare.send_all(listed, model, meta=b"v=3", timeout=30)
    check_error(results[5].error, tshare.E_PEER_CLOSED, "closed the channel")
    assert results[0].ok and results[0].released and results[2].ok and results[2].released, results
    check_error(results[1].error, tshare.E_PEER_CLOSED, "")
    assert results[1].id == 0 and not results[1].released
    check_error(results[3].error, tshare.E_INVALID_ARG, "in the list twice")
    check_error(results[4].error, tshare.E_STATE, "closed")
    again = tshare.send_all([chs[0], chs[2]], model_at(model_of_290(), 4), meta=b"v=4", timeout=30)
    assert all(r.ok and r.released for r in again), again  # the live ones go on
    cut.close()
    end(chs, [pids[0], pids[2]])


@test
def a_consumer_holding_its_set_times_out_alone():
    chs, pids = consumers(1)
    slow, slow_pids = consumers(1, hold_first_s=3.0)
    model = model_of_290()
    t0 = time.monotonic()
    results = tshare.send_all(chs + slow, model_at(model, 1), meta=b"v=1", timeout=1.0)
    took = time.monotonic() - t0
    assert results[0].ok and results[0].released, results
    check_error(results[1].error, tshare.E_TIMEOUT, "")
    assert not results[1].released and results[1].id > 0  # it went: only its release did not come
    assert took < 2.5, took  # one timeout for the whole call
    slow[0].wait_released(results[1].id, timeout=10)  # it comes later
    end(chs + slow, pids + slow_pids)


@test
def two_threads_fanning_out_to_the_same_channels_in_opposite_orders_both_finish():
    chs, pids = consumers(2)
    models = [model_of_290(), model_of_290()]
    failures = []

    def run(order, model, base):
        for k in range(15):
            v = base + k
            for r in tshare.send_all(order, model_at(model, v), meta=b"v=%d" % v, timeout=30):
                if not (r.ok and r.released):
                    failures.append(r)

    threads = [threading.Thread(target=run, args=(chs, models[0], 0)),
               threading.Thread(target=run, args=(chs[::-1], models[1], 100))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
        assert not th.is_alive(), "two fan-outs over the same channels waited on each other"
    assert not failures, failures
    end(chs, pids)


@test
def a_single_tensor_goes_to_each_and_wait_false_returns_before_the_releases():
    chs, pids = consumers(2)
    t = tshare.empty_shared(1000).fill_(1007.0)
    results = tshare.send_all(chs + [chs[0]], t, tag="1007", timeout=30, wait=False)
    assert all(r.ok and r.id > 0 and not r.released for r in results[:2]), results
    check_error(results[2].error, tshare.E_INVALID_ARG, "in the list twice")  # sent once, at its first place
    assert results[2].id == 0
    for r in results[:2]:
        r.channel.wait_released(r.id, timeout=30)
        assert r.channel.outstanding() == 0
    # What send() refuses of the tensor raises, before anything goes.
    expect_error(tshare.E_INVALID_ARG, "metadata travels with tensor sets", tshare.send_all, chs, t, meta=b"v")
    expect_error(tshare.E_UNSUPPORTED, "sparse", tshare.send_all, chs, torch.zeros(3, 3).to_sparse())
    assert all(c.outstanding() == 0 for c in chs)
    end(chs, pids)


@test
def what_send_refuses_of_the_tensors_raises_and_nothing_goes():
    chs, pids = consumers(2)
    expect_error(tshare.E_UNSUPPORTED, "share_model_", tshare.send_all, chs, {"private": torch.zeros(4)}, timeout=30)
    expect_error(tshare.E_INVALID_ARG, "no channels", tshare.send_all, [], model_of_290().state_dict())
    assert all(c.outstanding() == 0 for c in chs)
    results = tshare.send_all(chs, model_at(model_of_290(), 2), meta=b"v=2", timeout=30)
    assert all(r.ok and r.released for r in results), results
    end(chs, pids)


@test
def a_forked_child_fanning_out_on_inherited_channels_gets_an_error_for_each():
    chs, pids = consumers(2)
    model = model_at(model_of_290(), 1)
    pid = os.fork()
    if pid == 0:  # the channels are the parent's: each refuses, nothing raises, nothing goes
        code = 1
        try:
            results = tshare.send_all(chs, model, meta=b"v=1", timeout=5)
            code = 0 if all(not r.ok and r.id == 0 and not r.released for r in results) else 3
            print(results, flush=True)
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    results = tshare.send_all(chs, model, meta=b"v=1", timeout=30)  # the parent's go on
    assert all(r.ok and r.released for r in results), results
    end(chs, pids)


@test
def an_asyncio_producer_fans_out_while_its_loop_runs_and_a_holder_times_out_alone():
    import asyncio
    from tshare import aio

    chs, pids = consumers(2)
    slow, slow_pids = consumers(1, hold_first_s=2.0)
    model = model_of_290()

    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():  # the loop runs while send_all sends and awaits
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        tick = asyncio.ensure_future(ticker())
        t0 = time.monotonic()
        first = await aio.send_all(chs + slow, model_at(model, 1), meta=b"v=1", timeout=0.8)
        took = time.monotonic() - t0
        versions = []
        for v in range(2, 6):
            versions.append(await aio.send_all(chs, model_at(model, v), meta=b"v=%d" % v, timeout=30))
        stop.set()
        await tick
        return first, took, versions, ticks

    first, took, versions, ticks = asyncio.run(main())
    assert first[0].ok and first[0].released and first[1].ok and first[1].released, first
    check_error(first[2].error, tshare.E_TIMEOUT, "")  # the holder alone, within the call's timeout
    assert not first[2].released and first[2].id > 0 and took < 2.0, (first, took)
    assert all(r.ok and r.released for rs in versions for r in rs), versions
    assert ticks > 20, ticks  # the loop was not blocked
    slow[0].wait_released(first[2].id, timeout=10)
    end(chs + slow, pids + slow_pids)


@test
def cuda_a_state_dict_goes_to_two_consumers_built_once():
    import test_sets

    test_sets.need_cuda()
    started = [test_sets.start_cuda_consumer("versions") for _ in range(2)]
    chs = [p for p, _ in started]
    sent, base = test_sets.numbered_cuda_set(290)
    for version in range(5):
        base.copy_(torch.arange(870.0, device="cuda").view(290, 3) + version)  # on the current stream
        results = tshare.send_all(chs, sent, meta=b"%d" % version, timeout=60)
        for _, proc in started:
            line = proc.stdout.readline().strip()
            assert line == "n=290 ok cuda:0", line
        assert all(r.ok and r.released for r in results), results
    assert builds(chs) == 1, [c._c._set_cache_counts for c in chs]
    for p, proc in started:
        test_sets.end_cuda_consumer(p, proc)


if __name__ == "__main__":
    test.main()
