// The LibTorch bridge's hand-off, for tshare-bench: the same 4 KiB float32
// tensor round trip as the torch.multiprocessing peer, tensor in and tensor
// out: tshare::torch::send, the consumer's recv gives an at::Tensor, and
// dropping it releases the share. Eight tensors are reused in turn.
//
//   bench_torch --device cuda|cpu --iters N --warmup W
//   bench_torch --device cuda|cpu --pipelined N   (64 in flight, no round trip)
//
// Prints "result p50_us=... p99_us=... n=... torch=..." (pipelined:
// "result shares_per_s=... n=... fds_before=... fds_after=... gpu_free_before=...
// gpu_free_after=... (MiB) consumer_mappings_before=... consumer_mappings_after=...
// consumer_fds_before=... consumer_fds_after=... torch=...": the consumer's
// figures come over a pipe on its fd 4, taken at the first timed share and
// at the end) or "skip: why" (exit 77).
// The consumer is this binary again (--consumer, posix_spawn: a CUDA process
// must not fork).
#include <tshare/torch.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cerrno>
#include <fcntl.h>
#include <string>
#include <unistd.h>
#include <vector>

#if TSHARE_HAVE_CUDA
extern "C" {
#include "cuda_driver.h" // the driver as tshare loaded it
}
#endif

static const int TIMEOUT = 60000;

static long arg_long(int argc, char **argv, const char *name, long fallback) {
  for (int i = 1; i + 1 < argc; i++)
    if (std::strcmp(argv[i], name) == 0) return std::atol(argv[i + 1]);
  return fallback;
}

static std::string arg_str(int argc, char **argv, const char *name, const char *fallback) {
  for (int i = 1; i + 1 < argc; i++)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return fallback;
}

static long open_fds() {
  long n = 0;
  char path[64];
  for (int fd = 0; fd < 4096; fd++) {
    std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    if (access(path, F_OK) == 0) n++;
  }
  return n;
}

// The GPU's free memory in MiB, -1 if unknown.
static double gpu_free_mib() {
#if TSHARE_HAVE_CUDA
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  size_t free_b = 0, total = 0;
  if (cu && cu->cuMemGetInfo(&free_b, &total) == CUDA_SUCCESS) return double(free_b) / (1 << 20);
#endif
  return -1;
}

static unsigned long long open_mappings() {
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  return st.imports + st.fd_imports - st.import_closes;
}

static int consumer() {
  tshare_channel *ch = nullptr;
  tshare_error err;
  if (tshare_channel_open_socket(3, nullptr, &ch, &err) != TSHARE_OK) {
    std::fprintf(stderr, "bench_torch consumer: %s\n", err.message);
    return 1;
  }
  tshare::torch::ChannelPtr owned(ch);
  unsigned long long mappings_before = 0;
  long fds_before = 0;
  try {
    while (auto got = tshare::torch::recv(ch, {TIMEOUT})) {
      if (got->tensor.numel() != 1024) return 1; // usable here; dropping it releases the share
      if (got->tag != "start") continue;
      got.reset(); // released: the baseline is of what stays between hand-offs
      mappings_before = open_mappings();
      fds_before = open_fds();
    }
  } catch (const std::exception &e) {
    std::fprintf(stderr, "bench_torch consumer: %s\n", e.what());
    return 1;
  }
  FILE *report = fdopen(4, "w");
  if (report) {
    std::fprintf(report, "consumer_mappings_before=%llu consumer_mappings_after=%llu consumer_fds_before=%ld "
                         "consumer_fds_after=%ld\n",
                 mappings_before, open_mappings(), fds_before, open_fds());
    std::fclose(report);
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 1 && std::strcmp(argv[1], "--consumer") == 0) return consumer();
  std::string device = arg_str(argc, argv, "--device", "cuda");
  long iters = arg_long(argc, argv, "--iters", 10000), warmup = arg_long(argc, argv, "--warmup", 1000);
  tshare_error err;
  if (device == "cuda") {
    if (tshare_cuda_init(&err) != TSHARE_OK) {
      std::printf("skip: %s\n", err.message);
      return 77;
    }
    if (!at::hasCUDA()) {
      std::printf("skip: this LibTorch has no CUDA\n");
      return 77;
    }
  }
  int sv[2];
  if (tshare_socketpair(sv, &err) != TSHARE_OK) {
    std::printf("error: %s\n", err.message);
    return 1;
  }
  int report[2];
  if (pipe2(report, O_CLOEXEC) != 0) {
    std::printf("error: pipe: %s\n", std::strerror(errno));
    return 1;
  }
  char *child_argv[] = {(char *)"/proc/self/exe", (char *)"--consumer", nullptr};
  tshare_fd_map fds[2] = {{3, sv[1]}, {4, report[1]}};
  tshare_spawn_options so = {};
  so.file = "/proc/self/exe";
  so.argv = child_argv;
  so.fds = fds;
  so.nfds = 2;
  tshare_process *child = nullptr;
  if (tshare_spawn(&so, &child, &err) != TSHARE_OK) {
    std::printf("error: %s\n", err.message);
    return 1;
  }
  close(sv[1]);
  close(report[1]);
  tshare_channel *ch = nullptr;
  if (tshare_channel_open_socket(sv[0], nullptr, &ch, &err) != TSHARE_OK) {
    std::printf("error: %s\n", err.message);
    tshare_process_destroy(child);
    return 1;
  }
  long pipelined = arg_long(argc, argv, "--pipelined", 0);
  double shares_per_s = 0;
  long fds_before = 0, fds_after = 0;
  double gpu_before = -1, gpu_after = -1;
  std::vector<double> us;
  try {
    std::vector<at::Tensor> pool;
    for (int i = 0; i < 8; i++) {
      at::Tensor t = device == "cuda" ? at::full({1024}, float(i), at::TensorOptions().device(at::kCUDA))
                                      : tshare::torch::empty_shared({1024}).fill_(float(i));
      pool.push_back(t);
    }
    if (pipelined > 0) { // 64 in flight, each waited for only when the window is full
      std::vector<uint64_t> window;
      window.reserve(64);
      size_t oldest = 0;
      const char *tag = "";
      auto step = [&](long i) {
        uint64_t id = tshare::torch::send(ch, pool[size_t(i % 8)], {tag, TIMEOUT});
        tag = "";
        if (window.size() < 64) {
          window.push_back(id);
          return;
        }
        int rc = tshare_channel_wait_released(ch, window[oldest], TIMEOUT);
        if (rc != TSHARE_OK) throw tshare::torch::Error(rc, tshare_channel_last_error(ch));
        window[oldest] = id;
        oldest = (oldest + 1) % window.size();
      };
      for (long i = 0; i < 1000; i++) step(i); // warm: caches filled, pools made
      tshare_channel_wait_released(ch, 0, TIMEOUT);
      window.clear();
      oldest = 0;
      fds_before = open_fds();
      if (device == "cuda") gpu_before = gpu_free_mib();
      tag = "start"; // the consumer takes its own baseline here
      auto t0 = std::chrono::steady_clock::now();
      for (long i = 0; i < pipelined; i++) step(i);
      int rc = tshare_channel_wait_released(ch, 0, TIMEOUT);
      auto t1 = std::chrono::steady_clock::now();
      if (rc != TSHARE_OK) throw tshare::torch::Error(rc, tshare_channel_last_error(ch));
      fds_after = open_fds();
      if (device == "cuda") gpu_after = gpu_free_mib();
      shares_per_s = double(pipelined) / std::chrono::duration<double>(t1 - t0).count();
    }
    for (long i = 0; pipelined == 0 && i < warmup + iters; i++) {
      auto t0 = std::chrono::steady_clock::now();
      uint64_t id = tshare::torch::send(ch, pool[size_t(i % 8)], {"", TIMEOUT});
      int rc = tshare_channel_wait_released(ch, id, TIMEOUT);
      auto t1 = std::chrono::steady_clock::now();
      if (rc != TSHARE_OK) throw tshare::torch::Error(rc, tshare_channel_last_error(ch));
      if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    tshare_channel_send_bye(ch, 0, TIMEOUT);
    tshare_channel_wait_released(ch, 0, TIMEOUT);
  } catch (const std::exception &e) {
    std::printf("error: %s\n", e.what());
    tshare_channel_close(ch);
    tshare_process_destroy(child);
    return 1;
  }
  tshare_channel_close(ch);
  tshare_exit_status st;
  if (tshare_process_wait(child, TIMEOUT, &st) != TSHARE_OK || st.kind != TSHARE_EXIT_CODE || st.value != 0) {
    std::printf("error: the consumer failed\n");
    tshare_process_destroy(child);
    return 1;
  }
  tshare_process_destroy(child);
  if (pipelined > 0) {
    char consumer_said[256] = "";
    FILE *from = fdopen(report[0], "r");
    if (!from || !std::fgets(consumer_said, sizeof consumer_said, from)) std::strcpy(consumer_said, "\n");
    if (from) std::fclose(from);
    std::printf("result shares_per_s=%.0f n=%ld fds_before=%ld fds_after=%ld gpu_free_before=%.0f gpu_free_after=%.0f "
                "torch=%s %s",
                shares_per_s, pipelined, fds_before, fds_after, gpu_before, gpu_after, TORCH_VERSION, consumer_said);
    return 0;
  }
  close(report[0]);
  std::sort(us.begin(), us.end());
  auto pct = [&](double p) { // nearest rank, as tshare-bench takes it
    size_t rank = size_t(std::ceil(p / 100.0 * double(us.size())));
    return us[std::min(us.size(), std::max<size_t>(rank, 1)) - 1];
  };
  std::printf("result p50_us=%.2f p99_us=%.2f n=%zu torch=%s\n", pct(50), pct(99), us.size(), TORCH_VERSION);
  return 0;
}
