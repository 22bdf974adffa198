"""A producer under a low fd limit feeding several consumers many CUDA
tensors, in whichever allocator mode PYTORCH_CUDA_ALLOC_CONF sets:

  test_gpu_fd_limit.py [CONSUMERS TENSORS MIB]   (exit 0 pass, 1 fail, 77 skip)

The producer sets RLIMIT_NOFILE to 1024 (its consumers inherit it), keeps
TENSORS tensors of MIB MiB alive and sends every one to every consumer; each
consumer holds all it received, checks each is intact, then lets go. With
expandable segments every tensor spans several VMM chunks, each an fd when it
travels: what the producer keeps of them must stay bounded however many
consumers it feeds (defaults: 4 consumers, 200 tensors of 30 MiB)."""
import os
import resource
import subprocess
import sys
import time

try:
    import torch
except ImportError:
    print("SKIP: this Python has no torch (Debian: apt-get install python3-torch)")
    sys.exit(77)

import tshare

FD_LIMIT = 1024


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def lower_fd_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FD_LIMIT:
        print("SKIP: the hard fd limit %d is under %d" % (hard, FD_LIMIT))
        sys.exit(77)
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, hard))


def start_consumers(count, tensors, mib):
    chans, kids = [], []
    for i in range(count):
        a, b = tshare.socketpair()
        kids.append(subprocess.Popen([sys.executable, __file__, "_consumer", str(b), str(tensors), str(mib)],
                                     pass_fds=[b]))
        os.close(b)
        chans.append(tshare.open_socket(a, name="producer for consumer %d" % i))
    return chans, kids


def produce(consumers, tensors, mib):
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device here")
        sys.exit(77)
    lower_fd_limit()
    chans, kids = start_consumers(consumers, tensors, mib)
    n = mib * (1 << 20) // 4
    kept = [torch.full((n,), float(i), device="cuda") for i in range(tensors)]
    torch.cuda.synchronize()
    t0 = time.monotonic()
    most = open_fds()
    for i, t in enumerate(kept):
        for ch in chans:
            tshare.send(ch, t, tag=str(i), timeout=60)
        most = max(most, open_fds())
    for ch in chans:
        ch.send_bye(timeout=60)  # each consumer holds all it got until the stream ends
    for ch in chans:
        ch.wait_released(timeout=120)
    for ch in chans:
        ch.close()
    for k in kids:
        assert k.wait(timeout=60) == 0, "a consumer failed"
    mode = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default allocator"
    print("%d consumers x %d tensors of %d MiB under ulimit -n %d (%s): every one intact in %.1f s; "
          "the producer held at most %d fds" % (consumers, tensors, mib, FD_LIMIT, mode, time.monotonic() - t0, most))


def consume(fd, tensors, mib):
    n = mib * (1 << 20) // 4
    held = []
    with tshare.open_socket(int(fd), name="consumer") as ch:
        for r in ch:
            i = int(r.tag)
            assert r.tensor.is_cuda and r.tensor.numel() == n, (r.tensor.device, r.tensor.numel())
            assert bool((r.tensor == float(i)).all()), "tensor %d arrived changed" % i
            held.append(r)
        r = None
        assert len(held) == tensors, "%d of %d tensors came" % (len(held), tensors)
        del held[:]  # the releases go with the close


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_consumer":
        consume(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    args = [int(a) for a in sys.argv[1:4]] or [4, 200, 30]
    produce(*args)
