"""Example producer in Python: shares a model's weights with every worker
(zero-copy) and hands out batches round robin with an output tensor each;
the workers write the logits in place. The workers may be the LibTorch C++
examples/torch/inference_worker or inference_worker.py: same wire format.

  tshare-launch --consumers 3 --producer "python3 weights_server.py" \
                --consumer build/examples/torch/inference_worker
  (--device cuda on both for GPU memory; --batches N)
"""
import argparse
import sys

import torch

import tshare

BATCH, INPUTS, HIDDEN, CLASSES = 32, 64, 128, 10


def batch_input(b, device):
    """The formula both sides know, so a worker can check a batch arrived intact."""
    return torch.sin(torch.arange(BATCH * INPUTS, device=device) * 0.01 + float(b)).view(BATCH, INPUTS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    role = tshare.role()
    if role is None:
        sys.exit("weights_server.py: run me under tshare-launch")
    device = torch.device(a.device)
    workers = role.channels()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))
    model.to(device)
    with torch.no_grad():
        for p in model.parameters():
            tshare.share_memory_(p)  # CPU weights into shared memory once; CUDA memory is shared as it is
        for w in workers:
            for name, p in model.named_parameters():
                tshare.send(w, p, tag="weight " + name)
        inputs, outputs = [], []
        for b in range(a.batches):
            inputs.append(batch_input(b, device))
            # CPU answers must land in shared memory; GPU memory is shared as is.
            out = torch.zeros(BATCH, CLASSES, device=device) if device.type == "cuda" else tshare.empty_shared(BATCH, CLASSES)
            outputs.append(out)
            w = workers[b % len(workers)]
            tshare.send(w, inputs[-1], tag="batch %d" % b)
            tshare.send(w, out, tag="logits %d" % b)
        for w in workers:
            w.send_bye(timeout=10)
            w.wait_released(timeout=60)  # every worker is done with every tensor
        right = sum(torch.allclose(outputs[b], model(inputs[b]), 1e-4, 1e-5) for b in range(a.batches))
    weight_kib = sum(p.numel() * p.element_size() for p in model.parameters()) / 1024
    print("weights_server.py: %d weight tensors (%.1f KiB, %s) shared with %d workers, not copied; "
          "%d of %d batches answered correctly in place" % (len(list(model.parameters())), weight_kib, device,
                                                             len(workers), right, a.batches))
    role.report("shared", a.batches)
    return 0 if right == a.batches else 1


if __name__ == "__main__":
    sys.exit(main())
