"""Example consumer in Python: runs inference with weights that live in the
server's process (the LibTorch C++ examples/torch/weights_server or
weights_server.py). Receives the weights as zero-copy tensors, then batches;
checks each batch arrived intact, computes the logits and writes them into
the server's output tensor.

  tshare-launch --consumers 2 --producer build/examples/torch/weights_server \
                --consumer "python3 inference_worker.py"
"""
import sys

import torch
import torch.nn.functional as F

import tshare

BATCH, INPUTS = 32, 64


def batch_input(b, device):
    return torch.sin(torch.arange(BATCH * INPUTS, device=device) * 0.01 + float(b)).view(BATCH, INPUTS)


def main():
    role = tshare.role()
    if role is None:
        sys.exit("inference_worker.py: run me under tshare-launch")
    ch = role.channel(0)
    weights = {}  # "0.weight", "0.bias", "2.weight", "2.bias"
    answered = intact = 0
    with torch.no_grad():
        while True:
            r = tshare.recv(ch, timeout=60)
            if r is None:
                break
            if r.tag.startswith("weight "):
                weights[r.tag[7:]] = r.tensor
                continue
            b = int(r.tag.split()[1])  # "batch N"
            x = r.tensor
            out = tshare.recv(ch, timeout=60)
            if out is None or out.tag != "logits %d" % b:
                sys.exit("inference_worker.py: expected the logits of batch %d" % b)
            intact += torch.equal(x, batch_input(b, x.device))
            h = F.relu(F.linear(x, weights["0.weight"], weights["0.bias"]))
            out.tensor.copy_(F.linear(h, weights["2.weight"], weights["2.bias"]))
            answered += 1
            del r, x, out  # both shares are released here, not when the next batch comes
    weights.clear()
    print("inference_worker.py %d: %d batches answered, %d arrived intact" % (role.rank, answered, intact))
    role.report("verified", intact)
    ch.close()
    return 0 if intact == answered else 1


if __name__ == "__main__":
    sys.exit(main())
