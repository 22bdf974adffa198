/* Lent memory and kept mappings of the CUDA backend (the glossary in
 * docs/architecture.md): the producer's watched runs of VMM chunks and the
 * retire frames it sends for what it lent, the consumer's kept runs and
 * its answers. */
#include "backend_cuda.h"
#include "clock.h"
#include "error_detail.h"
#include "fd_budget.h"
#include "log.h"
#include "wire_checks.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Fds kept by watched runs of every channel of this process: the fd table
 * is the process's, and a producer feeding several consumers watches each
 * run once per channel (four consumers of 200 tensors of expandable
 * segments would keep over 2000). */
static ts_fd_budget run_fds = TS_FD_BUDGET_INIT(256);

/* r keeps the fresh fds of chunks if the budget has room for them. */
static bool run_keep_fds(struct watched_run *r, const ts_vmm_chunks *chunks) {
  if (!ts_fd_budget_take(&run_fds, r->n)) return false;
  for (int i = 0; i < r->n; i++) r->fd[i] = chunks->fd[i];
  return true;
}

static void run_close_fds(struct watched_run *r) {
  if (r->n == 0 || r->fd[0] < 0) return;
  for (int i = 0; i < r->n; i++) {
    close(r->fd[i]);
    r->fd[i] = -1;
  }
  ts_fd_budget_give(&run_fds, r->n);
}

static void watched_run_free(struct watched_run *r) {
  if (r) run_close_fds(r);
  free(r);
}

/* A newly watched run of chunks, keeping no fds yet. */
static struct watched_run *watched_run_new(const ts_vmm_chunks *chunks) {
  size_t n = (size_t)chunks->n;
  struct watched_run *r = malloc(sizeof *r + 2 * n * sizeof(uint64_t) + n * sizeof(int));
  if (!r) return NULL;
  r->n = chunks->n;
  r->peer_keeps = false;
  r->fd = (int *)(r->v + 2 * n);
  for (size_t i = 0; i < n; i++) {
    r->v[i] = chunks->base[i];
    r->v[n + i] = chunks->id[i];
    r->fd[i] = -1;
  }
  return r;
}

/* Start watching the run of chunks (fds fresh from the export): true if it
 * kept the fds, which the caller then must not close. */
static bool watched_run_watch(tshare_channel *ch, struct ts_cuda_chan *c, uint64_t run_id, const ts_vmm_chunks *chunks,
                          bool *watched) {
  if (c->watched_runs.count >= WATCHED_RUNS_MAX || ch->conn.minor < 1) return false;
  struct watched_run *r = watched_run_new(chunks);
  if (!r || ts_u64map_put(&c->watched_runs, run_id + 1, r) != 0) {
    free(r);
    return false;
  }
  *watched = true;
  return run_keep_fds(r, chunks);
}

/* The chunks' fds: those the watched run keeps when it keeps them, else new
 * ones, which a newly watched run keeps where the budget allows (*owned
 * false) or the caller closes after sending (*owned true). *watched: the
 * share may promise a retire notice. */
int ts_cuda_vmm_fds(tshare_channel *ch, struct ts_cuda_chan *c, uint64_t run_id, ts_vmm_chunks *chunks, bool *owned,
                   bool *watched, bool *held) {
  struct watched_run *r = ts_u64map_get(&c->watched_runs, run_id + 1);
  *owned = false;
  *watched = r != NULL;
  *held = r && r->peer_keeps;
  if (*held) return TSHARE_OK; /* the peer has it mapped: no fds travel */
  if (r && r->fd[0] >= 0) {
    for (int i = 0; i < chunks->n; i++) chunks->fd[i] = r->fd[i];
    return TSHARE_OK;
  }
  int rc = ts_cuda_vmm_export_fds(chunks, ch->err, sizeof ch->err);
  if (rc != TSHARE_OK) return rc;
  *owned = r || !watched_run_watch(ch, c, run_id, chunks, watched);
  return TSHARE_OK;
}

void ts_cuda_run_state(struct ts_cuda_chan *c, uint64_t run_id, bool *watched, bool *held) {
  const struct watched_run *r = ts_u64map_get(&c->watched_runs, run_id + 1);
  *watched = r != NULL;
  *held = r && r->peer_keeps;
}

/* Each chunk of watched run r still the allocation it was shared as. */
static bool run_unchanged(const ts_cuda_api *cu, const struct watched_run *r) {
  for (int i = 0; i < r->n; i++) {
    unsigned long long id = 0;
    if (cu->cuPointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, (CUdeviceptr)r->v[i]) != CUDA_SUCCESS ||
        id != r->v[r->n + i])
      return false;
  }
  return true;
}

bool ts_cuda_run_still_mapped(struct ts_cuda_chan *c, uint64_t run_id) {
  const struct watched_run *r = ts_u64map_get(&c->watched_runs, run_id + 1);
  const ts_cuda_api *cu = ts_cuda(NULL, NULL);
  return r && cu && run_unchanged(cu, r);
}

/* Runs whose chunks are no longer where they were, as their owner's
 * allocator left them: into ids (up to cap), no longer watched. A look
 * asks the driver about WATCH_CHUNKS_PER_LOOK chunks at most, going on
 * where the last look stopped: a model in expandable segments is hundreds
 * of runs of a few chunks each, and a look at all of them (a driver call
 * per chunk) took most of a millisecond, every millisecond, out of the
 * owner's sends. Only the peer's freeing of a stale mapping waits for it: a
 * send looks its run up itself. */
static size_t watched_runs_gone(struct ts_cuda_chan *c, const ts_cuda_api *cu, uint64_t *ids, size_t cap) {
  size_t n = 0, asked = 0;
  uint64_t key;
  void *value;
  size_t start = c->watch_pos, pos = start;
  bool wrapped = false;
  while (n < cap && asked < WATCH_CHUNKS_PER_LOOK && !(wrapped && pos >= start)) {
    if (!ts_u64map_next(&c->watched_runs, &pos, &key, &value)) {
      if (wrapped || start == 0) break;
      pos = 0; /* once around: from the start to where this look began */
      wrapped = true;
      continue;
    }
    struct watched_run *r = value;
    asked += (size_t)r->n;
    if (run_unchanged(cu, r)) continue;
    TS_LOG(TS_LOG_DEBUG, "VMM memory %llu (%d chunks) is no longer mapped as it was shared: retiring it",
           (unsigned long long)(key - 1), r->n);
    ids[n++] = key - 1;
    watched_run_free(ts_u64map_remove(&c->watched_runs, key));
  }
  c->watch_pos = pos;
  return n;
}

void ts_cuda_watched_runs_free(struct ts_cuda_chan *c) {
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&c->watched_runs, &pos, &key, &value);) watched_run_free(value);
  ts_u64map_free(&c->watched_runs);
}

/* After a VMM share of a watched run came in with its fds: keep the mapping
 * (a reference of its own) and tell the peer, which sends the run's next
 * shares without them. Best effort: without it the fds keep coming. */
void ts_cuda_keep_run(tshare_channel *ch, struct ts_cuda_chan *c, uint64_t alloc_id, ts_cuda_mapping *imp) {
  if (!(ch->conn.peer.capabilities & TSHARE_CAP_CUDA_HELD) || c->kept_runs.count >= KEPT_RUNS_MAX ||
      ts_u64map_get(&c->kept_runs, alloc_id + 1))
    return;
  if (ts_id_vec_push(&c->kept_notices, alloc_id) != TSHARE_OK) return;
  if (ts_u64map_put(&c->kept_runs, alloc_id + 1, imp) != 0) {
    c->kept_notices.len--;
    return;
  }
  ts_cuda_import_hold(imp, false);
}

void ts_cuda_drop_kept_run(struct ts_cuda_chan *c, uint64_t alloc_id) {
  ts_cuda_mapping *imp = ts_u64map_remove(&c->kept_runs, alloc_id + 1);
  if (imp) ts_cuda_import_put(imp);
}

#define RETIRING_MAX 1024      /* retires left for the idle entry; past it they are acted on at once */
#define RETIRING_WAIT_US 20000 /* a receive turn that finds the oldest this old acts on them (one that never waits) */

/* The owner's retires left for later: their mappings closed (now if idle),
 * their answers queued. A mapping left open past its retire is safe: the
 * owner frees the memory only after the answer, and a share of it made
 * meanwhile keeps the memory held on the owner's side (cuda_anchor.h)
 * while it uses the mapping. */
static void close_retiring(struct ts_cuda_chan *c, uint64_t origin) {
  if (!c->retiring.len || ts_id_vec_reserve(&c->closed_notices, c->retiring.len) != TSHARE_OK) return;
  for (size_t i = 0; i < c->retiring.len; i++) {
    uint64_t id = c->retiring.items[i];
    ts_cuda_drop_kept_run(c, id);
    ts_cuda_import_retire(origin, id);
    c->closed_notices.items[c->closed_notices.len++] = id;
  }
  c->retiring.len = 0;
}

/* A retire frame from the peer (closed: tshare_retire_kind): one of our
 * allocations it closed, a run it keeps mapped, or memory of its own that
 * it frees. */
int ts_cuda_on_retire(tshare_channel *ch, const tshare_frame *f) {
  struct ts_cuda_chan *c = ts_cuda_chan_of(ch);
  if (!c) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  const tshare_retire_frame *r = &f->u.retire;
  for (uint32_t i = 0; i < r->count; i++) {
    if (r->closed == TSHARE_RETIRE_CLOSED) { /* our peer closed its mapping: one reference less on the memory */
      lent_alloc *pm = ts_u64map_remove(&c->lent, MAPKEY(r->alloc_ids[i]));
      if (pm) {
        ts_cuda_alloc_peer_release(pm->alloc);
        free(pm);
      } else {
        (void)ts_anchor_closed(&c->anchors, r->alloc_ids[i]);
      }
    } else if (r->closed == TSHARE_RETIRE_KEPT) { /* our peer keeps this run mapped: its next shares go without fds */
      struct watched_run *run = ts_u64map_get(&c->watched_runs, r->alloc_ids[i] + 1);
      lent_alloc *pm = run ? NULL : ts_u64map_get(&c->lent, MAPKEY(r->alloc_ids[i]));
      if (run) { /* else retired meanwhile: the peer hears of it */
        run->peer_keeps = true;
        run_close_fds(run); /* its mapping holds the memory: no share of it needs them now */
      } else if (pm && !pm->retire_queued && ts_cuda_alloc_export(pm->alloc)->fd >= 0) {
        pm->peer_keeps = true; /* an owned VMM buffer: freed only after the peer's answer to its retire, as ever */
      }
    } else { /* the owner frees it: closed (now if idle) and answered once a receive would wait */
      TS_LOG(TS_LOG_DEBUG, "peer %s retires allocation %llu", ch->conn.peer_label, (unsigned long long)r->alloc_ids[i]);
      if (!c->retiring.len) c->retiring_since_us = ts_now_us();
      if (ts_id_vec_push(&c->retiring, r->alloc_ids[i]) != TSHARE_OK)
        return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "retire: out of memory");
    }
  }
  if (c->retiring.len >= RETIRING_MAX) close_retiring(c, ch->conn.peer_key);
  return TSHARE_OK;
}


/* CUDA memory's retire frames carry mem_kind 0, as they did before host
 * memory had any (session.h). */
#define RETIRE_MEM_CUDA 0

/* The ids of l in retire frames (closed as given); those that went leave l,
 * the rest go with a later flush. */
static int send_ids(tshare_channel *ch, uint8_t closed, ts_id_vec *l, int timeout_ms) {
  return ts_retire_send_ids(ch, closed, RETIRE_MEM_CUDA, l, timeout_ms);
}

/* Runs whose chunks were unmapped and segments idle long enough: their
 * retire notices queued (up to one frame's worth a look; room is made
 * first, so that nothing is marked that the queue could not take). */
static bool queue_watched_retires(struct ts_cuda_chan *c, const ts_cuda_api *cu, int64_t now) {
  if (ts_id_vec_reserve(&c->freed_notices, TSHARE_RELEASE_MAX) != TSHARE_OK) return false;
  uint64_t *ids = c->freed_notices.items + c->freed_notices.len;
  size_t n = cu && c->watched_runs.count ? watched_runs_gone(c, cu, ids, TSHARE_RELEASE_MAX) : 0;
  n += ts_anchors_idle(&c->anchors, now, ids + n, TSHARE_RELEASE_MAX - n);
  c->freed_notices.len += n;
  return true;
}

/* Lent allocations nobody holds any more: the peer is told, closes them
 * and answers; the memory is freed after the answer. Their notices queued
 * (up to one frame's worth a flush). Looked for only when some allocation
 * lost its last own reference since the last full look: a turn of a
 * hand-off takes no lock here. */
static bool queue_unused_allocs(struct ts_cuda_chan *c) {
  unsigned generation = ts_cuda_alloc_unused_generation();
  if (!c->lent.count || generation == c->unused_seen) return true;
  if (ts_id_vec_reserve(&c->freed_notices, TSHARE_RELEASE_MAX) != TSHARE_OK) return false;
  uint64_t key;
  void *value;
  size_t pos = 0, n = 0;
  while (n < TSHARE_RELEASE_MAX && ts_u64map_next(&c->lent, &pos, &key, &value)) {
    lent_alloc *pm = value;
    if (pm->retire_queued || !ts_cuda_alloc_unused(pm->alloc)) continue;
    pm->retire_queued = true;
    c->freed_notices.items[c->freed_notices.len++] = key - 1;
    n++;
  }
  if (n < TSHARE_RELEASE_MAX) c->unused_seen = generation; /* else the rest at the next turn */
  return true;
}

static int retire_nomem(tshare_channel *ch) {
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "retire: out of memory");
}

void ts_cuda_before_close(tshare_channel *ch, int timeout_ms) {
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  if (!c || !ts_anchors_count(&c->anchors)) return;
  int64_t deadline = ts_deadline(timeout_ms);
  /* Notices queued earlier go too: the wait below is for their answers as well. */
  size_t n;
  do {
    if (ts_id_vec_reserve(&c->freed_notices, TSHARE_RELEASE_MAX) != TSHARE_OK) return;
    n = ts_anchors_retire_all(&c->anchors, c->freed_notices.items + c->freed_notices.len, TSHARE_RELEASE_MAX);
    c->freed_notices.len += n;
  } while (n > 0);
  if (send_ids(ch, TSHARE_RETIRE_FREED, &c->freed_notices, ts_remaining(deadline)) != TSHARE_OK) return;
  /* A peer that hangs up has closed its idle mappings first (its close, or
   * its exit, does that before the socket goes). */
  while (ts_anchors_pending(&c->anchors) && ts_remaining(deadline) != 0) {
    int rc = ts_share_drive(ch, ts_remaining(deadline));
    if (rc != TSHARE_OK && rc != TSHARE_END) break;
  }
}


/* The notices this end owes: retire notices of runs gone and segments idle (looked
 * at every WATCH_CHECK_US) and of allocations nobody holds; KEPT notices; CLOSED answers. */
int ts_cuda_send_notices(tshare_channel *ch, struct ts_cuda_chan *c, const ts_cuda_api *cu, int64_t deadline) {
  if (c->retiring.len && ts_now_us() - c->retiring_since_us >= RETIRING_WAIT_US)
    close_retiring(c, ch->conn.peer_key); /* a receive that always finds frames waiting */
  if (c->watched_runs.count || ts_anchors_count(&c->anchors)) {
    int64_t now = ts_now_us();
    if (now - c->watched_checked_us >= WATCH_CHECK_US) {
      c->watched_checked_us = now;
      if (!queue_watched_retires(c, cu, now)) return retire_nomem(ch);
    }
  }
  if (!queue_unused_allocs(c)) return retire_nomem(ch);
  if (!c->freed_notices.len && !c->kept_notices.len && !c->closed_notices.len) return TSHARE_OK; /* the usual turn */
  int rc = send_ids(ch, TSHARE_RETIRE_FREED, &c->freed_notices, ts_remaining(deadline));
  if (rc == TSHARE_OK) rc = send_ids(ch, TSHARE_RETIRE_KEPT, &c->kept_notices, ts_remaining(deadline));
  if (rc == TSHARE_OK) rc = send_ids(ch, TSHARE_RETIRE_CLOSED, &c->closed_notices, ts_remaining(deadline));
  return rc;
}

int ts_cuda_idle(tshare_channel *ch, int64_t deadline) {
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  if (!c || !c->retiring.len) return TSHARE_OK;
  close_retiring(c, ch->conn.peer_key);
  /* The owner waits for these to free the memory (and its close waits for
   * them): they go now, not at the next receive; what the deadline leaves
   * goes with a later turn's notices. */
  return send_ids(ch, TSHARE_RETIRE_CLOSED, &c->closed_notices, ts_remaining(deadline));
}
