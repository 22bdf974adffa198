/* GPU tests: tensor sets of CUDA tensors between real processes. Each test
 * exits 77 with the reason when no CUDA device is usable. The consumer is
 * this binary again (`test_cuda_sets --role NAME`), started with
 * posix_spawn (a CUDA process must not fork).
 *
 * Member i of a set holds int32s (base + i) + k, base read from the set's
 * metadata ("BASE WRITE"): the consumer counts wrong elements on the
 * default stream, which is all a set's ordering promises, and with WRITE 1
 * writes 7777 + 3k over member 0 before it lets go of the set. */
#include "cudakit.h"
#include "harness.h"
#include "tshare/tshare.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TIMEOUT 30000
#define ELEMS 64 /* int32s per member */

static const ts_cuda_api *cu;

static void need_gpu(void) {
  char why[256];
  cu = ck_init(why, sizeof why);
  if (!cu) TS_SKIP("%s", why);
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

static tshare_tensor_desc vec_i32(int64_t n, uint64_t byte_offset) {
  int64_t shape[1] = {n};
  return tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, shape, byte_offset);
}

typedef struct peer {
  tshare_process *proc;
  int channel_fd;
  FILE *results;
} peer;

static peer start_role(const char *role) {
  int sv[2], res[2];
  tshare_error err;
  if (tshare_socketpair(sv, &err) != TSHARE_OK) TS_FAIL("%s", err.message);
  CHECK(pipe2(res, O_CLOEXEC) == 0);
  char *argv[] = {(char *)"/proc/self/exe", (char *)"--role", (char *)role, NULL};
  tshare_fd_map fds[2] = {{3, sv[1]}, {4, res[1]}};
  tshare_spawn_options so = {.file = "/proc/self/exe", .argv = argv, .fds = fds, .nfds = 2};
  peer p;
  if (tshare_spawn(&so, &p.proc, &err) != TSHARE_OK) TS_FAIL("spawn: %s", err.message);
  close(sv[1]);
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

static unsigned long long imports_so_far(void) {
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  return (unsigned long long)(st.imports + st.fd_imports);
}

/* Wrong elements of member i, on the default stream (or in host memory). */
static unsigned long long count_bad_member(const tshare_set *s, size_t i, int base) {
  const tshare_tensor_desc *d = tshare_set_desc(s, i);
  size_t n = (size_t)d->shape[0];
  if (tshare_set_cuda_device(s, i) < 0) return ck_count_bad_host(tshare_set_data(s, i), n, base + (int)i, 1);
  unsigned long long bad = 0;
  CUresult rc = ck_count_bad((CUdeviceptr)(uintptr_t)tshare_set_data(s, i), n, base + (int)i, 1, NULL, &bad);
  if (rc != CUDA_SUCCESS) TS_FAIL("count: %s", ts_cuda_strerror(rc));
  return bad;
}

/* Receive sets until bye; one line each: its tensors, its wrong elements,
 * the mappings it opened, how many lived on the GPU. */
static int role_set_checker(tshare_channel *ch, FILE *out) {
  for (;;) {
    unsigned long long before = imports_so_far();
    tshare_set *s;
    int rc = tshare_set_recv(ch, TIMEOUT, &s);
    if (rc == TSHARE_END) break;
    if (rc == TSHARE_E_PROTOCOL) { /* a set refused (cut off: its producer's send failed): the next one comes */
      fprintf(out, "refused %s\n", tshare_channel_last_error(ch));
      fflush(out);
      continue;
    }
    if (rc != TSHARE_OK) {
      fprintf(out, "error %s %s\n", tshare_status_name(rc), tshare_channel_last_error(ch));
      return 1;
    }
    size_t len, on_gpu = 0;
    const char *meta = tshare_set_meta(s, &len);
    int base = 0, write = 0;
    if (!meta || sscanf(meta, "%d %d", &base, &write) != 2) TS_FAIL("metadata");
    unsigned long long bad = 0;
    for (size_t i = 0; i < tshare_set_count(s); i++) {
      bad += count_bad_member(s, i, base);
      on_gpu += tshare_set_cuda_device(s, i) >= 0;
    }
    if (write) { /* queued on the default stream: the release waits for it */
      const tshare_tensor_desc *d = tshare_set_desc(s, 0);
      CHECK(ck_fill((CUdeviceptr)(uintptr_t)tshare_set_data(s, 0), (size_t)d->shape[0], 7777, 3, NULL) ==
            CUDA_SUCCESS);
    }
    fprintf(out, "tensors=%zu bad=%llu imports=%llu gpu=%zu\n", tshare_set_count(s), bad, imports_so_far() - before,
            on_gpu);
    fflush(out);
    tshare_set_release(s);
  }
  tshare_channel_poll(ch, 100); /* let the releases go out */
  return 0;
}

/* Take one set, say so, and wait to be killed. */
static int role_set_hold_and_die(tshare_channel *ch, FILE *out) {
  tshare_set *s;
  int rc = tshare_set_recv(ch, TIMEOUT, &s);
  fprintf(out, rc == TSHARE_OK ? "holding %zu\n" : "error %zu\n", rc == TSHARE_OK ? tshare_set_count(s) : 0);
  fflush(out);
  for (int i = 0; i < TIMEOUT / 100; i++) usleep(100 * 1000);
  return 1; /* never killed */
}

static int role_main(int argc, char **argv) {
  if (argc < 3) return 2;
  FILE *out = fdopen(4, "w");
  char why[256];
  cu = ck_init(why, sizeof why);
  if (!cu) {
    fprintf(out, "error %s\n", why);
    return 1;
  }
  tshare_channel *ch = open_ch(3, argv[2]);
  int rc = 2;
  if (strcmp(argv[2], "set_checker") == 0) rc = role_set_checker(ch, out);
  if (strcmp(argv[2], "set_hold_and_die") == 0) rc = role_set_hold_and_die(ch, out);
  tshare_channel_close(ch);
  fclose(out);
  return rc;
}

__attribute__((constructor)) static void set_role(void) { ts_role_main = role_main; }

/* ---- the producer's side ---------------------------------------------------- */

typedef struct keep_count {
  int adds, retains, drops;
} keep_count;

static void count_retain(void *k) { __atomic_add_fetch(&((keep_count *)k)->retains, 1, __ATOMIC_SEQ_CST); }
static void count_drop(void *k) { __atomic_add_fetch(&((keep_count *)k)->drops, 1, __ATOMIC_SEQ_CST); }

static void set_meta(tshare_set_builder *b, int base, int write) {
  char meta[32];
  int len = snprintf(meta, sizeof meta, "%d %d", base, write);
  tshare_error err;
  CHECK_RC(tshare_set_builder_set_meta(b, meta, (size_t)len + 1, &err), TSHARE_OK, err.message);
}

/* Members first..first+n-1 at ptr + ELEMS int32s each, filled for base. */
static void add_foreign(tshare_set_builder *b, CUdeviceptr ptr, int first, int n, int base, keep_count *keep) {
  for (int i = 0; i < n; i++) {
    CUdeviceptr at = ptr + (size_t)i * ELEMS * 4;
    CHECK(ck_fill(at, ELEMS, base + first + i, 1, NULL) == CUDA_SUCCESS);
    char name[32];
    snprintf(name, sizeof name, "layer.%d.weight", first + i);
    tshare_tensor_desc d = vec_i32(ELEMS, 0);
    tshare_error err;
    int rc;
    if (keep) {
      keep->adds++;
      rc = tshare_set_builder_add_cuda_keep(b, name, (void *)(uintptr_t)at, &d, count_retain, count_drop, keep, &err);
    } else {
      rc = tshare_set_builder_add_cuda(b, name, (void *)(uintptr_t)at, &d, &err);
    }
    CHECK_RC(rc, TSHARE_OK, err.message);
  }
}

/* VMM memory mapped as another allocator maps it (PyTorch's expandable
 * segments): one granule, exportable as an fd. */
typedef struct vmm_run {
  CUmemGenericAllocationHandle handle;
  CUdeviceptr ptr;
  size_t size;
} vmm_run;

static vmm_run vmm_run_map(void) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  vmm_run r;
  CHECK(cu->cuMemGetAllocationGranularity(&r.size, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) == CUDA_SUCCESS);
  CHECK(cu->cuMemCreate(&r.handle, r.size, &prop, 0) == CUDA_SUCCESS);
  CHECK(cu->cuMemAddressReserve(&r.ptr, r.size, 0, 0, 0) == CUDA_SUCCESS);
  CHECK(cu->cuMemMap(r.ptr, r.size, 0, r.handle, 0) == CUDA_SUCCESS);
  CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CHECK(cu->cuMemSetAccess(r.ptr, r.size, &access, 1) == CUDA_SUCCESS);
  return r;
}

static void vmm_run_unmap(const vmm_run *r) {
  CHECK(cu->cuMemUnmap(r->ptr, r->size) == CUDA_SUCCESS);
  CHECK(cu->cuMemRelease(r->handle) == CUDA_SUCCESS);
  CHECK(cu->cuMemAddressFree(r->ptr, r->size) == CUDA_SUCCESS);
}

/* Members first..first+n-1 in buf, filled for base. */
static void add_in_buffer(tshare_set_builder *b, tshare_cuda_buffer *buf, int first, int n, int base) {
  CUdeviceptr ptr = (CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(buf);
  for (int i = 0; i < n; i++) {
    size_t off = (size_t)i * ELEMS * 4;
    CHECK(ck_fill(ptr + off, ELEMS, base + first + i, 1, NULL) == CUDA_SUCCESS);
    char name[32];
    snprintf(name, sizeof name, "t%d", first + i);
    tshare_tensor_desc d = vec_i32(ELEMS, off);
    tshare_error err;
    CHECK_RC(tshare_set_builder_add_cuda_buffer(b, name, buf, &d, &err), TSHARE_OK, err.message);
  }
}

static void send_and_check(tshare_channel *ch, peer *c, const tshare_set_builder *b, size_t want_gpu,
                           unsigned long long *imports) {
  uint64_t id;
  CHECK_RC(tshare_set_send(ch, b, NULL, TIMEOUT, &id), TSHARE_OK, tshare_channel_last_error(ch));
  size_t tensors, gpu;
  unsigned long long bad, opened;
  const char *line = result_line(c);
  if (sscanf(line, "tensors=%zu bad=%llu imports=%llu gpu=%zu", &tensors, &bad, &opened, &gpu) != 4)
    TS_FAIL("consumer said: %s", line);
  printf("set %llu: %s\n", (unsigned long long)id, line);
  CHECK_EQ(tensors, tshare_set_builder_count(b));
  CHECK_EQ(bad, 0);
  CHECK_EQ(gpu, want_gpu);
  if (imports) *imports = opened;
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
}

static void end_stream(tshare_channel *ch, peer *c) {
  CHECK_RC(tshare_channel_send_bye(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(finish(c), 0);
  tshare_channel_close(ch);
}

/* ---- tests ------------------------------------------------------------------ */

/* 1 tensor (another allocator's), 290 over three segments (the last written
 * by a kernel still running when the set goes: only the set's event orders
 * the consumer after it), 10,000 in one tshare buffer. */
TS_TEST(cuda_sets_of_1_290_and_10000_tensors_round_trip) {
  need_gpu();
  peer c = start_role("set_checker");
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  keep_count keep = {0, 0, 0};
  CUdeviceptr one, seg[3];
  CHECK(cu->cuMemAlloc(&one, 1 << 20) == CUDA_SUCCESS);
  tshare_set_builder *b = tshare_set_builder_create();
  add_foreign(b, one, 0, 1, 10, NULL);
  set_meta(b, 10, 0);
  send_and_check(ch, &c, b, 1, NULL);
  tshare_set_builder_destroy(b);

  b = tshare_set_builder_create();
  for (int k = 0; k < 3; k++) {
    CHECK(cu->cuMemAlloc(&seg[k], 100 * ELEMS * 4) == CUDA_SUCCESS);
    add_foreign(b, seg[k], k * 100, k < 2 ? 100 : 90, 1000, &keep);
  }
  CUstream s;
  CHECK(cu->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS);
  CHECK(ck_spin_fill(seg[2] + 89 * ELEMS * 4, ELEMS, 1000 + 289, 1, 200u * 1000 * 1000, s) == CUDA_SUCCESS);
  tshare_set_builder_set_stream(b, s);
  set_meta(b, 1000, 0);
  send_and_check(ch, &c, b, 290, NULL);
  tshare_set_builder_destroy(b);

  tshare_cuda_buffer *big;
  tshare_error err;
  CHECK_RC(tshare_cuda_buffer_create(0, (size_t)10000 * ELEMS * 4, &big, &err), TSHARE_OK, err.message);
  b = tshare_set_builder_create();
  add_in_buffer(b, big, 0, 10000, 50000);
  set_meta(b, 50000, 0);
  send_and_check(ch, &c, b, 10000, NULL);
  tshare_set_builder_destroy(b);
  tshare_cuda_buffer_release(big);

  end_stream(ch, &c);
  /* Every reference a set took on what keeps its memory alive was let go
   * of, anchors included (the channel is closed). */
  printf("keeps: %d added, %d retained, %d dropped\n", keep.adds, keep.retains, keep.drops);
  CHECK_EQ(keep.adds, 290);
  CHECK_EQ(keep.drops, keep.adds + keep.retains);
  cu->cuStreamDestroy(s);
  cu->cuMemFree(one);
  for (int k = 0; k < 3; k++) cu->cuMemFree(seg[k]);
}

/* The same model sent again: every allocation is mapped already. */
TS_TEST(a_repeated_cuda_set_maps_nothing_new) {
  need_gpu();
  peer c = start_role("set_checker");
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  keep_count keep = {0, 0, 0};
  tshare_cuda_slab *slab;
  tshare_cuda_buffer *piece;
  tshare_error err;
  CHECK_RC(tshare_cuda_slab_create(0, 4 << 20, &slab, &err), TSHARE_OK, err.message);
  CHECK_RC(tshare_cuda_slab_alloc(slab, 200 * ELEMS * 4, &piece), TSHARE_OK, "slab");
  CUdeviceptr seg;
  CHECK(cu->cuMemAlloc(&seg, 90 * ELEMS * 4) == CUDA_SUCCESS);
  tshare_set_builder *b = tshare_set_builder_create();
  add_in_buffer(b, piece, 0, 200, 300);
  add_foreign(b, seg, 200, 90, 300, &keep);
  set_meta(b, 300, 0);
  unsigned long long imports[3];
  for (int round = 0; round < 3; round++) send_and_check(ch, &c, b, 290, &imports[round]);
  printf("mappings opened: %llu, then %llu, then %llu\n", imports[0], imports[1], imports[2]);
  CHECK_EQ(imports[0], 2); /* the slab and the segment, once each */
  CHECK_EQ(imports[1], 0);
  CHECK_EQ(imports[2], 0);
  tshare_set_builder_destroy(b);
  tshare_cuda_buffer_release(piece);
  tshare_cuda_slab_release(slab);
  end_stream(ch, &c);
  CHECK_EQ(keep.drops, keep.adds + keep.retains);
  cu->cuMemFree(seg);
}

/* What the consumer writes through a received tensor is the producer's
 * memory, there once the set came back. */
TS_TEST(writes_through_a_received_cuda_set_reach_the_producer) {
  need_gpu();
  peer c = start_role("set_checker");
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  tshare_cuda_buffer *buf;
  tshare_error err;
  CHECK_RC(tshare_cuda_buffer_create(0, 8 * ELEMS * 4, &buf, &err), TSHARE_OK, err.message);
  tshare_set_builder *b = tshare_set_builder_create();
  add_in_buffer(b, buf, 0, 8, 40);
  set_meta(b, 40, 1);
  send_and_check(ch, &c, b, 8, NULL);
  unsigned long long bad = 0;
  CHECK(ck_count_bad((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(buf), ELEMS, 7777, 3, NULL, &bad) ==
        CUDA_SUCCESS);
  CHECK_EQ(bad, 0);
  tshare_set_builder_destroy(b);
  tshare_cuda_buffer_release(buf);
  end_stream(ch, &c);
}

/* Host memory, a tshare buffer and VMM memory another allocator mapped
 * (its fd travels) in one set. */
TS_TEST(mixed_host_and_cuda_members_in_one_set) {
  need_gpu();
  peer c = start_role("set_checker");
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  tshare_error err;
  tshare_host_buffer *host;
  CHECK_RC(tshare_host_buffer_create(ELEMS * 4, "set-host", &host, &err), TSHARE_OK, err.message);
  int32_t *h = tshare_host_buffer_data(host);
  for (int k = 0; k < ELEMS; k++) h[k] = 500 + k;
  tshare_set_builder *b = tshare_set_builder_create();
  tshare_tensor_desc d = vec_i32(ELEMS, 0);
  CHECK_RC(tshare_set_builder_add_host(b, "host", host, &d, &err), TSHARE_OK, err.message);
  tshare_cuda_buffer *buf;
  CHECK_RC(tshare_cuda_buffer_create(0, ELEMS * 4, &buf, &err), TSHARE_OK, err.message);
  add_in_buffer(b, buf, 1, 1, 500);
  vmm_run r = vmm_run_map();
  CUdeviceptr vmm = r.ptr;
  add_foreign(b, vmm, 2, 2, 500, NULL);
  set_meta(b, 500, 0);
  send_and_check(ch, &c, b, 3, NULL);
  tshare_set_builder_destroy(b);
  tshare_cuda_buffer_release(buf);
  tshare_host_buffer_destroy(host);
  end_stream(ch, &c);
  vmm_run_unmap(&r);
}

/* Sent again: a set of n CUDA tensors at mem[0..n-1] (memory the consumer
 * keeps mapped until retired) and host memory, updated in place and sent 20
 * times. After the first, each goes as one frame from the layout the
 * consumer kept (the producer's log says so: TSHARE_LOG=info, set for this
 * test), and every tensor holds its round's values. */
static void send_again_20_rounds(tshare_channel *ch, peer *c, const CUdeviceptr *mem, int n, keep_count *keep) {
  tshare_error err;
  tshare_host_buffer *host;
  CHECK_RC(tshare_host_buffer_create(ELEMS * 4, "set-again-host", &host, &err), TSHARE_OK, err.message);
  tshare_set_builder *b = tshare_set_builder_create();
  tshare_tensor_desc d = vec_i32(ELEMS, 0);
  CHECK_RC(tshare_set_builder_add_host(b, "host", host, &d, &err), TSHARE_OK, err.message);
  for (int i = 1; i <= n; i++) add_foreign(b, mem[i - 1], i, 1, 0, keep);
  char log_path[] = "/tmp/tshare-set-again-log-XXXXXX";
  int log_fd = mkstemp(log_path), saved_stderr = dup(2);
  CHECK(log_fd >= 0 && saved_stderr >= 0);
  fflush(stderr);
  dup2(log_fd, 2);
  for (int round = 0; round < 20; round++) {
    int base = 1000 * round;
    int32_t *h = tshare_host_buffer_data(host);
    for (int k = 0; k < ELEMS; k++) h[k] = base + k;
    for (int i = 1; i <= n; i++) CHECK(ck_fill(mem[i - 1], ELEMS, base + i, 1, NULL) == CUDA_SUCCESS);
    set_meta(b, base, 0);
    send_and_check(ch, c, b, (size_t)n, NULL);
  }
  fflush(stderr);
  dup2(saved_stderr, 2);
  close(saved_stderr);
  static char text[1 << 20];
  ssize_t got = pread(log_fd, text, sizeof text - 1, 0);
  close(log_fd);
  unlink(log_path);
  text[got > 0 ? got : 0] = '\0';
  int again = 0;
  for (const char *p = text; (p = strstr(p, "again from its layout")) != NULL; p++) again++;
  printf("%d of 20 sets sent again as one frame\n", again);
  CHECK(again >= 18); /* the first goes whole; the consumer's keep notice may come after the second */
  tshare_set_builder_destroy(b);
  tshare_host_buffer_destroy(host);
}

/* VMM memory another allocator mapped (PyTorch's expandable segments). */
TS_TEST(a_cuda_set_sent_again_goes_from_its_kept_layout_with_each_rounds_data) {
  need_gpu();
  peer c = start_role("set_checker");
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  vmm_run r = vmm_run_map();
  CUdeviceptr vmm = r.ptr;
  CUdeviceptr mem[8];
  for (int i = 0; i < 8; i++) mem[i] = vmm + (size_t)i * ELEMS * 4;
  send_again_20_rounds(ch, &c, mem, 8, NULL);
  end_stream(ch, &c);
  vmm_run_unmap(&r);
}

/* A state_dict in expandable segments: each tensor a run of VMM chunks of
 * its own, here 100 (more than a consumer kept mapped before: then such a
 * set went whole every time), each kept alive by a reference the builder
 * holds, which spares its send the driver lookup of every chunk. */
TS_TEST(a_set_of_100_vmm_runs_kept_alive_goes_again_from_its_kept_layout) {
  need_gpu();
  peer c = start_role("set_checker");
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  enum { RUNS = 100 };
  static vmm_run runs[RUNS];
  CUdeviceptr mem[RUNS];
  for (int i = 0; i < RUNS; i++) {
    runs[i] = vmm_run_map();
    mem[i] = runs[i].ptr;
  }
  keep_count keep = {0, 0, 0};
  send_again_20_rounds(ch, &c, mem, RUNS, &keep);
  end_stream(ch, &c);
  CHECK_EQ(keep.adds, RUNS);
  CHECK_EQ(keep.drops, keep.adds + keep.retains);
  for (int i = 0; i < RUNS; i++) vmm_run_unmap(&runs[i]);
}

/* Memory kept alive by a reference may still be mapped anew at its old
 * address (a LibTorch storage resized to nothing and back, the allocator's
 * pages unmapped between): a builder of it sent again must not go from the
 * consumer's kept mapping of the old chunks. Its send fails saying so, and a
 * builder made anew carries the new memory. */
TS_TEST(vmm_memory_mapped_anew_under_a_kept_builder_is_never_read_stale) {
  need_gpu();
  peer c = start_role("set_checker");
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  vmm_run r = vmm_run_map();
  keep_count keep = {0, 0, 0};
  tshare_set_builder *b = tshare_set_builder_create();
  add_foreign(b, r.ptr, 0, 1, 0, &keep); /* member 0 holds base, base + 1, ... */
  for (int round = 0; round < 4; round++) { /* the run kept by the consumer: the set goes again */
    CHECK(ck_fill(r.ptr, ELEMS, 1000 * round, 1, NULL) == CUDA_SUCCESS);
    set_meta(b, 1000 * round, 0);
    send_and_check(ch, &c, b, 1, NULL);
  }
  /* The same address on a new allocation. */
  CUmemGenericAllocationHandle fresh;
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CHECK(cu->cuMemUnmap(r.ptr, r.size) == CUDA_SUCCESS);
  CHECK(cu->cuMemRelease(r.handle) == CUDA_SUCCESS);
  CHECK(cu->cuMemCreate(&fresh, r.size, &prop, 0) == CUDA_SUCCESS);
  CHECK(cu->cuMemMap(r.ptr, r.size, 0, fresh, 0) == CUDA_SUCCESS);
  CUmemAccessDesc access = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CHECK(cu->cuMemSetAccess(r.ptr, r.size, &access, 1) == CUDA_SUCCESS);
  r.handle = fresh;
  CHECK(ck_fill(r.ptr, ELEMS, 9000, 1, NULL) == CUDA_SUCCESS);
  set_meta(b, 9000, 0);
  uint64_t id = 0;
  int rc = tshare_set_send(ch, b, NULL, TIMEOUT, &id);
  printf("sent again after the memory was mapped anew: %s (%s)\n", tshare_status_name(rc),
         rc ? tshare_channel_last_error(ch) : "");
  CHECK_RC(rc, TSHARE_E_STATE, "the send of a builder whose memory was mapped anew");
  CHECK(strstr(tshare_channel_last_error(ch), "mapped anew") != NULL);
  tshare_set_builder_destroy(b);
  b = tshare_set_builder_create();
  add_foreign(b, r.ptr, 0, 1, 9000, &keep);
  set_meta(b, 9000, 0);
  CHECK_RC(tshare_set_send(ch, b, NULL, TIMEOUT, &id), TSHARE_OK, tshare_channel_last_error(ch));
  const char *line = result_line(&c);
  CHECK(strncmp(line, "refused", 7) == 0); /* the set cut off by the failed send */
  line = result_line(&c);
  printf("the set made anew: %s\n", line);
  CHECK(strncmp(line, "tensors=1 bad=0 ", 16) == 0);
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder_destroy(b);
  end_stream(ch, &c);
  CHECK_EQ(keep.drops, keep.adds + keep.retains);
  vmm_run_unmap(&r);
}

/* cudaMalloc segments held by what keeps them alive (PyTorch's default
 * caching allocator: a state_dict of one segment per large tensor): each
 * anchored while sets of it go, so the consumer keeps its IPC mapping and
 * the set goes again as one frame; every keep is let go of at the end. */
TS_TEST(a_set_of_cuda_malloc_segments_sent_again_goes_from_its_kept_layout) {
  need_gpu();
  peer c = start_role("set_checker");
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  CUdeviceptr mem[8];
  for (int i = 0; i < 8; i++) CHECK(cu->cuMemAlloc(&mem[i], ELEMS * 4) == CUDA_SUCCESS);
  keep_count keep = {0, 0, 0};
  send_again_20_rounds(ch, &c, mem, 8, &keep);
  end_stream(ch, &c);
  printf("keeps: %d added, %d retained, %d dropped\n", keep.adds, keep.retains, keep.drops);
  CHECK_EQ(keep.adds, 8);
  CHECK_EQ(keep.drops, keep.adds + keep.retains);
  for (int i = 0; i < 8; i++) cu->cuMemFree(mem[i]);
}

static unsigned long long lookups_so_far(void) {
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  return (unsigned long long)(st.exports + st.cache_hits);
}

/* Members of one cudaMalloc allocation, each kept alive (a module packed into
 * one allocation; a caching-allocator segment's blocks): the allocation is
 * looked up in the driver for the first alone (the first lookup of the
 * process also counts the zeroing guard's probe export, so the count starts
 * after it); another allocation gets its
 * own lookup, and members without a keep are looked up each. The set
 * arrives whole, with one memory per allocation, and every keep goes. */
TS_TEST(members_of_one_allocation_kept_alive_are_looked_up_once) {
  need_gpu();
  peer c = start_role("set_checker");
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  CUdeviceptr one, other, loose;
  CHECK(cu->cuMemAlloc(&one, 64 * ELEMS * 4) == CUDA_SUCCESS);
  CHECK(cu->cuMemAlloc(&other, 2 * ELEMS * 4) == CUDA_SUCCESS);
  CHECK(cu->cuMemAlloc(&loose, 2 * ELEMS * 4) == CUDA_SUCCESS);
  keep_count keep = {0, 0, 0};
  tshare_set_builder *b = tshare_set_builder_create();
  add_foreign(b, one, 0, 1, 0, &keep); /* looked up (and, first in the process, the zeroing probe's export) */
  unsigned long long l0 = lookups_so_far();
  add_foreign(b, one + ELEMS * 4, 1, 63, 0, &keep);
  unsigned long long l1 = lookups_so_far();
  add_foreign(b, other, 64, 2, 0, &keep);
  unsigned long long l2 = lookups_so_far();
  add_foreign(b, loose, 66, 2, 0, NULL);
  unsigned long long l3 = lookups_so_far();
  printf("driver lookups: %llu for 63 members after the first of one allocation, %llu for 2 of another, %llu for 2 "
         "without keeps\n",
         l1 - l0, l2 - l1, l3 - l2);
  CHECK_EQ(l1 - l0, 0);
  CHECK_EQ(l2 - l1, 1);
  CHECK_EQ(l3 - l2, 2);
  set_meta(b, 0, 0);
  unsigned long long opened = 0;
  send_and_check(ch, &c, b, 68, &opened);
  CHECK_EQ(opened, 3); /* one mapping per allocation */
  tshare_set_builder_destroy(b);
  end_stream(ch, &c);
  CHECK_EQ(keep.drops, keep.adds + keep.retains);
  cu->cuMemFree(one);
  cu->cuMemFree(other);
  cu->cuMemFree(loose);
}

/* A consumer killed while it holds a set of 16 x 8 MiB: the set comes back
 * as released, and the memory is the device's again. */
TS_TEST(a_consumer_killed_holding_a_cuda_set_frees_everything) {
  need_gpu();
  size_t free0, free1, free2, total;
  CHECK(cu->cuMemGetInfo(&free0, &total) == CUDA_SUCCESS);
  peer c = start_role("set_hold_and_die");
  tshare_channel *ch = open_ch(c.channel_fd, "producer");
  tshare_cuda_slab *slab;
  tshare_error err;
  CHECK_RC(tshare_cuda_slab_create(0, 256 << 20, &slab, &err), TSHARE_OK, err.message);
  tshare_set_builder *b = tshare_set_builder_create();
  for (int i = 0; i < 16; i++) {
    tshare_cuda_buffer *piece;
    CHECK_RC(tshare_cuda_slab_alloc(slab, 8 << 20, &piece), TSHARE_OK, "slab");
    char name[16];
    snprintf(name, sizeof name, "w%d", i);
    tshare_tensor_desc d = vec_i32(2 << 20, 0);
    CHECK_RC(tshare_set_builder_add_cuda_buffer(b, name, piece, &d, &err), TSHARE_OK, err.message);
    tshare_cuda_buffer_release(piece);
  }
  tshare_cuda_slab_release(slab);
  uint64_t id;
  CHECK_RC(tshare_set_send(ch, b, NULL, TIMEOUT, &id), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder_destroy(b); /* the sent set holds the memory now */
  CHECK(strcmp(result_line(&c), "holding 16") == 0);
  CHECK(cu->cuMemGetInfo(&free1, &total) == CUDA_SUCCESS);
  CHECK_EQ(tshare_channel_outstanding(ch), 1);
  tshare_process_signal(c.proc, SIGKILL);
  CHECK_RC(tshare_channel_wait_released(ch, id, TIMEOUT), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  tshare_channel_close(ch);
  CHECK_EQ(finish(&c), 128 + SIGKILL);
  for (int i = 0; i < 100; i++) {
    CHECK(cu->cuMemGetInfo(&free2, &total) == CUDA_SUCCESS);
    if (free2 + (8u << 20) >= free0) break;
    usleep(50 * 1000);
  }
  printf("free GPU memory: %zu MiB before, %zu MiB while held, %zu MiB after the consumer died\n", free0 >> 20,
         free1 >> 20, free2 >> 20);
  CHECK(free1 + (200u << 20) < free0);
  CHECK(free2 + (8u << 20) >= free0);
}

TS_TEST_MAIN
