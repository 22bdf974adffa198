"""What the Python tests share: the torch check, one test per argument,
channel pairs in one process, and error expectations.

  import harness                     # exits 77 when this Python has no torch
  test = harness.Tests("test_x.py")  # @test on each; test.main() at the end
"""
import gc
import os
import sys
import threading
import time

try:
    import torch  # noqa: F401  the package needs it
except ImportError:
    print("SKIP: this Python has no torch (Debian: apt-get install python3-torch)")
    sys.exit(77)

import tshare


class Tests:
    """A decorator that files tests by name, and the main that runs one."""

    def __init__(self, script):
        self.script = script
        self.tests = {}

    def __call__(self, fn):
        self.tests[fn.__name__] = fn
        return fn

    def main(self):
        if len(sys.argv) != 2 or sys.argv[1] not in self.tests:
            print("usage: %s {%s}" % (self.script, ",".join(self.tests)))
            sys.exit(2)
        self.tests[sys.argv[1]]()
        print("ok")


def pair(**kw):
    """Two connected channels of this process: each end's hello waits for
    the other's, so the consumer's end is opened in a thread."""
    a, b = tshare.socketpair()
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("c", tshare.open_socket(b, name="consumer", **kw)))
    th.start()
    p = tshare.open_socket(a, name="producer", **kw)
    th.join()
    return p, out["c"]


def check_error(e, code, fragment):
    assert e.code == code, "code %s (%s), want %s: %s" % (e.code, e.status, code, e)
    assert fragment in str(e), "message %r lacks %r" % (str(e), fragment)


def expect_error(code, fragment, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except tshare.Error as e:
        check_error(e, code, fragment)
        return e
    raise AssertionError("no error; wanted %s with %r" % (code, fragment))


def no_error_wanted(code, fragment):
    return AssertionError("no error; wanted %s with %r" % (code, fragment))


def fill(ch):
    """Send until ch has no room (its peer does not read); the count sent."""
    t = tshare.empty_shared(16)
    n = 0
    while True:
        try:
            tshare.send(ch, t[n % 16], timeout=0)
        except tshare.TimeoutError:
            return n
        n += 1


def memfds():
    """tshare memfds this process has open."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:tshare" in os.readlink("/proc/self/fd/" + fd):
                n += 1
        except OSError:
            pass
    return n


def expect_all_back_from_dead_peer(ch, base_fds, what="shares"):
    """After the peer was killed: drive ch until nothing it held is
    outstanding (5 s at most), then no tshare memfd beyond base_fds stays
    open here."""
    deadline = time.monotonic() + 5
    while ch.outstanding() and time.monotonic() < deadline:
        try:
            ch.poll(0.05)
        except tshare.PeerClosedError:
            pass
    assert ch.outstanding() == 0, "%d %s still held by a dead consumer" % (ch.outstanding(), what)
    gc.collect()
    assert memfds() == base_fds, "memfds open: %d, before %d" % (memfds(), base_fds)
