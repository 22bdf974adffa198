"""Example trainer in Python: the weight-sync pattern. The model's own
storage becomes shared memory once (tshare.share_model_); every step updates
the weights in place and pushes the whole state_dict to every inference
worker as one tensor set, the version in the metadata, then waits until each
worker is done with it before the next update. Nothing is copied: the
workers (the LibTorch C++ examples/torch/weight_sync_worker or
weight_sync_worker.py) read this process's memory.

  tshare-launch --consumers 2 --producer "python3 weight_sync_trainer.py --versions 5" \\
                --consumer build/examples/torch/weight_sync_worker
"""
import argparse
import sys

import torch

import tshare
from weight_sync import STEP, model, version_meta, weights_at


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--versions", type=int, default=5)
    a = ap.parse_args()
    role = tshare.role()
    if role is None:
        sys.exit("weight_sync_trainer.py: run me under tshare-launch")
    workers = role.channels()
    net = model()
    with torch.no_grad():
        for k, p in enumerate(net.parameters()):
            p.copy_(weights_at(k, p.shape, 0))
    tshare.share_model_(net)  # once: the module itself owns the shared memory
    failures = 0
    for v in range(1, a.versions + 1):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(STEP)  # the training step, in place
        state = net.state_dict()
        for i, w in enumerate(workers):
            try:
                tshare.send(w, state, meta=version_meta(v), timeout=60)
            except tshare.Error as e:
                print("weight_sync_trainer.py: version %d, worker %d: %s" % (v, i, e), file=sys.stderr)
                failures += 1
        for i, w in enumerate(workers):
            try:
                w.wait_released(timeout=60)  # every worker is done with version v
            except tshare.Error as e:
                print("weight_sync_trainer.py: version %d, worker %d: %s" % (v, i, e), file=sys.stderr)
                failures += 1
    for w in workers:
        w.send_bye(timeout=10)
    kib = sum(p.numel() * p.element_size() for p in net.parameters()) / 1024
    print("weight_sync_trainer.py: %d versions of %d tensors (%.1f KiB) updated in place and pushed to %d workers, "
          "%d failed hand-offs" % (a.versions, len(state), kib, len(workers), failures))
    role.report("versions", a.versions)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
