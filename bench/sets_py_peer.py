#!/usr/bin/env python3
"""A model's state_dict from Python, for tshare-bench: a 24-layer
transformer's 290 bf16 tensors (the names and shapes of bench_torch_sets)
handed to 1 or more consumer processes, per model, by one of:

  --impl tshare       tshare.send(ch, state_dict, meta=...): one tensor set
                      (tshare.send_all(channels, ...) to several consumers)
  --impl tshare-loop  one tshare.send per tensor
  --impl torch-mp     torch.multiprocessing: q.put(state_dict), the consumer
                      takes every tensor and answers on a second queue

with --into, a tshare consumer keeps the first version's tensors and takes
each next version into them (r.release(), tshare.recv(ch, into=r)) rather
than dropping them and getting new ones.

with --pack, the model's tensors are parameters of a module packed by
tshare.share_model_(module, pack_cuda=True): one allocation of the GPU (one
CUDA IPC mapping for a consumer to open) or one shared buffer on the CPU.

each twice: the first hand-off (a new model, its memory already shared and
allocated before the clock starts: CPU tensors from tshare.empty_shared or
share_memory_()) and the repeated update (the same storages updated in place
and sent again, a new version in the metadata). A hand-off ends when every
consumer let go of it (tshare: the release came back; torch.mp: the answer).

Prints "result first_p50_us=... first_p99_us=... update_p50_us=...
update_p99_us=... n=... tensors=290 mib=... hidden=... torch=..." last, or
"skip: why" (exit 77). tshare consumers are forked before anything touches
CUDA; torch.mp ones are its own processes (spawn for CUDA, fork for CPU).
--busy-thread runs a Python thread beside the producer's sends (the GIL busy).
"""
import argparse
import math
import os
import sys
import threading
import time


def shapes(h):
    out = [("embed_tokens.weight", (1024, h))]
    for l in range(24):
        p = "model.layers.%d." % l
        for w in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.append((p + "self_attn.%s.weight" % w, (h, h)))
            out.append((p + "self_attn.%s.bias" % w, (h,)))
        out += [(p + "mlp.up_proj.weight", (4 * h, h)), (p + "mlp.down_proj.weight", (h, 4 * h)),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("norm.weight", (h,)))
    return out


def state_dict(h, device, impl, pack=False):
    import torch
    import tshare

    if pack:  # the module's parameters moved into one allocation (CUDA) or one shared buffer (CPU)
        module = torch.nn.Module()
        names = [name for name, _ in shapes(h)]
        for i, (name, shape) in enumerate(shapes(h)):
            t = torch.zeros(shape, dtype=torch.bfloat16, device=device)
            module.register_parameter("p%d" % i, torch.nn.Parameter(t, requires_grad=False))
        tshare.share_model_(module, pack_cuda=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return {name: t for name, t in zip(names, module.state_dict().values())}
    sd = {}
    for name, shape in shapes(h):
        if device == "cuda":
            sd[name] = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        elif impl == "torch-mp":
            sd[name] = torch.zeros(shape, dtype=torch.bfloat16).share_memory_()
        else:
            sd[name] = tshare.empty_shared(*shape, dtype=torch.bfloat16)
    if device == "cuda":
        torch.cuda.synchronize()
    return sd


def now_us():  # CLOCK_MONOTONIC: one clock for every process of the machine
    return time.monotonic_ns() / 1000.0


def timeline_start(meta):  # the send call's start (us), written by the producer into an update's metadata
    at = meta.find(b" at=") if meta else -1
    return float(meta[at + 4:]) if at >= 0 else None


def since_ns(start_us):  # pct() takes nanoseconds
    return (now_us() - start_us) * 1000.0


def print_timeline(received, dropped, ahead):
    if received:
        print("update timeline, consumer, p50 from the send call's start: tensors received %.1f us, "
              "dropped and release sent %.1f us; %d of %d sets came as tensors recv made while it waited"
              % (pct(received, 50), pct(dropped, 50), ahead[1], ahead[2]), flush=True)


def tshare_consumer(fd, loop, into=False):
    import tshare

    received, dropped = [], []  # the update timeline, for where its time goes
    sets = 0
    r = None
    with tshare.open_socket(fd, name="bench consumer") as ch:
        while True:
            r = tshare.recv(ch, timeout=60, into=r if into else None)
            if r is None:
                print_timeline(received, dropped, ch._c._ahead_counts + (sets,))
                return 0
            sets += not loop
            if loop:  # one share per tensor, the last tagged "last"
                while r.tag != "last":
                    del r
                    r = tshare.recv(ch, timeout=60)
            elif len(r.tensors) != 290:
                return 1
            sent_at = None if loop else timeline_start(r.meta)
            if sent_at is not None:
                received.append(since_ns(sent_at))
            if into:
                r.release()  # its tensors stay for the next version
            else:
                r = None  # dropping it releases the set
            ch.poll(0)
            if sent_at is not None:
                dropped.append(since_ns(sent_at))


def mp_consumer(q, done):
    while True:
        sd = q.get()
        if sd is None:
            return
        n = len(sd)  # every tensor unpickled, its storage mapped or opened
        del sd
        done.put(n)


class TshareWay:
    def __init__(self, consumers, loop, into=False):
        import tshare

        self.tshare, self.loop, self.chs, self.children = tshare, loop, [], []
        self.sent_ns = None
        for _ in range(consumers):
            a, b = tshare.socketpair()
            pid = os.fork()  # before anything touched CUDA: each consumer starts its own
            if pid == 0:
                os.close(a)
                for ch in self.chs:
                    ch.close()  # the copies a fork gave this child: nothing is sent
                os._exit(tshare_consumer(b, loop, into))
            os.close(b)
            self.children.append(pid)
            self.chs.append(tshare.open_socket(a, name="bench producer"))

    def handoff(self, sd, version, timeline=False):
        if self.loop:
            items = list(sd.items())
            for ch in self.chs:
                for i, (name, t) in enumerate(items):
                    self.tshare.send(ch, t, tag="last" if i + 1 == len(items) else "", timeout=60)
        else:
            meta = b"version=%d" % version + (b" at=%.3f" % now_us() if timeline else b"")
            if len(self.chs) > 1:  # the fan-out: the set built once, sent to each, every release awaited
                self.sent_ns = None  # sending and waiting are one call
                for r in self.tshare.send_all(self.chs, sd, meta=meta, timeout=60):
                    if not (r.ok and r.released):
                        raise r.error or RuntimeError("a consumer kept its set")
                return
            self.tshare.send(self.chs[0], sd, meta=meta, timeout=60)
        self.sent_ns = time.perf_counter_ns()  # the send call(s) done, the releases not yet
        for ch in self.chs:
            ch.wait_released(timeout=60)

    def close(self):
        for ch in self.chs:
            ch.close()
        return all(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 for pid in self.children)


class TorchMpWay:
    def __init__(self, consumers, device):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn" if device == "cuda" else "fork")
        self.qs = [(ctx.Queue(), ctx.Queue()) for _ in range(consumers)]
        self.procs = [ctx.Process(target=mp_consumer, args=q, daemon=True) for q in self.qs]
        for p in self.procs:
            p.start()

    def handoff(self, sd, version, timeline=False):
        for q, _ in self.qs:
            q.put(sd)
        for _, done in self.qs:
            if done.get(timeout=60) != len(sd):
                raise RuntimeError("a consumer saw a wrong state_dict")

    def close(self):
        for q, _ in self.qs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
        return True


def pct(samples, p):  # nearest rank, as tshare-bench takes it
    s = sorted(samples)
    return s[min(len(s), max(1, math.ceil(p / 100 * len(s)))) - 1] / 1000.0


def measure(way, args, impl):
    import torch

    clock = time.perf_counter_ns
    first, update, update_send = [], [], []
    for i in range(args.warmup + (args.first_iters or args.iters)):
        sd = state_dict(args.hidden, args.device, impl, args.pack)  # not timed: the model's own allocation
        t0 = clock()
        way.handoff(sd, i)
        if i >= args.warmup:
            first.append(clock() - t0)
        del sd
    sd = state_dict(args.hidden, args.device, impl, args.pack)
    if args.busy_thread:  # from here on: the first hand-offs' model building would take a switch interval per op
        threading.Thread(target=busy_python, daemon=True).start()
    for i in range(args.warmup + args.iters):
        with torch.no_grad():  # the trainer's step, in place (not timed)
            if args.busy_thread:  # one call: beside the busy thread each op would wait a switch interval
                torch._foreach_add_(list(sd.values()), 1)
            else:
                for t in sd.values():
                    t.add_(1)
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        way.handoff(sd, i, timeline=i >= args.warmup)
        if i >= args.warmup:
            update.append(clock() - t0)
            if getattr(way, "sent_ns", None) is not None:
                update_send.append(way.sent_ns - t0)
    mib = sum(t.numel() * t.element_size() for t in sd.values()) / 2**20
    return first, update, update_send, mib


def busy_python():
    """Python work that never waits: the GIL is taken from it only when another thread asks."""
    n = 0
    while True:
        n += 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["tshare", "tshare-loop", "torch-mp"], default="tshare")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--consumers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=0)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--first-iters", type=int, default=0,
                    help="first hand-offs to time (default --iters): fewer keep a profile of the updates short")
    ap.add_argument("--busy-thread", action="store_true",
                    help="a thread of the producer runs Python meanwhile (a data loader, a logger): the GIL is busy")
    ap.add_argument("--into", action="store_true",
                    help="the consumer takes each version into the first one's tensors (tshare.recv into=)")
    ap.add_argument("--pack", action="store_true",
                    help="the model's tensors in one allocation, as tshare.share_model_(m, pack_cuda=True) leaves them")
    args = ap.parse_args()
    try:
        import torch

        import tshare  # noqa: F401
    except ImportError as e:
        print(f"skip: {sys.executable} cannot import torch and tshare ({e})", flush=True)
        return 77
    args.hidden = args.hidden or (1232 if args.device == "cuda" else 256)
    torch.set_num_threads(1)  # the consumers need the cores more than the update does
    # The consumers are forked first: asking torch whether it sees a GPU
    # initializes CUDA, and a child forked after that cannot use it.
    way = TorchMpWay(args.consumers, args.device) if args.impl == "torch-mp" else \
        TshareWay(args.consumers, args.impl == "tshare-loop", args.into)
    if args.device == "cuda" and not torch.cuda.is_available():
        way.close()
        print("skip: torch sees no CUDA device", flush=True)
        return 77
    try:
        first, update, update_send, mib = measure(way, args, args.impl)
    except tshare.Error as e:
        way.close()
        unsupported = e.code == tshare.E_UNSUPPORTED  # tensor sets of CUDA memory, where this version refuses them
        print(f"{'skip' if unsupported else 'error'}: {e}", flush=True)
        return 77 if unsupported else 1
    if not way.close():
        print("error: a consumer failed", flush=True)
        return 1
    print(f"{args.impl}, {args.device}, {args.consumers} consumer(s), 290 bf16 tensors, {mib:.1f} MiB "
          f"(hidden {args.hidden}): first p50 {pct(first, 50):.1f} us, update p50 {pct(update, 50):.1f} us"
          + (f" (of which in the send call {pct(update_send, 50):.1f} us)" if update_send else ""))
    print(f"result first_p50_us={pct(first, 50):.2f} first_p99_us={pct(first, 99):.2f} "
          f"update_p50_us={pct(update, 50):.2f} update_p99_us={pct(update, 99):.2f} n={args.iters} tensors=290 "
          f"mib={mib:.1f} hidden={args.hidden} torch={torch.__version__}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
