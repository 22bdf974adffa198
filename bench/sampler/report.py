#!/usr/bin/env python3
"""Names the samples sampler.c wrote: for each process, the functions the
samples were in (self) and under (inclusive), and with --focus F the call
paths from each sample up to the nearest caller named F, most frequent
first. Addresses are named with addr2line from the mappings the process
wrote; a library without symbols shows as library+offset.

  report.py DIR [--top N] [--focus F] [--under F] [--min-samples N]

with --under F, the samples inside F by each function below it (where
the time of one call goes).
"""
import argparse
import collections
import glob
import os
import struct
import subprocess
import sys


def read_maps(path):
    maps = []
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) < 6 or "x" not in p[1]:
                continue
            lo, hi = (int(x, 16) for x in p[0].split("-"))
            maps.append((lo, hi, int(p[2], 16), p[5]))
    return maps


def read_samples(path):
    data = open(path, "rb").read()
    stacks, at = [], 0
    while at + 4 <= len(data):
        (n,) = struct.unpack_from("i", data, at)
        at += 4
        if n <= 0 or at + 8 * n > len(data):
            break
        # The first two frames are the signal handler's and the kernel's trampoline.
        stacks.append(struct.unpack_from("%dQ" % n, data, at)[2:])
        at += 8 * n
    return stacks


def name_addresses(stacks, maps):
    where, per_file = {}, collections.defaultdict(set)
    for stack in stacks:
        for a in stack:
            if a in where:
                continue
            for lo, hi, off, path in maps:
                if lo <= a < hi:
                    where[a] = (path, a - lo + off)
                    per_file[path].add(a - lo + off)
                    break
            else:
                where[a] = ("?", a)
    names = {}
    for path, offsets in per_file.items():
        offsets = sorted(offsets)
        try:  # a return address: the call is the byte before it
            out = subprocess.run(["addr2line", "-f", "-C", "-e", path] + ["0x%x" % (o - 1) for o in offsets],
                                 capture_output=True, text=True, timeout=600).stdout.split("\n")
        except (OSError, subprocess.TimeoutExpired):
            out = []
        for i, o in enumerate(offsets):
            fn = out[2 * i] if 2 * i < len(out) else "??"
            names[(path, o)] = fn if fn and fn != "??" else "%s+0x%x" % (os.path.basename(path), o)
    return {a: names.get(w, "%s+0x%x" % w) for a, w in where.items()}


def short(fn):
    return fn.split("(")[0][:60]


def report(pid, stacks, named, top, focus, under=None):
    total = len(stacks)
    frames = [[named[a] for a in s] for s in stacks if s]
    self_count = collections.Counter(f[0] for f in frames)
    inclusive = collections.Counter(fn for f in frames for fn in set(f))
    print("== process %s: %d samples" % (pid, total))
    print("  -- self")
    for fn, c in self_count.most_common(top):
        print("  %5.1f%%  %s" % (100.0 * c / total, fn[:120]))
    print("  -- inclusive")
    for fn, c in inclusive.most_common(top):
        print("  %5.1f%%  %s" % (100.0 * c / total, fn[:120]))
    if under:
        below = []  # each sample inside F: the frames below F's innermost call
        for f in frames:
            hit = next((i for i, fn in enumerate(f) if under in fn), None)
            if hit is not None:
                below.append(f[:hit])
        print("  -- under %s: %.1f%% of the samples; of those, in each function below it" %
              (under, 100.0 * len(below) / max(total, 1)))
        counts = collections.Counter(fn for f in below for fn in set(f))
        counts["(%s itself)" % under] = sum(1 for f in below if not f)
        for fn, c in counts.most_common(top):
            print("  %5.1f%%  %s" % (100.0 * c / max(len(below), 1), fn[:120]))
    if focus:
        paths = collections.Counter()
        for f in frames:
            hit = next((i for i, fn in enumerate(f) if focus in fn), None)
            if hit is not None:
                paths[" <- ".join(short(fn) for fn in f[:hit + 1])] += 1
        print("  -- paths up to %s: %.1f%% of the samples" % (focus, 100.0 * sum(paths.values()) / total))
        for p, c in paths.most_common(top):
            print("  %5.1f%%  %s" % (100.0 * c / total, p))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--focus", help="a function name (or part of one): the paths from each sample up to it")
    ap.add_argument("--under", help="a function name (or part of one): the samples in it, by each function below it "
                    "(inclusive, as a share of those samples)")
    ap.add_argument("--min-samples", type=int, default=20, help="processes with fewer are left out")
    args = ap.parse_args()
    found = sorted(glob.glob(os.path.join(args.dir, "s.*")))
    if not found:
        print("report.py: no samples in %s (was SAMPLE_DIR set, and the sampler preloaded?)" % args.dir,
              file=sys.stderr)
        return 1
    for path in found:
        pid = path.rsplit(".", 1)[1]
        stacks = read_samples(path)
        maps_path = os.path.join(args.dir, "m." + pid)
        if len(stacks) < args.min_samples or not os.path.exists(maps_path):
            continue
        report(pid, stacks, name_addresses(stacks, read_maps(maps_path)), args.top, args.focus, args.under)
    return 0


if __name__ == "__main__":
    sys.exit(main())
