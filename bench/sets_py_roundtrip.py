#!/usr/bin/env python3
"""A 290-tensor state_dict from Python to Python in one process, on CPU:
sent, received, let go of and its release awaited, again and again with
the same tensors (the update pattern), in two layouts:

  model     share_model_ of 145 Linear(64, 64) layers: one memory for all
  separate  290 tshare.empty_shared tensors: a memory per tensor

Prints per layout the median send, recv (the consumer building its
tensors) and whole round trip in microseconds, and recv per member:

  PYTHONPATH=build/python python3 bench/sets_py_roundtrip.py [--rounds N]

Run it against two builds, interleaved, to compare them on a busy machine.
"""
import argparse
import statistics
import time

import torch
import tshare


def pair():
    import threading

    a, b = tshare.socketpair()
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("c", tshare.open_socket(b, name="consumer")))
    th.start()
    p = tshare.open_socket(a, name="producer")
    th.join()
    return p, out["c"]


def layouts():
    model = tshare.share_model_(torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(145)]))
    separate = {"t%d" % k: tshare.empty_shared(64, 64 if k % 2 else 1) for k in range(290)}
    return {"model": model.state_dict(), "separate": separate}


def warm(p, c, sd):
    """The first hand-offs, received from a thread: a set of new memories
    passes its fds, more than a socket holds before the consumer reads."""
    import threading

    for version in range(3):
        th = threading.Thread(target=lambda: tshare.recv(c, timeout=10))
        th.start()
        set_id = tshare.send(p, sd, meta=b"warm", timeout=10)
        th.join()
        c.poll(0)
        p.wait_released(set_id, timeout=10)


def measure(p, c, sd, rounds):
    send, recv, total = [], [], []
    for version in range(rounds):
        t0 = time.perf_counter()
        set_id = tshare.send(p, sd, meta=b"%d" % version, timeout=10)
        t1 = time.perf_counter()
        r = tshare.recv(c, timeout=10)
        t2 = time.perf_counter()
        assert len(r.tensors) == len(sd)
        del r
        c.poll(0)
        p.wait_released(set_id, timeout=10)
        t3 = time.perf_counter()
        send.append(t1 - t0)
        recv.append(t2 - t1)
        total.append(t3 - t0)
    return [statistics.median(x) * 1e6 for x in (send, recv, total)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    a = ap.parse_args()
    p, c = pair()
    for name, sd in layouts().items():
        warm(p, c, sd)  # the consumer's mappings, the kept set
        send, recv, total = measure(p, c, sd, a.rounds)
        print("%-8s send %7.1f us  recv %7.1f us (%.2f us/member)  round trip %7.1f us"
              % (name, send, recv, recv / len(sd), total))
    p.close()
    c.close()


if __name__ == "__main__":
    main()
