/* GPU tests: CUDA IPC shares between real processes. Each test exits 77
 * with the reason when no CUDA device is usable. The other processes are
 * this binary again (`test_cuda --role NAME`), started with posix_spawn
 * (a CUDA process must not fork). */
#include "cudakit.h"
#include "harness.h"
#include "tshare/tshare.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TIMEOUT 20000

static const ts_cuda_api *cu;

static void need_gpu(int devices) {
  char why[256];
  cu = ck_init(why, sizeof why);
  if (!cu) TS_SKIP("%s", why);
  if (tshare_cuda_device_count() < devices)
    TS_SKIP("needs %d CUDA devices, this machine has %d", devices, tshare_cuda_device_count());
}

static tshare_channel *open_ch(int fd, const char *name) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = name;
  tshare_channel *ch;
  tshare_error err;
  if (tshare_channel_open_socket(fd, &o, &ch, &err) != TSHARE_OK) TS_FAIL("channel: %s", err.message);
  return ch;
}

static tshare_tensor_desc vec_i32(int64_t n) {
  int64_t shape[1] = {n};
  return tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, shape, 0);
}

/* A process running `test_cuda --role ROLE ARGS`, with a channel on fd 3 and
 * a result pipe on fd 4. */
typedef struct peer {
  tshare_process *proc;
  int channel_fd; /* our end */
  FILE *results;
} peer;

/* given_fd >= 0: the child's channel is that fd (we keep no end of it). */
static peer start_role(const char *role, const char *arg, char *const *env, int extra_fd, int given_fd) {
  int sv[2] = {-1, given_fd}, res[2];
  tshare_error err;
  if (given_fd < 0 && tshare_socketpair(sv, &err) != TSHARE_OK) TS_FAIL("%s", err.message);
  CHECK(pipe2(res, O_CLOEXEC) == 0);
  char *argv[] = {(char *)"/proc/self/exe", (char *)"--role", (char *)role, (char *)(arg ? arg : ""), NULL};
  tshare_fd_map fds[3] = {{3, sv[1]}, {4, res[1]}, {5, extra_fd}};
  tshare_spawn_options so = {
      .file = "/proc/self/exe", .argv = argv, .env_set = env, .fds = fds, .nfds = extra_fd >= 0 ? 3 : 2};
  peer p;
  if (tshare_spawn(&so, &p.proc, &err) != TSHARE_OK) TS_FAIL("spawn: %s", err.message);
  if (given_fd < 0) close(sv[1]);
  close(res[1]);
  p.channel_fd = sv[0];
  p.results = fdopen(res[0], "r");
  return p;
}

static char *result_line(peer *p) {
  static char line[1024];
  if (!fgets(line, sizeof line, p->results)) TS_FAIL("the role process ended without a result");
  line[strcspn(line, "\n")] = '\0';
  return line;
}

static int finish(peer *p) {
  tshare_exit_status st;
  if (tshare_process_wait(p->proc, TIMEOUT, &st) != TSHARE_OK) {
    tshare_process_terminate(p->proc, 1000, &st);
    TS_FAIL("the role process did not end");
  }
  tshare_process_destroy(p->proc);
  fclose(p->results);
  return st.kind == TSHARE_EXIT_CODE ? st.value : 128 + st.value;
}

/* ---- roles ------------------------------------------------------------------ */

static void share_pattern(tshare_channel *ch, tshare_cuda_buffer *b, size_t off, int n, int base, int step);
static void end_stream(tshare_channel *ch);

/* Receive views until bye; each tag says "BASE STEP N": count bad elements on
 * this process's own stream, ordered only by what tshare made it wait on.
 * arg "hold": keep every view until the end (the import cache test). */
static int role_checker(const char *arg, tshare_channel *ch, FILE *out) {
  if (strcmp(arg, "dev1") == 0) CHECK(ts_cuda_push(ts_cuda_primary_ctx(1))); /* a stream on the other GPU */
  CUstream s;
  CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  tshare_view *held[256];
  size_t nheld = 0, views = 0;
  unsigned long long bad_total = 0;
  int device = -1;
  for (;;) {
    tshare_view *v;
    int rc = tshare_view_recv_stream(ch, s, TIMEOUT, &v);
    if (rc == TSHARE_END) break;
    if (rc != TSHARE_OK) {
      fprintf(out, "error %s %s\n", tshare_status_name(rc), tshare_channel_last_error(ch));
      return 1;
    }
    int base, step, n;
    if (sscanf(tshare_view_tag(v), "%d %d %d", &base, &step, &n) != 3) TS_FAIL("tag '%s'", tshare_view_tag(v));
    unsigned long long bad = 0;
    CUresult crc = ck_count_bad((CUdeviceptr)(uintptr_t)tshare_view_data(v), (size_t)n, base, step, s, &bad);
    if (crc != CUDA_SUCCESS) TS_FAIL("count: %s", ts_cuda_strerror(crc));
    bad_total += bad;
    device = tshare_view_cuda_device(v);
    views++;
    bool hold = strcmp(arg, "hold") == 0 || (strcmp(arg, "hold-small") == 0 && base < 100);
    if (hold && nheld < 256)
      held[nheld++] = v;
    else
      tshare_view_release(v);
  }
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  fprintf(out, "views=%zu bad=%llu imports=%llu hits=%llu device=%d\n", views, bad_total,
          (unsigned long long)(st.imports + st.fd_imports), (unsigned long long)st.import_hits, device);
  fflush(out);
  for (size_t i = 0; i < nheld; i++) tshare_view_release(held[i]);
  tshare_channel_poll(ch, 100); /* let the releases go out */
  return 0;
}

/* Read the share frame by hand and map it with no ordering at all: what a
 * consumer that skips the event sees while the producer's kernel still runs. */
static int role_unordered(tshare_channel *ch, FILE *out) {
  tshare_frame f;
  int fd;
  do {
    int rc = tshare_channel_recv_frame(ch, &f, &fd, TIMEOUT);
    if (rc != TSHARE_OK) TS_FAIL("recv: %s", tshare_channel_last_error(ch));
  } while (f.type != TSHARE_FRAME_SHARE);
  CUdeviceptr p;
  size_t size = f.u.share.alloc_size;
  if (f.u.share.mem_kind == TSHARE_MEM_CUDA_FD) { /* VMM memory: map the fd by hand */
    CUmemGenericAllocationHandle h;
    CHECK(fd >= 0);
    CHECK(cu->cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) ==
          CUDA_SUCCESS);
    CHECK(cu->cuMemAddressReserve(&p, size, 0, 0, 0) == CUDA_SUCCESS);
    CHECK(cu->cuMemMap(p, size, 0, h, 0) == CUDA_SUCCESS);
    CUmemAccessDesc a = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = 0},
                         .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CHECK(cu->cuMemSetAccess(p, size, &a, 1) == CUDA_SUCCESS);
    cu->cuMemRelease(h);
  } else {
    CUipcMemHandle h;
    memcpy(h.reserved, f.u.share.handle, sizeof h.reserved);
    CHECK(cu->cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) == CUDA_SUCCESS);
  }
  CUstream s;
  CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  int base, step, n;
  CHECK(sscanf(f.u.share.tag, "%d %d %d", &base, &step, &n) == 3);
  unsigned long long bad = 0;
  CHECK(ck_count_bad(p + f.u.share.tensor.byte_offset, (size_t)n, base, step, s, &bad) == CUDA_SUCCESS);
  fprintf(out, "bad=%llu\n", bad);
  fflush(out);
  if (f.u.share.mem_kind == TSHARE_MEM_CUDA_FD) {
    cu->cuMemUnmap(p, size);
    cu->cuMemAddressFree(p, size);
    close(fd);
  } else {
    cu->cuIpcCloseMemHandle(p);
  }
  return 0;
}

/* Receive everything, say so, then wait to be killed while holding it all. */
static int role_hold_and_die(tshare_channel *ch, FILE *out, int count) {
  for (int i = 0; i < count; i++) {
    tshare_view *v;
    if (tshare_view_recv(ch, TIMEOUT, &v) != TSHARE_OK) TS_FAIL("recv: %s", tshare_channel_last_error(ch));
  }
  fprintf(out, "holding %d\n", count);
  fflush(out);
  pause();
  return 0;
}

/* Share one tensor, then die without a bye. */
static int role_share_and_die(tshare_channel *ch) {
  tshare_cuda_buffer *b;
  tshare_error err;
  if (tshare_cuda_buffer_create(0, 4096, &b, &err) != TSHARE_OK) TS_FAIL("%s", err.message);
  CHECK(ck_fill((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(b), 1024, 7, 1, NULL) == CUDA_SUCCESS);
  tshare_tensor_desc d = vec_i32(1024);
  CHECK_RC(tshare_share_cuda_buffer(ch, b, &d, NULL, "7 1 1024", NULL, TIMEOUT, NULL), TSHARE_OK,
           tshare_channel_last_error(ch));
  cu->cuCtxSynchronize();
  _exit(9);
}

/* Forward every view from the channel on fd 3 to the one on fd 5. */
static int role_forwarder(tshare_channel *in, FILE *out) {
  tshare_channel *fwd = open_ch(5, "forwarder-out");
  int forwarded = 0;
  for (;;) {
    tshare_view *v;
    int rc = tshare_view_recv(in, TIMEOUT, &v);
    if (rc == TSHARE_END) break;
    if (rc != TSHARE_OK) TS_FAIL("recv: %s", tshare_channel_last_error(in));
    uint64_t id;
    CHECK_RC(tshare_share_view(fwd, v, NULL, NULL, NULL, TIMEOUT, &id), TSHARE_OK, tshare_channel_last_error(fwd));
    forwarded++;
  }
  CHECK_RC(tshare_channel_send_bye(fwd, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(fwd));
  /* The third process's releases free our views, whose releases go back. */
  CHECK_RC(tshare_channel_wait_released(fwd, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(fwd));
  tshare_channel_poll(in, 200);
  fprintf(out, "forwarded=%d\n", forwarded);
  fflush(out);
  tshare_channel_close(fwd);
  return 0;
}

/* Receive one share without touching CUDA first: report what import says. */
static int role_import_error(tshare_channel *ch, FILE *out) {
  tshare_view *v;
  int rc = tshare_view_recv(ch, TIMEOUT, &v);
  fprintf(out, "%s %s\n", tshare_status_name(rc), tshare_channel_last_error(ch));
  fflush(out);
  if (rc == TSHARE_OK) tshare_view_release(v);
  tshare_channel_poll(ch, 200);
  return 0;
}

/* Receive a view on stream s; the bad elements against its tag's pattern. */
/* Elements of v that differ from what its tag ("BASE STEP N") says, read on s. */
static unsigned long long count_bad_in(const tshare_view *v, CUstream s) {
  int base, step, n;
  if (sscanf(tshare_view_tag(v), "%d %d %d", &base, &step, &n) != 3) TS_FAIL("tag '%s'", tshare_view_tag(v));
  unsigned long long bad = 0;
  CHECK(ck_count_bad((CUdeviceptr)(uintptr_t)tshare_view_data(v), (size_t)n, base, step, s, &bad) == CUDA_SUCCESS);
  return bad;
}

static unsigned long long recv_checked(tshare_channel *ch, CUstream s, tshare_view **out) {
  CHECK_RC(tshare_view_recv_stream(ch, s, TIMEOUT, out), TSHARE_OK, tshare_channel_last_error(ch));
  return count_bad_in(*out, s);
}

/* Receive count views, check them, and hand them to a worker thread that
 * releases them while this (the driving) thread waits on fd 5, outside
 * tshare, until the producer says it has them back. */
static void *release_views(void *arg) {
  tshare_view **views = arg;
  for (int i = 0; views[i]; i++) tshare_view_release(views[i]);
  return NULL;
}

static int role_busy_releaser(tshare_channel *ch, FILE *out, int count) {
  CUstream s;
  CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  tshare_view *views[17] = {0};
  unsigned long long bad_total = 0;
  CHECK(count > 0 && count < 17);
  for (int i = 0; i < count; i++) bad_total += recv_checked(ch, s, &views[i]);
  /* The stream is idle: each release can go out at once. */
  CHECK(cu->cuStreamSynchronize(s) == CUDA_SUCCESS);
  pthread_t t;
  CHECK(pthread_create(&t, NULL, release_views, views) == 0);
  CHECK(pthread_join(t, NULL) == 0);
  char byte;
  CHECK(read(5, &byte, 1) == 1);
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, TIMEOUT, &v), TSHARE_END, tshare_channel_last_error(ch));
  fprintf(out, "views=%d bad=%llu\n", count, bad_total);
  fflush(out);
  return 0;
}

/* Two rounds of count shares, each from its own allocation, every view of a
 * round held until the round ends; at most 8 idle mappings are kept. */
static int role_cache_bounds(tshare_channel *ch, FILE *out, int count) {
  tshare_cuda_set_import_cache_limits(8, (size_t)1 << 40);
  CUstream s;
  CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  tshare_view *views[64];
  unsigned long long bad_total = 0;
  CHECK(count > 0 && count <= 64);
  for (int round = 0; round < 2; round++) {
    for (int i = 0; i < count; i++) bad_total += recv_checked(ch, s, &views[i]);
    for (int i = 0; i < count; i++) tshare_view_release(views[i]);
    int rc = tshare_channel_poll(ch, 0); /* the releases go out; the producer's bye may be here already */
    if (rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT && rc != TSHARE_END)
      TS_FAIL("poll: %s", tshare_channel_last_error(ch));
  }
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, TIMEOUT, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  fprintf(out, "bad=%llu imports=%llu hits=%llu closes=%llu\n", bad_total,
          (unsigned long long)(st.imports + st.fd_imports), (unsigned long long)st.import_hits,
          (unsigned long long)st.import_closes);
  fflush(out);
  return 0;
}

/* A producer in a pid namespace of its own (pid 1 there): one buffer, the
 * first of this process like every other such producer's, filled with base. */
static int role_ns_producer(tshare_channel *ch, FILE *out, int base) {
  tshare_cuda_buffer *b;
  tshare_error err;
  if (tshare_cuda_buffer_create(0, 1 << 20, &b, &err) != TSHARE_OK) {
    fprintf(out, "error %s\n", err.message);
    return 1;
  }
  share_pattern(ch, b, 4096, 4096, base, 1);
  fprintf(out, "pid=%d\n", (int)getpid());
  fflush(out);
  end_stream(ch);
  tshare_cuda_buffer_release(b);
  return 0;
}

/* Receives one share of VMM memory this end then keeps mapped, queues all
 * that follows (shares of that memory without fds, one id twice, its retire,
 * bye) before importing any, as a busy consumer finds them, then imports
 * them. Reports the views, the refusals and the mappings it closed. */
static int role_held_repeat(tshare_channel *ch, FILE *out) {
  CUstream s;
  CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  char refusal[TSHARE_ERROR_MSG_MAX] = "none";
  int views = 0;
  unsigned long long bad = 0;
  tshare_view *v;
  CHECK_EQ(recv_checked(ch, s, &v), 0);
  views++;
  tshare_view_release(v);
  int rc = TSHARE_OK;
  for (int i = 0; i < 100 && (rc = tshare_channel_poll(ch, TIMEOUT)) != TSHARE_END; i++)
    if (rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT)
      snprintf(refusal, sizeof refusal, "%s", tshare_channel_last_error(ch));
  while ((rc = tshare_view_recv_stream(ch, s, 0, &v)) != TSHARE_END && rc != TSHARE_E_TIMEOUT) {
    if (rc != TSHARE_OK) {
      snprintf(refusal, sizeof refusal, "%s", tshare_channel_last_error(ch));
      continue;
    }
    bad += count_bad_in(v, s);
    views++;
    tshare_view_release(v);
  }
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  fprintf(out, "views=%d bad=%llu closes=%llu refusal=%s\n", views, bad, (unsigned long long)st.import_closes, refusal);
  fflush(out);
  return 0;
}

static int role_main(int argc, char **argv) {
  if (argc < 4) return 2;
  const char *role = argv[2], *arg = argv[3];
  FILE *out = fdopen(4, "w");
  if (strcmp(role, "import_error") != 0) {
    char why[256];
    cu = ck_init(why, sizeof why);
    if (!cu) {
      fprintf(out, "error %s\n", why);
      return 1;
    }
  }
  tshare_channel *ch = open_ch(3, role);
  int rc = 2;
  if (strcmp(role, "checker") == 0) rc = role_checker(arg, ch, out);
  if (strcmp(role, "unordered") == 0) rc = role_unordered(ch, out);
  if (strcmp(role, "hold_and_die") == 0) rc = role_hold_and_die(ch, out, atoi(arg));
  if (strcmp(role, "share_and_die") == 0) rc = role_share_and_die(ch);
  if (strcmp(role, "forwarder") == 0) rc = role_forwarder(ch, out);
  if (strcmp(role, "import_error") == 0) rc = role_import_error(ch, out);
  if (strcmp(role, "busy_releaser") == 0) rc = role_busy_releaser(ch, out, atoi(arg));
  if (strcmp(role, "cache_bounds") == 0) rc = role_cache_bounds(ch, out, atoi(arg));
  if (strcmp(role, "ns_producer") == 0) rc = role_ns_producer(ch, out, atoi(arg));
  if (strcmp(role, "held_repeat") == 0) rc = role_held_repeat(ch, out);
  tshare_channel_close(ch);
  fclose(out);
  return rc;
}

__attribute__((constructor)) static void set_role(void) { ts_role_main = role_main; }

static void parse_checker(const char *line, size_t *views, unsigned long long *bad, unsigned long long *imports,
                          unsigned long long *hits, int *device) {
  if (sscanf(line, "views=%zu bad=%llu imports=%llu hits=%llu device=%d", views, bad, imports, hits, device) != 5)
    TS_FAIL("checker said: %s", line);
}

/* Fill n int32s at offset off of b with base + k*step and share them, tagged
 * so a checker can verify them. */
static void share_pattern(tshare_channel *ch, tshare_cuda_buffer *b, size_t off, int n, int base, int step) {
  CHECK(ck_fill((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(b) + off, (size_t)n, base, step, NULL) == CUDA_SUCCESS);
  tshare_tensor_desc d = vec_i32(n);
  d.byte_offset = off;
  char tag[48];
  snprintf(tag, sizeof tag, "%d %d %d", base, step, n);
  CHECK_RC(tshare_share_cuda_buffer(ch, b, &d, NULL, tag, NULL, TIMEOUT, NULL), TSHARE_OK,
           tshare_channel_last_error(ch));
}

/* Say bye and wait until the peer released everything. */
static void end_stream(tshare_channel *ch) {
  CHECK_RC(tshare_channel_send_bye(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
}

/* ---- tests ------------------------------------------------------------------ */

TS_TEST(has_device) { need_gpu(1); }

/* Many tensors at offsets: slab pieces, and tensors inside one cuMemAlloc
 * segment shared as foreign memory (handle + offset). */
TS_TEST(roundtrip_offsets) {
  need_gpu(1);
  peer c = start_role("checker", "", NULL, -1, -1);
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  tshare_cuda_slab *slab;
  tshare_error err;
  CHECK_RC(tshare_cuda_slab_create(0, 8 << 20, &slab, &err), TSHARE_OK, err.message);
  CUstream s;
  CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  int sent = 0;
  for (int i = 0; i < 48; i++) {
    int n = 1000 + 977 * i;
    tshare_cuda_buffer *b;
    CHECK_RC(tshare_cuda_slab_alloc(slab, (size_t)n * 4, &b), TSHARE_OK, "slab full");
    CHECK(ck_fill((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(b), (size_t)n, i * 1000, 3, s) == CUDA_SUCCESS);
    tshare_tensor_desc d = vec_i32(n);
    char tag[64];
    snprintf(tag, sizeof tag, "%d 3 %d", i * 1000, n);
    CHECK_RC(tshare_share_cuda_buffer(ch, b, &d, s, tag, NULL, TIMEOUT, NULL), TSHARE_OK,
             tshare_channel_last_error(ch));
    tshare_cuda_buffer_release(b); /* the share holds it now */
    sent++;
  }
  /* Foreign memory: one segment, tensors at offsets inside it. */
  CUdeviceptr seg;
  CHECK(cu->cuMemAlloc(&seg, 4 << 20) == CUDA_SUCCESS);
  for (int i = 0; i < 16; i++) {
    size_t off = (size_t)i * 65536 + 512;
    CHECK(ck_fill(seg + off, 4096, -5000 * i, 7, s) == CUDA_SUCCESS);
    tshare_tensor_desc d = vec_i32(4096);
    char tag[64];
    snprintf(tag, sizeof tag, "%d 7 4096", -5000 * i);
    CHECK_RC(tshare_share_cuda(ch, (void *)(uintptr_t)(seg + off), &d, s, tag, NULL, TIMEOUT, NULL), TSHARE_OK,
             tshare_channel_last_error(ch));
    sent++;
  }
  end_stream(ch);
  size_t views;
  unsigned long long bad, imports, hits;
  int device;
  parse_checker(result_line(&c), &views, &bad, &imports, &hits, &device);
  CHECK_EQ(views, sent);
  CHECK_EQ(bad, 0);
  CHECK_EQ(finish(&c), 0);
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  printf("shares %d, exports %llu, handle cache hits %llu, host syncs %llu; consumer imports %llu, hits %llu\n", sent,
         (unsigned long long)st.exports, (unsigned long long)st.cache_hits, (unsigned long long)st.host_syncs, imports,
         hits);
  CHECK_EQ(st.host_syncs, 0); /* every share was ordered by an event */
  tshare_channel_close(ch);
  tshare_cuda_slab_release(slab);
  cu->cuMemFree(seg);
}

/* A long kernel writes the tensor; the share goes out at once, without a
 * host sync. tshare's consumer, on its own stream, sees the data; a consumer
 * that maps the same handle without waiting on the event does not. */
TS_TEST(event_ordering) {
  need_gpu(1);
  const int n = 1 << 20;
  for (int ordered = 1; ordered >= 0; ordered--) {
    peer c = start_role(ordered ? "checker" : "unordered", "", NULL, -1, -1);
    tshare_channel *ch = open_ch(c.channel_fd, "producer");
    tshare_cuda_buffer *b;
    tshare_error err;
    CHECK_RC(tshare_cuda_buffer_create(0, (size_t)n * 4, &b, &err), TSHARE_OK, err.message);
    CUstream s;
    CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    CHECK(ck_spin_fill((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(b), (size_t)n, 11, 5, 700ull * 1000 * 1000, s) ==
          CUDA_SUCCESS);
    tshare_tensor_desc d = vec_i32(n);
    CHECK_RC(tshare_share_cuda_buffer(ch, b, &d, s, "11 5 1048576", NULL, TIMEOUT, NULL), TSHARE_OK,
             tshare_channel_last_error(ch));
    if (ordered) {
      CHECK_RC(tshare_channel_send_bye(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
      size_t views;
      unsigned long long bad, imports, hits;
      int device;
      parse_checker(result_line(&c), &views, &bad, &imports, &hits, &device);
      printf("with tshare's event ordering: %llu of %d elements wrong\n", bad, n);
      CHECK_EQ(views, 1);
      CHECK_EQ(bad, 0);
    } else {
      unsigned long long bad = 0;
      CHECK(sscanf(result_line(&c), "bad=%llu", &bad) == 1);
      printf("without ordering: %llu of %d elements wrong (the kernel had not finished)\n", bad, n);
      CHECK(bad > 0);
    }
    CHECK_EQ(finish(&c), 0);
    cu->cuStreamSynchronize(s);
    tshare_channel_close(ch);
    tshare_cuda_buffer_release(b);
  }
}

/* The import cache: shares of one allocation open it once while views live;
 * an address freed and allocated again maps the new memory. */
TS_TEST(import_cache) {
  need_gpu(1);
  peer c = start_role("checker", "hold-small", NULL, -1, -1);
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  tshare_cuda_slab *slab;
  tshare_error err;
  CHECK_RC(tshare_cuda_slab_create(0, 1 << 20, &slab, &err), TSHARE_OK, err.message);
  for (int i = 0; i < 4; i++) {
    tshare_cuda_buffer *b;
    CHECK_RC(tshare_cuda_slab_alloc(slab, 4096, &b), TSHARE_OK, "slab");
    CHECK(ck_fill((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(b), 1024, i, 1, NULL) == CUDA_SUCCESS);
    tshare_tensor_desc d = vec_i32(1024);
    char tag[32];
    snprintf(tag, sizeof tag, "%d 1 1024", i);
    CHECK_RC(tshare_share_cuda_buffer(ch, b, &d, NULL, tag, NULL, TIMEOUT, NULL), TSHARE_OK,
             tshare_channel_last_error(ch));
    tshare_cuda_buffer_release(b);
  }
  /* Free and reallocate at (most likely) the same address, new contents. */
  CUdeviceptr first, second;
  CHECK(cu->cuMemAlloc(&first, 1 << 20) == CUDA_SUCCESS);
  CHECK(ck_fill(first, 1024, 100, 1, NULL) == CUDA_SUCCESS);
  tshare_tensor_desc d = vec_i32(1024);
  uint64_t id;
  CHECK_RC(tshare_share_cuda(ch, (void *)(uintptr_t)first, &d, NULL, "100 1 1024", NULL, TIMEOUT, &id), TSHARE_OK,
           tshare_channel_last_error(ch));
  /* Freed only once released (the rule for memory tshare does not own); the
   * consumer closed its mapping then, so the next share opens afresh. */
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK(cu->cuMemFree(first) == CUDA_SUCCESS);
  CHECK(cu->cuMemAlloc(&second, 1 << 20) == CUDA_SUCCESS);
  CHECK(ck_fill(second, 1024, 200, 1, NULL) == CUDA_SUCCESS);
  CHECK_RC(tshare_share_cuda(ch, (void *)(uintptr_t)second, &d, NULL, "200 1 1024", NULL, TIMEOUT, NULL), TSHARE_OK,
           tshare_channel_last_error(ch));
  printf("address reused: %s\n", first == second ? "yes" : "no");
  CHECK_RC(tshare_channel_send_bye(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  size_t views;
  unsigned long long bad, imports, hits;
  int device;
  parse_checker(result_line(&c), &views, &bad, &imports, &hits, &device);
  printf("views %zu, imports %llu, cache hits %llu, wrong elements %llu\n", views, imports, hits, bad);
  CHECK_EQ(views, 6);
  CHECK_EQ(bad, 0);
  CHECK_EQ(imports, 3); /* the slab once (four shares), the first and the second allocation */
  CHECK_EQ(hits, 3);
  CHECK_RC(tshare_channel_wait_released(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(finish(&c), 0);
  tshare_channel_close(ch);
  tshare_cuda_slab_release(slab);
  cu->cuMemFree(second);
}

static void count_drop(void *counter) { ++*(int *)counter; }

static long long now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* cudaMalloc memory shared with a drop function (how the LibTorch bridge
 * shares caching-allocator tensors): the consumer keeps the segment mapped
 * between hand-offs because the producer keeps what the last release would
 * have dropped, until the segment was idle a while and the consumer said it
 * closed its mapping. */
TS_TEST(segment_held_while_the_consumer_keeps_it_mapped) {
  need_gpu(1);
  peer c = start_role("checker", "", NULL, -1, -1);
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  CUdeviceptr seg;
  CHECK(cu->cuMemAlloc(&seg, 1 << 20) == CUDA_SUCCESS);
  tshare_tensor_desc d = vec_i32(1024);
  int drops = 0;
  const int rounds = 10;
  for (int i = 0; i < rounds; i++) {
    d.byte_offset = (uint64_t)(i % 4) * 4096;
    CHECK(ck_fill(seg + d.byte_offset, 1024, 10 * i, 1, NULL) == CUDA_SUCCESS);
    char tag[32];
    snprintf(tag, sizeof tag, "%d 1 1024", 10 * i);
    uint64_t id;
    CHECK_RC(tshare_share_cuda_keep(ch, (void *)(uintptr_t)seg, &d, NULL, tag, count_drop, &drops, NULL, TIMEOUT,
                                    &id),
             TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  }
  printf("after %d released hand-offs: %d keeps dropped\n", rounds, drops);
  CHECK_EQ(drops, rounds - 1); /* the last one holds the segment for the consumer's mapping */
  long long t0 = now_ms();
  while (drops < rounds && now_ms() - t0 < 5000) {
    int rc = tshare_channel_poll(ch, 10);
    if (rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT) TS_FAIL("poll: %s", tshare_channel_last_error(ch));
  }
  printf("idle: the last keep dropped %lld ms after the last release\n", now_ms() - t0);
  CHECK_EQ(drops, rounds);
  /* Again, then a close straight after: the close asks the consumer first. */
  CHECK(ck_fill(seg, 1024, 500, 1, NULL) == CUDA_SUCCESS);
  d.byte_offset = 0;
  CHECK_RC(tshare_share_cuda_keep(ch, (void *)(uintptr_t)seg, &d, NULL, "500 1 1024", count_drop, &drops, NULL,
                                  TIMEOUT, NULL),
           TSHARE_OK, tshare_channel_last_error(ch));
  end_stream(ch);
  size_t views;
  unsigned long long bad, imports, hits;
  int device;
  parse_checker(result_line(&c), &views, &bad, &imports, &hits, &device);
  printf("consumer: views %zu, wrong elements %llu, opens %llu, cache hits %llu\n", views, bad, imports, hits);
  CHECK_EQ(views, rounds + 1);
  CHECK_EQ(bad, 0);
  CHECK_EQ(imports, 2); /* once, and once more after the idle retire */
  CHECK_EQ(hits, rounds - 1);
  tshare_channel_close(ch);
  CHECK_EQ(drops, rounds + 1);
  CHECK_EQ(finish(&c), 0);
  cu->cuMemFree(seg);
}

/* The consumer sees the devices in another order: it maps by UUID. With one
 * GPU the consumer names it by UUID in CUDA_VISIBLE_DEVICES. */
TS_TEST(visible_devices_remap) {
  need_gpu(1);
  int count = tshare_cuda_device_count();
  int producer_dev = count >= 2 ? 1 : 0;
  char env_cvd[128];
  if (count >= 2) {
    snprintf(env_cvd, sizeof env_cvd, "CUDA_VISIBLE_DEVICES=1,0");
  } else {
    uint8_t u[16];
    char text[48];
    CHECK(tshare_cuda_device_uuid(0, u) == TSHARE_OK);
    tshare_cuda_uuid_format(u, text, sizeof text);
    snprintf(env_cvd, sizeof env_cvd, "CUDA_VISIBLE_DEVICES=%s", text);
  }
  char *env[] = {env_cvd, NULL};
  peer c = start_role("checker", "", env, -1, -1);
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  tshare_cuda_buffer *b;
  tshare_error err;
  CHECK_RC(tshare_cuda_buffer_create(producer_dev, 1 << 16, &b, &err), TSHARE_OK, err.message);
  CHECK(ts_cuda_push(ts_cuda_primary_ctx(producer_dev)));
  CHECK(ck_fill((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(b), 4096, 42, 2, NULL) == CUDA_SUCCESS);
  tshare_tensor_desc d = vec_i32(4096);
  CHECK_RC(tshare_share_cuda_buffer(ch, b, &d, NULL, "42 2 4096", NULL, TIMEOUT, NULL), TSHARE_OK,
           tshare_channel_last_error(ch));
  ts_cuda_pop();
  CHECK_RC(tshare_channel_send_bye(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  size_t views;
  unsigned long long bad, imports, hits;
  int device;
  parse_checker(result_line(&c), &views, &bad, &imports, &hits, &device);
  printf("producer device %d, consumer (%s) mapped it as its device %d\n", producer_dev, env_cvd, device);
  CHECK_EQ(views, 1);
  CHECK_EQ(bad, 0);
  CHECK_EQ(device, 0); /* the producer's GPU is the consumer's first visible one */
  CHECK_EQ(finish(&c), 0);
  CHECK_RC(tshare_channel_wait_released(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
  tshare_cuda_buffer_release(b);
}

/* A consumer that sees no GPU at all gets a clear error, and the producer gets
 * the share back. */
TS_TEST(device_not_visible) {
  need_gpu(1);
  char *env[] = {(char *)"CUDA_VISIBLE_DEVICES=", NULL};
  peer c = start_role("import_error", "", env, -1, -1);
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  tshare_cuda_buffer *b;
  tshare_error err;
  CHECK_RC(tshare_cuda_buffer_create(0, 4096, &b, &err), TSHARE_OK, err.message);
  tshare_tensor_desc d = vec_i32(1024);
  uint64_t id;
  CHECK_RC(tshare_share_cuda_buffer(ch, b, &d, NULL, "0 0 1024", NULL, TIMEOUT, &id), TSHARE_OK,
           tshare_channel_last_error(ch));
  const char *line = result_line(&c);
  printf("consumer: %s\n", line);
  CHECK(strncmp(line, "TSHARE_E_NO_DEVICE", 18) == 0);
  CHECK(strstr(line, "no CUDA device") != NULL);
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_share_is_released(ch, id), 1);
  CHECK_EQ(finish(&c), 0);
  tshare_channel_close(ch);
  tshare_cuda_buffer_release(b);
}

/* A consumer on another GPU maps the memory through peer access. */
TS_TEST(cross_gpu_peer) {
  need_gpu(2);
  int can = 0;
  CUdevice d0, d1;
  cu->cuDeviceGet(&d0, 0);
  cu->cuDeviceGet(&d1, 1);
  cu->cuDeviceCanAccessPeer(&can, d1, d0);
  peer c = start_role("checker", "dev1", NULL, -1, -1);
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  tshare_cuda_buffer *b;
  tshare_error err;
  CHECK_RC(tshare_cuda_buffer_create(0, 1 << 20, &b, &err), TSHARE_OK, err.message);
  CHECK(ck_fill((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(b), 65536, 9, 9, NULL) == CUDA_SUCCESS);
  tshare_tensor_desc d = vec_i32(65536);
  CHECK_RC(tshare_share_cuda_buffer(ch, b, &d, NULL, "9 9 65536", NULL, TIMEOUT, NULL), TSHARE_OK,
           tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_send_bye(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  const char *line = result_line(&c);
  printf("peer access 1->0: %s; consumer: %s\n", can ? "yes" : "no", line);
  if (can) {
    size_t views;
    unsigned long long bad, imports, hits;
    int device;
    parse_checker(line, &views, &bad, &imports, &hits, &device);
    CHECK_EQ(views, 1);
    CHECK_EQ(bad, 0);
    CHECK_EQ(device, 1);
  } else {
    CHECK(strstr(line, "peer access") != NULL);
  }
  finish(&c);
  tshare_channel_close(ch);
  tshare_cuda_buffer_release(b);
}

/* A consumer killed while holding shares: the producer gets everything back
 * and the GPU memory returns to where it was. */
TS_TEST(consumer_killed_frees_memory) {
  need_gpu(1);
  size_t free0, free1, free2, total;
  CHECK(cu->cuMemGetInfo(&free0, &total) == CUDA_SUCCESS);
  peer c = start_role("hold_and_die", "16", NULL, -1, -1);
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  tshare_cuda_slab *slab;
  tshare_error err;
  CHECK_RC(tshare_cuda_slab_create(0, 256 << 20, &slab, &err), TSHARE_OK, err.message);
  for (int i = 0; i < 16; i++) {
    tshare_cuda_buffer *b;
    CHECK_RC(tshare_cuda_slab_alloc(slab, 8 << 20, &b), TSHARE_OK, "slab");
    tshare_tensor_desc d = vec_i32(2 << 20);
    CHECK_RC(tshare_share_cuda_buffer(ch, b, &d, NULL, "0 0 0", NULL, TIMEOUT, NULL), TSHARE_OK,
             tshare_channel_last_error(ch));
    tshare_cuda_buffer_release(b);
  }
  tshare_cuda_slab_release(slab);
  CHECK(strcmp(result_line(&c), "holding 16") == 0);
  CHECK(cu->cuMemGetInfo(&free1, &total) == CUDA_SUCCESS);
  CHECK_EQ(tshare_channel_outstanding(ch), 16);
  tshare_process_signal(c.proc, SIGKILL);
  CHECK_RC(tshare_channel_wait_released(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  tshare_channel_close(ch); /* drops what the dead peer might have kept mapped */
  CHECK_EQ(finish(&c), 128 + SIGKILL);
  /* The driver tears the dead process's context and mappings down on its own
   * time: give it a few seconds to hand the memory back. */
  for (int i = 0; i < 100; i++) {
    CHECK(cu->cuMemGetInfo(&free2, &total) == CUDA_SUCCESS);
    if (free2 + (8u << 20) >= free0) break;
    usleep(50 * 1000);
  }
  printf("free GPU memory: %zu MiB before, %zu MiB while shared, %zu MiB after the consumer died\n", free0 >> 20,
         free1 >> 20, free2 >> 20);
  CHECK(free1 + (200u << 20) < free0); /* the slab was really allocated */
  CHECK(free2 + (8u << 20) >= free0);  /* and it is back */
}

/* The producer dies after sharing: the consumer gets a clear error, no hang. */
TS_TEST(producer_killed_consumer_errors) {
  need_gpu(1);
  peer p = start_role("share_and_die", "", NULL, -1, -1);
  tshare_channel *ch = open_ch(p.channel_fd, "consumer");
  tshare_view *v = NULL;
  int rc = tshare_view_recv(ch, TIMEOUT, &v);
  if (rc == TSHARE_OK) {
    tshare_view_release(v);
    rc = tshare_view_recv(ch, TIMEOUT, &v);
  }
  printf("after the producer died: %s (%s)\n", tshare_status_name(rc), tshare_channel_last_error(ch));
  CHECK_EQ(rc, TSHARE_E_PEER_CLOSED);
  CHECK_EQ(finish(&p), 9);
  tshare_channel_close(ch);
}

/* A received share goes on to a third process: the original allocation. */
TS_TEST(forward_to_third) {
  need_gpu(1);
  int bc[2];
  tshare_error err;
  CHECK(tshare_socketpair(bc, &err) == TSHARE_OK);
  peer fwd = start_role("forwarder", "", NULL, bc[0], -1);
  peer third = start_role("checker", "hold", NULL, -1, bc[1]);
  close(bc[0]);
  close(bc[1]);
  tshare_channel *ch = open_ch(fwd.channel_fd, "owner");
  tshare_cuda_buffer *b;
  CHECK_RC(tshare_cuda_buffer_create(0, 1 << 20, &b, &err), TSHARE_OK, err.message);
  for (int i = 0; i < 3; i++) share_pattern(ch, b, (size_t)i * 65536, 4096, 1000 * i, 1);
  end_stream(ch);
  size_t views;
  unsigned long long bad, imports, hits;
  int device;
  parse_checker(result_line(&third), &views, &bad, &imports, &hits, &device);
  const char *fl = result_line(&fwd);
  printf("third process: %zu views, %llu wrong, %llu imports; forwarder: %s\n", views, bad, imports, fl);
  CHECK(strcmp(fl, "forwarded=3") == 0);
  CHECK_EQ(views, 3);
  CHECK_EQ(bad, 0);
  CHECK_EQ(imports, 1); /* one allocation, opened once by the third process */
  CHECK_EQ(hits, 2);
  CHECK_EQ(finish(&fwd), 0);
  CHECK_EQ(finish(&third), 0);
  tshare_channel_close(ch);
  tshare_cuda_buffer_release(b);
}

typedef struct pipe_end {
  int rfd, wfd;
  tshare_channel *ch;
} pipe_end;

static void *open_pipe_end(void *arg) {
  pipe_end *e = arg;
  tshare_error err;
  if (tshare_channel_open_pipes(e->rfd, e->wfd, NULL, &e->ch, &err) != TSHARE_OK) e->ch = NULL;
  return NULL;
}

/* Owned buffers travel as fd capabilities (CUDA VMM) where the device can
 * export them; legacy buffers as IPC handles. A pipe refuses an fd buffer
 * with a reason and carries a legacy one. */
TS_TEST(fd_capability_handles) {
  need_gpu(1);
  if (tshare_cuda_fd_handles_supported(0) != 1) TS_SKIP("device 0 cannot export VMM memory as POSIX fds");
  tshare_cuda_export_stats st0, st1;
  tshare_cuda_stats(&st0);
  tshare_cuda_buffer *fdb, *legacy;
  tshare_error err;
  CHECK_RC(tshare_cuda_buffer_create(0, 3u << 20, &fdb, &err), TSHARE_OK, err.message);
  CHECK_RC(tshare_cuda_buffer_create_kind(0, 1u << 20, TSHARE_CUDA_HANDLE_LEGACY, &legacy, &err), TSHARE_OK,
           err.message);
  CHECK_EQ(tshare_cuda_buffer_mem_kind(fdb), TSHARE_MEM_CUDA_FD);
  CHECK_EQ(tshare_cuda_buffer_mem_kind(legacy), TSHARE_MEM_CUDA_IPC);
  CHECK_EQ(tshare_cuda_buffer_size(fdb), 3u << 20);

  peer c = start_role("checker", "", NULL, -1, -1);
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  for (int i = 0; i < 3; i++) share_pattern(ch, fdb, (size_t)i * (1u << 20) + 4096, 8192, 300 * i, 3);
  share_pattern(ch, legacy, 0, 8192, 900, 3);
  end_stream(ch);
  size_t views;
  unsigned long long bad, imports, hits;
  int device;
  parse_checker(result_line(&c), &views, &bad, &imports, &hits, &device);
  CHECK_EQ(finish(&c), 0);
  tshare_channel_close(ch);
  tshare_cuda_stats(&st1);
  printf("fd capability: %zu views, %llu wrong, consumer mappings %llu, hits %llu; fd exports %llu\n", views, bad,
         imports, hits, (unsigned long long)(st1.fd_exports - st0.fd_exports));
  CHECK_EQ(views, 4);
  CHECK_EQ(bad, 0);
  CHECK_EQ(imports, 2); /* the VMM buffer once, the legacy one once */
  CHECK_EQ(hits, 2);
  CHECK_EQ(st1.fd_exports - st0.fd_exports, 1);

  int down[2], up[2];
  CHECK(pipe2(down, O_CLOEXEC) == 0 && pipe2(up, O_CLOEXEC) == 0);
  pipe_end far = {down[0], up[1], NULL};
  pthread_t t;
  CHECK(pthread_create(&t, NULL, open_pipe_end, &far) == 0);
  tshare_channel *pc;
  CHECK_RC(tshare_channel_open_pipes(up[0], down[1], NULL, &pc, &err), TSHARE_OK, err.message);
  pthread_join(t, NULL);
  CHECK(far.ch != NULL);
  tshare_tensor_desc d = vec_i32(16);
  CHECK_EQ(tshare_share_cuda_buffer(pc, fdb, &d, NULL, NULL, NULL, TIMEOUT, NULL), TSHARE_E_UNSUPPORTED);
  printf("fd buffer on a pipe: %s\n", tshare_channel_last_error(pc));
  CHECK(strstr(tshare_channel_last_error(pc), "pipe") != NULL);
  CHECK_RC(tshare_share_cuda_buffer(pc, legacy, &d, NULL, NULL, NULL, TIMEOUT, NULL), TSHARE_OK,
           tshare_channel_last_error(pc));
  tshare_channel_close(pc);
  tshare_channel_close(far.ch);
  tshare_cuda_buffer_release(fdb);
  tshare_cuda_buffer_release(legacy);
}

/* A consumer whose driving thread is busy elsewhere: the releases its worker
 * thread makes still reach the producer (one VMM buffer, one legacy). */
TS_TEST(release_from_a_worker_while_the_receiver_is_busy) {
  need_gpu(1);
  tshare_cuda_buffer *fdb, *legacy;
  tshare_error err;
  CHECK_RC(tshare_cuda_buffer_create(0, 1u << 20, &fdb, &err), TSHARE_OK, err.message);
  CHECK_RC(tshare_cuda_buffer_create_kind(0, 1u << 20, TSHARE_CUDA_HANDLE_LEGACY, &legacy, &err), TSHARE_OK,
           err.message);
  int done[2];
  CHECK(pipe2(done, O_CLOEXEC) == 0);
  peer c = start_role("busy_releaser", "4", NULL, done[0], -1);
  close(done[0]);
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  for (int i = 0; i < 2; i++) share_pattern(ch, fdb, (size_t)i * 65536, 4096, 10 * i, 7);
  for (int i = 0; i < 2; i++) share_pattern(ch, legacy, (size_t)i * 65536, 4096, 50 + 10 * i, 7);
  CHECK_RC(tshare_channel_wait_released(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  CHECK(write(done[1], "x", 1) == 1);
  close(done[1]);
  CHECK_RC(tshare_channel_send_bye(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  const char *line = result_line(&c);
  printf("busy receiver: %s; every release came back while its driving thread waited elsewhere\n", line);
  CHECK(strcmp(line, "views=4 bad=0") == 0);
  CHECK_EQ(finish(&c), 0);
  tshare_channel_close(ch);
  tshare_cuda_buffer_release(fdb);
  tshare_cuda_buffer_release(legacy);
}

/* The consumer holds views into 40 allocations at once, twice, keeping at
 * most 8 idle mappings: the 8 released last serve the second round, the
 * other 32 are closed and opened again. */
TS_TEST(import_cache_keeps_the_most_recent_idle_mappings) {
  need_gpu(1);
  enum { N = 40 };
  tshare_cuda_buffer *bufs[N];
  tshare_error err;
  for (int i = 0; i < N; i++)
    CHECK_RC(tshare_cuda_buffer_create_kind(0, 65536, TSHARE_CUDA_HANDLE_LEGACY, &bufs[i], &err), TSHARE_OK,
             err.message);
  peer c = start_role("cache_bounds", "40", NULL, -1, -1);
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  for (int round = 0; round < 2; round++) {
    for (int i = 0; i < N; i++) share_pattern(ch, bufs[i], 0, 1024, 1000 * round + i, 3);
    CHECK_RC(tshare_channel_wait_released(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  }
  CHECK_RC(tshare_channel_send_bye(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  const char *line = result_line(&c);
  printf("import cache, 2 rounds of %d held allocations, 8 idle kept: %s\n", N, line);
  CHECK(strcmp(line, "bad=0 imports=72 hits=8 closes=64") == 0);
  CHECK_EQ(finish(&c), 0);
  tshare_channel_close(ch);
  for (int i = 0; i < N; i++) tshare_cuda_buffer_release(bufs[i]);
}

TS_TEST(guard_report) {
  need_gpu(1);
  const char *why;
  int on = tshare_cuda_export_guard_active(&why);
  printf("guard=%d %s\n", on, why);
}

/* Two producers in two pid namespaces (containers sharing a socket) both say
 * pid 1 and number their allocations alike: a consumer holding a view from
 * one must map the other's own memory, for fd (VMM) and legacy handles. */
TS_TEST(producers_in_two_pid_namespaces) {
  need_gpu(1);
  if (getuid() != 0) TS_SKIP("needs root for unshare --pid");
  if (access("/usr/bin/unshare", X_OK) != 0) TS_SKIP("needs /usr/bin/unshare (util-linux)");
  char self[4096];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  CHECK(len > 0);
  self[len] = '\0';
  const char *kinds[] = {"TSHARE_CUDA_HANDLES=fd", "TSHARE_CUDA_HANDLES=legacy"};
  for (int k = 0; k < 2; k++) {
    peer prod[2];
    tshare_channel *ch[2];
    for (int i = 0; i < 2; i++) {
      int sv[2], res[2];
      tshare_error err;
      CHECK(tshare_socketpair(sv, &err) == TSHARE_OK && pipe2(res, O_CLOEXEC) == 0);
      char base[16];
      snprintf(base, sizeof base, "%d", 100000 * (i + 1));
      char *argv[] = {"unshare", "--pid", "--fork", "--mount-proc", self, "--role", "ns_producer", base, NULL};
      char *env[] = {(char *)kinds[k], NULL};
      tshare_fd_map fds[2] = {{3, sv[1]}, {4, res[1]}};
      tshare_spawn_options so = {.file = "/usr/bin/unshare", .argv = argv, .env_set = env, .fds = fds, .nfds = 2};
      if (tshare_spawn(&so, &prod[i].proc, &err) != TSHARE_OK) TS_FAIL("spawn: %s", err.message);
      close(sv[1]);
      close(res[1]);
      prod[i].channel_fd = sv[0];
      prod[i].results = fdopen(res[0], "r");
      ch[i] = open_ch(sv[0], "consumer");
      CHECK(strcmp(result_line(&prod[i]), "pid=1") == 0);
      CHECK_EQ(tshare_channel_peer(ch[i])->pid, 1); /* both say so */
    }
    CUstream s;
    CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
    tshare_view *v[2];
    for (int i = 0; i < 2; i++) /* the first is still held when the second arrives */
      CHECK_RC(tshare_view_recv_stream(ch[i], s, TIMEOUT, &v[i]), TSHARE_OK, tshare_channel_last_error(ch[i]));
    for (int i = 0; i < 2; i++) {
      unsigned long long bad = 0;
      CHECK(ck_count_bad((CUdeviceptr)(uintptr_t)tshare_view_data(v[i]), 4096, 100000 * (i + 1), 1, s, &bad) ==
            CUDA_SUCCESS);
      printf("%s: producer %d (pid 1 in its namespace): %llu of 4096 elements wrong\n", kinds[k], i, bad);
      CHECK_EQ(bad, 0);
    }
    for (int i = 0; i < 2; i++) {
      tshare_view_release(v[i]);
      tshare_view *none;
      CHECK_RC(tshare_view_recv(ch[i], TIMEOUT, &none), TSHARE_END, tshare_channel_last_error(ch[i]));
      tshare_channel_close(ch[i]);
      CHECK_EQ(finish(&prod[i]), 0);
    }
    cu->cuStreamDestroy(s);
  }
}

/* VMM memory as another allocator maps it (PyTorch's expandable segments):
 * one chunk, exportable as a POSIX fd. */
typedef struct vmm_block {
  CUdeviceptr ptr;
  size_t size;
  CUmemGenericAllocationHandle handle;
} vmm_block;

static vmm_block vmm_block_create(void) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  vmm_block b = {0, 0, 0};
  CHECK(cu->cuMemGetAllocationGranularity(&b.size, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS);
  CHECK(cu->cuMemCreate(&b.handle, b.size, &prop, 0) == CUDA_SUCCESS);
  CHECK(cu->cuMemAddressReserve(&b.ptr, b.size, 0, 0, 0) == CUDA_SUCCESS);
  CHECK(cu->cuMemMap(b.ptr, b.size, 0, b.handle, 0) == CUDA_SUCCESS);
  CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CHECK(cu->cuMemSetAccess(b.ptr, b.size, &access, 1) == CUDA_SUCCESS);
  return b;
}

static void vmm_block_free(vmm_block *b) {
  CHECK(cu->cuMemUnmap(b->ptr, b->size) == CUDA_SUCCESS);
  CHECK(cu->cuMemRelease(b->handle) == CUDA_SUCCESS);
  CHECK(cu->cuMemAddressFree(b->ptr, b->size) == CUDA_SUCCESS);
}

/* A share of b, which the consumer keeps mapped, named by its id alone (as
 * the producer sends it once the consumer said it keeps it). */
static tshare_frame held_share_frame(const vmm_block *b, uint64_t share_id, const char *tag) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SHARE;
  tshare_share_frame *s = &f.u.share;
  unsigned long long buffer_id = 0; /* a run of one chunk goes by its buffer id */
  CHECK(cu->cuPointerGetAttribute(&buffer_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, b->ptr) == CUDA_SUCCESS);
  s->share_id = share_id;
  s->alloc_id = buffer_id;
  s->mem_kind = TSHARE_MEM_CUDA_HELD;
  s->device_type = TSHARE_DEVICE_CUDA;
  CHECK_EQ(tshare_cuda_device_uuid(0, s->device_uuid), TSHARE_OK);
  s->alloc_size = b->size;
  s->tensor = vec_i32((int64_t)(b->size / 4));
  s->tag_len = (uint8_t)strlen(tag);
  memcpy(s->tag, tag, s->tag_len);
  return f;
}

/* A producer repeats the id of a share of memory the consumer keeps mapped
 * while the first waits to be received: the repeat is refused, and once the
 * memory is retired the consumer closes its mapping (the repeat took no
 * reference that nothing gives back). */
TS_TEST(a_repeated_id_of_a_kept_mapping_share_leaks_no_mapping) {
  need_gpu(1);
  if (tshare_cuda_fd_handles_supported(0) != 1) TS_SKIP("device 0 cannot export VMM memory as POSIX fds");
  vmm_block b = vmm_block_create();
  size_t n = b.size / 4;
  CHECK(ck_fill(b.ptr, n, 7, 1, NULL) == CUDA_SUCCESS && cu->cuCtxSynchronize() == CUDA_SUCCESS);
  char tag[64];
  snprintf(tag, sizeof tag, "7 1 %zu", n);
  peer c = start_role("held_repeat", "", NULL, -1, -1);
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  tshare_tensor_desc d = vec_i32((int64_t)n);
  uint64_t id;
  CHECK_RC(tshare_share_cuda(ch, (void *)(uintptr_t)b.ptr, &d, NULL, tag, NULL, TIMEOUT, &id), TSHARE_OK,
           tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_frame held = held_share_frame(&b, 1000, tag);
  for (int i = 0; i < 2; i++)
    CHECK_RC(tshare_channel_send_frame(ch, &held, -1, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  vmm_block_free(&b); /* its chunk is gone: the producer retires it at its next look */
  for (long long until = now_ms() + 200; now_ms() < until;) {
    tshare_frame f; /* the releases of the hand-made shares are this test's to ignore */
    int fd = -1;
    (void)tshare_channel_recv_frame(ch, &f, &fd, 5);
    if (fd >= 0) close(fd);
  }
  CHECK_RC(tshare_channel_send_bye(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  char *line = result_line(&c);
  printf("consumer: %s\n", line);
  int views = 0;
  unsigned long long bad = 1, closes = 0;
  CHECK(sscanf(line, "views=%d bad=%llu closes=%llu", &views, &bad, &closes) == 3);
  CHECK_EQ(views, 2);
  CHECK_EQ(bad, 0);
  CHECK(strstr(line, "share 1000") && strstr(line, "again"));
  CHECK_EQ(closes, 1);
  CHECK_EQ(finish(&c), 0);
  tshare_channel_close(ch);
}

TS_TEST_MAIN
