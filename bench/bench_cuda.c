/* CUDA rows: hand-offs through a new allocation, reused allocations and a
 * slab; raw CUDA IPC as the open-cost baseline; pipelined throughput; a
 * consumer kernel's bandwidth on shared vs local memory and vs a copy
 * through host memory; GPU memory over a long stream. */
#include "bench.h"
#include "bench_cuda_profile.h"
#include "cudakit.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const ts_cuda_api *cu;
static CUstream stream; /* this process's stream: the producer's or the consumer's */
static CUstream lanes[BENCH_MAX_CONSUMERS]; /* the producer's per-consumer streams when pipelining */

#define CU_OK(call) ((call) == CUDA_SUCCESS)

static tshare_tensor_desc small_desc(uint64_t offset) {
  int64_t shape[1] = {BENCH_SMALL_ELEMS};
  return tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, shape, offset);
}

int bench_cuda_probe(char *why, size_t cap) {
  if (cu) return 1;
  tshare_error err;
  if (tshare_cuda_init(&err) != TSHARE_OK) {
    snprintf(why, cap, "%s", err.message);
    return 0;
  }
  cu = ck_init(why, cap);
  if (!cu) return 0;
  for (int i = 0; i < BENCH_MAX_CONSUMERS; i++)
    if (!CU_OK(cu->cuStreamCreate(&lanes[i], CU_STREAM_NON_BLOCKING))) {
      snprintf(why, cap, "cuStreamCreate failed");
      cu = NULL;
      return 0;
    }
  stream = lanes[0];
  return 1;
}

void *bench_cuda_consumer_stream(void) { return cu ? (void *)stream : NULL; }

void bench_cuda_describe(char *out, size_t cap) {
  char name[128] = "?";
  int version = 0;
  CUdevice dev;
  if (cu && CU_OK(cu->cuDeviceGet(&dev, 0))) cu->cuDeviceGetName(name, sizeof name, dev);
  if (cu) cu->cuDriverGetVersion(&version);
  char drv[128] = "";
  FILE *f = fopen("/proc/driver/nvidia/version", "r");
  if (f) { /* "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ..." */
    char line[256];
    if (fgets(line, sizeof line, f))
      for (char *tok = strtok(line, " \t"); tok; tok = strtok(NULL, " \t")) {
        unsigned major, minor;
        if (sscanf(tok, "%u.%u", &major, &minor) == 2 && major >= 100) {
          bs_copy(drv, sizeof drv, tok);
          break;
        }
      }
    fclose(f);
  }
  snprintf(out, cap, "%s, driver %s (CUDA %d.%d)", name, drv[0] ? drv : "?", version / 1000, version % 1000 / 10);
}

/* ---- hand-off latency ---------------------------------------------------- */

typedef enum { NEW_ALLOC, REUSED, FOREIGN, SLAB } handoff_kind;

typedef struct handoff_src {
  handoff_kind kind;
  CUdeviceptr foreign[8];       /* FOREIGN: cuMemAlloc'd, as a caching allocator's segments */
  tshare_cuda_buffer *owned[8]; /* REUSED */
  tshare_cuda_slab *slab;
  long i;
} handoff_src;

/* One share of the kind; *buf (owned kinds) is released by the caller once
 * the share is released. */
static int share_once(tshare_channel *ch, handoff_src *s, uint64_t *id, tshare_cuda_buffer **buf) {
  tshare_tensor_desc d = small_desc(0);
  tshare_error err;
  *buf = NULL;
  int rc;
  switch (s->kind) {
  case NEW_ALLOC:
    rc = tshare_cuda_buffer_create(0, BENCH_SMALL_ELEMS * 4, buf, &err);
    break;
  case SLAB:
    rc = tshare_cuda_slab_alloc(s->slab, BENCH_SMALL_ELEMS * 4, buf);
    break;
  case REUSED:
    return tshare_share_cuda_buffer(ch, s->owned[s->i++ % 8], &d, stream, NULL, NULL, BENCH_TIMEOUT_MS, id);
  default:
    return tshare_share_cuda(ch, (void *)(uintptr_t)s->foreign[s->i++ % 8], &d, stream, NULL, NULL, BENCH_TIMEOUT_MS,
                             id);
  }
  if (rc != TSHARE_OK) return rc;
  return tshare_share_cuda_buffer(ch, *buf, &d, stream, NULL, NULL, BENCH_TIMEOUT_MS, id);
}

/* The sources of a kind: 8 allocations, or a slab; false with why if they
 * could not be made (what was made is left for src_close). */
static bool src_open(handoff_src *src, handoff_kind kind, char *why, size_t cap) {
  tshare_error err;
  src->kind = kind;
  for (int i = 0; i < 8; i++) {
    if (kind == FOREIGN && !CU_OK(cu->cuMemAlloc(&src->foreign[i], 64 << 10))) {
      snprintf(why, cap, "cuMemAlloc failed");
      return false;
    }
    if (kind == REUSED && tshare_cuda_buffer_create(0, 64 << 10, &src->owned[i], &err) != TSHARE_OK) {
      bs_copy(why, cap, err.message);
      return false;
    }
  }
  if (kind == SLAB && tshare_cuda_slab_create(0, 64u << 20, &src->slab, &err) != TSHARE_OK) {
    bs_copy(why, cap, err.message);
    return false;
  }
  return true;
}

static void src_close(tshare_channel *ch, handoff_src *src) {
  tshare_channel_wait_released(ch, 0, BENCH_TIMEOUT_MS);
  tshare_channel_poll(ch, 10); /* retire handshakes of what (a) freed */
  for (int i = 0; i < 8; i++) {
    if (src->foreign[i]) cu->cuMemFree(src->foreign[i]);
    tshare_cuda_buffer_release(src->owned[i]);
  }
  tshare_cuda_slab_release(src->slab);
}

/* Warmup and timed hand-offs of src to consumer 0, which answers cmd
 * ("recvt" or "recvp"): each whole and its share call (ns, after the
 * warmup); profiled: the timed share calls' driver calls are counted. The
 * consumer's answer in reply; false with the reason there on failure. */
static bool handoff_loop(bench *b, handoff_src *src, const char *cmd, bool profiled, bs_samples *ns,
                         bs_samples *share_ns, char *reply, size_t cap) {
  long total = b->opt.warmup + b->opt.iters;
  tshare_channel *ch = b->peers[0].ch;
  int rc = bp_send(&b->peers[0], "%s %ld %ld", cmd, total, b->opt.warmup) == 0 ? TSHARE_OK : TSHARE_E_PEER_CLOSED;
  for (long i = 0; i < total && rc == TSHARE_OK; i++) {
    uint64_t id;
    tshare_cuda_buffer *buf;
    bool timed = i >= b->opt.warmup;
    uint64_t t0 = bs_now_ns();
    if (profiled && timed) bc_set_phase(BC_SHARE);
    rc = share_once(ch, src, &id, &buf);
    bc_set_phase(BC_OFF);
    uint64_t ts = bs_now_ns();
    if (rc == TSHARE_OK) rc = tshare_channel_wait_released(ch, id, BENCH_TIMEOUT_MS);
    tshare_cuda_buffer_release(buf);
    uint64_t t1 = bs_now_ns();
    if (timed) {
      bs_add(ns, (double)(t1 - t0));
      bs_add(share_ns, (double)(ts - t0));
    }
  }
  bool ok = bp_reply(&b->peers[0], reply, cap, BENCH_TIMEOUT_MS) == 0 && rc == TSHARE_OK;
  if (!ok && rc != TSHARE_OK) bs_copy(reply, cap, tshare_channel_last_error(ch));
  return ok;
}

/* The phases of the latency rows of (b) and (c), for the profile rows. */
static bench_phases measured[SLAB + 1] = {{NAN, NAN, NAN}, {NAN, NAN, NAN}, {NAN, NAN, NAN}, {NAN, NAN, NAN}};

static void handoff_row(bench *b, handoff_kind kind, const char *key, const char *label) {
  handoff_src src = {.kind = kind};
  char reply[512] = "";
  bs_samples ns = {0}, share_ns = {0};
  if (!src_open(&src, kind, reply, sizeof reply) || !handoff_loop(b, &src, "recvt", false, &ns, &share_ns, reply, sizeof reply)) {
    br_skip(&b->rep, BR_LATENCY, "latency", key, label, reply);
  } else {
    bench_breakdown(bench_latency_row(b, key, label, &ns, "floor", "torch_mp_cuda"), &share_ns, reply);
    measured[kind] = (bench_phases){bs_percentile(&share_ns, 50) / 1000.0, bp_field(reply, "import_us"),
                                    bp_field(reply, "release_us")};
  }
  bs_free(&ns);
  bs_free(&share_ns);
  src_close(b->peers[0].ch, &src);
}

/* The same hand-offs again, the driver calls of each phase counted and
 * timed: what is left of the latency row's phases is tshare's own work. */
static void profile_rows(bench *b, handoff_kind kind, const char *key, const char *label) {
  handoff_src src = {.kind = kind};
  char reply[512] = "", rowkey[48];
  bs_samples ns = {0}, share_ns = {0};
  snprintf(rowkey, sizeof rowkey, "own_%s", key);
  if (!bc_active(cu, reply, sizeof reply)) {
    br_skip(&b->rep, BR_VALUE, "profile", rowkey, label, reply);
    return;
  }
  bc_reset();
  if (!src_open(&src, kind, reply, sizeof reply) || !handoff_loop(b, &src, "recvp", true, &ns, &share_ns, reply, sizeof reply)) {
    br_skip(&b->rep, BR_VALUE, "profile", rowkey, label, reply);
  } else {
    bc_tally share;
    bc_tally_of(BC_SHARE, b->opt.iters, &share);
    bench_cuda_profile_rows(b, key, label, &measured[kind], &share, reply, b->opt.iters);
  }
  bs_free(&ns);
  bs_free(&share_ns);
  src_close(b->peers[0].ch, &src);
}

/* The same hand-off with bare driver calls and a bare frame: what (a) cannot
 * go below. The consumer times its open and close, we our alloc, export and
 * free. Runs on consumer 1, whose channel has carried no CUDA share: no
 * event of the library's comes between these, but a retire of host memory
 * the host rows kept may (the consumer skips it). */
static void raw_ipc_rows(bench *b) {
  const char *key = "raw_ipc", *label = "raw CUDA IPC: alloc, export, frame, open, close, free";
  long total = b->opt.warmup + b->opt.iters;
  bp_peer *peer = &b->peers[b->npeers > 1 ? 1 : 0];
  tshare_channel *ch = peer->ch;
  char reply[512] = "";
  bs_samples ns = {0}, own = {0};
  bool ready = bp_send(peer, "raw %ld", total) == 0 && bp_await_ready(peer, reply, sizeof reply, BENCH_TIMEOUT_MS) == 0;
  int rc = ready ? TSHARE_OK : TSHARE_E_PEER_CLOSED;
  for (long i = 0; i < total && rc == TSHARE_OK; i++) {
    tshare_frame f, back;
    memset(&f, 0, sizeof f);
    f.type = TSHARE_FRAME_SHARE;
    tshare_share_frame *s = &f.u.share;
    s->share_id = (1ull << 50) + (uint64_t)i;
    s->alloc_id = (uint64_t)i + 1;
    s->mem_kind = TSHARE_MEM_CUDA_IPC;
    s->device_type = TSHARE_DEVICE_CUDA;
    s->handle_len = TSHARE_HANDLE_MAX;
    s->tensor = small_desc(0);
    s->alloc_size = BENCH_SMALL_ELEMS * 4;
    uint64_t t0 = bs_now_ns();
    CUdeviceptr p = 0;
    CUipcMemHandle h;
    if (!CU_OK(cu->cuMemAlloc(&p, BENCH_SMALL_ELEMS * 4)) || !CU_OK(cu->cuIpcGetMemHandle(&h, p))) {
      rc = TSHARE_E_CUDA;
      break;
    }
    uint64_t t1 = bs_now_ns();
    memcpy(s->handle, h.reserved, TSHARE_HANDLE_MAX);
    int fd = -1;
    rc = tshare_channel_send_frame(ch, &f, -1, BENCH_TIMEOUT_MS);
    /* Releases of the library's own shares (applied by the receive) may come
     * before the consumer's answer to this frame. */
    bool answered = false;
    while (rc == TSHARE_OK && !answered) {
      rc = tshare_channel_recv_frame(ch, &back, &fd, BENCH_TIMEOUT_MS);
      if (rc == TSHARE_OK && fd >= 0) close(fd);
      if (rc == TSHARE_OK && back.type != TSHARE_FRAME_RELEASE) rc = TSHARE_E_PROTOCOL;
      for (uint32_t k = 0; rc == TSHARE_OK && k < back.u.release.count; k++)
        answered |= back.u.release.share_ids[k] == s->share_id;
    }
    uint64_t t2 = bs_now_ns();
    cu->cuMemFree(p);
    uint64_t t3 = bs_now_ns();
    if (i >= b->opt.warmup) {
      bs_add(&ns, (double)(t3 - t0));
      bs_add(&own, (double)(t1 - t0 + t3 - t2));
    }
  }
  int ok = ready && bp_reply(peer, reply, sizeof reply, BENCH_TIMEOUT_MS) == 0 && rc == TSHARE_OK;
  if (!ok) {
    br_skip(&b->rep, BR_LATENCY, "latency", key, label,
            !ready                  ? (reply[0] ? reply : "consumer is gone")
            : rc == TSHARE_E_CUDA   ? "a driver call failed"
            : rc != TSHARE_OK       ? tshare_channel_last_error(ch)
                                    : reply);
  } else {
    bench_latency_row(b, key, label, &ns, "floor", "torch_mp_cuda");
    /* The open cost of (a): the driver calls alone, medians added. */
    br_row *row = br_add(&b->rep, BR_LATENCY, "latency", "open_cost", "open cost: those driver calls alone (p50s added)",
                         "us");
    row->value = bs_percentile(&own, 50) / 1000.0 + bp_field(reply, "open_us") + bp_field(reply, "close_us");
    row->n = (long)own.n;
    snprintf(row->note, sizeof row->note, "alloc+export+free %.1f us here, open %.1f us and close %.1f us there",
             bs_percentile(&own, 50) / 1000.0, bp_field(reply, "open_us"), bp_field(reply, "close_us"));
  }
  bs_free(&ns);
  bs_free(&own);
}

/* ---- throughput -------------------------------------------------------- */

/* Each thread records on its own stream, as independent producers would. */
static int share_small_buffer(tshare_channel *ch, void *src, int lane, uint64_t *id) {
  tshare_tensor_desc d = small_desc(0);
  return tshare_share_cuda_buffer(ch, src, &d, lanes[lane], NULL, NULL, BENCH_TIMEOUT_MS, id);
}

static void throughput_rows(bench *b) {
  tshare_cuda_buffer *buf = NULL;
  tshare_error err;
  int have = tshare_cuda_buffer_create(0, 1u << 20, &buf, &err) == TSHARE_OK;
  bench_throughput_rows(b, "cuda", share_small_buffer, buf, have ? NULL : err.message);
  tshare_cuda_buffer_release(buf);
  tshare_channel_wait_released(b->peers[0].ch, 0, BENCH_TIMEOUT_MS);
}

/* ---- bandwidth ----------------------------------------------------------- */

static void bandwidth_rows(bench *b) {
  size_t bytes = b->opt.bw_bytes;
  tshare_cuda_buffer *buf = NULL;
  tshare_host_buffer *host = NULL;
  tshare_error err;
  tshare_channel *ch = b->peers[0].ch;
  char why[512] = "", reply[512] = "";
  double gib = (double)bytes / (1u << 30);
  char what[16];
  snprintf(what, sizeof what, "%.3g GiB", gib > 999 ? 999 : gib);
  int ok = tshare_cuda_buffer_create(0, bytes, &buf, &err) == TSHARE_OK;
  if (!ok) bs_copy(why, sizeof why, err.message);
  CUdeviceptr p = ok ? (CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(buf) : 0;
  if (ok && !(CU_OK(ck_fill(p, bytes / 4, 7, 3, stream)) && CU_OK(cu->cuStreamSynchronize(stream)))) {
    ok = 0;
    snprintf(why, sizeof why, "filling the tensor failed");
  }
  int64_t n32 = (int64_t)(bytes / 4);
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, &n32, 0);
  const int reps = 10;
  /* 1. the consumer's kernel on the shared tensor and on a local copy */
  if (ok && bp_send(&b->peers[0], "bw %d", reps) == 0) {
    uint64_t id;
    int rc = tshare_share_cuda_buffer(ch, buf, &d, stream, NULL, NULL, BENCH_TIMEOUT_MS, &id);
    if (rc == TSHARE_OK) rc = tshare_channel_wait_released(ch, id, BENCH_TIMEOUT_MS);
    ok = bp_reply(&b->peers[0], reply, sizeof reply, BENCH_TIMEOUT_MS) == 0 && rc == TSHARE_OK;
    if (!ok) bs_copy(why, sizeof why, rc != TSHARE_OK ? tshare_channel_last_error(ch) : reply);
  }
  if (ok) {
    br_row *local = br_add(&b->rep, BR_VALUE, "bandwidth", "bw_local", "", "GB/s");
    snprintf(local->label, sizeof local->label, "consumer kernel reads %s, local allocation", what);
    local->value = bp_field(reply, "local_gbs");
    local->n = reps;
    br_row *shared = br_add(&b->rep, BR_VALUE, "bandwidth", "bw_shared", "", "GB/s");
    snprintf(shared->label, sizeof shared->label, "consumer kernel reads %s, tshare zero copy", what);
    shared->value = bp_field(reply, "shared_gbs");
    shared->n = reps;
    snprintf(shared->ratio_key, sizeof shared->ratio_key, "bw_local");
    snprintf(shared->note, sizeof shared->note, "the same sum on both: %s",
             bp_field(reply, "same") == 1 ? "yes" : "NO");
  } else {
    br_skip(&b->rep, BR_VALUE, "bandwidth", "bw_shared", "consumer kernel, shared vs local", why);
  }
  /* 2. a whole hand-off ending in that read: zero copy vs through host memory */
  const int trips = 3;
  bs_samples zc = {0}, naive = {0};
  if (ok && bp_send(&b->peers[0], "zc %d", trips) == 0) {
    int rc = TSHARE_OK;
    for (int i = 0; i < trips && rc == TSHARE_OK; i++) {
      uint64_t id, t0 = bs_now_ns();
      rc = tshare_share_cuda_buffer(ch, buf, &d, stream, NULL, NULL, BENCH_TIMEOUT_MS, &id);
      if (rc == TSHARE_OK) rc = tshare_channel_wait_released(ch, id, BENCH_TIMEOUT_MS);
      bs_add(&zc, (double)(bs_now_ns() - t0));
    }
    ok = bp_reply(&b->peers[0], reply, sizeof reply, BENCH_TIMEOUT_MS) == 0 && rc == TSHARE_OK;
    if (!ok) bs_copy(why, sizeof why, rc != TSHARE_OK ? tshare_channel_last_error(ch) : reply);
  }
  if (ok && tshare_host_buffer_create(bytes, "bench-staging", &host, &err) != TSHARE_OK) {
    ok = 0;
    bs_copy(why, sizeof why, err.message);
  }
  if (ok && bp_send(&b->peers[0], "naive %d %zu", trips, bytes) == 0) {
    int rc = TSHARE_OK;
    for (int i = 0; i < trips && rc == TSHARE_OK; i++) {
      uint64_t id, t0 = bs_now_ns();
      if (!CU_OK(cu->cuMemcpyDtoH(tshare_host_buffer_data(host), p, bytes))) rc = TSHARE_E_CUDA;
      if (rc == TSHARE_OK) rc = tshare_share_host(ch, host, &d, NULL, NULL, BENCH_TIMEOUT_MS, &id);
      if (rc == TSHARE_OK) rc = tshare_channel_wait_released(ch, id, BENCH_TIMEOUT_MS);
      bs_add(&naive, (double)(bs_now_ns() - t0));
    }
    ok = bp_reply(&b->peers[0], reply, sizeof reply, BENCH_TIMEOUT_MS) == 0 && rc == TSHARE_OK;
    if (!ok) bs_copy(why, sizeof why, rc != TSHARE_OK ? tshare_channel_last_error(ch) : reply);
  }
  if (ok) {
    br_row *z = br_add(&b->rep, BR_VALUE, "bandwidth", "handoff_zero_copy", "", "ms");
    snprintf(z->label, sizeof z->label, "hand %s over + consumer reads it: tshare", what);
    z->value = bs_percentile(&zc, 50) / 1e6;
    z->n = trips;
    br_row *h = br_add(&b->rep, BR_VALUE, "bandwidth", "handoff_via_host", "", "ms");
    snprintf(h->label, sizeof h->label, "the same through host memory (D2H, memfd, H2D)");
    h->value = bs_percentile(&naive, 50) / 1e6;
    h->n = trips;
    snprintf(h->ratio_key, sizeof h->ratio_key, "handoff_zero_copy");
    snprintf(h->note, sizeof h->note, "ratio: how many times longer than zero copy");
  } else {
    br_skip(&b->rep, BR_VALUE, "bandwidth", "handoff_zero_copy", "hand-off + read: zero copy vs via host", why);
  }
  bs_free(&zc);
  bs_free(&naive);
  tshare_host_buffer_destroy(host);
  tshare_cuda_buffer_release(buf);
  tshare_channel_wait_released(ch, 0, BENCH_TIMEOUT_MS);
  tshare_channel_poll(ch, 50);
}

/* ---- memory over a long stream -------------------------------------------- */

typedef struct churn {
  tshare_cuda_slab *slab;
  unsigned seed;
  long n;
} churn;

/* Random sizes from a slab; every 512th share a fresh allocation, so
 * mappings open and close along the way. */
static int share_churn(tshare_channel *ch, void *src, int lane, uint64_t *id) {
  (void)lane;
  churn *c = src;
  unsigned r = (unsigned)rand_r(&c->seed);
  size_t bytes = 256 + (r % 1024) * 256;
  tshare_cuda_buffer *buf = NULL;
  tshare_error err;
  int rc = (c->n++ % 512 == 511) ? tshare_cuda_buffer_create(0, bytes, &buf, &err)
                                 : tshare_cuda_slab_alloc(c->slab, bytes, &buf);
  if (rc != TSHARE_OK) return rc;
  int64_t elems = (int64_t)(bytes / 4);
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, &elems, 0);
  rc = tshare_share_cuda_buffer(ch, buf, &d, stream, NULL, NULL, BENCH_TIMEOUT_MS, id);
  tshare_cuda_buffer_release(buf); /* the share holds it now */
  return rc;
}

typedef struct snapshot {
  double gpu_free_mib, fds, rss_kib, events;
  char consumer[512];
} snapshot;

static int take_snapshot(bench *b, snapshot *s) {
  tshare_channel_wait_released(b->peers[0].ch, 0, BENCH_TIMEOUT_MS);
  tshare_channel_poll(b->peers[0].ch, 50); /* let retire handshakes finish */
  size_t free_b = 0, total_b = 0;
  cu->cuMemGetInfo(&free_b, &total_b);
  tshare_cuda_export_stats st;
  tshare_cuda_stats(&st);
  s->gpu_free_mib = (double)free_b / (1 << 20);
  s->fds = (double)bs_open_fds();
  s->rss_kib = (double)bs_rss_kib();
  s->events = (double)st.events;
  return bench_ask(b, 0, s->consumer, sizeof s->consumer, "stats");
}

static void memory_rows(bench *b) {
  churn c = {.seed = 777};
  tshare_error err;
  char why[512] = "";
  snapshot s0, s1;
  int ok = tshare_cuda_slab_create(0, 256u << 20, &c.slab, &err) == TSHARE_OK;
  if (!ok) bs_copy(why, sizeof why, err.message);
  long warm = b->opt.memory_shares / 100 > 1000 ? b->opt.memory_shares / 100 : 1000;
  if (ok) ok = bench_pump(b, 1, share_churn, &c, warm, why, sizeof why) >= 0;
  if (ok && (ok = take_snapshot(b, &s0) == 0) == 0) bs_copy(why, sizeof why, s0.consumer);
  if (ok) ok = bench_pump(b, 1, share_churn, &c, b->opt.memory_shares, why, sizeof why) >= 0;
  if (ok && (ok = take_snapshot(b, &s1) == 0) == 0) bs_copy(why, sizeof why, s1.consumer);
  tshare_cuda_slab_release(c.slab);
  if (!ok) {
    br_skip(&b->rep, BR_MEMORY, "memory", "cuda_memory", "cuda: memory", why);
    return;
  }
  bench_memory_row(b, "cuda_gpu_free", "cuda: GPU memory free", s0.gpu_free_mib, s1.gpu_free_mib, "MiB");
  bench_memory_row(b, "cuda_producer_fds", "cuda: producer open fds", s0.fds, s1.fds, "");
  bench_memory_row(b, "cuda_producer_events", "cuda: producer events", s0.events, s1.events, "");
  bench_memory_row(b, "cuda_producer_rss", "cuda: producer RSS", s0.rss_kib, s1.rss_kib, "KiB");
  bench_memory_row(b, "cuda_consumer_fds", "cuda: consumer open fds", bp_field(s0.consumer, "fds"),
                 bp_field(s1.consumer, "fds"), "");
  bench_memory_row(b, "cuda_consumer_mappings", "cuda: consumer IPC mappings open",
                 bp_field(s0.consumer, "cuda_mappings"), bp_field(s1.consumer, "cuda_mappings"), "");
  bench_memory_row(b, "cuda_consumer_events", "cuda: consumer events", bp_field(s0.consumer, "events"),
                 bp_field(s1.consumer, "events"), "");
  bench_memory_row(b, "cuda_consumer_rss", "cuda: consumer RSS", bp_field(s0.consumer, "rss_kib"),
                 bp_field(s1.consumer, "rss_kib"), "KiB");
}

void bench_cuda_handoffs(bench *b, int throughput) {
  handoff_row(b, REUSED, "cuda_reused", "cuda (b): reused allocations (import cache)");
  handoff_row(b, SLAB, "cuda_slab", "cuda (c): slab pieces, pooled events");
  if (throughput) throughput_rows(b);
}

void bench_cuda(bench *b) {
  handoff_row(b, NEW_ALLOC, "cuda_new_alloc", "cuda (a): a new allocation each time");
  raw_ipc_rows(b);
  handoff_row(b, REUSED, "cuda_reused", "cuda (b): reused allocations (import cache)");
  handoff_row(b, SLAB, "cuda_slab", "cuda (c): slab pieces, pooled events");
  handoff_row(b, FOREIGN, "cuda_foreign", "cuda: reused cudaMalloc memory (not tshare's)");
  /* Where the time of (b) and (c) goes, measured in this same run. */
  bench_cuda_driver_rows(b, stream);
  printf("\n| hand-off | phase | p50 us | driver us | tshare's own us |\n|---|---|---|---|---|\n");
  profile_rows(b, REUSED, "reused", "cuda (b)");
  profile_rows(b, SLAB, "slab", "cuda (c)");
  throughput_rows(b);
  bandwidth_rows(b);
  memory_rows(b);
}

/* ---- consumer side ------------------------------------------------------- */

static int fail(char *reply, size_t cap, const char *what) {
  snprintf(reply, cap, "%s", what);
  return -1;
}

static int consume_raw(tshare_channel *ch, long n, char *reply, size_t cap) {
  bs_samples open_ns = {0}, close_ns = {0};
  bp_consumer_ready();
  int rc = 0;
  for (long i = 0; i < n && rc == 0; i++) {
    tshare_frame f;
    int fd = -1;
    /* The library's own frames may come first: the producer retires host
     * memory the host rows kept mapped here once it frees it. This loop does
     * not apply them (those mappings stay until the channel closes). */
    int got;
    do {
      got = tshare_channel_recv_frame(ch, &f, &fd, BENCH_TIMEOUT_MS);
      if (got == TSHARE_OK && fd >= 0) close(fd);
    } while (got == TSHARE_OK && f.type == TSHARE_FRAME_RETIRE);
    if (got != TSHARE_OK || f.type != TSHARE_FRAME_SHARE) {
      rc = fail(reply, cap, "raw: no share frame");
      break;
    }
    CUipcMemHandle h;
    memcpy(h.reserved, f.u.share.handle, TSHARE_HANDLE_MAX);
    CUdeviceptr p;
    uint64_t t0 = bs_now_ns();
    if (!CU_OK(cu->cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))) rc = fail(reply, cap, "raw: open");
    uint64_t t1 = bs_now_ns();
    if (rc == 0 && !CU_OK(cu->cuIpcCloseMemHandle(p))) rc = fail(reply, cap, "raw: close");
    uint64_t t2 = bs_now_ns();
    bs_add(&open_ns, (double)(t1 - t0));
    bs_add(&close_ns, (double)(t2 - t1));
    tshare_frame back;
    memset(&back, 0, sizeof back);
    back.type = TSHARE_FRAME_RELEASE;
    back.u.release.count = 1;
    back.u.release.share_ids[0] = f.u.share.share_id;
    if (tshare_channel_send_frame(ch, &back, -1, BENCH_TIMEOUT_MS) != TSHARE_OK) rc = fail(reply, cap, "raw: send");
  }
  if (rc == 0)
    snprintf(reply, cap, "open_us=%.2f close_us=%.2f", bs_percentile(&open_ns, 50) / 1000.0,
             bs_percentile(&close_ns, 50) / 1000.0);
  bs_free(&open_ns);
  bs_free(&close_ns);
  return rc;
}

/* Time `reps` reads of a and of b, interleaved so drift hits both alike. */
static int consume_bandwidth(tshare_channel *ch, int reps, char *reply, size_t cap) {
  tshare_view *v;
  if (tshare_view_recv_stream(ch, stream, BENCH_TIMEOUT_MS, &v) != TSHARE_OK)
    return fail(reply, cap, tshare_channel_last_error(ch));
  size_t bytes = (size_t)tshare_tensor_numel(tshare_view_desc(v)) * 4;
  CUdeviceptr shared = (CUdeviceptr)(uintptr_t)tshare_view_data(v), local = 0, sums = 0;
  CUevent e0 = NULL, e1 = NULL;
  bs_samples t_shared = {0}, t_local = {0};
  unsigned long long sum[2] = {0, 0};
  int rc = 0;
  if (!CU_OK(cu->cuMemAlloc(&local, bytes)) || !CU_OK(cu->cuMemAlloc(&sums, 16)) ||
      !CU_OK(cu->cuEventCreate(&e0, 0)) || !CU_OK(cu->cuEventCreate(&e1, 0)) ||
      !CU_OK(cu->cuMemcpyDtoDAsync(local, shared, bytes, stream)))
    rc = fail(reply, cap, "bw: setup failed");
  for (int i = 0; rc == 0 && i < reps + 1; i++) {
    for (int which = 0; rc == 0 && which < 2; which++) {
      float ms = 0;
      CUdeviceptr p = which == 0 ? shared : local;
      if (!CU_OK(cu->cuMemsetD8(sums + 8 * (unsigned)which, 0, 8)) || !CU_OK(cu->cuEventRecord(e0, stream)) ||
          !CU_OK(ck_read_sum(p, bytes, sums + 8 * (unsigned)which, stream)) || !CU_OK(cu->cuEventRecord(e1, stream)) ||
          !CU_OK(cu->cuEventSynchronize(e1)) || !CU_OK(cu->cuEventElapsedTime(&ms, e0, e1)))
        rc = fail(reply, cap, "bw: kernel failed");
      if (i > 0) bs_add(which == 0 ? &t_shared : &t_local, ms); /* the first round warms up */
    }
  }
  if (rc == 0 && !CU_OK(cu->cuMemcpyDtoH(sum, sums, sizeof sum))) rc = fail(reply, cap, "bw: reading the sums");
  if (rc == 0)
    snprintf(reply, cap, "shared_gbs=%.1f local_gbs=%.1f same=%d", (double)bytes / (bs_percentile(&t_shared, 50) * 1e6),
             (double)bytes / (bs_percentile(&t_local, 50) * 1e6), sum[0] == sum[1]);
  if (e0) cu->cuEventDestroy(e0);
  if (e1) cu->cuEventDestroy(e1);
  cu->cuStreamSynchronize(stream);
  if (local) cu->cuMemFree(local);
  if (sums) cu->cuMemFree(sums);
  bs_free(&t_shared);
  bs_free(&t_local);
  tshare_view_release(v);
  return rc;
}

/* Receive, read on the GPU, release: the release waits for the read. With
 * staging, the share is host memory copied to the GPU first. */
static int consume_and_read(tshare_channel *ch, int n, size_t staging, char *reply, size_t cap) {
  CUdeviceptr sums = 0, local = 0;
  if (!CU_OK(cu->cuMemAlloc(&sums, 8)) || (staging && !CU_OK(cu->cuMemAlloc(&local, staging))))
    return fail(reply, cap, "read: cuMemAlloc failed");
  int rc = 0;
  for (int i = 0; i < n && rc == 0; i++) {
    tshare_view *v;
    if (tshare_view_recv_stream(ch, stream, BENCH_TIMEOUT_MS, &v) != TSHARE_OK) {
      rc = fail(reply, cap, tshare_channel_last_error(ch));
      break;
    }
    size_t bytes = (size_t)tshare_tensor_numel(tshare_view_desc(v)) * 4;
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)tshare_view_data(v);
    if (staging) {
      if (bytes > staging || !CU_OK(cu->cuMemcpyHtoD(local, tshare_view_data(v), bytes))) rc = fail(reply, cap, "H2D");
      p = local;
    }
    if (rc == 0 && !CU_OK(ck_read_sum(p, bytes, sums, stream))) rc = fail(reply, cap, "read kernel");
    if (staging) cu->cuStreamSynchronize(stream);
    tshare_view_release(v);
  }
  cu->cuStreamSynchronize(stream);
  cu->cuMemFree(sums);
  if (local) cu->cuMemFree(local);
  return rc;
}

int bench_cuda_consumer(tshare_channel *ch, const char *cmd, char *reply, size_t cap) {
  long n = 0;
  size_t bytes = 0;
  long warmup = 0;
  if (sscanf(cmd, "recvp %ld %ld", &n, &warmup) == 2) {
    if (!cu) return fail(reply, cap, "no GPU in the consumer");
    return bench_cuda_consume_profiled(ch, stream, n, warmup, reply, cap);
  }
  int is_raw = sscanf(cmd, "raw %ld", &n) == 1, is_bw = !is_raw && sscanf(cmd, "bw %ld", &n) == 1;
  int is_zc = sscanf(cmd, "zc %ld", &n) == 1, is_naive = sscanf(cmd, "naive %ld %zu", &n, &bytes) == 2;
  if (!is_raw && !is_bw && !is_zc && !is_naive) return 1;
  if (!cu) return fail(reply, cap, "no GPU in the consumer");
  if (is_raw) return consume_raw(ch, n, reply, cap);
  if (is_bw) return consume_bandwidth(ch, (int)n, reply, cap);
  return consume_and_read(ch, (int)n, is_naive ? bytes : 0, reply, cap);
}
