// A model's state through the LibTorch bridge: a 290-tensor bf16 state_dict
// (a 24-layer transformer's names and shapes) handed to 1 or more consumer
// processes and released back, per model, in three ways: as one tensor set
// through a SetSender kept across the hand-offs (the documented pattern:
// sender.send, or send_all to several consumers), as one tensor set built
// anew each time (the free send_set / send_set_all), or as one send() per
// tensor; each twice: the first hand-off (a new model: memory the consumers
// have not seen, allocated before the clock starts) and the repeated update
// (the producer updates its storages in place and sends again, the version
// in the set's metadata, as a trainer does).
//
//   bench_torch_sets [--device cpu|cuda] [--consumers N] [--way set|set-free|loop]
//                    [--hidden H] [--iters N] [--warmup W] [--first-iters N]
//                    [--consumer bridge|into|recv-set|core|read|split] [--hold-us N] [--pack]
//
// --consumer bridge (the default) takes each set through one SetReceiver
// kept across them, as the update pattern does (the tensors of a set sent
// again made while it waited); into keeps the first set's tensors and takes
// each next version into them (release, SetReceiver::recv_into), as a
// consumer whose model runs on them does; recv-set through recv_set, each set's
// tensors made when it comes; core takes each set through the C API alone (tshare_set_recv,
// tshare_set_release), with no tensors made; read does the same and reads the
// first byte of each CPU member before the release, as a consumer using
// the weights would, and holds the set --hold-us more before the release
// (the producer's next frames queue up meanwhile); split takes it so and then
// makes its tensors (adopt_set), timing each step: where a consumer's time
// goes, the core's part or the bridge's and LibTorch's.
//
// Prints one line per measurement, then, last, the line tshare-bench reads:
// "result first_p50_us=... first_p99_us=... update_p50_us=... update_p99_us=...
// n=... tensors=290 mib=... hidden=... torch=..." or "skip: why" (exit 77).
// The consumers are forked before anything touches CUDA.
#include <tshare/torch_set.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/nn/module.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <sys/socket.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace tt = tshare::torch;

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

// --pack: the model's tensors are parameters of a module packed by
// share_module_(module, /*pack_cuda=*/true), one allocation (one mapping for
// a consumer to open) or one shared buffer.
static bool pack = false;

// 2 embeddings + 24 layers x 12 tensors = 290: on the GPU each tensor an
// allocation of the caching allocator, on the CPU each in shared memory of
// its own (what the bridge's empty_shared gives).
static tt::NamedTensors transformer_state(int64_t h, bool cuda) {
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
  tt::NamedTensors state;
  if (pack) { // parameters of a module, moved into one allocation (CUDA) or one shared buffer (CPU)
    ::torch::nn::Module module;
    for (size_t i = 0; i < shapes.size(); i++)
      module.register_parameter("p" + std::to_string(i),
                                at::zeros(shapes[i].second, at::TensorOptions().dtype(at::kBFloat16)
                                                                .device(cuda ? at::kCUDA : at::kCPU)),
                                /*requires_grad=*/false);
    tt::share_module_(module, /*pack_cuda=*/true);
    std::vector<at::Tensor> params = module.parameters();
    for (size_t i = 0; i < shapes.size(); i++) state.emplace_back(shapes[i].first, params[i]);
    return state;
  }
  for (auto &e : shapes)
    state.emplace_back(e.first, cuda ? at::zeros(e.second, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA))
                                     : tt::empty_shared(e.second, at::kBFloat16).zero_());
  return state;
}

// The timeline of an update, for where its time goes: the producer writes
// the send call's start ("at=", CLOCK_MONOTONIC in microseconds, one clock
// for every process of the machine) into the metadata of an update, and the
// consumer notes when recv_set gave it the tensors and when dropping them
// had sent the release, both from that start.
static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static double timeline_start(const std::string &meta) {
  size_t at = meta.find(" at=");
  return at == std::string::npos ? -1 : std::atof(meta.c_str() + at + 4);
}

struct Stats {
  double p50, p99;
};

static Stats stats(std::vector<double> us) { // nearest rank, as tshare-bench takes it
  if (us.empty()) return {NAN, NAN};
  std::sort(us.begin(), us.end());
  auto pct = [&](double p) {
    size_t rank = size_t(std::ceil(p / 100.0 * double(us.size())));
    return us[std::min(us.size(), std::max<size_t>(rank, 1)) - 1];
  };
  return {pct(50), pct(99)};
}

static void print_timeline(long index, const std::vector<double> &received, const std::vector<double> &dropped) {
  if (received.empty()) return;
  std::printf("update timeline, consumer %ld, p50 from the send call's start: tensors received %.1f us, "
              "dropped and release sent %.1f us\n",
              index, stats(received).p50, stats(dropped).p50);
  std::fflush(stdout);
}

static long hold_us = 0; // --hold-us: how long a read consumer holds each set

// A consumer: takes every hand-off (a set, or tensors until the one tagged
// "last") and drops it at once, which releases it.
// The core's part of a consumer: the set taken and released, no tensors
// (split: its tensors made by adopt_set, then dropped, each step timed;
// read: a byte of each CPU member read first).
static void consume_core(tshare_channel *ch, long index, bool split, bool read, std::vector<double> &received_us,
                         std::vector<double> &dropped_us) {
  std::vector<double> made_us, drop_us;
  for (;;) {
    tshare_set *set = nullptr;
    int rc = tshare_set_recv(ch, TIMEOUT, &set);
    if (rc == TSHARE_END) {
      print_timeline(index, received_us, dropped_us);
      if (split && !made_us.empty())
        std::printf("consumer %ld, p50: the set taken by the core at %.1f us, then its tensors made in %.1f us "
                    "(%.2f us per tensor) and dropped (the release sent) in %.1f us\n",
                    index, stats(received_us).p50, stats(made_us).p50, stats(made_us).p50 / 290, stats(drop_us).p50);
      std::fflush(stdout);
      return;
    }
    if (rc != TSHARE_OK) throw tt::Error(rc, tshare_channel_last_error(ch));
    size_t len = 0;
    const char *meta = static_cast<const char *>(tshare_set_meta(set, &len));
    double sent_at = timeline_start(std::string(meta ? meta : "", len));
    double taken = now_us();
    if (sent_at >= 0) received_us.push_back(taken - sent_at);
    if (split) {
      std::optional<tt::ReceivedSet> r = tt::adopt_set(set);
      double made = now_us();
      r.reset();
      double gone = now_us();
      if (sent_at >= 0) made_us.push_back(made - taken), drop_us.push_back(gone - made);
    } else {
      for (size_t i = 0; read && i < tshare_set_count(set); i++)
        if (tshare_set_cuda_device(set, i) < 0 && tshare_set_data(set, i))
          (void)*static_cast<volatile const char *>(tshare_set_data(set, i));
      if (read && hold_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(hold_us));
      tshare_set_release(set);
    }
    if (sent_at >= 0) dropped_us.push_back(now_us() - sent_at);
  }
}

static int consumer(int fd, bool as_set, const std::string &kind, long index) {
  tshare_channel *ch = nullptr;
  tshare_error err;
  if (tshare_channel_open_socket(fd, nullptr, &ch, &err) != TSHARE_OK) return 1;
  tt::ChannelPtr owned(ch);
  std::vector<double> received_us, dropped_us;
  try {
    if (as_set && (kind == "core" || kind == "read" || kind == "split")) {
      consume_core(ch, index, kind == "split", kind == "read", received_us, dropped_us);
      return 0;
    }
    tt::SetReceiver receiver; // the update pattern's consumer; recv-set: each set made as it comes
    std::optional<tt::ReceivedSet> kept; // into: the set whose tensors take the next version
    uint64_t sets = 0;
    for (;;) {
      if (as_set) {
        std::optional<tt::ReceivedSet> r = kind == "recv-set"   ? tt::recv_set(ch, {TIMEOUT})
                                           : kind == "into" && kept ? receiver.recv_into(ch, *kept, {TIMEOUT})
                                                                    : receiver.recv(ch, {TIMEOUT});
        if (!r) {
          print_timeline(index, received_us, dropped_us);
          if (kind == "into")
            std::printf("consumer %ld: %llu of %llu sets came into the tensors of the set before\n", index,
                        (unsigned long long)receiver.received_into(), (unsigned long long)sets);
          else if (kind != "recv-set")
            std::printf("consumer %ld: %llu of %llu sets came with their tensors made ahead (SetReceiver)\n", index,
                        (unsigned long long)receiver.ready_made(), (unsigned long long)sets);
          std::fflush(stdout);
          return 0;
        }
        sets++;
        double sent_at = timeline_start(r->meta);
        if (sent_at >= 0) received_us.push_back(now_us() - sent_at);
        if (kind == "into") {
          tt::release(*r); // its tensors stay for the next version; the release goes out with the next call
          kept = std::move(r);
        } else {
          r.reset(); // every tensor dropped: the release goes out
        }
        if (sent_at >= 0) dropped_us.push_back(now_us() - sent_at);
        continue;
      }
      auto r = tt::recv(ch, {TIMEOUT});
      if (!r) return 0;
      while (r->tag != "last") {
        r = tt::recv(ch, {TIMEOUT});
        if (!r) return 1;
      }
    }
  } catch (const std::exception &e) {
    std::fprintf(stderr, "bench_torch_sets consumer: %s\n", e.what());
    return 1;
  }
}

static void wait_all(const std::vector<tshare_channel *> &chs) {
  for (tshare_channel *ch : chs)
    if (tshare_channel_wait_released(ch, 0, TIMEOUT) != TSHARE_OK)
      throw tt::Error(TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
}

// The part of the last hand-off spent in the send call(s), before waiting
// for the releases: where a hand-off's time goes, printed beside the total.
static double last_send_us;

// --way set: one sender kept across every hand-off of the run (a new model
// is a new set to it; an update sends the kept set again).
static tt::SetSender sender;

// One hand-off to every consumer and back, in microseconds.
static double handoff_us(const std::vector<tshare_channel *> &chs, const tt::NamedTensors &state,
                         const std::string &way, long version, bool update) {
  auto t0 = std::chrono::steady_clock::now();
  if (way != "loop") {
    tt::SetOptions o;
    o.meta = "version=" + std::to_string(version);
    if (update) o.meta += " at=" + std::to_string(now_us());
    o.timeout_ms = TIMEOUT;
    bool kept = way == "set";
    if (chs.size() == 1) {
      if (kept) sender.send(chs[0], state, o);
      else tt::send_set(chs[0], state, o);
      last_send_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
      wait_all(chs);
    } else {
      for (const tt::SendResult &r : kept ? sender.send_all(chs, state, o, TIMEOUT) : tt::send_set_all(chs, state, o, TIMEOUT))
        if (!r.ok() || !r.released) throw tt::Error(r.code ? r.code : TSHARE_E_TIMEOUT, r.error);
    }
  } else {
    for (tshare_channel *ch : chs)
      for (size_t i = 0; i < state.size(); i++)
        tt::send(ch, state[i].second, {i + 1 == state.size() ? "last" : "", TIMEOUT});
    last_send_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    wait_all(chs);
  }
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

// The GPU done with what came before the clock starts: item() waits for the
// current stream, where the allocation's and the update's kernels went.
static void settle(const tt::NamedTensors &state) { (void)state.back().second.sum().item<float>(); }

// The first hand-offs (a new model each) and the repeated updates.
static void measure(const std::vector<tshare_channel *> &chs, bool cuda, int64_t hidden, const std::string &way, long iters,
                    long first_iters, long warmup, Stats *first, Stats *update, Stats *update_send, double *mib) {
  std::vector<double> us, send_us;
  for (long i = 0; i < warmup + first_iters; i++) {
    tt::NamedTensors fresh = transformer_state(hidden, cuda); // not timed: the model's own allocation
    if (cuda) settle(fresh);
    double t = handoff_us(chs, fresh, way, i, false);
    if (i >= warmup) us.push_back(t);
  }
  *first = stats(us);
  us.clear();
  tt::NamedTensors state = transformer_state(hidden, cuda);
  size_t bytes = 0;
  for (auto &e : state) bytes += e.second.nbytes();
  *mib = double(bytes) / (1 << 20);
  for (long i = 0; i < warmup + iters; i++) {
    for (auto &e : state) e.second.add_(1); // the trainer's in-place step (not timed)
    if (cuda) settle(state);
    last_send_us = NAN; // fan-out to several consumers: sending and waiting are one call
    double t = handoff_us(chs, state, way, i, i >= warmup);
    if (i >= warmup) us.push_back(t), send_us.push_back(last_send_us);
  }
  *update = stats(us);
  *update_send = stats(send_us);
}

int main(int argc, char **argv) {
  std::string device = arg_str(argc, argv, "--device", "cpu"), way = arg_str(argc, argv, "--way", "set");
  long iters = arg_long(argc, argv, "--iters", 200), warmup = arg_long(argc, argv, "--warmup", 20);
  // Each first hand-off allocates a model: fewer of them keep a profile of the updates short.
  long first_iters = std::max(1L, arg_long(argc, argv, "--first-iters", iters));
  long consumers = std::max(1L, std::min(16L, arg_long(argc, argv, "--consumers", 1)));
  bool cuda = device == "cuda", as_set = way != "loop";
  std::string consumer_kind = arg_str(argc, argv, "--consumer", "bridge");
  if (consumer_kind != "bridge" && consumer_kind != "into" && consumer_kind != "recv-set" && consumer_kind != "core" &&
      consumer_kind != "read" &&
      consumer_kind != "split") {
    std::printf("error: --consumer %s: bridge, into, recv-set, core, read or split\n", consumer_kind.c_str());
    return 2;
  }
  if (way != "set" && way != "set-free" && way != "loop") {
    std::printf("error: --way %s: set, set-free or loop\n", way.c_str());
    return 2;
  }
  int64_t hidden = arg_long(argc, argv, "--hidden", cuda ? 1232 : 256);
  hold_us = arg_long(argc, argv, "--hold-us", 0);
  for (int i = 1; i < argc; i++) pack = pack || std::strcmp(argv[i], "--pack") == 0;
  // One thread: an idle intra-op pool spinning after the update would take
  // the cores the consumers need, and time that is not the hand-off's.
  at::set_num_threads(1);
  std::vector<pid_t> pids;
  std::vector<tshare_channel *> chs;
  for (long i = 0; i < consumers; i++) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 1;
    std::fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      close(sv[0]);
      _exit(consumer(sv[1], as_set, consumer_kind, i));
    }
    close(sv[1]);
    pids.push_back(pid);
    tshare_channel *ch = nullptr;
    tshare_error err;
    if (tshare_channel_open_socket(sv[0], nullptr, &ch, &err) != TSHARE_OK) {
      std::printf("error: %s\n", err.message);
      return 1;
    }
    chs.push_back(ch);
  }
  int status = 0;
  Stats first{}, update{}, update_send{};
  double mib = 0;
  tshare_error err;
  if (cuda && (tshare_cuda_init(&err) != TSHARE_OK || !at::hasCUDA())) {
    std::printf("skip: %s\n", at::hasCUDA() ? err.message : "this LibTorch has no CUDA");
    status = 77;
  }
  try {
    if (!status) measure(chs, cuda, hidden, way, iters, first_iters, warmup, &first, &update, &update_send, &mib);
  } catch (const tt::Error &e) {
    // Tensor sets of CUDA memory, where this version refuses them.
    std::printf("%s: %s\n", e.code() == TSHARE_E_UNSUPPORTED ? "skip" : "error", e.what());
    status = e.code() == TSHARE_E_UNSUPPORTED ? 77 : 1;
  } catch (const std::exception &e) {
    std::printf("error: %s\n", e.what());
    status = 1;
  }
  for (tshare_channel *ch : chs) {
    tshare_channel_send_bye(ch, 0, TIMEOUT);
    tshare_channel_close(ch);
  }
  for (pid_t pid : pids) {
    int st = 0;
    waitpid(pid, &st, 0);
    if (!status && (!WIFEXITED(st) || WEXITSTATUS(st))) {
      std::printf("error: a consumer failed\n");
      status = 1;
    }
  }
  if (status) return status;
  std::printf("%s, %s, %ld consumer(s), 290 bf16 tensors, %.1f MiB (hidden %lld): first p50 %.1f us, update p50 %.1f us "
              "(of which in the send call %.1f us)\n",
              way == "set"        ? "one set, SetSender kept"
              : way == "set-free" ? "one set, send_set each time"
                                  : "one send() per tensor",
              device.c_str(), consumers, mib, (long long)hidden,
              first.p50, update.p50, update_send.p50);
  std::printf("result first_p50_us=%.2f first_p99_us=%.2f update_p50_us=%.2f update_p99_us=%.2f n=%ld tensors=290 "
              "mib=%.1f hidden=%lld torch=%s\n",
              first.p50, first.p99, update.p50, update.p99, iters, mib, (long long)hidden, TORCH_VERSION);
  return 0;
}
