"""Example inference worker in Python: receives each version of the trainer's
weights (the LibTorch C++ examples/torch/weight_sync_trainer or
weight_sync_trainer.py) as one tensor set of zero-copy tensors, checks it
sees exactly that version's values, runs a forward pass with them and lets
go, which tells the trainer it may update again.

  tshare-launch --consumers 2 --producer build/examples/torch/weight_sync_trainer \\
                --consumer "python3 weight_sync_worker.py"
"""
import sys

import torch
import torch.nn.functional as F

import tshare
from weight_sync import INPUTS, version_meta, version_of, weights_at


def main():
    role = tshare.role()
    if role is None:
        sys.exit("weight_sync_worker.py: run me under tshare-launch")
    ch = role.channel(0)
    last = intact = count = 0
    output_sum = 0.0
    with torch.no_grad():
        while True:
            r = tshare.recv(ch, timeout=60)
            if r is None:
                break
            v = version_of(r.meta)
            if v != last + 1:
                sys.exit("weight_sync_worker.py: expected %r, got %r" % (version_meta(last + 1), r.meta))
            last = v
            w = r.tensors
            intact += all(torch.equal(t, weights_at(k, t.shape, v)) for k, t in enumerate(w.values()))
            count = len(w)
            y = F.linear(F.relu(F.linear(torch.ones(4, INPUTS), w["0.weight"], w["0.bias"])), w["2.weight"], w["2.bias"])
            output_sum = float(y.sum())
            del r, w  # the set goes back to the trainer now, not when the next one comes
    print("weight_sync_worker.py %d: versions 1..%d of %d tensors received in place, %d with every value right; "
          "last output sum %.3f" % (role.rank, last, count, intact, output_sum))
    role.report("verified", intact)
    ch.close()
    return 0 if last > 0 and intact == last else 1


if __name__ == "__main__":
    sys.exit(main())
