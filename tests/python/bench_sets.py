"""A 24-layer transformer's CPU state_dict (290 tensors, fp32, small sizes)
from one process to another: one tensor set per hand-off against one
tshare.send per tensor and torch.multiprocessing's q.put(state_dict), in one
run.

    PYTHONPATH=build/python python3 tests/python/bench_sets.py [--rounds N] [--dim D]

Per hand-off, the producer's send time and the round trip (send, the
consumer takes every tensor and drops it, the producer sees the release).
The producer updates the model in place between hand-offs (share_model_),
as a trainer does. Not a test: it prints figures.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import tshare


class Layer(torch.nn.Module):
    """12 tensors: two norms and q, k, v, o, two MLP projections with biases."""

    def __init__(self, d):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)


def transformer(d, layers=24):
    m = torch.nn.Module()
    m.embed = torch.nn.Embedding(512, d)
    m.pos = torch.nn.Embedding(128, d)
    m.layers = torch.nn.ModuleList(Layer(d) for _ in range(layers))
    return m


def consume(fd):
    ch = tshare.open_socket(fd, name="bench consumer")
    while True:
        r = tshare.recv(ch, timeout=60)
        if r is None:
            break
        for t in r.tensors.values():
            pass  # taken: a real consumer would load them
        del r, t
        ch.poll(0)  # the release goes out now
    ch.close()
    os._exit(0)


def run(p, sd, rounds, as_set, model):
    sends, trips = [], []
    items = list(sd.items())
    for i in range(rounds):
        with torch.no_grad():
            model.embed.weight[0, 0] = i  # an update in place, as an optimizer step
        t0 = time.perf_counter()
        if as_set:
            tshare.send(p, sd, meta=b"version %d" % i, timeout=30)
        else:
            for name, t in items:
                tshare.send(p, t, tag=name[-64:], timeout=30)
        t1 = time.perf_counter()
        p.wait_released(timeout=30)
        t2 = time.perf_counter()
        sends.append(t1 - t0)
        trips.append(t2 - t0)
    return statistics.median(sends) * 1e6, statistics.median(trips) * 1e6


def _mp_consumer(q, done):
    while True:
        sd = q.get()
        if sd is None:
            return
        del sd
        done.put(1)


def torch_mp_trip(model, rounds):
    """torch.multiprocessing's q.put(state_dict) to a child that takes it
    and answers: the median round trip."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("fork")
    q, done = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_mp_consumer, args=(q, done))
    child.start()
    model.share_memory()
    trips = []
    for i in range(rounds + 3):
        t0 = time.perf_counter()
        q.put(model.state_dict())
        done.get()
        if i >= 3:
            trips.append(time.perf_counter() - t0)
    q.put(None)
    child.join()
    return statistics.median(trips) * 1e6


def state_dict_time(model, rounds=20):
    """What model.state_dict() costs by itself (a sender calls it per hand-off)."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        model.state_dict()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--dim", type=int, default=64)
    a = ap.parse_args()
    model = transformer(a.dim)
    tshare.share_model_(model)
    sd = model.state_dict()
    assert len(sd) == 290, len(sd)
    x, y = tshare.socketpair()
    pid = os.fork()
    if pid == 0:
        os.close(x)
        consume(y)
    os.close(y)
    p = tshare.open_socket(x, name="bench producer")
    run(p, sd, 10, True, model)  # warm up both paths
    run(p, sd, 3, False, model)
    set_send, set_trip = run(p, sd, a.rounds, True, model)
    loop_send, loop_trip = run(p, sd, max(10, a.rounds // 10), False, model)
    sd_time = state_dict_time(model)
    p.close()
    os.waitpid(pid, 0)
    mp_trip = torch_mp_trip(transformer(a.dim), max(10, a.rounds // 10))
    mib = sum(t.numel() * t.element_size() for t in sd.values()) / 2**20
    print("CPU state_dict: %d tensors, %.1f MiB fp32, median of %d hand-offs" % (len(sd), mib, a.rounds))
    print("  one set:            send %8.1f us   round trip %8.1f us" % (set_send, set_trip))
    print("  one send per tensor: send %8.1f us   round trip %8.1f us" % (loop_send, loop_trip))
    print("  torch.mp q.put(state_dict):               round trip %8.1f us" % mp_trip)
    print("  set vs torch.mp: %.1fx (round trip)" % (mp_trip / set_trip))
    print("  set vs loop: %.1fx (send), %.1fx (round trip); model.state_dict() itself: %.1f us"
          % (loop_send / set_send, loop_trip / set_trip, sd_time * 1e6))
    target = 1000.0
    print("  target <= %.0f us per model (round trip): %s" % (target, "MET" if set_trip <= target else "MISSED"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
