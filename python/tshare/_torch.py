"""Torch tensors over tshare channels: send, recv, empty_shared, share_memory_.

How a tensor travels is decided by where its memory lives, as in the LibTorch
bridge: a CUDA tensor (caching allocator, expandable segments or any device
memory) as a CUDA IPC handle or VMM chunk fds plus an event recorded on the
current stream; a CPU tensor in tshare's shared memory (empty_shared,
share_memory_) as a memfd; a received tensor, or any view of one, as a share
of the original producer's memory. Received tensors are built through DLPack
(the versioned capsule where the installed torch takes it, else the classic
one); their deleter releases the share exactly once, from any thread.
"""
import functools
import os
import sys
import time
from typing import Dict, NamedTuple, Optional

import torch

from . import _sets, _tshare
from ._tshare import Error

_DTYPE_INT, _DTYPE_UINT, _DTYPE_FLOAT, _DTYPE_BFLOAT, _DTYPE_COMPLEX, _DTYPE_BOOL = 0, 1, 2, 4, 5, 6
_DEVICE_CUDA = 2

# torch dtype -> DLPack (code, bits): the dtypes the LibTorch bridge carries.
_TO_DLPACK = {
    torch.bool: (_DTYPE_BOOL, 8),
    torch.uint8: (_DTYPE_UINT, 8),
    torch.int8: (_DTYPE_INT, 8),
    torch.int16: (_DTYPE_INT, 16),
    torch.int32: (_DTYPE_INT, 32),
    torch.int64: (_DTYPE_INT, 64),
    torch.float16: (_DTYPE_FLOAT, 16),
    torch.bfloat16: (_DTYPE_BFLOAT, 16),
    torch.float32: (_DTYPE_FLOAT, 32),
    torch.float64: (_DTYPE_FLOAT, 64),
    torch.complex64: (_DTYPE_COMPLEX, 64),
    torch.complex128: (_DTYPE_COMPLEX, 128),
}
_FROM_DLPACK = {v: k for k, v in _TO_DLPACK.items()}
_DLPACK_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "handle", 4: "bfloat", 5: "complex", 6: "bool"}

if hasattr(torch.Tensor, "untyped_storage"):

    def _storage(t):
        return t.untyped_storage()

else:  # torch before 2.0

    def _storage(t):
        return t.storage()


# The storage's identity (its StorageImpl) and address, for the storage table:
# the cheapest storage object the installed torch gives. Torch 1.x's
# storage() builds a TypedStorage in Python (microseconds per call); its
# _storage() is the untyped one underneath, with the same _cdata.
if hasattr(torch.Tensor, "untyped_storage"):
    _raw_storage = torch.Tensor.untyped_storage
elif hasattr(torch.Tensor, "_storage"):
    _raw_storage = torch.Tensor._storage
else:
    _raw_storage = _storage


_from_dlpack = getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack


def _configure_dlpack():
    """Pick the capsule the installed torch takes, and how bool travels."""
    try:
        torch.utils.dlpack.to_dlpack(torch.zeros(1, dtype=torch.bool))
        bool_as_uint8 = False
    except Exception:  # torch 1.x: "Bool type is not supported by dlpack"
        bool_as_uint8 = True
    _tshare._configure(True, bool_as_uint8)
    try:
        _from_dlpack(_tshare._host_capsule(1))
        return "versioned", bool_as_uint8
    except Exception:  # the capsule was not taken; its destructor freed the buffer
        _tshare._configure(False, bool_as_uint8)
        return "classic", bool_as_uint8


DLPACK_CAPSULE, _BOOL_AS_UINT8 = _configure_dlpack()

if hasattr(torch._C, "_cuda_getCurrentRawStream"):

    def _current_stream(device):
        return torch._C._cuda_getCurrentRawStream(device)

else:

    def _current_stream(device):
        return torch.cuda.current_stream(device).cuda_stream


def _fail(code, message):
    raise _tshare._error(code, "tshare: " + message)


def _timeout_ms(timeout):
    """Seconds (None: forever) to the C library's milliseconds (< 0: forever)."""
    if timeout is None:
        return -1
    if timeout <= 0:
        return 0
    return max(1, int(timeout * 1000.0 + 0.999))


def _check_shareable(t):
    """Everything send() refuses, each with what to do instead."""
    if not isinstance(t, torch.Tensor):
        _fail(_tshare.E_INVALID_ARG, "send: expected a torch.Tensor, got %s" % type(t).__name__)
    if t.is_sparse or t.layout in _SPARSE_LAYOUTS:
        _fail(_tshare.E_UNSUPPORTED, "cannot send a sparse tensor: send its indices and values, or .to_dense()")
    if t.is_quantized:
        _fail(_tshare.E_UNSUPPORTED, "cannot send a quantized tensor: send int_repr() with its scale and zero point")
    if getattr(t, "is_nested", False):
        _fail(_tshare.E_UNSUPPORTED, "cannot send a nested tensor: send its components")
    if t.is_meta:
        _fail(_tshare.E_UNSUPPORTED, "cannot send a meta tensor: it has no memory to share")
    if t.layout != torch.strided:
        _fail(_tshare.E_UNSUPPORTED, "cannot send a tensor with a non-strided layout; convert it with .to_dense()")
    if t.device.type not in ("cpu", "cuda"):
        _fail(_tshare.E_UNSUPPORTED, "cannot send a tensor on %s: tshare shares CPU and CUDA memory" % t.device)
    if t.is_conj():
        _fail(_tshare.E_UNSUPPORTED, "cannot send a lazily conjugated view: call .resolve_conj() first")
    if t.is_neg():
        _fail(_tshare.E_UNSUPPORTED, "cannot send a lazily negated view: call .resolve_neg() first")
    if t.dim() > _tshare.MAX_NDIM:
        _fail(_tshare.E_TOO_LARGE, "cannot send a tensor of %d dimensions (at most %d)" % (t.dim(), _tshare.MAX_NDIM))
    if t.dtype not in _TO_DLPACK:
        hint = (
            " (a quantized type: send int_repr() and the scale and zero point)"
            if t.dtype in _QUANTIZED
            else " (convert it with .to() to a type tshare carries)"
        )
        _fail(_tshare.E_UNSUPPORTED, "dtype %s has no DLPack code tshare carries%s" % (t.dtype, hint))


_SPARSE_LAYOUTS = tuple(
    getattr(torch, name) for name in ("sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc") if hasattr(torch, name)
)
_QUANTIZED = tuple(getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4") if hasattr(torch, name))


def _storage_of(t):
    try:
        return _storage(t)
    except (RuntimeError, NotImplementedError):
        _fail(_tshare.E_UNSUPPORTED, "cannot send a tensor without storage (a functional or fake tensor)")


def _raw_storage_of(t):
    try:
        return _raw_storage(t)
    except (RuntimeError, NotImplementedError):
        _fail(_tshare.E_UNSUPPORTED, "cannot send a tensor without storage (a functional or fake tensor)")


_STRIDED = torch.strided


def _dlpack_dtype(t):
    """t's DLPack (code, bits) when send() takes t as it is; else raises what
    _check_shareable says. The common case costs a few attribute reads: a
    dtype tshare carries rules out quantized tensors, a CPU or CUDA device
    meta ones, a strided layout sparse ones."""
    fields = _TO_DLPACK.get(t.dtype) if isinstance(t, torch.Tensor) else None
    if (
        fields is None
        or t.layout is not _STRIDED
        or not (t.is_cpu or t.is_cuda)
        or _is_nested(t)
        or t.is_conj()
        or t.is_neg()
        or t.dim() > _tshare.MAX_NDIM
    ):
        _check_shareable(t)
    return fields


if hasattr(torch.Tensor, "is_nested"):

    def _is_nested(t):
        return t.is_nested

else:

    def _is_nested(t):
        return False


def send(ch, tensor, tag="", timeout=None, move_to_shared_memory=True, meta=None, copy=False):
    """Share tensor on ch without copying it and return the share id.

    The tensor's memory stays alive until the peer releases the share, however
    long the tensor itself lives. A CPU tensor outside shared memory is moved
    there first, once (share_memory_), unless move_to_shared_memory is False.

    A Mapping[str, Tensor] (a state_dict) goes as one tensor set, in its
    order, with meta (bytes-like, or str sent as UTF-8; at most 16 MiB) and
    one release for the whole set; the id returned is the set's. Its CPU
    tensors must be in tshare's shared memory already (share_model_(model)
    before model.state_dict()): a set never moves them, since a state_dict's
    tensors are aliases of the model's. copy=True sends a one-off copy of
    those that are not. CUDA tensors (of one device) go as they are, ordered
    after the device's current stream. Sent again with the same tensors, the
    set goes as one frame: the channel keeps the last set it sent
    (ch.forget_set() lets go of it).
    """
    c = ch._c
    if not isinstance(tensor, torch.Tensor) and _sets.is_set(tensor):
        return _sets.send_set(ch, tensor, meta, _timeout_ms(timeout), copy)
    if meta is not None:
        _fail(_tshare.E_INVALID_ARG, "send: metadata travels with tensor sets: send {name: tensor} with meta=")
    code, bits = _dlpack_dtype(tensor)
    ms = _timeout_ms(timeout)
    if not tensor.is_cuda:  # empty_shared() memory is found from the address alone, without the storage
        share_id = c._send_host_at(tensor.data_ptr(), code, bits, tensor.shape, tensor.stride(), tag, ms)
        if share_id is not None:
            return share_id
    return _send_by_storage(c, tensor, code, bits, tag, ms, move_to_shared_memory)


class SendResult:
    """One consumer's outcome of send_all(): the channel; id, the share's or
    set's id on it (0 when it did not go); error, the tshare.Error that
    stopped it (None when it went, and came back if send_all waited); and
    released, whether its release came back (False when send_all did not
    wait). ok is error is None."""

    __slots__ = ("channel", "id", "error", "released")

    def __init__(self, channel, id, error):
        self.channel, self.id, self.error, self.released = channel, id, error, False

    @property
    def ok(self):
        return self.error is None

    def __repr__(self):
        what = "released" if self.released else "sent" if self.error is None else repr(self.error)
        return "SendResult(%r, id=%d, %s)" % (self.channel, self.id, what)


def send_all(channels, tensors, tag="", timeout=None, meta=None, copy=False, wait=True):
    """Send tensors to every channel of channels (one consumer each) in one
    call, and wait until each released it; a list of SendResult, one per
    channel in order.

    A Mapping[str, Tensor] (a state_dict) is built into one tensor set once
    (or the set kept from the last send_all to the same channels goes again)
    and handed to each consumer: what send() does for one channel, without
    building it per consumer (tag is not used for a set). A Tensor goes to
    each as send() would send it. One consumer's failure (a dead peer, a
    channel that is closed or listed twice, a send or a release that did not
    come in time) is its result's error, and nothing is raised for it. What
    is wrong with tensors themselves (what send() refuses) raises, as send()
    does, and nothing goes. timeout (seconds) bounds the whole call, sending
    and waiting; with None, a consumer that never makes room or never
    releases holds the call up. wait=False returns once every send went.
    """
    channels = list(channels)
    if not channels:
        _fail(_tshare.E_INVALID_ARG, "send_all: no channels")
    deadline = _deadline(timeout)
    results = [SendResult(ch, 0, None) for ch in channels]
    seen = set()
    for r in results:  # a channel listed twice gets the set once, at its first place
        if id(r.channel) in seen:
            r.error = _tshare._error(_tshare.E_INVALID_ARG, "tshare: send_all: this channel is in the list twice")
        seen.add(id(r.channel))
    if not isinstance(tensors, torch.Tensor) and _sets.is_set(tensors):
        _send_set_to_all([r for r in results if r.error is None], tensors, meta, deadline, copy)
    else:
        if meta is not None:
            _fail(_tshare.E_INVALID_ARG, "send_all: metadata travels with tensor sets: send {name: tensor} with meta=")
        _dlpack_dtype(tensors)  # what send() refuses of the tensor itself raises (_check_shareable's), before anything goes
        for r in results:
            if r.error is None:
                try:
                    r.id = send(r.channel, tensors, tag=tag, timeout=_left(deadline), copy=copy)
                except Error as e:
                    r.error = e
    if wait:
        for r in results:
            if r.error is None:
                try:
                    r.channel.wait_released(r.id, timeout=_left(deadline))
                    r.released = True
                except Error as e:
                    r.error = e
    return results


def _deadline(timeout):
    """A monotonic deadline timeout seconds from now (None: none)."""
    return None if timeout is None else time.monotonic() + max(0.0, timeout)


def _left(deadline):
    """The seconds left before deadline, as a timeout (None: no limit)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _send_set_to_all(results, tensors, meta, deadline, copy):
    """The set to every channel of results: built by (and kept on) the one
    of lowest address, whose C call enters the others in address order, so
    that two fan-outs over the same channels take turns and never wait on
    each other for ever; one it cannot enter (closed, or held by another
    thread's call until the deadline) gets its error there. An owner closed,
    or held so, is that channel's error, and the next one builds."""
    live = sorted(results, key=lambda r: id(r.channel._c))
    while live:
        owner, others = live[0], live[1:]
        try:
            outcomes = _sets.send_set(owner.channel, tensors, meta, _timeout_ms(_left(deadline)), copy,
                                      others=[r.channel._c for r in others])
        except Error as e:  # nothing went: the C call raises only before it sends
            if not (e.code == _tshare.E_TIMEOUT or (e.code == _tshare.E_STATE and owner.channel.closed)):
                raise
            owner.error = e
            live = others
            continue
        for r, (set_id, error) in zip(live, outcomes):
            r.id, r.error = set_id, error
        return


def _send_by_storage(c, tensor, code, bits, tag, ms, move_to_shared_memory):
    """send() of memory known by its storage: a received tensor, CUDA memory,
    torch's shared memory, or CPU memory to move into shared memory first."""
    storage = _raw_storage_of(tensor)
    cuda = tensor.is_cuda
    device = tensor.device.index if cuda else 0
    stream = _current_stream(device) if cuda else 0
    args = (cuda, device, code, bits, tensor.shape, tensor.stride(), stream, tag, ms)
    # The share holds the storage, not the tensor: a tensor may be pointed at
    # other memory (set_, .data =) while the peer still holds this.
    share_id = c._send(storage, storage._cdata, storage.data_ptr(), tensor.data_ptr(), *args)
    if share_id is None and tensor.is_shared():  # torch's own shared memory: its file travels
        share_id = _send_torch_shared(c, tensor, storage, args)
    if share_id is None:  # CPU memory that is not shared memory
        if not move_to_shared_memory:
            _fail(
                _tshare.E_UNSUPPORTED,
                "the CPU tensor is not in shared memory: allocate it with tshare.empty_shared(), call "
                "tshare.share_memory_(), or pass move_to_shared_memory=True",
            )
        share_memory_(tensor)
        storage = _raw_storage(tensor)  # by its storage: an empty tensor's address may lie past its buffer
        share_id = c._send(storage, storage._cdata, storage.data_ptr(), tensor.data_ptr(), *args)
    return share_id


def _mapping_of(addr):
    """(start, file offset, path) of this process's mapping holding addr, or None."""
    with open("/proc/self/maps", "rb") as f:
        for line in f:
            fields = line.split(None, 5)
            lo, _, hi = fields[0].partition(b"-")
            if int(lo, 16) <= addr < int(hi, 16):
                path = fields[5].strip().decode("utf-8", "surrogateescape") if len(fields) > 5 else ""
                return int(lo, 16), int(fields[2], 16), path
    return None


def torch_shared_file(storage):
    """(fd, size, base, owned) of the file under a storage in torch's shared
    CPU memory (share_memory_(), torch.multiprocessing), or None.

    With the file_descriptor strategy the file is unlinked and the storage
    keeps its fd (owned False: not to be closed); with file_system it is a
    named /dev/shm file, opened here (owned True). base is the address the
    file's first byte is mapped at: torch's mapping, whose start may hold a
    header before the data (file_system's refcount).
    """
    addr = storage.data_ptr()
    if not addr:
        return None
    found = _mapping_of(addr)
    if found is None or not found[2].startswith("/"):
        return None
    start, offset, path = found
    base = start - offset
    if path.endswith(" (deleted)"):  # file_descriptor: asking for the fd copies nothing for such a storage
        fd, _ = storage._share_fd_cpu_()
        owned = False
    else:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        owned = True
    return fd, os.fstat(fd).st_size, base, owned


def adopt_torch_shared(tensors):
    """For a set's send: capsules that make the CPU tensors in torch's own
    shared memory found as tshare memory while they live; [] when none is."""
    adopted, seen = [], set()
    for t in tensors:
        if not (isinstance(t, torch.Tensor) and t.is_cpu and t.is_shared()):
            continue
        storage = _storage_of(t)
        if storage._cdata in seen or _memory_kind_of(t) is not None:
            continue
        seen.add(storage._cdata)
        found = torch_shared_file(storage)
        if found is None:
            continue
        fd, size, base, owned = found
        try:
            adopted.append(_tshare._adopt_file(fd, size, base, storage))
        finally:
            if owned:
                os.close(fd)
    return adopted


def _send_torch_shared(c, tensor, storage, args):
    """Send a CPU tensor in torch's shared memory as that memory: the share
    holds the storage until its release; None when its file is not found."""
    found = torch_shared_file(storage)
    if found is None:
        return None
    fd, size, base, owned = found
    try:
        return c._send(storage, storage._cdata, storage.data_ptr(), tensor.data_ptr(), *args, fd, size, base)
    finally:
        if owned:
            os.close(fd)


class _ReceivedFields(NamedTuple):
    tensor: Optional[torch.Tensor]
    tag: str
    share_id: int


class Received(_ReceivedFields):
    """A received tensor, its tag and its share id (the producer's number);
    or a received tensor set: tensor None, tag "", share_id the set's id.

    .tensors: {name: tensor} in the sender's order; for a single share
    {tag: tensor}. .meta: a set's metadata as bytes (b"" when it has none);
    None for a single share, which carries none. Each tensor of a set keeps
    the whole set alive: it is released once every one of them is gone.
    """

    def __new__(cls, tensor, tag, share_id, tensors=None, meta=None, hold=None):
        self = super().__new__(cls, tensor, tag, share_id)
        if tensors is not None:
            self.__dict__["_set"] = (tensors, meta)
            if hold is not None:
                self.__dict__["_hold"] = (tensors,) + hold  # (tensors, generation, capsules, memories, id of the channel)
        return self

    def release(self) -> None:
        """Done reading this version of a set: it is released now (it goes
        to the producer with this thread's next call on the channel, as a
        dropped set's release does: recv(ch, into=r) is one, ch.poll(0)
        another), while its tensors stay and keep pointing at the same
        memory, which stays mapped. From then on the producer may write that
        memory, so the tensors' contents are no longer this version's, and
        sending them is refused until `tshare.recv(ch, into=r)` brought the
        next version into them. Releasing again does nothing while no newer
        version came into the tensors; once one did, any Received over them
        releases that one. Raises for a single tensor (drop it instead) and
        for a set whose tensor was sent on and whose share is still out. A
        CUDA set is released after the work queued on the default stream so
        far, as a set dropped is, and work queued on the default stream
        after that finishes before their memory is unmapped (synchronize
        other streams yourself before dropping the tensors)."""
        hold = self.__dict__.get("_hold")
        if hold is None:
            _fail(_tshare.E_INVALID_ARG, "release: %r is not a received tensor set (a single tensor is released "
                                         "when it is dropped)" % (self,))
        _tshare._release_pinned(hold[2])

    @property
    def tensors(self) -> Dict[str, torch.Tensor]:
        s = self.__dict__.get("_set")
        return s[0] if s is not None else {self.tag: self.tensor}

    @property
    def meta(self) -> Optional[bytes]:
        s = self.__dict__.get("_set")
        return s[1] if s is not None else None

    def __repr__(self):
        s = self.__dict__.get("_set")
        if s is None:
            return super().__repr__()
        return "Received(set %d: %d tensors, %d bytes of metadata)" % (self.share_id, len(s[0]), len(s[1]))


# Received(tensor, tag, share_id) without Received.__new__'s Python frame:
# a single share carries no set fields.
_new_received = tuple.__new__
_native_tensor_of = getattr(_sets._native, "tensor_of", None)  # None without tshare._torch_native


@functools.lru_cache(maxsize=None)
def _cuda_device_count():
    """Devices torch can use: fixed for the process, so asked once, not per hand-off."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _stream_for(device):
    if not _cuda_device_count():  # no stream to order on: the share is taken, then refused (recv)
        return 0
    if device < 0:
        device = torch.cuda.current_device()
    count = _cuda_device_count()
    if device >= count:
        _fail(_tshare.E_INVALID_ARG, "recv: device %d does not exist here (%d visible)" % (device, count))
    return _current_stream(device)


def _dtype_name(code, bits):
    return "%s%d" % (_DLPACK_CODE_NAMES.get(code, "code%d" % code), bits)


def recv(ch, timeout=None, device=None, as_parameter=False, requires_grad=None,
         into: Optional[Received] = None) -> Optional[Received]:
    """The next tensor on ch, or None once the peer said bye.

    Its memory is the producer's (writes are visible there); it is released
    when the tensor and every view of it are gone. A CUDA tensor arrives on
    the device holding it (or `device`, by peer access), and that device's
    current stream waits for the producer's work. A share that cannot become
    a torch tensor here is released back and raised as tshare.Error.

    as_parameter=True gives a torch.nn.Parameter on the same memory (as
    torch.multiprocessing rebuilds one). The wire carries no autograd state,
    so the receiver says it: requires_grad (None: True for floating point and
    complex dtypes, which alone can require gradients, else False).

    into=r, a set received before on ch (another channel's is refused): r is
    released as r.release() does, and a next set of r's layout (the
    producer's same state_dict sent again, its tensors updated in place)
    comes as r's own tensors: the Received returned has r's .tensors, the
    same dict of the same tensor objects (device and as_parameter are theirs
    then), and the new version's id and metadata; it and r share them, so
    releasing either releases this version. A set of another layout comes
    as new tensors (then `result.tensors is not r.tensors`), and r's tensors
    keep their memory mapped until they go. Between the release and the
    return, r's tensors hold whatever the producer writes; a recv that ends
    without a set for them (TimeoutError, a cancel, something else came)
    leaves them released: a plain recv never takes them, recv(into=r) again
    offers them again.
    """
    c = ch._c
    reused = None
    if into is not None:
        reused = _sets.give_back(c, into)
    elif _sets.AHEAD:
        _sets.make_ahead(c)
    try:
        r = c._recv(_timeout_ms(timeout), _stream_for, -1 if device is None else int(device))
    finally:
        if reused is not None:  # not taken (a timeout, a cancel, something else came): never another recv's
            c._ahead_withdraw(reused)
    if r is None:
        return None
    if r[0] in ("set", "kept"):  # "kept": its tensors made while this recv waited (_sets.make_ahead) or into's
        box = [r]
        del r  # box alone holds the capsules: a refused set goes back at once
        set_id, meta, tensors, hold = _sets.received_set(box)
        hold = hold + (id(c),)  # the channel, by identity: into= checks it (generations tell channels apart too)
        if reused is not None and tensors is reused:
            return Received(None, "", set_id, tensors, meta, hold)
        if as_parameter:
            tensors = {k: torch.nn.Parameter(t, requires_grad=_parameter_grad(t.dtype, set_id, requires_grad))
                       for k, t in tensors.items()}
        return Received(None, "", set_id, tensors, meta, hold)
    capsule, tag, share_id, code, bits, device_type, _ = r
    dtype = _FROM_DLPACK.get((code, bits))
    if dtype is not None and device_type != _DEVICE_CUDA and not as_parameter:  # the common case, in few steps
        return _new_received(Received, (_received_tensor(capsule, dtype), tag, share_id))
    if dtype is None:
        del capsule  # releases the share
        _fail(_tshare.E_UNSUPPORTED, "a shared dtype %s has no PyTorch equivalent" % _dtype_name(code, bits))
    if device_type == _DEVICE_CUDA and not _cuda_device_count():
        del capsule
        _fail(_tshare.E_UNSUPPORTED, "share %d is GPU memory and this torch has no usable CUDA" % share_id)
    if device_type == _DEVICE_CUDA:
        torch.cuda._lazy_init()  # as torch.from_dlpack does for a CUDA tensor (once; a flag after that)
    if as_parameter:
        try:
            grad = _parameter_grad(dtype, share_id, requires_grad)
        except Error:
            del capsule
            raise
    t = _received_tensor(capsule, dtype)
    if as_parameter:
        t = torch.nn.Parameter(t, requires_grad=grad)
    return _new_received(Received, (t, tag, share_id))


def _received_tensor(capsule, dtype):
    """The torch tensor over a received share's capsule in dtype, its storage
    bound to the capsule's memory. tshare._torch_native makes it in C++ where
    it loaded (torch.from_dlpack's Python call costs a microsecond or more
    of parsing and conversion per hand-off); torch's from_dlpack otherwise."""
    if _native_tensor_of is not None:
        return _tshare._bound_made(capsule, _native_tensor_of, dtype)
    t = _tshare._bound(capsule, _from_dlpack, _raw_storage)
    return t.view(torch.bool) if dtype is torch.bool and _BOOL_AS_UINT8 else t


def _parameter_grad(dtype, share_id, requires_grad):
    """What requires_grad a Parameter of dtype gets; refused when it cannot."""
    can_require = dtype.is_floating_point or dtype.is_complex
    if requires_grad is None:
        return can_require
    if requires_grad and not can_require:
        _fail(
            _tshare.E_INVALID_ARG,
            "recv: share %d is %s, which cannot require gradients: pass requires_grad=False "
            "(or None) with as_parameter=True" % (share_id, dtype),
        )
    return bool(requires_grad)


def _normalize_size(size):
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    out = []
    for s in size:
        s = int(s)
        if s < 0:
            _fail(_tshare.E_INVALID_ARG, "empty_shared: negative size %d" % s)
        out.append(s)
    return tuple(out)


def empty_shared(*size, dtype=None):
    """A zero-filled CPU tensor in shared memory (a memfd): sent without a copy."""
    size = _normalize_size(size)
    dtype = dtype or torch.get_default_dtype()
    if dtype not in _TO_DLPACK:
        _fail(_tshare.E_UNSUPPORTED, "empty_shared: dtype %s has no DLPack code tshare carries" % dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in size:
        numel *= s
    return _shared_bytes(numel * itemsize).view(dtype).view(size)


def _shared_bytes(nbytes):
    """A 1-D uint8 tensor over a new host buffer, bound for later sends."""
    capsule = _tshare._host_capsule(nbytes)
    raw = _from_dlpack(capsule)
    _tshare._bind(capsule, _storage(raw)._cdata)
    return raw


def _memory_kind_of(tensor):
    """"view", "host" or None: how the memory under a tensor travels."""
    try:
        return _tshare._memory_kind(_storage(tensor)._cdata)
    except (RuntimeError, NotImplementedError):
        return None


def is_shared(tensor):
    """True when tensor can be sent without a copy: CUDA memory, a received
    tensor, CPU memory from empty_shared()/share_memory_(), or CPU memory in
    torch's own shared memory (Tensor.share_memory_(), torch.multiprocessing)."""
    if tensor.is_cuda:
        return True
    if not tensor.is_cpu:
        return False
    if _tshare._host_memory_at(tensor.data_ptr()) or tensor.is_shared():
        return True
    try:
        return _tshare._memory_kind(_storage(tensor)._cdata) is not None
    except (RuntimeError, NotImplementedError):
        return False


def share_memory_(tensor):
    """Move tensor's storage into shared memory (one copy) and return tensor.

    A no-op for CUDA tensors and for memory that is shared already. Unlike
    the LibTorch bridge, only this tensor is moved: other tensors on the old
    storage keep the old (private) memory, since Python cannot swap a storage's
    memory under them.
    """
    if not isinstance(tensor, torch.Tensor) or not (tensor.is_cpu or tensor.is_cuda):
        _fail(_tshare.E_INVALID_ARG, "share_memory_: needs a CPU tensor with storage")
    if is_shared(tensor):
        return tensor
    storage = _storage_of(tensor)
    itemsize = tensor.element_size()
    count = storage.nbytes() // itemsize
    shared = empty_shared(count, dtype=tensor.dtype)
    if count:
        shared.copy_(tensor.as_strided((count,), (1,), 0))
    with torch.no_grad():
        tensor.set_(_storage(shared), tensor.storage_offset(), tensor.size(), tensor.stride())
    return tensor


_sets._torch = sys.modules[__name__]
_sets._TO_DLPACK, _sets._FROM_DLPACK = _TO_DLPACK, _FROM_DLPACK
share_model_ = _sets.share_model_
