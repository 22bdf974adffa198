"""Tensor sets: a Mapping[str, Tensor] (a state_dict) in one hand-off, with
metadata; share_model_, which puts a module's CPU tensors in shared memory in
place.

A set carries host and CUDA memory. Every CPU tensor of a set must already
live in tshare's shared memory (share_model_, empty_shared, share_memory_):
send never moves a state_dict's tensors behind the caller's back, since a
state_dict holds aliases of the model's parameters and moving an alias would
leave the model on its private memory. copy=True makes a one-off copy
instead. CUDA tensors travel as they are (the caching allocator's segments,
in either allocator mode), all of one device, ordered after the current
stream of that device; the set holds each tensor's storage until it is released.
Tensors on one storage or segment (views, tied weights) travel with their
memory once: the C library sends each allocation once per set.
"""
import functools
import os
import re
from collections.abc import Mapping

import torch

from . import _tshare

# Filled by _torch (which imports this module): its dtype map and helpers.
_TO_DLPACK = _FROM_DLPACK = None
_torch = None

META_MAX = 16 * 1024 * 1024  # the wire's bound on a set's metadata (TSHARE_SET_META_MAX)
NAME_MAX = 1024  # bytes of one name (TSHARE_SET_NAME_MAX)
_ALIGN = 64  # where share_model_ places each storage in its buffer: any dtype's alignment


def _load_native():
    """tshare._torch_native when it was built against the running torch
    (the same version), else None: received sets are then made in Python.
    TSHARE_TORCH_NATIVE=0 turns it off."""
    if os.environ.get("TSHARE_TORCH_NATIVE", "1") == "0":
        return None
    try:
        from . import _torch_native
    except ImportError:  # not built, or built against another torch's libraries
        return None
    running = re.match(r"[0-9.]*[0-9]", torch.__version__)
    return _torch_native if running and running.group(0) == _torch_native.torch_version else None


_native = _load_native()

# A channel's recv makes the next set's tensors while it waits, from the last
# set it received whose layout the C library keeps (py_set_ahead.h): needs
# the C++ maker. TSHARE_SET_AHEAD=0 turns it off. The recipe is kept either
# way: recv(into=r) hands the next set to r's tensors by it.
AHEAD = _native is not None and os.environ.get("TSHARE_SET_AHEAD", "1") != "0"


def _fail(code, message):
    raise _tshare._error(code, "tshare: " + message)


def is_set(obj):
    return isinstance(obj, Mapping) and not isinstance(obj, torch.Tensor)


def _meta_bytes(meta):
    """meta as bytes: bytes-like as is, str as UTF-8, None as no metadata."""
    if meta is None:
        return b""
    if isinstance(meta, str):
        meta = meta.encode("utf-8")
    try:
        view = memoryview(meta)
    except TypeError:
        _fail(_tshare.E_INVALID_ARG, "send: meta must be bytes-like or str, not %s" % type(meta).__name__)
    if view.nbytes > META_MAX:
        _fail(_tshare.E_TOO_LARGE, "send: metadata of %d bytes (at most %d)" % (view.nbytes, META_MAX))
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


def _name_bytes(name):
    if not isinstance(name, str):
        _fail(_tshare.E_INVALID_ARG, "send: tensor set names must be str, got %s %r" % (type(name).__name__, name))
    try:
        b = name.encode("utf-8")
    except UnicodeEncodeError as e:
        _fail(_tshare.E_INVALID_ARG, "send: name %r is not valid UTF-8 text: %s" % (name, e))
    if not b or len(b) > NAME_MAX or b"\0" in b:
        _fail(
            _tshare.E_INVALID_ARG,
            "send: name %.80r%s: names are 1 to %d bytes of UTF-8 without NUL"
            % (name, "..." if len(name) > 80 else "", NAME_MAX),
        )
    return b


_COMPLEX = (torch.complex64, torch.complex128)  # may be lazily conjugated views


def _items(tensors, pairs):
    """What the C side reads of each member, straight off the tensor: the
    fewest attribute reads (the cost of a set is mostly these), made in one
    C loop: [(name, data_ptr, dtype, shape, strides, lazy)], lazy for a
    lazily negated or conjugated view; and the device of its CUDA members
    when their fields (_with_cuda's) are there too, else -1. The C side
    checks the rest and hands back what it cannot take. tshare._torch_native
    reads plain tensors in C++ from pairs (_native_pairs), at a fraction of
    torch's method calls' cost, CUDA fields included (a 290-tensor model's
    _with_cuda took a millisecond of a first hand-off)."""
    if pairs is not None:
        got = _native.set_items_cuda(pairs, _PLAIN)
        if got is not None:
            return got
    return _tshare._set_items(tensors, _COMPLEX), -1


def _native_pairs(tensors):
    """tensors' (name, tensor) pairs for tshare._torch_native, or None
    without it (or where items() fails: the C loop then raises it)."""
    if _native is None:
        return None
    try:
        return list(tensors.items())
    except Exception:
        return None


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types whose methods are torch's own


def _refuse(name, t):
    """Raise why member (name, t) cannot go in a set."""
    _name_bytes(name)
    _check_member(name, t)
    _not_shared(name, t)


def _check_member(name, t):
    if not isinstance(t, torch.Tensor):
        _fail(_tshare.E_INVALID_ARG, "send: %r is a %s, not a torch.Tensor" % (name, type(t).__name__))
    try:
        _torch._check_shareable(t)
    except _tshare.Error as e:
        raise _tshare._error(e.code, "%s (tensor %r)" % (e, name)) from None


def _not_shared(name, t):
    """The error for a member that is not in tshare's shared memory."""
    _check_member(name, t)
    kind = _torch._memory_kind_of(t)
    if kind == "pinned":
        _fail(
            _tshare.E_STATE,
            "send: tensor %r is of a received set released with Received.release(): its memory is the producer's "
            "to change until the next version comes into it (recv into=); send after that, or a copy" % name,
        )
    if kind == "view":
        copy_how = ("clone it on its device first (t.clone(); copy=True copies CPU tensors only)" if t.is_cuda
                    else "pass copy=True for a one-off copy")
        _fail(
            _tshare.E_UNSUPPORTED,
            "send: tensor %r is a received tensor, which a tensor set cannot share on in this version: %s, or "
            "send it alone with tshare.send()" % (name, copy_how),
        )
    if t.is_cuda:  # the C side raises its own errors for CUDA memory
        _fail(_tshare.E_INVALID_ARG, "send: tensor %r: CUDA memory the set could not take" % name)
    _fail(
        _tshare.E_UNSUPPORTED,
        "send: tensor %r is not in tshare's shared memory, and a set never moves it (a state_dict holds aliases "
        "of the model's tensors: moving them would leave the model on its private memory): call "
        "tshare.share_model_(model) once before model.state_dict(), or pass copy=True for a one-off copy" % name,
    )


def send_set(ch, tensors, meta, timeout_ms, copy, others=None):
    """Send the Mapping tensors as one set; its id. With others (the C
    channels of more consumers): the set built once (or ch's kept set) goes
    to ch and to each of them, and the result is [(set_id, error)] for ch,
    then others, an error being a tshare.Error (set_id 0) or None."""
    if copy:
        tensors = _copied(tensors)
    meta = _meta_bytes(meta)
    # The channel keeps the builder of the set it sent last and sends it again
    # while items are equal (a state_dict updated in place); a copy is new
    # memory every time, never worth keeping. tshare._torch_native gives a key
    # of the same fields, cheaper than the items: the kept set goes on it alone.
    keep = not copy
    c, stream_now = ch._c, _torch._current_stream
    go = c._send_set if others is None else functools.partial(c._send_set_all, others)
    # The key straight off the mapping (no list of its items): the kept set
    # goes on it alone; the pairs are made only to build a set.
    key = _native.set_key(tensors, _PLAIN) if keep and _native is not None else None
    if key is not None:
        set_id, _ = go(None, _TO_DLPACK, meta, timeout_ms, stream_now, keep, key)
        if set_id is not None:
            return set_id
    pairs = _native_pairs(tensors)
    try:
        items, device = _items(tensors, pairs)
    except (RuntimeError, AttributeError, TypeError):  # not a tensor; sparse, nested...
        for name, t in tensors.items():
            _check_member(name, t)
        raise
    if not items:
        _fail(_tshare.E_INVALID_ARG, "send: the tensor set is empty (a set carries 1 to 65536 tensors)")
    if key is None:  # the fields compared, never the tensor objects of the CUDA fields
        key = items if device < 0 else [item[:6] for item in items]
    stream = _torch._current_stream(device) if device >= 0 else 0  # the CUDA members' stream, read once
    set_id, look_at = go(items, _TO_DLPACK, meta, timeout_ms, stream_now, keep, key, stream)
    if set_id is None:  # members in torch's own shared memory go as that memory: tried once more with them
        adopted = _torch.adopt_torch_shared(tensors.values())
        if adopted:
            set_id, look_at = go(items, _TO_DLPACK, meta, timeout_ms, stream_now, keep, key, stream)
            del adopted
    if set_id is None:
        name, t = list(tensors.items())[look_at]
        if device < 0 and isinstance(t, torch.Tensor) and t.is_cuda:  # CUDA members: what the C side needs of them too
            set_id, look_at = go(_with_cuda(items, tensors), _TO_DLPACK, meta, timeout_ms, stream_now, keep,
                                          key, _cuda_stream(tensors))
            if set_id is None:
                name, t = list(tensors.items())[look_at]
        if set_id is None:
            _refuse(name, t)
    return set_id


def _with_cuda(items, tensors):
    """items with (storage_key, storage_base, storage, device) added to each
    CUDA tensor's: the set holds the storage, its memory, not the tensor,
    which may be pointed at other memory while a sent set still names this."""
    out = list(items)
    for i, t in enumerate(tensors.values()):
        if t.is_cuda:
            storage = _torch._storage_of(t)
            out[i] = items[i][:6] + ((storage._cdata, storage.data_ptr(), storage, t.device.index),)
    return out


def _cuda_stream(tensors):
    """The current stream of the first CUDA tensor's device (a set carries one device's memory)."""
    for t in tensors.values():
        if t.is_cuda:
            return _torch._current_stream(t.device.index)
    return 0


def _copied(tensors):
    """tensors with those outside tshare's shared memory copied into it."""
    out = dict(tensors)
    private = []
    for name, t in out.items():
        if not isinstance(t, torch.Tensor):
            _check_member(name, t)
        if t.is_cpu and _torch._memory_kind_of(t) != "host" and not t.is_shared():  # torch's shared memory goes as is
            private.append(name)
    for name, copy in zip(private, _packed([out[n] for n in private])):
        out[name] = copy
    return out


def _storage_groups(tensors):
    """tensors grouped by storage: [(storage, [index, ...])], in first-seen order."""
    groups = {}
    for i, t in enumerate(tensors):
        storage = _torch._storage_of(t)
        groups.setdefault(storage._cdata, (storage, []))[1].append(i)
    return list(groups.values())


def _packed(tensors, device=None, groups=None):
    """Copies of CPU tensors in one new shared buffer (device None), or of
    one device's CUDA tensors in one new allocation of it, as views that keep
    their layout: tensors of one storage stay on one (copied) storage.
    groups: _storage_groups(tensors), where the caller has them already."""
    with torch.no_grad():
        return _packed_copies(tensors, device, groups or _storage_groups(tensors))


def _set_onto(tensors, copies):
    """Each tensor pointed, in place, at its copy's memory and layout."""
    for t, c in zip(tensors, copies):
        t.set_(_torch._storage(c), c.storage_offset(), c.size(), c.stride())


def _packed_copies(tensors, device, groups):
    offsets, total = [], 0
    for storage, _ in groups:
        offsets.append(total)
        total += (storage.nbytes() + _ALIGN - 1) // _ALIGN * _ALIGN
    total = max(total, _ALIGN)  # views of any dtype, also when every storage is empty
    if device is None:
        raw = _torch._shared_bytes(total)
    else:  # the caching allocator's: one segment (large blocks get their own)
        raw = torch.empty(total, dtype=torch.uint8, device=device)
    out = [None] * len(tensors)
    for (storage, members), offset in zip(groups, offsets):
        nbytes = storage.nbytes()
        first = tensors[members[0]]
        if nbytes:  # the storage's bytes as they are: whatever dtype, conj or neg bit its tensors read them with
            whole = torch.empty(0, dtype=torch.uint8, device=first.device).set_(_torch._raw_storage(first))
            raw[offset:offset + nbytes].copy_(whole)
        for i in members:
            t = tensors[i]
            item = t.element_size()
            out[i] = raw.view(t.dtype).as_strided(t.size(), t.stride(), offset // item + t.storage_offset())
    return out


def share_model_(module, pack_cuda=False):
    """Move module's CPU parameters and buffers into tshare's shared memory,
    in place, and return module.

    Every parameter and buffer keeps its identity (optimizers and hooks that
    hold them go on working); its memory becomes a view of one shared buffer
    for the whole module, values copied once. From then on the module itself
    owns the shared memory: model.state_dict() sends as a set without a copy,
    the producer's in-place updates (optimizer steps, p.add_()) are what
    consumers see, and a consumer's writes are seen by the module. Tied
    weights and other tensors on one storage stay on one storage. Tensors
    already in tshare's shared memory are left as they are. Tensors made
    later (module.to(), a new parameter, a reassigned .data) are private
    again: call share_model_ again after such changes.

    CUDA tensors are shareable where they are, and are left there unless
    pack_cuda is True: then each device's CUDA parameters and buffers move,
    the same way, into one allocation of that device (when they are on more
    than one storage). A consumer opens one CUDA IPC mapping for the module's
    first hand-off instead of one per segment of the caching allocator (a
    model of hundreds of tensors has tens of segments, and each open is tens
    of microseconds in the driver). Whole storages are copied, so the device
    needs room for a second copy of them while they move; the caching
    allocator keeps their old blocks for its later allocations. The device
    is synchronized before and after the copies. Pack before capturing CUDA
    graphs or compiling with CUDA graphs (they keep the old addresses), and
    send the state_dict again afterwards: consumers holding a set sent before
    see the old memory. For PyTorch's default allocator: with
    expandable_segments:True packing measured slower.
    """
    if not isinstance(module, torch.nn.Module):
        _fail(_tshare.E_INVALID_ARG, "share_model_: expected a torch.nn.Module, got %s" % type(module).__name__)
    seen, host, cuda = set(), [], {}
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in seen or t.layout is not torch.strided:
            continue
        seen.add(id(t))
        if t.is_cpu and _torch._memory_kind_of(t) != "host":
            host.append(t)
        elif pack_cuda and t.is_cuda:
            cuda.setdefault(t.device, []).append(t)
    with torch.no_grad():
        if host:
            _set_onto(host, _packed(host))
        for device, tensors in cuda.items():
            groups = _storage_groups(tensors)
            if len(groups) < 2:  # one storage already (packed before): nothing to gain
                continue
            # Every stream's writes to them done before the copies, and the
            # copies done before their old blocks go back to the allocator
            # (which would hand them out again on their own streams at once).
            torch.cuda.synchronize(device)
            moved = _packed(tensors, device, groups)
            torch.cuda.synchronize(device)
            _set_onto(tensors, moved)
    return module


def received_set(box):
    """The torch tensors of the set recv got, {name: tensor} in the sender's
    order, with its id and metadata. box holds recv's result alone, so that a
    refusal here drops every capsule, and with them the set, at once.

    One tensor per memory of the set, bound to it, and each member a view of
    that tensor's dtype view (py_set_recv.c says why): a member costs one
    as_strided, not a capsule of its own. A ("kept", ...) result has its
    tensors already: made while recv waited (make_ahead), its memory attached."""
    if box[0][0] == "kept":
        _, set_id, meta, tensors, cuda, generation, capsules, memories = box.pop()
        if cuda >= 0:
            _after_default_stream(torch.device("cuda", cuda))
        return set_id, meta, tensors, (generation, capsules, memories)
    _, set_id, meta, bases, kinds, views, own, generation = box.pop()
    dtypes = _FROM_DLPACK
    refused = [(name, code, bits) for _, code, bits, _, name in kinds if (code, bits) not in dtypes]
    refused += [(name, code, bits) for _, name, _, code, bits in own if (code, bits) not in dtypes]
    if refused:
        del bases[:], own[:]  # the set goes back to the producer
        name, code, bits = refused[0]
        _fail(
            _tshare.E_UNSUPPORTED,
            "recv: set %d: tensor %r has dtype %s, which has no PyTorch equivalent"
            % (set_id, name, _torch._dtype_name(code, bits)),
        )
    if _native is not None:
        capsules = bases + [capsule for _, _, capsule, _, _ in own]
        try:
            memories, keys, tensors, cuda = _native.set_tensors(bases, kinds, views, own, dtypes)
        except BaseException:  # refused: the set goes back at once, not with the traceback
            del bases[:], own[:], capsules[:]
            raise
        del bases[:], own[:]
        try:
            _tshare._bind_keys(capsules, keys)  # memories holds each capsule's memory meanwhile
        except BaseException:
            del capsules[:], memories
            raise
        if cuda >= 0:
            _after_default_stream(torch.device("cuda", cuda))
        return set_id, meta, tensors, (generation, capsules, memories)
    capsules = bases + [capsule for _, _, capsule, _, _ in own]
    memories = _bound_all(bases)
    del bases[:]
    kind_views = [memories[m].narrow(0, 0, usable).view(dtypes[code, bits]) for m, code, bits, usable, _ in kinds]
    tensors = _tshare._set_members(kind_views, views)
    if own:
        own = _own_tensors(own)
        tensors = _in_order(tensors, own)
        memories = memories + [t for _, _, t in own]
    cuda = next((t.device for t in memories if t.is_cuda), None)
    if cuda is not None:
        _after_default_stream(cuda)
    return set_id, meta, tensors, (generation, capsules, memories)


def give_back(c, r):
    """recv's into=r: r's set released with its memory kept mapped
    (Received.release), and its tensors offered to channel c for the next
    set of r's layout, in place of any made ahead. The tensors dict the
    next set comes as when it fits, or None where r cannot take it (not a set of c's current
    layout: recv then makes new tensors)."""
    hold = r.__dict__.get("_hold") if isinstance(r, _torch.Received) else None
    if hold is None or hold[4] != id(c):
        _fail(_tshare.E_INVALID_ARG, "recv: into= takes a tensor set received before on this channel, not %r%s"
              % (r, "" if hold is None else " (received on another channel)"))
    tensors, generation, capsules, memories, _ = hold
    _tshare._release_pinned(capsules)
    if not generation or not c._ahead_into(generation, tensors, capsules, memories):
        return None
    return tensors


def make_ahead(c):
    """While nothing waits on channel c (a look reads what came, and sends
    the releases this thread's drops left queued), make the tensors of a set
    of the last kept layout and leave them on c: a recv that gets such a set
    hands them over (("kept", ...), received_set) with its memory attached. What
    goes wrong here is the next set's to report, made as any other."""
    # Tensors made in inference mode are inference tensors, which a recv
    # outside it must not hand out: made only outside (normal tensors work
    # inside it too).
    if not c._ahead_wanted() or torch.is_inference_mode_enabled() or c._peek() is not False:
        return
    spec = c._ahead_spec()
    if spec is None:
        return
    generation, bases, kinds, views, own = spec
    del spec
    capsules = bases + [capsule for _, _, capsule, _, _ in own]
    try:
        memories, keys, tensors, _ = _native.set_tensors(bases, kinds, views, own, _FROM_DLPACK)
        del bases[:], own[:]
        _tshare._bind_keys(capsules, keys)
    except Exception:  # a dtype torch lacks, memory: nothing was held, nothing is kept
        return
    c._ahead_put(generation, tensors, capsules, memories)


def _bound_all(capsules):
    """The torch tensor over each capsule, its storage bound to the capsule's
    memory (what makes its tensors known as received ones, and sent on as
    such), made in one C loop."""
    return _tshare._bound_all(capsules, _torch._from_dlpack, _torch._raw_storage)


def _own_tensors(own):
    """[(index, name, tensor)] of the members with a capsule of their own; own is emptied."""
    tensors = _bound_all([capsule for _, _, capsule, _, _ in own])
    bool_as_uint8 = _torch._BOOL_AS_UINT8
    out = [(index, name, t.view(torch.bool) if bool_as_uint8 and code == _BOOL else t)
           for (index, name, _, code, _), t in zip(own, tensors)]
    del own[:], tensors
    return out


def _in_order(views, own):
    """The members in the sender's order: views ({name: tensor}, in order)
    with own ([(index, name, tensor)], in order) put in their places."""
    if not views:  # a memory per member (each tensor its own empty_shared)
        return {name: t for _, name, t in own}
    out, rest = {}, iter(views.items())
    at = {index: (name, t) for index, name, t in own}
    for i in range(len(views) + len(own)):
        name, t = at[i] if i in at else next(rest)
        out[name] = t
    return out


def _after_default_stream(device):
    """A set's CUDA tensors are ready for work on the default stream (the
    producer's event is waited for there): the current stream waits for it
    too, on the GPU, where it is another one. The streams are compared by
    their raw handles: torch.cuda.current_stream() alone costs microseconds
    per call, and most receivers run on the default stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    default = _DEFAULT_STREAM.get(index)
    if default is None:  # fixed for the process: the device's default stream
        default = _DEFAULT_STREAM[index] = torch.cuda.default_stream(index).cuda_stream
    if _torch._current_stream(index) != default:
        torch.cuda.current_stream(index).wait_stream(torch.cuda.default_stream(index))


_DEFAULT_STREAM = {}  # device index -> its default stream's raw handle


_BOOL = 6
