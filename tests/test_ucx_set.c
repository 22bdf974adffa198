/* Tensor sets over UCX (host memory read as remote memory): every layout of
 * several dtypes in three buffers, each element checked, the set released
 * back to the producer as soon as its bytes were read and the received set
 * a copy; a hostile producer's sets refused one by one while the channel
 * goes on; and one network copy per node: a producer in one namespace, a
 * relay in another that shares what it read on to two local workers over
 * Unix sockets (memfds, no copy). Processes meet as in ucx_pair.h. */
#include "harness.h"
#include "proc_util.h"
#include "ucx_pair.h"
#include "tshare/set.h"
#include "ucx_api.h" /* a hostile producer registers memory of its own */

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* ---- the set ----------------------------------------------------------------- */

enum { BUFFERS = 3, LAYOUTS = 6 };
static const size_t buffer_bytes[BUFFERS] = {64u << 10, 1u << 20, 4096};
static const tshare_dtype dtypes[] = {
    {TSHARE_DTYPE_FLOAT, 32, 1}, {TSHARE_DTYPE_INT, 64, 1}, {TSHARE_DTYPE_UINT, 8, 1}, {TSHARE_DTYPE_FLOAT, 16, 1}};
#define N_DTYPES (sizeof dtypes / sizeof dtypes[0])
static const char META[] = "step=42";

static uint8_t pattern(uint64_t byte, unsigned seed) { return (uint8_t)(byte * 131u + seed * 17u + 5u); }

/* Layout `which`: contiguous, transposed, every other element, reversed,
 * 3-D at an offset, empty. */
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

/* Member k: its buffer, dtype and layout (the 1 MiB buffer's tensors sit
 * 512 KiB in). */
static unsigned buffer_of(size_t k) { return (unsigned)(k % BUFFERS); }
static tshare_tensor_desc member_desc(size_t k) {
  tshare_tensor_desc d = layout(dtypes[(k / LAYOUTS) % N_DTYPES], (int)(k % LAYOUTS));
  if (buffer_of(k) == 1) d.byte_offset += 512u << 10;
  return d;
}
#define MEMBERS (N_DTYPES * LAYOUTS)

static void member_name(size_t k, char *out, size_t cap) { snprintf(out, cap, "layers.%zu.weight", k); }

/* Every byte of every element is the producer's byte at the same place of
 * its buffer (seeded by the buffer's index). */
static void check_tensor(const tshare_tensor_desc *d, const uint8_t *data, unsigned seed, size_t k) {
  size_t item = tshare_dtype_itemsize(d->dtype);
  uint64_t n = tshare_tensor_numel(d);
  for (uint64_t e = 0; e < n; e++) {
    int64_t at = 0;
    uint64_t rest = e;
    for (int i = d->ndim - 1; i >= 0; i--) {
      at += (int64_t)(rest % (uint64_t)d->shape[i]) * d->strides[i];
      rest /= (uint64_t)d->shape[i];
    }
    for (size_t b = 0; b < item; b++) {
      uint64_t producer_byte = (uint64_t)((int64_t)d->byte_offset + at * (int64_t)item) + b;
      uint8_t got = data[at * (int64_t)item + (int64_t)b];
      if (got != pattern(producer_byte, seed))
        TS_FAIL("tensor %zu, element %llu byte %zu: %u, the producer's was %u", k, (unsigned long long)e, b, got,
                pattern(producer_byte, seed));
    }
  }
}

static void check_set(const tshare_set *s) {
  CHECK_EQ(tshare_set_count(s), MEMBERS);
  for (size_t k = 0; k < MEMBERS; k++) {
    char name[32];
    member_name(k, name, sizeof name);
    CHECK(strcmp(tshare_set_name(s, k), name) == 0);
    tshare_tensor_desc want = member_desc(k);
    const tshare_tensor_desc *d = tshare_set_desc(s, k);
    CHECK(d->ndim == want.ndim && d->byte_offset == want.byte_offset && d->dtype.code == want.dtype.code);
    if (tshare_tensor_numel(d)) check_tensor(d, tshare_set_data(s, k), buffer_of(k), k);
  }
  size_t len;
  const char *meta = tshare_set_meta(s, &len);
  CHECK(len == sizeof META - 1 && memcmp(meta, META, len) == 0);
}

/* The set over three buffers (destroyed here: the builder holds them). */
static tshare_set_builder *build_set(void) {
  tshare_host_buffer *bufs[BUFFERS];
  tshare_error err;
  for (unsigned i = 0; i < BUFFERS; i++) {
    CHECK_RC(tshare_host_buffer_create(buffer_bytes[i], "ucx-set", &bufs[i], &err), TSHARE_OK, err.message);
    uint8_t *p = tshare_host_buffer_data(bufs[i]);
    for (size_t j = 0; j < buffer_bytes[i]; j++) p[j] = pattern(j, i);
  }
  tshare_set_builder *b = tshare_set_builder_create();
  CHECK(b != NULL);
  for (size_t k = 0; k < MEMBERS; k++) {
    char name[32];
    member_name(k, name, sizeof name);
    tshare_tensor_desc d = member_desc(k);
    CHECK_RC(tshare_set_builder_add_host(b, name, bufs[buffer_of(k)], &d, &err), TSHARE_OK, err.message);
  }
  CHECK_RC(tshare_set_builder_set_meta(b, META, sizeof META - 1, &err), TSHARE_OK, err.message);
  for (unsigned i = 0; i < BUFFERS; i++) tshare_host_buffer_destroy(bufs[i]);
  return b;
}

/* ---- a set across: released once read ------------------------------------------- */

/* The set's release comes while the consumer still holds its copy: the
 * consumer reads it only after this end closed. */
static void set_producer(void) {
  tshare_channel *ch = accept_one(TOKEN);
  CHECK(tshare_channel_peer(ch)->capabilities & TSHARE_CAP_UCX_SETS);
  tshare_set_builder *b = build_set();
  uint64_t id;
  CHECK_RC(tshare_set_send(ch, b, NULL, 10000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder_destroy(b);
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void set_consumer(void) {
  tshare_channel *ch = connect_one(TOKEN);
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_set_is_copy(s), 1);
  tshare_view *v;
  CHECK_RC(tshare_set_view(s, 0, &v), TSHARE_OK, "");
  CHECK_EQ(tshare_view_is_copy(v), 1);
  for (size_t k = 0; k < MEMBERS; k++) {
    tshare_host_buffer *buf = tshare_set_host_buffer(s, k);
    CHECK(buf != NULL);
    CHECK(tshare_set_data(s, k) == (char *)tshare_host_buffer_data(buf) + tshare_set_desc(s, k)->byte_offset);
  }
  tshare_set *next;
  CHECK_RC(tshare_set_recv(ch, 10000, &next), TSHARE_END, tshare_channel_last_error(ch)); /* released before */
  check_set(s);
  check_tensor(tshare_view_desc(v), tshare_view_data(v), buffer_of(0), 0);
  tshare_set_release(s);
  tshare_view_release(v);
  tshare_channel_close(ch);
}

TS_TEST(set_every_layout_loopback) {
  use_loopback();
  run_pair(set_producer, set_consumer);
}

TS_TEST(set_every_layout_netns) {
  make_namespaces();
  run_pair(set_producer, set_consumer);
}

/* ---- a hostile producer ------------------------------------------------------- */

enum { REGION = 65536 };

static void send_frame(tshare_channel *ch, const tshare_frame *f) {
  CHECK_RC(tshare_channel_send_frame(ch, f, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
}

static tshare_frame set_step(uint8_t op, uint64_t set_id) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SET;
  f.u.set.op = op;
  f.u.set.set_id = set_id;
  return f;
}

static void send_rkey(tshare_channel *ch, uint64_t alloc_id, uint64_t address, uint64_t length, const void *key,
                      size_t key_len) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RKEY;
  f.u.rkey = (tshare_rkey_frame){.alloc_id = alloc_id, .address = address, .length = length,
                                 .key_len = (uint16_t)key_len};
  memcpy(f.u.rkey.key, key, key_len);
  send_frame(ch, &f);
}

/* A set of one tensor per memory (uint8, `bytes` long, at offset 0), the
 * memories of kind `kind` and the sizes given. */
static void send_set(tshare_channel *ch, uint64_t id, uint8_t kind, const uint64_t *sizes, uint32_t mems,
                     uint64_t bytes) {
  tshare_frame f = set_step(TSHARE_SET_BEGIN, id);
  f.u.set.u.begin = (tshare_set_begin_frame){.count = mems, .mem_count = mems, .names_bytes = mems, .meta_bytes = 0};
  send_frame(ch, &f);
  for (uint32_t i = 0; i < mems; i++) {
    f = set_step(TSHARE_SET_MEM, id);
    f.u.set.u.mem = (tshare_set_mem_frame){.index = i, .alloc_id = id * 10 + i, .mem_kind = kind,
                                           .device_type = TSHARE_DEVICE_CPU, .alloc_size = sizes[i]};
    send_frame(ch, &f);
  }
  for (uint32_t i = 0; i < mems; i++) {
    f = set_step(TSHARE_SET_MEMBER, id);
    tshare_set_member_frame *m = &f.u.set.u.member;
    m->index = i;
    m->mem_index = i;
    m->name_len = 1;
    m->name[0] = (char)('a' + i);
    int64_t n = (int64_t)bytes;
    m->tensor = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_UINT, 8, 1}, 1, &n, 0);
    send_frame(ch, &f);
  }
  f = set_step(TSHARE_SET_END, id);
  send_frame(ch, &f);
}

/* Raw releases until sets first..last all came back. */
static void wait_raw_releases(tshare_channel *ch, uint64_t first, uint64_t last) {
  bool back[16] = {false};
  size_t missing = (size_t)(last - first + 1);
  while (missing) {
    tshare_frame r;
    int fd;
    CHECK_RC(tshare_channel_recv_frame(ch, &r, &fd, 10000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(r.type, TSHARE_FRAME_RELEASE);
    for (uint32_t k = 0; k < r.u.release.count; k++) {
      uint64_t id = r.u.release.share_ids[k];
      if (id < first || id > last) TS_FAIL("release of %llu, no set of this end", (unsigned long long)id);
      if (back[id - first]) TS_FAIL("set %llu released twice", (unsigned long long)id);
      back[id - first] = true;
      missing--;
    }
  }
}

/* Sets 2001..2005, each wrong in one way, then a good set from the API. */
static void hostile_producer(void) {
  tshare_channel *ch = accept_one(TOKEN);
  const ts_ucx_api *ucx = ts_ucx(NULL, NULL);
  CHECK(ucx != NULL);
  static uint8_t region[4 * REGION]; /* registered: the first REGION bytes */
  for (size_t i = 0; i < REGION; i++) region[i] = pattern(i, 9);
  ts_ucp_mem_map_params mp = {TS_UCP_MEM_MAP_PARAM_FIELD_ADDRESS | TS_UCP_MEM_MAP_PARAM_FIELD_LENGTH, region, REGION};
  ts_ucp_mem_h memh;
  void *key;
  size_t key_len;
  CHECK_EQ(ucx->ucp_mem_map(ucx->context, &mp, &memh), TS_UCS_OK);
  CHECK_EQ(ucx->ucp_rkey_pack(ucx->context, memh, &key, &key_len), TS_UCS_OK);
  uint64_t base = (uint64_t)(uintptr_t)region;
  uint64_t sizes[2] = {4096, 4096};
  /* 2001: a host memfd it claims this end keeps mapped (none crosses UCX) */
  send_set(ch, 2001, TSHARE_MEM_HOST_KEPT, sizes, 1, 64);
  /* 2002: remote memory no key came for */
  send_set(ch, 2002, TSHARE_MEM_UCX_REMOTE, sizes, 1, 64);
  /* 2003: a memory larger than the region its key reads */
  send_rkey(ch, 20030, base, REGION, key, key_len);
  sizes[0] = 2 * REGION;
  send_set(ch, 2003, TSHARE_MEM_UCX_REMOTE, sizes, 1, 64);
  /* 2004: two memories, each within this machine's memory, together over it */
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  send_rkey(ch, 20040, base, REGION, key, key_len);
  send_rkey(ch, 20041, base, 1ull << 47, key, key_len);
  sizes[0] = REGION;
  sizes[1] = (uint64_t)pages * (uint64_t)page - REGION / 2;
  send_set(ch, 2004, TSHARE_MEM_UCX_REMOTE, sizes, 2, 64);
  /* 2005: a tensor past the end of its memory */
  send_rkey(ch, 20050, base, REGION, key, key_len);
  sizes[0] = 4096;
  send_set(ch, 2005, TSHARE_MEM_UCX_REMOTE, sizes, 1, 8192);
  wait_raw_releases(ch, 2001, 2005);
  ucx->ucp_rkey_buffer_release(key);
  /* The channel goes on: a good set. */
  tshare_set_builder *b = build_set();
  uint64_t id;
  CHECK_RC(tshare_set_send(ch, b, NULL, 10000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder_destroy(b);
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  ucx->ucp_mem_unmap(ucx->context, memh);
  tshare_channel_close(ch);
}

static void expect_refused(tshare_channel *ch, int want, const char *words) {
  tshare_set *s = NULL;
  int rc = tshare_set_recv(ch, 10000, &s);
  const char *detail = tshare_channel_last_error(ch);
  fprintf(stderr, "refused: %s\n", detail);
  CHECK_RC(rc, want, detail);
  CHECK(s == NULL);
  if (!strstr(detail, words)) TS_FAIL("the refusal '%s' does not say '%s'", detail, words);
}

static void wary_consumer(void) {
  tshare_channel *ch = connect_one(TOKEN);
  expect_refused(ch, TSHARE_E_PROTOCOL, "keeps no mapping");          /* 2001 */
  expect_refused(ch, TSHARE_E_PROTOCOL, "no usable rkey");            /* 2002 */
  expect_refused(ch, TSHARE_E_OUT_OF_BOUNDS, "registered region");    /* 2003 */
  expect_refused(ch, TSHARE_E_NOMEM, "landing buffers");              /* 2004 */
  expect_refused(ch, TSHARE_E_OUT_OF_BOUNDS, "tensor 0");             /* 2005 */
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  check_set(s);
  tshare_set_release(s);
  tshare_channel_close(ch);
}

TS_TEST(hostile_sets_refused_alone_loopback) {
  use_loopback();
  run_pair(hostile_producer, wary_consumer);
}

/* ---- one network copy per node ------------------------------------------------- */

enum { WORKERS = 2 };
static int worker_fds[WORKERS];

/* A worker of the relay's node: the set maps the relay's landing buffers. */
static void worker(int fd) {
  char name[16];
  snprintf(name, sizeof name, "worker-%d", fd == worker_fds[0] ? 0 : 1);
  tshare_channel *ch = open_socket_channel(fd, name, NULL, NULL);
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 15000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_set_is_copy(s), 0);
  check_set(s);
  tshare_set_release(s);
  CHECK_RC(tshare_set_recv(ch, 15000, &s), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

/* The relay's set from what landed: each tensor where it landed, no copy. */
static tshare_set_builder *reshare(tshare_set *s) {
  tshare_set_builder *b = tshare_set_builder_create();
  CHECK(b != NULL);
  tshare_error err;
  for (size_t k = 0; k < tshare_set_count(s); k++) {
    tshare_host_buffer *buf = tshare_set_host_buffer(s, k);
    CHECK(buf != NULL);
    CHECK_RC(tshare_set_builder_add_host(b, tshare_set_name(s, k), buf, tshare_set_desc(s, k), &err), TSHARE_OK,
             err.message);
  }
  size_t len;
  const void *meta = tshare_set_meta(s, &len);
  CHECK_RC(tshare_set_builder_set_meta(b, meta, len, &err), TSHARE_OK, err.message);
  return b;
}

static void relay(void) {
  pid_t pids[WORKERS];
  for (int i = 0; i < WORKERS; i++) {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    worker_fds[i] = sv[1];
    pids[i] = fork_child(worker, sv[1]);
    close(sv[1]);
    worker_fds[i] = sv[0];
  }
  tshare_channel *local[WORKERS];
  for (int i = 0; i < WORKERS; i++) local[i] = open_socket_channel(worker_fds[i], "relay", NULL, NULL);
  tshare_channel *ch = connect_one(TOKEN);
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder *b = reshare(s);
  tshare_set_release(s); /* the builder holds the landing buffers */
  uint64_t ids[WORKERS];
  tshare_error results[WORKERS];
  CHECK_RC(tshare_set_send_all(b, local, WORKERS, NULL, 10000, ids, results), TSHARE_OK, results[0].message);
  tshare_set_builder_destroy(b);
  CHECK_RC(tshare_set_wait_all(local, ids, WORKERS, 10000, results), TSHARE_OK, results[0].message);
  for (int i = 0; i < WORKERS; i++) tshare_channel_close(local[i]);
  for (int i = 0; i < WORKERS; i++) CHECK_CHILD_OK(pids[i]);
  tshare_channel_close(ch);
}

TS_TEST(relay_to_local_workers_loopback) {
  use_loopback();
  run_pair(set_producer, relay);
}

TS_TEST(relay_to_local_workers_netns) {
  make_namespaces();
  run_pair(set_producer, relay);
}

TS_TEST_MAIN
