#!/usr/bin/env python3
"""The torch.multiprocessing baseline of tshare-bench.

The same hand-off as tshare's latency rows: a 4 KiB float32 tensor goes to
another process, which gets a usable tensor and acknowledges. Here through a
spawn-context Queue, as PyTorch documents for CUDA tensors. Eight tensors are
reused in turn (CPU ones already in shared memory), so the consumer's cache of
opened handles is warm, like tshare's reused-allocation row.

Prints one line: "result p50_us=... p99_us=... n=... torch=..." or, where
python3 has no torch (or no GPU for --device cuda), "skip: why" and exits 77.
"""
import argparse
import sys
import time


def consumer(q_in, q_ack):
    while True:
        t = q_in.get()
        if t is None:
            break
        q_ack.put(t.numel())  # the tensor is mapped and usable here
        del t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    ap.add_argument("--iters", type=int, default=10000)
    ap.add_argument("--warmup", type=int, default=1000)
    args = ap.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        print(f"skip: python3 has no torch ({e})", flush=True)
        return 77
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skip: torch sees no CUDA device", flush=True)
        return 77
    ctx = mp.get_context("spawn")
    q_in, q_ack = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(q_in, q_ack), daemon=True)
    proc.start()
    pool = [torch.full((1024,), float(i), device=args.device) for i in range(8)]
    if args.device == "cpu":
        for t in pool:
            t.share_memory_()
    else:
        torch.cuda.synchronize()
    samples = []
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter_ns()
        q_in.put(pool[i % 8])
        if q_ack.get(timeout=60) != 1024:
            print("skip: the consumer saw a wrong tensor", flush=True)
            return 1
        t1 = time.perf_counter_ns()
        if i >= args.warmup:
            samples.append(t1 - t0)
    q_in.put(None)
    proc.join(timeout=30)
    samples.sort()
    n = len(samples)
    pct = lambda p: samples[min(n - 1, max(0, -(-p * n // 100) - 1))] / 1000.0
    print(f"result p50_us={pct(50):.2f} p99_us={pct(99):.2f} n={n} torch={torch.__version__}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
