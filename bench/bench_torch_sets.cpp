// A model's state through the LibTorch bridge, CPU: a 290-tensor state_dict
// (a 24-layer transformer's names and shapes, scaled down) handed to a
// consumer process and released back, per model: as one tensor set
// (send_set / recv_set) of tensors in one memory each, as one set of tensors
// in one memory (what share_module_ makes of a module), and as one share per
// tensor (send / recv in a loop), in one run. The producer updates the weights in place before every
// hand-off, as a trainer does.
//
//   bench_torch_sets [--iters N] [--warmup W] [--hidden H]
//
// Prints one line per way: p50 and p99 per model, and per tensor, and
// whether the set meets the target (per model <= 300 us).
#include <tshare/torch_set.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

namespace tt = tshare::torch;

static const int TIMEOUT = 60000;
static const double TARGET_US = 300;

static long arg_long(int argc, char **argv, const char *name, long fallback) {
  for (int i = 1; i + 1 < argc; i++)
    if (std::strcmp(argv[i], name) == 0) return std::atol(argv[i + 1]);
  return fallback;
}

// 2 embeddings + 24 layers x 12 tensors = 290, in shared memory: each in a
// memory of its own, or all of them views of one buffer (one memory to
// travel), as share_module_ lays out a module.
static tt::NamedTensors transformer_state(int64_t h, bool arena) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  auto add = [&](const std::string &name, std::vector<int64_t> sizes) { shapes.emplace_back(name, sizes); };
  add("embed_tokens.weight", {1024, h});
  for (int l = 0; l < 24; l++) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char *w : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
      add(p + "self_attn." + w + ".weight", {h, h});
      add(p + "self_attn." + w + ".bias", {h});
    }
    add(p + "mlp.up_proj.weight", {4 * h, h});
    add(p + "mlp.down_proj.weight", {h, 4 * h});
    add(p + "input_layernorm.weight", {h});
    add(p + "post_attention_layernorm.weight", {h});
  }
  add("norm.weight", {h});
  int64_t total = 0;
  for (auto &e : shapes) total += c10::multiply_integers(e.second);
  at::Tensor all = arena ? tt::empty_shared({total}, at::kBFloat16) : at::Tensor();
  tt::NamedTensors state;
  int64_t at = 0;
  for (auto &e : shapes) {
    int64_t n = c10::multiply_integers(e.second);
    state.emplace_back(e.first, arena ? all.narrow(0, at, n).view(e.second) : tt::empty_shared(e.second, at::kBFloat16));
    at += n;
  }
  return state;
}

// The consumer: takes every hand-off ("set": one set; "loop": tensors until
// the one tagged "last") and drops it at once, which releases it.
static int consumer(int fd) {
  tshare_channel *ch = nullptr;
  tshare_error err;
  if (tshare_channel_open_socket(fd, nullptr, &ch, &err) != TSHARE_OK) return 1;
  tt::ChannelPtr owned(ch);
  try {
    for (;;) {
      auto first = tt::recv(ch, {TIMEOUT}); // "set" or "loop" announces the way
      if (!first) return 0;
      if (first->tag == "set") {
        first.reset();
        if (!tt::recv_set(ch, {TIMEOUT})) return 1;
      } else {
        first.reset();
        while (auto r = tt::recv(ch, {TIMEOUT}))
          if (r->tag == "last") break;
      }
    }
  } catch (const std::exception &e) {
    std::fprintf(stderr, "bench_torch_sets consumer: %s\n", e.what());
    return 1;
  }
}

struct Stats {
  double p50, p99;
};

static Stats stats(std::vector<double> us) {
  std::sort(us.begin(), us.end());
  return {us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 99 / 100)]};
}

// One hand-off's round trip; *send_us gets the producer's sending part.
static double handoff_us(tshare_channel *ch, const tt::NamedTensors &state, bool as_set, const at::Tensor &marker,
                         double *send_us) {
  using clock = std::chrono::steady_clock;
  for (auto &e : state) e.second.add_(1); // the trainer's in-place step (not timed)
  auto t0 = clock::now();
  tt::send(ch, marker, {as_set ? "set" : "loop"});
  if (as_set) {
    tt::send_set(ch, state, {"version"});
  } else {
    for (size_t i = 0; i < state.size(); i++) tt::send(ch, state[i].second, {i + 1 == state.size() ? "last" : ""});
  }
  auto t1 = clock::now();
  if (tshare_channel_wait_released(ch, 0, TIMEOUT) != TSHARE_OK) throw std::runtime_error(tshare_channel_last_error(ch));
  *send_us = std::chrono::duration<double, std::micro>(t1 - t0).count();
  return std::chrono::duration<double, std::micro>(clock::now() - t0).count();
}

int main(int argc, char **argv) {
  long iters = arg_long(argc, argv, "--iters", 200), warmup = arg_long(argc, argv, "--warmup", 20);
  int64_t hidden = arg_long(argc, argv, "--hidden", 256);
  // One thread: an idle intra-op pool spinning after the update would take
  // the cores the consumer needs, and time that is not the hand-off's.
  at::set_num_threads(1);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    _exit(consumer(sv[1]));
  }
  close(sv[1]);
  tshare_channel *ch = nullptr;
  tshare_error err;
  if (tshare_channel_open_socket(sv[0], nullptr, &ch, &err) != TSHARE_OK) {
    std::fprintf(stderr, "bench_torch_sets: %s\n", err.message);
    return 1;
  }
  tt::NamedTensors own = transformer_state(hidden, false), arena = transformer_state(hidden, true);
  at::Tensor marker = tt::empty_shared({1});
  size_t bytes = 0;
  for (auto &e : own) bytes += e.second.nbytes();
  std::printf("bench_torch_sets: %zu bf16 tensors, %.1f MiB, CPU, %ld hand-offs each way after %ld warm-up\n",
              own.size(), double(bytes) / (1 << 20), iters, warmup);
  struct Way {
    const char *name;
    const tt::NamedTensors &state;
    bool as_set;
  } ways[] = {{"one set, 290 memories", own, true},
              {"one set, one memory", arena, true},
              {"one send() per tensor", own, false}};
  int status = 0;
  try {
    for (const Way &w : ways) {
      std::vector<double> us, send_us;
      for (long i = 0; i < warmup + iters; i++) {
        double sent;
        double t = handoff_us(ch, w.state, w.as_set, marker, &sent);
        if (i >= warmup) us.push_back(t), send_us.push_back(sent);
      }
      Stats s = stats(us);
      std::printf("%-24s per model p50 %8.1f us  p99 %8.1f us  (sending %7.1f us)  per tensor p50 %6.2f us", w.name,
                  s.p50, s.p99, stats(send_us).p50, s.p50 / double(w.state.size()));
      if (w.as_set) std::printf("  target <= %.0f us: %s", TARGET_US, s.p50 <= TARGET_US ? "MET" : "MISSED");
      std::printf("\n");
    }
  } catch (const std::exception &e) {
    std::fprintf(stderr, "bench_torch_sets: %s\n", e.what());
    status = 1;
  }
  tshare_channel_send_bye(ch, 0, TIMEOUT);
  tshare_channel_close(ch);
  int st = 0;
  waitpid(pid, &st, 0);
  return status || !WIFEXITED(st) || WEXITSTATUS(st) ? 1 : 0;
}
