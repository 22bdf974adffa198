#!/usr/bin/env python3
"""The Python package's hand-off, for tshare-bench: the same 4 KiB float32
tensor round trip as the torch.multiprocessing peer and the LibTorch bridge's
row: tshare.send, the consumer's tshare.recv gives a torch tensor, and
dropping it releases the share; the producer waits for that release. Eight
tensors are reused in turn (CPU ones from tshare.empty_shared).

Prints "result p50_us=... p99_us=... n=... torch=..." or "skip: why" (exit 77).
The consumer is this script again (--consumer FD), started with exec.
"""
import argparse
import os
import subprocess
import sys
import time


def consumer(fd):
    import tshare

    with tshare.open_socket(fd, name="bench consumer") as ch:
        while True:
            r = tshare.recv(ch, timeout=60)
            if r is None:
                return 0
            if r.tensor.numel() != 1024:  # usable here; dropping it releases the share
                return 1
            del r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--iters", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--consumer", type=int, default=-1)
    args = ap.parse_args()
    try:
        import torch

        import tshare
    except ImportError as e:
        print(f"skip: {sys.executable} cannot import torch and tshare ({e})", flush=True)
        return 77
    if args.consumer >= 0:
        return consumer(args.consumer)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skip: torch sees no CUDA device", flush=True)
        return 77
    a, b = tshare.socketpair()
    child = subprocess.Popen([sys.executable, __file__, "--consumer", str(b)], pass_fds=[b])
    os.close(b)
    ch = tshare.open_socket(a, name="bench producer")
    if args.device == "cuda":
        pool = [torch.full((1024,), float(i), device="cuda") for i in range(8)]
        torch.cuda.synchronize()
    else:
        pool = [tshare.empty_shared(1024).fill_(float(i)) for i in range(8)]
    samples = []
    clock = time.perf_counter_ns
    for i in range(args.warmup + args.iters):
        t0 = clock()
        sid = tshare.send(ch, pool[i % 8], timeout=60)
        ch.wait_released(sid, timeout=60)
        t1 = clock()
        if i >= args.warmup:
            samples.append(t1 - t0)
    ch.close()
    if child.wait(timeout=60) != 0:
        print("error: the consumer failed", flush=True)
        return 1
    samples.sort()
    n = len(samples)
    pct = lambda p: samples[min(n - 1, max(0, -(-p * n // 100) - 1))] / 1000.0
    print(f"result p50_us={pct(50):.2f} p99_us={pct(99):.2f} n={n} torch={torch.__version__}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
