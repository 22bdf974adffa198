// Example trainer: keeps its model in shared memory, updates the weights in
// place every step and pushes each version to every inference worker as one
// tensor set (metadata: the version) through one SetSender, waiting until
// each worker is done with it before the next update. Nothing is copied:
// the workers read this process's memory.
//
//   tshare-launch --consumers 2 --producer "weight_sync_trainer --versions 5" \
//                 --consumer "weight_sync_worker"
#include "weight_sync.h"

#include <tshare/torch_set.h>

#include <cstdio>
#include <cstring>
#include <vector>

static int versions_arg(int argc, char **argv) {
  for (int i = 1; i + 1 < argc; i++)
    if (std::strcmp(argv[i], "--versions") == 0) return std::atoi(argv[i + 1]);
  return 5;
}

int main(int argc, char **argv) {
  int versions = versions_arg(argc, argv);
  tshare_role role;
  tshare_error err;
  if (tshare_role_from_env(&role, &err) != TSHARE_OK) {
    std::fprintf(stderr, "weight_sync_trainer: %s (run it under tshare-launch)\n", err.message);
    return 1;
  }
  std::vector<tshare::torch::ChannelPtr> owned;
  std::vector<tshare_channel *> workers;
  for (int i = 0; i < role.nchannels; i++) {
    tshare_channel *ch = nullptr;
    if (tshare_role_open_channel(&role, i, nullptr, &ch, &err) != TSHARE_OK) {
      std::fprintf(stderr, "weight_sync_trainer: %s\n", err.message);
      return 1;
    }
    owned.emplace_back(ch);
    workers.push_back(ch);
  }
  torch::NoGradGuard no_grad;
  torch::nn::Sequential model = weight_sync_model();
  size_t k = 0;
  for (auto &p : model->parameters()) p.copy_(weights_at(k++, p.sizes(), 0));
  // Once: the module's own parameters move into shared memory, in place.
  tshare::torch::share_module_(*model);

  int failures = 0;
  // Kept across the versions: it sends the set it built for version 1 again,
  // with each new version's metadata, as long as the parameters stay put.
  tshare::torch::SetSender sender;
  try {
    for (int v = 1; v <= versions; v++) {
      for (auto &p : model->parameters()) p.add_(kSyncStep); // the training step, in place
      auto results = sender.send_all(workers, model->named_parameters(), {version_meta(v)}, 60000);
      for (const auto &r : results)
        if (!r.ok()) {
          std::fprintf(stderr, "weight_sync_trainer: version %d: %s\n", v, r.error.c_str());
          failures++;
        }
    }
  } catch (const tshare::torch::Error &e) {
    std::fprintf(stderr, "weight_sync_trainer: %s\n", e.what());
    return 1;
  }
  for (tshare_channel *w : workers) tshare_channel_send_bye(w, 0, 10000);
  size_t bytes = 0;
  for (auto &p : model->parameters()) bytes += p.nbytes();
  std::printf("weight_sync_trainer: %d versions of %zu tensors (%.1f KiB) updated in place and pushed to %zu "
              "workers (the set built %llu time(s)), %d failed hand-offs\n",
              versions, model->parameters().size(), double(bytes) / 1024, workers.size(),
              (unsigned long long)sender.builds(), failures);
  tshare_role_report(&role, "versions", versions);
  return failures == 0 ? 0 : 1;
}
