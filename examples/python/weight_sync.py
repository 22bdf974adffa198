"""What the weight-sync trainers and workers agree on, C++ and Python alike
(examples/torch/weight_sync.h says the same): the model's shape, the step the
trainer takes, and the weights of every version, a formula, so a worker can
check it sees exactly version v and not a mix of two."""
import math

import torch

INPUTS, HIDDEN, OUTPUTS = 32, 64, 8
STEP = 0.0625  # every weight grows by 1/16 per version: exact in float32


def model():
    return torch.nn.Sequential(torch.nn.Linear(INPUTS, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUTPUTS))


def weights_at(k, shape, version):
    """Tensor k of the state at version: multiples of 1/1024 plus version steps."""
    x = torch.arange(math.prod(shape), dtype=torch.float32) * 0.01 + float(k)
    return (torch.round(torch.sin(x) * 1024) / 1024 + version * STEP).view(shape)


def version_meta(version):
    return b"version=%d" % version


def version_of(meta):
    """The version in a set's metadata, or -1."""
    return int(meta[8:]) if meta and meta.startswith(b"version=") else -1
