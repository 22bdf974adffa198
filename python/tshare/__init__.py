"""tshare: zero-copy tensor hand-offs between processes on one machine.

CPU tensors travel as memfds, CUDA tensors as CUDA IPC handles (or VMM chunk
fds for expandable segments); the peer may be Python, C or a LibTorch C++
program: they all speak the same wire format.

    import tshare, torch
    with tshare.connect("weights", timeout=10) as ch:
        r = tshare.recv(ch)          # Received(tensor, tag, share_id), None at the end
        print(r.tag, r.tensor.sum())
        del r                        # the producer's memory is released

A whole model goes as one tensor set (r.tensors is then the state_dict, in
the sender's order, and r.meta the metadata):

    tshare.share_model_(model)       # once: the model's CPU storage becomes shared memory
    tshare.send(ch, model.state_dict(), meta=b"step 1")

Errors are tshare.Error (tshare.TimeoutError, tshare.PeerClosedError) with
.code (a tshare status, e.g. tshare.E_TIMEOUT) and .status (its name).
Timeouts are in seconds; None waits forever.
"""
import os

from . import _tshare
from ._tshare import END, OK, Error, PeerClosedError, TimeoutError, cuda_device_count, library_version, socketpair
from ._tshare import (  # noqa: F401  statuses, for comparing with Error.code
    E_BUSY,
    E_CUDA,
    E_INVALID_ARG,
    E_LIMIT,
    E_NO_DEVICE,
    E_NOT_FOUND,
    E_PEER_CLOSED,
    E_PEER_ERROR,
    E_PERMISSION,
    E_PROTOCOL,
    E_STATE,
    E_TIMEOUT,
    E_TOO_LARGE,
    E_UNSUPPORTED,
)
from ._torch import DLPACK_CAPSULE, Received, SendResult, empty_shared, is_shared, recv, send, send_all, share_memory_
from ._torch import share_model_
from ._torch import _timeout_ms
from ._endpoint import Endpoint, endpoint_pair

__version__ = library_version()
TAG_MAX = _tshare.TAG_MAX

__all__ = [
    "Channel", "Listener", "Role", "Received", "Error", "TimeoutError", "PeerClosedError", "Endpoint",
    "open_socket", "socketpair", "endpoint_pair", "listen", "connect", "role", "send", "send_all", "SendResult", "recv",
    "empty_shared", "share_memory_", "share_model_", "is_shared", "library_version", "cuda_device_count",
]


class Channel:
    """A connected channel to one peer. Use it as a context manager, or close()
    it: pending releases go out, the peer is told the stream ended (bye) and
    every share it still holds is dropped as released.

    Any thread may call any method: calls on one channel take turns, and one
    that waits (recv, poll, wait_released, send waiting for room) lets the
    others in every 20 ms. close() from another thread ends such a wait with
    tshare.Error. Ctrl-C in the main thread raises KeyboardInterrupt from a
    wait within ~20 ms, whatever its timeout. Received tensors may die on any
    thread (docs/python.md, "Threads, Ctrl-C and close")."""

    __slots__ = ("_c", "_aio")

    def __init__(self, c):
        self._c = c
        self._aio = None  # the tshare.aio watcher of the loop awaiting on it

    def __reduce__(self):
        _refuse_pickling("Channel")

    def send(self, tensor, tag="", timeout=None, move_to_shared_memory=True, meta=None, copy=False):
        """tshare.send(self, ...)."""
        return send(self, tensor, tag=tag, timeout=timeout, move_to_shared_memory=move_to_shared_memory, meta=meta,
                    copy=copy)

    def recv(self, timeout=None, device=None, as_parameter=False, requires_grad=None, into=None):
        """tshare.recv(self, ...)."""
        return recv(self, timeout=timeout, device=device, as_parameter=as_parameter, requires_grad=requires_grad,
                    into=into)

    def __iter__(self):
        """Received tensors until the peer says bye: `for r in ch:`. The loop
        variable holds its tensor until the next one arrives; `del r` at the
        end of the body releases it before the loop waits again (a producer
        that waits for releases needs that). No hidden reference is kept."""
        return self

    def __next__(self):
        r = recv(self)
        if r is None:
            raise StopIteration
        return r

    def poll(self, timeout=0.0):
        """Process incoming frames (releases, shares queued for recv): True if
        something came, False if nothing did within timeout, None once the peer
        said bye."""
        return self._c.poll(_timeout_ms(timeout))

    def wait_released(self, share_id=0, timeout=None):
        """Drive the channel until share_id (0: every share) is released;
        tshare.TimeoutError if that takes longer than timeout."""
        self._c._wait_released(share_id, _timeout_ms(timeout))

    def is_released(self, share_id):
        return self._c.is_released(share_id)

    def outstanding(self):
        """Shares sent on this channel that the peer still holds."""
        return self._c.outstanding()

    def send_bye(self, timeout=None):
        """Tell the peer the stream is over (close() does it too)."""
        self._c._send_bye(_timeout_ms(timeout))

    def forget_set(self):
        """Drop the tensor set this channel keeps to send again (the last one
        sent, with a reference on every memory it holds): its storages may
        then be freed. The next set sent is built anew. Close drops it too."""
        self._c._forget_set()

    def close(self):
        self._unwatched_before_close()
        self._c.close()
        self._closed_under_awaits()

    def _unwatched_before_close(self):
        """On the thread of the loop awaiting the channel (tshare.aio), or
        once that loop is closed, its watcher lets go of the fd now; else it
        does when its awaits end (it watches a dup, so the number the channel
        frees cannot be reused under it meanwhile)."""
        w = self._aio
        if w is None:
            return
        import asyncio  # imported already: tshare.aio made the watcher

        try:
            here = asyncio.get_running_loop() is w.loop
        except RuntimeError:
            here = False
        if here or w.loop.is_closed():
            w.retire(loop_closed=not here)

    def _closed_under_awaits(self):
        """Awaits on the channel (tshare.aio) raise that it is closed."""
        w = self._aio
        if w is not None:
            try:
                w.loop.call_soon_threadsafe(w.closed)
            except RuntimeError:  # that loop was closed: nothing awaits there any more
                pass

    def fileno(self):
        return self._c.fileno()

    @property
    def closed(self):
        return self._c.closed

    @property
    def transport(self):
        """'ring', 'socket', 'pipes' or 'ucx' (a channel across hosts)."""
        return self._c.transport

    @property
    def receives_copies(self):
        """True where what this end receives is a copy in its own memory
        (a channel across hosts: the bytes were read over UCX, and GPU
        tensors placed on this end's GPU), False where received tensors are
        the producer's memory, mapped (every same-host channel): writes to
        them are then seen by the producer."""
        return self._c.transport == "ucx"

    @property
    def gpu_path(self):
        """How CUDA tensors sent on this channel reach the peer: 'ipc'
        (mapped in place, same host), 'staged' (copied through host memory
        on both ends, a channel across hosts) or None (the peer takes no GPU
        memory: built without CUDA, or no usable GPU across hosts)."""
        return self._c.gpu_path

    @property
    def peer_name(self):
        return self._c.peer_name

    @property
    def peer_pid(self):
        return self._c.peer_pid

    def __enter__(self):
        self._c.__enter__()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return repr(self._c)


def _refuse_pickling(what):
    raise _tshare._error(
        E_UNSUPPORTED,
        "tshare: a %s cannot be pickled (it is a live connection of this process): hand a child process a "
        "tshare.Endpoint instead (tshare.endpoint_pair(), or Listener.endpoint()) and open it there" % what,
    )


def _options(name, transport, spin_us, allow_uid):
    return dict(
        name=name,
        transport=transport,
        spin_us=-1 if spin_us is None else int(spin_us),
        allow_uid=-1 if allow_uid is None else int(allow_uid),
    )


def open_socket(fd, name=None, transport=None, spin_us=None, allow_uid=None):
    """A channel on one end of a connected Unix stream socket (e.g. from
    socketpair()); the channel owns fd from here on, also on failure."""
    opts = _options(name, transport, spin_us, allow_uid)
    try:
        _tshare._check_options(**opts)  # refused options: the fd is closed too, as promised
    except BaseException:
        os.close(fd)
        raise
    return Channel(_tshare._open_socket(fd, **opts))


class Listener:
    """A rendezvous listener: accept() opens a channel per peer. As with a
    Channel, any thread may call it, close() from another thread ends a
    waiting accept() with tshare.Error, and Ctrl-C interrupts it."""

    __slots__ = ("_l",)

    def __init__(self, l):
        self._l = l

    def __reduce__(self):
        _refuse_pickling("Listener")

    def endpoint(self):
        """A picklable Endpoint that connects to this listener where it is opened."""
        return Endpoint(address=self.path)

    def accept(self, timeout=None, name=None, transport=None, spin_us=None, allow_uid=None, token=None):
        """The next peer's channel; tshare.TimeoutError when none came in time.
        A ucx:// listener checks the peer's token against token (default:
        the environment's TSHARE_TOKEN)."""
        opts = _options(name, transport, spin_us, allow_uid)
        return Channel(self._l._accept(_timeout_ms(timeout), token=token, **opts))

    @property
    def path(self):
        return self._l.path

    def fileno(self):
        return self._l.fileno()

    def close(self):
        self._l.close()

    def __enter__(self):
        self._l.__enter__()
        return self

    def __exit__(self, *exc):
        self._l.close()
        return False

    def __repr__(self):
        return repr(self._l)


def listen(name):
    """Listen on a name ($XDG_RUNTIME_DIR/tshare/NAME, or a path with a '/'),
    or across hosts on ucx://HOST:PORT/NAME (accept() then wants a token)."""
    return Listener(_tshare._listen(name))


def connect(name, timeout=None, channel_name=None, transport=None, spin_us=None, allow_uid=None, token=None):
    """Connect to the listener on name, waiting up to timeout for it to appear.
    name may be ucx://HOST:PORT/NAME, a listener on another host: token is
    the secret both ends share (default: the environment's TSHARE_TOKEN)."""
    opts = _options(channel_name, transport, spin_us, allow_uid)
    opts["channel_name"] = opts.pop("name")
    return Channel(_tshare._connect(name, _timeout_ms(timeout), token=token, **opts))


class Role:
    """This process's role under tshare-launch: name ('producer' or
    'consumer'), rank, num_consumers, and its channels (the producer has one
    per consumer, a consumer one to the producer)."""

    __slots__ = ("_r", "_channels")

    def __init__(self, r):
        self._r = r
        self._channels = {}

    name = property(lambda self: self._r.name)
    rank = property(lambda self: self._r.rank)
    num_consumers = property(lambda self: self._r.num_consumers)
    num_channels = property(lambda self: self._r.num_channels)

    def channel(self, index=0, name=None, transport=None, spin_us=None, allow_uid=None):
        """The role's channel index, opened on first use."""
        if index not in self._channels:
            opts = _options(name, transport, spin_us, allow_uid)
            self._channels[index] = Channel(self._r.channel(index, **opts))
        return self._channels[index]

    def channels(self):
        """Every channel of the role, in rank order."""
        return [self.channel(i) for i in range(self.num_channels)]

    def report(self, key, value):
        """Set a figure in the launcher's summary ("shared", "verified")."""
        self._r.report(key, int(value))

    def report_add(self, key, delta):
        """Add delta to a figure in the launcher's summary."""
        self._r.report_add(key, int(delta))

    def __repr__(self):
        return repr(self._r)


_role = None


def role():
    """The Role this process was started in by tshare-launch, or None when it
    was not started by the launcher. The same object on every call."""
    global _role
    if _role is None:
        r = _tshare._role_from_env()
        if r is None:
            return None
        _role = Role(r)
    return _role
