"""fork() and the tshare package, one test per argument:

  test_fork.py NAME      (exit 0 pass, 1 fail, 77 skip with the reason)

A channel and the tensors received on it belong to the process that opened
it: a forked child that drops an inherited tensor releases nothing on its
parent's channel, and a call on the inherited channel raises an error naming
the owner."""
import gc
import os
import sys
import traceback

try:
    import torch
except ImportError:
    print("SKIP: this Python has no torch (Debian: apt-get install python3-torch)")
    sys.exit(77)

import tshare

TESTS = {}
CHECKPOINT = "after the fork"


def test(fn):
    TESTS[fn.__name__] = fn
    return fn


def in_child(fn, *args):
    """Fork; the child runs fn(*args) and exits 0, or 1 with the traceback."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return pid


def exited_ok(pid, who):
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "%s ended with status 0x%x" % (who, status)


def producer(fd):
    """Shares a tensor of 1s, then waits for the consumer's checkpoint (sent
    after its forked child exited). A release seen by then came from that
    child: the producer reuses the memory, as a real one would, and writes
    2s into it. Then it acks, and ends when the consumer says bye."""
    with tshare.open_socket(fd, name="producer") as p:
        t = tshare.empty_shared(1024, dtype=torch.float32)
        t.fill_(1)
        sid = tshare.send(p, t, tag="ones", timeout=5)
        r = tshare.recv(p, timeout=10)  # None: a bye came first
        if p.is_released(sid):
            t.fill_(2)
        assert r is not None and r.tag == CHECKPOINT, "got %r instead of the checkpoint" % (r,)
        del r
        tshare.send(p, tshare.empty_shared(1, dtype=torch.float32), tag="ack", timeout=5)
        p.wait_released(timeout=10)
        assert tshare.recv(p, timeout=10) is None, "no bye"


def consumer_holding(fd):
    """The consumer's channel and the producer's tensor of 1s, in a list that
    holds its only reference (a forked child empties its copy)."""
    c = tshare.open_socket(fd, name="consumer")
    held = [tshare.recv(c, timeout=5).tensor]
    assert bool((held[0] == 1).all())
    return c, held


def goes_on_unchanged(c, t, producer_pid):
    """The producer saw nothing from the child: it answers the checkpoint and
    did not reuse the memory under the parent's tensor."""
    try:
        tshare.send(c, tshare.empty_shared(1, dtype=torch.float32), tag=CHECKPOINT, timeout=5)
        ack = tshare.recv(c, timeout=10)
    except tshare.PeerClosedError:
        ack = None
    assert bool((t == 1).all()), "the parent's tensor changed under it: 1 -> %g" % t[0].item()
    assert ack is not None and ack.tag == "ack", "the channel did not go on: %r" % (ack,)
    del ack, t
    gc.collect()
    c.wait_released(timeout=10)
    c.send_bye(timeout=5)
    c.close()
    exited_ok(producer_pid, "the producer")


def child_drops_and_closes(ch, held):
    held.clear()
    gc.collect()
    ch.close()


def child_calls(ch, held, owner):
    want = "belongs to process %d (opened before fork)" % owner
    for call in (lambda: tshare.recv(ch, timeout=1), lambda: ch.poll(1), lambda: ch.wait_released(timeout=1),
                 lambda: ch.send_bye(timeout=1), lambda: tshare.send(ch, held[0], timeout=1)):
        try:
            call()
            raise AssertionError("a call on the inherited channel did not raise")
        except tshare.Error as e:
            assert e.code == tshare.E_STATE and want in str(e), "%s (code %s) does not say %r" % (e, e.code, want)


@test
def a_forked_child_dropping_a_received_tensor_changes_nothing():
    a, b = tshare.socketpair()
    producer_pid = in_child(producer, a)
    os.close(a)
    c, held = consumer_holding(b)
    exited_ok(in_child(child_drops_and_closes, c, held), "the forked child")
    goes_on_unchanged(c, held.pop(), producer_pid)


@test
def a_forked_child_using_the_inherited_channel_gets_an_error_naming_the_owner():
    a, b = tshare.socketpair()
    producer_pid = in_child(producer, a)
    os.close(a)
    c, held = consumer_holding(b)
    exited_ok(in_child(child_calls, c, held, os.getpid()), "the forked child")
    goes_on_unchanged(c, held.pop(), producer_pid)


if __name__ == "__main__":
    TESTS[sys.argv[1]]()
    print("PASS: " + sys.argv[1])
