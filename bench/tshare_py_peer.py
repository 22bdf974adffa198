#!/usr/bin/env python3
"""The Python package's hand-off, for tshare-bench: the same 4 KiB float32
tensor round trip as the torch.multiprocessing peer and the LibTorch bridge's
row: tshare.send, the consumer's tshare.recv gives a torch tensor, and
dropping it releases the share; the producer waits for that release. Eight
tensors are reused in turn (CPU ones from tshare.empty_shared).

Prints "result p50_us=... p99_us=... n=... torch=..." or "skip: why" (exit 77).
The consumer is this script again (--consumer FD), started with exec.
--phases also prints each side's own p50 per call: the producer's send, the
consumer's recv of a share already queued, and dropping the received tensor
(the rest of the round trip is the frames and the waits).
"""
import argparse
import os
import subprocess
import sys
import time


def p50_us(samples):
    samples = sorted(samples)
    return samples[(len(samples) - 1) // 2] / 1000.0 if samples else float("nan")


def consumer(fd, ready_fd, phases):
    import tshare

    os.write(ready_fd, b"r")  # imported: the producer's hello need not outwait torch's import
    recv_ns, drop_ns = [], []
    clock = time.perf_counter_ns
    with tshare.open_socket(fd, name="bench consumer") as ch:
        while True:
            while phases and ch._c._peek() is False:  # recv's own time, not the wait for the share
                ch.poll(60)
            t0 = clock()
            r = tshare.recv(ch, timeout=60)
            t1 = clock()
            if r is None:
                break
            if r.tensor.numel() != 1024:  # usable here; dropping it releases the share
                return 1
            t2 = clock()
            del r
            if phases:
                recv_ns.append(t1 - t0)
                drop_ns.append(clock() - t2)
    if phases:
        os.write(ready_fd, b"recv=%.2f drop=%.2f" % (p50_us(recv_ns), p50_us(drop_ns)))
    os.close(ready_fd)
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--iters", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--consumer", type=int, default=-1)
    ap.add_argument("--ready", type=int, default=-1)
    ap.add_argument("--phases", action="store_true", help="also print each side's p50 per call")
    args = ap.parse_args()
    try:
        import torch

        import tshare
    except ImportError as e:
        print(f"skip: {sys.executable} cannot import torch and tshare ({e})", flush=True)
        return 77
    if args.consumer >= 0:
        return consumer(args.consumer, args.ready, args.phases)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skip: torch sees no CUDA device", flush=True)
        return 77
    a, b = tshare.socketpair()
    ready_r, ready_w = os.pipe()
    argv = [sys.executable, __file__, "--consumer", str(b), "--ready", str(ready_w)] + (["--phases"] if args.phases else [])
    child = subprocess.Popen(argv, pass_fds=[b, ready_w])
    os.close(b)
    os.close(ready_w)
    if os.read(ready_r, 1) != b"r":  # on a loaded machine importing torch alone can outlast a hello's timeout
        print("error: the consumer exited before it was ready", flush=True)
        return 1
    ch = tshare.open_socket(a, name="bench producer")
    if args.device == "cuda":
        pool = [torch.full((1024,), float(i), device="cuda") for i in range(8)]
        torch.cuda.synchronize()
    else:
        pool = [tshare.empty_shared(1024).fill_(float(i)) for i in range(8)]
    samples, send_ns = [], []
    clock = time.perf_counter_ns
    for i in range(args.warmup + args.iters):
        t0 = clock()
        sid = tshare.send(ch, pool[i % 8], timeout=60)
        ts = clock()
        ch.wait_released(sid, timeout=60)
        t1 = clock()
        if i >= args.warmup:
            samples.append(t1 - t0)
            send_ns.append(ts - t0)
    ch.close()
    consumer_phases = os.read(ready_r, 200).decode() if args.phases else ""
    os.close(ready_r)
    if child.wait(timeout=60) != 0:
        print("error: the consumer failed", flush=True)
        return 1
    if args.phases:
        print("phases p50_us: send=%.2f %s" % (p50_us(send_ns), consumer_phases), flush=True)
    samples.sort()
    n = len(samples)
    pct = lambda p: samples[min(n - 1, max(0, -(-p * n // 100) - 1))] / 1000.0
    print(f"result p50_us={pct(50):.2f} p99_us={pct(99):.2f} n={n} torch={torch.__version__}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
