// The update pattern's consumer through the LibTorch bridge, between real
// processes: a SetReceiver kept across versions hands over the tensors it
// made while it waited when a set comes again from the layout it kept (each
// version's names, values and metadata right, writes reaching the producer,
// one release per set), and makes anew a set whose tensors changed. Two sets
// of one layout held at once, a receive that times out, reset(), and sets
// dropped on other threads while the next is received. A consumer that keeps
// its tensors: release() and recv_into(), each version in the same tensors.
#include "set_test_util.h"

#include <c10/core/InferenceMode.h>

#include <atomic>
#include <functional>
#include <memory>
#include <thread>

// ---- 290 tensors, 30 versions ----------------------------------------------------

// Checks every version; writes -v into member v's first value (the producer
// reads it after the release).
static void versions_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "versions consumer");
  tt::SetReceiver receiver;
  int v = 0;
  while (auto r = receiver.recv(ch, {TIMEOUT})) {
    v++;
    CHECK(r->meta == "version=" + std::to_string(v));
    CHECK_EQ(r->tensors.size(), 290);
    // The first is made when it comes; a later one is made ahead where it came
    // while recv() waited (one that came before the call is made then).
    CHECK(receiver.ready_made() <= uint64_t(v - 1));
    for (size_t k = 0; k < 290; k++) {
      const auto &item = r->tensors[k];
      if (item.key() != member_name(k)) TS_FAIL("version %d: member %zu is '%s'", v, k, item.key().c_str());
      if (!at::equal(item.value(), version_values(v, k))) TS_FAIL("version %d: %s differs", v, item.key().c_str());
      CHECK(item.value().is_contiguous() && item.value().storage().nbytes() == 4 * sizeof(float));
    }
    CHECK(r->tensors.find(member_name(289)) && r->tensors[member_name(289)].data_ptr() == r->tensors[289].value().data_ptr());
    r->tensors[size_t(v)].value()[0] = float(-v);
  }
  CHECK_EQ(v, 30);
  printf("consumer: %llu of 29 versions came while recv() waited, made ahead\n",
         (unsigned long long)receiver.ready_made());
  CHECK(receiver.ready_made() >= 1); // the producer pauses before each version: most are
  tshare_channel_close(ch);
}

TS_TEST(a_receiver_hands_over_the_tensors_it_made_ahead_for_each_version) { send_30_versions(versions_consumer, true, 20000); }

// ---- a set that changed is made anew ---------------------------------------------

// The metadata: "again" or "whole" (whether the producer's sender sent its
// kept set again), then what the set holds. A set sent again must come made
// ahead (where it came while recv() waited: timing), any other must not;
// each must hold what the producer described.
static void describing_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "consumer");
  tt::SetReceiver receiver;
  int sets = 0;
  uint64_t ready = 0;
  while (auto r = receiver.recv(ch, {TIMEOUT})) {
    bool again = r->meta.compare(0, 6, "again\n") == 0;
    std::string got = describe(r->tensors), sent = r->meta.substr(6);
    if (got != sent) TS_FAIL("set %d: received\n%s\nsent\n%s", sets, got.c_str(), sent.c_str());
    if (receiver.ready_made() > ready + again)
      TS_FAIL("set %d (%s): made ahead %llu times, expected %llu", sets, again ? "sent again" : "sent whole",
              (unsigned long long)receiver.ready_made(), (unsigned long long)(ready + again));
    ready = receiver.ready_made();
    sets++;
  }
  CHECK(ready <= 4);
  tshare_channel_close(ch);
}

TS_TEST(a_receiver_makes_anew_a_set_whose_tensors_changed) {
  ForkedConsumer consumer(describing_consumer);
  at::Tensor base = tt::empty_shared({4, 4});
  base.copy_(at::arange(16, at::kFloat).view({4, 4}));
  tt::NamedTensors state = {{"a", base.narrow(0, 0, 1)}, {"b", base[1]}, {"c", base.narrow(0, 2, 2)}};
  tt::SetSender sender;
  struct Change {
    const char *what;
    std::function<void()> apply;
    bool again; // the sender sends its kept set again
  };
  std::vector<Change> changes = {
      {"first", [] {}, false},
      {"updated in place", [&] { base.mul_(2); }, true},
      {"reassigned", [&] { state[1].second = tt::empty_shared({4}).fill_(7.0f); }, false},
      {"again", [] {}, true},
      {"reshaped", [&] { state[2].second = state[2].second.view({8}); }, false},
      {"transposed", [&] { state[2].second = base.narrow(0, 2, 2).t(); }, false},
      {"updated in place again", [&] { base.add_(1); }, true},
      {"added", [&] { state.emplace_back("d", base[3]); }, false},
      {"removed", [&] { state.pop_back(); }, false},
      {"renamed", [&] { state[0].first = "renamed"; }, false},
      {"reordered", [&] { std::swap(state[0], state[1]); }, false},
      {"again, last", [] {}, true},
  };
  for (const Change &c : changes) {
    c.apply();
    uint64_t builds = sender.builds();
    std::string meta = std::string(c.again ? "again\n" : "whole\n") + describe(state);
    consumer.wait_released(sender.send(consumer.ch, state, {meta, TIMEOUT}));
    if ((sender.builds() == builds) != c.again) TS_FAIL("%s: the sender did not do what the test expects", c.what);
  }
  consumer.finish();
}

// ---- two sets of one layout at once, a timeout, reset ----------------------------

// Holds version 2 while version 3 comes (made ahead: the same memory, so both
// read version 3's values); a poll with nothing sent times out, having made
// the next one's tensors, which version 4 gets; after reset() the next is made anew; a receiver
// moved on keeps what it kept. (Version 1 comes alone: the producer learns
// that the memory is kept mapped from its release.)
static void holding_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "consumer");
  tt::SetReceiver receiver;
  CHECK(receiver.recv(ch, {TIMEOUT})->meta == "version=1");
  auto r2 = receiver.recv(ch, {TIMEOUT});
  auto r3 = receiver.recv(ch, {TIMEOUT});
  CHECK(r2 && r3 && r2->meta == "version=2" && r3->meta == "version=3");
  CHECK(receiver.ready_made() <= 2); // those that came while recv() waited
  CHECK(r2->set_id != r3->set_id);
  for (size_t k = 0; k < 290; k++) {
    CHECK(r2->tensors[k].value().data_ptr() == r3->tensors[k].value().data_ptr());
    CHECK(at::equal(r3->tensors[k].value(), version_values(3, k)));
  }
  CHECK_THROWS_CODE(receiver.recv(ch, {0}), TSHARE_E_TIMEOUT, ""); // a poll makes version 4's tensors ahead
  uint64_t before_4 = receiver.ready_made();
  r3.reset(); // the producer waits for both releases before version 4
  at::Tensor kept = r2->tensors[7].value();
  r2.reset();
  CHECK(at::equal(kept, version_values(3, 7)));
  kept.reset();
  auto r4 = receiver.recv(ch, {TIMEOUT});
  CHECK(r4 && r4->meta == "version=4" && at::equal(r4->tensors[5].value(), version_values(4, 5)));
  uint64_t ready = receiver.ready_made();
  CHECK_EQ(ready, before_4 + 1); // made by the poll, whenever version 4 came
  r4.reset();
  receiver.reset();
  auto r5 = receiver.recv(ch, {TIMEOUT});
  CHECK(r5 && r5->meta == "version=5" && at::equal(r5->tensors[289].value(), version_values(5, 289)));
  CHECK_EQ(receiver.ready_made(), ready); // nothing kept to make it ahead from
  r5.reset();
  tt::SetReceiver moved = std::move(receiver);
  auto r6 = moved.recv(ch, {TIMEOUT});
  CHECK(r6 && r6->meta == "version=6" && at::equal(r6->tensors[0].value(), version_values(6, 0)));
  CHECK(moved.ready_made() >= ready && moved.ready_made() <= ready + 1); // what it counted moved with it
  r6.reset();
  CHECK(!moved.recv(ch, {TIMEOUT}));
  CHECK_THROWS_CODE(moved.recv(nullptr), TSHARE_E_INVALID_ARG, "no channel");
  tshare_channel_close(ch);
}

TS_TEST(two_sets_of_one_layout_held_at_once_are_released_each_once) {
  ForkedConsumer c(holding_consumer);
  tt::NamedTensors state = model_in_7_memories();
  tt::SetSender sender;
  auto version = [&](int v) {
    write_version(state, v);
    return sender.send(c.ch, state, {"version=" + std::to_string(v), TIMEOUT});
  };
  c.wait_released(version(1));
  uint64_t id2 = version(2), id3 = version(3);
  c.wait_released(id3);
  c.wait_released(id2);
  for (int v = 4; v <= 6; v++) c.wait_released(version(v));
  CHECK_EQ(sender.builds(), 1);
  c.finish();
}

// A poll in inference mode makes nothing ahead: the next version, received
// outside it, must be tensors it can write.
static void inference_mode_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "consumer");
  tt::SetReceiver receiver;
  CHECK(receiver.recv(ch, {TIMEOUT})->meta == "version=1");
  {
    c10::InferenceMode inference;
    CHECK_THROWS_CODE(receiver.recv(ch, {0}), TSHARE_E_TIMEOUT, ""); // version 2 comes 200 ms after its release
  }
  auto r2 = receiver.recv(ch, {TIMEOUT});
  CHECK(r2 && r2->meta == "version=2");
  at::Tensor t = r2->tensors[3].value();
  CHECK(!t.is_inference());
  t.add_(1); // an inference tensor would throw here
  CHECK(at::equal(t, version_values(2, 3) + 1));
  t.reset();
  r2.reset();
  CHECK(!receiver.recv(ch, {TIMEOUT}));
  tshare_channel_close(ch);
}

TS_TEST(a_poll_in_inference_mode_makes_no_tensors_ahead_that_a_recv_outside_it_hands_out) {
  ForkedConsumer c(inference_mode_consumer);
  tt::NamedTensors state = model_in_7_memories();
  tt::SetSender sender;
  for (int v = 1; v <= 2; v++) {
    write_version(state, v);
    if (v == 2) usleep(200000); // the consumer's poll finds nothing (its release may go before the poll)
    c.wait_released(sender.send(c.ch, state, {"version=" + std::to_string(v), TIMEOUT}));
  }
  c.finish();
}

// ---- sets dropped on other threads ------------------------------------------------

// Each set is checked and dropped on a thread of its own while the next is
// received (and its tensors made ahead) on this one.
static void threaded_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "consumer");
  tt::SetReceiver receiver;
  std::vector<std::thread> workers;
  std::atomic<int> wrong{0};
  int v = 0;
  while (auto r = receiver.recv(ch, {TIMEOUT})) {
    v++;
    workers.emplace_back([&wrong, v, set = std::make_shared<tt::ReceivedSet>(std::move(*r))]() mutable {
      if (set->meta != "version=" + std::to_string(v)) wrong++;
      for (size_t k = 0; k < 290; k += 17)
        if (set->tensors[k].value().numel() != 4) wrong++;
      set.reset();
    });
  }
  for (auto &w : workers) w.join();
  CHECK_EQ(wrong.load(), 0);
  CHECK_EQ(v, 40);
  tshare_channel_close(ch);
}

TS_TEST(sets_made_ahead_and_dropped_on_other_threads_are_released_each_once) {
  ForkedConsumer c(threaded_consumer);
  tt::NamedTensors state = model_in_7_memories();
  tt::SetSender sender;
  std::vector<uint64_t> ids;
  for (int v = 1; v <= 40; v++) {
    ids.push_back(sender.send(c.ch, state, {"version=" + std::to_string(v), TIMEOUT}));
    if (v % 4 == 0) // a few in flight at once
      for (size_t i = ids.size() - 4; i < ids.size(); i++) c.wait_released(ids[i]);
  }
  c.finish();
  for (uint64_t id : ids) CHECK_EQ(c.releases.of(id), 1);
}

// ---- one set's tensors kept across versions: release, recv_into -------------------

// Versions 2 to 30 come into version 1's tensors, the same objects, each
// released first (on another thread every fifth time); a released tensor is
// not sent on; writes reach the producer as with any set.
static void into_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "into consumer");
  tt::SetReceiver receiver;
  auto r = receiver.recv(ch, {TIMEOUT});
  CHECK(r && r->meta == "version=1");
  std::vector<at::Tensor> first;
  for (auto &item : r->tensors) first.push_back(item.value());
  int v = 1;
  for (;;) {
    for (size_t k = 0; k < 290; k++)
      if (!at::equal(r->tensors[k].value(), version_values(v, k))) TS_FAIL("version %d: member %zu differs", v, k);
    r->tensors[size_t(v)].value()[0] = float(-v); // the producer reads it after the release
    if (v % 5 == 0)
      std::thread([&r] { tt::release(*r); }).join();
    else
      tt::release(*r);
    tt::release(*r); // again: nothing more
    CHECK_THROWS_CODE(tt::send(ch, r->tensors[0].value()), TSHARE_E_STATE, "release");
    auto next = receiver.recv_into(ch, *r, {TIMEOUT});
    if (!next) break;
    v++;
    CHECK(next->meta == "version=" + std::to_string(v) && next->set_id != r->set_id);
    for (size_t k = 0; k < 290; k++)
      if (!next->tensors[k].value().is_same(first[k])) TS_FAIL("version %d: member %zu is a new tensor", v, k);
    r = std::move(next);
  }
  CHECK_EQ(v, 30);
  CHECK_EQ(receiver.received_into(), 29);
  CHECK_EQ(receiver.ready_made(), 0);
  r.reset();
  first.clear();
  tshare_channel_close(ch);
}

TS_TEST(each_version_comes_into_the_tensors_of_the_one_before) { send_30_versions(into_consumer, true); }

// An offer no set took (a timeout) leaves the tensors released, mapped and
// intact; a set of another layout then comes as new tensors; tensors that are
// not one set's as it came are refused.
static void offer_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "consumer");
  tt::SetReceiver receiver;
  auto r = receiver.recv(ch, {TIMEOUT});
  CHECK(r && r->meta == "version=1");
  CHECK_THROWS_CODE(receiver.recv_into(ch, *r, {0}), TSHARE_E_TIMEOUT, ""); // the producer waits 100 ms
  auto other = receiver.recv_into(ch, *r, {TIMEOUT});
  CHECK(other && other->meta == "other" && other->tensors.size() == 3);
  CHECK(!other->tensors[0].value().is_same(r->tensors[0].value()));
  CHECK_EQ(receiver.received_into(), 0);
  for (size_t k = 0; k < 290; k++) // the producer's memory, still mapped, as version 1 left it
    if (!at::equal(r->tensors[k].value(), version_values(1, k))) TS_FAIL("member %zu differs", k);
  CHECK_THROWS_CODE(tt::send(ch, r->tensors[3].value()), TSHARE_E_STATE, "release");
  other.reset();
  tt::ReceivedSet changed = *r;
  changed.tensors[0].value() = at::zeros({4});
  CHECK_THROWS_CODE(tt::release(changed), TSHARE_E_INVALID_ARG, "not one received set");
  CHECK_THROWS_CODE(receiver.recv_into(ch, changed, {0}), TSHARE_E_INVALID_ARG, "not one received set");
  tt::ReceivedSet none; // as a ReceivedSet whose tensors moved into the next version
  tt::release(none);    // holds nothing: nothing to do
  CHECK_THROWS_CODE(receiver.recv_into(ch, none, {0}), TSHARE_E_INVALID_ARG, "not one received set");
  r.reset();
  changed = tt::ReceivedSet();
  CHECK(!receiver.recv(ch, {TIMEOUT}));
  tshare_channel_close(ch);
}

TS_TEST(an_offer_no_set_took_leaves_the_tensors_released_and_mapped) {
  ForkedConsumer c(offer_consumer);
  tt::NamedTensors state = model_in_7_memories();
  write_version(state, 1);
  tt::SetSender sender;
  c.wait_released(sender.send(c.ch, state, {"version=1", TIMEOUT}));
  usleep(100000); // the consumer's recv_into that sent the release times out first
  tt::NamedTensors other = {{"x", tt::empty_shared({2})}, {"y", tt::empty_shared({3})}, {"z", tt::empty_shared({1})}};
  c.wait_released(tt::send_set(c.ch, other, {"other", TIMEOUT}));
  c.finish();
}

TS_TEST_MAIN
