// Helpers shared by the bridge's set tests between processes: the releases
// a producer saw per set, a set's contents as text (what the producer sends
// as metadata for the consumer to compare with), and the 290-member model
// of 30 versions both sides compute.
#ifndef TSHARE_TEST_TORCH_SET_UTIL_H
#define TSHARE_TEST_TORCH_SET_UTIL_H

#include "torch_test_util.h"

#include "tshare/torch_set.h"

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include <unistd.h>

static const int TIMEOUT = 10000;

// Releases seen by the producer, per set id (the channel's on_release).
struct ReleaseCounts {
  std::mutex lock;
  std::map<uint64_t, int> by_id;
  int of(uint64_t id) {
    std::lock_guard<std::mutex> g(lock);
    return by_id.count(id) ? by_id[id] : 0;
  }
};

static inline void count_release(void *user, uint64_t share_id, void *, int) {
  auto *counts = static_cast<ReleaseCounts *>(user);
  std::lock_guard<std::mutex> g(counts->lock);
  counts->by_id[share_id]++;
}

static inline void wait_released_once(tshare_channel *ch, ReleaseCounts &counts, uint64_t id) {
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(counts.of(id), 1);
}

// Everything a consumer can see of a set's tensors, as text: names in order,
// dtype, sizes, strides and values.
static inline const std::string &key_of(const std::pair<std::string, at::Tensor> &e) { return e.first; }
static inline const at::Tensor &value_of(const std::pair<std::string, at::Tensor> &e) { return e.second; }
static inline const std::string &key_of(const tt::TensorDict::Item &item) { return item.key(); }
static inline const at::Tensor &value_of(const tt::TensorDict::Item &item) { return item.value(); }

template <class Tensors> static std::string describe(const Tensors &tensors) {
  std::string out;
  for (const auto &e : tensors) {
    const at::Tensor &t = value_of(e);
    out += key_of(e) + " " + c10::toString(t.scalar_type()) + " sizes";
    for (int64_t s : t.sizes()) out += " " + std::to_string(s);
    out += " strides";
    for (int64_t s : t.strides()) out += " " + std::to_string(s);
    out += " values";
    at::Tensor flat = t.reshape({-1}).to(at::kDouble).contiguous();
    for (int64_t i = 0; i < flat.numel(); i++) out += " " + std::to_string(flat.data_ptr<double>()[i]);
    out += "\n";
  }
  return out;
}

// Member k of version v holds 1000v + k + {0, 1, 2, 3}; 290 members in 7 memories.
static inline at::Tensor version_values(int v, size_t k) {
  return at::arange(4, at::kFloat) + (1000.0 * v + double(k));
}

static inline std::string member_name(size_t k) {
  return "model.layers." + std::to_string(k / 12) + ".w" + std::to_string(k);
}

static inline tt::NamedTensors model_in_7_memories() {
  std::vector<at::Tensor> bases;
  for (int m = 0; m < 7; m++) bases.push_back(tt::empty_shared({42, 4}));
  tt::NamedTensors state;
  for (size_t k = 0; k < 290; k++) state.emplace_back(member_name(k), bases[k % 7][int64_t(k / 7)]);
  return state;
}

// Version v written into state in place, as a training step.
static inline void write_version(tt::NamedTensors &state, int v) {
  for (size_t k = 0; k < state.size(); k++) state[k].second.copy_(version_values(v, k));
}

// The producer's end of a test: a consumer forked with a socket, the
// channel to it counting releases; finish() says bye, waits for every
// release and for the consumer's clean exit.
struct ForkedConsumer {
  pid_t pid;
  ReleaseCounts releases;
  tshare_channel *ch;
  explicit ForkedConsumer(void (*consumer)(int)) {
    int sock;
    pid = fork_with_socket(consumer, &sock);
    ch = open_channel(sock, "trainer", count_release, &releases);
  }
  void wait_released(uint64_t id) { wait_released_once(ch, releases, id); }
  void finish() {
    bye_and_wait_released(ch, TIMEOUT);
    CHECK_EQ(tshare_channel_outstanding(ch), 0);
    CHECK_CHILD_OK(pid);
    tshare_channel_close(ch);
  }
};

// 30 versions of that model through one SetSender (built once) to a
// consumer forked with a socket, each waited for, released once. With
// consumer_writes the consumer wrote -v into member v's first value: it must
// be in the producer's memory after the release. step_us: a pause before
// each version.
static inline void send_30_versions(void (*consumer)(int), bool consumer_writes, useconds_t step_us = 0) {
  ForkedConsumer c(consumer);
  tt::NamedTensors state = model_in_7_memories();
  tt::SetSender sender;
  for (int v = 1; v <= 30; v++) {
    write_version(state, v);
    if (step_us) usleep(step_us); // a training step's time: the consumer waits in recv() meanwhile
    c.wait_released(sender.send(c.ch, state, {"version=" + std::to_string(v), TIMEOUT}));
    if (consumer_writes && state[size_t(v)].second[0].item<float>() != float(-v))
      TS_FAIL("version %d: the consumer's write is not here", v);
  }
  CHECK_EQ(sender.builds(), 1);
  c.finish();
}

#endif
