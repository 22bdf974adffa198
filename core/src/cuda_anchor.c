/* Anchors: see cuda_anchor.h. */
#include "cuda_anchor.h"
#include "clock.h"

#include <stdatomic.h>
#include <stdlib.h>

/* What a share of an anchored segment keeps: the caller's drop and keep. */
struct parked {
  ts_anchors *set;
  uint64_t alloc_id;
  void (*drop)(void *);
  void *keep;
};

struct anchor {
  uint32_t outstanding; /* shares of the segment the peer still holds */
  uint64_t gen;         /* shares of it made so far */
  uint64_t retire_gen;  /* gen when the pending retire notice went */
  bool retire_pending;
  int64_t last_us;      /* the last share or release of it */
  struct parked *held;  /* the keep of the last released share */
};

static void parked_drop(struct parked *p) {
  if (!p) return;
  p->drop(p->keep);
  free(p);
}

static void anchor_remove(ts_anchors *set, uint64_t alloc_id) {
  struct anchor *a = ts_u64map_remove(&set->by_id, alloc_id + 1);
  if (!a) return;
  parked_drop(a->held);
  free(a);
}

/* The release of a share of an anchored segment: its keep becomes what
 * holds the segment (the one it replaces goes: either holds it). */
static void park(void *owner) {
  struct parked *p = owner;
  ts_anchors *set = p->set;
  struct anchor *a = set->off ? NULL : ts_u64map_get(&set->by_id, p->alloc_id + 1);
  if (!a) {
    parked_drop(p);
    return;
  }
  a->outstanding--;
  a->last_us = ts_now_us();
  struct parked *old = a->held;
  a->held = p;
  parked_drop(old);
}

bool ts_anchor_share(ts_anchors *set, uint64_t alloc_id, void (**drop)(void *), void **keep) {
  if (set->off) return false;
  struct anchor *a = ts_u64map_get(&set->by_id, alloc_id + 1);
  bool fresh = !a;
  if (fresh) {
    if (set->by_id.count >= ANCHORS_MAX || !(a = calloc(1, sizeof *a))) return false;
    if (ts_u64map_put(&set->by_id, alloc_id + 1, a) != 0) {
      free(a);
      return false;
    }
  }
  struct parked *p = malloc(sizeof *p);
  if (!p) {
    if (fresh) anchor_remove(set, alloc_id);
    return false;
  }
  *p = (struct parked){set, alloc_id, *drop, *keep};
  *drop = park;
  *keep = p;
  a->outstanding++;
  a->gen++;
  a->last_us = ts_now_us();
  return true;
}

/* Anchors idle since before now_us - idle_us (all of them: INT64_MIN) with
 * no notice pending: marked as asked, into ids. */
static size_t ask(ts_anchors *set, int64_t now_us, int64_t idle_us, uint64_t *ids, size_t cap) {
  size_t n = 0;
  uint64_t key;
  void *value;
  for (size_t pos = 0; n < cap && ts_u64map_next(&set->by_id, &pos, &key, &value);) {
    struct anchor *a = value;
    if (a->retire_pending) continue;
    if (idle_us != INT64_MIN && (a->outstanding || now_us - a->last_us < idle_us)) continue;
    a->retire_pending = true;
    a->retire_gen = a->gen;
    ids[n++] = key - 1;
  }
  return n;
}

/* How long a segment is held without a share: a weight-sync loop whose steps
 * take longer than the default sets TSHARE_CUDA_ANCHOR_IDLE_MS above its step
 * time, so that each update finds the segments still mapped (what it costs:
 * memory the program dropped stays allocated that long). */
static int64_t anchor_idle_us(void) {
  static _Atomic int64_t cached = -1; /* read once; threads that race compute the same value */
  int64_t idle_us = atomic_load_explicit(&cached, memory_order_relaxed);
  if (idle_us < 0) {
    const char *s = getenv("TSHARE_CUDA_ANCHOR_IDLE_MS");
    char *end = NULL;
    long long ms = s && *s ? strtoll(s, &end, 10) : -1;
    idle_us = ms >= 0 && ms <= 86400000LL && end && *end == '\0' ? (int64_t)ms * 1000 : ANCHOR_IDLE_US;
    atomic_store_explicit(&cached, idle_us, memory_order_relaxed);
  }
  return idle_us;
}

size_t ts_anchors_idle(ts_anchors *set, int64_t now_us, uint64_t *ids, size_t cap) {
  return ask(set, now_us, anchor_idle_us(), ids, cap);
}

size_t ts_anchors_retire_all(ts_anchors *set, uint64_t *ids, size_t cap) { return ask(set, 0, INT64_MIN, ids, cap); }

size_t ts_anchors_pending(const ts_anchors *set) {
  size_t n = 0;
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&set->by_id, &pos, &key, &value);) n += ((struct anchor *)value)->retire_pending;
  return n;
}

bool ts_anchor_closed(ts_anchors *set, uint64_t alloc_id) {
  struct anchor *a = ts_u64map_get(&set->by_id, alloc_id + 1);
  if (!a) return false;
  if (!a->retire_pending) return true; /* not asked for: nothing to let go of */
  a->retire_pending = false;
  /* A share made after the notice may have been mapped afresh and kept:
   * then the segment stays held, and is retired again once idle. */
  if (a->gen == a->retire_gen && a->outstanding == 0) anchor_remove(set, alloc_id);
  return true;
}

void ts_anchors_drop_all(ts_anchors *set) {
  set->off = true;
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&set->by_id, &pos, &key, &value);) {
    struct anchor *a = value;
    parked_drop(a->held);
    free(a);
  }
  ts_u64map_free(&set->by_id);
}

bool ts_anchor_held(const ts_anchors *set, uint64_t alloc_id) {
  const struct anchor *a = set->off ? NULL : ts_u64map_get(&set->by_id, alloc_id + 1);
  return a && !a->retire_pending;
}

size_t ts_anchors_count(const ts_anchors *set) { return set->by_id.count; }
