"""Tensor sets from Python: a Mapping[str, Tensor] in one hand-off with
metadata, share_model_, and what a set refuses. One test per argument:

    test_sets.py NAME
"""
import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time

import harness
from harness import expect_error, memfds, pair

import cases
import torch
import tshare
from tshare import _torch, aio

test = harness.Tests("test_sets.py")


def shared_copy(t):
    """t's values in tshare's shared memory, with t's layout."""
    return tshare.share_memory_(t.clone())


def recv_in_thread(c, timeout=30):
    """Receive on c from a thread (a large set fills the socket before the
    sender returns); join() gives the Received."""
    out = {}

    def run():
        try:
            out["r"] = tshare.recv(c, timeout=timeout)
        except BaseException as e:  # reported by join
            out["e"] = e

    th = threading.Thread(target=run)
    th.start()

    def join():
        th.join()
        if "e" in out:
            raise out["e"]
        return out.pop("r")

    return join


def release(p, c, set_id):
    c.poll(0)  # the consumer's releases go out when it drives the channel
    p.wait_released(set_id, timeout=10)
    assert p.is_released(set_id) and p.outstanding() == 0


def numbered_set(n, name_of=lambda i: "t%d" % i):
    """n tensors of 3 float32 each, tensor i holding i, i+1, i+2, all in one buffer."""
    base = tshare.empty_shared(n, 3, dtype=torch.float32)
    base += torch.arange(n, dtype=torch.float32).view(n, 1) + torch.arange(3.0)
    return {name_of(i): base[i] for i in range(n)}


@test
def sets_of_1_290_and_10000_tensors_arrive_in_order_and_go_back_as_one():
    p, c = pair()
    for n in (1, 290, 10000):
        sent = numbered_set(n)
        join = recv_in_thread(c)
        set_id = tshare.send(p, sent, meta=b"n=%d" % n, timeout=30)
        r = join()
        assert r.tensor is None and r.tag == "" and r.share_id == set_id, r
        assert r.meta == b"n=%d" % n
        assert list(r.tensors) == list(sent), "names or order differ"
        for name, t in sent.items():
            assert torch.equal(r.tensors[name], t), name
        # One memory for all n: the consumer maps it once.
        assert r.tensors["t0"].data_ptr() + 12 * (n - 1) == r.tensors["t%d" % (n - 1)].data_ptr()
        keep = r.tensors["t0"]  # one tensor keeps the whole set
        del r
        gc.collect()
        c.poll(0)
        p.poll(0.05)
        assert p.outstanding() == 1, "released while a tensor of it lives"
        del keep
        release(p, c, set_id)
    p.close()
    c.close()


@test
def names_of_1_and_1024_bytes_and_metadata_intact():
    p, c = pair()
    long_name = "é" * 511 + "xy"  # 1024 bytes of UTF-8
    meta = bytes(range(256)) * 9000  # 2.3 MB: many metadata frames
    t = tshare.empty_shared(4)
    t += torch.arange(4.0)
    sent = {"a": t[0], long_name: t, "z": t[1:3]}
    join = recv_in_thread(c)
    set_id = tshare.send(p, sent, meta=meta, timeout=30)
    r = join()
    assert list(r.tensors) == ["a", long_name, "z"] and r.meta == meta
    assert torch.equal(r.tensors[long_name], t) and torch.equal(r.tensors["z"], t[1:3])
    del r
    release(p, c, set_id)
    # str metadata goes as UTF-8; no metadata arrives as b"".
    tshare.send(p, {"x": t}, meta="version ü")
    r = tshare.recv(c, timeout=5)
    assert r.meta == "version ü".encode()
    del r
    sid = tshare.send(p, {"x": t})
    r = tshare.recv(c, timeout=5)
    assert r.meta == b"" and r.share_id == sid
    del r
    release(p, c, sid)


@test
def every_dtype_and_layout_in_one_set():
    p, c = pair()
    bases = {d: shared_copy(cases.base(dtype)) for d, dtype in cases.DTYPES.items()}
    tags = cases.all_tags()
    sent = {}
    for tag in tags:
        dtype_name, layout = tag.split("/")
        sent[tag] = cases.LAYOUTS[layout](bases[dtype_name])
    join = recv_in_thread(c)
    set_id = tshare.send(p, sent, timeout=30)
    r = join()
    assert list(r.tensors) == tags
    for tag in tags:
        why = cases.check(tag, r.tensors[tag])
        assert why is None, why
    # The views of one base came with one memory: their addresses keep their distance.
    got, want = r.tensors["float64/sliced"], sent["float64/sliced"]
    assert got.data_ptr() - r.tensors["float64/contiguous"].data_ptr() == want.data_ptr() - bases["float64"].data_ptr()
    del r, got
    release(p, c, set_id)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter
        self.norm = torch.nn.BatchNorm1d(4)
        self.proj = torch.nn.Linear(4, 4)
        self.alias = torch.nn.Parameter(self.proj.weight.detach()[0])  # another Parameter on proj.weight's storage


@test
def share_model_makes_the_module_own_shared_memory_seen_both_ways():
    torch.manual_seed(0)
    m = Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params = list(m.parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    assert tshare.share_model_(m) is m
    assert list(m.parameters()) == params, "parameters were replaced, not moved in place"
    assert all(tshare.is_shared(t) for t in m.state_dict().values())
    assert m.alias.data_ptr() == m.proj.weight.data_ptr(), "tensors of one storage were separated"
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    p, c = pair()
    set_id = tshare.send(p, m.state_dict(), meta=b"step 0")
    r = tshare.recv(c, timeout=5)
    got = r.tensors
    # A consumer's write lands in the producer's module.
    got["norm.running_mean"].fill_(7)
    got["proj.bias"][1] = -3
    assert torch.equal(m.norm.running_mean, torch.full((4,), 7.0)) and m.proj.bias[1].item() == -3
    # The producer's optimizer step and in-place updates reach the consumer without another send.
    m.proj(torch.ones(2, 4)).sum().backward()
    opt.step()
    with torch.no_grad():
        m.embed.weight.add_(1)
    for k, v in m.state_dict().items():
        assert torch.equal(got[k], v), k
    assert got["embed.weight"].data_ptr() != got["proj.weight"].data_ptr()
    del r, got
    release(p, c, set_id)
    # Sharing again is a no-op: the memory is shared already.
    ptr = m.proj.weight.data_ptr()
    tshare.share_model_(m)
    assert m.proj.weight.data_ptr() == ptr
    tshare.share_model_(m, pack_cuda=True)  # no CUDA tensors: the same
    assert m.proj.weight.data_ptr() == ptr
    expect_error(tshare.E_INVALID_ARG, "torch.nn.Module", tshare.share_model_, {"w": torch.zeros(1)})


class Odd(torch.nn.Module):
    """Storages that a copy through a member's dtype gets wrong: a float view
    of the first 4 of 6 bytes, a conjugate buffer, a view at an offset, bool,
    bf16 and empty ones."""

    def __init__(self):
        super().__init__()
        raw = torch.arange(1, 7, dtype=torch.uint8)
        self.first = torch.nn.Parameter(raw[:4].view(torch.float32), requires_grad=False)
        self.register_buffer("bytes6", raw)
        self.offset = torch.nn.Parameter(torch.arange(10.0)[3:7])
        self.brain = torch.nn.Parameter(torch.arange(4.0).to(torch.bfloat16))
        self.register_buffer("z", torch.tensor([1 + 2j, 3 - 1j]).conj())
        self.register_buffer("flags", torch.tensor([True, False, True]))
        self.register_buffer("empty", torch.empty(0))


@test
def share_model_copies_each_storages_bytes_whatever_its_tensors_read_them_as():
    m = Odd()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    assert m.z.is_conj()
    tshare.share_model_(m)
    for k, v in m.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), (k, v, before[k])
        assert v.numel() == 0 or tshare.is_shared(v), k
    assert m.z.is_conj() and m.first.data_ptr() == m.bytes6.data_ptr(), "one storage became two"
    assert m.offset.requires_grad and m.offset.is_leaf and not m.first.requires_grad


@test
def update_in_place_and_send_again_with_a_new_version():
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    tshare.share_model_(m)
    p, c = pair()
    for version in range(1, 6):
        with torch.no_grad():
            for t in m.parameters():
                t.fill_(version)
        set_id = tshare.send(p, m.state_dict(), meta=b"version %d" % version)
        r = tshare.recv(c, timeout=5)
        assert r.meta == b"version %d" % version
        assert all(bool((t == version).all()) for t in r.tensors.values()), "stale values in version %d" % version
        del r
        release(p, c, set_id)


@test
def private_cpu_tensors_are_refused_with_advice_or_copied_on_request():
    p, c = pair()
    m = torch.nn.Linear(3, 2)
    e = expect_error(tshare.E_UNSUPPORTED, "tshare.share_model_(model)", tshare.send, p, m.state_dict())
    assert "copy=True" in str(e) and "'weight'" in str(e)
    assert not tshare.is_shared(m.weight), "the refused send moved the model's memory"
    # copy=True: a one-off copy; the consumer's writes do not reach the model.
    sid = tshare.send(p, m.state_dict(), copy=True, meta=b"copy")
    r = tshare.recv(c, timeout=5)
    assert torch.equal(r.tensors["weight"], m.weight.detach()) and r.meta == b"copy"
    r.tensors["weight"].fill_(5)
    assert not bool((m.weight == 5).any())
    # A received tensor cannot go in a set (it is not a host buffer of this process) unless copied.
    e = expect_error(tshare.E_UNSUPPORTED, "received tensor", tshare.send, p, {"w": r.tensors["weight"]})
    assert "copy=True" in str(e)
    sid2 = tshare.send(p, {"w": r.tensors["weight"]}, copy=True)
    r2 = tshare.recv(c, timeout=5)
    assert torch.equal(r2.tensors["w"], torch.full((2, 3), 5.0))
    del r, r2, e  # the error's traceback holds the refused tensors too
    c.poll(0)
    p.wait_released(timeout=5)
    assert p.is_released(sid) and p.is_released(sid2)


@test
def bad_sets_get_clear_errors_and_the_channel_stays_usable():
    p, c = pair()
    t = tshare.empty_shared(4)
    E = tshare
    expect_error(E.E_INVALID_ARG, "names must be str", tshare.send, p, {1: t})
    expect_error(E.E_INVALID_ARG, "1 to 1024 bytes", tshare.send, p, {"": t})
    expect_error(E.E_INVALID_ARG, "1 to 1024 bytes", tshare.send, p, {"x" * 1025: t})
    expect_error(E.E_INVALID_ARG, "1 to 1024 bytes", tshare.send, p, {"a\0b": t})
    expect_error(E.E_INVALID_ARG, "not valid UTF-8", tshare.send, p, {"\udc80": t})
    expect_error(E.E_INVALID_ARG, "is empty", tshare.send, p, {})
    expect_error(E.E_INVALID_ARG, "not a torch.Tensor", tshare.send, p, {"x": [1, 2]})
    expect_error(E.E_TOO_LARGE, "metadata of 16777217 bytes", tshare.send, p, {"x": t}, meta=bytes(16 * 1024 * 1024 + 1))
    expect_error(E.E_INVALID_ARG, "meta must be bytes-like", tshare.send, p, {"x": t}, meta=3)
    expect_error(E.E_INVALID_ARG, "metadata travels with tensor sets", tshare.send, p, t, meta=b"x")
    expect_error(E.E_UNSUPPORTED, "sparse", tshare.send, p, {"s": torch.eye(2).to_sparse()})
    expect_error(E.E_UNSUPPORTED, "resolve_conj", tshare.send, p, {"z": shared_copy(torch.ones(2, dtype=torch.complex64)).conj()})
    expect_error(E.E_UNSUPPORTED, "meta tensor", tshare.send, p, {"m": torch.empty(2, device="meta")})
    expect_error(E.E_UNSUPPORTED, "quantized", tshare.send, p,
                 {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)})
    assert p.outstanding() == 0, "a refused set left a share behind"
    # The largest metadata goes, and the channel carries on.
    join = recv_in_thread(c)
    sid = tshare.send(p, {"x": t}, meta=bytes(16 * 1024 * 1024), timeout=60)
    r = join()
    assert len(r.meta) == 16 * 1024 * 1024 and torch.equal(r.tensors["x"], t)
    del r
    release(p, c, sid)


@test
def sets_and_single_shares_arrive_in_the_order_sent():
    p, c = pair()
    t = tshare.empty_shared(3)
    t += torch.arange(3.0)
    ids = [tshare.send(p, t[0], tag="a"), tshare.send(p, {"s1": t}), tshare.send(p, {"s2": t}),
           tshare.send(p, t[1], tag="b"), tshare.send(p, {"s3": t})]
    p.send_bye()
    got = []
    for r in c:
        got.append((r.share_id, r.tag if r.tensor is not None else list(r.tensors)[0]))
        assert r.meta is None if r.tensor is not None else r.meta == b""
        if r.tensor is not None:
            assert r.tensors == {r.tag: r.tensor}
        del r
    assert got == list(zip(ids, ["a", "s1", "s2", "b", "s3"])), got
    c.poll(0)
    p.wait_released(timeout=5)


@test
def a_tensor_of_a_received_set_is_shared_on_as_the_producers_memory():
    p, c = pair()
    p2, c2 = pair()
    t = tshare.empty_shared(3, 4)
    t += torch.arange(12.0).view(3, 4)
    set_id = tshare.send(p, {"a": t, "b": t[1]})
    r = tshare.recv(c, timeout=5)
    tshare.send(p2, r.tensors["b"][1:], tag="on")  # a view of a set's tensor, to a third party
    r2 = tshare.recv(c2, timeout=5)
    r2.tensor.fill_(-1)
    assert torch.equal(t[1], torch.tensor([4.0, -1, -1, -1])), "the third party's write missed the producer"
    del r
    gc.collect()
    c.poll(0)
    p.poll(0.1)
    assert p.outstanding() == 1, "the set was released while shared on"
    del r2
    c2.poll(0)
    p2.wait_released(timeout=5)
    c.poll(0.1)  # the forward's end releases the set
    release(p, c, set_id)


@test
def a_consumer_killed_while_holding_a_set_frees_everything():
    base_fds = memfds()
    a, b = tshare.socketpair()
    pid = os.fork()
    if pid == 0:
        os.close(a)
        ch = tshare.open_socket(b, name="doomed consumer")
        held = [tshare.recv(ch, timeout=10) for _ in range(3)]
        assert all(len(r.tensors) == 290 for r in held)
        os.kill(os.getpid(), signal.SIGKILL)
    os.close(b)
    p = tshare.open_socket(a, name="producer")
    for i in range(3):
        sent = {"t%d" % k: tshare.empty_shared(8) for k in range(290)}  # 290 memories each
        tshare.send(p, sent, meta=b"%d" % i, timeout=10)
        del sent  # only the set holds the memfds now
    os.waitpid(pid, 0)
    p.forget_set()  # the channel keeps the set it sent last, to send again
    harness.expect_all_back_from_dead_peer(p, base_fds, "sets")
    p.close()


@test
def asyncio_sends_and_awaits_sets():
    async def main():
        p, c = pair()
        sent = numbered_set(1000)
        send = asyncio.ensure_future(aio.send(p, sent, meta=b"aio", timeout=30))
        r = await aio.recv(c, timeout=30)
        set_id = await send
        assert r.share_id == set_id and r.meta == b"aio" and list(r.tensors) == list(sent)
        assert torch.equal(r.tensors["t999"], sent["t999"])
        released = asyncio.ensure_future(aio.wait_released(p, set_id, timeout=10))
        await asyncio.sleep(0.05)
        assert not released.done(), "released while the consumer holds the set"
        del r
        gc.collect()
        c.poll(0)
        await released
        assert p.outstanding() == 0
        p.close()
        c.close()

    asyncio.run(main())


@test
def received_sets_as_parameters():
    p, c = pair()
    t = tshare.empty_shared(2, 2)
    i = tshare.empty_shared(2, dtype=torch.int64)
    tshare.send(p, {"w": t, "n": i})
    r = tshare.recv(c, timeout=5, as_parameter=True)
    w, n = r.tensors["w"], r.tensors["n"]
    assert isinstance(w, torch.nn.Parameter) and w.requires_grad
    assert isinstance(n, torch.nn.Parameter) and not n.requires_grad
    del r, w, n
    c.poll(0)
    p.wait_released(timeout=5)


# ---- CUDA tensors in sets: the consumer is another process (an IPC mapping
# of this process's own memory is refused), started fresh (CUDA and fork do
# not mix). Member k of a numbered CUDA set holds 3k, 3k+1, 3k+2.


def need_cuda():
    if not torch.cuda.is_available() or tshare.cuda_device_count() < 1:
        print("SKIP: no CUDA device")
        sys.exit(77)


def cuda_consumer(fd, mode):
    """The consumer process: each set checked against its numbering (one
    line each: "n=N ok" or what is wrong); "write" fills the first tensor
    with -1 before letting go; "hold" keeps the first set until killed;
    "versions": each value is shifted by the version the metadata holds;
    "side": as "versions", received and read on a stream of its own;
    "hold-any": as "hold", whatever the values."""
    ch = tshare.open_socket(fd, name="cuda consumer")
    if mode == "into":
        cuda_consumer_into(ch)
        return
    if mode == "side":
        torch.cuda.set_stream(torch.cuda.Stream())  # every recv and read below runs on it
    for r in ch:
        shift = int(r.meta) if mode in ("versions", "side") else 0
        bad = [name for k, (name, t) in enumerate(r.tensors.items())
               if t.is_cuda and mode != "hold-any" and not torch.equal(t.cpu(), torch.arange(3.0 * k, 3.0 * k + 3) + shift)]
        devices = sorted({str(t.device) for t in r.tensors.values()})
        print("n=%d %s %s" % (len(r.tensors), "ok" if not bad else "bad:" + ",".join(bad[:5]), "+".join(devices)),
              flush=True)
        if mode == "storages":  # one storage per memory of the set: how many allocations it mapped
            print("storages=%d" % len({t.untyped_storage().data_ptr() for t in r.tensors.values()}), flush=True)
        if mode in ("write", "storages"):
            next(iter(r.tensors.values())).fill_(-1)
        if mode in ("hold", "hold-any"):
            time.sleep(60)
        del r
    if mode == "versions":  # the sets whose tensors recv made while it waited, and those handed over
        print("ahead %d %d" % ch._c._ahead_counts, flush=True)
    ch.close()


def cuda_consumer_into(ch):
    """cuda_consumer's "into": each version received into the first one's
    tensors (recv(into=r)), checked as "versions" does, a line each ending
    "into" when it came into them; a write queued on the default stream
    before each release, which the producer's next version must follow."""
    r = first = None
    while True:
        r = ch.recv(timeout=60, into=r) if r is not None else ch.recv(timeout=60)
        if r is None:
            break
        came_into = first is not None and r.tensors is first
        first = first if first is not None else r.tensors
        shift = int(r.meta)
        bad = [name for k, (name, t) in enumerate(r.tensors.items())
               if not torch.equal(t.cpu(), torch.arange(3.0 * k, 3.0 * k + 3) + shift)]
        print("n=%d %s%s" % (len(r.tensors), "ok" if not bad else "bad:" + ",".join(bad[:5]),
                             " into" if came_into else ""), flush=True)
        torch.cuda._sleep(20_000_000)  # the release waits for this, and the producer's next write for the release
        next(iter(r.tensors.values())).add_(0.5)
        r.release()
    ch.close()


def start_cuda_consumer(mode):
    a, b = tshare.socketpair()
    proc = subprocess.Popen([sys.executable, __file__, "--cuda-consumer", str(b), mode], pass_fds=(b,),
                            stdout=subprocess.PIPE, text=True)
    os.close(b)
    return tshare.open_socket(a, name="cuda producer"), proc


def send_cuda_and_expect(p, proc, tensors, want, **kw):
    """Send tensors as a set; the consumer's line must be want; its release comes."""
    set_id = tshare.send(p, tensors, timeout=60, **kw)
    line = proc.stdout.readline().strip()
    assert line == want, line
    p.wait_released(set_id, timeout=30)


def end_cuda_consumer(p, proc):
    p.send_bye()
    assert proc.wait(timeout=30) == 0
    p.close()


def numbered_cuda_set(n):
    base = torch.arange(3.0 * n, device="cuda").view(n, 3)
    return {"t%d" % k: base[k] for k in range(n)}, base


@test
def cuda_each_version_comes_into_the_first_versions_tensors_after_the_consumers_work():
    need_cuda()
    p, proc = start_cuda_consumer("into")
    sent, base = numbered_cuda_set(290)
    for v in range(6):
        send_cuda_and_expect(p, proc, sent, "n=290 ok" + (" into" if v else ""), meta=b"%d" % v)
        with torch.no_grad():  # absolute values: a consumer's add landing after this would show at its next read
            base.copy_(torch.arange(3.0 * 290, device="cuda").view(290, 3) + v + 1)
    end_cuda_consumer(p, proc)


@test
def cuda_sets_of_1_290_and_10000_tensors_round_trip():
    need_cuda()
    p, proc = start_cuda_consumer("check")
    for n in (1, 290, 10000):
        sent, _ = numbered_cuda_set(n)
        send_cuda_and_expect(p, proc, sent, "n=%d ok cuda:0" % n, meta=b"n=%d" % n)
    end_cuda_consumer(p, proc)


@test
def cuda_writes_through_a_received_set_reach_the_producer_and_cpu_rides_along():
    need_cuda()
    p, proc = start_cuda_consumer("write")
    sent, base = numbered_cuda_set(4)
    cpu = tshare.empty_shared(3)
    cpu += torch.arange(3.0)  # a CPU member: checked by the consumer's numbering only on CUDA
    send_cuda_and_expect(p, proc, dict(sent, cpu=cpu), "n=5 ok cpu+cuda:0")
    torch.cuda.synchronize()
    assert torch.equal(base[0].cpu(), torch.full((3,), -1.0)), "the consumer's write missed the producer"
    assert torch.equal(base[1].cpu(), torch.tensor([3.0, 4, 5]))
    end_cuda_consumer(p, proc)


@test
def cuda_a_state_dict_updated_in_place_is_sent_again_from_the_kept_set():
    need_cuda()
    p, proc = start_cuda_consumer("versions")
    first, base = numbered_cuda_set(200)
    second = torch.arange(600.0, 870.0, device="cuda").view(90, 3)  # another allocation
    sent = dict(first, **{"t%d" % (200 + k): second[k] for k in range(90)})
    sent["cpu"] = tshare.empty_shared(3)
    for version in range(6):
        base.copy_(torch.arange(600.0, device="cuda").view(200, 3) + version)  # on the current stream
        second.copy_(torch.arange(600.0, 870.0, device="cuda").view(90, 3) + version)
        send_cuda_and_expect(p, proc, sent, "n=291 ok cpu+cuda:0", meta=b"%d" % version)
    assert p._c._set_cache_counts == (5, 1), p._c._set_cache_counts
    end_cuda_consumer(p, proc)


@test
def cuda_versions_come_as_the_tensors_recv_made_while_it_waited_after_the_producers_stream():
    need_cuda()
    p, proc = start_cuda_consumer("versions")
    sent, base = numbered_cuda_set(290)
    for version in range(10):
        if version in (6, 9):  # the producer's stream busy: the consumer's values must still be this version's
            torch.cuda._sleep(200_000_000)
        base.copy_(torch.arange(870.0, device="cuda").view(290, 3) + version)
        send_cuda_and_expect(p, proc, sent, "n=290 ok cuda:0", meta=b"%d" % version)
        time.sleep(0.02)  # the consumer waits in recv meanwhile, making the next version's tensors
    p.send_bye()
    line = proc.stdout.readline().split()
    assert proc.wait(timeout=30) == 0 and line[0] == "ahead", line
    made, handed = int(line[1]), int(line[2])
    if tshare._sets.AHEAD:  # the consumer runs with this environment and build
        assert 5 <= handed <= 9 and made in (handed, handed + 1), line  # + 1: made while it waited for the bye
    else:
        assert made == handed == 0, line
    p.close()


@test
def cuda_a_set_received_on_a_side_stream_is_read_there_after_the_producers_work():
    need_cuda()
    p, proc = start_cuda_consumer("side")
    sent, base = numbered_cuda_set(290)
    for version in range(1, 7):  # from 1: version 0's values are already there
        torch.cuda._sleep(200_000_000)  # the producer's stream busy: the side stream must wait for it too
        base.copy_(torch.arange(870.0, device="cuda").view(290, 3) + version)
        send_cuda_and_expect(p, proc, sent, "n=290 ok cuda:0", meta=b"%d" % version)
    end_cuda_consumer(p, proc)


class NumberedCuda(torch.nn.Module):
    """n - 1 CUDA parameters and a buffer, member k holding 3k, 3k+1, 3k+2;
    every other one at the start of a 48 MiB block (a caching-allocator
    segment of its own), the others small blocks."""

    def __init__(self, n):
        super().__init__()
        for k in range(n):
            v = torch.empty(3 << 22 if k % 2 else 3, device="cuda")[:3]
            v.copy_(torch.arange(3.0 * k, 3.0 * k + 3))
            if k == n - 1:
                self.register_buffer("b%d" % k, v)
            else:
                setattr(self, "p%d" % k, torch.nn.Parameter(v))


def allocations(module):
    return len({_torch._storage_of(t).data_ptr() for t in module.state_dict().values()})


@test
def cuda_share_model_with_pack_cuda_moves_the_model_into_one_allocation_in_place():
    need_cuda()
    m = NumberedCuda(7)
    params = list(m.parameters())
    assert allocations(m) == 7
    tshare.share_model_(m)  # CUDA tensors stay where they are without pack_cuda
    assert allocations(m) == 7
    p, proc = start_cuda_consumer("storages")
    send_cuda_and_expect(p, proc, m.state_dict(), "n=7 ok cuda:0")
    unpacked = int(proc.stdout.readline().strip().split("=")[1])
    assert unpacked > 1, unpacked
    torch.cuda.synchronize()
    m.p0.data.copy_(torch.arange(3.0))  # the consumer wrote -1 there
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    assert tshare.share_model_(m, pack_cuda=True) is m
    assert list(m.parameters()) == params, "parameters were replaced, not moved in place"
    assert allocations(m) == 1 and m.b6.is_cuda and m.p1.is_cuda
    for k, t in enumerate(m.state_dict().values()):
        assert torch.equal(t.cpu(), torch.arange(3.0 * k, 3.0 * k + 3)), k
    send_cuda_and_expect(p, proc, m.state_dict(), "n=7 ok cuda:0")
    packed = int(proc.stdout.readline().strip().split("=")[1])
    # One allocation, one mapping; expandable segments carry it as runs of the allocator's chunks.
    expandable = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    assert packed == 1 or (expandable and packed <= unpacked), (packed, unpacked)
    print("storages the consumer made: %d unpacked, %d packed" % (unpacked, packed))
    torch.cuda.synchronize()
    assert torch.equal(m.p0.detach().cpu(), torch.full((3,), -1.0)), "the consumer's write missed the module"
    # The packed parameters train in place; packing again moves nothing.
    m.p0.data.copy_(torch.arange(3.0))
    assert m.p0.requires_grad and m.p0.is_leaf
    m.p0.grad = torch.ones(3, device="cuda")
    opt.step()
    assert torch.equal(m.p0.detach().cpu(), torch.arange(3.0) - 1), "the step missed the packed parameter"
    assert torch.equal(m.state_dict()["p0"].cpu(), torch.arange(3.0) - 1)
    ptr = m.p1.data_ptr()
    tshare.share_model_(m, pack_cuda=True)
    assert m.p1.data_ptr() == ptr and allocations(m) == 1
    end_cuda_consumer(p, proc)


@test
def cuda_a_consumer_killed_while_holding_a_set_frees_everything():
    need_cuda()
    p, proc = start_cuda_consumer("hold")
    sent, base = numbered_cuda_set(290)
    set_id = tshare.send(p, sent, timeout=30)
    assert proc.stdout.readline().strip() == "n=290 ok cuda:0"
    assert p.outstanding() == 1
    proc.kill()
    proc.wait()
    p.wait_released(set_id, timeout=30)
    assert p.outstanding() == 0
    p.close()


@test
def cuda_a_sets_memory_lives_while_a_sent_set_or_the_kept_one_holds_it():
    need_cuda()

    def allocated():
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    # Sent again and again from the kept set, each version released: the
    # kept set alone holds the memory once the caller's tensors are gone,
    # until the channel closes.
    p, proc = start_cuda_consumer("check")
    sent, base = numbered_cuda_set(290)
    for version in range(3):
        send_cuda_and_expect(p, proc, sent, "n=290 ok cuda:0", meta=b"%d" % version)
    assert p._c._set_cache_counts == (2, 1), p._c._set_cache_counts
    held = allocated()
    del sent, base
    assert allocated() == held, "the kept set's memory went back to the allocator while it was kept"
    end_cuda_consumer(p, proc)
    assert allocated() < held, "a closed channel left its sets' memory allocated"
    # A set the consumer holds keeps its memory after the kept one lets go,
    # until its release (the consumer killed).
    p, proc = start_cuda_consumer("hold")
    sent, base = numbered_cuda_set(290)
    set_id = tshare.send(p, sent, timeout=30)
    assert proc.stdout.readline().strip() == "n=290 ok cuda:0"
    held = allocated()
    del sent, base
    p.forget_set()
    assert allocated() == held, "a held set's memory went back to the allocator before its release"
    proc.kill()
    proc.wait()
    p.wait_released(set_id, timeout=30)
    p.close()
    assert allocated() < held, "a released set left its memory allocated"


@test
def cuda_a_tensor_pointed_at_other_memory_after_its_send_leaves_the_sent_memory_held():
    need_cuda()
    for how in ("set", "single share"):
        p, proc = start_cuda_consumer("hold-any")
        w = torch.zeros(3 << 20, device="cuda")  # 12 MiB of its own (not a view: a view's base would hold it)
        share_id = tshare.send(p, {"t0": w} if how == "set" else w, timeout=30)
        assert proc.stdout.readline().strip() == "n=1 ok cuda:0"
        gc.collect()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        with torch.no_grad():
            w.set_(torch.zeros(3, device="cuda"))  # the tensor elsewhere now; the consumer still maps the old memory
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() > held, "the %s's memory went back to the allocator while held" % how
        proc.kill()
        proc.wait()
        p.wait_released(share_id, timeout=30)
        p.close()
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() < held, "the released %s's memory stayed allocated" % how


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--cuda-consumer":
        cuda_consumer(int(sys.argv[2]), sys.argv[3])
        sys.exit(0)
    test.main()
