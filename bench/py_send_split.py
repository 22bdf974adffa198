#!/usr/bin/env python3
"""Where a Python producer's send of a kept 290-tensor set goes, split: the
list of the mapping's items (what the send no longer builds), set_key (the
key the kept set is recognised by, timed on that list), _send_set (the C
side: the kept set compared, the stream asked, the core's send), the wait
for the release, and tshare.send whole. One consumer process (sets_py_peer's).

    PYTHONPATH=<build>/python python3 bench/py_send_split.py [cuda|cpu]
"""
import sys, os, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sets_py_peer as sp
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
way = sp.TshareWay(1, False, False)  # forks the consumer before CUDA is touched
import torch, tshare
from tshare import _sets, _torch
sd = sp.state_dict(1232 if dev == "cuda" else 256, dev, "tshare")
ch = way.chs[0]
c = ch._c
for i in range(20):
    way.handoff(sd, i)
clk = time.perf_counter_ns
P, K, S, T, W = [], [], [], [], []
for i in range(400):
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = clk(); pairs = list(sd.items()); t1 = clk()
    key = _sets._native.set_key(pairs, _sets._PLAIN); t2 = clk()
    sid, _ = c._send_set(None, _sets._TO_DLPACK, _sets._meta_bytes(b"v=%d" % i), 60000, _torch._current_stream, True, key)
    t3 = clk()
    assert sid is not None
    ch.wait_released(timeout=60); t4 = clk()
    if dev == "cuda":
        torch.cuda.synchronize()
    t5 = clk(); tshare.send(ch, sd, meta=b"v=%d" % i, timeout=60); t6 = clk()
    ch.wait_released(timeout=60)
    P.append(t1 - t0); K.append(t2 - t1); S.append(t3 - t2); W.append(t4 - t3); T.append(t6 - t5)
for n, x in (("items list", P), ("set_key", K), ("_send_set kept", S), ("wait_released", W), ("tshare.send whole", T)):
    x.sort(); print("%s: %s p50 %.1f us p90 %.1f" % (dev, n, x[len(x) // 2] / 1e3, x[len(x) * 9 // 10] / 1e3))
way.close()
