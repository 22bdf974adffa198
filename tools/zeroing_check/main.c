/* tshare-zeroing-check: does this machine's driver zero GPU memory that is
 * exported with cudaIpcGetMemHandle after data was written to it?
 *
 * It spawns a real consumer process and tries each ordering: export before
 * and after the write, writes by copy and by kernel, and a tensor with live
 * neighbours in the same allocation. Each row is checked in the producer
 * (tensor and neighbours, after the export) and in the consumer (through the
 * imported handle). Then tshare's own paths run the same way: an owned buffer,
 * a slab piece, and a guarded export of written memory.
 *
 * Exit codes: 0 not affected; 1 this driver zeroes exported memory (tshare's
 * paths still delivered intact data); 2 could not check (no GPU, an error);
 * 3 a tshare path lost data (a bug: please report it). */
#include "cudakit.h"
#include "tshare/tshare.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define N 1024 /* int32 elements per tensor */
#define TIMEOUT_MS 20000

enum write_kind { BY_COPY, BY_KERNEL };
enum path { RAW_BEFORE, RAW_AFTER, RAW_NEIGHBOURS, TS_OWNED, TS_SLAB, TS_GUARDED };

typedef struct row {
  const char *name;
  enum path path;
  enum write_kind write;
  /* results */
  int producer_ok, neighbours_ok, consumer_ok; /* -1: not applicable */
  int32_t first[2], seen[2];
} row;

static const ts_cuda_api *cu;
static tshare_channel *ch;
static FILE *results;
static int verbose;

__attribute__((format(printf, 2, 3))) static void die(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "tshare-zeroing-check: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  exit(code);
}

/* ---- the consumer ---------------------------------------------------------- */

static int consumer_main(void) {
  char why[256];
  if (!ck_init(why, sizeof why)) {
    fprintf(stderr, "consumer: %s\n", why);
    return 2;
  }
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "zeroing-check-consumer";
  tshare_error err;
  if (tshare_channel_open_socket(3, &o, &ch, &err) != TSHARE_OK) {
    fprintf(stderr, "consumer: %s\n", err.message);
    return 2;
  }
  FILE *out = fdopen(4, "w");
  static int32_t host[N];
  for (;;) {
    tshare_view *v;
    int rc = tshare_view_recv(ch, TIMEOUT_MS, &v);
    if (rc == TSHARE_END) break;
    if (rc != TSHARE_OK) {
      fprintf(out, "error %s\n", tshare_channel_last_error(ch));
      fflush(out);
      return 2;
    }
    int base, step;
    if (sscanf(tshare_view_tag(v), "check %d %d", &base, &step) == 2) {
      /* The view is ordered after the producer's writes; copy and look. */
      CUresult crc = cu->cuMemcpyDtoH(host, (CUdeviceptr)(uintptr_t)tshare_view_data(v), sizeof host);
      if (crc != CUDA_SUCCESS)
        fprintf(out, "error %s\n", ts_cuda_strerror(crc));
      else
        fprintf(out, "%zu %d %d\n", ck_count_bad_host(host, N, base, step), host[0], host[1]);
      fflush(out);
    }
    tshare_view_release(v);
  }
  tshare_channel_close(ch);
  fclose(out);
  return 0;
}

/* ---- the producer ---------------------------------------------------------- */

static int wait_consumer(row *r) {
  char line[512];
  if (!fgets(line, sizeof line, results)) die(2, "the consumer ended early");
  if (strncmp(line, "error", 5) == 0) die(2, "consumer: %s", line);
  size_t bad;
  if (sscanf(line, "%zu %d %d", &bad, &r->seen[0], &r->seen[1]) != 3) die(2, "consumer said: %s", line);
  return bad == 0;
}

static void write_pattern(CUdeviceptr p, enum write_kind w, int base) {
  static int32_t host[N];
  CUresult rc;
  if (w == BY_COPY) {
    for (int i = 0; i < N; i++) host[i] = base + i;
    rc = cu->cuMemcpyHtoD(p, host, sizeof host);
  } else {
    rc = ck_fill(p, N, base, 1, NULL);
    if (rc == CUDA_SUCCESS) rc = cu->cuCtxSynchronize();
  }
  if (rc != CUDA_SUCCESS) die(2, "writing the pattern: %s", ts_cuda_strerror(rc));
}

static int intact(CUdeviceptr p, int base, int32_t first[2]) {
  static int32_t host[N];
  CUresult rc = cu->cuMemcpyDtoH(host, p, sizeof host);
  if (rc != CUDA_SUCCESS) die(2, "reading back: %s", ts_cuda_strerror(rc));
  if (first) {
    first[0] = host[0];
    first[1] = host[1];
  }
  return ck_count_bad_host(host, N, base, 1) == 0;
}

static void share_and_check(row *r, const void *data, tshare_cuda_buffer *buf, int base) {
  int64_t shape[1] = {N};
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, shape, 0);
  char tag[64];
  snprintf(tag, sizeof tag, "check %d 1", base);
  uint64_t id;
  int rc = buf ? tshare_share_cuda_buffer(ch, buf, &d, NULL, tag, NULL, TIMEOUT_MS, &id)
               : tshare_share_cuda(ch, data, &d, NULL, tag, NULL, TIMEOUT_MS, &id);
  if (rc != TSHARE_OK) die(2, "share: %s", tshare_channel_last_error(ch));
  CUdeviceptr p = buf ? (CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(buf) : (CUdeviceptr)(uintptr_t)data;
  r->producer_ok = intact(p, base, r->first);
  r->consumer_ok = wait_consumer(r);
  if (tshare_channel_wait_released(ch, id, TIMEOUT_MS) != TSHARE_OK)
    die(2, "waiting for the release: %s", tshare_channel_last_error(ch));
}

/* Export an allocation before writing: share one element of it and let the
 * consumer drop it unread. tshare keeps the handle, so the real share later
 * does not export again. */
static void export_now(CUdeviceptr p) {
  int64_t shape[1] = {1};
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, shape, 0);
  uint64_t id;
  if (tshare_share_cuda(ch, (void *)(uintptr_t)p, &d, NULL, "skip", NULL, TIMEOUT_MS, &id) != TSHARE_OK ||
      tshare_channel_wait_released(ch, id, TIMEOUT_MS) != TSHARE_OK)
    die(2, "export: %s", tshare_channel_last_error(ch));
}

static void run_row(row *r, int index) {
  int base = (index + 1) * 100000 + 1;
  CUresult rc;
  r->neighbours_ok = -1;
  tshare_cuda_set_export_guard(r->path == TS_GUARDED ? TSHARE_EXPORT_GUARD_ON : TSHARE_EXPORT_GUARD_OFF);
  if (r->path == RAW_BEFORE || r->path == RAW_AFTER || r->path == TS_GUARDED) {
    CUdeviceptr p;
    if ((rc = cu->cuMemAlloc(&p, N * sizeof(int32_t))) != CUDA_SUCCESS) die(2, "cuMemAlloc: %s", ts_cuda_strerror(rc));
    if (r->path == RAW_BEFORE) export_now(p);
    write_pattern(p, r->write, base);
    share_and_check(r, (void *)(uintptr_t)p, NULL, base);
    cu->cuMemFree(p);
  } else if (r->path == RAW_NEIGHBOURS) {
    /* Three tensors in one allocation, as a caching allocator packs them;
     * the middle one is shared, the outer ones are its live neighbours. */
    CUdeviceptr seg;
    size_t bytes = N * sizeof(int32_t);
    if ((rc = cu->cuMemAlloc(&seg, 3 * bytes)) != CUDA_SUCCESS) die(2, "cuMemAlloc: %s", ts_cuda_strerror(rc));
    write_pattern(seg, r->write, base - 50000);
    write_pattern(seg + bytes, r->write, base);
    write_pattern(seg + 2 * bytes, r->write, base + 50000);
    share_and_check(r, (void *)(uintptr_t)(seg + bytes), NULL, base);
    r->neighbours_ok = intact(seg, base - 50000, NULL) && intact(seg + 2 * bytes, base + 50000, NULL);
    cu->cuMemFree(seg);
  } else if (r->path == TS_OWNED) {
    tshare_cuda_buffer *b;
    tshare_error err;
    if (tshare_cuda_buffer_create(0, N * sizeof(int32_t), &b, &err) != TSHARE_OK) die(2, "%s", err.message);
    write_pattern((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(b), r->write, base);
    share_and_check(r, NULL, b, base);
    tshare_cuda_buffer_release(b);
  } else { /* TS_SLAB: two pieces; the second is shared, the first is its neighbour */
    tshare_cuda_slab *s;
    tshare_cuda_buffer *a, *b;
    tshare_error err;
    if (tshare_cuda_slab_create(0, 1 << 20, &s, &err) != TSHARE_OK) die(2, "%s", err.message);
    if (tshare_cuda_slab_alloc(s, N * sizeof(int32_t), &a) != TSHARE_OK ||
        tshare_cuda_slab_alloc(s, N * sizeof(int32_t), &b) != TSHARE_OK)
      die(2, "slab allocation failed");
    write_pattern((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(a), r->write, base - 50000);
    write_pattern((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(b), r->write, base);
    share_and_check(r, NULL, b, base);
    r->neighbours_ok = intact((CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(a), base - 50000, NULL);
    tshare_cuda_buffer_release(a);
    tshare_cuda_buffer_release(b);
    tshare_cuda_slab_release(s);
  }
}

static const char *yes_no(int ok) { return ok < 0 ? "-" : ok ? "intact" : "LOST"; }

static void usage(FILE *f) {
  fprintf(f, "usage: tshare-zeroing-check [-v]\n"
             "Checks whether this machine's NVIDIA driver zeroes GPU memory exported with\n"
             "cudaIpcGetMemHandle after data was written (as Windows/WSL2 drivers do), with a\n"
             "real consumer process, and that tshare's paths deliver intact data either way.\n"
             "Exit: 0 not affected, 1 affected (tshare's paths intact), 2 could not check,\n"
             "3 a tshare path lost data.\n");
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--consumer-role") == 0) {
    char why[256];
    cu = ck_init(why, sizeof why);
    return cu ? consumer_main() : 2;
  }
  int opt;
  static const struct option longopts[] = {{"verbose", no_argument, NULL, 'v'}, {"help", no_argument, NULL, 'h'}, {0}};
  while ((opt = getopt_long(argc, argv, "vh", longopts, NULL)) != -1) {
    if (opt == 'v')
      verbose = 1;
    else if (opt == 'h') {
      usage(stdout);
      return 0;
    } else {
      usage(stderr);
      return 2;
    }
  }
  char why[256];
  cu = ck_init(why, sizeof why);
  if (!cu) {
    printf("tshare-zeroing-check: cannot check: %s\n", why);
    return 2;
  }
  char name[128] = "?";
  uint8_t uuid[16];
  char uuid_text[48] = "?";
  CUdevice dev;
  if (cu->cuDeviceGet(&dev, 0) == CUDA_SUCCESS) cu->cuDeviceGetName(name, sizeof name, dev);
  if (tshare_cuda_device_uuid(0, uuid) == TSHARE_OK) tshare_cuda_uuid_format(uuid, uuid_text, sizeof uuid_text);
  int driver = 0;
  cu->cuDriverGetVersion(&driver);
  FILE *osf = fopen("/proc/sys/kernel/osrelease", "re");
  char kernel[128] = "?";
  if (osf) {
    if (fgets(kernel, sizeof kernel, osf)) kernel[strcspn(kernel, "\n")] = '\0';
    fclose(osf);
  }
  printf("device 0: %s (%s), CUDA driver API %d.%d, kernel %s\n", name, uuid_text, driver / 1000, driver % 1000 / 10,
         kernel);

  int sv[2], res[2];
  tshare_error err;
  if (tshare_socketpair(sv, &err) != TSHARE_OK) die(2, "%s", err.message);
  if (pipe2(res, O_CLOEXEC) != 0) die(2, "pipe: %s", strerror(errno));
  char *cargv[] = {(char *)"/proc/self/exe", (char *)"--consumer-role", NULL};
  tshare_fd_map fds[] = {{3, sv[1]}, {4, res[1]}};
  tshare_spawn_options so = {.file = "/proc/self/exe", .argv = cargv, .fds = fds, .nfds = 2};
  tshare_process *child;
  if (tshare_spawn(&so, &child, &err) != TSHARE_OK) die(2, "starting the consumer: %s", err.message);
  close(sv[1]);
  close(res[1]);
  results = fdopen(res[0], "r");
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "zeroing-check";
  if (tshare_channel_open_socket(sv[0], &o, &ch, &err) != TSHARE_OK) die(2, "channel: %s", err.message);

  row rows[] = {
      {"export before write (raw)", RAW_BEFORE, BY_COPY, 0, 0, 0, {0}, {0}},
      {"export before write (raw)", RAW_BEFORE, BY_KERNEL, 0, 0, 0, {0}, {0}},
      {"export after write (raw)", RAW_AFTER, BY_COPY, 0, 0, 0, {0}, {0}},
      {"export after write (raw)", RAW_AFTER, BY_KERNEL, 0, 0, 0, {0}, {0}},
      {"after write, live neighbours (raw)", RAW_NEIGHBOURS, BY_COPY, 0, 0, 0, {0}, {0}},
      {"tshare owned buffer", TS_OWNED, BY_KERNEL, 0, 0, 0, {0}, {0}},
      {"tshare slab piece + neighbour", TS_SLAB, BY_KERNEL, 0, 0, 0, {0}, {0}},
      {"tshare guarded export", TS_GUARDED, BY_COPY, 0, 0, 0, {0}, {0}},
  };
  size_t nrows = sizeof rows / sizeof rows[0];
  printf("\n%-36s %-7s %-9s %-10s %-9s %s\n", "ordering", "write", "producer", "neighbours", "consumer",
         "first values (producer / consumer)");
  int raw_lost = 0, tshare_lost = 0;
  for (size_t i = 0; i < nrows; i++) {
    row *r = &rows[i];
    run_row(r, (int)i);
    bool ok = r->producer_ok && r->consumer_ok && r->neighbours_ok != 0;
    if (!ok && r->path <= RAW_NEIGHBOURS) raw_lost = 1;
    if (!ok && r->path >= TS_OWNED) tshare_lost = 1;
    printf("%-36s %-7s %-9s %-10s %-9s %d %d / %d %d\n", r->name, r->write == BY_COPY ? "copy" : "kernel",
           yes_no(r->producer_ok), yes_no(r->neighbours_ok), yes_no(r->consumer_ok), r->first[0], r->first[1],
           r->seen[0], r->seen[1]);
    fflush(stdout);
  }
  tshare_channel_send_bye(ch, 0, TIMEOUT_MS);
  tshare_exit_status st;
  tshare_process_wait(child, TIMEOUT_MS, &st);
  tshare_process_destroy(child);
  tshare_channel_close(ch);
  tshare_cuda_export_stats stats;
  tshare_cuda_stats(&stats);
  if (verbose)
    printf("\nexports %llu, guarded %llu, restored %llu\n", (unsigned long long)stats.exports,
           (unsigned long long)stats.guarded, (unsigned long long)stats.restored);
  printf("\n");
  if (tshare_lost) {
    printf("verdict: a tshare path lost data on this machine: this is a tshare bug, please report it\n");
    return 3;
  }
  if (raw_lost) {
    printf("verdict: this driver zeroes exported memory (cudaIpcGetMemHandle after a write loses the data).\n"
           "         tshare's owned buffers, slabs and guarded exports delivered intact data; keep\n"
           "         TSHARE_EXPORT_GUARD at auto or on for memory tshare does not own.\n");
    return 1;
  }
  printf("verdict: not affected: this driver keeps exported memory intact in every ordering\n");
  return 0;
}
