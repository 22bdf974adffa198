"""A Python role for tshare-launch: produce or consume the tensors of cases.py.

  peer.py produce [--device cpu|cuda] [--tags T,T,...] [--set]
  peer.py consume [--device cpu|cuda]

The producer shares every case with every consumer (tag = case name), waits
until each is released, and says bye; with --set it sends them all as one
tensor set instead (names = case names, metadata "cases", the layouts of one
dtype on one shared base). A consumer checks every tensor, alone or in a set,
against the case its tag or name names and exits 1 on the first difference. Figures go to the
launcher's summary ("shared", "verified"). Exit 77 when cuda is asked for and
torch has no GPU here."""
import argparse
import sys

try:
    import torch
except ImportError:
    print("SKIP: this Python has no torch (Debian: apt-get install python3-torch)")
    sys.exit(77)

import cases
import tshare


SET_META = b"cases"


def as_one_set(tags):
    """The cases of tags as one set: each dtype's base in shared memory once,
    its layouts views of it."""
    bases, sent = {}, {}
    for tag in tags:
        dtype_name, layout = tag.split("/")
        if dtype_name not in bases:
            bases[dtype_name] = tshare.share_memory_(cases.base(cases.DTYPES[dtype_name]))
        sent[tag] = cases.LAYOUTS[layout](bases[dtype_name])
    return sent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["produce", "consume"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tags", default="")
    ap.add_argument("--set", action="store_true", help="produce: every case in one tensor set")
    ap.add_argument("--first-refused", default="", help="consume: the first share must be refused with this message")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device here")
        return 77
    role = tshare.role()
    if role is None:
        print("peer.py: run me under tshare-launch", file=sys.stderr)
        return 2
    if a.mode == "produce":
        tags = a.tags.split(",") if a.tags else cases.all_tags()
        channels = role.channels()
        if a.set:
            sent = as_one_set(tags)
            for ch in channels:
                tshare.send(ch, sent, meta=SET_META, timeout=30)
            tags = []  # sent
        for tag in tags:
            t = cases.case(tag, a.device)
            for ch in channels:
                tshare.send(ch, t, tag=tag, timeout=30)
            if a.device == "cuda":
                torch.cuda.current_stream().synchronize()
        for ch in channels:
            ch.wait_released(timeout=60)
            ch.close()
        shared = len(a.tags.split(",") if a.tags else cases.all_tags())
        role.report("shared", shared)
        print("python producer: shared %d tensors with %d consumer(s)" % (shared, len(channels)))
        return 0
    ch = role.channel(0)
    verified = 0
    if a.first_refused:
        try:
            tshare.recv(ch, timeout=60)
            print("python consumer: WRONG the first share was taken", file=sys.stderr)
            return 1
        except tshare.Error as e:
            if e.code != tshare.E_UNSUPPORTED or a.first_refused not in str(e):
                print("python consumer: WRONG refusal: %s" % e, file=sys.stderr)
                return 1
            print("python consumer: refused as expected: %s" % e)
    while True:
        r = tshare.recv(ch, timeout=60)
        if r is None:
            break
        if r.tensor is None and r.meta != SET_META:
            print("python consumer: WRONG set metadata %r" % r.meta, file=sys.stderr)
            return 1
        for name, t in r.tensors.items():  # a set's, or {tag: tensor}
            why = cases.check(name, t, a.device)
            if why:
                print("python consumer: WRONG " + why, file=sys.stderr)
                return 1
            verified += 1
        del r, t  # released now, not when the next one arrives
    role.report("verified", verified)
    print("python consumer: verified %d tensors" % verified)
    return 0


if __name__ == "__main__":
    sys.exit(main())
