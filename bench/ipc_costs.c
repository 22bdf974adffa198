/* tshare-ipc-costs: what the driver alone takes to hand a new allocation to
 * another process with legacy CUDA IPC, per segment: the export
 * (cuIpcGetMemHandle the first time), the open and the close on the other
 * side, and whether opens from several threads at once go faster. A new
 * model's first hand-off pays one open per caching-allocator segment it has
 * not seen; this says how far tshare's own work is from that floor.
 *
 *   tshare-ipc-costs [--segments N] [--mib S] [--threads T]
 *
 * The consumer is a forked child (forked before either side touches CUDA).
 * Three rounds of N segments each: opened one at a time, opened from T
 * threads at once, and one at a time again (an order effect shows as a
 * difference between the first and the third). Prints one "result" line per
 * measure; exits 77 without a GPU. */
#include "bench_stats.h"
#include "cuda_driver.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define ROUNDS 3

static double now_us(void) { return (double)bs_now_ns() / 1e3; }

/* The sum of what was added (bs_percentile sorts it; the sum stays). */
static double total(const bs_samples *s) {
  double t = 0;
  for (size_t i = 0; i < s->n; i++) t += s->v[i];
  return t;
}

static int full_write(int fd, const void *p, size_t n) {
  for (size_t off = 0; off < n;) {
    ssize_t w = write(fd, (const char *)p + off, n - off);
    if (w <= 0) return -1;
    off += (size_t)w;
  }
  return 0;
}

static int full_read(int fd, void *p, size_t n) {
  for (size_t off = 0; off < n;) {
    ssize_t r = read(fd, (char *)p + off, n - off);
    if (r <= 0) return -1;
    off += (size_t)r;
  }
  return 0;
}

static const ts_cuda_api *cuda_up(CUcontext *ctx) {
  int status;
  const char *why = NULL;
  const ts_cuda_api *cu = ts_cuda(&status, &why);
  if (!cu) {
    printf("skip: %s\n", why ? why : "no CUDA driver");
    fflush(stdout);
    return NULL;
  }
  *ctx = ts_cuda_primary_ctx(0);
  if (!*ctx || cu->cuCtxPushCurrent(*ctx) != CUDA_SUCCESS) {
    printf("skip: no usable device 0\n");
    fflush(stdout);
    return NULL;
  }
  return cu;
}

typedef struct opener {
  const ts_cuda_api *cu;
  CUcontext ctx;
  CUipcMemHandle *handles;
  CUdeviceptr *mapped;
  int first, count;
  int failed;
} opener;

static void *open_some(void *arg) {
  opener *o = arg;
  if (o->cu->cuCtxPushCurrent(o->ctx) != CUDA_SUCCESS) {
    o->failed = 1;
    return NULL;
  }
  for (int i = o->first; i < o->first + o->count; i++)
    if (o->cu->cuIpcOpenMemHandle(&o->mapped[i], o->handles[i], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS) != CUDA_SUCCESS)
      o->failed = 1;
  CUcontext popped;
  o->cu->cuCtxPopCurrent(&popped);
  return NULL;
}

/* The consumer: reads each round's handles, opens and closes them. */
static int consumer(int from_producer, int to_producer, int n, int threads) {
  CUcontext ctx;
  const ts_cuda_api *cu = cuda_up(&ctx);
  char ok = cu ? 'y' : 'n';
  if (full_write(to_producer, &ok, 1) < 0 || !cu) return cu ? 1 : 77;
  CUipcMemHandle *handles = calloc((size_t)n, sizeof *handles);
  CUdeviceptr *mapped = calloc((size_t)n, sizeof *mapped);
  bs_samples open_us = {0}, close_us = {0};
  if (!handles || !mapped) return 1;
  for (int round = 0; round < ROUNDS; round++) {
    bs_clear(&open_us);
    bs_clear(&close_us);
    if (full_read(from_producer, handles, (size_t)n * sizeof *handles) < 0) return 1;
    int parallel = round == 1 && threads > 1;
    double t0 = now_us();
    if (parallel) {
      pthread_t tid[64];
      opener o[64];
      int per = (n + threads - 1) / threads;
      for (int t = 0; t < threads; t++) {
        int first = t * per, count = first + per > n ? n - first : per;
        o[t] = (opener){cu, ctx, handles, mapped, first, count > 0 ? count : 0, 0};
        if (pthread_create(&tid[t], NULL, open_some, &o[t]) != 0) {
          fprintf(stderr, "ipc_costs: cannot start thread %d\n", t);
          return 1; /* the threads started hold nothing this process needs after it exits */
        }
      }
      for (int t = 0; t < threads; t++) {
        pthread_join(tid[t], NULL);
        if (o[t].failed) {
          fprintf(stderr, "ipc_costs: an open failed in thread %d\n", t);
          return 1;
        }
      }
    } else {
      for (int i = 0; i < n; i++) {
        double a = now_us();
        CUresult rc = cu->cuIpcOpenMemHandle(&mapped[i], handles[i], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
        bs_add(&open_us, now_us() - a);
        if (rc != CUDA_SUCCESS) {
          fprintf(stderr, "ipc_costs: cuIpcOpenMemHandle: %s\n", ts_cuda_strerror(rc));
          return 1;
        }
      }
    }
    double opened = now_us() - t0;
    for (int i = 0; i < n; i++) {
      double a = now_us();
      cu->cuIpcCloseMemHandle(mapped[i]);
      bs_add(&close_us, now_us() - a);
    }
    if (parallel)
      printf("result round=%d open_threads threads=%d total_us=%.1f wall_per_segment_us=%.2f\n", round, threads,
             opened, opened / n);
    else
      printf("result round=%d open_serial p50_us=%.2f total_us=%.1f\n", round, bs_percentile(&open_us, 50), opened);
    printf("result round=%d close p50_us=%.2f total_us=%.1f\n", round, bs_percentile(&close_us, 50),
           total(&close_us));
    fflush(stdout);
    char done = 'd';
    if (full_write(to_producer, &done, 1) < 0) return 1;
  }
  return 0;
}

static int producer(int to_consumer, int from_consumer, int n, size_t bytes) {
  char ok = 0;
  if (full_read(from_consumer, &ok, 1) < 0 || ok != 'y') return 77;
  CUcontext ctx;
  const ts_cuda_api *cu = cuda_up(&ctx);
  if (!cu) return 77;
  CUdeviceptr *ptrs = calloc((size_t)n, sizeof *ptrs);
  CUipcMemHandle *handles = calloc((size_t)n, sizeof *handles);
  bs_samples alloc_us = {0}, export_us = {0}, again_us = {0}, free_us = {0};
  if (!ptrs || !handles) return 1;
  for (int round = 0; round < ROUNDS; round++) {
    bs_clear(&alloc_us);
    bs_clear(&export_us);
    bs_clear(&again_us);
    bs_clear(&free_us);
    for (int i = 0; i < n; i++) {
      double a = now_us();
      CUresult rc = cu->cuMemAlloc(&ptrs[i], bytes);
      bs_add(&alloc_us, now_us() - a);
      if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "ipc_costs: cuMemAlloc of %zu bytes: %s\n", bytes, ts_cuda_strerror(rc));
        return 1;
      }
      cu->cuMemsetD8(ptrs[i], (unsigned char)i, bytes); /* written, as a model's weights are */
    }
    cu->cuCtxSynchronize();
    for (int i = 0; i < n; i++) {
      double a = now_us();
      CUresult rc = cu->cuIpcGetMemHandle(&handles[i], ptrs[i]);
      bs_add(&export_us, now_us() - a);
      if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "ipc_costs: cuIpcGetMemHandle: %s\n", ts_cuda_strerror(rc));
        return 1;
      }
      a = now_us();
      cu->cuIpcGetMemHandle(&handles[i], ptrs[i]);
      bs_add(&again_us, now_us() - a);
    }
    if (full_write(to_consumer, handles, (size_t)n * sizeof *handles) < 0) return 1;
    char done;
    if (full_read(from_consumer, &done, 1) < 0) return 1;
    for (int i = 0; i < n; i++) {
      double a = now_us();
      cu->cuMemFree(ptrs[i]);
      bs_add(&free_us, now_us() - a);
    }
    printf("result round=%d producer alloc p50_us=%.2f export_first p50_us=%.2f total_us=%.1f export_again "
           "p50_us=%.2f free p50_us=%.2f\n",
           round, bs_percentile(&alloc_us, 50), bs_percentile(&export_us, 50), total(&export_us),
           bs_percentile(&again_us, 50), bs_percentile(&free_us, 50));
    fflush(stdout);
  }
  return 0;
}

int main(int argc, char **argv) {
  int n = 64, threads = 4;
  double mib = 20;
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 == argc) {
      fprintf(stderr, "usage: %s [--segments N] [--mib S] [--threads T]\n", argv[0]);
      return 2;
    }
    if (!strcmp(argv[i], "--segments")) n = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--mib")) mib = atof(argv[i + 1]);
    else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
    else {
      fprintf(stderr, "usage: %s [--segments N] [--mib S] [--threads T]\n", argv[0]);
      return 2;
    }
  }
  if (n < 1 || n > 4096 || threads < 1 || threads > 64 || mib <= 0 || mib > 4096) {
    fprintf(stderr, "ipc_costs: --segments 1..4096, --threads 1..64, --mib up to 4096\n");
    return 2;
  }
  size_t bytes = (size_t)(mib * 1024 * 1024);
  printf("ipc costs: %d segments of %.1f MiB per round, %d rounds, %d threads in round 1\n", n, mib, ROUNDS, threads);
  fflush(stdout);
  signal(SIGPIPE, SIG_IGN); /* a consumer that died: a failed write and exit 1, not a signal */
  int down[2], up[2];
  if (pipe(down) < 0 || pipe(up) < 0) return 1;
  pid_t pid = fork();
  if (pid < 0) return 1;
  if (pid == 0) {
    close(down[1]);
    close(up[0]);
    _exit(consumer(down[0], up[1], n, threads));
  }
  close(down[0]);
  close(up[1]);
  int rc = producer(down[1], up[0], n, bytes);
  close(down[1]);
  close(up[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  int child = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
  return rc ? rc : child;
}
