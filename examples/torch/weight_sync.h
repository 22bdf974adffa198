// What the weight-sync trainer and its inference workers agree on, C++ and
// Python alike (examples/python/weight_sync.py says the same): the model's
// shape, the step the trainer takes, and the weights of every version (a
// formula, so a worker can check it sees exactly version v, not a mix).
#ifndef TSHARE_EXAMPLE_WEIGHT_SYNC_H
#define TSHARE_EXAMPLE_WEIGHT_SYNC_H

#include <torch/torch.h>

#include <string>

constexpr int64_t kSyncInputs = 32, kSyncHidden = 64, kSyncOutputs = 8;
// The trainer's update: every weight grows by 1/16 per version (exact in
// float32, so a worker compares with torch::equal).
constexpr double kSyncStep = 0.0625;

inline torch::nn::Sequential weight_sync_model() {
  return torch::nn::Sequential(torch::nn::Linear(kSyncInputs, kSyncHidden), torch::nn::ReLU(),
                               torch::nn::Linear(kSyncHidden, kSyncOutputs));
}

// Tensor k of the state at version v: multiples of 1/1024 below 2 in
// magnitude at version 0, plus v steps.
inline torch::Tensor weights_at(size_t k, at::IntArrayRef sizes, int version) {
  torch::Tensor x = torch::arange(c10::multiply_integers(sizes), torch::kFloat) * 0.01 + double(k);
  return (torch::round(torch::sin(x) * 1024) / 1024 + version * kSyncStep).view(sizes);
}

inline std::string version_meta(int version) { return "version=" + std::to_string(version); }

// The version in a set's metadata, or -1 when it carries none.
inline int version_of(const std::string &meta) {
  return meta.rfind("version=", 0) == 0 ? std::atoi(meta.c_str() + 8) : -1;
}

#endif
