"""tshare._torch_native: a set's members read and a received set's tensors
made in C++. It must give what the Python path gives, be used where the build
made it, and refuse a place outside its memory. One test per argument:

    test_torch_native.py NAME

TSHARE_EXPECT_TORCH_NATIVE=1 (set by the build where it built the module)
makes its absence from the build tree's package a failure, not a skip (a
pip-installed tshare, TSHARE_TEST_PYTHON, is built without it).
"""
import os
import sys

import harness
from harness import pair

import torch
import tshare
from tshare import _sets, _torch, _tshare
from test_set_reuse import odd_set

test = harness.Tests("test_torch_native.py")


def native():
    """The module, or exit 77 saying why there is none."""
    if _sets._native is None:
        build_tree = not os.environ.get("TSHARE_TEST_PYTHON")  # not a pip-installed tshare (tests/packaging/python.in)
        if build_tree and os.environ.get("TSHARE_EXPECT_TORCH_NATIVE") == "1" and os.environ.get("TSHARE_TORCH_NATIVE") != "0":
            raise AssertionError("the build made tshare._torch_native, but tshare does not use it")
        print("SKIP: tshare._torch_native was not built for this torch (python/CMakeLists.txt says why)")
        sys.exit(77)
    return _sets._native


@test
def the_module_is_used_where_it_was_built():
    m = native()
    assert m.torch_version == torch.__version__.split("+")[0][: len(m.torch_version)]


@test
def members_read_in_cpp_equal_what_torchs_methods_read():
    m = native()
    base = torch.arange(24.0).view(4, 6)
    members = dict(odd_set())
    members.update({
        "transposed": base.t(), "offset": base[1:, 2:], "scalar": base[0, 0], "empty": base[:0],
        "parameter": torch.nn.Parameter(torch.ones(3)), "complex": torch.ones(2, dtype=torch.complex64),
        "conj": torch.ones(2, dtype=torch.complex64).conj(),
    })
    if hasattr(torch, "_neg_view"):
        members["neg"] = torch._neg_view(torch.ones(2))
    got = m.set_items(list(members.items()), _sets._PLAIN)
    want = _tshare._set_items(members, _sets._COMPLEX)
    assert len(got) == len(want) == len(members)
    for g, w in zip(got, want):
        assert g[0] == w[0] and g[1] == w[1] and g[2] is w[2], (g, w)
        assert tuple(g[3]) == tuple(w[3]) and tuple(g[4]) == tuple(w[4]) and g[5] == w[5], (g, w)
    assert got == want  # what the kept-set check compares

    class Sub(torch.Tensor):
        pass

    # Anything but a plain tensor is left to the Python methods.
    assert m.set_items([("a", base), ("s", base.as_subclass(Sub))], _sets._PLAIN) is None
    assert m.set_items([("a", base), ("n", None)], _sets._PLAIN) is None
    assert m.set_items([("a", base), ("x", 3)], _sets._PLAIN) is None


@test
def cuda_fields_read_in_cpp_equal_what_torchs_methods_read():
    """set_items_cuda: set_items' items and, for each CUDA member, the fields
    _with_cuda reads through torch's methods; CPU members get none."""
    m = native()
    cpu = {"w": tshare.empty_shared(4, 6), "b": tshare.empty_shared(6)}
    pairs = list(cpu.items())
    assert m.set_items_cuda(pairs, _sets._PLAIN) == (m.set_items(pairs, _sets._PLAIN), -1)
    assert m.set_items_cuda([("s", torch.ones(2).as_subclass(type("Sub", (torch.Tensor,), {})))], _sets._PLAIN) is None
    if not torch.cuda.is_available():
        print("no CUDA device: the CPU half only")
        return
    base = torch.arange(24.0, device="cuda").view(4, 6)
    members = dict(cpu, cw=base, crow=base[1], ccol=base[:, 2], empty=torch.empty(0, device="cuda"))
    pairs = list(members.items())
    items, device = m.set_items_cuda(pairs, _sets._PLAIN)
    assert device == torch.cuda.current_device(), device
    want = _sets._with_cuda(m.set_items(pairs, _sets._PLAIN), members)
    assert len(items) == len(want)
    for (name, t), got, w in zip(pairs, items, want):
        assert got[:6] == w[:6], (name, got, w)
        assert len(got) == len(w) == (7 if t.is_cuda else 6), (name, got, w)
        if t.is_cuda:
            assert got[6][0] == w[6][0] and got[6][1] == w[6][1] and got[6][3] == w[6][3], (name, got[6], w[6])
            # What holds the memory: the storage (a hold of it in C++; torch's storage object in Python).
            assert type(got[6][2]).__name__ == "PyCapsule" and w[6][2].data_ptr() == w[6][1], (name, got[6], w[6])


@test
def the_kept_sets_key_changes_with_every_field_the_items_hold():
    m = native()
    base = tshare.empty_shared(4, 6)
    base += torch.arange(24.0).view(4, 6)
    key = lambda pairs: m.set_key(pairs, _sets._PLAIN)
    same = [("w", base), ("b", base[0])]
    assert key(same) == key([("w", base), ("b", base[0])])  # new view objects, same fields
    changed = [
        [("v", base), ("b", base[0])],  # a name
        [("w", base), ("b", base[1])],  # an address
        [("w", base.view(torch.int32)), ("b", base[0])],  # a dtype
        [("w", base.view(6, 4)), ("b", base[0])],  # a shape
        [("w", base.t()), ("b", base[0])],  # strides (and shape)
        [("w", base.view(2, 12)[:, :6]), ("b", base[0])],  # strides only
        [("w", base), ("b", base[0]), ("c", base[1])],  # a member more
        [("b", base[0]), ("w", base)],  # the order
    ]
    if hasattr(torch, "_neg_view"):
        changed.append([("w", torch._neg_view(base)), ("b", base[0])])  # the lazy bit
    keys = [key(c) for c in changed]
    assert key(same) not in keys and len(set(keys)) == len(keys)
    assert key([("w", base), (7, base)]) is None  # left to the items, which name the error
    p, c = pair()
    sd = {"w": base, "b": base[0]}
    for _ in range(3):
        tshare.send(p, sd, timeout=5)
        r = tshare.recv(c, timeout=5)
        assert list(r.tensors) == ["w", "b"]
        del r
        c.poll(0)
        p.wait_released(timeout=5)
    assert p._c._set_cache_counts == (2, 1)  # built once, sent again twice on its key
    sd["b"] = base[1]
    tshare.send(p, sd, timeout=5)
    r = tshare.recv(c, timeout=5)
    assert torch.equal(r.tensors["b"], base[1]) and not torch.equal(base[0], base[1])
    assert p._c._set_cache_counts == (2, 2)


@test
def a_set_made_in_cpp_equals_the_one_made_in_python():
    native()
    p, c = pair()
    sent = odd_set()
    received = []
    for way in (_sets._native, None):
        _sets._native = way
        set_id = tshare.send(p, sent, meta=b"m")
        r = tshare.recv(c, timeout=5)
        received.append((set_id, r))
    (a_id, a), (b_id, b) = received
    assert list(a.tensors) == list(b.tensors) == list(sent) and a.meta == b.meta == b"m"
    key = lambda t: _torch._raw_storage(t)._cdata
    for name, t in sent.items():
        x, y = a.tensors[name], b.tensors[name]
        assert x.dtype == y.dtype == t.dtype and x.shape == y.shape == t.shape, name
        assert x.stride() == y.stride() == t.stride() and x.storage_offset() == y.storage_offset(), name
        assert x.data_ptr() == y.data_ptr() == t.data_ptr() or torch.equal(x, t), name
        assert torch.equal(x, t) and torch.equal(y, t), name
        assert _torch._memory_kind_of(x) == _torch._memory_kind_of(y) == "view", name
        assert not x.requires_grad and x.is_leaf, name
    # A member written in place counts on its memory's version both ways
    # (autograd's check of tensors saved for backward sees it).
    for r in (a, b):
        before = r.tensors["one"]._version
        r.tensors["row"].add_(0)
        assert r.tensors["one"]._version > before
    # The same members share a storage both ways.
    names = list(sent)
    same = lambda r: {(m, n) for m in names for n in names if key(r.tensors[m]) == key(r.tensors[n])}
    assert same(a) == same(b)
    # Writes go to the producer; a member sent on alone is the producer's memory.
    a.tensors["row"][0] = -1.0
    assert sent["one"][2, 0].item() == -1.0
    p2, c2 = pair()
    tshare.send(p2, a.tensors["stepped"], tag="on")
    r2 = tshare.recv(c2, timeout=5)
    assert torch.equal(r2.tensor, sent["stepped"])
    del r2
    c2.poll(0)
    p2.wait_released(timeout=5)
    del a, b, received, r, x, y
    c.poll(0)
    for set_id in (a_id, b_id):
        p.wait_released(set_id, timeout=5)
    assert p.outstanding() == 0


@test
def a_received_tensor_made_in_cpp_equals_the_one_torchs_from_dlpack_makes():
    m = native()
    p, c = pair()
    received = []
    for dtype in sorted(set(_torch._FROM_DLPACK.values()), key=str):
        base = tshare.empty_shared(6, 8, dtype=dtype)
        pattern = torch.arange(base.numel() * base.element_size()) % (2 if dtype is torch.bool else 251)
        base.view(-1).view(torch.uint8).copy_(pattern.to(torch.uint8))
        sent = base.t()[2:7:2]  # strided, at an offset
        for way in (_torch._native_tensor_of, None):
            _torch._native_tensor_of = way
            try:
                tshare.send(p, sent, tag=str(dtype))
                r = tshare.recv(c, timeout=5)
            finally:
                _torch._native_tensor_of = m.tensor_of
            t = r.tensor
            assert t.dtype == dtype and t.shape == sent.shape and t.stride() == sent.stride(), (dtype, way)
            same_bytes = lambda x: x.contiguous().view(-1).view(torch.uint8)  # NaN patterns compare too
            assert torch.equal(same_bytes(t), same_bytes(sent)), (dtype, way)
            assert _torch._memory_kind_of(t) == "view" and not t.requires_grad and t.is_leaf, (dtype, way)
            received.append(r)
    # Written through, sent on: the producer's memory either way.
    a, b = received[0].tensor, received[1].tensor
    a.fill_(1)
    assert torch.equal(b, torch.ones_like(b))
    p2, c2 = pair()
    tshare.send(p2, a, tag="on")
    r2 = tshare.recv(c2, timeout=5)
    assert torch.equal(r2.tensor, torch.ones_like(a))
    del r2, a, b, t, r
    c2.poll(0)
    p2.wait_released(timeout=5)
    received.clear()
    c.poll(0)
    p.wait_released(timeout=5)
    assert p.outstanding() == 0
    # A dtype of another element size than the capsule's (bytes) is refused, the capsule left unused.
    capsule = _tshare._host_capsule(64)
    try:
        m.tensor_of(capsule, torch.float32)
    except ValueError as e:
        assert "bit elements are not" in str(e), e
    else:
        raise AssertionError("tensor_of took a dtype of another size")
    torch.utils.dlpack.from_dlpack(capsule)


@test
def places_outside_the_memory_are_refused_and_nothing_is_read():
    m = native()
    dtypes = _torch._FROM_DLPACK
    f32 = (2, 32)

    def make(views, kind_memory=0, dtype=f32):
        bases = [_tshare._host_capsule(64)]  # 64 bytes: 16 floats
        kinds = [(kind_memory, dtype[0], dtype[1], 64, "x")]
        return m.set_tensors(bases, kinds, views, [], dtypes)

    memories, keys, tensors, cuda = make([("ok", 0, (4, 4), (4, 1), 0)])
    assert tensors["ok"].shape == (4, 4) and cuda == -1 and len(keys) == 1
    bad = [
        ([("past the end", 0, (17,), (1,), 0)], "outside its memory"),
        ([("offset past", 0, (2,), (1,), 15)], "outside its memory"),
        ([("huge stride", 0, (2, 2), (1 << 40, 1), 0)], "outside its memory"),
        ([("negative stride", 0, (2,), (-1,), 1)], "outside its memory"),
        ([("overflowing span", 0, (1 << 62, 3), (1 << 62, 1), 0)], "outside its memory"),
        ([("overflowing end", 0, (2,), ((1 << 63) - 2,), 0)], "outside its memory"),
        ([("negative offset", 0, (1,), (1,), -1)], "outside its memory"),
        ([("no such kind", 3, (1,), (1,), 0)], "bad place"),
        ([("ranks differ", 0, (2, 2), (1,), 0)], "bad place"),
    ]
    for views, words in bad:
        try:
            make(views)
        except ValueError as e:
            assert words in str(e), (views, e)
        else:
            raise AssertionError("accepted: %r" % (views,))
    for kwargs, error in (({"kind_memory": 1}, IndexError), ({"dtype": (9, 9)}, ValueError)):
        try:
            make([("x", 0, (1,), (1,), 0)], **kwargs)
        except error:
            pass
        else:
            raise AssertionError("accepted: %r" % (kwargs,))
    used = _tshare._host_capsule(8)
    torch.utils.dlpack.from_dlpack(used)
    try:
        m.set_tensors([used], [], [], [], dtypes)
    except ValueError as e:
        assert "used already" in str(e)
    else:
        raise AssertionError("a used capsule was taken again")


if __name__ == "__main__":
    test.main()
