/* Kept host mappings (docs/architecture.md's glossary): a consumer keeps a
 * producer's memfd mapped past its last view, so that the next shares of
 * the same buffer travel as a frame alone (TSHARE_MEM_HOST_KEPT, no fd to
 * pass, no mapping to make).
 *
 * The protocol, between peers that both offer TSHARE_CAP_HOST_KEPT:
 *   producer  lends a buffer to the channel on its first share and sends
 *             that share with its fd and TSHARE_SHARE_FLAG_RETIRE_NOTICE;
 *   consumer  keeps the mapping if it has room and says so once
 *             (retire frame, closed = KEPT, mem_kind = host memfd);
 *   producer  sends later shares of it as TSHARE_MEM_HOST_KEPT;
 *   producer  once its creator destroyed the buffer and no share of it is
 *             out, retires it (closed = FREED) and lets go of it;
 *   consumer  stops keeping it: unmaps it when its last view goes, or if
 *             idle, once a receive would wait (host_chan's `retired`).
 * A memfd's pages live while any process maps them, so no answer is
 * needed: the producer may free its side at once. Only the producer
 * retires, so a consumer never finds a kept share of memory it let go. */
#include "backend_host.h"
#include "error_detail.h"
#include "fd_budget.h"
#include "log.h"
#include "tshare/hostmem.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* Mappings a consumer keeps per channel, unless TSHARE_HOST_KEPT_MAX says
 * otherwise (0: keep none). A kept mapping costs a VMA and, with
 * keep_host_fds, an fd under the budget below. */
#define KEPT_PER_CHANNEL_DEFAULT 4096

/* The fds of idle kept mappings, across every channel of this process. */
static ts_fd_budget kept_fds = TS_FD_BUDGET_INIT(1024);

#define LENT_KEY(id) ((id) + 1) /* u64map keys are nonzero */

typedef struct lent_buffer {
  tshare_host_buffer *buf;
  bool peer_keeps; /* the peer said it keeps it mapped */
} lent_buffer;

static size_t kept_per_channel(void) {
  static long most = -1;
  if (most < 0) {
    const char *s = getenv("TSHARE_HOST_KEPT_MAX");
    char *end;
    long v = s && *s ? strtol(s, &end, 10) : -1;
    most = v >= 0 && s && *end == '\0' ? v : KEPT_PER_CHANNEL_DEFAULT;
  }
  return (size_t)most;
}

static bool peer_keeps_host(const tshare_channel *ch) {
  return ch->conn.minor >= 4 && (ch->conn.peer.capabilities & TSHARE_CAP_HOST_KEPT);
}

/* ---- producer ----------------------------------------------------------- */

int ts_host_lend(tshare_channel *ch, tshare_host_buffer *buf, bool *kept, uint32_t *share_flags) {
  *kept = false;
  *share_flags = 0;
  if (!peer_keeps_host(ch)) return TSHARE_OK;
  host_chan *h = ts_host_chan(ch);
  uint64_t key = LENT_KEY(tshare_host_buffer_id(buf));
  lent_buffer *l = ts_u64map_get(&h->lent, key);
  if (l && l->peer_keeps) {
    *kept = true;
    return TSHARE_OK;
  }
  if (!l) {
    l = calloc(1, sizeof *l);
    if (!l || ts_u64map_put(&h->lent, key, l) != 0) {
      free(l);
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
    }
    l->buf = buf;
    ts_host_buffer_lend(buf);
  }
  *share_flags = TSHARE_SHARE_FLAG_RETIRE_NOTICE;
  return TSHARE_OK;
}

static bool peer_keeps_sets(const tshare_channel *ch) {
  return peer_keeps_host(ch) && ch->conn.minor >= 5 && (ch->conn.peer.capabilities & TSHARE_CAP_SET_HOST_KEPT);
}

/* A set's host memory goes as a share's does, to a peer that keeps the
 * memfds of sets too; an unsealed file is never lent (share_host says why). */
int ts_host_lend_in_set(tshare_channel *ch, void *source, bool *kept, uint32_t *share_flags) {
  *kept = false;
  *share_flags = 0;
  if (!peer_keeps_sets(ch) || ts_host_buffer_unsealed(source)) return TSHARE_OK;
  return ts_host_lend(ch, source, kept, share_flags);
}

ts_keep_state ts_host_keep_state_in_set(tshare_channel *ch, void *source) {
  if (!peer_keeps_sets(ch) || ts_host_buffer_unsealed(source)) return TS_KEEP_NONE;
  const lent_buffer *l = ts_u64map_get(&ts_host_chan(ch)->lent, LENT_KEY(tshare_host_buffer_id(source)));
  return l && l->peer_keeps ? TS_KEEP_KEPT : TS_KEEP_OFFERED;
}

/* Retire lent buffer l (under key): its notice queued, the channel's hold
 * let go. False when the notice could not be queued (nothing changed). */
static bool retire_lent(host_chan *h, uint64_t key, lent_buffer *l) {
  if (ts_id_vec_push(&h->freed_notices, key - 1) != TSHARE_OK) return false;
  ts_u64map_remove(&h->lent, key);
  ts_host_buffer_lend_end(l->buf);
  free(l);
  return true;
}

/* Lent buffers nobody else holds: retired (their notices queued) and let go. */
static int retire_unused(tshare_channel *ch, host_chan *h) {
  uint64_t generation = ts_host_buffers_unused_generation();
  if (generation == h->unused_seen || h->lent.count == 0) return TSHARE_OK;
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&h->lent, &pos, &key, &value);) {
    lent_buffer *l = value;
    if (ts_host_buffer_only_lent(l->buf) && !retire_lent(h, key, l))
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "retire: out of memory");
  }
  h->unused_seen = generation; /* only once every one was looked at */
  return TSHARE_OK;
}

/* A share of a buffer was released: if the share was all that held it
 * besides lending channels, it is retired now rather than at the next
 * housekeeping, so a released buffer's memory goes with its release. An
 * early retire is safe: the peer only stops keeping it mapped. */
void ts_host_export_done(tshare_channel *ch, const ts_export *e) {
  if (e->release != ts_host_buffer_release || !peer_keeps_host(ch)) return;
  host_chan *h = ts_host_chan(ch);
  tshare_host_buffer *buf = e->owner;
  uint64_t key = LENT_KEY(tshare_host_buffer_id(buf));
  lent_buffer *l = ts_u64map_get(&h->lent, key);
  if (l && ts_host_buffer_only_lent_but_one(buf)) (void)retire_lent(h, key, l); /* else at the next housekeeping */
}

static void lent_free_all(host_chan *h) {
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&h->lent, &pos, &key, &value);) {
    lent_buffer *l = value;
    ts_host_buffer_lend_end(l->buf);
    free(l);
  }
  ts_u64map_free(&h->lent);
}

/* ---- consumer ----------------------------------------------------------- */

void ts_host_maybe_keep_locked(tshare_channel *ch, ts_mapping *m, uint32_t share_flags) {
  if (m->kept || !(share_flags & TSHARE_SHARE_FLAG_RETIRE_NOTICE) || !peer_keeps_host(ch)) return;
  host_chan *h = ts_host_chan(ch);
  if (h->kept >= kept_per_channel()) return;
  if (ts_id_vec_push(&h->kept_notices, m->alloc_id) != TSHARE_OK) return; /* not kept: only slower */
  m->kept = true;
  h->kept++;
}

void ts_host_kept_idle_locked(ts_mapping *m) {
  /* An idle mapping keeps its fd (for sharing later views on) only within
   * the budget; past it, views of this memory cannot be shared on. */
  if (m->fd < 0 || m->fd_budgeted) return;
  if (ts_fd_budget_take(&kept_fds, 1)) {
    m->fd_budgeted = true;
  } else {
    close(m->fd);
    m->fd = -1;
  }
}

static void unkeep_locked(host_chan *h, ts_mapping *m) {
  m->kept = false;
  h->kept--;
  if (m->fd_budgeted) ts_fd_budget_give(&kept_fds, 1);
  m->fd_budgeted = false;
}

/* Retired mappings past this many, or this many bytes, are unmapped at
 * once, where the retire is read: a receive that never waits still lets go
 * of them, and a big model's pages are not held past its retire. */
#define RETIRED_HELD_MAX 1024
#define RETIRED_BYTES_MAX ((size_t)1 << 30)

/* Kept mapping m is kept no more (ch->lock held): if idle, its fd closes now
 * and its mapping goes when a receive would wait (host_chan's `retired`),
 * else with its last view (and then at the next idle too where its owner
 * retired it: defer_in_use). */
static void stop_keeping_locked(host_chan *h, ts_mapping *m, bool defer_in_use) {
  unkeep_locked(h, m);
  if (m->views != 0) {
    m->retired_in_use = defer_in_use;
    return;
  }
  ts_u64map_remove(&h->mappings, m->alloc_id);
  if (m->fd >= 0) close(m->fd); /* the mapping (if any bytes) holds the file */
  m->fd = -1;
  m->next_retired = h->retired;
  h->retired = m;
  h->retired_bytes += m->size;
  h->retired_count++;
}

/* Unmap what the owner retired (the munmaps that free the pages), without
 * ch->lock: a view released meanwhile on another thread does not wait. */
static void unmap_retired(host_chan *h) {
  ts_mapping *m = h->retired;
  h->retired = NULL;
  h->retired_count = h->retired_bytes = 0;
  while (m) {
    ts_mapping *next = m->next_retired;
    ts_host_unmap(m);
    m = next;
  }
}

bool ts_host_defer_unmap_locked(tshare_channel *ch, ts_mapping *m) {
  host_chan *h = ts_host_chan(ch);
  if (ch->closed || h->retired_later_bytes + m->size > RETIRED_BYTES_MAX) return false;
  m->next_retired = h->retired_later;
  __atomic_store_n(&h->retired_later, m, __ATOMIC_RELEASE); /* idle peeks without the lock */
  h->retired_later_bytes += m->size;
  return true;
}

/* The retired mappings whose last view went since, onto `retired` (the
 * channel-call thread's list); ch NULL: the channel's free, nobody else left. */
static void take_retired_later(tshare_channel *ch, host_chan *h) {
  if (ch) pthread_mutex_lock(&ch->lock);
  ts_mapping *m = h->retired_later;
  h->retired_later = NULL;
  h->retired_later_bytes = 0;
  if (ch) pthread_mutex_unlock(&ch->lock);
  while (m) {
    ts_mapping *next = m->next_retired;
    m->next_retired = h->retired;
    h->retired = m;
    h->retired_bytes += m->size;
    h->retired_count++;
    m = next;
  }
}

int ts_host_idle(tshare_channel *ch, int64_t deadline) {
  (void)deadline; /* a retired memfd needs no answer */
  host_chan *h = ts_host_chan(ch);
  if (!h) return TSHARE_OK;
  if (__atomic_load_n(&h->retired_later, __ATOMIC_ACQUIRE)) take_retired_later(ch, h); /* one seen late: next idle */
  if (h->retired) unmap_retired(h); /* the usual turn: nothing retired, nothing written */
  return TSHARE_OK;
}

int ts_host_kept_mapping_locked(tshare_channel *ch, const tshare_share_frame *s, ts_mapping **out) {
  ts_mapping *m = ts_u64map_get(&ts_host_chan(ch)->mappings, s->alloc_id);
  if (!m || !m->kept)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "import: share %llu names host allocation %llu as kept mapped here, and this end keeps no mapping "
                   "of it",
                   (unsigned long long)s->share_id, (unsigned long long)s->alloc_id);
  if (m->size != s->alloc_size)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "import: share %llu says allocation %llu has %llu bytes; it was mapped with %zu",
                   (unsigned long long)s->share_id, (unsigned long long)s->alloc_id,
                   (unsigned long long)s->alloc_size, m->size);
  *out = m;
  return TSHARE_OK;
}

/* The owner retires allocations this end may keep: stop keeping them (the
 * idle ones are unmapped once a receive would wait, the others with their
 * last view). Ids this end does not keep are left alone: a peer may name
 * anything. */
static void on_freed(tshare_channel *ch, host_chan *h, const tshare_retire_frame *r) {
  pthread_mutex_lock(&ch->lock);
  for (uint32_t i = 0; i < r->count; i++) {
    ts_mapping *m = ts_u64map_get(&h->mappings, r->alloc_ids[i]);
    if (m && m->kept) stop_keeping_locked(h, m, true);
  }
  pthread_mutex_unlock(&ch->lock);
  if (h->retired_count > RETIRED_HELD_MAX || h->retired_bytes > RETIRED_BYTES_MAX) unmap_retired(h);
}

/* The peer keeps buffers of ours mapped: their next shares go without fds. */
static void on_kept(host_chan *h, const tshare_retire_frame *r) {
  for (uint32_t i = 0; i < r->count; i++) {
    lent_buffer *l = ts_u64map_get(&h->lent, LENT_KEY(r->alloc_ids[i]));
    if (l) l->peer_keeps = true; /* else retired meanwhile: the peer hears of it */
  }
}

int ts_host_on_retire(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost) {
  (void)fd_lost;
  if (fd >= 0) close(fd);
  host_chan *h = ts_host_chan(ch);
  const tshare_retire_frame *r = &f->u.retire;
  if (r->closed == TSHARE_RETIRE_FREED)
    on_freed(ch, h, r);
  else if (r->closed == TSHARE_RETIRE_KEPT)
    on_kept(h, r);
  /* CLOSED: host memory needs no answer; a peer's is ignored. */
  return TSHARE_OK;
}

/* ---- both --------------------------------------------------------------- */

int ts_host_housekeeping(tshare_channel *ch, int64_t deadline, ts_backend_wait *wait) {
  *wait = TS_BACKEND_IDLE;
  host_chan *h = ts_host_chan(ch);
  int rc = retire_unused(ch, h);
  if (rc == TSHARE_OK && h->freed_notices.len)
    rc = ts_retire_send_ids(ch, TSHARE_RETIRE_FREED, TSHARE_MEM_HOST_MEMFD, &h->freed_notices,
                            ts_remaining(deadline));
  if (rc == TSHARE_OK && h->kept_notices.len)
    rc = ts_retire_send_ids(ch, TSHARE_RETIRE_KEPT, TSHARE_MEM_HOST_MEMFD, &h->kept_notices, ts_remaining(deadline));
  if (rc == TSHARE_E_PEER_CLOSED) {
    /* Nobody is left to tell: the receive that follows reads the peer's
     * last frames (a bye) and its end, and reports those. */
    h->freed_notices.len = h->kept_notices.len = 0;
    return TSHARE_OK;
  }
  return rc;
}

void ts_host_peer_gone(tshare_channel *ch) {
  host_chan *h = ts_host_chan(ch);
  if (!h) return;
  /* Nobody is left to send kept shares: idle mappings go now, the rest with
   * their last view. What was lent is nobody's to keep any more. */
  pthread_mutex_lock(&ch->lock);
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&h->mappings, &pos, &key, &value);) {
    ts_mapping *m = value;
    if (m->kept) stop_keeping_locked(h, m, false);
  }
  h->kept_notices.len = 0;
  pthread_mutex_unlock(&ch->lock);
  take_retired_later(ch, h);
  unmap_retired(h);
  lent_free_all(h);
  h->freed_notices.len = 0;
}

void ts_host_keep_free(tshare_channel *ch, host_chan *h) {
  (void)ch;
  take_retired_later(NULL, h);
  unmap_retired(h);
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&h->mappings, &pos, &key, &value);) {
    ts_mapping *m = value;
    if (m->kept) unkeep_locked(h, m);
  }
  lent_free_all(h);
  ts_id_vec_free(&h->kept_notices);
  ts_id_vec_free(&h->freed_notices);
}
