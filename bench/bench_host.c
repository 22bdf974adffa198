/* The floors, host-memory hand-offs, the pump and host memory over a long
 * stream. */
#include "bench.h"

#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

/* Low-level share ids of the floor: far from the ids the library hands out. */
#define FLOOR_ID_BASE (1ull << 48)

int bench_ask(bench *b, int peer, char *reply, size_t cap, const char *fmt, ...) {
  char cmd[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  if (bp_send(&b->peers[peer], "%s", cmd) != 0) {
    snprintf(reply, cap, "consumer %d is gone", peer);
    return -1;
  }
  return bp_reply(&b->peers[peer], reply, cap, BENCH_TIMEOUT_MS);
}

br_row *bench_latency_row(bench *b, const char *key, const char *label, bs_samples *ns, const char *floor_key,
                          const char *peer_key) {
  br_row *row = br_add(&b->rep, BR_LATENCY, "latency", key, label, "us");
  row->value = bs_percentile(ns, 50) / 1000.0;
  row->p99 = bs_percentile(ns, 99) / 1000.0;
  row->n = (long)ns->n;
  snprintf(row->floor_key, sizeof row->floor_key, "%s%s", floor_key ? floor_key : "", floor_key ? b->rep.key_suffix : "");
  snprintf(row->peer_key, sizeof row->peer_key, "%s", peer_key ? peer_key : "");
  return row;
}

void bench_breakdown(br_row *row, bs_samples *share_ns, const char *reply) {
  snprintf(row->note, sizeof row->note, "p50 parts: share call %.1f, consumer import %.1f, release %.1f us",
           bs_percentile(share_ns, 50) / 1000.0, bp_field(reply, "import_us"), bp_field(reply, "release_us"));
}

/* ---- the floor: a frame of a share's size there and a release's back ---- */

static void floor_frame(tshare_frame *f, int cuda_sized, uint64_t id) {
  memset(f, 0, sizeof *f);
  f->type = TSHARE_FRAME_SHARE;
  tshare_share_frame *s = &f->u.share;
  s->share_id = id;
  s->alloc_id = 1;
  int64_t shape[1] = {BENCH_SMALL_ELEMS};
  s->tensor = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, shape, 0);
  s->alloc_size = 2u << 20;
  s->origin_pid = (uint32_t)getpid();
  if (cuda_sized) { /* what a CUDA share carries: a handle, a device, an event */
    s->mem_kind = TSHARE_MEM_CUDA_IPC;
    s->device_type = TSHARE_DEVICE_CUDA;
    s->handle_len = TSHARE_HANDLE_MAX;
    memset(s->handle, 0x5a, TSHARE_HANDLE_MAX);
    memset(s->device_uuid, 0xa5, sizeof s->device_uuid);
    f->flags = TSHARE_FRAME_FLAG_HAS_EVENT;
    s->event_generation = (uint32_t)id;
  } else { /* a host share: the memfd travels beside the frame */
    s->mem_kind = TSHARE_MEM_HOST_MEMFD;
    s->device_type = TSHARE_DEVICE_CPU;
    f->flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  }
}

static void floor_row(bench *b, int cuda_sized, const char *key, const char *label) {
  long total = b->opt.warmup + b->opt.iters;
  char reply[512] = "";
  int fd = -1;
  if (!cuda_sized) {
    fd = memfd_create("tshare-bench-floor", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, 4096) != 0) {
      br_skip(&b->rep, BR_LATENCY, "latency", key, label, "memfd_create failed");
      return;
    }
  }
  if (bp_send(&b->peers[0], "floor %ld", total) != 0 || bp_await_ready(&b->peers[0], reply, sizeof reply, BENCH_TIMEOUT_MS) != 0) {
    br_skip(&b->rep, BR_LATENCY, "latency", key, label, reply[0] ? reply : "consumer is gone");
    if (fd >= 0) close(fd);
    return;
  }
  tshare_channel *ch = b->peers[0].ch;
  bs_samples ns = {0}, send_ns = {0};
  int rc = TSHARE_OK;
  for (long i = 0; i < total && rc == TSHARE_OK; i++) {
    tshare_frame f, back;
    floor_frame(&f, cuda_sized, FLOOR_ID_BASE + (uint64_t)i);
    uint64_t t0 = bs_now_ns();
    rc = tshare_channel_send_frame(ch, &f, fd, BENCH_TIMEOUT_MS);
    if (i >= b->opt.warmup) bs_add(&send_ns, (double)(bs_now_ns() - t0));
    int back_fd = -1;
    if (rc == TSHARE_OK) rc = tshare_channel_recv_frame(ch, &back, &back_fd, BENCH_TIMEOUT_MS);
    uint64_t t1 = bs_now_ns();
    if (rc == TSHARE_OK && (back.type != TSHARE_FRAME_RELEASE || back.u.release.share_ids[0] != f.u.share.share_id))
      rc = TSHARE_E_PROTOCOL; /* a release of another frame: the round trips are out of step */
    if (i >= b->opt.warmup) bs_add(&ns, (double)(t1 - t0));
  }
  if (fd >= 0) close(fd);
  if (bp_reply(&b->peers[0], reply, sizeof reply, BENCH_TIMEOUT_MS) != 0 || rc != TSHARE_OK) {
    br_skip(&b->rep, BR_LATENCY, "latency", key, label,
            rc != TSHARE_OK ? tshare_channel_last_error(ch) : reply);
  } else {
    br_row *row = bench_latency_row(b, key, label, &ns, key, NULL);
    snprintf(row->note, sizeof row->note, "no memory behind it: the frame I/O alone (p50 send call %.1f us)",
             bs_percentile(&send_ns, 50) / 1000.0);
  }
  bs_free(&ns);
  bs_free(&send_ns);
}

/* ---- host hand-off ------------------------------------------------------- */

static void host_handoff_row(bench *b) {
  const char *key = "host_reused", *label = "host: share a memfd tensor (buffer reused)";
  tshare_host_buffer *buf = NULL;
  tshare_error err;
  if (tshare_host_buffer_create(1u << 20, "bench", &buf, &err) != TSHARE_OK) {
    br_skip(&b->rep, BR_LATENCY, "latency", key, label, err.message);
    return;
  }
  int64_t shape[1] = {BENCH_SMALL_ELEMS};
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, shape, 0);
  long total = b->opt.warmup + b->opt.iters;
  tshare_channel *ch = b->peers[0].ch;
  char reply[512];
  if (bp_send(&b->peers[0], "recvt %ld", total) != 0) {
    br_skip(&b->rep, BR_LATENCY, "latency", key, label, "consumer is gone");
    tshare_host_buffer_destroy(buf);
    return;
  }
  bs_samples ns = {0}, share_ns = {0};
  int rc = TSHARE_OK;
  for (long i = 0; i < total && rc == TSHARE_OK; i++) {
    uint64_t id, t0 = bs_now_ns();
    rc = tshare_share_host(ch, buf, &d, NULL, NULL, BENCH_TIMEOUT_MS, &id);
    uint64_t ts = bs_now_ns();
    if (rc == TSHARE_OK) rc = tshare_channel_wait_released(ch, id, BENCH_TIMEOUT_MS);
    uint64_t t1 = bs_now_ns();
    if (i >= b->opt.warmup) {
      bs_add(&ns, (double)(t1 - t0));
      bs_add(&share_ns, (double)(ts - t0));
    }
  }
  tshare_host_buffer_destroy(buf);
  if (bp_reply(&b->peers[0], reply, sizeof reply, BENCH_TIMEOUT_MS) != 0 || rc != TSHARE_OK)
    br_skip(&b->rep, BR_LATENCY, "latency", key, label, rc != TSHARE_OK ? tshare_channel_last_error(ch) : reply);
  else
    bench_breakdown(bench_latency_row(b, key, label, &ns, "floor_fd", "torch_mp_cpu"), &share_ns, reply);
  bs_free(&ns);
  bs_free(&share_ns);
}

/* ---- the pump ------------------------------------------------------------ */

typedef struct pump_arg {
  tshare_channel *ch;
  int lane;
  bench_share_fn share;
  void *src;
  long n;
  int window;
  uint64_t share_ns; /* spent in share calls */
  int rc;
  char why[200];
} pump_arg;

static void *pump_one(void *p) {
  pump_arg *a = p;
  long sent = 0;
  int rc = TSHARE_OK;
  while (rc == TSHARE_OK && sent < a->n) {
    while (rc == TSHARE_OK && sent < a->n && tshare_channel_outstanding(a->ch) < (size_t)a->window) {
      uint64_t id, t0 = bs_now_ns();
      rc = a->share(a->ch, a->src, a->lane, &id);
      a->share_ns += bs_now_ns() - t0;
      sent++;
    }
    if (rc == TSHARE_OK) {
      rc = tshare_channel_poll(a->ch, BENCH_TIMEOUT_MS);
    }
  }
  if (rc == TSHARE_OK) rc = tshare_channel_wait_released(a->ch, 0, BENCH_TIMEOUT_MS);
  a->rc = rc;
  if (rc != TSHARE_OK) snprintf(a->why, sizeof a->why, "%s", tshare_channel_last_error(a->ch));
  return NULL;
}

double bench_pump(bench *b, int npeers, bench_share_fn share, void *src, long per_peer, char *why, size_t cap) {
  pump_arg args[BENCH_MAX_CONSUMERS];
  pthread_t threads[BENCH_MAX_CONSUMERS];
  for (int i = 0; i < npeers; i++)
    if (bp_send(&b->peers[i], "recv %ld", per_peer) != 0) {
      snprintf(why, cap, "consumer %d is gone", i);
      return -1;
    }
  uint64_t t0 = bs_now_ns();
  for (int i = 0; i < npeers; i++) {
    args[i] = (pump_arg){.ch = b->peers[i].ch, .lane = i, .share = share, .src = src, .n = per_peer, .window = b->opt.window};
    if (pthread_create(&threads[i], NULL, pump_one, &args[i]) != 0) {
      args[i].rc = TSHARE_E_SYSTEM;
      snprintf(args[i].why, sizeof args[i].why, "pthread_create failed");
      pump_one(&args[i]); /* keep the consumer's count right */
      threads[i] = 0;
    }
  }
  for (int i = 0; i < npeers; i++)
    if (threads[i]) pthread_join(threads[i], NULL);
  uint64_t t1 = bs_now_ns();
  double rate = (double)per_peer * npeers / ((double)(t1 - t0) / 1e9);
  uint64_t share_ns = 0;
  for (int i = 0; i < npeers; i++) share_ns += args[i].share_ns;
  b->pump_share_us = (double)share_ns / (double)(per_peer * npeers) / 1000.0;
  b->pump_busy = (double)share_ns / (double)npeers / (double)(t1 - t0);
  for (int i = 0; i < npeers; i++) {
    char reply[512];
    if (bp_reply(&b->peers[i], reply, sizeof reply, BENCH_TIMEOUT_MS) != 0) {
      snprintf(why, cap, "consumer %d: %s", i, reply);
      rate = -1;
    } else if (args[i].rc != TSHARE_OK) {
      snprintf(why, cap, "%s", args[i].why);
      rate = -1;
    }
  }
  return rate;
}

void bench_pump_note(const bench *b, br_row *row) {
  snprintf(row->note, sizeof row->note, "producer threads spent %.0f%% of the time in share calls, %.2f us each",
           100 * b->pump_busy, b->pump_share_us);
}

static int share_host_small(tshare_channel *ch, void *src, int lane, uint64_t *id) {
  (void)lane;
  int64_t shape[1] = {BENCH_SMALL_ELEMS};
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, shape, 0);
  return tshare_share_host(ch, src, &d, NULL, NULL, BENCH_TIMEOUT_MS, id);
}

void bench_throughput_rows(bench *b, const char *what, bench_share_fn share, void *src, const char *unavailable) {
  static const int counts[] = {1, 4};
  for (size_t k = 0; k < 2; k++) {
    int n = counts[k];
    char key[48], label[80], why[256] = "";
    snprintf(key, sizeof key, "%s_pipelined_%d", what, n);
    snprintf(label, sizeof label, "%s: shares/s to %d consumer%s", what, n, n > 1 ? "s" : "");
    double rate = -1;
    if (unavailable) bs_copy(why, sizeof why, unavailable);
    else if (n > b->npeers) snprintf(why, sizeof why, "not enough consumers");
    else rate = bench_pump(b, n, share, src, b->opt.pipelined, why, sizeof why);
    if (rate < 0) {
      br_skip(&b->rep, BR_VALUE, "throughput", key, label, why);
      continue;
    }
    br_row *row = br_add(&b->rep, BR_VALUE, "throughput", key, label, "shares/s");
    row->value = rate;
    row->n = b->opt.pipelined * n;
    bench_pump_note(b, row);
    if (n > 1) snprintf(row->ratio_key, sizeof row->ratio_key, "%s_pipelined_1", what);
  }
}

static void host_throughput_rows(bench *b) {
  tshare_host_buffer *buf = NULL;
  tshare_error err;
  int have = tshare_host_buffer_create(1u << 20, "bench", &buf, &err) == TSHARE_OK;
  bench_throughput_rows(b, "host", share_host_small, buf, have ? NULL : err.message);
  tshare_host_buffer_destroy(buf);
}

/* ---- memory over a long stream ------------------------------------------- */

typedef struct host_pool {
  tshare_host_buffer *bufs[8];
  unsigned seed;
} host_pool;

/* A random slice of one of several buffers: mappings come and go. */
static int share_host_random(tshare_channel *ch, void *src, int lane, uint64_t *id) {
  (void)lane;
  host_pool *p = src;
  unsigned r = (unsigned)rand_r(&p->seed);
  tshare_host_buffer *buf = p->bufs[r % 8];
  int64_t elems = 1 + (int64_t)((r >> 3) % 16384);
  uint64_t off = (uint64_t)((r >> 17) % 64) * 1024;
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, &elems, off);
  return tshare_share_host(ch, buf, &d, NULL, NULL, BENCH_TIMEOUT_MS, id);
}

br_row *bench_memory_row(bench *b, const char *key, const char *label, double before, double after, const char *unit) {
  br_row *row = br_add(&b->rep, BR_MEMORY, "memory", key, label, unit);
  row->before = before;
  row->value = after;
  row->n = b->opt.memory_shares;
  return row;
}

static void host_memory_rows(bench *b) {
  host_pool pool = {.seed = 12345};
  tshare_error err;
  for (int i = 0; i < 8; i++)
    if (tshare_host_buffer_create(1u << 20, "bench", &pool.bufs[i], &err) != TSHARE_OK) {
      br_skip(&b->rep, BR_MEMORY, "memory", "host_memory", "host: memory", err.message);
      for (int j = 0; j < i; j++) tshare_host_buffer_destroy(pool.bufs[j]);
      return;
    }
  char why[256], before[512], after[512];
  long warm = b->opt.memory_shares / 100 > 1000 ? b->opt.memory_shares / 100 : 1000;
  long fds0 = 0, rss0 = 0;
  int ok = bench_pump(b, 1, share_host_random, &pool, warm, why, sizeof why) >= 0;
  if (ok) {
    fds0 = bs_open_fds();
    rss0 = bs_rss_kib();
    ok = bench_ask(b, 0, before, sizeof before, "stats") == 0;
    if (!ok) bs_copy(why, sizeof why, before);
  }
  double rate = ok ? bench_pump(b, 1, share_host_random, &pool, b->opt.memory_shares, why, sizeof why) : -1;
  long fds1 = bs_open_fds(), rss1 = bs_rss_kib(); /* with the same buffers alive as before */
  if (rate >= 0) {
    ok = bench_ask(b, 0, after, sizeof after, "stats") == 0;
    if (!ok) bs_copy(why, sizeof why, after);
  } else {
    ok = 0;
  }
  for (int i = 0; i < 8; i++) tshare_host_buffer_destroy(pool.bufs[i]);
  if (!ok) {
    br_skip(&b->rep, BR_MEMORY, "memory", "host_memory", "host: memory", why);
    return;
  }
  bench_memory_row(b, "host_producer_fds", "host: producer open fds", (double)fds0, (double)fds1, "");
  bench_memory_row(b, "host_producer_rss", "host: producer RSS", (double)rss0, (double)rss1, "KiB");
  bench_memory_row(b, "host_consumer_fds", "host: consumer open fds", bp_field(before, "fds"), bp_field(after, "fds"),
                   "");
  bench_memory_row(b, "host_consumer_rss", "host: consumer RSS", bp_field(before, "rss_kib"),
                   bp_field(after, "rss_kib"), "KiB");
  bench_memory_row(b, "host_consumer_mappings", "host: consumer mappings", bp_field(before, "host_mappings"),
                   bp_field(after, "host_mappings"), "");
}

void bench_host_handoffs(bench *b, int throughput) {
  floor_row(b, 1, "floor", "floor: frame round trip, a CUDA share's size");
  floor_row(b, 0, "floor_fd", "floor: frame + fd round trip, a host share's size");
  host_handoff_row(b);
  if (throughput) host_throughput_rows(b);
}

void bench_host(bench *b) {
  bench_host_handoffs(b, 1);
  host_memory_rows(b);
}

/* What a consumer blocked in a receive with nothing coming costs: its CPU
 * time over a wait of ms, once its spin budget is spent. */
void bench_idle_row(bench *b, int ms) {
  char reply[256];
  const char *key = "idle_consumer_cpu", *label = "idle consumer: CPU while blocked in a receive";
  if (bench_ask(b, 0, reply, sizeof reply, "idle %d", ms) != 0) {
    br_skip(&b->rep, BR_VALUE, "idle", key, label, reply);
    return;
  }
  br_row *row = br_add(&b->rep, BR_VALUE, "idle", key, label, "% of a core");
  row->value = bp_field(reply, "cpu_pct");
  snprintf(row->note, sizeof row->note, "a %d ms receive with nothing sent: %.0f us of CPU", ms,
           bp_field(reply, "cpu_us"));
}

/* ---- consumer side ------------------------------------------------------- */

static int consume_floor(tshare_channel *ch, long n, char *reply, size_t cap) {
  bp_consumer_ready();
  for (long i = 0; i < n; i++) {
    tshare_frame f;
    int fd = -1;
    int rc = tshare_channel_recv_frame(ch, &f, &fd, BENCH_TIMEOUT_MS);
    if (fd >= 0) close(fd);
    if (rc != TSHARE_OK || f.type != TSHARE_FRAME_SHARE) {
      snprintf(reply, cap, "floor: %s", rc != TSHARE_OK ? tshare_channel_last_error(ch) : "not a share frame");
      return -1;
    }
    tshare_frame back;
    memset(&back, 0, sizeof back);
    back.type = TSHARE_FRAME_RELEASE;
    back.u.release.count = 1;
    back.u.release.share_ids[0] = f.u.share.share_id;
    if ((rc = tshare_channel_send_frame(ch, &back, -1, BENCH_TIMEOUT_MS)) != TSHARE_OK) {
      snprintf(reply, cap, "floor: %s", tshare_channel_last_error(ch));
      return -1;
    }
  }
  return 0;
}

static int consume_views(tshare_channel *ch, long n, char *reply, size_t cap) {
  void *stream = bench_cuda_consumer_stream();
  for (long i = 0; i < n; i++) {
    tshare_view *v;
    int rc = tshare_view_recv_stream(ch, stream, BENCH_TIMEOUT_MS, &v);
    if (rc != TSHARE_OK) {
      snprintf(reply, cap, "recv: %s", tshare_channel_last_error(ch));
      return -1;
    }
    tshare_view_release(v);
  }
  return 0;
}

/* The same one at a time, timing the import (the share is read and decoded
 * first, so neither the wait for it nor the read is in it) and the release
 * with the drive that sends it. */
static int consume_views_timed(tshare_channel *ch, long n, char *reply, size_t cap) {
  void *stream = bench_cuda_consumer_stream();
  bs_samples recv_ns = {0}, release_ns = {0};
  int rc = 0;
  for (long i = 0; i < n && rc == 0; i++) {
    tshare_share_info info;
    int got;
    /* Waits as a blocked receive does (on the ring: spins, then sleeps), so
     * the import timed below starts with the share already here. */
    while ((got = tshare_channel_peek_share(ch, BENCH_TIMEOUT_MS, &info)) == TSHARE_E_TIMEOUT) {
    }
    if (got != TSHARE_OK) {
      snprintf(reply, cap, "recv: %s", tshare_channel_last_error(ch));
      rc = -1;
      break;
    }
    tshare_view *v;
    uint64_t t0 = bs_now_ns();
    if (tshare_view_recv_stream(ch, stream, BENCH_TIMEOUT_MS, &v) != TSHARE_OK) {
      snprintf(reply, cap, "recv: %s", tshare_channel_last_error(ch));
      rc = -1;
      break;
    }
    uint64_t t1 = bs_now_ns();
    tshare_view_release(v);
    (void)tshare_channel_poll(ch, 0);
    uint64_t t2 = bs_now_ns();
    bs_add(&recv_ns, (double)(t1 - t0));
    bs_add(&release_ns, (double)(t2 - t1));
  }
  if (rc == 0)
    snprintf(reply, cap, "import_us=%.2f release_us=%.2f", bs_percentile(&recv_ns, 50) / 1000.0,
             bs_percentile(&release_ns, 50) / 1000.0);
  bs_free(&recv_ns);
  bs_free(&release_ns);
  return rc;
}

/* Mappings of host memory still open: the process's maps naming tshare's memfds. */
static long count_memfd_maps(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return -1;
  char line[512];
  long n = 0;
  while (fgets(line, sizeof line, f))
    if (strstr(line, "/memfd:")) n++;
  fclose(f);
  return n;
}

/* A receive that times out: the CPU it burns while nothing comes. */
static int consume_idle(tshare_channel *ch, long ms, char *reply, size_t cap) {
  struct timespec c0, c1;
  tshare_view *v = NULL;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
  int rc = tshare_view_recv(ch, (int)ms, &v);
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
  if (rc != TSHARE_E_TIMEOUT) {
    if (v) tshare_view_release(v);
    snprintf(reply, cap, "idle: expected a timeout, got %s", tshare_status_name(rc));
    return -1;
  }
  double us = (double)(c1.tv_sec - c0.tv_sec) * 1e6 + (double)(c1.tv_nsec - c0.tv_nsec) / 1e3;
  snprintf(reply, cap, "cpu_us=%.0f cpu_pct=%.3f", us, us / ((double)ms * 1e3) * 100.0);
  return 0;
}

int bench_host_consumer(tshare_channel *ch, const char *cmd, char *reply, size_t cap) {
  long n = 0;
  if (sscanf(cmd, "idle %ld", &n) == 1) return consume_idle(ch, n, reply, cap);
  if (sscanf(cmd, "floor %ld", &n) == 1) return consume_floor(ch, n, reply, cap);
  if (sscanf(cmd, "recv %ld", &n) == 1) return consume_views(ch, n, reply, cap);
  if (sscanf(cmd, "recvt %ld", &n) == 1) return consume_views_timed(ch, n, reply, cap);
  if (strcmp(cmd, "stats") == 0) {
    tshare_cuda_export_stats st;
    tshare_cuda_stats(&st);
    snprintf(reply, cap, "fds=%ld rss_kib=%ld host_mappings=%ld cuda_mappings=%lld events=%llu", bs_open_fds(),
             bs_rss_kib(), count_memfd_maps(), (long long)(st.imports + st.fd_imports - st.import_closes),
             (unsigned long long)st.events);
    return 0;
  }
  return 1;
}
