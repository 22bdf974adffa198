"""Endpoints: a channel's end before it is opened, to hand to another process.

A Channel is a live connection of the process that opened it and cannot be
pickled. An Endpoint can: either one end of a socketpair (its fd travels with
multiprocessing's fd reduction, DupFd: passed at spawn for Process arguments,
through multiprocessing's resource sharer over a Queue) or a listener's
address (a path). The receiving process opens it as its channel.
"""
import multiprocessing.reduction
import os
import select

from . import _tshare


def _fail(code, message):
    raise _tshare._error(code, "tshare: " + message)


class Endpoint:
    """An end of a channel that is not open yet: open() makes it a Channel.

    From tshare.endpoint_pair() (one end of a socketpair each) or
    Listener.endpoint() (an address to connect to). Picklable, so it may be an
    argument of a spawned multiprocessing.Process or torch.multiprocessing
    .spawn, or go through a multiprocessing Queue. Pickling an fd endpoint
    passes a duplicate of the fd: close this process's copy once the child
    has it (after Process.start()), so the child's death is seen as a hang-up.
    """

    __slots__ = ("_fd", "_address", "_waits_for_peer")

    def __init__(self, fd=None, address=None, waits_for_peer=False):
        if (fd is None) == (address is None):
            _fail(_tshare.E_INVALID_ARG, "Endpoint: give either fd (one end of a socketpair) or address")
        self._fd = None if fd is None else int(fd)
        self._address = address
        self._waits_for_peer = bool(waits_for_peer)

    def open(self, timeout=None, name=None, transport=None, spin_us=None, allow_uid=None):
        """The Channel of this end (an fd endpoint is used up).

        An address connects, waiting up to timeout for the listener. Of the
        two ends of endpoint_pair(), the first waits up to timeout (None:
        forever; Ctrl-C ends it) for the second to be opened, since the
        second may live in a process that is still starting; the second
        opens at once and then waits for the first's hello (at most the
        handshake timeout, 10 s)."""
        from . import Channel, connect

        if self._address is not None:
            return connect(self._address, timeout=timeout, channel_name=name, transport=transport, spin_us=spin_us,
                           allow_uid=allow_uid)
        fd = self._take_fd()
        try:
            # Until the C open takes fd it is still ours: whatever raises before
            # (bad options, the timeout, Ctrl-C in the wait) gives it back, so
            # open() may be tried again and close() closes it.
            opts = _checked_options(name, transport, spin_us, allow_uid)
            if self._waits_for_peer and not _readable(fd, timeout):
                _fail(_tshare.E_TIMEOUT, "Endpoint.open: the other end was not opened within %g s" % timeout)
        except BaseException:
            self._fd = fd
            raise
        return Channel(_tshare._open_socket(fd, **opts))  # owns fd from here on, also on failure

    def _take_fd(self):
        fd = self._fd
        if fd is None:
            _fail(_tshare.E_STATE, "Endpoint: this end was opened or closed already")
        self._fd = None
        return fd

    @property
    def address(self):
        """The listener's path, or None for one end of a socketpair."""
        return self._address

    def close(self):
        """Close an fd endpoint that will not be opened here. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self):
        try:
            self.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __reduce__(self):
        if self._address is not None:
            return (Endpoint, (None, self._address))
        if self._fd is None:
            _fail(_tshare.E_STATE, "Endpoint: cannot pickle an end that was opened or closed already")
        return (_rebuild_fd_endpoint, (multiprocessing.reduction.DupFd(self._fd), self._waits_for_peer))

    def __repr__(self):
        if self._address is not None:
            return "<tshare.Endpoint to %s>" % self._address
        if self._fd is None:
            return "<tshare.Endpoint used>"
        return "<tshare.Endpoint fd %d>" % self._fd


def _rebuild_fd_endpoint(dup, waits_for_peer):
    return Endpoint(fd=dup.detach(), waits_for_peer=waits_for_peer)


def _checked_options(name, transport, spin_us, allow_uid):
    """The options of open_socket, checked by the C open's own checks before
    the fd is handed over, so that a refusal leaves the fd with us."""
    from . import _options

    opts = _options(name, transport, spin_us, allow_uid)
    _tshare._check_options(**opts)
    return opts


def _readable(fd, timeout):
    """Whether fd became readable (the peer wrote its hello, or hung up) within timeout s."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(None if timeout is None else max(0, int(timeout * 1000.0 + 0.999))))


def endpoint_pair():
    """Two Endpoints on the ends of a new socketpair: keep the first, hand
    the second to another process (a spawned child), open both."""
    a, b = _tshare.socketpair()
    return Endpoint(fd=a, waits_for_peer=True), Endpoint(fd=b)
