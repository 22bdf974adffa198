// The LibTorch bridge with CPU tensors, between real processes: every dtype,
// layouts and storage offsets, writes back, the storage kept until release,
// the deleter releasing exactly once (also from another thread), forwarding
// to a third process, and the errors for what cannot be shared.
#include "torch_test_util.h"

#include <ATen/MapAllocator.h>

#include <thread>

// ---- every dtype ------------------------------------------------------------

static void dtype_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "dtype consumer");
  size_t i = 0;
  while (auto r = tt::recv(ch, {5000})) {
    CHECK(i < all_dtypes.size());
    at::ScalarType want = all_dtypes[i++];
    CHECK(r->tag == c10::toString(want));
    CHECK(r->tensor.scalar_type() == want);
    CHECK(r->tensor.is_cpu());
    CHECK(at::equal(r->tensor, pattern(want, 100)));
  }
  CHECK_EQ(i, all_dtypes.size());
  tshare_channel_close(ch);
}

TS_TEST(every_dtype_round_trips) {
  int sock;
  pid_t pid = fork_with_socket(dtype_consumer, &sock);
  tshare_channel *ch = open_channel(sock, "dtype producer");
  for (at::ScalarType t : all_dtypes) {
    tshare_dtype d = tt::to_tshare_dtype(t);
    CHECK(tt::to_scalar_type(d) == t); // the mapping is a bijection on these
    tt::SendOptions o;
    o.tag = c10::toString(t);
    tt::send(ch, pattern(t, 100), o);
  }
  bye_and_wait_released(ch, 10000);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

// ---- layouts, storage offsets, writes back ----------------------------------

static void layout_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "layout consumer");
  at::Tensor mine = at::arange(120, at::kFloat).view({4, 5, 6});
  auto expected = layouts_of(mine);
  std::vector<at::Tensor> got;
  for (auto &e : expected) {
    auto r = tt::recv(ch, {5000});
    CHECK(r && r->tag == e.first);
    at::Tensor t = r->tensor;
    if (t.sizes() != e.second.sizes() || t.strides() != e.second.strides())
      TS_FAIL("%s: layout differs", e.first.c_str());
    CHECK(at::equal(t, e.second));
    got.push_back(t);
  }
  // All views came out of one storage, mapped once: the write lands in the
  // producer's base, at element [2][1][0] seen through the "offset row" view.
  CHECK((char *)got[3].data_ptr() == (char *)got[0].data_ptr() + 2 * 30 * sizeof(float));
  got[3][1][0].fill_(-1.0f);
  got.clear();
  CHECK(!tt::recv(ch, {5000}));
  tshare_channel_close(ch);
}

TS_TEST(layouts_and_offsets_arrive_as_sent_and_writes_come_back) {
  int sock;
  pid_t pid = fork_with_socket(layout_consumer, &sock);
  tshare_channel *ch = open_channel(sock, "layout producer");
  at::Tensor base = at::arange(120, at::kFloat).view({4, 5, 6}); // ordinary memory: moved once
  void *before = base.data_ptr();
  for (auto &e : layouts_of(base)) {
    tt::SendOptions o;
    o.tag = e.first;
    tt::send(ch, e.second, o);
  }
  CHECK(tt::is_shared(base));
  CHECK(base.data_ptr() != before); // moved into a memfd, in place
  bye_and_wait_released(ch, 10000);
  CHECK_EQ(base[2][1][0].item<float>(), -1);
  CHECK_EQ(base[2][1][1].item<float>(), 2 * 30 + 6 + 1);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

TS_TEST(share_memory_moves_storage_in_place) {
  at::Tensor a = at::arange(1000, at::kLong);
  at::Tensor view = a.narrow(0, 10, 5);
  CHECK(!tt::is_shared(a));
  tt::share_memory_(view);
  CHECK(tt::is_shared(a) && tt::is_shared(view)); // one storage: both moved
  CHECK(at::equal(a, at::arange(1000, at::kLong)));
  view.fill_(-3);
  CHECK_EQ(a[12].item<int64_t>(), -3);
  CHECK_EQ(count_mappings("tshare-torch"), 1);
  CHECK_THROWS_CODE(tt::share_memory_(at::Tensor()), TSHARE_E_INVALID_ARG, "CPU tensor");
  bool resize_refused = false;
  try {
    a.resize_({100000}); // would silently leave shared memory
  } catch (const c10::Error &) {
    resize_refused = true;
  }
  CHECK(resize_refused);
  at::Tensor z = tt::empty_shared({3, 4}, at::kDouble);
  CHECK(tt::is_shared(z) && z.is_contiguous() && z.scalar_type() == at::kDouble);
  CHECK(at::equal(z, at::zeros({3, 4}, at::kDouble)));
  CHECK_THROWS_CODE(tt::empty_shared({-1}), TSHARE_E_INVALID_ARG, "negative");
  a.reset();
  view.reset();
  z.reset();
  CHECK_EQ(count_mappings("tshare-torch"), 0);
}

// ---- torch's own shared memory: its file travels, nothing copied ----------

// A tensor in torch's shared memory as Tensor.share_memory_() makes it under
// the file_descriptor strategy: an unlinked /dev/shm file kept open by fd.
static at::Tensor in_torch_shared_memory(int64_t n) {
  size_t bytes = static_cast<size_t>(n) * sizeof(float);
  std::string name = "/tshare_test_" + std::to_string(getpid());
  int flags = at::ALLOCATOR_MAPPED_SHAREDMEM | at::ALLOCATOR_MAPPED_EXCLUSIVE | at::ALLOCATOR_MAPPED_KEEPFD |
              at::ALLOCATOR_MAPPED_UNLINK;
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes,
                       at::MapAllocator::makeDataPtr(name, flags, bytes, nullptr), nullptr, false);
  at::Tensor t = at::empty({0}, at::kFloat);
  t.set_(storage, 0, {n}, {1});
  t.copy_(at::arange(n, at::kFloat));
  return t;
}

static void writes_minus_one(int fd) {
  tshare_channel *ch = open_channel(fd, "torch shm consumer");
  auto r = tt::recv(ch, {5000});
  CHECK(r && at::equal(r->tensor, at::arange(10, 20, at::kFloat)));
  r->tensor.fill_(-1.0f);
  r.reset();
  CHECK(!tt::recv(ch, {5000}));
  tshare_channel_close(ch);
}

TS_TEST(a_tensor_in_torch_shared_memory_travels_as_that_memory) {
  int sock;
  pid_t pid = fork_with_socket(writes_minus_one, &sock);
  tshare_channel *ch = open_channel(sock, "torch shm producer");
  at::Tensor t = in_torch_shared_memory(64);
  void *before = t.data_ptr();
  CHECK(tt::is_shared(t));
  tt::SendOptions o;
  o.move_to_shared_memory = false; // nothing to move: it is shared memory already
  tt::send(ch, t.narrow(0, 10, 10), o);
  CHECK(t.data_ptr() == before);
  CHECK_EQ(count_mappings("tshare-torch"), 0); // no memfd was made
  bye_and_wait_released(ch, 10000);
  CHECK_EQ(t[10].item<float>(), -1);
  CHECK_EQ(t[19].item<float>(), -1);
  CHECK_EQ(t[20].item<float>(), 20);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

// ---- lifetime: kept until released, released exactly once -----------------

// Drive ch once without waiting: queued releases go out.
static void flush(tshare_channel *ch) {
  int rc = tshare_channel_poll(ch, 0);
  if (rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT) TS_FAIL("poll: %s", tshare_channel_last_error(ch));
}

static void holder(int fd) {
  tshare_channel *ch = open_channel(fd, "holder");
  auto r = tt::recv(ch, {5000});
  CHECK(r);
  at::Tensor slice = r->tensor.narrow(0, 100, 10);
  r->tensor.reset(); // the slice still holds the share
  flush(ch);
  tt::send(ch, at::zeros({1}), {"still holding"});
  // The producer dropped its tensor meanwhile: the memory is still here.
  auto go = tt::recv(ch, {5000});
  CHECK(go && go->tag == "dropped");
  go.reset();
  CHECK(at::equal(slice, at::arange(100, 110, at::kInt)));
  slice.add_(1000);
  // The last reference dies on another thread; the release is queued there.
  std::thread([s = std::move(slice)]() mutable { s.reset(); }).join();
  flush(ch);
  tt::send(ch, at::zeros({1}), {"released"});
  CHECK(!tt::recv(ch, {5000}));
  CHECK_RC(tshare_channel_wait_released(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static int releases;
static void count_release(void *, uint64_t, void *, int status) {
  CHECK_EQ(status, TSHARE_OK);
  releases++;
}

TS_TEST(storage_lives_until_released_and_the_deleter_releases_once) {
  int sock;
  pid_t pid = fork_with_socket(holder, &sock);
  tshare_channel *ch = open_channel(sock, "keeper", count_release);
  uint64_t id;
  {
    at::Tensor t = at::arange(4096, at::kInt);
    id = tt::send(ch, t);
  }
  // The producer's tensor is gone; the share still holds the memfd.
  CHECK_EQ(count_mappings("tshare-torch"), 1);
  auto marker = tt::recv(ch, {5000});
  CHECK(marker && marker->tag == "still holding");
  CHECK_EQ(tshare_share_is_released(ch, id), 0); // the slice still holds it
  marker.reset();
  tt::send(ch, at::zeros({1}), {"dropped"});
  marker = tt::recv(ch, {5000});
  CHECK(marker && marker->tag == "released");
  marker.reset();
  CHECK_EQ(tshare_share_is_released(ch, id), 1);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, "");
  // A second release of the same share would be a protocol error here.
  CHECK_RC(tshare_channel_wait_released(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  int rc;
  while ((rc = tshare_channel_poll(ch, 5000)) == TSHARE_OK) {
  }
  CHECK(rc == TSHARE_END || rc == TSHARE_E_PEER_CLOSED);
  CHECK_EQ(releases, 2); // the tensor and the "dropped" marker, once each
  CHECK_EQ(count_mappings("tshare-torch"), 0);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

// ---- forwarding a received tensor ------------------------------------------

static void third(int fd) {
  tshare_channel *ch = open_channel(fd, "third");
  auto r = tt::recv(ch, {5000});
  CHECK(r && r->tag == "column 3");
  CHECK(at::equal(r->tensor, at::arange(64, at::kDouble).view({8, 8}).select(1, 3)));
  r->tensor.fill_(-7); // two processes away, in the owner's memory
  r.reset();
  CHECK(!tt::recv(ch, {5000}));
  tshare_channel_close(ch);
}

// The third process is forked by the forwarder and inherits its channel to
// the owner; a static keeps that copy reachable, not leaked, in the third.
static tshare_channel *volatile forwarder_upstream;

static void forwarder(int fd) {
  tshare_channel *up = forwarder_upstream = open_channel(fd, "forwarder");
  int down_fd;
  pid_t pid = fork_with_socket(third, &down_fd);
  tshare_channel *down = open_channel(down_fd, "forwarder down");
  {
    auto r = tt::recv(up, {5000});
    CHECK(r);
    tt::send(down, r->tensor.select(1, 3), {"column 3"});
  } // our references are gone; the forward holds the view
  bye_and_wait_released(down, 5000);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(down);
  CHECK(!tt::recv(up, {5000}));
  tshare_channel_close(up);
}

TS_TEST(received_tensor_is_sent_on_to_a_third_process) {
  int sock;
  pid_t pid = fork_with_socket(forwarder, &sock);
  tshare_channel *ch = open_channel(sock, "owner");
  at::Tensor m = tt::empty_shared({8, 8}, at::kDouble);
  m.copy_(at::arange(64, at::kDouble).view({8, 8}));
  tt::send(ch, m);
  CHECK_RC(tshare_channel_wait_released(ch, 0, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK(at::equal(m.select(1, 3), at::full({8}, -7.0, at::kDouble)));
  CHECK_EQ(m[0][2].item<double>(), 2);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, "");
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

// ---- what cannot be shared --------------------------------------------------

static void refusing_consumer(int fd) {
  tshare_channel *ch = open_channel(fd, "consumer");
  // From a C producer: negative strides and a dtype LibTorch lacks.
  CHECK_THROWS_CODE(tt::recv(ch, {5000}), TSHARE_E_UNSUPPORTED, "negative stride");
  CHECK_THROWS_CODE(tt::recv(ch, {5000}), TSHARE_E_UNSUPPORTED, "no LibTorch equivalent");
  // The channel is still fine after both.
  auto r = tt::recv(ch, {5000});
  CHECK(r && r->tag == "fine" && at::equal(r->tensor, at::ones({3})));
  r.reset();
  CHECK(!tt::recv(ch, {5000}));
  tshare_channel_close(ch);
}

TS_TEST(unsupported_tensors_get_clear_errors) {
  int sock;
  pid_t pid = fork_with_socket(refusing_consumer, &sock);
  tshare_channel *ch = open_channel(sock, "producer");
  at::Tensor dense = at::ones({4, 4});
  CHECK_THROWS_CODE(tt::send(ch, at::Tensor()), TSHARE_E_INVALID_ARG, "undefined");
  CHECK_THROWS_CODE(tt::send(ch, dense.to_sparse()), TSHARE_E_UNSUPPORTED, "sparse");
  CHECK_THROWS_CODE(tt::send(ch, at::quantize_per_tensor(dense, 0.1, 0, at::kQInt8)), TSHARE_E_UNSUPPORTED,
                    "quantized");
  CHECK_THROWS_CODE(tt::send(ch, at::empty({4}, at::TensorOptions().device(at::kMeta))), TSHARE_E_UNSUPPORTED,
                    "meta");
  CHECK_THROWS_CODE(tt::send(ch, at::ones({2}, at::kComplexFloat).conj()), TSHARE_E_UNSUPPORTED, "resolve_conj");
  CHECK_THROWS_CODE(tt::send(ch, at::empty({2}, at::kComplexHalf)), TSHARE_E_UNSUPPORTED, "DLPack");
  CHECK_THROWS_CODE(tt::send(ch, at::ones(std::vector<int64_t>(33, 1))), TSHARE_E_TOO_LARGE, "dimensions");
  CHECK_THROWS_CODE(tt::send(ch, dense, {std::string(300, 'x')}), TSHARE_E_TOO_LARGE, "tag");
  tt::SendOptions no_move;
  no_move.move_to_shared_memory = false;
  CHECK_THROWS_CODE(tt::send(ch, dense, no_move), TSHARE_E_UNSUPPORTED, "empty_shared");
  CHECK(!tt::is_shared(dense)); // refused sends leave the tensor alone
  CHECK_THROWS_CODE(tt::send(nullptr, dense), TSHARE_E_INVALID_ARG, "channel");
  CHECK_EQ(tshare_channel_outstanding(ch), 0);

  // Shares a C producer may send that have no LibTorch form.
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(4096, NULL, &buf, NULL), TSHARE_OK, "");
  int64_t n = 8;
  tshare_tensor_desc reversed = tshare_tensor_contiguous({TSHARE_DTYPE_FLOAT, 32, 1}, 1, &n, 7 * sizeof(float));
  reversed.strides[0] = -1;
  tshare_tensor_desc u16 = tshare_tensor_contiguous({TSHARE_DTYPE_UINT, 16, 1}, 1, &n, 0);
  uint64_t a, b;
  CHECK_RC(tshare_share_host(ch, buf, &reversed, NULL, NULL, 5000, &a), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_share_host(ch, buf, &u16, NULL, NULL, 5000, &b), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_host_buffer_destroy(buf);
  tt::send(ch, at::ones({3}), {"fine"});
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, "");
  // The refused shares were released back, not leaked.
  CHECK_RC(tshare_channel_wait_released(ch, 0, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_share_is_released(ch, a), 1);
  CHECK_EQ(tshare_share_is_released(ch, b), 1);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

static void pipe_end(int) {
  int rfd, wfd;
  child_pipe_ends(&rfd, &wfd);
  tshare_channel *ch = nullptr;
  CHECK_RC(tshare_channel_open_pipes(rfd, wfd, NULL, &ch, NULL), TSHARE_OK, "");
  CHECK(!tt::recv(ch, {5000}));
  tshare_channel_close(ch);
}

TS_TEST(cpu_tensor_over_pipes_is_refused_clearly) {
  int rfd, wfd;
  pid_t pid = fork_with_pipes(pipe_end, &rfd, &wfd);
  tshare_channel *ch = nullptr;
  CHECK_RC(tshare_channel_open_pipes(rfd, wfd, NULL, &ch, NULL), TSHARE_OK, "");
  CHECK_THROWS_CODE(tt::send(ch, tt::empty_shared({4})), TSHARE_E_UNSUPPORTED, "socket");
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, "");
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

TS_TEST_MAIN
