/* The stream both sides run: the producer's slots and fresh allocations,
 * the consumer that checks every element and releases in random order. */
#include "stress.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SLOTS 128
#define SLOT_BYTES (64u << 10)
#define FRESH_EVERY 256            /* one share in this many gets an allocation of its own */
#define FRESH_MAX_BYTES (256u << 10)
#define HOLD_MAX 64                /* views a consumer holds at most */

struct stress_source {
  stress_mem mem;
  uint32_t rng;
  tshare_host_buffer *host;
  tshare_cuda_buffer *cuda;
  uint64_t last_share[SLOTS]; /* 0: free */
};

stress_source *stress_source_create(stress_mem mem, uint32_t seed, char *why, size_t cap) {
  stress_source *s = calloc(1, sizeof *s);
  if (!s) {
    snprintf(why, cap, "out of memory");
    return NULL;
  }
  s->mem = mem;
  s->rng = seed | 1;
  tshare_error err;
  int rc = mem == STRESS_CUDA ? tshare_cuda_buffer_create(0, SLOTS * SLOT_BYTES, &s->cuda, &err)
                              : tshare_host_buffer_create(SLOTS * SLOT_BYTES, "tshare-stress", &s->host, &err);
  if (rc != TSHARE_OK) {
    snprintf(why, cap, "%s", err.message);
    free(s);
    return NULL;
  }
  return s;
}

void stress_source_destroy(stress_source *s) {
  if (!s) return;
  tshare_host_buffer_destroy(s->host);
  tshare_cuda_buffer_release(s->cuda);
  free(s);
}

static int32_t pattern_base(uint64_t seq) { return (int32_t)((seq * 7919u) % 1000003u); }

/* Fill n int32s at p with base + k. */
static int fill(stress_mem mem, void *p, size_t n, int32_t base) {
  if (mem == STRESS_CUDA) return stress_gpu_fill(p, n, base);
  int32_t *v = p;
  for (size_t k = 0; k < n; k++) v[k] = base + (int32_t)k;
  return 0;
}

static int free_slot(stress_source *s, tshare_channel *ch, int timeout_ms) {
  int64_t waited = 0;
  for (;;) {
    uint32_t start = stress_rand(&s->rng) % SLOTS;
    for (uint32_t i = 0; i < SLOTS; i++) {
      uint32_t k = (start + i) % SLOTS;
      if (!s->last_share[k] || tshare_share_is_released(ch, s->last_share[k]) != 0) return (int)k;
    }
    /* Every slot is still held: the window is full. Take releases in. */
    int rc = tshare_channel_poll(ch, 10);
    if (rc < 0 && rc != TSHARE_E_TIMEOUT) return rc;
    if (rc == TSHARE_END) return TSHARE_E_PEER_CLOSED;
    waited += 10;
    if (timeout_ms >= 0 && waited > timeout_ms) return TSHARE_E_TIMEOUT;
  }
}

int stress_source_share(stress_source *s, tshare_channel *ch, uint64_t seq, bool windowed, int timeout_ms) {
  size_t n = 16 + stress_rand(&s->rng) % (SLOT_BYTES / 4 - 16); /* 64 B .. 64 KiB */
  int32_t base = pattern_base(seq);
  int64_t shape[1] = {(int64_t)n};
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, shape, 0);
  char tag[48];
  uint64_t id = 0;
  tshare_error err;
  int rc;
  if (windowed && seq % FRESH_EVERY == FRESH_EVERY - 1) {
    /* A fresh allocation that only this share keeps alive. */
    size_t bytes = n * 4 + stress_rand(&s->rng) % (FRESH_MAX_BYTES - n * 4);
    snprintf(tag, sizeof tag, "%d %zu", base, n);
    if (s->mem == STRESS_CUDA) {
      tshare_cuda_buffer *b;
      if ((rc = tshare_cuda_buffer_create(0, bytes, &b, &err)) != TSHARE_OK) return rc;
      rc = fill(s->mem, tshare_cuda_buffer_ptr(b), n, base) == 0
               ? tshare_share_cuda_buffer(ch, b, &d, NULL, tag, NULL, timeout_ms, &id)
               : TSHARE_E_CUDA;
      tshare_cuda_buffer_release(b);
    } else {
      tshare_host_buffer *b;
      if ((rc = tshare_host_buffer_create(bytes, "tshare-stress-fresh", &b, &err)) != TSHARE_OK) return rc;
      fill(s->mem, tshare_host_buffer_data(b), n, base);
      rc = tshare_share_host(ch, b, &d, tag, NULL, timeout_ms, &id);
      tshare_host_buffer_destroy(b);
    }
    return rc;
  }
  int slot;
  if (windowed) {
    slot = free_slot(s, ch, timeout_ms);
    if (slot < 0) return slot;
    snprintf(tag, sizeof tag, "%d %zu", base, n);
  } else {
    slot = (int)(seq % SLOTS);
    snprintf(tag, sizeof tag, "- %zu", n); /* reused while held: no check */
  }
  d.byte_offset = (uint64_t)slot * SLOT_BYTES;
  void *data = s->mem == STRESS_CUDA ? tshare_cuda_buffer_ptr(s->cuda) : tshare_host_buffer_data(s->host);
  if (windowed && fill(s->mem, (char *)data + d.byte_offset, n, base) != 0) return TSHARE_E_CUDA;
  rc = s->mem == STRESS_CUDA ? tshare_share_cuda_buffer(ch, s->cuda, &d, NULL, tag, NULL, timeout_ms, &id)
                             : tshare_share_host(ch, s->host, &d, tag, NULL, timeout_ms, &id);
  if (rc == TSHARE_OK) s->last_share[slot] = id;
  return rc;
}

/* ---- consumer ---------------------------------------------------------- */

long long stress_view_bad(stress_mem mem, tshare_view *v) {
  int base;
  size_t n;
  if (sscanf(tshare_view_tag(v), "%d %zu", &base, &n) != 2) return 0; /* "- N": not checked */
  if (tshare_view_desc(v)->shape[0] != (int64_t)n) return (long long)n;
  if (mem == STRESS_CUDA) return stress_gpu_count_bad(tshare_view_data(v), n, base);
  const int32_t *p = tshare_view_data(v);
  long long bad = 0;
  for (size_t k = 0; k < n; k++) bad += p[k] != base + (int32_t)k;
  return bad;
}

int stress_role_consumer(tshare_channel *ch, stress_mem mem, const char *arg) {
  uint32_t rng = (uint32_t)strtoul(arg, NULL, 10) | 1;
  bool report = strstr(arg, "report") != NULL;
  tshare_view *held[HOLD_MAX + 1]; /* one more than held: a new view comes in before one goes */
  size_t nheld = 0, hold_target = 1 + stress_rand(&rng) % HOLD_MAX;
  unsigned long long views = 0, bad = 0;
  stress_snapshot warm, end;
  memset(&warm, 0, sizeof warm);
  int rc;
  for (;;) {
    tshare_view *v;
    rc = tshare_view_recv(ch, STRESS_TIMEOUT_MS, &v);
    if (rc != TSHARE_OK) break;
    long long b = stress_view_bad(mem, v);
    bad += b < 0 ? 1 : (unsigned long long)b;
    held[nheld++] = v;
    /* Hold a random number of views; release a random one of them. */
    while (nheld > hold_target) {
      size_t k = stress_rand(&rng) % nheld;
      tshare_view_release(held[k]);
      held[k] = held[--nheld];
      if (stress_rand(&rng) % 64 == 0) hold_target = 1 + stress_rand(&rng) % HOLD_MAX;
    }
    if (++views == 10000 && report) stress_snapshot_take(&warm);
  }
  while (nheld) tshare_view_release(held[--nheld]);
  tshare_channel_poll(ch, 0); /* the last releases go out */
  if (rc != TSHARE_END) {
    fprintf(stderr, "consumer: %s: %s\n", tshare_status_name(rc), tshare_channel_last_error(ch));
    return 1;
  }
  tshare_channel_wait_released(ch, 0, 1000);
  printf("views=%llu bad=%llu\n", views, bad);
  if (report) {
    stress_snapshot_take(&end);
    /* After 10k views and with every view released: nothing may have grown. */
    bool grew = views >= 10000 && (end.fds > warm.fds || end.mappings > warm.mappings ||
                                   end.cuda_events > STRESS_EVENTS_PER_CHANNEL || end.rss_kib - warm.rss_kib > 8192);
    printf("consumer memory after 10k views -> at the end: rss %ld -> %ld KiB, fds %ld -> %ld, CUDA mappings %llu -> "
           "%llu, events %llu -> %llu%s\n",
           warm.rss_kib, end.rss_kib, warm.fds, end.fds, (unsigned long long)warm.mappings,
           (unsigned long long)end.mappings, (unsigned long long)warm.cuda_events,
           (unsigned long long)end.cuda_events, grew ? " GREW" : "");
    if (grew) bad++;
  }
  fflush(stdout);
  return bad == 0 ? 0 : 1;
}

int stress_role_producer(tshare_channel *ch, stress_mem mem, const char *arg) {
  char why[256];
  stress_source *s = stress_source_create(mem, (uint32_t)strtoul(arg, NULL, 10), why, sizeof why);
  if (!s) {
    fprintf(stderr, "producer: %s\n", why);
    return 1;
  }
  int rc = TSHARE_OK;
  for (uint64_t seq = 0; rc == TSHARE_OK; seq++) rc = stress_source_share(s, ch, seq, true, STRESS_TIMEOUT_MS);
  stress_source_destroy(s);
  return rc == TSHARE_E_PEER_CLOSED ? 0 : 1;
}
