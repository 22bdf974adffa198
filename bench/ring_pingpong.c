/* tshare-ring-pingpong: the ring transport's frame round trip beside a raw
 * shared-memory ping-pong between the same two processes, in one run, and
 * frames/s one way. A profiling aid for the ring's fast path (run it under
 * `perf record` / `perf stat`); tshare-bench has the rows that count.
 *
 * One more row takes the peer and the scheduler out: both ends of a ring
 * channel in one thread, each frame waiting in the ring when it is read, so
 * the time is tshare's own work (encode, copy, decode, the atomics and the
 * checks), the part of a round trip a busy or shared machine cannot blur.
 *
 * The same for a whole host-share hand-off of a buffer the consumer already
 * maps (share, import, release, the release applied): the library's part of
 * the bench's "host: share a memfd tensor (buffer reused)" row.
 *
 *   tshare-ring-pingpong [N]   N round trips per row (default 200000)
 *   tshare-ring-pingpong --own N   only the one-thread rows */
#include "bench_stats.h"

#include <tshare/tshare.h>

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define TIMEOUT_MS 10000

static void pause_cpu(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* The raw floor: one word each way, both ends spinning. */
typedef struct raw_pair {
  _Alignas(64) _Atomic uint64_t ping;
  _Alignas(64) _Atomic uint64_t pong;
} raw_pair;

static double raw_round_trip(raw_pair *p, long n, int child) {
  bs_samples ns = {0};
  for (long i = 1; i <= n; i++) {
    if (child) {
      while (atomic_load_explicit(&p->ping, memory_order_acquire) != (uint64_t)i) pause_cpu();
      atomic_store_explicit(&p->pong, (uint64_t)i, memory_order_release);
      continue;
    }
    uint64_t t0 = bs_now_ns();
    atomic_store_explicit(&p->ping, (uint64_t)i, memory_order_release);
    while (atomic_load_explicit(&p->pong, memory_order_acquire) != (uint64_t)i) pause_cpu();
    bs_add(&ns, (double)(bs_now_ns() - t0));
  }
  double p50 = child ? 0 : bs_percentile(&ns, 50) / 1000.0;
  bs_free(&ns);
  return p50;
}

static void share_frame(tshare_frame *f, uint64_t id) {
  memset(f, 0, sizeof *f);
  f->type = TSHARE_FRAME_SHARE;
  f->u.share.share_id = id;
  f->u.share.alloc_id = 1;
  int64_t shape[1] = {1024};
  f->u.share.tensor = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, shape, 0);
  f->u.share.alloc_size = 1u << 20;
  f->u.share.mem_kind = TSHARE_MEM_CUDA_IPC;
  f->u.share.device_type = TSHARE_DEVICE_CUDA;
  f->u.share.handle_len = TSHARE_HANDLE_MAX;
  memset(f->u.share.handle, 0x5a, TSHARE_HANDLE_MAX);
}

static void release_frame(tshare_frame *f, uint64_t id) {
  memset(f, 0, sizeof *f);
  f->type = TSHARE_FRAME_RELEASE;
  f->u.release.count = 1;
  f->u.release.share_ids[0] = id;
}

/* A share frame there, a release frame back: the floor row of tshare-bench. */
static int ring_round_trip(tshare_channel *ch, long n, int child, double *p50) {
  bs_samples ns = {0};
  int rc = TSHARE_OK;
  for (long i = 0; i < n && rc == TSHARE_OK; i++) {
    tshare_frame f;
    int fd = -1;
    if (child) {
      rc = tshare_channel_recv_frame(ch, &f, &fd, TIMEOUT_MS);
      if (rc == TSHARE_OK) {
        release_frame(&f, f.u.share.share_id);
        rc = tshare_channel_send_frame(ch, &f, -1, TIMEOUT_MS);
      }
      continue;
    }
    share_frame(&f, (uint64_t)i + 1);
    uint64_t t0 = bs_now_ns();
    rc = tshare_channel_send_frame(ch, &f, -1, TIMEOUT_MS);
    if (rc == TSHARE_OK) rc = tshare_channel_recv_frame(ch, &f, &fd, TIMEOUT_MS);
    bs_add(&ns, (double)(bs_now_ns() - t0));
  }
  *p50 = child ? 0 : bs_percentile(&ns, 50) / 1000.0;
  bs_free(&ns);
  return rc;
}

/* n share frames one way as fast as they go, one release frame back at the end. */
static int ring_one_way(tshare_channel *ch, long n, int child, double *rate) {
  tshare_frame f;
  int fd = -1, rc = TSHARE_OK;
  uint64_t t0 = bs_now_ns();
  for (long i = 0; i < n && rc == TSHARE_OK; i++) {
    if (child) {
      rc = tshare_channel_recv_frame(ch, &f, &fd, TIMEOUT_MS);
    } else {
      share_frame(&f, (uint64_t)i + 1);
      rc = tshare_channel_send_frame(ch, &f, -1, TIMEOUT_MS);
    }
  }
  if (rc == TSHARE_OK && child) {
    release_frame(&f, 1);
    rc = tshare_channel_send_frame(ch, &f, -1, TIMEOUT_MS);
  } else if (rc == TSHARE_OK) {
    rc = tshare_channel_recv_frame(ch, &f, &fd, TIMEOUT_MS);
  }
  *rate = (double)n / ((double)(bs_now_ns() - t0) / 1e9);
  return rc;
}

typedef struct opener {
  int fd;
  tshare_channel *ch;
} opener;

static void *open_end(void *arg) {
  opener *o = arg;
  tshare_channel_options opts;
  tshare_channel_options_init(&opts);
  opts.transport = TSHARE_TRANSPORT_RING;
  tshare_error err;
  if (tshare_channel_open_socket(o->fd, &opts, &o->ch, &err) != TSHARE_OK) o->ch = NULL;
  return NULL;
}

/* Both ends of one ring channel, opened in this thread and a helper. */
static int open_pair(opener *a, opener *b) {
  int fds[2];
  tshare_error err;
  if (tshare_socketpair(fds, &err) != TSHARE_OK) return -1;
  *a = (opener){fds[0], NULL};
  *b = (opener){fds[1], NULL};
  pthread_t t;
  if (pthread_create(&t, NULL, open_end, b) != 0) return -1;
  open_end(a);
  pthread_join(t, NULL);
  return a->ch && b->ch ? 0 : -1;
}

/* One host-share hand-off with both ends in this thread. */
static int host_handoff(tshare_channel *p, tshare_channel *c, tshare_host_buffer *buf, const tshare_tensor_desc *d) {
  uint64_t id;
  tshare_view *v;
  int rc = tshare_share_host(p, buf, d, NULL, NULL, TIMEOUT_MS, &id);
  if (rc == TSHARE_OK) rc = tshare_view_recv(c, TIMEOUT_MS, &v);
  if (rc != TSHARE_OK) return rc;
  tshare_view_release(v);
  (void)tshare_channel_poll(c, 0);
  return tshare_channel_wait_released(p, id, TIMEOUT_MS);
}

/* The host hand-off's CPU work in ns (the best of five runs of n), or -1. */
static double own_host_ns(long n) {
  opener a = {-1, NULL}, b = {-1, NULL};
  tshare_host_buffer *buf = NULL;
  tshare_error err;
  double best = -1;
  int64_t shape[1] = {1024};
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, shape, 0);
  if (open_pair(&a, &b) == 0 && tshare_host_buffer_create(1u << 20, "pingpong", &buf, &err) == TSHARE_OK) {
    int rc = host_handoff(a.ch, b.ch, buf, &d); /* the first: the memfd travels, the mapping is made */
    for (int run = 0; run < 5 && rc == TSHARE_OK; run++) {
      uint64_t t0 = bs_now_ns();
      for (long i = 0; i < n && rc == TSHARE_OK; i++) rc = host_handoff(a.ch, b.ch, buf, &d);
      double ns = (double)(bs_now_ns() - t0) / (double)n;
      if (best < 0 || ns < best) best = ns;
    }
    if (rc != TSHARE_OK) {
      fprintf(stderr, "tshare-ring-pingpong: host: %s / %s\n", tshare_channel_last_error(a.ch),
              tshare_channel_last_error(b.ch));
      best = -1;
    }
  }
  if (buf) tshare_host_buffer_destroy(buf);
  if (a.ch) tshare_channel_close(a.ch);
  if (b.ch) tshare_channel_close(b.ch);
  return best;
}

/* Both ends in this thread: the round trip's CPU work in ns (the best of
 * five runs of n), or -1. */
static double own_work_ns(long n) {
  opener a = {-1, NULL}, b = {-1, NULL};
  if (open_pair(&a, &b) != 0) {
    if (a.ch) tshare_channel_close(a.ch);
    if (b.ch) tshare_channel_close(b.ch);
    return -1;
  }
  double best = -1;
  for (int run = 0; run < 5 && a.ch && b.ch; run++) {
    int rc = TSHARE_OK, fd = -1;
    uint64_t t0 = bs_now_ns();
    for (long i = 0; i < n && rc == TSHARE_OK; i++) {
      tshare_frame f;
      share_frame(&f, (uint64_t)i + 1);
      rc = tshare_channel_send_frame(a.ch, &f, -1, TIMEOUT_MS);
      if (rc == TSHARE_OK) rc = tshare_channel_recv_frame(b.ch, &f, &fd, TIMEOUT_MS);
      if (rc == TSHARE_OK) {
        release_frame(&f, f.u.share.share_id);
        rc = tshare_channel_send_frame(b.ch, &f, -1, TIMEOUT_MS);
      }
      if (rc == TSHARE_OK) rc = tshare_channel_recv_frame(a.ch, &f, &fd, TIMEOUT_MS);
    }
    double ns = (double)(bs_now_ns() - t0) / (double)n;
    if (rc != TSHARE_OK) {
      fprintf(stderr, "tshare-ring-pingpong: %s\n", tshare_channel_last_error(a.ch));
      break;
    }
    if (best < 0 || ns < best) best = ns;
  }
  if (a.ch) tshare_channel_close(a.ch);
  if (b.ch) tshare_channel_close(b.ch);
  return best;
}

int main(int argc, char **argv) {
  if (argc > 2 && strcmp(argv[1], "--own") == 0) {
    double own = own_work_ns(atol(argv[2])), host = own < 0 ? -1 : own_host_ns(atol(argv[2]));
    if (own < 0 || host < 0) return 1;
    printf("ring frame round trip, one thread  %.3f us of tshare's own work\n", own / 1000.0);
    printf("host share hand-off, one thread    %.3f us of tshare's own work (buffer reused)\n", host / 1000.0);
    return 0;
  }
  long n = argc > 1 ? atol(argv[1]) : 200000;
  if (n <= 0) {
    fprintf(stderr, "usage: tshare-ring-pingpong [round trips]\n");
    return 2;
  }
  raw_pair *raw = mmap(NULL, sizeof *raw, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  int fds[2];
  tshare_error err;
  if (raw == MAP_FAILED || tshare_socketpair(fds, &err) != TSHARE_OK) {
    fprintf(stderr, "tshare-ring-pingpong: setup failed\n");
    return 1;
  }
  pid_t pid = fork();
  if (pid < 0) return 1;
  int child = pid == 0;
  close(fds[child ? 0 : 1]);
  tshare_channel_options opts;
  tshare_channel_options_init(&opts);
  opts.transport = TSHARE_TRANSPORT_RING;
  tshare_channel *ch = NULL;
  if (tshare_channel_open_socket(fds[child ? 1 : 0], &opts, &ch, &err) != TSHARE_OK) {
    fprintf(stderr, "tshare-ring-pingpong: open: %s\n", err.message);
    if (!child) kill(pid, SIGKILL);
    return 1;
  }
  double raw_p50 = raw_round_trip(raw, n, child), ring_p50 = 0, rate = 0;
  int rc = ring_round_trip(ch, n, child, &ring_p50);
  if (rc == TSHARE_OK) rc = ring_one_way(ch, n, child, &rate);
  if (rc != TSHARE_OK) fprintf(stderr, "tshare-ring-pingpong: %s\n", tshare_channel_last_error(ch));
  tshare_channel_close(ch);
  if (child) _exit(rc == TSHARE_OK ? 0 : 1);
  int status = 0;
  waitpid(pid, &status, 0);
  if (rc != TSHARE_OK || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return 1;
  printf("raw shared-memory round trip p50   %.3f us\n", raw_p50);
  printf("ring frame round trip p50          %.3f us (%.2fx raw)\n", ring_p50, ring_p50 / raw_p50);
  printf("ring share frames/s one way        %.0f\n", rate);
  return 0;
}
