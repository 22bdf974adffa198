// Example consumer: runs inference with weights that live in the server's
// process. Receives the weights (zero-copy views of the server's tensors),
// then batches; checks each batch arrived intact, computes the logits and
// writes them into the server's output tensor.
#include "model.h"

#include <tshare/torch.h>

#include <cstdio>
#include <map>

int main() {
  tshare_role role;
  tshare_error err;
  tshare_channel *raw = nullptr;
  if (tshare_role_from_env(&role, &err) != TSHARE_OK || tshare_role_open_channel(&role, 0, nullptr, &raw, &err) != TSHARE_OK) {
    std::fprintf(stderr, "inference_worker: %s (run it under tshare-launch)\n", err.message);
    return 1;
  }
  tshare::torch::ChannelPtr ch(raw);
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> weights; // "0.weight", "0.bias", "2.weight", "2.bias"
  int answered = 0, intact = 0;
  try {
    while (auto r = tshare::torch::recv(ch.get(), {60000})) {
      if (r->tag.rfind("weight ", 0) == 0) {
        weights[r->tag.substr(7)] = r->tensor;
        continue;
      }
      int64_t b = std::stoll(r->tag.substr(6)); // "batch N"
      torch::Tensor x = r->tensor;
      auto out = tshare::torch::recv(ch.get(), {60000});
      if (!out || out->tag != "logits " + std::to_string(b)) throw std::runtime_error("expected the logits of batch " + std::to_string(b));
      if (torch::equal(x, batch_input(b, x.device()))) intact++;
      torch::Tensor h = torch::relu(torch::linear(x, weights.at("0.weight"), weights.at("0.bias")));
      out->tensor.copy_(torch::linear(h, weights.at("2.weight"), weights.at("2.bias")));
      answered++;
    } // x and the output die here: both shares are released
  } catch (const std::exception &e) {
    std::fprintf(stderr, "inference_worker %d: %s\n", role.rank, e.what());
    return 1;
  }
  std::printf("inference_worker %d: %zu weight tensors mapped from the server, %d batches answered in place\n",
              role.rank, weights.size(), answered);
  weights.clear();
  tshare_role_report(&role, "verified", intact);
  return intact == answered ? 0 : 1;
}
