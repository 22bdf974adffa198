#!/usr/bin/env python3
"""Two paired measurements of the Python package's model hand-off, each
way alternating with its baseline in one process (the machines are noisy):

  bench/py_fanout_paired.py fanout   4 consumer processes; a new 290-tensor
      bf16 CUDA model (first) and the same model updated in place (update),
      handed over by tshare.send_all or by a loop of tshare.send then
      wait_released per channel
  bench/py_fanout_paired.py items    one consumer; the send call of a first
      hand-off with the CUDA members' fields read in C++ (set_items_cuda) or
      by the two-pass path it replaced (native set_items, then the Python
      _with_cuda loop)

Prints p50 per way. Needs CUDA, tshare._torch_native and bench/ on the path
(run from the repository root with PYTHONPATH=build/python).
"""
import os
import sys
import time

import torch
import tshare
from tshare import _sets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sets_py_peer import TshareWay, shapes  # noqa: E402  (its consumers drop each hand-off at once)


def cuda_or_end(way):
    """Asked once the consumers forked (a child forked after CUDA started cannot use it)."""
    if torch.cuda.is_available():
        return True
    print("skip: torch sees no CUDA device")
    way.close()
    return False


def model():
    sd = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes(1232)}
    torch.cuda.synchronize()
    return sd


def p50(name, samples):
    samples.sort()
    print("%s: p50 %.0f us (n=%d)" % (name, samples[len(samples) // 2], len(samples)), flush=True)


def fanout():
    way = TshareWay(4, False)
    if not cuda_or_end(way):
        return 77
    chs = way.chs

    def by_loop(sd):
        ids = [tshare.send(ch, sd, meta=b"v", timeout=60) for ch in chs]
        for ch, i in zip(chs, ids):
            ch.wait_released(i, timeout=60)

    def by_send_all(sd):
        assert all(r.ok and r.released for r in tshare.send_all(chs, sd, meta=b"v", timeout=60))

    ways = {"loop": by_loop, "send_all": by_send_all}
    first = {k: [] for k in ways}
    for i in range(40):
        k = "loop" if i % 2 else "send_all"
        sd = model()
        t0 = time.perf_counter_ns()
        ways[k](sd)
        if i >= 4:
            first[k].append((time.perf_counter_ns() - t0) / 1000)
        del sd
    update = {k: [] for k in ways}
    sd = model()
    for i in range(200):
        k = "loop" if (i // 2) % 2 else "send_all"  # each way twice in a row: the second from its kept set
        with torch.no_grad():
            for t in sd.values():
                t.add_(1)
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        ways[k](sd)
        if i >= 8 and i % 2:
            update[k].append((time.perf_counter_ns() - t0) / 1000)
    for name, d in (("first", first), ("update", update)):
        for k, v in d.items():
            p50("%s, 4 consumers, %s" % (name, k), v)
    return 0 if way.close() else 1


def items():
    way = TshareWay(1, False)
    if not cuda_or_end(way):
        return 77
    chs = way.chs
    native = _sets._native
    new_fn = native.set_items_cuda

    def old_fn(pairs, plain):
        got = native.set_items(pairs, plain)
        return None if got is None else (got, -1)

    times = {"old": [], "new": []}
    for i in range(64):
        which = "old" if i % 2 else "new"
        native.set_items_cuda = old_fn if which == "old" else new_fn
        sd = model()
        t0 = time.perf_counter_ns()
        sid = tshare.send(chs[0], sd, meta=b"v", timeout=60)
        t1 = time.perf_counter_ns()
        chs[0].wait_released(sid, timeout=60)
        if i >= 4:
            times[which].append((t1 - t0) / 1000)
        del sd
    native.set_items_cuda = new_fn
    for k, v in times.items():
        p50("%s: first hand-off's send call" % k, v)
    return 0 if way.close() else 1


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in ("fanout", "items"):
        print(__doc__)
        return 2
    if _sets._native is None:
        print("skip: tshare._torch_native is not built")
        return 77
    return fanout() if sys.argv[1] == "fanout" else items()


if __name__ == "__main__":
    sys.exit(main())
