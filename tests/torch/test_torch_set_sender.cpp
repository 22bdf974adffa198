// The update pattern through the LibTorch bridge, between real processes: a
// SetSender kept across versions sends the set it built again while the
// tensors are the same (each version's values and metadata right, one
// release per set), and builds anew when a tensor is reassigned, reshaped,
// restrided, renamed, added or removed; what it keeps alive; two threads on
// one sender. On the consumer: tensors kept after the ReceivedSet is gone
// hold the set until the last goes, then one release; a member sent on is
// the producer's memory.
#include "set_test_util.h"

#include <thread>

// Takes sets until bye; each must be what its metadata describes.
static void describing_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "consumer");
  int sets = 0;
  while (auto r = tt::recv_set(ch, {TIMEOUT})) {
    std::string got = describe(r->tensors);
    if (got != r->meta) TS_FAIL("set %d: received\n%s\nsent\n%s", sets, got.c_str(), r->meta.c_str());
    sets++;
  }
  tshare_channel_close(ch);
}

// ---- 290 tensors, 30 versions, one build ------------------------------------

static void versions_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "versions consumer");
  int v = 0;
  while (auto r = tt::recv_set(ch, {TIMEOUT})) {
    v++;
    CHECK(r->meta == "version=" + std::to_string(v));
    CHECK_EQ(r->tensors.size(), 290);
    for (size_t k = 0; k < 290; k++) {
      const auto &item = r->tensors[k];
      if (item.key() != member_name(k)) TS_FAIL("version %d: member %zu is '%s'", v, k, item.key().c_str());
      if (!at::equal(item.value(), version_values(v, k))) TS_FAIL("version %d: %s differs", v, item.key().c_str());
    }
  }
  CHECK_EQ(v, 30);
  tshare_channel_close(ch);
}

TS_TEST(a_290_tensor_set_sent_30_times_through_one_sender_is_built_once) { send_30_versions(versions_consumer, false); }

// ---- what makes the sender build anew -----------------------------------------

static uint64_t send_described(tt::SetSender &sender, tshare_channel *ch, const tt::NamedTensors &state) {
  return sender.send(ch, state, {describe(state), TIMEOUT});
}

TS_TEST(the_sender_builds_anew_when_the_tensors_change_and_not_otherwise) {
  ForkedConsumer consumer(describing_consumer);
  tshare_channel *ch = consumer.ch;
  ReleaseCounts &releases = consumer.releases;
  at::Tensor base = tt::empty_shared({4, 4});
  base.copy_(at::arange(16, at::kFloat).view({4, 4}));
  tt::NamedTensors state = {{"a", base.narrow(0, 0, 1)}, {"b", base[1]}, {"c", base.narrow(0, 2, 2)}};
  tt::SetSender sender;
  uint64_t built = 0;
  auto step = [&](bool rebuilds, const char *what) {
    wait_released_once(ch, releases, send_described(sender, ch, state));
    built += rebuilds;
    if (sender.builds() != built) TS_FAIL("%s: %llu builds, expected %llu", what, (unsigned long long)sender.builds(),
                                          (unsigned long long)built);
  };
  step(true, "first");
  base.mul_(2); // in place: the same set
  step(false, "updated in place");
  tt::TensorDict dict; // the same tensors in another container
  for (auto &e : state) dict.insert(e.first, e.second);
  wait_released_once(ch, releases, sender.send(ch, dict, {describe(dict), TIMEOUT}));
  CHECK_EQ(sender.builds(), built);
  state[1].second = tt::empty_shared({4}).fill_(7.0f); // reassigned: other memory
  step(true, "reassigned");
  state[2].second = state[2].second.view({8}); // reshaped: same memory and pointer
  step(true, "reshaped");
  state[2].second = base.narrow(0, 2, 2).t(); // same pointer and memory, other strides
  step(true, "transposed");
  state[0].second = base.narrow(0, 0, 1).to(at::kDouble); // another dtype (moved into shared memory)
  CHECK_THROWS_CODE(sender.send(ch, state, {describe(state), TIMEOUT}), TSHARE_E_UNSUPPORTED, "not in shared memory");
  tt::share_memory_(state[0].second);
  step(true, "dtype");
  state.emplace_back("d", base[3]);
  step(true, "added");
  state.pop_back();
  step(true, "removed");
  state[0].first = "renamed";
  step(true, "renamed");
  std::swap(state[0], state[1]);
  step(true, "reordered");
  step(false, "again");
  CHECK_THROWS_CODE(sender.send(nullptr, state), TSHARE_E_INVALID_ARG, "no channel");
  consumer.finish();
}

// ---- what the sender keeps alive ----------------------------------------------

static void dropping_consumer(int fd) {
  // Keeps no host mapping past its sets, so the producer holds the memory
  // for nothing but its own sets and the sender.
  CHECK(setenv("TSHARE_HOST_KEPT_MAX", "0", 1) == 0);
  tshare_channel *ch = open_channel(fd, "consumer");
  while (auto r = tt::recv_set(ch, {TIMEOUT})) CHECK(at::equal(r->tensors["w"], at::full({4}, 3.0f)));
  tshare_channel_close(ch);
}

TS_TEST(the_sender_keeps_the_last_sets_memory_until_reset) {
  int sock;
  pid_t pid = fork_with_socket(dropping_consumer, &sock);
  tshare_channel *ch = open_channel(sock, "trainer");
  tt::SetSender sender;
  {
    at::Tensor w = tt::empty_shared({4});
    w.fill_(3.0f);
    uint64_t id = sender.send(ch, {{"w", w}}, {"", TIMEOUT});
    CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  } // the producer's tensor is gone; the kept set holds its memory
  (void)tshare_channel_poll(ch, 0); // the channel lets go of what only it holds
  CHECK_EQ(count_mappings("tshare-torch"), 1);
  sender.reset();
  (void)tshare_channel_poll(ch, 0);
  CHECK_EQ(count_mappings("tshare-torch"), 0);
  CHECK_EQ(sender.builds(), 1);
  tt::SetSender moved(std::move(sender)); // the kept set moves with it; the old one starts afresh
  at::Tensor w2 = tt::empty_shared({4});
  w2.fill_(3.0f);
  uint64_t id = sender.send(ch, {{"w", w2}}, {"", TIMEOUT});
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(sender.builds(), 1);
  CHECK_EQ(moved.builds(), 1);
  bye_and_wait_released(ch, TIMEOUT);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

// ---- two threads on one sender -------------------------------------------------

TS_TEST(two_threads_on_one_sender_each_get_their_own_sets_right) {
  const int rounds = 25;
  int socks[2];
  pid_t pids[2];
  for (int i = 0; i < 2; i++) pids[i] = fork_with_socket(describing_consumer, &socks[i]);
  tt::SetSender sender;
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; i++)
    threads.emplace_back([&, i] {
      tshare_channel *ch = open_channel(socks[i], i ? "thread 1" : "thread 0");
      tt::NamedTensors state;
      for (int k = 0; k <= 3 * i; k++) { // different sets: each thread's send rebuilds the other's
        at::Tensor t = tt::empty_shared({2 + i, 3});
        state.emplace_back("t" + std::to_string(i) + "." + std::to_string(k), t.fill_(100 * i + k));
      }
      for (int r = 0; r < rounds; r++) {
        for (auto &e : state) e.second.add_(1);
        uint64_t id = send_described(sender, ch, state);
        CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
      }
      bye_and_wait_released(ch, TIMEOUT);
      tshare_channel_close(ch);
    });
  for (auto &t : threads) t.join();
  CHECK(sender.builds() >= 2 && sender.builds() <= 2 * rounds);
  for (pid_t pid : pids) CHECK_CHILD_OK(pid);
}

// ---- the consumer: tensors outliving the ReceivedSet ---------------------------

static void keeping_consumer(int fd) {
  CHECK(setenv("TSHARE_HOST_KEPT_MAX", "0", 1) == 0); // mappings go with the set
  tshare_channel *ch = open_channel(fd, "consumer");
  auto r = tt::recv_set(ch, {TIMEOUT});
  CHECK(r && r->tensors.size() == 3);
  CHECK_EQ(count_mappings("tshare-torch"), 2);
  at::Tensor a = r->tensors["a"];
  at::Tensor derived = r->tensors["c"].narrow(0, 1, 2) * 1; // a new tensor: holds nothing
  at::Tensor view = r->tensors["c"].narrow(0, 1, 2);        // a view: holds the set
  r.reset();
  CHECK_EQ(count_mappings("tshare-torch"), 2); // a and view hold the whole set
  a.reset();
  CHECK_EQ(count_mappings("tshare-torch"), 2);
  CHECK(at::equal(view, derived));
  view.fill_(-5.0f); // the producer reads it after the release
  view.reset();
  CHECK_EQ(count_mappings("tshare-torch"), 0);
  CHECK(!tt::recv_set(ch, {TIMEOUT}));
  tshare_channel_close(ch);
}

// Rows 0..3 and 4..7, in shared memory.
static at::Tensor two_rows() {
  at::Tensor two = tt::empty_shared({2, 4});
  return two.copy_(at::arange(8, at::kFloat).view({2, 4}));
}

TS_TEST(tensors_kept_after_the_received_set_hold_it_until_the_last_goes) {
  int sock;
  pid_t pid = fork_with_socket(keeping_consumer, &sock);
  ReleaseCounts releases;
  tshare_channel *ch = open_channel(sock, "producer", count_release, &releases);
  at::Tensor one = tt::empty_shared({4}).fill_(1.0f), two = two_rows();
  uint64_t id = tt::send_set(ch, {{"a", one}, {"b", two[0]}, {"c", two[1]}});
  wait_released_once(ch, releases, id);
  CHECK(at::equal(two[1], at::tensor({4.0f, -5.0f, -5.0f, 7.0f})));
  bye_and_wait_released(ch, TIMEOUT);
  CHECK_EQ(releases.of(id), 1);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

// ---- a member sent on -----------------------------------------------------------

// Sends part of a member back: the producer gets its own memory, not a copy;
// the forward holds the set after the consumer dropped every tensor.
static void forwarding_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "consumer");
  auto r = tt::recv_set(ch, {TIMEOUT});
  CHECK(r && tt::is_shared(r->tensors["c"]));
  uint64_t fwd = tt::send(ch, r->tensors["c"].narrow(0, 1, 2), {"forwarded", TIMEOUT});
  r.reset();
  CHECK_RC(tshare_channel_wait_released(ch, fwd, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK(!tt::recv_set(ch, {TIMEOUT}));
  tshare_channel_close(ch);
}

TS_TEST(a_member_sent_on_is_the_producers_memory_and_holds_the_set) {
  int sock;
  pid_t pid = fork_with_socket(forwarding_consumer, &sock);
  ReleaseCounts releases;
  tshare_channel *ch = open_channel(sock, "producer", count_release, &releases);
  at::Tensor two = two_rows();
  uint64_t id = tt::send_set(ch, {{"b", two[0]}, {"c", two[1]}});
  auto back = tt::recv(ch, {TIMEOUT});
  CHECK(back && back->tag == "forwarded" && at::equal(back->tensor, at::tensor({5.0f, 6.0f})));
  back->tensor.fill_(-1.0f); // the producer's own memory, mapped again
  CHECK(at::equal(two[1], at::tensor({4.0f, -1.0f, -1.0f, 7.0f})));
  CHECK_EQ(tshare_share_is_released(ch, id), 0); // the forward holds the set
  back.reset();
  wait_released_once(ch, releases, id);
  bye_and_wait_released(ch, TIMEOUT);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

TS_TEST_MAIN
