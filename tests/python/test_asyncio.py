"""tshare.aio under asyncio, one test per argument:

  test_asyncio.py NAME      (exit 0 pass, 1 fail, 77 skip with the reason)

Channels are opened in pairs from two threads (the hello of each end waits
for the other's); producers are threads with the blocking API or tasks on
the consumers' loop."""
import asyncio
import os
import random
import resource
import signal
import threading
import time

import harness
import torch

import tshare
from tshare import aio
from harness import pair

test = harness.Tests("test_asyncio.py")


async def expect_error(code, fragment, awaitable):
    try:
        await awaitable
    except tshare.Error as e:
        harness.check_error(e, code, fragment)
        return
    raise harness.no_error_wanted(code, fragment)


def cpu_seconds():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def produce(ch, n, seed):
    """n one-element shares k = 0..n-1 at uneven times (a pause longer than
    the consumer's longest recv every 40), tagged with k; every 25 it waits
    for the consumer's releases; then bye."""
    rng = random.Random(seed)
    buf = tshare.empty_shared(n)
    buf.copy_(torch.arange(n, dtype=buf.dtype))
    for k in range(n):
        tshare.send(ch, buf[k : k + 1], tag=str(k), timeout=10)
        if rng.random() < 0.3:
            threading.Event().wait(rng.random() * 0.004)
        if k % 40 == 20:
            threading.Event().wait(0.06)
        if k % 25 == 24:
            ch.wait_released(timeout=10)
    ch.wait_released(timeout=10)
    ch.send_bye(timeout=10)


async def consume_with_timeouts(ch, rng):
    """Every share until bye, each recv under a short asyncio.wait_for that
    often cancels it mid-wait: (values in order of arrival, cancels)."""
    got, cancels = [], 0
    while True:
        try:
            r = await asyncio.wait_for(aio.recv(ch), timeout=rng.choice((0.0002, 0.001, 0.003, 0.05)))
        except asyncio.TimeoutError:
            cancels += 1
            continue
        if r is None:
            return got, cancels
        assert r.tag == str(int(r.tensor.item())), "tag %s carries %s" % (r.tag, r.tensor)
        got.append(int(r.tensor.item()))
        del r


@test
def four_producers_one_loop_with_cancellations():
    """One loop consumes from 4 channels fed by 4 producer threads; recvs are
    cancelled by wait_for timeouts all along. Every share arrives once, in
    order, and every release reaches its producer."""
    n = 200
    pairs = [pair() for _ in range(4)]
    producers = [threading.Thread(target=produce, args=(p, n, i)) for i, (p, _) in enumerate(pairs)]
    for t in producers:
        t.start()

    async def main():
        rng = random.Random(7)
        return await asyncio.gather(*(consume_with_timeouts(c, rng) for _, c in pairs))

    results = asyncio.run(asyncio.wait_for(main(), timeout=60))
    for t in producers:
        t.join(30)
        assert not t.is_alive(), "a producer still waits"
    for i, (got, cancels) in enumerate(results):
        assert got == list(range(n)), "channel %d got %d shares, first wrong at %s" % (
            i, len(got), next((k for k, v in enumerate(got) if v != k), len(got)))
        assert cancels > 0, "channel %d: no recv was cancelled; the test did not test it" % i
    for p, c in pairs:
        assert p.outstanding() == 0
        p.close()
        c.close()
    print("4 x %d shares in order; cancelled recvs: %s" % (n, [c for _, c in results]))


@test
def a_recv_woken_for_a_share_and_then_cancelled_leaves_it_queued():
    """The race a cancellation can lose a share in: the recv was woken for a
    queued share and is cancelled before it runs. The share stays queued and
    the next recv (here a second one waiting beside it) gets it."""
    p, c = pair()

    async def main():
        first = asyncio.ensure_future(aio.recv(c))
        second = asyncio.ensure_future(aio.recv(c, timeout=5))
        await asyncio.sleep(0.05)  # both wait on the fd
        tshare.send(p, tshare.empty_shared(2), tag="the one")
        c._aio.update()  # the loop's wake-up, made now: it wakes the first recv only
        assert first._fut_waiter is None or first._fut_waiter.done(), "the first recv was not woken"
        first.cancel()
        try:
            await first
            raise AssertionError("the cancelled recv returned")
        except asyncio.CancelledError:
            pass
        r = await second
        assert r is not None and r.tag == "the one", r
        del r, second  # a task keeps its result
        c.poll(0)  # the consumer's release goes out with its next call
        await aio.wait_released(p, timeout=5)
        await expect_error(tshare.E_TIMEOUT, "recv", aio.recv(c, timeout=0))  # it came once

    asyncio.run(main())
    p.close()
    c.close()


@test
def a_share_that_lands_while_the_loop_looks_for_sets_wakes_its_await():
    """The loop's look at a channel asks for a waiting share, then for a
    waiting set; the set look reads what came meanwhile, and a share that
    lands between the two is queued by it. The look must still say a share
    waits, or the await sleeps on an fd that its frame no longer makes
    readable. Thousands of hand-offs from a producer process that waits for
    each release, each awaited for at most 5 s, with the watcher's periodic
    drive off (it would find the share after 100 ms). The same loop without
    awaits (_peek, then poll) stalled in about one run in three on the look
    that asked once."""
    aio._RELEASE_FLUSH_S = 1000.0
    n = 5000
    a, b = tshare.socketpair()
    pid = os.fork()
    if pid == 0:  # the producer: blocking calls only
        code = 1
        try:
            os.close(b)
            p = tshare.open_socket(a, name="producer")
            buf = tshare.empty_shared(8)
            for k in range(n):
                sid = tshare.send(p, buf[k % 8 : k % 8 + 1], tag=str(k), timeout=10)
                p.wait_released(sid, timeout=10)
            p.send_bye(timeout=10)
            p.close()
            code = 0
        finally:
            os._exit(code)
    os.close(a)
    c = tshare.open_socket(b, name="consumer")

    async def main():
        for k in range(n):
            try:
                r = await asyncio.wait_for(aio.recv(c), timeout=5)
            except asyncio.TimeoutError:
                raise AssertionError("hand-off %d of %d: the await slept 5 s with its share already taken off the channel" % (k, n))
            assert r is not None and r.tag == str(k), "hand-off %d came as %r" % (k, r and r.tag)
            del r
        assert await asyncio.wait_for(aio.recv(c), timeout=10) is None  # the bye, after the last release went

    asyncio.run(main())
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the producer failed: status %d" % status
    c.close()


@test
def a_call_that_takes_frames_another_await_waits_for_wakes_it():
    """An await's own call takes frames off the channel that another await
    sleeps for, so the fd says nothing more (on a socket channel): the drain
    after every call wakes that await. The watcher's periodic drive, which
    would find the share too, is set off here so that only the drain can."""
    aio._RELEASE_FLUSH_S = 1000.0
    for transport in ("socket", "ring"):
        p, c = pair(transport=transport)
        sid = tshare.send(c, tshare.empty_shared(1), tag="to the producer")

        async def main():
            sleeper = asyncio.ensure_future(aio.recv(c, timeout=60))
            await asyncio.sleep(0.05)  # it sleeps on c's fd
            r = tshare.recv(p, timeout=5)
            tshare.send(p, tshare.empty_shared(1), tag="for the sleeper")
            del r
            p.poll(0)  # the release of sid follows the share on c
            await aio.wait_released(c, sid, timeout=5)  # its first call takes both, before the loop looks at the fd
            got = await asyncio.wait_for(sleeper, timeout=5)
            assert got.tag == "for the sleeper", "%s: %r" % (transport, got)

        asyncio.run(main())
        p.close()
        c.close()


@test
def three_recvs_on_one_channel_share_the_stream():
    """Three tasks await recv on one channel: each share goes to exactly one."""
    p, c = pair()
    n = 300
    producer = threading.Thread(target=produce, args=(p, n, 3))
    producer.start()

    async def take(into):
        while True:
            r = await aio.recv(c)
            if r is None:
                return
            into.append(int(r.tensor.item()))
            del r

    async def main():
        lists = [[], [], []]
        await asyncio.wait_for(asyncio.gather(*(take(lst) for lst in lists)), timeout=60)
        return lists

    lists = asyncio.run(main())
    producer.join(30)
    everything = sorted(v for lst in lists for v in lst)
    assert everything == list(range(n)), "%d shares received, %d distinct" % (len(everything), len(set(everything)))
    print("shares per task: %s" % [len(lst) for lst in lists])
    p.close()
    c.close()


@test
def a_tensor_dropped_while_every_await_sleeps_is_released():
    """A task drops a received tensor on the loop's thread while the only
    await on the channel sleeps on its fd: the release still reaches the
    producer, which waits for it before it sends again."""
    p, c = pair()
    n = 5

    def producer():
        buf = tshare.empty_shared(n)
        for k in range(n):
            sid = tshare.send(p, buf[k : k + 1], tag=str(k), timeout=10)
            p.wait_released(sid, timeout=10)
        p.send_bye(timeout=10)

    async def drop_later(r):
        await asyncio.sleep(0.05)  # by then the consumer waits for the next share
        del r

    async def main():
        tags, droppers = [], []
        async for r in aio.iterate(c):
            tags.append(r.tag)
            droppers.append(asyncio.ensure_future(drop_later(r)))
            del r
        await asyncio.gather(*droppers)
        return tags

    th = threading.Thread(target=producer)
    th.start()
    tags = asyncio.run(asyncio.wait_for(main(), timeout=30))
    th.join(30)
    assert tags == [str(k) for k in range(n)], tags
    p.close()
    c.close()


@test
def idle_awaits_use_no_cpu():
    """A recv and a wait_released that wait 2 s on a quiet channel sleep on
    the fd: the process uses far less than a busy loop's 2 s of CPU, and
    both end with tshare.TimeoutError."""
    p, c = pair()
    sid = tshare.send(p, tshare.empty_shared(4), tag="held")
    held = tshare.recv(c, timeout=5)  # held all along: no release comes

    async def main():
        before = cpu_seconds()
        results = await asyncio.gather(aio.recv(c, timeout=2), aio.wait_released(p, sid, timeout=2),
                                       return_exceptions=True)
        return cpu_seconds() - before, results

    used, results = asyncio.run(main())
    for r in results:
        assert isinstance(r, tshare.TimeoutError) and r.code == tshare.E_TIMEOUT, "%r" % (r,)
    assert used < 0.3, "two idle awaits of 2 s used %.3f s of CPU" % used
    print("CPU for two idle 2 s awaits: %.4f s" % used)
    del held
    c.poll(0)
    p.wait_released(sid, timeout=5)
    p.close()
    c.close()


@test
def a_send_awaits_room_without_blocking_the_loop():
    """On a full channel an awaited send waits while the loop runs other
    tasks; a cancelled one sent nothing; once the consumer reads, the send
    completes and its share arrives after the others."""
    p, c = pair()
    sent = harness.fill(p)

    async def main():
        t = tshare.empty_shared(1)
        await expect_error(tshare.E_TIMEOUT, "send", aio.send(p, t, tag="timed out", timeout=0.05))
        try:
            await asyncio.wait_for(aio.send(p, t, tag="cancelled"), timeout=0.05)
            raise AssertionError("a send into a full channel completed")
        except asyncio.TimeoutError:
            pass
        assert p.outstanding() == sent, "outstanding %d, sent %d" % (p.outstanding(), sent)
        late = asyncio.ensure_future(aio.send(p, t, tag="late"))
        ticks = 0
        while ticks < 5:  # the loop goes on while the send waits
            await asyncio.sleep(0.01)
            ticks += 1
        assert not late.done(), "the send completed without room"
        tags = []
        while True:
            r = await aio.recv(c, timeout=10)
            tags.append(r.tag)
            del r
            if tags[-1] == "late":
                break
        await asyncio.wait_for(late, timeout=10)
        return tags

    tags = asyncio.run(main())
    assert len(tags) == sent + 1 and "cancelled" not in tags and "timed out" not in tags, tags[-3:]
    c.poll(0)
    p.wait_released(timeout=10)
    p.close()
    c.close()


@test
def close_ends_awaits():
    """close() from a task on the loop, or from another thread, ends the
    awaits on that channel with tshare.Error (closed); other channels on the
    loop go on."""
    p1, c1 = pair()
    p2, c2 = pair()
    p3, c3 = pair()

    async def main():
        recv1 = asyncio.ensure_future(aio.recv(c1))
        released2 = asyncio.ensure_future(aio.wait_released(p2, tshare.send(p2, tshare.empty_shared(1))))
        still = asyncio.ensure_future(aio.recv(c3, timeout=10))
        await asyncio.sleep(0.05)
        c1.close()
        await expect_error(tshare.E_STATE, "closed", asyncio.wait_for(recv1, timeout=5))
        threading.Thread(target=p2.close).start()
        await expect_error(tshare.E_STATE, "closed", asyncio.wait_for(released2, timeout=5))
        tshare.send(p3, tshare.empty_shared(1), tag="goes on")
        r = await still
        assert r.tag == "goes on"

    asyncio.run(main())
    loop = asyncio.new_event_loop()  # a loop closed with an await still pending on c3
    abandoned = loop.create_task(aio.recv(c3))
    loop.run_until_complete(asyncio.sleep(0.05))
    loop.close()
    for ch in (p1, c2, p3, c3):
        ch.close()  # also c3, whose await's loop is gone
    del abandoned


@test
def a_new_channel_on_a_closed_channels_fd_number_wakes_its_awaits():
    """A channel closed with an await pending (from a task on the loop, or
    from another thread) lets go of its fd in the loop: a new channel that
    gets the same fd number wakes its awaits through the fd, not only on the
    100 ms flush timer."""

    async def closed_under_an_await(close):
        """Close a channel an await waits on; then pairs until one end has
        the closed channel's fd number: (that end, its peer, all the pairs)."""
        p, c = pair()
        pending = asyncio.ensure_future(aio.wait_released(p, tshare.send(p, tshare.empty_shared(1))))
        await asyncio.sleep(0.05)
        number = p.fileno()
        close(p)
        pairs = []
        for _ in range(10):  # the old channel may have freed lower numbers too
            pairs.append(pair())
            for a, b in (pairs[-1], pairs[-1][::-1]):
                if b.fileno() == number:
                    return b, a, pairs, pending, c
        raise AssertionError("no new channel got fd %d back" % number)

    async def first_recv_time(consumer, producer, pending):
        """A recv on consumer begins while the closed channel's await is
        still pending, which then ends: the fd stays watched for the recv."""
        got = asyncio.ensure_future(aio.recv(consumer, timeout=5))
        await asyncio.sleep(0.01)  # the recv sleeps on the fd by now
        await expect_error(tshare.E_STATE, "closed", asyncio.wait_for(pending, timeout=5))
        selector = asyncio.get_running_loop()._selector
        assert consumer._aio.fd in selector.get_map(), "the new channel's fd is no longer watched"
        t0 = time.monotonic()
        tshare.send(producer, tshare.empty_shared(1), tag="woken", timeout=5)
        r = await got
        assert r.tag == "woken", r
        return time.monotonic() - t0

    def close_in_a_thread(ch):
        th = threading.Thread(target=ch.close)
        th.start()
        th.join()

    for how, close in (("on the loop", lambda ch: ch.close()), ("from another thread", close_in_a_thread)):

        async def main():
            times = []
            for _ in range(10):
                consumer, producer, pairs, pending, old_peer = await closed_under_an_await(close)
                times.append(await first_recv_time(consumer, producer, pending))
                for a, b in pairs + [(old_peer, old_peer)]:
                    a.close()
                    b.close()
            return times

        times = sorted(asyncio.run(asyncio.wait_for(main(), timeout=60)))
        assert times[7] < 0.05, "closed %s: recvs on the reused fd took %s s" % (
            how, ", ".join("%.3f" % t for t in times))


@test
def a_producer_killed_while_awaited_ends_the_awaits():
    """A producer process SIGKILLed while the consumer's loop awaits: its
    last share comes first, then the recv raises tshare.PeerClosedError;
    another channel's await on the loop goes on."""
    a, b = tshare.socketpair()
    pid = os.fork()
    if pid == 0:
        os.close(b)
        ch = tshare.open_socket(a, name="doomed producer")
        tshare.send(ch, tshare.empty_shared(4), tag="last words")
        ch.poll(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    os.close(a)
    c = tshare.open_socket(b, name="consumer")
    p2, c2 = pair()

    async def main():
        other = asyncio.ensure_future(aio.recv(c2, timeout=10))
        r = await aio.recv(c, timeout=10)
        assert r.tag == "last words", r
        del r
        try:
            await asyncio.wait_for(aio.recv(c), timeout=5)
            raise AssertionError("a recv from a dead producer returned")
        except tshare.PeerClosedError:
            pass
        tshare.send(p2, tshare.empty_shared(1), tag="still here")
        r = await other
        assert r.tag == "still here", r

    asyncio.run(main())
    os.waitpid(pid, 0)
    for ch in (c, p2, c2):
        ch.close()


@test
def bye_ends_iteration_and_awaited_releases_return():
    """An async producer and consumer on one loop: the consumer's
    `async for` ends at the bye, the producer's awaited releases return."""
    p, c = pair()
    n = 50

    async def producer():
        buf = tshare.empty_shared(n)
        for k in range(n):
            sid = await aio.send(p, buf[k : k + 1], tag=str(k))
            if k % 10 == 9:
                await aio.wait_released(p, sid, timeout=10)
        await aio.wait_released(p, timeout=10)
        p.send_bye()

    async def consumer():
        tags = []
        async for r in aio.iterate(c):
            tags.append(r.tag)
            del r
        return tags

    async def main():
        return await asyncio.wait_for(asyncio.gather(producer(), consumer()), timeout=30)

    _, tags = asyncio.run(main())
    assert tags == [str(k) for k in range(n)], tags
    p.close()
    c.close()


if __name__ == "__main__":
    test.main()
