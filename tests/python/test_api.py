"""The tshare package's own behaviour, one test per argument:

  test_api.py NAME      (exit 0 pass, 1 fail, 77 skip with the reason)

Two ends of a channel in one process are opened from two threads and then
driven by the test's thread; CUDA tests put the consumer in a child forked
before CUDA starts (a process cannot open its own CUDA IPC handles)."""
import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

try:
    import torch
except ImportError:
    print("SKIP: this Python has no torch (Debian: apt-get install python3-torch)")
    sys.exit(77)

import tshare
from tshare import _torch  # noqa: E402
import harness  # noqa: E402
from harness import expect_error, fill, memfds, pair  # noqa: E402  after the torch check

TESTS = {}


def test(fn):
    TESTS[fn.__name__] = fn
    return fn


@test
def release_once():
    p, c = pair()
    t = tshare.empty_shared(4, 5, dtype=torch.float32)
    t += torch.arange(20.0).view(4, 5)
    sid = tshare.send(p, t, tag="x")
    r = tshare.recv(c, timeout=5)
    assert r.share_id == sid and r.tag == "x" and torch.equal(r.tensor, t)
    v = r.tensor[1:, ::2]  # a view keeps the share
    del r
    gc.collect()
    c.poll(0)
    p.poll(0.05)
    assert p.outstanding() == 1, "released while a view lives"
    del v
    c.poll(0)  # the consumer's driving thread sends its own releases when it drives the channel
    p.wait_released(sid, timeout=5)
    assert p.outstanding() == 0 and p.is_released(sid)
    # A second release of the same share would be a protocol error on the
    # producer's side: the channel goes on working.
    sid2 = tshare.send(p, t[0], tag="again")
    r = tshare.recv(c, timeout=5)
    assert r.share_id == sid2 and torch.equal(r.tensor, t[0])
    del r
    c.poll(0)
    p.wait_released(timeout=5)
    # Iterating the channel keeps no reference of its own: del in the loop
    # body releases at once.
    for i in range(3):
        tshare.send(p, t[i], tag=str(i))
    n = 0
    for r in c:  # (not enumerate(c): its cached result tuple would hold r)
        del r
        c.poll(0)
        deadline = time.monotonic() + 5  # a loaded machine may take a while to carry the release
        while p.outstanding() > 2 - n and time.monotonic() < deadline:
            p.poll(0.01)
        assert p.outstanding() == 2 - n, "iteration %d: %d outstanding" % (n, p.outstanding())
        if n == 2:
            break
        n += 1
    p.close()
    assert tshare.recv(c, timeout=5) is None, "a closed producer ends the stream"
    c.close()


@test
def release_from_another_thread():
    p, c = pair()
    t = tshare.empty_shared(1000, dtype=torch.int64)
    ids = [tshare.send(p, t[i * 10:(i + 1) * 10], tag=str(i)) for i in range(50)]
    got = [tshare.recv(c, timeout=5) for _ in ids]
    holder = [got]
    del got

    def drop():
        holder.clear()  # the tensors die here, on this thread

    th = threading.Thread(target=drop)
    th.start()
    th.join()
    gc.collect()
    c.poll(0)
    p.wait_released(timeout=5)
    assert p.outstanding() == 0
    p.close()
    c.close()


@test
def release_after_the_producer_died():
    a, b = tshare.socketpair()
    pid = os.fork()
    if pid == 0:
        os.close(b)
        ch = tshare.open_socket(a, name="doomed producer")
        t = tshare.empty_shared(256, dtype=torch.float64)
        t += 7.0
        tshare.send(ch, t, tag="last words")
        ch.poll(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    os.close(a)
    c = tshare.open_socket(b, name="consumer")
    r = tshare.recv(c, timeout=10)
    os.waitpid(pid, 0)
    assert r.tensor.sum().item() == 7.0 * 256, "the memory outlives its producer"
    del r  # releasing into a dead channel: no crash, no error
    gc.collect()
    e = expect_error(tshare.E_PEER_CLOSED, "", tshare.recv, c, timeout=5)
    assert isinstance(e, tshare.PeerClosedError) and isinstance(e, ConnectionError)
    c.close()


@test
def refusals_name_what_to_do():
    p, c = pair()
    E = tshare
    expect_error(E.E_UNSUPPORTED, "sparse", tshare.send, p, torch.eye(3).to_sparse())
    expect_error(E.E_UNSUPPORTED, "quantized", tshare.send, p, torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8))
    expect_error(E.E_UNSUPPORTED, "meta", tshare.send, p, torch.empty(2, device="meta"))
    expect_error(E.E_UNSUPPORTED, "resolve_conj", tshare.send, p, torch.ones(2, dtype=torch.complex64).conj())
    if hasattr(torch, "_neg_view"):
        expect_error(E.E_UNSUPPORTED, "resolve_neg", tshare.send, p, torch._neg_view(torch.ones(2, dtype=torch.complex64)))
    expect_error(E.E_UNSUPPORTED, "has no DLPack code", tshare.send, p, torch.zeros(2, dtype=torch.complex32))
    expect_error(E.E_TOO_LARGE, "dimensions", tshare.send, p, torch.zeros([1] * 33))
    expect_error(E.E_TOO_LARGE, "tag of 65 bytes", tshare.send, p, tshare.empty_shared(1), tag="x" * 65)
    expect_error(E.E_UNSUPPORTED, "not in shared memory", tshare.send, p, torch.ones(3), move_to_shared_memory=False)
    expect_error(E.E_INVALID_ARG, "expected a torch.Tensor", tshare.send, p, [1, 2])
    expect_error(E.E_INVALID_ARG, "negative size", tshare.empty_shared, 2, -1)
    # Nothing was sent, and the channel still works.
    assert p.outstanding() == 0
    sid = tshare.send(p, torch.arange(3), tag="fine")
    r = tshare.recv(c, timeout=5)
    assert r.share_id == sid and r.tensor.tolist() == [0, 1, 2]
    del r
    c.poll(0)
    p.wait_released(timeout=5)
    p.close()
    c.close()


@test
def errors_carry_status_and_message():
    p, c = pair()
    e = expect_error(tshare.E_TIMEOUT, "recv", tshare.recv, c, timeout=0.05)
    assert isinstance(e, tshare.TimeoutError) and isinstance(e, TimeoutError) and e.status == "TSHARE_E_TIMEOUT"
    p.close()
    expect_error(tshare.E_STATE, "closed", tshare.send, p, torch.ones(1))
    assert repr(p) == "<tshare.Channel closed>"
    c.close()
    e = expect_error(tshare.E_NOT_FOUND, "connect to", tshare.connect, "tshare-test-nobody-%d" % os.getpid(), timeout=0.1)
    assert tshare.E_NOT_FOUND < 0 and tshare.OK == 0


@test
def shared_memory_tensors():
    t = tshare.empty_shared((2, 3), dtype=torch.float64)
    assert t.shape == (2, 3) and t.dtype == torch.float64 and not t.any() and tshare.is_shared(t)
    assert tshare.is_shared(t.t()[1:]), "views of shared memory are shared"
    b = tshare.empty_shared(5, dtype=torch.bool)
    assert b.dtype == torch.bool and tshare.is_shared(b)
    plain = torch.arange(12, dtype=torch.int32).view(3, 4)[:, 1:]
    assert not tshare.is_shared(plain)
    before = plain.clone()
    assert tshare.share_memory_(plain) is plain and tshare.is_shared(plain) and torch.equal(plain, before)
    assert plain.stride() == (4, 1) and plain.storage_offset() == 1
    p, c = pair()
    sid = tshare.send(p, plain, move_to_shared_memory=False, tag="in place")
    r = tshare.recv(c, timeout=5)
    r.tensor.mul_(10)  # the consumer writes: the producer sees it
    assert torch.equal(plain, before * 10)
    del r
    c.poll(0)
    p.wait_released(sid, timeout=5)
    p.close()
    c.close()


@test
def shared_memory_under_another_storage_is_sent_as_itself():
    t = tshare.empty_shared(16, dtype=torch.float32)
    alias = torch.from_numpy(t.numpy())[4:]  # the same memory under a storage torch made for the array
    assert tshare.is_shared(alias), "found by its address, not its storage"
    p, c = pair()
    sid = tshare.send(p, alias, move_to_shared_memory=False)
    r = tshare.recv(c, timeout=5)
    r.tensor.fill_(7)  # the consumer writes: the producer's buffer sees it, no copy went
    assert torch.equal(t[4:], torch.full((12,), 7.0)) and not t[:4].any()
    del r
    c.poll(0)
    p.wait_released(sid, timeout=5)
    p.close()
    c.close()


@test
def consumer_killed_mid_stream_frees_the_producers_memory():
    base_fds = memfds()
    a, b = tshare.socketpair()
    pid = os.fork()
    if pid == 0:
        os.close(a)
        ch = tshare.open_socket(b, name="doomed consumer")
        held = []
        while True:
            r = tshare.recv(ch, timeout=10)
            held.append(r)  # holds everything, then dies holding it
            if len(held) == 20:
                os.kill(os.getpid(), signal.SIGKILL)
    os.close(b)
    p = tshare.open_socket(a, name="producer")
    for i in range(40):
        t = tshare.empty_shared(1 << 16, dtype=torch.uint8)
        try:
            tshare.send(p, t, tag=str(i), timeout=5)
        except tshare.PeerClosedError:  # the consumer died first (a loaded machine): t went nowhere
            break
        finally:
            del t  # only the share holds the memfd now; a tensor kept here would keep its memfd open
    os.waitpid(pid, 0)
    harness.expect_all_back_from_dead_peer(p, base_fds, "shares")
    p.close()


@test
def rendezvous_and_reprs():
    name = "tshare-pytest-%d" % os.getpid()
    with tshare.listen(name) as l:
        assert name in repr(l) and l.path.endswith(name)
        out = {}
        th = threading.Thread(target=lambda: out.setdefault("c", tshare.connect(name, timeout=5, channel_name="client")))
        th.start()
        s = l.accept(timeout=5, name="server")
        th.join()
        with s, out["c"] as c:
            assert "'client'" in repr(s) and "over ring" in repr(s), repr(s)
            assert c.peer_name == "server" and s.peer_pid == os.getpid()
            sid = s.send(tshare.empty_shared(3, dtype=torch.int16))
            r = c.recv(timeout=5)
            assert r.share_id == sid and "share_id=%d" % sid in repr(r)
            del r
            c.poll(0)
            s.wait_released(timeout=5)
        assert s.closed and c.closed
    assert tshare.role() is None, "not started by tshare-launch"
    p, c = pair(transport="socket")
    assert p.transport == "socket" and c.transport == "socket"
    assert not p.receives_copies and not c.receives_copies  # the producer's memory, mapped
    p.close()
    c.close()


def in_thread(fn, *args, **kw):
    """Run fn on a new thread; the returned dict gets "result" or "error"."""
    out = {}

    def run():
        try:
            out["result"] = fn(*args, **kw)
        except BaseException as e:  # noqa: B902  handed to the test thread
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    out["thread"] = th
    return out


def joined(out, what):
    out["thread"].join(10)
    assert not out["thread"].is_alive(), "%s still waits 10 s after the channel was closed" % what
    return out.get("error")


@test
def close_while_another_thread_waits():
    """close() from one thread while another waits inside recv, wait_released
    or poll (timeout None): the waiter gets tshare.Error naming the close, the
    process does not crash, and the channel's memory is freed only after."""
    waits = {
        "recv": lambda p, c: tshare.recv(c),
        "poll": lambda p, c: c.poll(None),
        "wait_released": lambda p, c: p.wait_released(timeout=None),
    }
    for attempt in range(3):
        for what, wait in waits.items():
            p, c = pair()
            r = None
            if what == "wait_released":  # a share the consumer holds: the wait cannot end by itself
                tshare.send(p, tshare.empty_shared(4), tag="held")
                r = tshare.recv(c, timeout=5)
            closing = p if what == "wait_released" else c
            out = in_thread(wait, p, c)
            time.sleep(0.05 * attempt)  # closes before, as and after the waiter enters its wait
            closing.close()
            e = joined(out, what)
            assert isinstance(e, tshare.Error), "%s: %r instead of tshare.Error" % (what, e if e else out.get("result"))
            assert e.code == tshare.E_STATE and "closed" in str(e), "%s: %s" % (what, e)
            assert closing.closed
            del r
            p.close()
            c.close()


@test
def eight_threads_send_on_one_channel():
    """8 threads share on one channel while a ninth waits in recv on it: every
    share id is distinct, the consumer gets each once, all are released and
    outstanding() comes back to 0. close() ends the waiting recv."""
    senders, per_thread = 8, 200
    p, c = pair()
    t = tshare.empty_shared(senders * per_thread, dtype=torch.int64)
    t += torch.arange(senders * per_thread)
    got = []

    def consume():
        for _ in range(senders * per_thread):
            r = tshare.recv(c, timeout=30)
            assert r.tensor.item() == int(r.tag), "share %d: %s, tagged %s" % (r.share_id, r.tensor, r.tag)
            got.append(r.share_id)
            del r
        c.poll(0)  # the last releases go out

    consumer = in_thread(consume)
    waiter = in_thread(tshare.recv, p)  # nothing comes this way: it waits throughout
    sent = [[] for _ in range(senders)]

    def send(k):
        for i in range(k * per_thread, (k + 1) * per_thread):
            sent[k].append(tshare.send(p, t[i], tag=str(i), timeout=30))

    threads = [in_thread(send, k) for k in range(senders)]
    for th in threads:
        assert joined(th, "a sender") is None, th.get("error")
    assert joined(consumer, "the consumer") is None, consumer.get("error")
    ids = [i for s in sent for i in s]
    assert len(set(ids)) == len(ids), "%d duplicate share ids" % (len(ids) - len(set(ids)))
    assert sorted(got) == sorted(ids), "received ids differ from the sent ones"
    p.wait_released(timeout=30)
    assert p.outstanding() == 0, "%d shares outstanding after every release" % p.outstanding()
    p.close()
    assert isinstance(joined(waiter, "recv"), tshare.Error)
    c.close()


@test
def a_call_from_inside_the_channels_own_work_is_refused():
    """Python code run from inside a call on a channel (here a finalizer of
    the storage a share kept, run as its release is applied) that calls the
    same channel gets tshare.Error instead of waiting for itself forever."""
    a, b = pair()
    tshare.send(a, tshare.empty_shared(8), tag="to forward")
    r = tshare.recv(b, timeout=5)
    fwd, c = pair()
    with held_storages() as held:
        tshare.send(fwd, r.tensor[1:], tag="part")  # the share holds its storage until c releases it
    seen = []
    weakref.finalize(held.pop(), lambda: seen.append(call_capturing(fwd.outstanding)))
    got = tshare.recv(c, timeout=5)
    del got
    c.poll(0)
    fwd.wait_released(timeout=5)  # applies the release: part dies inside this call
    assert len(seen) == 1, "the finalizer did not run"
    e = seen[0]
    assert isinstance(e, tshare.Error) and e.code == tshare.E_STATE and "already inside" in str(e), e
    assert fwd.outstanding() == 0, "the channel works after the refusal"
    del r
    b.poll(0)
    a.wait_released(timeout=5)
    for ch in (a, b, fwd, c):
        ch.close()


class HeldStorage:
    """Stands in for a tensor's storage in a send: what a share holds until
    its release, so that a test sees when the share lets go of it."""

    def __init__(self, storage):
        self.storage, self._cdata = storage, storage._cdata

    def data_ptr(self):
        return self.storage.data_ptr()


@contextlib.contextmanager
def held_storages():
    """Sends inside the block hand their shares a HeldStorage each, listed in
    what it yields (none stays in the list: the test takes them out)."""
    real, made = _torch._raw_storage_of, []

    def standing_in(t):
        made.append(HeldStorage(real(t)))
        return made[-1]

    _torch._raw_storage_of = standing_in
    try:
        yield made
    finally:
        _torch._raw_storage_of = real


def call_capturing(fn):
    try:
        return fn()
    except Exception as e:  # noqa: B902  the test looks at it
        return e


def interrupted_by_sigint(what, fn, *args, **kw):
    """fn (a call that waits forever) raises KeyboardInterrupt when SIGINT
    arrives from another thread; a watchdog ends the process if it does not."""
    watchdog = threading.Timer(20, lambda: (print("FAIL: %s was not interrupted by SIGINT in 20 s" % what, flush=True),
                                            os._exit(1)))
    watchdog.start()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        fn(*args, **kw)
        raise AssertionError("%s returned instead of waiting" % what)
    except KeyboardInterrupt:
        pass
    finally:
        watchdog.cancel()
    took = time.monotonic() - t0
    assert took < 5, "%s took %.1f s to see SIGINT" % (what, took)
    print("%s interrupted %.0f ms after it started" % (what, took * 1000))


@test
def ctrl_c_interrupts_waits():
    p, c = pair()
    interrupted_by_sigint("recv", tshare.recv, c)
    interrupted_by_sigint("poll", c.poll, None)
    tshare.send(p, tshare.empty_shared(4), tag="held")
    r = tshare.recv(c, timeout=5)
    interrupted_by_sigint("wait_released", p.wait_released, timeout=None)
    # The channel still works after the interruptions.
    del r
    c.poll(0)
    p.wait_released(timeout=5)
    p.close()
    assert tshare.recv(c, timeout=5) is None
    c.close()
    with tshare.listen("tshare-pytest-sigint-%d" % os.getpid()) as l:
        interrupted_by_sigint("accept", l.accept)
    p, c = pair()
    sent = fill(p)
    interrupted_by_sigint("send waiting for room", tshare.send, p, tshare.empty_shared(4))
    assert p.outstanding() == sent, "the interrupted send left a share behind"
    p.close()
    c.close()


def a_long_set_send(p):
    """A thread inside one long C call on p: a set send of 10,000 tensors to
    a consumer that does not read, waiting for room until p's peer closes."""
    big = tshare.empty_shared(10000 * 4, dtype=torch.float32)
    sd = {"m%05d_%s" % (i, "x" * 200): big[i * 4:(i + 1) * 4] for i in range(10000)}
    out = in_thread(tshare.send, p, sd, timeout=30)
    time.sleep(0.3)  # inside its send by now: the ring and the socket fill in microseconds
    assert "thread" in out and out["thread"].is_alive() and not out.get("error"), out
    return out


@test
def a_call_waiting_behind_another_threads_long_call_times_out_and_sees_ctrl_c():
    """Calls waiting for their turn on a channel another thread's set send
    holds: each gives up after its own timeout (a timeout that answers,
    poll's, answers), Ctrl-C ends one that waits with no timeout, a fan-out
    reports that channel alone as timed out and sends to the others, and
    the channel goes on once the long call ends."""
    p, c = pair()
    out = a_long_set_send(p)
    for what, call, answer in (
        ("wait_released", lambda: p.wait_released(timeout=0.3), None),
        ("recv", lambda: tshare.recv(p, timeout=0.3), None),
        ("send", lambda: tshare.send(p, tshare.empty_shared(4), timeout=0.3), None),
        ("a set's send", lambda: tshare.send(p, {"a": tshare.empty_shared(4)}, timeout=0.3), None),
        ("poll", lambda: p.poll(0.3), False),
        ("recv without time to wait", lambda: tshare.recv(p, timeout=0), None),
    ):
        t0 = time.monotonic()
        got = call_capturing(call)
        took = time.monotonic() - t0
        assert took < 2, "%s waited %.1f s for the other thread's call" % (what, took)
        if answer is not None:
            assert got is answer, "%s: %r" % (what, got)
            continue
        assert isinstance(got, tshare.TimeoutError), "%s: %r" % (what, got)
        if what != "recv without time to wait":
            assert took >= 0.25, "%s gave up after %.2f s of its 0.3 s" % (what, took)
        assert "its turn" in str(got) and "another thread" in str(got), "%s: %s" % (what, got)
    # A loop that polls without waiting gives up a place in the line every
    # time: as many as it likes (the line keeps them all).
    for i in range(80):
        t0 = time.monotonic()
        assert p.poll(0) is False and time.monotonic() - t0 < 1, "poll %d behind the long call" % i
    interrupted_by_sigint("outstanding", p.outstanding)
    interrupted_by_sigint("repr", repr, p)  # the interrupt goes on, never taken for a closed channel
    interrupted_by_sigint("last_error", lambda: p._c.last_error)
    q, d = pair()
    results = tshare.send_all([q, p], {"w": tshare.empty_shared(4)}, timeout=0.5, wait=False)
    by = {id(r.channel): r for r in results}
    assert by[id(q)].ok and by[id(q)].id > 0, results
    assert isinstance(by[id(p)].error, tshare.TimeoutError) and "its turn" in str(by[id(p)].error), results
    r = tshare.recv(d, timeout=5)
    assert list(r.tensors) == ["w"]
    del r
    c.close()  # the long send sees its peer gone and ends
    e = joined(out, "the long set send")
    assert isinstance(e, tshare.Error), repr(e)
    assert p.outstanding() >= 0  # the channel takes calls again
    q.close()
    d.close()
    p.close()


@test
def open_socket_with_refused_options_closes_its_fd():
    # open_socket owns its fd also on failure: a refusal of its options leaks nothing.
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        a, b = tshare.socketpair()
        os.close(b)
        try:
            tshare.open_socket(a, transport="bogus")
            raise AssertionError("transport 'bogus' was taken")
        except tshare.Error as e:
            assert e.code == tshare.E_INVALID_ARG, e
    left = len(os.listdir("/proc/self/fd")) - before
    assert left == 0, "%d fds left open by refused opens" % left
    print("open_socket_with_refused_options_closes_its_fd: ok")


@test
def a_send_that_times_out_keeps_nothing():
    """A send waits for room in slices, each a try of its own: when it times
    out, nothing was sent and the tensor it was given is not held."""
    p, c = pair()
    tshare.send(p, tshare.empty_shared(8), tag="forward me")
    r = tshare.recv(c, timeout=5)
    q, d = pair()
    sent = fill(q)
    refs = sys.getrefcount(r.tensor)
    with held_storages() as held:
        expect_error(tshare.E_TIMEOUT, "send", tshare.send, q, r.tensor, timeout=0.2)
    kept = [weakref.ref(h) for h in held]
    del held
    assert kept and all(k() is None for k in kept), "a timed-out send kept what it was given"
    assert sys.getrefcount(r.tensor) == refs, "references %d, before %d" % (sys.getrefcount(r.tensor), refs)
    assert q.outstanding() == sent
    del r
    c.poll(0)
    p.wait_released(timeout=5)
    for ch in (p, c, q, d):
        ch.close()


@test
def cuda_writes_are_seen_and_memory_returns():
    """The consumer (another process) adds 1 on its stream; the producer sees
    it after the release, and its CUDA memory is back once the tensor is gone
    (at once with expandable segments, within 0.1 s of idling otherwise)."""
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device here")
        sys.exit(77)
    a, b = tshare.socketpair()
    child = subprocess.Popen([sys.executable, __file__, "_cuda_consumer", str(b)], pass_fds=[b])
    os.close(b)
    ch = tshare.open_socket(a, name="cuda producer")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    sid = tshare.send(ch, t, tag="add one")
    ch.wait_released(sid, timeout=30)
    assert t[:10].tolist() == [float(i + 1) for i in range(10)], t[:10]
    del t
    torch.cuda.synchronize()
    # The default allocator's segment stays held while the consumer keeps it
    # mapped for the next share: it goes once idle for 0.1 s and the consumer
    # closed its mapping, as long as this end drives the channel.
    t0 = time.monotonic()
    while torch.cuda.memory_allocated() != before and time.monotonic() - t0 < 5:
        ch.poll(0.01)
    print("memory back to its baseline %.0f ms after the release" % ((time.monotonic() - t0) * 1000))
    assert torch.cuda.memory_allocated() == before, (torch.cuda.memory_allocated(), before)
    ch.close()
    assert child.wait(timeout=30) == 0


def _cuda_consumer(fd):
    with tshare.open_socket(int(fd), name="cuda consumer") as ch:
        for r in ch:
            assert r.tensor.is_cuda and r.tensor.shape == (1 << 20,)
            assert r.tensor[:10].tolist() == list(range(10)), r.tensor[:10]
            r.tensor.add_(1)  # on the current stream; the release waits for it
            del r


if __name__ == "__main__":
    name = sys.argv[1]
    if name == "_cuda_consumer":
        _cuda_consumer(sys.argv[2])
        sys.exit(0)
    TESTS[name]()
    print("%s: ok (DLPack %s capsules, torch %s)" % (name, tshare.DLPACK_CAPSULE, torch.__version__))
