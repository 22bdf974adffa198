// Example inference worker: receives each version of the trainer's weights
// as one tensor set (zero-copy views of the trainer's memory), checks it sees
// exactly that version's values, runs a forward pass with them and lets go,
// which tells the trainer it may update again. Works with the C++ trainer
// (weight_sync_trainer) and the Python one (examples/python/weight_sync_trainer.py).
#include "weight_sync.h"

#include <tshare/torch_set.h>

#include <cstdio>

int main() {
  tshare_role role;
  tshare_error err;
  tshare_channel *raw = nullptr;
  if (tshare_role_from_env(&role, &err) != TSHARE_OK || tshare_role_open_channel(&role, 0, nullptr, &raw, &err) != TSHARE_OK) {
    std::fprintf(stderr, "weight_sync_worker: %s (run it under tshare-launch)\n", err.message);
    return 1;
  }
  tshare::torch::ChannelPtr ch(raw);
  torch::NoGradGuard no_grad;
  int last = 0, intact = 0;
  size_t tensors = 0;
  double output_sum = 0;
  // Kept across the versions: it makes the tensors of the next version
  // while it waits, from the layout of this one.
  tshare::torch::SetReceiver receiver;
  try {
    while (auto r = receiver.recv(ch.get(), {60000})) {
      int v = version_of(r->meta);
      if (v != last + 1) throw std::runtime_error("expected version " + std::to_string(last + 1) + ", got '" + r->meta + "'");
      last = v;
      bool same = true;
      size_t k = 0;
      for (const auto &item : r->tensors) same = same && torch::equal(item.value(), weights_at(k++, item.value().sizes(), v));
      if (same) intact++;
      tensors = r->tensors.size();
      const auto &w = r->tensors;
      torch::Tensor x = torch::ones({4, kSyncInputs});
      torch::Tensor y = torch::linear(torch::relu(torch::linear(x, w["0.weight"], w["0.bias"])), w["2.weight"], w["2.bias"]);
      output_sum = y.sum().item<double>();
    } // r goes: the set is released to the trainer
  } catch (const std::exception &e) {
    std::fprintf(stderr, "weight_sync_worker %d: %s\n", role.rank, e.what());
    return 1;
  }
  std::printf("weight_sync_worker %d: versions 1..%d of %zu tensors received in place, %d with every value "
              "right; last output sum %.3f\n",
              role.rank, last, tensors, intact, output_sum);
  tshare_role_report(&role, "verified", intact);
  return intact == last && last > 0 ? 0 : 1;
}
