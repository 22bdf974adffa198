"""Tensor sets sent again and received cheaply: a channel keeps the builder
of the set it sent last and sends it again while the same tensors go (a
state_dict updated in place); a consumer makes one torch tensor per memory
of a set and each member a view of it. One test per argument:

    test_set_reuse.py NAME
"""
import collections
import gc
import os
import threading
import time
from collections.abc import Mapping

import harness
from harness import memfds, pair

import numpy
import torch
import tshare
from tshare import _torch

test = harness.Tests("test_set_reuse.py")


def counts(p):
    """(sets sent again from the kept builder, sets built and kept) on p."""
    return p._c._set_cache_counts


def storage_key(t):
    return _torch._raw_storage(t)._cdata


def release(p, c, set_id):
    c.poll(0)  # the consumer's releases go out when it drives the channel
    p.wait_released(set_id, timeout=10)
    assert p.is_released(set_id) and p.outstanding() == 0


def model_of_290():
    """A module whose state_dict is 290 tensors (145 layers' weight and
    bias), in one tshare shared buffer."""
    return tshare.share_model_(torch.nn.Sequential(*[torch.nn.Linear(4, 3) for _ in range(145)]))


def round_trip(p, c, sent, meta):
    """Send sent with meta; the consumer's set has its names, order, values
    and meta; released after."""
    set_id = tshare.send(p, sent, meta=meta, timeout=10)
    r = tshare.recv(c, timeout=10)
    assert r.share_id == set_id and r.meta == meta and list(r.tensors) == list(sent), meta
    for name, t in sent.items():
        got = r.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), (meta, name)
    del r, got
    release(p, c, set_id)


@test
def a_state_dict_of_290_tensors_sent_30_times_is_built_once():
    m = model_of_290()
    p, c = pair()
    for version in range(30):
        with torch.no_grad():
            for k, t in enumerate(m.parameters()):
                t.copy_(torch.arange(float(t.numel())).view(t.shape) * (version + 1) + k)
        sent = m.state_dict()
        set_id = tshare.send(p, sent, meta=b"version %d" % version, timeout=10)
        r = tshare.recv(c, timeout=10)
        assert r.share_id == set_id and r.meta == b"version %d" % version and list(r.tensors) == list(sent)
        for name, t in sent.items():
            assert torch.equal(r.tensors[name], t), (version, name)
        got = list(r.tensors.values())
        # share_model_ put the module in one buffer: one memory, one storage for all 290.
        assert len({storage_key(t) for t in got}) == 1, "a storage per member"
        assert all(_torch._memory_kind_of(t) == "view" for t in got), "not known as received"
        del r, got
        release(p, c, set_id)
    assert counts(p) == (29, 1), counts(p)
    p.close()
    c.close()


@test
def the_kept_set_is_built_anew_when_its_tensors_change():
    m = model_of_290()
    p, c = pair()
    round_trip(p, c, m.state_dict(), b"first")
    round_trip(p, c, m.state_dict(), b"the same tensors")
    assert counts(p) == (1, 1), counts(p)
    w = tshare.empty_shared(3, 4)
    w.fill_(5)
    m[3].weight.data = w  # a parameter reassigned: other memory
    round_trip(p, c, m.state_dict(), b"reassigned")
    assert counts(p) == (1, 2), counts(p)
    round_trip(p, c, m.state_dict(), b"again")
    assert counts(p) == (2, 2), counts(p)
    sd = m.state_dict()
    sd["3.weight"] = sd["3.weight"].view(4, 3)  # same address, another shape
    round_trip(p, c, sd, b"reshaped")
    sd["3.weight"] = sd["3.weight"].t()  # another stride
    round_trip(p, c, sd, b"transposed")
    assert counts(p) == (2, 4), counts(p)
    sd = m.state_dict()
    sd["0.bias"] = sd["1.bias"]  # another tensor at another address
    round_trip(p, c, sd, b"replaced")
    sd["0.bias"] = sd["0.bias"].view(torch.int32)  # same address, another dtype
    round_trip(p, c, sd, b"another dtype")
    reordered = dict(reversed(list(sd.items())))
    round_trip(p, c, reordered, b"reordered")
    assert counts(p) == (2, 7), counts(p)
    round_trip(p, c, reordered, b"only the metadata differs")
    assert counts(p) == (3, 7), counts(p)
    p.forget_set()
    round_trip(p, c, reordered, b"forgotten")
    assert counts(p) == (3, 8), counts(p)
    # A copy is new memory each time: never kept, never sent again.
    private = {"w": torch.ones(3)}
    for _ in range(2):
        sid = tshare.send(p, private, copy=True)
        r = tshare.recv(c, timeout=10)
        assert torch.equal(r.tensors["w"], private["w"])
        del r
        release(p, c, sid)
    assert counts(p) == (3, 8), counts(p)
    p.close()
    c.close()


@test
def the_channel_holds_the_last_sets_memory_until_another_set_or_forget_set():
    base_fds = memfds()
    a, b = tshare.socketpair()
    pid = os.fork()
    if pid == 0:  # the consumer: takes each set and lets it go
        os.close(a)
        ch = tshare.open_socket(b, name="consumer")
        for r in ch:
            del r
        os._exit(0)
    os.close(b)
    p = tshare.open_socket(a, name="producer")

    def send_and_drop(n):
        """A set of n tensors, each its own memfd, that nothing here holds but the channel."""
        sent = {"t%d" % k: tshare.empty_shared(8) for k in range(n)}
        set_id = tshare.send(p, sent, timeout=10)
        del sent
        p.wait_released(set_id, timeout=10)
        gc.collect()

    send_and_drop(5)
    assert memfds() == base_fds + 5, "the channel let go of the set it sent last: %d" % (memfds() - base_fds)
    send_and_drop(3)
    assert memfds() == base_fds + 3, "the set before the last is still held: %d" % (memfds() - base_fds)
    p.forget_set()
    p.poll(0.05)  # the producer's side of a memfd the consumer keeps mapped goes once it is retired
    assert memfds() == base_fds, "forget_set kept memory: %d" % (memfds() - base_fds)
    p.forget_set()  # nothing kept: a no-op
    send_and_drop(2)
    p.send_bye()
    p.close()
    assert memfds() == base_fds, "close kept memory: %d" % (memfds() - base_fds)
    p.forget_set()  # closed: nothing to drop
    _, status = os.waitpid(pid, 0)
    assert status == 0


def odd_set():
    """Members of three memories: views, strides, bool, empty and 0-d
    tensors, and floats at byte offsets that are no multiple of 4."""
    one = tshare.empty_shared(4, 6)
    one += torch.arange(24.0).view(4, 6)
    flags = tshare.empty_shared(10, dtype=torch.bool)
    flags[::3] = True
    raw = tshare.empty_shared(40, dtype=torch.uint8)
    raw += torch.arange(40, dtype=torch.uint8)
    odd = torch.from_numpy(raw.numpy()[1:9].view(numpy.float32))  # 2 floats at byte 1 of raw
    lone = tshare.empty_shared(16, dtype=torch.uint8)
    lone += 7
    floats_at_3 = torch.from_numpy(lone.numpy()[3:15].view(numpy.float32))  # the only members of lone
    return {
        "one": one, "row": one[2], "column": one[:, 3], "transposed": one.t(), "stepped": one[::2, 1::2],
        "expanded": one[1, :1].expand(5), "scalar": one[3, 5], "empty": one[:0],
        "flags": flags, "flags stepped": flags[1::3], "raw": raw, "odd": odd, "int16": raw[2:10].view(torch.int16),
        "floats at 3": floats_at_3[:2], "floats at 7": floats_at_3[1:],
    }


@test
def odd_offsets_bool_and_strided_members_arrive_intact_and_stay_received():
    p, c = pair()
    p2, c2 = pair()
    sent = odd_set()
    set_id = tshare.send(p, sent, meta=b"odd")
    r = tshare.recv(c, timeout=5)
    assert list(r.tensors) == list(sent)
    for name, t in sent.items():
        got = r.tensors[name]
        assert got.dtype == t.dtype and got.shape == t.shape and got.stride() == t.stride(), name
        assert torch.equal(got, t), name
        assert _torch._memory_kind_of(got) == "view", name
    got = r.tensors
    # A memory's members share one storage; a float at byte 1 of raw has its own.
    assert len({storage_key(got[k]) for k in ("one", "row", "transposed", "stepped", "expanded", "scalar")}) == 1
    assert storage_key(got["raw"]) == storage_key(got["int16"]) != storage_key(got["odd"])
    assert got["odd"].data_ptr() == got["raw"].data_ptr() + 1
    # Written through, seen by the producer; shared on alone, the producer's memory.
    got["odd"][1] = 2.5
    got["flags stepped"][0] = True
    assert sent["odd"][1].item() == 2.5 and bool(sent["flags"][1])
    # A memory whose lowest member is at an odd byte: its tensor starts there.
    assert storage_key(got["floats at 3"]) == storage_key(got["floats at 7"]) and got["floats at 3"].data_ptr() % 2
    for name in ("odd", "flags stepped", "stepped", "floats at 7"):
        tshare.send(p2, got[name], tag=name)
        r2 = tshare.recv(c2, timeout=5)
        assert r2.tag == name and torch.equal(r2.tensor, sent[name]), name
        del r2
    c2.poll(0)
    p2.wait_released(timeout=5)
    del r, got
    release(p, c, set_id)


@test
def tensors_kept_from_a_received_set_hold_it_until_the_last_goes():
    p, c = pair()
    sent = odd_set()
    set_id = tshare.send(p, sent)
    r = tshare.recv(c, timeout=5)
    part = r.tensors["row"][1:4]  # a view of a member, on the memory's storage
    odd = r.tensors["odd"]  # a member with a capsule of its own
    assert storage_key(part) == storage_key(r.tensors["one"]) != storage_key(odd)
    kept = [part, odd, r.tensors["flags"]]
    del r, part, odd
    while kept:
        gc.collect()
        c.poll(0)
        p.poll(0.05)
        assert p.outstanding() == 1, "the set went back while %d of its tensors live" % len(kept)
        kept.pop()
    release(p, c, set_id)
    # One release: a second would be a protocol error at the producer's next poll.
    p.poll(0.05)
    round_trip(p, c, {"x": sent["one"]}, b"the channel goes on")
    p.close()
    c.close()


@test
def two_threads_sending_on_one_channel_keep_the_kept_set_whole():
    models = [model_of_290(), model_of_290()]
    for k, m in enumerate(models):
        with torch.no_grad():
            for t in m.parameters():
                t.fill_(k + 1)
    want = [m.state_dict() for m in models]
    p, c = pair()
    each = 15
    errors = []

    def producer(k):
        try:
            for v in range(each):
                tshare.send(p, models[k].state_dict(), meta=b"%d %d" % (k, v), timeout=30)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    def forgetter():
        for _ in range(40):
            p.forget_set()
            time.sleep(0.002)

    threads = [threading.Thread(target=producer, args=(k,)) for k in (0, 1)] + [threading.Thread(target=forgetter)]
    for th in threads:
        th.start()
    for _ in range(2 * each):
        r = tshare.recv(c, timeout=30)
        k = int(r.meta.split()[0])
        assert list(r.tensors) == list(want[k])
        for name, t in r.tensors.items():
            assert torch.equal(t, want[k][name]), (r.meta, name)
        del r, t
        c.poll(0)
    for th in threads:
        th.join()
    assert not errors, errors
    hits, builds = counts(p)
    assert hits + builds == 2 * each and builds >= 2, counts(p)
    c.poll(0)
    p.wait_released(timeout=10)
    assert p.outstanding() == 0
    p.close()
    c.close()


@test
def tensors_of_a_set_stay_on_its_memory_and_each_set_gets_tensors_of_its_own():
    """Set N+1 of the same layout (sent again from the kept set) gives new
    tensor objects, never set N's, and set N's tensors, still held, read set
    N's memory: the consumer's per-member work is per set."""
    for layout in ("one memory", "a memory per member"):
        if layout == "one memory":
            m = model_of_290()
            sd = m.state_dict()
        else:
            sd = {"t%d" % i: tshare.empty_shared(3, 2) for i in range(40)}
        p, c = pair()
        held, ids = [], set()
        for version in range(3):
            with torch.no_grad():
                for t in sd.values():
                    t.fill_(version)
            set_id = tshare.send(p, sd, meta=b"%d" % version, timeout=10)
            r = tshare.recv(c, timeout=10)
            for name, t in r.tensors.items():
                assert id(t) not in ids, (layout, version, name, "a tensor handed out twice")
                assert torch.equal(t, sd[name]), (layout, version, name)
            ids.update(id(t) for t in r.tensors.values())
            held.append(r)
            for old, r_old in enumerate(held[:-1]):
                # The same memory: the producer's fill is seen through every set still held.
                assert all(bool((t == version).all()) for t in r_old.tensors.values()), (layout, old)
                assert all(a is not b for a, b in zip(r_old.tensors.values(), r.tensors.values()))
            assert p.outstanding() == len(held), (layout, p.outstanding())
        assert counts(p) == (2, 1), (layout, counts(p))
        first = held.pop(0)
        kept = next(iter(first.tensors.values()))
        del first
        gc.collect()
        c.poll(0)
        p.poll(0.05)
        assert p.outstanding() == 3, "set 0 went back while one of its tensors lives"
        del kept, r, r_old, t, held[:]
        gc.collect()
        c.poll(0)
        p.wait_released(timeout=10)
        assert p.outstanding() == 0
        p.close()
        c.close()


class Members(Mapping):
    """A Mapping that is not a dict, in an order of its own."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def __getitem__(self, name):
        return dict(self.pairs)[name]

    def __iter__(self):
        return (name for name, _ in self.pairs)

    def __len__(self):
        return len(self.pairs)


@test
def sets_of_any_mapping_go_in_its_own_order_and_bad_members_are_named():
    p, c = pair()
    a, b, z = tshare.empty_shared(2), tshare.empty_shared(3), tshare.empty_shared(4)
    a.fill_(1), b.fill_(2), z.fill_(3)
    ordered = collections.OrderedDict([("a", a), ("b", b), ("z", z)])
    ordered.move_to_end("a")  # OrderedDict's order, not that of the dict beneath
    round_trip(p, c, ordered, b"ordered")
    round_trip(p, c, Members([("z", z), ("a", a)]), b"a Mapping")
    neg = torch._neg_view(tshare.empty_shared(2)) if hasattr(torch, "_neg_view") else None
    bad = [({"a": a, "x": 3}, tshare.E_INVALID_ARG, "'x' is a int"),
           (Members([("a", a), ("n", None)]), tshare.E_INVALID_ARG, "'n' is a NoneType"),
           ({"a": a, 7: b}, tshare.E_INVALID_ARG, "names must be str")]
    if neg is not None:
        bad.append(({"a": a, "neg": neg}, tshare.E_UNSUPPORTED, "resolve_neg"))
    for sent, code, words in bad:
        try:
            tshare.send(p, sent, timeout=10)
        except tshare.Error as e:
            assert e.code == code and words in str(e), (words, e)
        else:
            raise AssertionError("sent: %s" % words)
    round_trip(p, c, ordered, b"the channel goes on")
    p.close()
    c.close()


if __name__ == "__main__":
    test.main()
