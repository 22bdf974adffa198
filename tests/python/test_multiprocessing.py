"""Channels and spawned children (multiprocessing, torch.multiprocessing),
and received Parameters, one test per argument:

  test_multiprocessing.py NAME      (exit 0 pass, 1 fail, 77 skip with the reason)

Children are started with the spawn method: a fresh interpreter that gets
its end as a pickled tshare.Endpoint."""
import multiprocessing
import os
import pickle
import signal
import sys
import threading

import harness
import torch
import torch.multiprocessing

import tshare
from harness import expect_error

test = harness.Tests("test_multiprocessing.py")


def unique_name(what):
    """A rendezvous name of this process ($XDG_RUNTIME_DIR/tshare/NAME)."""
    return "tshare-test-mp-%s-%d" % (what, os.getpid())


def opened_endpoint_pair():
    """Both ends of endpoint_pair() opened here, the second in a thread."""
    mine, theirs = tshare.endpoint_pair()
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("c", theirs.open(name="consumer")))
    th.start()
    p = mine.open(name="producer", timeout=10)
    th.join()
    return p, out["c"]


# ---- children (module level: spawn imports this file in the child) ----------


def add_one_to_each(endpoint):
    """Receive tensors until bye and add 1 to each in place: the producer's
    memory, so the parent sees the sums once the releases are back."""
    with endpoint.open(name="spawned child", timeout=60) as ch:
        for r in ch:
            r.tensor.add_(1)
            del r
        ch.poll(0)


def check_parameters(rank, endpoint):
    """torch.multiprocessing.spawn's function: take the weights as Parameters
    and send back, as a tensor of the producer's, what arrived."""
    with endpoint.open(name="spawn rank %d" % rank, timeout=60) as ch:
        w = tshare.recv(ch, timeout=60, as_parameter=True)
        steps = tshare.recv(ch, timeout=60, as_parameter=True)
        report = tshare.recv(ch, timeout=60)
        assert isinstance(w.tensor, torch.nn.Parameter) and w.tensor.requires_grad, w.tensor
        assert isinstance(steps.tensor, torch.nn.Parameter) and not steps.tensor.requires_grad, steps.tensor
        (w.tensor * 2).sum().backward()  # a leaf of this process's autograd graph
        report.tensor[rank] = float(w.tensor.sum().item() + steps.tensor.item() + w.tensor.grad.sum().item())
        del w, steps, report
        ch.poll(0)


def sum_cuda_weights_under_asyncio(endpoint):
    """Await the CUDA weights as a Parameter and a report tensor; write the
    weights' sum and requires_grad into the report (the parent's memory)."""
    import asyncio

    from tshare import aio

    async def main(ch):
        w = await aio.recv(ch, timeout=60, as_parameter=True)
        report = await aio.recv(ch, timeout=60)
        assert w.tensor.is_cuda and isinstance(w.tensor, torch.nn.Parameter), w.tensor
        report.tensor[0] = w.tensor.sum()
        report.tensor[1] = float(w.tensor.requires_grad)
        del w, report
        ch.poll(0)
        assert await aio.recv(ch, timeout=60) is None  # the bye

    with endpoint.open(name="cuda child", timeout=60) as ch:
        asyncio.run(main(ch))


# ---- tests ---------------------------------------------------------------


@test
def a_spawned_process_opens_the_other_end_of_an_endpoint_pair():
    """mp.get_context('spawn').Process gets one end of endpoint_pair(): its
    fd travels as the child starts. The child's in-place writes reach the
    parent's shared memory, and its exit is seen as the end of the stream."""
    mine, theirs = tshare.endpoint_pair()
    child = multiprocessing.get_context("spawn").Process(target=add_one_to_each, args=(theirs,))
    child.start()
    theirs.close()  # the child has its own copy: its exit must hang the channel up
    with mine.open(name="parent", timeout=60) as ch:
        data = tshare.empty_shared(3, 4)
        data.copy_(torch.arange(12.0).view(3, 4))
        for row in data:
            tshare.send(ch, row, timeout=10)
        ch.wait_released(timeout=60)
        ch.send_bye(timeout=10)
        assert torch.equal(data, torch.arange(12.0).view(3, 4) + 1), data
    child.join(60)
    assert child.exitcode == 0, "child exit code %s" % child.exitcode


@test
def torch_multiprocessing_spawn_children_connect_through_a_listener_endpoint():
    """torch.multiprocessing.spawn with 2 ranks gets Listener.endpoint() (an
    address): each connects, takes a float and an int tensor as Parameters
    with requires_grad as given (True for float, False for int) and writes
    what it saw into a tensor the parent shared."""
    nprocs = 2
    listener = tshare.listen(unique_name("weights"))
    with listener:
        ctx = torch.multiprocessing.spawn(check_parameters, args=(listener.endpoint(),), nprocs=nprocs, join=False)
        channels = [listener.accept(timeout=60, name="parent") for _ in range(nprocs)]
        w = tshare.empty_shared(4)
        w.fill_(0.5)
        steps = tshare.empty_shared((), dtype=torch.int64)
        steps.fill_(7)
        report = tshare.empty_shared(nprocs)
        for ch in channels:
            for t in (w, steps, report):
                tshare.send(ch, t, timeout=10)
        for ch in channels:
            ch.wait_released(timeout=60)
            ch.close()
        while not ctx.join(60):
            pass
    # w sums to 2, steps is 7, the gradient of sum(2w) sums to 8
    assert torch.equal(report, torch.full((nprocs,), 17.0)), report
    assert torch.equal(w, torch.full((4,), 0.5)), "the child's backward changed the weights: %s" % w


@test
def cuda_tensors_to_a_spawned_child_under_asyncio():
    """CUDA weights to a spawned child (CUDA does not survive fork) that
    awaits them with tshare.aio as a Parameter and writes into a CUDA tensor
    of the parent's."""
    if not torch.cuda.is_available() or tshare.cuda_device_count() == 0:
        print("SKIP: no CUDA device")
        sys.exit(77)
    mine, theirs = tshare.endpoint_pair()
    child = multiprocessing.get_context("spawn").Process(target=sum_cuda_weights_under_asyncio, args=(theirs,))
    child.start()
    theirs.close()
    with mine.open(name="parent", timeout=120) as ch:
        w = torch.full((1024,), 0.5, device="cuda")
        report = torch.zeros(2, device="cuda")
        tshare.send(ch, w, timeout=10)
        tshare.send(ch, report, timeout=10)
        ch.wait_released(timeout=120)
        ch.send_bye(timeout=10)
        assert report.tolist() == [512.0, 1.0], report
    child.join(120)
    assert child.exitcode == 0, "child exit code %s" % child.exitcode


@test
def pickling_a_channel_or_listener_is_refused_naming_what_to_do():
    """A Channel and a Listener are live connections of this process: pickled
    (also as the argument of a spawned process) they raise tshare.Error that
    names tshare.Endpoint; an Endpoint that was opened cannot travel."""
    p, c = opened_endpoint_pair()
    expect_error(tshare.E_UNSUPPORTED, "tshare.Endpoint", pickle.dumps, p)
    child = multiprocessing.get_context("spawn").Process(target=add_one_to_each, args=(c,))
    expect_error(tshare.E_UNSUPPORTED, "Channel cannot be pickled", child.start)
    with tshare.listen(unique_name("pickled")) as l:
        expect_error(tshare.E_UNSUPPORTED, "Listener cannot be pickled", pickle.dumps, l)
    mine, theirs = tshare.endpoint_pair()
    theirs.close()
    expect_error(tshare.E_STATE, "opened or closed already", pickle.dumps, theirs)
    expect_error(tshare.E_STATE, "opened or closed already", theirs.open)
    mine.close()
    p.close()
    c.close()


@test
def an_endpoint_through_a_queue_or_pickle_in_process():
    """Outside a spawn, an fd endpoint travels through multiprocessing's
    resource sharer (a Queue between processes; here pickle in process):
    the copy is a channel of its own end, the original still closable."""
    mine, theirs = tshare.endpoint_pair()
    copy = pickle.loads(pickle.dumps(theirs, protocol=2))
    theirs.close()
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("c", copy.open(name="copy")))
    th.start()
    p = mine.open(name="producer", timeout=10)
    th.join()
    c = out["c"]
    tshare.send(p, tshare.empty_shared(2), tag="via pickle")
    r = tshare.recv(c, timeout=5)
    assert r.tag == "via pickle"
    del r
    c.poll(0)
    p.wait_released(timeout=5)
    p.close()
    c.close()


@test
def the_first_end_waits_for_the_other_to_open():
    """endpoint_pair()'s first end waits (up to its timeout) for the other
    to be opened, and may try again; a child that dies first hangs it up."""
    mine, theirs = tshare.endpoint_pair()
    expect_error(tshare.E_TIMEOUT, "not opened within", mine.open, timeout=0.2)
    theirs.close()  # as a child dying before it opened its end
    expect_error(tshare.E_PEER_CLOSED, "", mine.open, timeout=10)


def open_fds():
    return len(os.listdir("/proc/self/fd"))


@test
def a_refused_open_leaves_the_fd_with_the_endpoint():
    """An open() refused before the channel took the fd (bad options) leaves
    the fd with the endpoint: close() closes it, or a later open() uses it."""
    before = open_fds()
    for _ in range(50):
        mine, theirs = tshare.endpoint_pair()
        for end in (mine, theirs):
            expect_error(tshare.E_INVALID_ARG, "transport 'bogus'", end.open, transport="bogus", timeout=5)
            assert "fd" in repr(end), "a refused open used the end up: %r" % end
        mine.close()
        theirs.close()
    assert open_fds() == before, "%d fds leaked by refused opens" % (open_fds() - before)
    mine, theirs = tshare.endpoint_pair()
    expect_error(tshare.E_INVALID_ARG, "transport", theirs.open, transport="bogus")
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("c", theirs.open(name="consumer")))
    th.start()
    p = mine.open(name="producer", timeout=10)
    th.join()
    p.close()
    out["c"].close()
    assert open_fds() == before, "%d fds leaked" % (open_fds() - before)


@test
def ctrl_c_while_the_first_end_waits_keeps_its_fd():
    """Ctrl-C (KeyboardInterrupt) while the first end waits for the other
    leaves the fd with the endpoint: close() closes it."""
    before = open_fds()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        mine, theirs = tshare.endpoint_pair()
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        try:
            mine.open(timeout=5)
            raise AssertionError("open() returned with no peer")
        except KeyboardInterrupt:
            pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert "fd" in repr(mine), "Ctrl-C used the end up: %r" % mine
    mine.close()
    theirs.close()
    assert open_fds() == before, "%d fds leaked by Ctrl-C in open()" % (open_fds() - before)


@test
def received_tensors_as_parameters():
    """recv(as_parameter=True): a Parameter on the producer's memory with
    requires_grad as asked (None: only floating point and complex dtypes);
    asking gradients of an integer tensor is refused and released back;
    a Parameter's share is released when it dies."""
    p, c = opened_endpoint_pair()
    f = tshare.empty_shared(3)
    i = tshare.empty_shared(3, dtype=torch.int32)
    sf = tshare.send(p, f, tag="float")
    r = tshare.recv(c, timeout=5, as_parameter=True)
    assert isinstance(r.tensor, torch.nn.Parameter) and r.tensor.requires_grad and r.tag == "float"
    with torch.no_grad():
        r.tensor.fill_(2.0)
    assert torch.equal(f, torch.full((3,), 2.0)), "a Parameter is on the producer's memory: %s" % f
    del r
    c.poll(0)
    p.wait_released(sf, timeout=5)
    tshare.send(p, f, tag="frozen")
    r = c.recv(timeout=5, as_parameter=True, requires_grad=False)
    assert isinstance(r.tensor, torch.nn.Parameter) and not r.tensor.requires_grad
    del r
    tshare.send(p, i, tag="int")
    r = tshare.recv(c, timeout=5, as_parameter=True)
    assert isinstance(r.tensor, torch.nn.Parameter) and not r.tensor.requires_grad and r.tensor.dtype == torch.int32
    del r
    si = tshare.send(p, i, tag="int with grad")
    expect_error(tshare.E_INVALID_ARG, "cannot require gradients", tshare.recv, c, timeout=5, as_parameter=True,
                 requires_grad=True)
    c.poll(0)
    p.wait_released(si, timeout=5)  # refused, so released back
    c.poll(0)
    p.wait_released(timeout=5)
    p.close()
    c.close()


if __name__ == "__main__":
    test.main()
