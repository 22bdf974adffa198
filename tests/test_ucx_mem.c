/* Host memory across hosts over UCX (TSHARE_MEM_UCX_REMOTE, "fetch" mode):
 * every dtype and layout the single-tensor tests use, both ways, each
 * element checked; the producer destroying its buffer right after the
 * share; the wire the producer speaks (one rkey per registration, a retire
 * once the buffer is gone); a hostile producer's malformed keys, regions
 * and lengths. Two processes each time (ucx_pair.h), over 127.0.0.1 or two
 * network namespaces joined by a veth pair. */
#include "harness.h"
#include "ucx_pair.h"
#include "tshare/hostmem.h"
#include "tshare/share.h"
#include "ucx_api.h" /* a hostile producer registers memory of its own */
#include "tshare/cuda.h" /* tshare_view_cuda_device: staged GPU bytes */

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* ---- the tensors ----------------------------------------------------------- */

static const tshare_dtype dtypes[] = {
    {TSHARE_DTYPE_INT, 8, 1},     {TSHARE_DTYPE_INT, 16, 1},    {TSHARE_DTYPE_INT, 32, 1},
    {TSHARE_DTYPE_INT, 64, 1},    {TSHARE_DTYPE_UINT, 8, 1},    {TSHARE_DTYPE_UINT, 16, 1},
    {TSHARE_DTYPE_UINT, 32, 1},   {TSHARE_DTYPE_UINT, 64, 1},   {TSHARE_DTYPE_FLOAT, 16, 1},
    {TSHARE_DTYPE_FLOAT, 32, 1},  {TSHARE_DTYPE_FLOAT, 64, 1},  {TSHARE_DTYPE_BFLOAT, 16, 1},
    {TSHARE_DTYPE_COMPLEX, 64, 1}, {TSHARE_DTYPE_COMPLEX, 128, 1}, {TSHARE_DTYPE_BOOL, 8, 1},
    {TSHARE_DTYPE_INT, 8, 4},
};
#define N_DTYPES (sizeof dtypes / sizeof dtypes[0])
#define N_LAYOUTS 6

/* Layout `which` of dtype dt: contiguous, transposed, every other element,
 * reversed (a negative stride), 3-D at an offset, empty. */
static tshare_tensor_desc layout(tshare_dtype dt, int which) {
  size_t item = tshare_dtype_itemsize(dt);
  tshare_tensor_desc d;
  memset(&d, 0, sizeof d);
  d.dtype = dt;
  switch (which) {
  case 0: d.ndim = 1, d.shape[0] = 1000, d.strides[0] = 1; break;
  case 1: d.ndim = 2, d.shape[0] = 3, d.shape[1] = 4, d.strides[0] = 1, d.strides[1] = 3, d.byte_offset = 64; break;
  case 2: d.ndim = 1, d.shape[0] = 50, d.strides[0] = 2, d.byte_offset = 400 * item; break;
  case 3: d.ndim = 1, d.shape[0] = 10, d.strides[0] = -1, d.byte_offset = 9 * item + 32; break;
  case 4:
    d.ndim = 3, d.shape[0] = 2, d.shape[1] = 3, d.shape[2] = 5, d.byte_offset = 7 * item;
    tshare_tensor_set_contiguous(&d);
    break;
  default: d.ndim = 1, d.shape[0] = 0, d.strides[0] = 1; break;
  }
  return d;
}

static uint8_t pattern(uint64_t byte, unsigned seed) { return (uint8_t)(byte * 131u + seed * 17u + 5u); }

/* A host buffer of size bytes, each the pattern of its place and seed. */
static tshare_host_buffer *patterned(size_t size, const char *name, unsigned seed) {
  tshare_host_buffer *buf;
  tshare_error err;
  CHECK_RC(tshare_host_buffer_create(size, name, &buf, &err), TSHARE_OK, err.message);
  uint8_t *p = tshare_host_buffer_data(buf);
  for (size_t i = 0; i < tshare_host_buffer_size(buf); i++) p[i] = pattern(i, seed);
  return buf;
}

/* Every byte of every element of the view is the producer's byte at the
 * same place of its allocation. */
static void check_layout(const tshare_tensor_desc *d, const uint8_t *data, unsigned seed, uint64_t share_id) {
  size_t item = tshare_dtype_itemsize(d->dtype);
  uint64_t n = 1;
  for (int i = 0; i < d->ndim; i++) n *= (uint64_t)d->shape[i];
  for (uint64_t e = 0; e < n; e++) {
    int64_t at = 0; /* elements from element [0,...,0] */
    uint64_t rest = e;
    for (int i = d->ndim - 1; i >= 0; i--) {
      at += (int64_t)(rest % (uint64_t)d->shape[i]) * d->strides[i];
      rest /= (uint64_t)d->shape[i];
    }
    for (size_t b = 0; b < item; b++) {
      uint64_t producer_byte = (uint64_t)((int64_t)d->byte_offset + at * (int64_t)item) + b;
      uint8_t got = data[at * (int64_t)item + (int64_t)b];
      if (got != pattern(producer_byte, seed))
        TS_FAIL("share %llu, element %llu byte %zu: %u, the producer's was %u", (unsigned long long)share_id,
                (unsigned long long)e, b, got, pattern(producer_byte, seed));
    }
  }
}

static void check_elements(const tshare_view *v, unsigned seed) {
  check_layout(tshare_view_desc(v), tshare_view_data(v), seed, tshare_view_share_id(v));
}

/* ---- both ways --------------------------------------------------------------- */

static int producer_side; /* 0: the listener produces, 1: the connector */

/* Each dtype in each layout, each in a buffer of its own destroyed right
 * after its share: the share and the channel hold it until the release. */
static void produce_all(tshare_channel *ch) {
  unsigned seed = 0;
  for (size_t t = 0; t < N_DTYPES; t++)
    for (int l = 0; l < N_LAYOUTS; l++, seed++) {
      tshare_host_buffer *buf = patterned(16384, "ucx-mem", seed);
      tshare_tensor_desc d = layout(dtypes[t], l);
      char tag[16];
      snprintf(tag, sizeof tag, "%u", seed);
      CHECK_RC(tshare_share_host(ch, buf, &d, tag, NULL, 5000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
      tshare_host_buffer_destroy(buf);
    }
  CHECK_RC(tshare_channel_wait_released(ch, 0, 15000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
}

static void consume_all(tshare_channel *ch) {
  for (unsigned i = 0; i < N_DTYPES * N_LAYOUTS; i++) {
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, 10000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(tshare_view_is_copy(v), 1);
    CHECK_EQ(tshare_view_device_type(v), TSHARE_DEVICE_CPU);
    CHECK_EQ((unsigned)atoi(tshare_view_tag(v)), i);
    tshare_tensor_desc want = layout(dtypes[i / N_LAYOUTS], (int)(i % N_LAYOUTS));
    CHECK(memcmp(tshare_view_desc(v), &want, sizeof want) == 0);
    check_elements(v, i);
    tshare_view_release(v);
  }
}

static void exchange(tshare_channel *ch, int side) {
  if (side == producer_side)
    produce_all(ch);
  else
    consume_all(ch);
  tshare_channel_close(ch);
}

/* ---- remote views: slices read on demand --------------------------------------- */

/* The bytes a layout touches, from its element [0,...,0]: [*lo, *hi). */
static void span_of(const tshare_tensor_desc *d, int64_t *lo, int64_t *hi) {
  int64_t item = (int64_t)tshare_dtype_itemsize(d->dtype), low = 0, high = item;
  for (int i = 0; i < d->ndim; i++) {
    if (d->shape[i] == 0) {
      *lo = *hi = 0;
      return;
    }
    int64_t reach = (d->shape[i] - 1) * d->strides[i] * item;
    if (reach < 0) low += reach;
    else high += reach;
  }
  *lo = low, *hi = high;
}

/* Every layout received as a remote view: no bytes until read; the whole
 * span read and checked, one element alone, and reads outside refused. */
static void consume_remote(tshare_channel *ch) {
  for (unsigned i = 0; i < N_DTYPES * N_LAYOUTS; i++) {
    tshare_view *v;
    CHECK_RC(tshare_view_recv_remote(ch, 10000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK(tshare_view_data(v) == NULL);
    CHECK_EQ(tshare_view_is_copy(v), 1);
    const tshare_tensor_desc *d = tshare_view_desc(v);
    int64_t lo, hi;
    span_of(d, &lo, &hi);
    uint8_t *bytes = malloc((size_t)(hi - lo) + 1);
    CHECK(bytes != NULL);
    CHECK_RC(tshare_view_read(v, lo, bytes, (size_t)(hi - lo)), TSHARE_OK, tshare_channel_last_error(ch));
    check_layout(d, bytes - lo, i, tshare_view_share_id(v));
    uint8_t one = 0;
    if (hi > lo) { /* element [0,...,0]'s first byte alone */
      CHECK_RC(tshare_view_read(v, 0, &one, 1), TSHARE_OK, tshare_channel_last_error(ch));
      CHECK_EQ(one, pattern(d->byte_offset, i));
    }
    CHECK_EQ(tshare_view_read(v, lo - 1, &one, 1), TSHARE_E_OUT_OF_BOUNDS);
    CHECK_EQ(tshare_view_read(v, hi, &one, 1), TSHARE_E_OUT_OF_BOUNDS);
    CHECK_EQ(tshare_view_read(v, INT64_MIN, &one, 1), TSHARE_E_OUT_OF_BOUNDS);
    CHECK_EQ(tshare_view_read(v, lo, &one, SIZE_MAX), TSHARE_E_OUT_OF_BOUNDS);
    CHECK_EQ(tshare_view_read(v, lo, NULL, 1), TSHARE_E_INVALID_ARG);
    free(bytes);
    tshare_view_release(v);
  }
}

static void remote_listener(void) {
  tshare_channel *ch = accept_one(TOKEN);
  produce_all(ch);
  tshare_channel_close(ch);
}

static void remote_connector(void) {
  tshare_channel *ch = connect_one(TOKEN);
  consume_remote(ch);
  tshare_channel_close(ch);
}

TS_TEST(remote_views_read_slices_of_every_layout_loopback) {
  use_loopback();
  run_pair(remote_listener, remote_connector);
}

TS_TEST(remote_views_read_slices_of_every_layout_netns) {
  make_namespaces();
  run_pair(remote_listener, remote_connector);
}

/* A remote view holds the producer's memory until its release; a fetched
 * one released it when it was read, and is no remote view. */
static void hold_listener(void) {
  tshare_channel *ch = accept_one(TOKEN);
  tshare_host_buffer *buf = patterned(65536, "ucx-hold", 4);
  tshare_tensor_desc d = layout((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 0);
  uint64_t remote, fetched;
  /* GPU memory would go staged, where the peer said it places staged bytes on a GPU. */
  bool staged = tshare_channel_peer(ch)->capabilities & TSHARE_CAP_UCX_STAGED;
  CHECK_EQ(tshare_channel_gpu_path(ch), staged ? TSHARE_GPU_PATH_STAGED : TSHARE_GPU_PATH_NONE);
  CHECK_RC(tshare_share_host(ch, buf, &d, "remote", NULL, 5000, &remote), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_channel_wait_released(ch, remote, 300), TSHARE_E_TIMEOUT); /* the consumer holds it 800 ms */
  CHECK_RC(tshare_channel_wait_released(ch, remote, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_share_host(ch, buf, &d, "fetched", NULL, 5000, &fetched), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, fetched, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_host_buffer_destroy(buf);
  CHECK_RC(tshare_channel_wait_released(ch, 0, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void hold_connector(void) {
  tshare_channel *ch = connect_one(TOKEN);
  tshare_view *v;
  CHECK_RC(tshare_view_recv_remote(ch, 10000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  uint8_t four[4];
  CHECK_RC(tshare_view_read(v, 0, four, 4), TSHARE_OK, tshare_channel_last_error(ch));
  for (int b = 0; b < 4; b++) CHECK_EQ(four[b], pattern(tshare_view_desc(v)->byte_offset + (uint64_t)b, 4));
  usleep(800000);
  tshare_view_release(v);
  CHECK_RC(tshare_view_recv(ch, 10000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_view_read(v, 0, four, 4), TSHARE_E_INVALID_ARG); /* its bytes are here already */
  check_elements(v, 4);
  tshare_view_release(v);
  tshare_channel_close(ch);
}

TS_TEST(a_remote_view_holds_the_producers_memory_until_released_loopback) {
  use_loopback();
  run_pair(hold_listener, hold_connector);
}

/* On a same-host channel there is nothing remote: refused, released back. */
TS_TEST(a_remote_view_on_a_same_host_channel_is_refused) {
  int sv[2];
  tshare_error err;
  CHECK_RC(tshare_socketpair(sv, &err), TSHARE_OK, err.message);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    close(sv[0]);
    tshare_channel *ch;
    CHECK_RC(tshare_channel_open_socket(sv[1], NULL, &ch, &err), TSHARE_OK, err.message);
    tshare_view *v = NULL;
    CHECK_EQ(tshare_view_recv_remote(ch, 10000, &v), TSHARE_E_UNSUPPORTED);
    CHECK(v == NULL && strstr(tshare_channel_last_error(ch), "tshare_view_recv()") != NULL);
    tshare_channel_close(ch);
    _exit(0);
  }
  close(sv[1]);
  tshare_channel *ch;
  CHECK_RC(tshare_channel_open_socket(sv[0], NULL, &ch, &err), TSHARE_OK, err.message);
  bool ipc = tshare_channel_peer(ch)->capabilities & TSHARE_CAP_CUDA_IPC; /* the peer was built with CUDA */
  CHECK_EQ(tshare_channel_gpu_path(ch), ipc ? TSHARE_GPU_PATH_IPC : TSHARE_GPU_PATH_NONE);
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(4096, "same-host", &buf, &err), TSHARE_OK, err.message);
  tshare_tensor_desc d = layout((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 0);
  uint64_t id;
  CHECK_RC(tshare_share_host(ch, buf, &d, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_host_buffer_destroy(buf);
  int status;
  CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
  tshare_channel_close(ch);
}

static void every_dtype_listener(void) { exchange(accept_one(TOKEN), 0); }
static void every_dtype_connector(void) { exchange(connect_one(TOKEN), 1); }

TS_TEST(every_dtype_and_layout_loopback) {
  use_loopback();
  producer_side = 1;
  run_pair(every_dtype_listener, every_dtype_connector);
  producer_side = 0;
  use_loopback();
  run_pair(every_dtype_listener, every_dtype_connector);
}

TS_TEST(every_dtype_and_layout_netns) {
  make_namespaces();
  producer_side = 1;
  run_pair(every_dtype_listener, every_dtype_connector);
  producer_side = 0;
  run_pair(every_dtype_listener, every_dtype_connector);
}

/* ---- the producer's memory ------------------------------------------------------ */

/* 8 MiB, destroyed at once after the share: without the channel's hold,
 * the consumer's read lands on unmapped memory and the producer faults in
 * UCX's handler; with it, every byte arrives. Then the copy is the
 * consumer's own: writing to it changes nothing of the producer's. */
#define BIG (8u << 20)

static void big_producer(tshare_channel *ch) {
  tshare_host_buffer *buf = patterned(BIG, "ucx-big", 99);
  int64_t n = BIG;
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_UINT, 8, 1}, 1, &n, 0);
  uint64_t id;
  CHECK_RC(tshare_share_host(ch, buf, &d, "big", NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_host_buffer_destroy(buf); /* the creator's reference: gone before the read */
  CHECK_RC(tshare_channel_wait_released(ch, id, 15000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void big_consumer(tshare_channel *ch) {
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 15000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_view_is_copy(v), 1);
  check_elements(v, 99);
  memset(tshare_view_data(v), 0, BIG); /* the copy is writable, and ours */
  tshare_view_release(v);
  tshare_channel_close(ch);
}

static void big_listener(void) { big_producer(accept_one(TOKEN)); }
static void big_connector(void) { big_consumer(connect_one(TOKEN)); }

TS_TEST(producer_destroys_right_after_share_loopback) {
  use_loopback();
  run_pair(big_listener, big_connector);
}

/* The wire, read raw on the consumer's side: a registration's key travels
 * once, later shares of the buffer are frames alone, and the buffer's end
 * (destroyed, its shares released) retires the key. */
static void wire_listener(void) {
  tshare_channel *ch = accept_one(TOKEN);
  tshare_host_buffer *buf;
  tshare_error err;
  CHECK_RC(tshare_host_buffer_create(4096, "ucx-wire", &buf, &err), TSHARE_OK, err.message);
  int64_t n = 16;
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, &n, 0);
  for (int i = 0; i < 3; i++) {
    uint64_t id;
    CHECK_RC(tshare_share_host(ch, buf, &d, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  tshare_host_buffer_destroy(buf); /* the retire goes with the next drive */
  int rc;
  for (int i = 0; i < 100 && (rc = tshare_channel_poll(ch, 100)) != TSHARE_END; i++)
    CHECK(rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT); /* until the peer, having read the retire, says bye */
  CHECK_EQ(rc, TSHARE_END);
  tshare_channel_close(ch);
}

static void expect_frame(tshare_channel *ch, tshare_frame *f, int type) {
  int fd;
  CHECK_RC(tshare_channel_recv_frame(ch, f, &fd, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(fd, -1);
  if (f->type != type) TS_FAIL("a %s frame came, a %s frame was due", tshare_frame_type_name(f->type),
                               tshare_frame_type_name(type));
}

static void release_raw(tshare_channel *ch, uint64_t share_id) {
  tshare_frame r;
  memset(&r, 0, sizeof r);
  r.type = TSHARE_FRAME_RELEASE;
  r.u.release.count = 1;
  r.u.release.share_ids[0] = share_id;
  CHECK_RC(tshare_channel_send_frame(ch, &r, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
}

static void wire_connector(void) {
  tshare_channel *ch = connect_one(TOKEN);
  CHECK(tshare_channel_peer(ch)->capabilities & TSHARE_CAP_UCX_REMOTE);
  tshare_frame f;
  expect_frame(ch, &f, TSHARE_FRAME_RKEY);
  uint64_t alloc = f.u.rkey.alloc_id;
  CHECK(f.u.rkey.length >= 4096 && f.u.rkey.key_len > 0);
  for (int i = 0; i < 3; i++) {
    expect_frame(ch, &f, TSHARE_FRAME_SHARE);
    CHECK_EQ(f.u.share.mem_kind, TSHARE_MEM_UCX_REMOTE);
    CHECK_EQ(f.u.share.alloc_id, alloc);
    release_raw(ch, f.u.share.share_id);
  }
  expect_frame(ch, &f, TSHARE_FRAME_RETIRE);
  CHECK_EQ(f.u.retire.mem_kind, TSHARE_MEM_UCX_REMOTE);
  CHECK_EQ(f.u.retire.closed, TSHARE_RETIRE_FREED);
  CHECK_EQ(f.u.retire.count, 1);
  CHECK_EQ(f.u.retire.alloc_ids[0], alloc);
  tshare_channel_close(ch);
}

TS_TEST(one_key_per_registration_then_retired_loopback) {
  use_loopback();
  run_pair(wire_listener, wire_connector);
}

/* ---- a hostile producer ------------------------------------------------------ */

/* Raw frames naming memory of the hostile process's own: a region it did
 * register (so the key is real), then lies about it. */
static tshare_frame rkey_frame(uint64_t alloc_id, uint64_t address, uint64_t length, const void *key, size_t key_len) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RKEY;
  f.u.rkey.alloc_id = alloc_id;
  f.u.rkey.address = address;
  f.u.rkey.length = length;
  f.u.rkey.key_len = (uint16_t)key_len;
  memcpy(f.u.rkey.key, key, key_len);
  return f;
}

static tshare_frame share_frame(uint64_t share_id, uint64_t alloc_id, uint64_t alloc_size, uint64_t bytes) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SHARE;
  f.u.share.share_id = share_id;
  f.u.share.alloc_id = alloc_id;
  f.u.share.mem_kind = TSHARE_MEM_UCX_REMOTE;
  f.u.share.device_type = TSHARE_DEVICE_CPU;
  f.u.share.alloc_size = alloc_size;
  int64_t n = (int64_t)bytes;
  f.u.share.tensor = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_UINT, 8, 1}, 1, &n, 0);
  return f;
}

static void send_raw_frame(tshare_channel *ch, const tshare_frame *f) {
  CHECK_RC(tshare_channel_send_frame(ch, f, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
}

/* The refusals the consumer must give, one per raw share 1001..1004, each
 * released back; then a good share of a real buffer still arrives. */
static void hostile_producer(void) {
  tshare_channel *ch = accept_one(TOKEN);
  int status;
  const char *why;
  const ts_ucx_api *ucx = ts_ucx(&status, &why);
  CHECK(ucx != NULL);
  /* Only the first REGION bytes are registered; the rest stays mapped so
   * that a UCX which serves a lying get in software reads this process's
   * own bytes rather than faulting in it (the hostile end is this one). */
  enum { REGION = 65536 };
  static uint8_t region[4 * REGION];
  ts_ucp_mem_map_params mp = {TS_UCP_MEM_MAP_PARAM_FIELD_ADDRESS | TS_UCP_MEM_MAP_PARAM_FIELD_LENGTH, region,
                              REGION};
  ts_ucp_mem_h memh;
  void *key;
  size_t key_len;
  CHECK_EQ(ucx->ucp_mem_map(ucx->context, &mp, &memh), TS_UCS_OK);
  CHECK_EQ(ucx->ucp_rkey_pack(ucx->context, memh, &key, &key_len), TS_UCS_OK);
  uint64_t base = (uint64_t)(uintptr_t)region;
  for (size_t i = 0; i < REGION; i++) region[i] = pattern(i, 3);
  /* 1: a key that is not UCX's: over tcp (UCX_TLS=tcp, UCX 1.13) gets are
   * served in software and no key is checked, so this one may be read */
  uint8_t garbage[40];
  memset(garbage, 0xa5, sizeof garbage);
  tshare_frame f = rkey_frame(101, base, REGION, garbage, sizeof garbage);
  send_raw_frame(ch, &f);
  f = share_frame(1001, 101, REGION, 64);
  send_raw_frame(ch, &f);
  /* 2: an allocation no key came for */
  f = share_frame(1002, 102, REGION, 64);
  send_raw_frame(ch, &f);
  /* 3: a share larger than the region its key reads */
  f = rkey_frame(103, base, REGION, key, key_len);
  send_raw_frame(ch, &f);
  f = share_frame(1003, 103, 2 * REGION, 2 * REGION);
  send_raw_frame(ch, &f);
  /* 4: a region and share of 64 TiB, more than the consumer can land */
  f = rkey_frame(104, base, 1ull << 46, key, key_len);
  send_raw_frame(ch, &f);
  f = share_frame(1004, 104, 1ull << 46, 1ull << 46);
  send_raw_frame(ch, &f);
  /* 5: GPU bytes staged in host memory, sent whatever the consumer's hello
   * offered: placed on its GPU where it has one, else refused */
  f = share_frame(1005, 103, REGION, 64);
  f.u.share.device_type = TSHARE_DEVICE_CUDA;
  send_raw_frame(ch, &f);
  bool released[6] = {false}; /* by raw id - 1000 */
  for (int i = 0; i < 5; i++) {
    tshare_frame r;
    int fd;
    CHECK_RC(tshare_channel_recv_frame(ch, &r, &fd, 10000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(r.type, TSHARE_FRAME_RELEASE);
    for (uint32_t k = 0; k < r.u.release.count; k++) {
      CHECK(r.u.release.share_ids[k] >= 1001 && r.u.release.share_ids[k] <= 1005);
      released[r.u.release.share_ids[k] - 1000] = true;
    }
    if (released[1] && released[2] && released[3] && released[4] && released[5]) break;
  }
  CHECK(released[1] && released[2] && released[3] && released[4] && released[5]);
  ucx->ucp_rkey_buffer_release(key);
  /* The channel goes on: a real share. */
  tshare_host_buffer *buf = patterned(4096, "ucx-good", 7);
  tshare_tensor_desc d = layout((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 2);
  uint64_t id;
  CHECK_RC(tshare_share_host(ch, buf, &d, "good", NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_host_buffer_destroy(buf);
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  ucx->ucp_mem_unmap(ucx->context, memh);
  tshare_channel_close(ch);
}

static void expect_refused(tshare_channel *ch, int want, const char *words) {
  tshare_view *v = NULL;
  int rc = tshare_view_recv(ch, 10000, &v);
  const char *detail = tshare_channel_last_error(ch);
  fprintf(stderr, "refused: %s\n", detail);
  CHECK_RC(rc, want, detail);
  CHECK(v == NULL);
  if (!strstr(detail, words)) TS_FAIL("the refusal '%s' does not say '%s'", detail, words);
}

/* 1: a key UCX may not check: refused, or read from the region it names
 * (and then the region's bytes, and nothing else, came). Released either way. */
static void key_not_checked(tshare_channel *ch) {
  tshare_view *v = NULL;
  int rc = tshare_view_recv(ch, 10000, &v);
  if (rc == TSHARE_OK) {
    printf("a key that is not UCX's was not detected (UCX_TLS=%s): the share was read\n", getenv("UCX_TLS"));
    fflush(stdout);
    check_elements(v, 3);
    tshare_view_release(v);
    return;
  }
  printf("a key that is not UCX's was refused: %s\n", tshare_channel_last_error(ch));
  if (!strstr(tshare_channel_last_error(ch), "1001")) TS_FAIL("the refusal does not name the share");
}

/* 5: GPU bytes staged by the peer: on a GPU of this process's where one is
 * usable (a copy), else refused saying why; released back either way. */
static void staged_gpu_bytes(tshare_channel *ch) {
  tshare_view *v = NULL;
  int rc = tshare_view_recv(ch, 10000, &v);
  if (rc == TSHARE_OK) {
    printf("staged GPU bytes were placed on GPU %d\n", tshare_view_cuda_device(v));
    CHECK_EQ(tshare_view_device_type(v), TSHARE_DEVICE_CUDA);
    CHECK(tshare_view_cuda_device(v) >= 0);
    CHECK_EQ(tshare_view_is_copy(v), 1);
    tshare_view_release(v);
    return;
  }
  const char *detail = tshare_channel_last_error(ch);
  printf("staged GPU bytes were refused: %s\n", detail);
  CHECK(rc == TSHARE_E_NO_DEVICE || rc == TSHARE_E_UNSUPPORTED);
  if (!strstr(detail, "GPU memory")) TS_FAIL("the refusal '%s' does not say it was GPU memory", detail);
}

static void wary_consumer(void) {
  tshare_channel *ch = connect_one(TOKEN);
  key_not_checked(ch);                                          /* 1 */
  expect_refused(ch, TSHARE_E_PROTOCOL, "no usable rkey");     /* 2 */
  expect_refused(ch, TSHARE_E_OUT_OF_BOUNDS, "registered region"); /* 3 */
  expect_refused(ch, TSHARE_E_NOMEM, "landing buffer");           /* 4 */
  staged_gpu_bytes(ch);                                           /* 5 */
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 10000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK(strcmp(tshare_view_tag(v), "good") == 0);
  check_elements(v, 7);
  tshare_view_release(v);
  tshare_channel_close(ch);
}

TS_TEST(hostile_producer_loopback) {
  use_loopback();
  run_pair(hostile_producer, wary_consumer);
}

TS_TEST_MAIN
