// The LibTorch bridge with CUDA tensors between real processes: every dtype
// and layout, caching-allocator blocks with live neighbours in one segment,
// the storage kept until release, ordering on the current streams of both
// sides, forwarding, and the zeroing guard on the emulated affected driver.
// The other processes are this binary again (`--role NAME`, posix_spawn: a
// CUDA process must not fork). Without a GPU every test exits 77.
#include "torch_test_util.h"
#include "tshare/torch_set.h"

#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/nn/module.h>

#include <csignal>
#include <set>
#include <cstring>
#include <ctime>
#include <unistd.h>

static const int TIMEOUT = 20000;

static void need_gpu() {
  tshare_error err;
  if (tshare_cuda_init(&err) != TSHARE_OK) TS_SKIP("%s", err.message);
  if (c10::cuda::device_count() == 0) TS_SKIP("LibTorch sees no CUDA device");
}

// `this-binary --role ROLE` with its channel on fd 3 (and env added).
static tshare_process *spawn_role(const char *role, int channel_fd, char *const *env = nullptr) {
  char *argv[] = {(char *)"/proc/self/exe", (char *)"--role", (char *)role, nullptr};
  tshare_fd_map fds[1] = {{3, channel_fd}};
  tshare_spawn_options so = {};
  so.file = "/proc/self/exe";
  so.argv = argv;
  so.env_set = env;
  so.fds = fds;
  so.nfds = 1;
  tshare_process *p = nullptr;
  tshare_error err;
  if (tshare_spawn(&so, &p, &err) != TSHARE_OK) TS_FAIL("spawn %s: %s", role, err.message);
  close(channel_fd);
  return p;
}

// A socketpair: our end comes back, the role gets the other on fd 3.
static tshare_process *start(const char *role, int *our_fd, char *const *env = nullptr) {
  int sv[2];
  tshare_error err;
  if (tshare_socketpair(sv, &err) != TSHARE_OK) TS_FAIL("%s", err.message);
  *our_fd = sv[0];
  return spawn_role(role, sv[1], env);
}

static void finish(tshare_process *p, const char *what) {
  tshare_exit_status st;
  if (tshare_process_wait(p, TIMEOUT, &st) != TSHARE_OK) {
    tshare_process_terminate(p, 1000, &st);
    TS_FAIL("%s did not end", what);
  }
  tshare_process_destroy(p);
  char why[64];
  if (st.kind != TSHARE_EXIT_CODE || st.value != 0) TS_FAIL("%s: %s", what, tshare_exit_describe(st, why, sizeof why));
}

static const at::TensorOptions on_gpu = at::TensorOptions().device(at::kCUDA, 0);

// PyTorch's caching allocator maps expandable segments with the CUDA VMM
// calls: their tensors travel as fds of the chunks they touch.
static bool expandable() {
  const char *conf = getenv("PYTORCH_CUDA_ALLOC_CONF");
  return conf && strstr(conf, "expandable_segments:True");
}

static void need_expandable() {
  need_gpu();
  if (!expandable()) TS_SKIP("needs PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the @expandable entries)");
}

static int64_t tt_now_ms() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static size_t gpu_free_bytes() {
  size_t free_b = 0, total = 0;
  cudaMemGetInfo(&free_b, &total);
  return free_b;
}

// A consumer whose own GPU memory must not count in the producer's baseline:
// it makes its CUDA context first, then says so.
static void say_ready(tshare_channel *ch) {
  at::zeros({1}, on_gpu);
  c10::cuda::device_synchronize();
  tt::send(ch, at::zeros({1}), {"ready"});
}

static void wait_ready(tshare_channel *ch) {
  auto ready = tt::recv(ch, {TIMEOUT});
  CHECK(ready && ready->tag == "ready");
}

static at::Tensor cuda_base() { return at::arange(120, on_gpu.dtype(at::kFloat)).view({4, 5, 6}); }

// ---- roles ---------------------------------------------------------------------

// Every dtype, then every layout of cuda_base(); writes -1 through "offset row".
static int role_check_all(tshare_channel *ch) {
  for (at::ScalarType t : all_dtypes) {
    auto r = tt::recv(ch, {TIMEOUT});
    CHECK(r && r->tag == c10::toString(t));
    CHECK(r->tensor.is_cuda() && r->tensor.scalar_type() == t);
    CHECK(at::equal(r->tensor, pattern(t, 100, r->tensor.device())));
  }
  at::Tensor mine = cuda_base();
  for (auto &e : layouts_of(mine)) {
    auto r = tt::recv(ch, {TIMEOUT});
    CHECK(r && r->tag == e.first);
    if (r->tensor.sizes() != e.second.sizes() || r->tensor.strides() != e.second.strides())
      TS_FAIL("%s: layout differs", e.first.c_str());
    CHECK(at::equal(r->tensor, e.second));
    if (e.first == "offset row") r->tensor[1][0].fill_(-1.0f);
  }
  CHECK(!tt::recv(ch, {TIMEOUT}));
  return 0;
}

// Adds 10 to whatever arrives (on this process's own pool stream).
static int role_add_ten(tshare_channel *ch) {
  c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
  while (auto r = tt::recv(ch, {TIMEOUT})) {
    CHECK(at::equal(r->tensor, at::full_like(r->tensor, 2)));
    r->tensor.add_(10);
  }
  return 0;
}

// Reads after the producer says it dropped its tensor and reused the memory.
static int role_late_reader(tshare_channel *ch) {
  auto r = tt::recv(ch, {TIMEOUT});
  CHECK(r);
  auto go = tt::recv(ch, {TIMEOUT});
  CHECK(go && go->tag == "dropped and reallocated");
  CHECK(at::equal(r->tensor, at::arange(1 << 20, on_gpu.dtype(at::kInt))));
  r.reset();
  go.reset();
  CHECK(!tt::recv(ch, {TIMEOUT}));
  return 0;
}

// Receives on a pool stream and checks there, with no host sync in between.
static int role_ordered_reader(tshare_channel *ch) {
  c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
  auto r = tt::recv(ch, {TIMEOUT});
  CHECK(r);
  int64_t wrong = (r->tensor != 7).sum().item<int64_t>(); // queued after the event wait
  printf("consumer on its own stream: %lld of %lld elements wrong\n", (long long)wrong,
         (long long)r->tensor.numel());
  CHECK_EQ(wrong, 0);
  r.reset();
  CHECK(!tt::recv(ch, {TIMEOUT}));
  return 0;
}

static int role_third(tshare_channel *ch) {
  auto r = tt::recv(ch, {TIMEOUT});
  CHECK(r && r->tag == "column 3");
  CHECK(at::equal(r->tensor, at::arange(64, on_gpu.dtype(at::kDouble)).view({8, 8}).select(1, 3)));
  r->tensor.fill_(-7);
  r.reset();
  CHECK(!tt::recv(ch, {TIMEOUT}));
  return 0;
}

static int role_forwarder(tshare_channel *up) {
  int down_fd;
  tshare_process *third = start("third", &down_fd);
  tshare_channel *down = open_channel(down_fd, "forwarder down");
  {
    auto r = tt::recv(up, {TIMEOUT});
    CHECK(r);
    tt::send(down, r->tensor.select(1, 3), {"column 3"});
  }
  bye_and_wait_released(down, TIMEOUT);
  finish(third, "third");
  tshare_channel_close(down);
  CHECK(!tt::recv(up, {TIMEOUT}));
  return 0;
}

// Three neighbours in one caching-allocator segment; the middle one is sent.
static int neighbours_producer(tshare_channel *ch, bool expect_guard) {
  // Decide the guard first: in auto mode its probe makes one export of its own.
  const char *why = "";
  int guard = tshare_cuda_export_guard_active(&why);
  printf("guard: %s\n", why);
  CHECK_EQ(guard, expect_guard ? 1 : 0);
  tshare_cuda_export_stats before;
  tshare_cuda_stats(&before);
  at::Tensor a = at::full({1000}, 1, on_gpu.dtype(at::kFloat));
  at::Tensor b = at::full({1000}, 2, on_gpu.dtype(at::kFloat));
  at::Tensor c = at::full({1000}, 3, on_gpu.dtype(at::kFloat));
  // A strided view with a storage offset: every other element of b[100:300].
  at::Tensor part = b.narrow(0, 100, 200).view({100, 2}).select(1, 0);
  tt::send(ch, part);
  tt::send(ch, b.narrow(0, 900, 10));
  bye_and_wait_released(ch, TIMEOUT);
  CHECK(at::equal(a, at::full_like(a, 1)));
  CHECK(at::equal(c, at::full_like(c, 3)));
  at::Tensor want = at::full_like(b, 2);
  want.narrow(0, 100, 200).view({100, 2}).select(1, 0).add_(10);
  want.narrow(0, 900, 10).add_(10);
  CHECK(at::equal(b, want));
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  unsigned long long exports = st.exports - before.exports, hits = st.cache_hits - before.cache_hits,
                     guarded = st.guarded - before.guarded, restored = st.restored - before.restored;
  printf("neighbours intact; exports %llu, handle cache hits %llu, guarded %llu, restored %llu\n", exports, hits,
         guarded, restored);
  if (expandable()) {
    // VMM memory: the chunk is exported once as an fd, which the channel
    // keeps for the next share, and never through cudaIpcGetMemHandle, the
    // call the zeroing bug hides in.
    CHECK_EQ(exports, 1);
    CHECK_EQ(guarded, 0);
    return 0;
  }
  CHECK_EQ(exports, 1); // one segment, exported once: base + offset
  CHECK_EQ(hits, 1);
  if (expect_guard) CHECK(guarded == 1 && restored == 1);
  return 0;
}

static int role_neighbours_producer(tshare_channel *ch) { return neighbours_producer(ch, true); }

// Expandable segments: a tensor over several chunks and a small one; writes
// -5 at the big one's last element.
static int role_chunk_reader(tshare_channel *ch) {
  auto big = tt::recv(ch, {TIMEOUT});
  CHECK(big && big->tag == "big");
  int64_t n = big->tensor.numel();
  CHECK(at::equal(big->tensor, at::arange(n, on_gpu.dtype(at::kFloat)).remainder(1000)));
  auto small = tt::recv(ch, {TIMEOUT});
  CHECK(small && small->tag == "small");
  CHECK(at::equal(small->tensor, at::full({4096}, 3, on_gpu.dtype(at::kInt))));
  big->tensor[n - 1].fill_(-5);
  c10::cuda::device_synchronize();
  big.reset(); // released: the mapping stays open for the next share of these chunks
  tshare_cuda_export_stats st0, st;
  tshare_cuda_stats(&st0);
  auto again = tt::recv(ch, {TIMEOUT});
  CHECK(again && again->tag == "big again");
  CHECK_EQ(again->tensor[n - 1].item<float>(), -5);
  tshare_cuda_stats(&st);
  printf("consumer: %lld floats over several chunks and a small tensor intact; fd imports %llu; the same chunks "
         "again: %llu new imports, %llu cache hits\n",
         (long long)n, (unsigned long long)st0.fd_imports, (unsigned long long)(st.fd_imports - st0.fd_imports),
         (unsigned long long)(st.import_hits - st0.import_hits));
  CHECK_EQ(st.fd_imports, st0.fd_imports);
  CHECK(st.import_hits > st0.import_hits);
  again.reset();
  small.reset();
  CHECK(!tt::recv(ch, {TIMEOUT}));
  return 0;
}

// Holds a view while its producer frees the tensor and empties its cache,
// reads it intact, then releases it.
static int role_holder(tshare_channel *ch) {
  say_ready(ch);
  auto r = tt::recv(ch, {TIMEOUT});
  CHECK(r && r->tag == "held");
  auto freed = tt::recv(ch, {TIMEOUT});
  CHECK(freed && freed->tag == "freed");
  int64_t n = r->tensor.numel();
  CHECK(at::equal(r->tensor, at::arange(n, on_gpu.dtype(at::kInt))));
  printf("consumer: %lld ints read intact after the producer freed them and emptied its cache\n", (long long)n);
  r.reset();
  freed.reset();
  // Still here while the producer watches its GPU memory come back: the
  // mapping this process kept for the next share closes at the retire notice.
  auto measured = tt::recv(ch, {TIMEOUT});
  CHECK(measured && measured->tag == "measured");
  measured.reset();
  CHECK(!tt::recv(ch, {TIMEOUT}));
  return 0;
}

// Twenty hand-offs of one caching-allocator tensor: mapped once, whichever
// allocator mode (the fast path for memory tshare does not own).
static int role_repeat_reader(tshare_channel *ch) {
  tshare_cuda_export_stats st0, st;
  tshare_cuda_stats(&st0);
  int n = 0;
  while (auto r = tt::recv(ch, {TIMEOUT})) {
    CHECK(r->tag == std::to_string(n));
    CHECK(at::equal(r->tensor, at::full({1024}, float(n), on_gpu)));
    n++;
  }
  tshare_cuda_stats(&st);
  unsigned long long opens = (st.imports + st.fd_imports) - (st0.imports + st0.fd_imports),
                     hits = st.import_hits - st0.import_hits;
  printf("consumer: %d hand-offs of one tensor (%s): %llu opens, %llu cache hits\n", n,
         expandable() ? "expandable segments" : "default allocator", opens, hits);
  CHECK_EQ(n, 20);
  CHECK_EQ(opens, 1);
  CHECK_EQ(hits, 19);
  return 0;
}

// Expandable segments: after the first share of a run of chunks, this end
// keeps the mapping and says so, and the next shares come without fds. With
// room for one unclaimed fd, ten shares queued before any is taken are then
// all accepted (with fds, all but one would be refused).
static int role_held_reader() {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "held reader";
  o.max_unclaimed_fds = 1;
  tshare_channel *ch = nullptr;
  tshare_error err;
  CHECK_RC(tshare_channel_open_socket(3, &o, &ch, &err), TSHARE_OK, err.message);
  auto first = tt::recv(ch, {TIMEOUT});
  CHECK(first && first->tag == "first");
  CHECK(at::equal(first->tensor, at::arange(1024, on_gpu.dtype(at::kFloat))));
  first.reset();
  int rc;
  while ((rc = tshare_channel_poll(ch, TIMEOUT)) == TSHARE_OK) {
  } // the release and the notice go; the rest of the stream is queued here
  CHECK_RC(rc, TSHARE_END, tshare_channel_last_error(ch));
  int n = 0;
  while (auto r = tt::recv(ch, {TIMEOUT})) {
    CHECK(r->tag == std::to_string(n));
    CHECK(at::equal(r->tensor, at::arange(n * 100, n * 100 + 100, on_gpu.dtype(at::kFloat))));
    n++;
  }
  printf("consumer: %d shares queued with room for one fd, all taken\n", n);
  CHECK_EQ(n, 10);
  tshare_channel_close(ch);
  return 0;
}

// Takes three shares of one tensor (its memory then kept mapped for the
// next), holds a fourth, and is killed.
static int role_killed_while_keeping(tshare_channel *ch) {
  say_ready(ch);
  for (int i = 0; i < 3; i++) CHECK(tt::recv(ch, {TIMEOUT}));
  auto held = tt::recv(ch, {TIMEOUT});
  CHECK(held && held->tensor.numel() == int64_t(32) << 20);
  raise(SIGKILL);
  return 1;
}

// Tensor sets: each member k of a set holds 3k, 3k+1, 3k+2 (CPU members
// too); read on this process's own pool stream (recv_set orders the current
// stream after the set's event). The metadata says what else to do: "again"
// (every allocation is mapped already: no new opens), "write" (-1 into the
// first tensor before letting go).
// The next set, and how many mappings receiving it opened.
static std::optional<tt::ReceivedSet> recv_set_counting_opens(tshare_channel *ch, unsigned long long *opens) {
  tshare_cuda_export_stats st0, st;
  tshare_cuda_stats(&st0);
  auto r = tt::recv_set(ch, {TIMEOUT});
  tshare_cuda_stats(&st);
  *opens = (st.imports + st.fd_imports) - (st0.imports + st0.fd_imports);
  return r;
}

static int role_set_reader(tshare_channel *ch) {
  c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
  int sets = 0;
  unsigned long long opens;
  while (auto r = recv_set_counting_opens(ch, &opens)) {
    int64_t k = 0, wrong = 0;
    for (auto &item : r->tensors) {
      at::Tensor want = at::arange(3 * k, 3 * k + 3, item.value().options().dtype(at::kFloat));
      wrong += (item.value().to(at::kFloat) != want).sum().item<int64_t>();
      k++;
    }
    printf("consumer: set %d (%s): %zu tensors, %lld elements wrong, %llu mappings opened\n", sets, r->meta.c_str(),
           r->tensors.size(), (long long)wrong, opens);
    CHECK_EQ(wrong, 0);
    if (r->meta == "again") CHECK_EQ(opens, 0);
    // The module's one allocation: one IPC open. Expandable segments carry it
    // as runs of the allocator's chunks instead (counted, not asserted).
    if (r->meta == "packed" && !expandable()) CHECK_EQ(opens, 1);
    if (r->meta == "write") { // on this pool stream: synchronized before the set goes, as docs/torch.md asks
      r->tensors[0].value().fill_(-1.0f);
      c10::cuda::getCurrentCUDAStream().synchronize();
    }
    sets++;
  }
  return 0;
}

// Versions from a SetSender: member k of version v holds 1000v + k in each
// of its values, read on this process's own pool stream; from the second
// version on, nothing new is mapped (the same set, sent again).
// With a SetReceiver (ahead): the versions sent again come with their tensors
// made ahead, and read right (ordered after the producer's stream all the same).
// With into: each version after the first is received into the tensors of the
// one before (release, recv_into): the same tensor objects while the layout
// holds, read right after the producer's work.
static int read_versions(tshare_channel *ch, tt::SetReceiver *receiver, bool into = false) {
  c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
  int v = 0;
  unsigned long long opens;
  std::optional<tt::ReceivedSet> last; // into: the set whose tensors take the next
  std::vector<at::Tensor> before;      // its tensors, to compare the next's with
  int same = 0;                        // versions that came into the tensors before them
  auto next = [&]() -> std::optional<tt::ReceivedSet> {
    if (!receiver) return recv_set_counting_opens(ch, &opens);
    tshare_cuda_export_stats st0, st;
    tshare_cuda_stats(&st0);
    auto r = into && last ? receiver->recv_into(ch, *last, {TIMEOUT}) : receiver->recv(ch, {TIMEOUT});
    tshare_cuda_stats(&st);
    opens = (st.imports + st.fd_imports) - (st0.imports + st0.fd_imports);
    if (into && r) {
      bool kept = before.size() == r->tensors.size();
      for (size_t k = 0; kept && k < before.size(); k++) kept = r->tensors[k].value().is_same(before[k]);
      same += kept;
      before.clear();
      for (auto &item : r->tensors) before.push_back(item.value());
      last = *r; // the same tensors: the next comes into them
    }
    return r;
  };
  while (auto r = next()) {
    v++;
    CHECK(r->meta == "version=" + std::to_string(v));
    int64_t k = 0, wrong = 0;
    for (auto &item : r->tensors) {
      wrong += (item.value() != float(1000 * v + k)).sum().item<int64_t>();
      k++;
    }
    if (wrong || (v > 1 && opens))
      printf("consumer: version %d: %lld elements wrong, %llu mappings opened\n", v, (long long)wrong, opens);
    CHECK_EQ(wrong, 0);
    if (v > 1) CHECK_EQ(opens, 0);
  }
  CHECK_EQ(v, 30);
  // Versions 20 and 21 are ordered after another stream than the one before
  // them: the set goes whole then (a layout of its own), made when it comes;
  // of the others, those that came while recv() waited were made ahead.
  if (receiver && into) {
    // 27 versions sent again, each into the tensors before it; 20 and 21 new.
    printf("consumer: %d of 27 versions sent again came into the tensors before them\n", same);
    CHECK_EQ(same, 27);
    CHECK_EQ(receiver->received_into(), 27);
    CHECK_EQ(receiver->ready_made(), 0);
  } else if (receiver) {
    printf("consumer: %llu of 27 versions sent again were made ahead\n", (unsigned long long)receiver->ready_made());
    CHECK(receiver->ready_made() >= 1 && receiver->ready_made() <= 27);
  }
  return 0;
}

static int role_versions_reader(tshare_channel *ch) { return read_versions(ch, nullptr); }

static int role_versions_reader_ahead(tshare_channel *ch) {
  tt::SetReceiver receiver;
  return read_versions(ch, &receiver);
}

static int role_versions_reader_into(tshare_channel *ch) {
  tt::SetReceiver receiver;
  return read_versions(ch, &receiver, true);
}

static int role_set_killed(tshare_channel *ch) {
  auto r = tt::recv_set(ch, {TIMEOUT});
  CHECK(r && r->tensors.size() == 290);
  raise(SIGKILL);
  return 1;
}

static int role_main(int argc, char **argv) {
  if (argc < 3) return 2;
  if (std::string(argv[2]) == "held_reader") return role_held_reader();
  tshare_channel *ch = open_channel(3, argv[2]);
  std::string role = argv[2];
  int rc = role == "check_all"            ? role_check_all(ch)
           : role == "add_ten"            ? role_add_ten(ch)
           : role == "late_reader"        ? role_late_reader(ch)
           : role == "ordered_reader"     ? role_ordered_reader(ch)
           : role == "third"              ? role_third(ch)
           : role == "forwarder"          ? role_forwarder(ch)
           : role == "neighbours_producer" ? role_neighbours_producer(ch)
           : role == "chunk_reader"       ? role_chunk_reader(ch)
           : role == "holder"             ? role_holder(ch)
           : role == "repeat_reader"      ? role_repeat_reader(ch)
           : role == "killed_while_keeping" ? role_killed_while_keeping(ch)
           : role == "set_reader"         ? role_set_reader(ch)
           : role == "set_killed"         ? role_set_killed(ch)
           : role == "versions_reader"    ? role_versions_reader(ch)
           : role == "versions_reader_ahead" ? role_versions_reader_ahead(ch)
           : role == "versions_reader_into" ? role_versions_reader_into(ch)
                                          : 2;
  tshare_channel_close(ch);
  fflush(stdout);
  return rc;
}
__attribute__((constructor)) static void set_role() { ts_role_main = role_main; }

// ---- tests ---------------------------------------------------------------------

TS_TEST(cuda_every_dtype_and_layout) {
  need_gpu();
  int fd;
  tshare_process *p = start("check_all", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  for (at::ScalarType t : all_dtypes) tt::send(ch, pattern(t, 100, at::Device(at::kCUDA, 0)), {c10::toString(t)});
  at::Tensor base = cuda_base();
  for (auto &e : layouts_of(base)) tt::send(ch, e.second, {e.first});
  bye_and_wait_released(ch, TIMEOUT);
  CHECK_EQ(base[2][1][0].item<float>(), -1);
  CHECK_EQ(base[2][1][1].item<float>(), 67);
  finish(p, "consumer");
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  printf("shares %zu, exports %llu, handle cache hits %llu, host syncs %llu\n", all_dtypes.size() + 8,
         (unsigned long long)st.exports, (unsigned long long)st.cache_hits, (unsigned long long)st.host_syncs);
  CHECK_EQ(st.host_syncs, 0);
  tshare_channel_close(ch);
}

TS_TEST(cuda_neighbours_in_one_segment) {
  need_gpu();
  int fd;
  tshare_process *p = start("add_ten", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  neighbours_producer(ch, false);
  finish(p, "consumer");
  tshare_channel_close(ch);
}

TS_TEST(cuda_storage_kept_until_released) {
  need_gpu();
  int fd;
  tshare_process *p = start("late_reader", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  {
    at::Tensor x = at::arange(1 << 20, on_gpu.dtype(at::kInt));
    tt::send(ch, x);
  }
  // Our tensor is gone and the cache emptied: were the block free, this
  // allocation would take it and overwrite it.
  c10::cuda::CUDACachingAllocator::emptyCache();
  at::Tensor y = at::full({1 << 20}, -1, on_gpu.dtype(at::kInt));
  c10::cuda::device_synchronize();
  tt::send(ch, at::zeros({1}), {"dropped and reallocated"});
  bye_and_wait_released(ch, TIMEOUT);
  finish(p, "consumer");
  tshare_channel_close(ch);
}

TS_TEST(cuda_ordering_on_current_streams) {
  need_gpu();
  int fd;
  tshare_process *p = start("ordered_reader", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  {
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
    at::Tensor x = at::zeros({1 << 22}, on_gpu.dtype(at::kInt));
    at::cuda::sleep(int64_t(1) << 30); // about half a second of GPU time on this stream
    x.fill_(7);
    tt::send(ch, x); // no host sync: the consumer waits on our event
  }
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  CHECK_EQ(st.host_syncs, 0);
  bye_and_wait_released(ch, TIMEOUT);
  finish(p, "consumer");
  tshare_channel_close(ch);
}

TS_TEST(cuda_received_tensor_sent_on_to_a_third_process) {
  need_gpu();
  int fd;
  tshare_process *p = start("forwarder", &fd);
  tshare_channel *ch = open_channel(fd, "owner");
  at::Tensor m = at::arange(64, on_gpu.dtype(at::kDouble)).view({8, 8});
  tt::send(ch, m);
  CHECK_RC(tshare_channel_wait_released(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK(at::equal(m.select(1, 3), at::full({8}, -7.0, on_gpu.dtype(at::kDouble))));
  CHECK_EQ(m[0][2].item<double>(), 2);
  CHECK_RC(tshare_channel_send_bye(ch, 0, TIMEOUT), TSHARE_OK, "");
  finish(p, "forwarder");
  tshare_channel_close(ch);
}

// The emulated affected driver zeroes the whole allocation at every export.
// Through the bridge the tensor and its neighbours in the segment survive.
TS_TEST(cuda_zeroing_guard_through_the_bridge) {
  const char *emulator = getenv("TSHARE_ZEROING_EMULATOR");
  if (getenv("TSHARE_SANITIZED")) TS_SKIP("the emulator is preloaded, which a sanitizer runtime refuses");
  if (!emulator) TS_SKIP("TSHARE_ZEROING_EMULATOR is not set (run through ctest)");
  need_gpu();
  int sv[2];
  tshare_error err;
  CHECK_RC(tshare_socketpair(sv, &err), TSHARE_OK, err.message);
  std::string preload = std::string("LD_PRELOAD=") + emulator;
  char *env[] = {(char *)preload.c_str(), (char *)"TSHARE_EXPORT_GUARD=auto", nullptr};
  tshare_process *producer = spawn_role("neighbours_producer", sv[0], env);
  tshare_process *consumer = spawn_role("add_ten", sv[1]);
  finish(producer, "producer under the emulated driver");
  finish(consumer, "consumer");
}

TS_TEST(cuda_expandable_segment_tensor_spanning_chunks) {
  need_expandable();
  int fd;
  tshare_process *p = start("chunk_reader", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  // 60 MiB: at least three of the large pool's 20 MiB chunks.
  at::Tensor big = at::arange(int64_t(15) << 20, on_gpu.dtype(at::kFloat)).remainder(1000);
  at::Tensor small = at::full({4096}, 3, on_gpu.dtype(at::kInt));
  tt::send(ch, big, {"big"});
  tt::send(ch, small, {"small"});
  tt::send(ch, big, {"big again"});
  bye_and_wait_released(ch, TIMEOUT);
  CHECK_EQ(big[big.numel() - 1].item<float>(), -5); // written through the consumer's mapping
  CHECK_EQ(big[0].item<float>(), 0);
  finish(p, "consumer");
  tshare_channel_close(ch);
}

TS_TEST(cuda_repeated_hand_offs_map_once) {
  need_gpu();
  int fd;
  tshare_process *p = start("repeat_reader", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  at::Tensor x = at::zeros({1024}, on_gpu);
  for (int i = 0; i < 20; i++) {
    x.fill_(float(i));
    uint64_t id = tt::send(ch, x, {std::to_string(i)});
    CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  }
  bye_and_wait_released(ch, TIMEOUT);
  finish(p, "consumer");
  tshare_channel_close(ch);
}

TS_TEST(cuda_expandable_kept_mapping_shares_travel_without_fds) {
  need_expandable();
  int fd;
  tshare_process *p = start("held_reader", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  at::Tensor x = at::arange(1024, on_gpu.dtype(at::kFloat));
  uint64_t id = tt::send(ch, x, {"first"});
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  for (int i = 0; i < 10; i++) tt::send(ch, x.narrow(0, i * 100, 100), {std::to_string(i)});
  bye_and_wait_released(ch, TIMEOUT);
  finish(p, "consumer");
  tshare_channel_close(ch);
}

// The consumer dies while it keeps the producer's memory mapped (and holds
// a view): the producer lets go of what it held for it, and the memory comes
// back once its own tensor is gone.
TS_TEST(cuda_consumer_killed_while_keeping_memory_mapped) {
  need_gpu();
  int fd;
  tshare_process *p = start("killed_while_keeping", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  wait_ready(ch);
  {
    at::Tensor x = at::arange(int64_t(32) << 20, on_gpu.dtype(at::kInt)); // 128 MiB
    for (int i = 0; i < 3; i++) {
      uint64_t id = tt::send(ch, x);
      CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
    }
    tt::send(ch, x);
  }
  // Everything the dead consumer held is dropped; nothing is held for it.
  CHECK_RC(tshare_channel_wait_released(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_exit_status st;
  CHECK_RC(tshare_process_wait(p, TIMEOUT, &st), TSHARE_OK, "the consumer did not end");
  tshare_process_destroy(p);
  CHECK(st.kind == TSHARE_EXIT_SIGNAL && st.value == SIGKILL);
  // Once the dead consumer's own memory has gone back (the free figure holds
  // still), emptying this process's cache must give the tensor's 128 MiB
  // back: nothing holds it for the consumer any more.
  size_t settled = gpu_free_bytes();
  for (int i = 0; i < 100; i++) {
    usleep(20000);
    size_t now = gpu_free_bytes();
    if (now == settled) break;
    settled = now;
  }
  c10::cuda::CUDACachingAllocator::emptyCache();
  size_t after = gpu_free_bytes();
  printf("GPU free after the consumer died: %zu MiB; this process's cache emptied: %zu MiB\n", settled >> 20,
         after >> 20);
  CHECK(after >= settled + (size_t(120) << 20));
  tshare_channel_close(ch);
}

TS_TEST(cuda_memory_freed_by_the_producer_returns_after_release) {
  need_gpu();
  int fd;
  tshare_process *p = start("holder", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  wait_ready(ch);
  c10::cuda::CUDACachingAllocator::emptyCache();
  size_t baseline = gpu_free_bytes();
  {
    at::Tensor x = at::arange(int64_t(32) << 20, on_gpu.dtype(at::kInt)); // 128 MiB
    tt::send(ch, x, {"held"});
  }
  c10::cuda::CUDACachingAllocator::emptyCache(); // our tensor is gone: only the share holds the memory
  c10::cuda::device_synchronize();
  size_t while_held = gpu_free_bytes();
  tt::send(ch, at::zeros({1}), {"freed"});
  CHECK_RC(tshare_channel_wait_released(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  // Released. Expandable segments: the storage goes back to the caching
  // allocator, which unmaps it when its cache is emptied; this end sees the
  // chunks unmapped (it looks every millisecond it drives the channel) and
  // says so, and the consumer closes the mapping it kept for the next share.
  // The default allocator's segment: this end holds the storage while the
  // consumer keeps the segment mapped, until it was idle for a while and the
  // consumer closed it; then the cache can let it go.
  c10::cuda::CUDACachingAllocator::emptyCache();
  size_t released = gpu_free_bytes(); // kernels loaded since the baseline took some too: compare with this
  int64_t t0 = tt_now_ms();
  size_t after = released;
  const size_t back = size_t(120) << 20; // of the 128 MiB tensor's memory
  while (after < released + back && tt_now_ms() - t0 < 5000) {
    (void)tshare_channel_poll(ch, 1);
    c10::cuda::CUDACachingAllocator::emptyCache();
    after = gpu_free_bytes();
  }
  printf("GPU free: baseline %zu MiB, shared and freed here %zu MiB, released %zu MiB, then %zu MiB %lld ms later\n",
         baseline >> 20, while_held >> 20, released >> 20, after >> 20, (long long)(tt_now_ms() - t0));
  CHECK(baseline - while_held >= (size_t(100) << 20)); // the share kept the memory
  CHECK(after >= released + back);                     // and it came back while the consumer lives on
  tt::send(ch, at::zeros({1}), {"measured"});
  bye_and_wait_released(ch, TIMEOUT);
  finish(p, "consumer");
  tshare_channel_close(ch);
}

// n numbered tensors (member k holds 3k, 3k+1, 3k+2): views of one tensor,
// or each its own caching-allocator block.
static tt::NamedTensors numbered_set(int64_t n, bool blocks) {
  at::Tensor base = at::arange(3 * n, on_gpu.dtype(at::kFloat)).view({n, 3});
  tt::NamedTensors set;
  for (int64_t k = 0; k < n; k++)
    set.emplace_back("layer." + std::to_string(k), blocks ? base[k].clone() : base[k]);
  return set;
}

static void send_set_and_wait(tshare_channel *ch, const tt::NamedTensors &set, const std::string &meta) {
  uint64_t id = tt::send_set(ch, set, {meta, TIMEOUT});
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
}

// Sets of 1, 290 (each its own block, the last written on a pool stream
// behind a long sleep: only the set's event orders the consumer after it)
// and 10,000 CUDA tensors; the same set again maps nothing new; a CPU member
// rides along; the consumer's writes are the producer's memory.
TS_TEST(cuda_sets_of_1_290_and_10000_tensors) {
  need_gpu();
  int fd;
  tshare_process *p = start("set_reader", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  send_set_and_wait(ch, numbered_set(1, false), "one");
  tt::NamedTensors blocks = numbered_set(290, true);
  {
    c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool());
    at::Tensor last = blocks.back().second;
    last.fill_(0.0f);
    at::cuda::sleep(200 * 1000 * 1000); // about 0.1 s of the GPU's time before the right values land
    last.copy_(at::arange(867, 870, on_gpu.dtype(at::kFloat)));
    send_set_and_wait(ch, blocks, "blocks");
  }
  send_set_and_wait(ch, blocks, "again");
  send_set_and_wait(ch, blocks, "again");
  send_set_and_wait(ch, numbered_set(10000, false), "ten thousand");
  tt::NamedTensors mixed = numbered_set(2, false);
  at::Tensor cpu = tt::empty_shared({3});
  cpu.copy_(at::arange(6, 9, at::kFloat));
  mixed.emplace_back("cpu", cpu);
  send_set_and_wait(ch, mixed, "write");
  CHECK(at::equal(mixed[0].second.cpu(), at::full({3}, -1.0f)));
  CHECK(at::equal(mixed[1].second.cpu(), at::arange(3, 6, at::kFloat)));
  bye_and_wait_released(ch, TIMEOUT);
  finish(p, "consumer");
  tshare_channel_close(ch);
}

// n - 1 CUDA parameters and a buffer, member k holding 3k, 3k+1, 3k+2;
// every other one at the start of a 48 MiB block (a caching-allocator
// segment of its own), the others small blocks.
struct NumberedModule : ::torch::nn::Module {
  explicit NumberedModule(int64_t n) {
    for (int64_t k = 0; k < n; k++) {
      at::Tensor v = at::empty({k % 2 ? int64_t(3) << 22 : 3}, on_gpu.dtype(at::kFloat)).narrow(0, 0, 3);
      v.copy_(at::arange(3 * k, 3 * k + 3, on_gpu.dtype(at::kFloat)));
      if (k == n - 1) register_buffer("b" + std::to_string(k), v);
      else register_parameter("p" + std::to_string(k), v, /*requires_grad=*/k == 1);
    }
  }
  tt::NamedTensors state() {
    tt::NamedTensors out;
    for (auto &item : named_parameters()) out.emplace_back(item.key(), item.value());
    for (auto &item : named_buffers()) out.emplace_back(item.key(), item.value());
    return out;
  }
  size_t allocations() {
    std::set<const void *> data;
    for (auto &e : state()) data.insert(e.second.storage().data());
    return data.size();
  }
};

// share_module_ with pack_cuda: the module's CUDA parameters and buffer,
// from several segments, move in place into one allocation; a set of its
// state opens one mapping on the consumer, and the consumer's writes land
// in the module's own parameters.
TS_TEST(cuda_share_module_with_pack_cuda_moves_the_module_into_one_allocation) {
  need_gpu();
  NumberedModule m(7);
  std::vector<const void *> impls;
  for (auto &e : m.state()) impls.push_back(e.second.unsafeGetTensorImpl());
  CHECK_EQ(m.allocations(), 7u);
  tt::share_module_(m); // CUDA tensors stay where they are without pack_cuda
  CHECK_EQ(m.allocations(), 7u);
  tt::share_module_(m, /*pack_cuda=*/true);
  CHECK_EQ(m.allocations(), 1u);
  tt::NamedTensors state = m.state();
  for (size_t k = 0; k < state.size(); k++) {
    CHECK(state[k].second.unsafeGetTensorImpl() == impls[k]); // moved in place, not replaced
    CHECK(state[k].second.is_cuda());
    CHECK(state[k].second.requires_grad() == (k == 1) && state[k].second.is_leaf());
    CHECK(at::equal(state[k].second.cpu(), at::arange(3 * int64_t(k), 3 * int64_t(k) + 3, at::kFloat)));
  }
  const void *arena = state[0].second.storage().data();
  tt::share_module_(m, true); // packed already: nothing moves
  CHECK(m.state()[0].second.storage().data() == arena);
  int fd;
  tshare_process *p = start("set_reader", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  send_set_and_wait(ch, state, "packed");
  send_set_and_wait(ch, state, "write");
  CHECK(at::equal(m.state()[0].second.cpu(), at::full({3}, -1.0f)));
  bye_and_wait_released(ch, TIMEOUT);
  finish(p, "consumer");
  tshare_channel_close(ch);
}

// The update pattern on the GPU: 290 blocks updated in place on the current
// stream and sent 30 times through one SetSender, built once. Version 10 is
// written behind a long sleep on the default stream, version 20 on a pool
// stream behind one, version 21 on the default stream again: only the kept set's stream, renewed per send, orders the
// consumer after the right work.
static void send_versions(const char *reader) {
  need_gpu();
  int fd;
  tshare_process *p = start(reader, &fd);
  tshare_channel *ch = open_channel(fd, "trainer");
  tt::NamedTensors state = numbered_set(290, true);
  tt::SetSender sender;
  for (int v = 1; v <= 30; v++) {
    c10::optional<c10::cuda::CUDAStreamGuard> on_pool;
    if (v == 20) {
      on_pool.emplace(c10::cuda::getStreamFromPool());
      at::cuda::sleep(200 * 1000 * 1000); // about 0.1 s of the GPU's time before the values land
    }
    if (v == 10) // on the default stream: a set sent again (made ahead for a SetReceiver) waits for it
      at::cuda::sleep(200 * 1000 * 1000);
    for (size_t k = 0; k < state.size(); k++) state[k].second.fill_(float(1000 * v) + float(k));
    uint64_t id = sender.send(ch, state, {"version=" + std::to_string(v), TIMEOUT});
    CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  }
  CHECK_EQ(sender.builds(), 1);
  bye_and_wait_released(ch, TIMEOUT);
  finish(p, "consumer");
  tshare_channel_close(ch);
}

TS_TEST(cuda_set_sender_sends_the_kept_set_again) { send_versions("versions_reader"); }

// The same versions to a SetReceiver: each set sent again gets the tensors
// it made while it waited, version 20 (behind the sleep) read right too.
TS_TEST(cuda_set_receiver_makes_the_tensors_of_versions_ahead) { send_versions("versions_reader_ahead"); }

// The same versions received each into the tensors of the one before
// (release, recv_into): version 10 behind the default stream's sleep and
// version 20 behind a pool stream's read right in the same tensors.
TS_TEST(cuda_set_receiver_brings_each_version_into_the_tensors_before_it) { send_versions("versions_reader_into"); }

// A consumer killed while it holds a set: released as one, nothing left.
TS_TEST(cuda_set_consumer_killed_frees_everything) {
  need_gpu();
  int fd;
  tshare_process *p = start("set_killed", &fd);
  tshare_channel *ch = open_channel(fd, "producer");
  uint64_t id = tt::send_set(ch, numbered_set(290, true), {"", TIMEOUT});
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  tshare_exit_status st;
  CHECK_RC(tshare_process_wait(p, TIMEOUT, &st), TSHARE_OK, "wait");
  CHECK(st.kind == TSHARE_EXIT_SIGNAL && st.value == SIGKILL);
  tshare_process_destroy(p);
  tshare_channel_close(ch);
}

// What a set refuses of CUDA tensors, before anything is sent.
TS_TEST(cuda_set_refusals_name_the_tensor) {
  need_gpu();
  at::Tensor gpu = at::ones({4}, on_gpu);
  CHECK_THROWS_CODE(tt::send_set(nullptr, {{"gpu", gpu}}), TSHARE_E_INVALID_ARG, "no channel");
  if (c10::cuda::device_count() > 1) {
    at::Tensor other = at::ones({4}, at::TensorOptions().device(at::kCUDA, 1));
    CHECK_THROWS_CODE(tt::send_set_all({}, {{"gpu", gpu}, {"other", other}}), TSHARE_E_UNSUPPORTED,
                      "tensor 1 ('other')");
  }
}

TS_TEST_MAIN
