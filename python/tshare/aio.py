"""tshare under asyncio: awaitable recv, send and wait_released.

    import asyncio, tshare
    from tshare import aio

    async def consume(ch):
        while (r := await aio.recv(ch)) is not None:   # or: async for r in aio.iterate(ch)
            use(r.tensor)
            del r                                        # released

An await never blocks the loop: it watches the channel's fd with the running
loop's add_reader and makes only non-blocking calls (timeout 0). Any number
of channels may be awaited on one loop, and several awaits on one channel.

Cancellation (task.cancel(), asyncio.wait_for timing out) leaves the channel
usable and loses no share: a share is taken off the channel only by the await
that returns it, with no await in between, so a cancelled recv leaves it
queued for the next. A cancelled send sent nothing.

The fd is edge-like: it says that frames came, not how many, and any call on
the channel may take them. So each channel has one watcher per loop. After it
starts watching it drives the channel once (frames that came before are not
announced again), and after every wake and every call an await made it drains
the channel until nothing more came, then wakes the awaits whose condition
now holds: a queued share (one recv at a time), a release, the peer's bye or
an error. A send waiting for ring room is tried again on every wake and every
10 ms, as the C library's own blocking send does (a ring has no wake-up for
room).

A channel's awaits belong to one event loop at a time. Blocking calls from
other threads on the same channel take their turns as usual, but their
progress wakes no await: give a channel to one loop, or to threads.
"""
import asyncio
import collections
import functools
import os
from typing import AsyncIterator, List, Optional

from . import _tshare
from ._sets import is_set as _is_set
from ._torch import Received, SendResult, _deadline, _left
from ._torch import recv as _recv
from ._torch import send as _send
from ._torch import send_all as _send_all

__all__ = ["recv", "send", "send_all", "wait_released", "iterate"]

_WOULD_WAIT = object()
_ROOM_RETRY_S = 0.010  # the C library's own slice for a send waiting for ring room
_IDLE_WAKES_BEFORE_PAUSE = 3  # readable with nothing to read: stop watching for a slice
# Releases made on the loop's own thread wait for its next call on the channel
# (the C library batches them): while every await sleeps, the watcher makes
# one this often, as a blocking recv does between its slices.
_RELEASE_FLUSH_S = 0.1


def _timed_out(what, timeout):
    return _tshare._error(_tshare.E_TIMEOUT, "tshare: %s: nothing within %g s" % (what, timeout))


def _nonblocking(call, *args, **kw):
    """call with timeout=0: its result, or _WOULD_WAIT when it would wait."""
    try:
        return call(*args, timeout=0, **kw)
    except _tshare.TimeoutError:
        return _WOULD_WAIT


class _Await:
    """One await on a channel: what it waits for and the future its task sleeps on."""

    __slots__ = ("kind", "share_id", "future")

    def __init__(self, kind, share_id, loop):
        self.kind = kind  # "recv", "released" or "send"
        self.share_id = share_id
        self.future = loop.create_future()

    def wake(self):
        if not self.future.done():
            self.future.set_result(None)

    def rearm(self, loop):
        if self.future.done():
            self.future = loop.create_future()


class _Watcher:
    """A channel's fd in one loop, and the awaits on that channel there."""

    def __init__(self, ch, loop):
        self.ch = ch
        self.loop = loop
        # fileno() also asks the peer for nudges on a ring channel. The loop
        # watches a dup of it: the channel may be closed from another thread
        # while the loop still has it registered, and its number may not be
        # reused (by a new channel) before this watcher lets go of it.
        self.fd = os.dup(ch.fileno())
        self.awaits = collections.OrderedDict()  # in arrival order
        self.watching = False
        self.idle_wakes = 0
        self.room_timer = None
        self.flush_timer = None
        self.failed = False  # the channel failed: the awaits were woken to raise why

    # ---- the fd ----

    def add(self, a):
        self.awaits[a] = None
        self._watch()

    def remove(self, a):
        self.awaits.pop(a, None)
        if not self.awaits:
            self.retire()
            if self.ch._aio is self:
                self.ch._aio = None

    def retire(self, loop_closed=False):
        """Stop watching for good and close the dup (the channel closes, or
        nothing awaits it any more). Only on the loop's thread, or once the
        loop is closed (loop_closed: nothing is registered any more)."""
        if not loop_closed:
            self._unwatch()
        self.watching = False
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def _watch(self):
        if self.fd < 0:
            return  # retired: the awaits left find the channel closed
        if not self.watching:
            self.loop.add_reader(self.fd, self._readable)
            self.watching = True
        if self.flush_timer is None:
            self.flush_timer = self.loop.call_later(_RELEASE_FLUSH_S, self._flush)

    def _unwatch(self):
        if self.watching:
            self.loop.remove_reader(self.fd)
            self.watching = False
        for timer in (self.room_timer, self.flush_timer):
            if timer is not None:
                timer.cancel()
        self.room_timer = self.flush_timer = None

    def _flush(self):
        """Send the loop thread's releases; it also finds what the fd missed."""
        self.flush_timer = None
        if self.awaits:
            self.update()
            self.flush_timer = self.loop.call_later(_RELEASE_FLUSH_S, self._flush)

    def _readable(self):
        if self.update(wake_senders=True):
            self.idle_wakes = 0
            return
        # Readable, yet nothing came and nobody could go on: bytes the channel
        # leaves on the socket for now. Watching again later keeps it from spinning.
        self.idle_wakes += 1
        if self.idle_wakes >= _IDLE_WAKES_BEFORE_PAUSE:
            self.idle_wakes = 0
            self._unwatch()
            self.loop.call_later(_ROOM_RETRY_S, self._resume)

    def _resume(self):
        if self.awaits:
            self._watch()
            self.update(wake_senders=True)

    def _room_retry(self):
        self.room_timer = None
        self.update(wake_senders=True)

    def closed(self):
        """The channel was closed: every await goes on to find that out."""
        for a in list(self.awaits):
            a.wake()

    # ---- who can go on ----

    def _drain(self):
        """Process what came until nothing more did. True if something came;
        None when the channel failed (each await's own call raises why)."""
        came = False
        try:
            while self.ch._c.poll(0) is True:
                came = True
        except _tshare.Error:
            return None
        return came

    def _share_waits(self):
        """True, False, or None (the bye, or an error the recv will raise)."""
        try:
            return self.ch._c._peek()
        except _tshare.Error:
            return None

    def _released(self, a):
        try:
            if a.share_id == 0:
                return self.ch.outstanding() == 0
            return self.ch.is_released(a.share_id)
        except _tshare.Error:
            return True  # its own call raises why

    def update(self, wake_senders=False):
        """Drain the channel, then wake every await that can go on. True if
        something came or someone was woken."""
        if not self.awaits:
            return False
        came = self._drain()
        if came is None:
            # Once: an await whose own call still says "would wait" then
            # sleeps until the fd or the next flush, not in a busy loop.
            if not self.failed:
                self.failed = True
                self.closed()
                return True
            return False
        woken = self._wake_receivers() | self._wake_released()
        if wake_senders:
            woken |= self._wake_senders()
        return came or woken

    def _wake_receivers(self):
        receivers = [a for a in self.awaits if a.kind == "recv"]
        if not receivers or any(a.future.done() for a in receivers):
            return False  # a woken recv takes the share first, then updates again
        waits = self._share_waits()
        if waits is False:
            return False
        for a in receivers if waits is None else receivers[:1]:
            a.wake()
        return True

    def _wake_released(self):
        woken = False
        for a in self.awaits:
            if a.kind == "released" and not a.future.done() and self._released(a):
                a.wake()
                woken = True
        return woken

    def _wake_senders(self):
        senders = [a for a in self.awaits if a.kind == "send"]
        for a in senders:
            a.wake()
        return bool(senders)

    def retry_room_soon(self):
        """Wake the sends again in a slice: room in a ring is not announced."""
        if self.room_timer is None:
            self.room_timer = self.loop.call_later(_ROOM_RETRY_S, self._room_retry)


def _watcher(ch, loop):
    w = ch._aio
    if w is not None and w.loop is not loop:
        if w.awaits:
            raise _tshare._error(
                _tshare.E_STATE,
                "tshare: the channel is awaited in another event loop: a channel's awaits belong to one loop at a time",
            )
        w = None
    if w is None:
        w = ch._aio = _Watcher(ch, loop)
    return w


async def _until(ch, kind, attempt, what, timeout, share_id=0):
    """attempt() (a non-blocking call) until it gives a result, sleeping on
    the channel's watcher in between; tshare.TimeoutError after timeout s."""
    loop = asyncio.get_running_loop()
    w = _watcher(ch, loop)
    a = _Await(kind, share_id, loop)
    w.add(a)
    deadline = None if timeout is None else loop.time() + max(0.0, timeout)
    timer = None if deadline is None else loop.call_at(deadline, a.wake)
    try:
        while True:
            result = attempt()  # watching already: whatever comes after this try wakes us
            if result is not _WOULD_WAIT:
                return result
            if deadline is not None and loop.time() >= deadline:
                raise _timed_out(what, timeout)
            a.rearm(loop)
            w.update()  # this try may have taken frames others wait for
            if kind == "send":
                w.retry_room_soon()
            await a.future
    finally:
        if timer is not None:
            timer.cancel()
        w.remove(a)
        if w.awaits:
            w.update()  # pass on what this await took or was woken for


async def recv(ch, timeout: Optional[float] = None, device: Optional[int] = None, as_parameter: bool = False,
               requires_grad: Optional[bool] = None, into: Optional[Received] = None) -> Optional[Received]:
    """Await the next tensor or tensor set on ch (tshare.recv without
    blocking the loop): Received(tensor, tag, share_id) with .tensors and
    .meta, or None once the peer said bye. into=r as for tshare.recv (r is
    released at the first try, cancelled or not)."""

    def attempt():
        return _nonblocking(_recv, ch, device=device, as_parameter=as_parameter, requires_grad=requires_grad,
                            into=into)

    return await _until(ch, "recv", attempt, "recv", timeout)


async def send(ch, tensor, tag: str = "", timeout: Optional[float] = None, move_to_shared_memory: bool = True,
               meta=None, copy: bool = False) -> int:
    """Share tensor on ch (tshare.send), awaiting room without blocking the
    loop; the share id. Cancelled or timed out, nothing was sent.

    A Mapping (a tensor set) goes from a worker thread: its frames cannot
    wait for room one try at a time as a single share's do (a set cut off
    halfway is lost), so the thread makes the blocking send while the loop
    runs on. Cancelled, the set still goes; timed out, the peer releases the
    part that went."""
    if _is_set(tensor):
        call = functools.partial(_send, ch, tensor, timeout=timeout, meta=meta, copy=copy)
        return await asyncio.get_running_loop().run_in_executor(None, call)

    def attempt():
        return _nonblocking(_send, ch, tensor, tag=tag, move_to_shared_memory=move_to_shared_memory)

    return await _until(ch, "send", attempt, "send", timeout)


async def send_all(channels, tensors, tag: str = "", timeout: Optional[float] = None, meta=None, copy: bool = False,
                   wait: bool = True) -> List[SendResult]:
    """tshare.send_all without blocking the loop: the sends go from a worker
    thread (a set's frames cannot wait for room one try at a time), then the
    releases are awaited in the loop, every channel's at once; timeout
    bounds both. One SendResult per channel, as tshare.send_all gives.
    Cancelled, what went still goes and is released as any share."""
    deadline = _deadline(timeout)
    call = functools.partial(_send_all, list(channels), tensors, tag=tag, timeout=timeout, meta=meta, copy=copy,
                             wait=False)
    results = await asyncio.get_running_loop().run_in_executor(None, call)
    if wait:

        async def released(r):
            try:
                await wait_released(r.channel, r.id, timeout=_left(deadline))
                r.released = True
            except _tshare.Error as e:
                r.error = e

        await asyncio.gather(*(released(r) for r in results if r.error is None))
    return results


async def wait_released(ch, share_id: int = 0, timeout: Optional[float] = None) -> None:
    """Await the release of share_id (0: every share sent on ch)."""

    def attempt():
        r = _nonblocking(ch.wait_released, share_id)
        return _WOULD_WAIT if r is _WOULD_WAIT else True

    await _until(ch, "released", attempt, "wait_released", timeout, share_id)


async def iterate(ch, device: Optional[int] = None, as_parameter: bool = False,
                  requires_grad: Optional[bool] = None) -> AsyncIterator[Received]:
    """`async for r in aio.iterate(ch):` every tensor until the peer says bye.
    The iterator drops its own reference to r before it waits for the next."""
    while True:
        r = await recv(ch, device=device, as_parameter=as_parameter, requires_grad=requires_grad)
        if r is None:
            return
        yield r
        r = None
