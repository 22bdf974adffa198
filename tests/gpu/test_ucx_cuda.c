/* GPU tests: CUDA memory across a ucx:// channel, staged through host
 * memory (session_stage.c on the producer, backend_ucx_device.c on the
 * consumer). Each case runs a producer and a consumer over 127.0.0.1, or in
 * two network namespaces joined by a veth pair (skipped where they cannot
 * be made: the loopback cases cover the same path). Every element is
 * checked on the consumer's GPU. Exit 77 with the reason without a usable
 * GPU or without UCX.
 *
 * The test process itself never touches CUDA: it forks the two sides (a
 * process that initialised CUDA must not fork), and each side opens the
 * driver on its own. */
#include "cudakit.h"
#include "ucx_pair.h"

#include "tshare/tshare.h"

#define TIMEOUT 20000
#define BIG_ELEMS ((size_t)5 << 20) /* 20 MiB of int32: more than the consumer's two 8 MiB bounce buffers */
#define SMALL_ELEMS 1000
#define MEMBERS 290
#define SEGMENTS 10
#define MEMBER_ELEMS 96

static const ts_cuda_api *cu;

static void open_gpu(void) {
  char why[256];
  cu = ck_init(why, sizeof why);
  if (!cu) {
    printf("SKIP: %s\n", why);
    _exit(77);
  }
}

/* Whether a GPU is usable, asked of a child: this process stays without CUDA. */
static void need_gpu(void) {
  int p[2];
  CHECK(pipe(p) == 0);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    char why[256] = "";
    int ok = ck_init(why, sizeof why) != NULL;
    if (write(p[1], why, strlen(why)) < 0) _exit(2);
    _exit(ok ? 0 : 77);
  }
  close(p[1]);
  char why[257] = "";
  ssize_t n = read(p[0], why, sizeof why - 1);
  why[n > 0 ? n : 0] = '\0';
  close(p[0]);
  int status;
  CHECK(waitpid(pid, &status, 0) == pid);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) TS_SKIP("%s", why);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static tshare_tensor_desc vec_i32(size_t n, uint64_t byte_offset) {
  int64_t shape[1] = {(int64_t)n};
  return tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, shape, byte_offset);
}

static void fill(CUdeviceptr p, size_t n, int base) {
  CHECK_EQ(ck_fill(p, n, base, 1, NULL), CUDA_SUCCESS);
  CHECK_EQ(cu->cuCtxSynchronize(), CUDA_SUCCESS);
}

static unsigned long long bad_on_gpu(const void *data, size_t n, int base) {
  unsigned long long bad = ~0ull;
  CHECK_EQ(ck_count_bad((CUdeviceptr)(uintptr_t)data, n, base, 1, NULL, &bad), CUDA_SUCCESS);
  return bad;
}

/* ---- single shares ---------------------------------------------------------- */

/* A tshare CUDA buffer (a layout at an offset) and another allocator's
 * memory bigger than both bounce buffers. The second is written again as
 * soon as its share returns: what crossed is what it held then. */
static void share_producer(void) {
  open_gpu();
  tshare_channel *ch = accept_one(TOKEN);
  CHECK(tshare_channel_peer(ch)->capabilities & TSHARE_CAP_UCX_STAGED);
  tshare_cuda_buffer *buf;
  tshare_error err;
  CHECK_RC(tshare_cuda_buffer_create(0, (SMALL_ELEMS + 16) * 4, &buf, &err), TSHARE_OK, err.message);
  fill((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(buf) + 64, SMALL_ELEMS, 11);
  tshare_tensor_desc d = vec_i32(SMALL_ELEMS, 64);
  uint64_t first, second;
  CHECK_RC(tshare_share_cuda_buffer(ch, buf, &d, NULL, "small", NULL, TIMEOUT, &first), TSHARE_OK,
           tshare_channel_last_error(ch));
  CUdeviceptr big;
  CHECK_EQ(cu->cuMemAlloc(&big, BIG_ELEMS * 4), CUDA_SUCCESS);
  fill(big, BIG_ELEMS, 3);
  tshare_tensor_desc b = vec_i32(BIG_ELEMS, 0);
  CHECK_RC(tshare_share_cuda(ch, (void *)(uintptr_t)big, &b, NULL, "big", NULL, TIMEOUT, &second), TSHARE_OK,
           tshare_channel_last_error(ch));
  fill(big, BIG_ELEMS, 999); /* staged already: the consumer still reads 3.. */
  CHECK_RC(tshare_channel_wait_released(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_cuda_buffer_release(buf);
  CHECK_EQ(cu->cuMemFree(big), CUDA_SUCCESS);
  tshare_channel_close(ch);
}

static void share_consumer(void) {
  open_gpu();
  tshare_channel *ch = connect_one(TOKEN);
  tshare_view *small, *big;
  CHECK_RC(tshare_view_recv(ch, TIMEOUT, &small), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_view_recv(ch, TIMEOUT, &big), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_view_device_type(small), TSHARE_DEVICE_CUDA);
  CHECK_EQ(tshare_view_cuda_device(small), 0);
  CHECK_EQ(tshare_view_is_copy(small), 1);
  CHECK_EQ(tshare_view_desc(small)->shape[0], SMALL_ELEMS);
  CHECK_EQ(bad_on_gpu(tshare_view_data(small), SMALL_ELEMS, 11), 0);
  CHECK_EQ(tshare_view_is_copy(big), 1);
  CHECK_EQ(bad_on_gpu(tshare_view_data(big), BIG_ELEMS, 3), 0);
  /* The copy is this process's: writing it is allowed and changes nothing there. */
  fill((CUdeviceptr)(uintptr_t)tshare_view_data(big), BIG_ELEMS, 5);
  CHECK_EQ(bad_on_gpu(tshare_view_data(big), BIG_ELEMS, 5), 0);
  tshare_view_release(small);
  tshare_view_release(big);
  tshare_channel_close(ch);
}

TS_TEST(cuda_shares_cross_staged_loopback) {
  need_gpu();
  use_loopback();
  run_pair(share_producer, share_consumer);
}

TS_TEST(cuda_shares_cross_staged_netns) {
  need_gpu();
  make_namespaces();
  run_pair(share_producer, share_consumer);
}

/* ---- shared on to this host's processes ------------------------------------- */

/* A worker of the consumer's host: a CUDA tensor over a local socket (CUDA
 * IPC), every element checked. Forked before its parent opens CUDA. */
static void local_worker(int fd) {
  open_gpu();
  tshare_channel *ch;
  tshare_error err;
  CHECK_RC(tshare_channel_open_socket(fd, NULL, &ch, &err), TSHARE_OK, err.message);
  CHECK_EQ(tshare_channel_gpu_path(ch), TSHARE_GPU_PATH_IPC);
  for (int i = 0; i < 2; i++) {
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, TIMEOUT, &v), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(tshare_view_is_copy(v), 0); /* the relay's memory, mapped */
    size_t n = (size_t)tshare_view_desc(v)->shape[0];
    CHECK_EQ(bad_on_gpu(tshare_view_data(v), n, i == 0 ? 11 + 10 : 3), 0);
    tshare_view_release(v);
  }
  tshare_channel_close(ch);
  _exit(0);
}

static void keep_nothing(void *keep) { (void)keep; }

/* Receives both shares over UCX and shares them on: the small one in part
 * (from its element 10), the big one whole. */
static void relay_consumer(void) {
  int sv[2];
  tshare_error err;
  CHECK_RC(tshare_socketpair(sv, &err), TSHARE_OK, err.message);
  pid_t worker = fork();
  CHECK(worker >= 0);
  if (worker == 0) {
    close(sv[0]);
    local_worker(sv[1]);
  }
  close(sv[1]);
  open_gpu();
  tshare_channel *local;
  CHECK_RC(tshare_channel_open_socket(sv[0], NULL, &local, &err), TSHARE_OK, err.message);
  tshare_channel *ch = connect_one(TOKEN);
  CHECK_EQ(tshare_channel_gpu_path(ch), TSHARE_GPU_PATH_STAGED);
  tshare_view *small, *big;
  CHECK_RC(tshare_view_recv(ch, TIMEOUT, &small), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_view_recv(ch, TIMEOUT, &big), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_tensor_desc part = vec_i32(SMALL_ELEMS - 10, 40); /* from tshare_view_data(small) */
  uint64_t ids[2];
  CHECK_RC(tshare_share_view_part(local, small, &part, NULL, NULL, keep_nothing, NULL, NULL, TIMEOUT, &ids[0]), TSHARE_OK,
           tshare_channel_last_error(local));
  tshare_view_release(small); /* the share on holds the memory */
  CHECK_RC(tshare_share_view(local, big, NULL, NULL, NULL, TIMEOUT, &ids[1]), TSHARE_OK,
           tshare_channel_last_error(local));
  CHECK_RC(tshare_channel_wait_released(local, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(local));
  int status;
  CHECK(waitpid(worker, &status, 0) == worker && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  tshare_channel_close(local);
  tshare_channel_close(ch);
}

TS_TEST(cuda_views_read_over_ucx_are_shared_on_to_a_local_worker_loopback) {
  need_gpu();
  use_loopback();
  run_pair(share_producer, relay_consumer);
}

/* ---- a 290-tensor set, updated in place ------------------------------------- */

/* Member i: int32 base + i + k, in one of SEGMENTS allocations; the last
 * member is one large allocation of its own. */
static size_t member_elems(size_t i) { return i == MEMBERS - 1 ? BIG_ELEMS : MEMBER_ELEMS; }
static uint64_t member_offset(size_t i) { return (uint64_t)(i / SEGMENTS) * MEMBER_ELEMS * 4; }

static void fill_model(CUdeviceptr *seg, CUdeviceptr big, int base) {
  for (size_t i = 0; i < MEMBERS; i++) {
    CUdeviceptr p = i == MEMBERS - 1 ? big : seg[i % SEGMENTS] + member_offset(i);
    CHECK_EQ(ck_fill(p, member_elems(i), base + (int)i, 1, NULL), CUDA_SUCCESS);
  }
  CHECK_EQ(cu->cuCtxSynchronize(), CUDA_SUCCESS);
}

/* Two rounds of the same builder: the second after the first's release,
 * with every tensor written again in place. */
static void set_producer(void) {
  open_gpu();
  tshare_channel *ch = accept_one(TOKEN);
  CUdeviceptr seg[SEGMENTS], big;
  for (int s = 0; s < SEGMENTS; s++)
    CHECK_EQ(cu->cuMemAlloc(&seg[s], (MEMBERS / SEGMENTS + 1) * MEMBER_ELEMS * 4), CUDA_SUCCESS);
  CHECK_EQ(cu->cuMemAlloc(&big, BIG_ELEMS * 4), CUDA_SUCCESS);
  tshare_set_builder *b = tshare_set_builder_create();
  tshare_error err;
  for (size_t i = 0; i < MEMBERS; i++) {
    char name[48];
    snprintf(name, sizeof name, "layers.%zu.weight", i);
    CUdeviceptr p = i == MEMBERS - 1 ? big : seg[i % SEGMENTS] + member_offset(i);
    tshare_tensor_desc d = vec_i32(member_elems(i), 0);
    CHECK_RC(tshare_set_builder_add_cuda(b, name, (void *)(uintptr_t)p, &d, &err), TSHARE_OK, err.message);
  }
  for (int round = 0; round < 2; round++) {
    fill_model(seg, big, 100 * round);
    char meta[16];
    snprintf(meta, sizeof meta, "round=%d", round);
    CHECK_RC(tshare_set_builder_set_meta(b, meta, strlen(meta), &err), TSHARE_OK, err.message);
    uint64_t id;
    CHECK_RC(tshare_set_send(ch, b, NULL, TIMEOUT, &id), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  }
  tshare_set_builder_destroy(b);
  for (int s = 0; s < SEGMENTS; s++) CHECK_EQ(cu->cuMemFree(seg[s]), CUDA_SUCCESS);
  CHECK_EQ(cu->cuMemFree(big), CUDA_SUCCESS);
  tshare_channel_close(ch);
}

static void check_model(const tshare_set *s, int base) {
  CHECK_EQ(tshare_set_count(s), MEMBERS);
  CHECK_EQ(tshare_set_is_copy(s), 1);
  for (size_t i = 0; i < MEMBERS; i++) {
    CHECK_EQ(tshare_set_cuda_device(s, i), 0);
    CHECK(tshare_set_host_buffer(s, i) == NULL); /* on the GPU, not in host memory */
    unsigned long long bad = bad_on_gpu(tshare_set_data(s, i), member_elems(i), base + (int)i);
    if (bad) TS_FAIL("member %zu ('%s'): %llu of %zu elements differ", i, tshare_set_name(s, i), bad, member_elems(i));
  }
}

/* The first round is still held (and checked again) after the second came:
 * the two are separate copies. */
static void set_consumer(void) {
  open_gpu();
  tshare_channel *ch = connect_one(TOKEN);
  tshare_set *first, *second;
  CHECK_RC(tshare_set_recv(ch, TIMEOUT, &first), TSHARE_OK, tshare_channel_last_error(ch));
  size_t len;
  const char *meta = tshare_set_meta(first, &len);
  CHECK(len == 7 && memcmp(meta, "round=0", 7) == 0);
  check_model(first, 0);
  CHECK_RC(tshare_set_recv(ch, TIMEOUT, &second), TSHARE_OK, tshare_channel_last_error(ch));
  check_model(second, 100);
  check_model(first, 0);
  tshare_view *v;
  CHECK_RC(tshare_set_view(second, MEMBERS - 1, &v), TSHARE_OK, "");
  CHECK_EQ(tshare_view_is_copy(v), 1);
  CHECK_EQ(tshare_view_cuda_device(v), 0);
  tshare_set_release(first);
  tshare_set_release(second);
  CHECK_EQ(bad_on_gpu(tshare_view_data(v), BIG_ELEMS, 100 + MEMBERS - 1), 0); /* the view holds its memory */
  tshare_view_release(v);
  tshare_channel_close(ch);
}

TS_TEST(a_290_tensor_cuda_set_crosses_staged_twice_loopback) {
  need_gpu();
  use_loopback();
  run_pair(set_producer, set_consumer);
}

TS_TEST(a_290_tensor_cuda_set_crosses_staged_twice_netns) {
  need_gpu();
  make_namespaces();
  run_pair(set_producer, set_consumer);
}

TS_TEST_MAIN
