// What both sides of the example agree on: the model's shape and the input
// batches (a formula, so the worker can check a batch arrived intact).
#ifndef TSHARE_EXAMPLE_TORCH_MODEL_H
#define TSHARE_EXAMPLE_TORCH_MODEL_H

#include <torch/torch.h>

#include <cstring>
#include <string>

constexpr int64_t kBatch = 32, kInputs = 64, kHidden = 128, kClasses = 10;

inline torch::Tensor batch_input(int64_t b, const torch::Device &device) {
  return torch::sin(torch::arange(kBatch * kInputs, torch::TensorOptions().device(device)) * 0.01 + double(b))
      .view({kBatch, kInputs});
}

// "--device cuda" anywhere in argv selects the GPU.
inline torch::Device device_from_args(int argc, char **argv) {
  for (int i = 1; i + 1 < argc; i++)
    if (std::strcmp(argv[i], "--device") == 0 && std::strcmp(argv[i + 1], "cuda") == 0) return torch::kCUDA;
  return torch::kCPU;
}

inline int int_arg(int argc, char **argv, const char *name, int fallback) {
  for (int i = 1; i + 1 < argc; i++)
    if (std::strcmp(argv[i], name) == 0) return std::atoi(argv[i + 1]);
  return fallback;
}

#endif
