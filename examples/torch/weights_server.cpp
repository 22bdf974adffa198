// Example producer: holds a model's weights and hands batches to inference
// workers. The weights are shared once with every worker and never copied:
// the workers compute with this process's memory. Each batch goes to one
// worker (round robin) with an output tensor that the worker fills in place;
// the server checks every answer against its own forward pass.
//
//   tshare-launch --consumers 2 --producer "weights_server --batches 8 [--device cuda]" \
//                 --consumer "inference_worker"
#include "model.h"

#include <tshare/torch.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char **argv) {
  // Nothing to set up for the fast path: the workers keep the memory of the
  // weights mapped between hand-offs in either allocator mode (the default
  // caching allocator's segments, or expandable segments; docs/cuda.md).
  torch::Device device = device_from_args(argc, argv);
  int batches = int_arg(argc, argv, "--batches", 8);
  tshare_role role;
  tshare_error err;
  if (tshare_role_from_env(&role, &err) != TSHARE_OK) {
    std::fprintf(stderr, "weights_server: %s (run it under tshare-launch)\n", err.message);
    return 1;
  }
  std::vector<tshare::torch::ChannelPtr> workers;
  for (int i = 0; i < role.nchannels; i++) {
    tshare_channel *ch = nullptr;
    if (tshare_role_open_channel(&role, i, nullptr, &ch, &err) != TSHARE_OK) {
      std::fprintf(stderr, "weights_server: %s\n", err.message);
      return 1;
    }
    workers.emplace_back(ch);
  }
  torch::NoGradGuard no_grad;
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(kInputs, kHidden), torch::nn::ReLU(),
                              torch::nn::Linear(kHidden, kClasses));
  model->to(device);

  try {
    size_t weight_bytes = 0;
    for (auto &w : workers)
      for (auto &p : model->named_parameters()) {
        tshare::torch::send(w.get(), p.value(), {"weight " + p.key()});
        if (&w == &workers.front()) weight_bytes += p.value().nbytes();
      }
    std::vector<torch::Tensor> inputs, outputs;
    for (int b = 0; b < batches; b++) {
      inputs.push_back(batch_input(b, device));
      // CPU answers must land in shared memory; GPU memory is shared as is.
      outputs.push_back(device.is_cuda() ? torch::zeros({kBatch, kClasses}, torch::TensorOptions().device(device))
                                         : tshare::torch::empty_shared({kBatch, kClasses}));
      tshare_channel *w = workers[size_t(b) % workers.size()].get();
      tshare::torch::send(w, inputs.back(), {"batch " + std::to_string(b)});
      tshare::torch::send(w, outputs.back(), {"logits " + std::to_string(b)});
    }
    for (auto &w : workers) {
      tshare_channel_send_bye(w.get(), 0, 10000);
      if (tshare_channel_wait_released(w.get(), 0, 60000) != TSHARE_OK) {
        std::fprintf(stderr, "weights_server: %s\n", tshare_channel_last_error(w.get()));
        return 1;
      }
    }
    int right = 0;
    for (int b = 0; b < batches; b++)
      if (torch::allclose(outputs[size_t(b)], model->forward(inputs[size_t(b)]), 1e-4, 1e-5)) right++;
    std::printf("weights_server: %zu weight tensors (%.1f KiB, %s) shared with %zu workers, not copied; "
                "%d of %d batches answered correctly in place\n",
                model->parameters().size(), double(weight_bytes) / 1024, device.str().c_str(), workers.size(), right,
                batches);
    tshare_role_report(&role, "shared", batches);
    return right == batches ? 0 : 1;
  } catch (const tshare::torch::Error &e) {
    std::fprintf(stderr, "weights_server: %s\n", e.what());
    return 1;
  }
}
