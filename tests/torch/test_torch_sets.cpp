// Tensor sets through the LibTorch bridge, between real processes: sets of 1,
// 290 and 10,000 tensors with names of 1 and 1024 bytes and metadata; every
// dtype and layout in one set; a module shared in place, updated in place and
// sent again per version, the consumer's writes seen by the producer's
// module; a consumer killed while holding a set; fan-out with per-consumer
// results; the errors for what a set cannot carry; C and C++ on either end.
#include "torch_test_util.h"

#include "tshare/torch_set.h"

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

#include <signal.h>
#include <stdlib.h>

// ---- sets of 1, 290 and 10,000 tensors ------------------------------------

// Tensor i of a plan holds 4 floats 10i .. 10i+3 at offset 4i of memory i %
// mems (each memory an empty_shared base: it travels once); names of 1 byte
// (tensor 0), 1024 bytes (tensor 1) and a real model's; meta_len bytes of
// metadata, byte k = 7k + 3.
struct Plan {
  size_t count, mems, meta_len;
};
static const Plan plans[] = {{1, 1, 0}, {290, 290, 100}, {10000, 3, 5000}};

static std::string name_of(size_t i) {
  if (i == 0) return "w";
  if (i == 1) return std::string(TSHARE_SET_NAME_MAX, 'n');
  return "vision_tower.vision_model.encoder.layers." + std::to_string(i) + ".self_attn.out_proj.weight";
}

static std::string meta_of(const Plan &p) {
  std::string m(p.meta_len, '\0');
  for (size_t k = 0; k < p.meta_len; k++) m[k] = static_cast<char>(7 * k + 3);
  return m;
}

static at::Tensor values_of(size_t i) { return at::arange(4, at::kFloat) + 10.0 * double(i); }

static tt::NamedTensors plan_tensors(const Plan &p) {
  std::vector<at::Tensor> bases;
  for (size_t m = 0; m < p.mems; m++) bases.push_back(tt::empty_shared({int64_t(p.count / p.mems + 1), 4}));
  tt::NamedTensors set;
  for (size_t i = 0; i < p.count; i++) {
    at::Tensor t = bases[i % p.mems][int64_t(i / p.mems)];
    t.copy_(values_of(i));
    set.emplace_back(name_of(i), t);
  }
  return set;
}

static void plan_consumer(int fd) {
  // Keeps no host mapping past its views (TSHARE_HOST_KEPT_MAX, read before the
  // first channel): a set's memory goes with its last tensor here.
  CHECK(setenv("TSHARE_HOST_KEPT_MAX", "0", 1) == 0);
  tshare_channel *ch = open_channel(fd, "set consumer");
  for (const Plan &p : plans) {
    auto r = tt::recv_set(ch, {10000});
    CHECK(r);
    CHECK_EQ(r->tensors.size(), p.count);
    CHECK(r->meta == meta_of(p));
    CHECK(!r->is_copy); // the producer's memory, mapped
    for (size_t i = 0; i < p.count; i++) {
      const auto &item = r->tensors[i]; // the sender's order
      if (item.key() != name_of(i)) TS_FAIL("name %zu is '%.40s'", i, item.key().c_str());
      if (!at::equal(item.value(), values_of(i))) TS_FAIL("tensor %zu differs", i);
    }
    CHECK(r->tensors.contains(name_of(p.count - 1)));
    CHECK_EQ(count_mappings("tshare-torch"), int(p.mems)); // each memory mapped once
    at::Tensor first = r->tensors["w"];
    r.reset(); // the one tensor kept holds the whole set
    CHECK_EQ(count_mappings("tshare-torch"), int(p.mems));
    first.fill_(-1.0f); // the producer reads it after the release
    first.reset();
    CHECK_EQ(count_mappings("tshare-torch"), 0);
  }
  CHECK(!tt::recv_set(ch, {10000}));
  tshare_channel_close(ch);
}

TS_TEST(sets_of_1_290_and_10000_tensors_round_trip_with_metadata) {
  int sock;
  pid_t pid = fork_with_socket(plan_consumer, &sock);
  tshare_channel *ch = open_channel(sock, "set producer");
  for (const Plan &p : plans) {
    tt::NamedTensors set = plan_tensors(p);
    tt::SetOptions o;
    o.meta = meta_of(p);
    uint64_t id;
    if (p.count == 290) { // as a module's named_parameters() gives them
      tt::TensorDict dict;
      for (auto &e : set) dict.insert(e.first, e.second);
      id = tt::send_set(ch, dict, o);
    } else {
      id = tt::send_set(ch, set, o);
    }
    CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(tshare_channel_outstanding(ch), 0);
    CHECK(at::equal(set[0].second, at::full({4}, -1.0f))); // the consumer's write
  }
  bye_and_wait_released(ch, 10000);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

// ---- every dtype and layout in one set --------------------------------------

static tt::NamedTensors dtypes_and_layouts(const at::Tensor &base) {
  tt::NamedTensors set;
  for (at::ScalarType t : all_dtypes) set.emplace_back(c10::toString(t), pattern(t, 100));
  for (auto &e : layouts_of(base)) set.push_back(e);
  return set;
}

static void layout_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "layout consumer");
  at::Tensor mine = at::arange(120, at::kFloat).view({4, 5, 6});
  tt::NamedTensors expected = dtypes_and_layouts(mine);
  auto r = tt::recv_set(ch, {10000});
  CHECK(r && r->tensors.size() == expected.size());
  for (size_t i = 0; i < expected.size(); i++) {
    const at::Tensor &got = r->tensors[i].value();
    const at::Tensor &want = expected[i].second;
    CHECK(r->tensors[i].key() == expected[i].first);
    if (got.scalar_type() != want.scalar_type() || got.sizes() != want.sizes() || got.strides() != want.strides())
      TS_FAIL("%s: dtype or layout differs", expected[i].first.c_str());
    if (!at::equal(got, want)) TS_FAIL("%s: values differ", expected[i].first.c_str());
  }
  // The views of one storage are one memory, mapped once: a write through
  // "offset row" lands in the producer's base at [2][1][0].
  at::Tensor whole = r->tensors["whole"], row = r->tensors["offset row"];
  CHECK((char *)row.data_ptr() == (char *)whole.data_ptr() + 2 * 30 * sizeof(float));
  row[1][0].fill_(-1.0f);
  r.reset();
  whole.reset();
  row.reset();
  CHECK(!tt::recv_set(ch, {10000}));
  tshare_channel_close(ch);
}

TS_TEST(every_dtype_and_layout_in_one_set) {
  int sock;
  pid_t pid = fork_with_socket(layout_consumer, &sock);
  tshare_channel *ch = open_channel(sock, "layout producer");
  at::Tensor base = tt::empty_shared({4, 5, 6});
  base.copy_(at::arange(120, at::kFloat).view({4, 5, 6}));
  tt::NamedTensors set = dtypes_and_layouts(base);
  for (auto &e : set) tt::share_memory_(e.second);
  uint64_t id = tt::send_set(ch, set);
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(base[2][1][0].item<float>(), -1);
  CHECK_EQ(base[2][1][1].item<float>(), 2 * 30 + 6 + 1);
  bye_and_wait_released(ch, 10000);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

// ---- a module shared in place, updated in place, sent per version ----------

static torch::nn::Sequential small_model() {
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::BatchNorm1d(16), torch::nn::Linear(16, 4));
}

// The module's state as a set: parameters, then buffers.
static tt::NamedTensors state_of(torch::nn::Module &m) {
  tt::NamedTensors state;
  for (auto &p : m.named_parameters()) state.emplace_back(p.key(), p.value());
  for (auto &b : m.named_buffers()) state.emplace_back(b.key(), b.value());
  return state;
}

// Version v's value of the k-th tensor of the state (exact in every dtype
// the model holds, the int64 batch counter included).
static double value_at(int version, size_t k) { return 100.0 * version + double(k); }

static void version_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "version consumer");
  int versions = 0;
  while (auto r = tt::recv_set(ch, {10000})) {
    int v = std::stoi(r->meta.substr(8)); // "version N"
    CHECK_EQ(v, versions + 1);
    size_t k = 0;
    for (const auto &item : r->tensors) {
      if (!at::equal(item.value(), at::full_like(item.value(), value_at(v, k))))
        TS_FAIL("version %d: %s is not %g", v, item.key().c_str(), value_at(v, k));
      k++;
    }
    if (v == 3) r->tensors["0.bias"][5].fill_(-1.0f); // seen by the producer's module
    versions++;
  }
  CHECK_EQ(versions, 3);
  tshare_channel_close(ch);
}

TS_TEST(a_module_shared_in_place_is_updated_and_sent_again_per_version) {
  int sock;
  pid_t pid = fork_with_socket(version_consumer, &sock);
  tshare_channel *ch = open_channel(sock, "trainer");
  torch::NoGradGuard no_grad;
  torch::nn::Sequential model = small_model();
  tt::share_module_(*model);
  CHECK_EQ(count_mappings("tshare-torch"), 1); // one buffer for the whole module
  std::vector<void *> storages;
  for (auto &e : state_of(*model)) {
    CHECK(tt::is_shared(e.second));
    storages.push_back(e.second.data_ptr());
  }
  tt::share_module_(*model); // idempotent: nothing moves again
  tt::share_module_(*model, /*pack_cuda=*/true); // no CUDA tensors: the same
  CHECK_EQ(count_mappings("tshare-torch"), 1);
  tt::NamedTensors after = state_of(*model);
  for (size_t k = 0; k < after.size(); k++) CHECK(after[k].second.data_ptr() == storages[k]);
  for (int v = 1; v <= 3; v++) {
    tt::NamedTensors state = state_of(*model);
    for (size_t k = 0; k < state.size(); k++) {
      state[k].second.fill_(value_at(v, k)); // in place, as an optimizer step
      CHECK(state[k].second.data_ptr() == storages[k]);
    }
    uint64_t id = tt::send_set(ch, state, {"version " + std::to_string(v)});
    CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  auto *linear = model[0]->as<torch::nn::Linear>();
  CHECK_EQ(linear->bias[5].item<float>(), -1);
  CHECK_EQ(linear->bias[4].item<float>(), value_at(3, 1));
  bye_and_wait_released(ch, 10000);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

TS_TEST(share_module_moves_parameters_and_buffers_into_one_buffer_in_place) {
  torch::nn::Module m;
  at::Tensor w = m.register_parameter("w", at::arange(16, at::kFloat).view({4, 4}));
  at::Tensor tied = m.register_buffer("w_t", w.t()); // another tensor on w's storage
  at::Tensor count = m.register_buffer("count", at::full({3}, 7, at::kLong));
  at::Tensor shared = m.register_buffer("already", tt::empty_shared({2}));
  void *already_at = shared.data_ptr();
  at::Tensor old_view = w.narrow(0, 1, 1); // taken before: keeps the old memory
  c10::TensorImpl *w_impl = w.unsafeGetTensorImpl();
  tt::share_module_(m);
  CHECK(m.named_parameters()["w"].unsafeGetTensorImpl() == w_impl); // the same tensor, moved
  CHECK(tt::is_shared(w) && tt::is_shared(tied) && tt::is_shared(count));
  CHECK(w.requires_grad());
  CHECK(at::equal(w, at::arange(16, at::kFloat).view({4, 4})) && at::equal(count, at::full({3}, 7, at::kLong)));
  CHECK(tied.data_ptr() == w.data_ptr() && at::equal(tied, w.t())); // still tied
  CHECK(w.storage().unsafeGetStorageImpl() == count.storage().unsafeGetStorageImpl()); // one buffer
  CHECK(shared.data_ptr() == already_at); // already shared: left alone
  CHECK(!tt::is_shared(old_view));
  CHECK_EQ(count_mappings("tshare-torch"), 2); // the module's buffer and "already"
  {
    torch::NoGradGuard no_grad;
    w.add_(1);
  }
  CHECK_EQ(tied[0][1].item<float>(), 5); // w[1][0] + 1, through the tied view
}

// ---- a state_dict outside shared memory -------------------------------------

static void one_set_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "consumer");
  auto r = tt::recv_set(ch, {10000});
  CHECK(r && r->meta == "moved");
  r->tensors["2.weight"].fill_(5.0f);
  r.reset();
  CHECK(!tt::recv_set(ch, {10000}));
  tshare_channel_close(ch);
}

TS_TEST(a_state_dict_outside_shared_memory_is_refused_or_moved_in_place) {
  int sock;
  pid_t pid = fork_with_socket(one_set_consumer, &sock);
  tshare_channel *ch = open_channel(sock, "producer");
  torch::NoGradGuard no_grad;
  torch::nn::Sequential model = small_model();
  CHECK_THROWS_CODE(tt::send_set(ch, model->named_parameters()), TSHARE_E_UNSUPPORTED, "share_module_(module)");
  CHECK_THROWS_CODE(tt::send_set(ch, model->named_parameters()), TSHARE_E_UNSUPPORTED, "tensor 0 ('0.weight')");
  for (auto &p : model->parameters()) CHECK(!tt::is_shared(p)); // refused: nothing moved
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  tt::SetOptions move;
  move.meta = "moved";
  move.move_to_shared_memory = true;
  uint64_t id = tt::send_set(ch, model->named_parameters(), move);
  for (auto &p : model->parameters()) CHECK(tt::is_shared(p)); // the module's own storage moved
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK(at::equal(model[2]->as<torch::nn::Linear>()->weight, at::full({4, 16}, 5.0f)));
  bye_and_wait_released(ch, 10000);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

// ---- what a set cannot carry --------------------------------------------------

static void refusals_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "consumer");
  // A set from a C producer with a dtype LibTorch lacks: released back.
  CHECK_THROWS_CODE(tt::recv_set(ch, {10000}), TSHARE_E_UNSUPPORTED, "no LibTorch equivalent");
  // The channel goes on: the first set the bridge refused nothing of.
  auto r = tt::recv_set(ch, {10000});
  CHECK(r && r->meta == "fine" && r->tensors.size() == 1 && at::equal(r->tensors["ok"], at::ones({3})));
  // A received tensor cannot go on in a set of this process (alone it can).
  CHECK_THROWS_CODE(tt::send_set(ch, {{"again", r->tensors["ok"]}}), TSHARE_E_UNSUPPORTED, "received from a peer");
  r.reset();
  CHECK(!tt::recv_set(ch, {10000}));
  tshare_channel_close(ch);
}

TS_TEST(bad_sets_get_clear_errors_and_the_channel_stays_usable) {
  int sock;
  pid_t pid = fork_with_socket(refusals_consumer, &sock);
  tshare_channel *ch = open_channel(sock, "producer");
  at::Tensor a = tt::empty_shared({3}), b = tt::empty_shared({3});
  CHECK_THROWS_CODE(tt::send_set(ch, {{"x", a}, {"y", b}, {"x", b}}), TSHARE_E_INVALID_ARG, "already in the set");
  CHECK_THROWS_CODE(tt::send_set(ch, {{"x", a}, {"", b}}), TSHARE_E_TOO_LARGE, "tensor 1 ('')");
  std::string long_name(TSHARE_SET_NAME_MAX + 1, 'n');
  CHECK_THROWS_CODE(tt::send_set(ch, {{long_name, a}}), TSHARE_E_TOO_LARGE, "1025 bytes");
  CHECK_THROWS_CODE(tt::send_set(ch, {{std::string("a\0b", 3), a}}), TSHARE_E_INVALID_ARG, "NUL");
  tt::SetOptions big;
  big.meta.assign(TSHARE_SET_META_MAX + 1, 'm');
  CHECK_THROWS_CODE(tt::send_set(ch, {{"x", a}}, big), TSHARE_E_TOO_LARGE, "metadata");
  CHECK_THROWS_CODE(tt::send_set(ch, tt::NamedTensors{}), TSHARE_E_INVALID_ARG, "no tensors");
  CHECK_THROWS_CODE(tt::send_set(ch, {{"x", a}, {"sparse", at::ones({2, 2}).to_sparse()}}), TSHARE_E_UNSUPPORTED,
                    "tensor 1 ('sparse'): cannot send a sparse tensor");
  CHECK_THROWS_CODE(tt::send_set(ch, {{"m", at::empty({2}, at::TensorOptions().device(at::kMeta))}}),
                    TSHARE_E_UNSUPPORTED, "meta tensor");
  CHECK_THROWS_CODE(tt::send_set(nullptr, {{"x", a}}), TSHARE_E_INVALID_ARG, "no channel");
  CHECK_EQ(tshare_channel_outstanding(ch), 0); // nothing went out

  // From C: a member whose dtype the bridge cannot represent.
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-c", &buf, NULL), TSHARE_OK, "");
  int64_t n = 8;
  tshare_tensor_desc u16 = tshare_tensor_contiguous({TSHARE_DTYPE_UINT, 16, 1}, 1, &n, 0);
  tshare_set_builder *builder = tshare_set_builder_create();
  tshare_error err;
  CHECK_RC(tshare_set_builder_add_host(builder, "u16", buf, &u16, &err), TSHARE_OK, err.message);
  uint64_t refused;
  CHECK_RC(tshare_set_send(ch, builder, NULL, 5000, &refused), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder_destroy(builder);
  tshare_host_buffer_destroy(buf);
  a.fill_(1.0f);
  tt::send_set(ch, {{"ok", a}}, {"fine"});
  bye_and_wait_released(ch, 10000);
  CHECK_EQ(tshare_share_is_released(ch, refused), 1);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

// ---- a consumer killed while holding a set ---------------------------------

static void dies_holding_a_set(int fd) {
  tshare_channel *ch = open_channel(fd, "consumer");
  auto r = tt::recv_set(ch, {10000});
  CHECK(r && r->tensors.size() == 290);
  at::Tensor kept = r->tensors[5].value().narrow(0, 1, 2);
  (void)kept;
  kill(getpid(), SIGKILL);
}

TS_TEST(a_consumer_killed_holding_a_set_frees_everything) {
  int sock;
  pid_t pid = fork_with_socket(dies_holding_a_set, &sock);
  tshare_channel *ch = open_channel(sock, "producer");
  uint64_t id;
  {
    tt::NamedTensors set = plan_tensors(plans[1]); // 290 tensors, each its own memfd
    id = tt::send_set(ch, set);
  } // the producer's tensors are gone: only the sent set holds the memory
  CHECK_EQ(count_mappings("tshare-torch"), 290);
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_share_is_released(ch, id), 1);
  CHECK_EQ(count_mappings("tshare-torch"), 0);
  int st = wait_child(pid);
  CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
  tshare_channel_close(ch);
}

// ---- fan-out ---------------------------------------------------------------------

// Consumer kinds, by the fork's argument: one that releases at once, one
// gone before the set comes, one that holds the set until the producer's bye.
static void releasing_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "releasing");
  auto r = tt::recv_set(ch, {10000});
  CHECK(r && r->meta == "v1" && at::equal(r->tensors["w"], at::full({4}, 2.0f)));
  r.reset();
  CHECK(!tt::recv_set(ch, {10000}));
  tshare_channel_close(ch);
}

static void gone_consumer(int fd) { tshare_channel_close(open_channel(fd, "gone")); }

static void holding_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "holding");
  auto r = tt::recv_set(ch, {10000});
  CHECK(r && r->meta == "v1");
  CHECK(!tt::recv_set(ch, {10000})); // holds r until the bye
  tshare_channel_close(ch);
}

TS_TEST(fan_out_reports_each_consumer_on_its_own) {
  void (*kinds[])(int) = {releasing_consumer, gone_consumer, releasing_consumer, holding_consumer};
  std::vector<pid_t> pids;
  std::vector<tshare_channel *> channels;
  for (auto kind : kinds) {
    int sock;
    pids.push_back(fork_with_socket(kind, &sock));
    channels.push_back(open_channel(sock, "trainer"));
  }
  CHECK_EQ(wait_child(pids[1]), 0);
  channels.push_back(nullptr);
  at::Tensor w = tt::empty_shared({4});
  w.fill_(2.0f);
  std::vector<tt::SendResult> results = tt::send_set_all(channels, {{"w", w}}, {"v1"}, 2000);
  CHECK_EQ(results.size(), 5);
  for (size_t i : std::vector<size_t>{0, 2}) {
    if (!results[i].ok()) TS_FAIL("consumer %zu: %s", i, results[i].error.c_str());
    CHECK(results[i].released && results[i].set_id != 0);
  }
  CHECK(!results[1].ok() && !results[1].released); // gone: its own error, the others unaffected
  CHECK(strstr(results[1].error.c_str(), "consumer 1"));
  CHECK_EQ(results[3].code, TSHARE_E_TIMEOUT); // still holding it
  CHECK(!results[3].released && strstr(results[3].error.c_str(), "consumer 3"));
  CHECK(strstr(results[3].error.c_str(), "not released within 2000 ms"));
  CHECK_EQ(results[4].code, TSHARE_E_INVALID_ARG);
  for (size_t i : std::vector<size_t>{0, 2, 3}) bye_and_wait_released(channels[i], 10000);
  for (size_t i : std::vector<size_t>{0, 2, 3}) CHECK_CHILD_OK(pids[i]);
  for (tshare_channel *ch : channels)
    if (ch) tshare_channel_close(ch);
}

// ---- C and C++ on either end -------------------------------------------------

static void c_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "C consumer");
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_set_count(s), 2);
  size_t len;
  const char *meta = static_cast<const char *>(tshare_set_meta(s, &len));
  CHECK(len == 9 && memcmp(meta, "from C++\0", 9) == 0);
  long k = tshare_set_find(s, "transposed");
  CHECK_EQ(k, 1);
  const tshare_tensor_desc *d = tshare_set_desc(s, size_t(k));
  CHECK(d->ndim == 2 && d->shape[0] == 3 && d->shape[1] == 2 && d->strides[0] == 1 && d->strides[1] == 3);
  CHECK(d->dtype.code == TSHARE_DTYPE_INT && d->dtype.bits == 64);
  int64_t *x = static_cast<int64_t *>(tshare_set_data(s, size_t(k)));
  CHECK(x[0] == 0 && x[3] == 3 && x[1] == 1); // [0][0], [0][1] = m[1][0], [1][0] = m[0][1]
  x[0] = -9;
  tshare_set_release(s);
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(a_cpp_producer_and_a_c_consumer) {
  int sock;
  pid_t pid = fork_with_socket(c_consumer, &sock);
  tshare_channel *ch = open_channel(sock, "C++ producer");
  at::Tensor m = tt::empty_shared({2, 3}, at::kLong);
  m.copy_(at::arange(6, at::kLong).view({2, 3}));
  uint64_t id = tt::send_set(ch, {{"m", m}, {"transposed", m.t()}}, {std::string("from C++\0", 9)});
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(m[0][0].item<int64_t>(), -9);
  bye_and_wait_released(ch, 10000);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

static void cpp_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "C++ consumer");
  auto r = tt::recv_set(ch, {10000});
  CHECK(r && r->meta == "from C" && r->tensors.size() == 2);
  CHECK(r->tensors[0].key() == "b" && r->tensors[1].key() == "a"); // the C builder's order
  CHECK(at::equal(r->tensors["a"], at::arange(8, at::kFloat)));
  CHECK(at::equal(r->tensors["b"], at::arange(8, at::kFloat).narrow(0, 4, 4)));
  r->tensors["b"].fill_(0.5f);
  r.reset();
  CHECK(!tt::recv_set(ch, {10000}));
  tshare_channel_close(ch);
}

// A C producer's memory: 8 floats 0..7 in one host buffer.
static tshare_host_buffer *numbered_buffer() {
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(8 * sizeof(float), "tshare-c", &buf, NULL), TSHARE_OK, "");
  float *f = static_cast<float *>(tshare_host_buffer_data(buf));
  for (int i = 0; i < 8; i++) f[i] = float(i);
  return buf;
}

static tshare_tensor_desc floats_at(int64_t n, size_t first) {
  tshare_dtype f32 = {TSHARE_DTYPE_FLOAT, 32, 1};
  return tshare_tensor_contiguous(f32, 1, &n, first * sizeof(float));
}

// Builder b sent (and destroyed), then released by the consumer.
static void send_until_released(tshare_channel *ch, tshare_set_builder *b) {
  uint64_t id;
  CHECK_RC(tshare_set_send(ch, b, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder_destroy(b);
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
}

// The C producer's set: "b" (the buffer's last 4 floats), then "a" (all 8),
// metadata "from C".
static void send_c_set(tshare_channel *ch, tshare_host_buffer *buf) {
  tshare_tensor_desc whole = floats_at(8, 0), tail = floats_at(4, 4);
  tshare_set_builder *b = tshare_set_builder_create();
  tshare_error err;
  CHECK_RC(tshare_set_builder_add_host(b, "b", buf, &tail, &err), TSHARE_OK, err.message);
  CHECK_RC(tshare_set_builder_add_host(b, "a", buf, &whole, &err), TSHARE_OK, err.message);
  CHECK_RC(tshare_set_builder_set_meta(b, "from C", 6, &err), TSHARE_OK, err.message);
  send_until_released(ch, b);
}

// The consumer wrote 0.5 into "b"; the producer says bye.
static void end_c_producer(tshare_channel *ch, tshare_host_buffer *buf, pid_t pid) {
  const float *f = static_cast<const float *>(tshare_host_buffer_data(buf));
  for (int i = 0; i < 8; i++) CHECK(f[i] == (i < 4 ? float(i) : 0.5f));
  tshare_host_buffer_destroy(buf);
  bye_and_wait_released(ch, 10000);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

// A C producer to consumer: the C set; then (odd) a set of odd shapes (a
// scalar, an empty tensor, a stride-0 one), and one of a good tensor
// followed by a float32 view with a negative stride, which LibTorch cannot
// hold.
static void run_c_producer(void (*consumer)(int), bool odd) {
  int sock;
  pid_t pid = fork_with_socket(consumer, &sock);
  tshare_channel *ch = open_channel(sock, "C producer");
  tshare_host_buffer *buf = numbered_buffer();
  send_c_set(ch, buf);
  if (odd) {
    tshare_tensor_desc scalar = floats_at(1, 1), empty = floats_at(0, 2), repeated = floats_at(4, 3);
    scalar.ndim = 0;
    repeated.strides[0] = 0;
    tshare_set_builder *b = tshare_set_builder_create();
    tshare_error err;
    CHECK_RC(tshare_set_builder_add_host(b, "scalar", buf, &scalar, &err), TSHARE_OK, err.message);
    CHECK_RC(tshare_set_builder_add_host(b, "empty", buf, &empty, &err), TSHARE_OK, err.message);
    CHECK_RC(tshare_set_builder_add_host(b, "repeated", buf, &repeated, &err), TSHARE_OK, err.message);
    send_until_released(ch, b);
    tshare_tensor_desc whole = floats_at(8, 0), backwards = floats_at(8, 7);
    backwards.strides[0] = -1;
    b = tshare_set_builder_create();
    CHECK_RC(tshare_set_builder_add_host(b, "whole", buf, &whole, &err), TSHARE_OK, err.message);
    CHECK_RC(tshare_set_builder_add_host(b, "reversed", buf, &backwards, &err), TSHARE_OK, err.message);
    send_until_released(ch, b); // refused by the consumer after its first tensor: released back
  }
  end_c_producer(ch, buf, pid);
}

TS_TEST(a_c_producer_and_a_cpp_consumer) { run_c_producer(cpp_consumer, false); }

// A consumer that takes sets through the C API, looks at one before it
// makes tensors of it (adopt_set), and meets one LibTorch cannot hold.
static void adopting_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "adopting consumer");
  tshare_set *set = nullptr;
  CHECK_RC(tshare_set_recv(ch, 10000, &set), TSHARE_OK, tshare_channel_last_error(ch));
  size_t len = 0;
  CHECK(tshare_set_count(set) == 2 && tshare_set_meta(set, &len) && len == 6);
  tt::ReceivedSet r = tt::adopt_set(set); // the tensors hold the set from here
  CHECK(r.meta == "from C" && r.tensors.size() == 2 && r.set_id == tshare_set_id(set));
  CHECK(r.tensors[0].key() == "b" && r.tensors[1].key() == "a");
  CHECK(at::equal(r.tensors["a"], at::arange(8, at::kFloat)));
  CHECK(at::equal(r.tensors["b"], at::arange(8, at::kFloat).narrow(0, 4, 4)));
  at::Tensor kept = r.tensors["b"];
  r.tensors.clear();
  kept.fill_(0.5f); // the set is released with this last tensor
  kept.reset();
  // Each storage spans its tensor's elements, as at::from_blob's would.
  CHECK_RC(tshare_set_recv(ch, 10000, &set), TSHARE_OK, tshare_channel_last_error(ch));
  r = tt::adopt_set(set);
  const at::Tensor &scalar = r.tensors["scalar"], &empty = r.tensors["empty"], &repeated = r.tensors["repeated"];
  CHECK(scalar.dim() == 0 && scalar.item<float>() == 1.0f && scalar.storage().nbytes() == 4);
  CHECK(empty.numel() == 0 && empty.storage().nbytes() == 0);
  CHECK(at::equal(repeated, at::full({4}, 3.0f)) && repeated.storage().nbytes() == 4);
  r.tensors.clear();
  CHECK_RC(tshare_set_recv(ch, 10000, &set), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_THROWS_CODE(tt::adopt_set(set), TSHARE_E_UNSUPPORTED, "negative stride"); // and released back
  CHECK_THROWS_CODE(tt::adopt_set(nullptr), TSHARE_E_INVALID_ARG, "no set");
  CHECK_RC(tshare_set_recv(ch, 10000, &set), TSHARE_END, "bye");
  tshare_channel_close(ch);
}

TS_TEST(a_set_taken_through_the_c_api_is_adopted_as_tensors) { run_c_producer(adopting_consumer, true); }

TS_TEST_MAIN
