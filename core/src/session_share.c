/* The session layer: the lifetime protocol. Shares sent and the references
 * they hold, views received (their memory mapped by a backend, reached
 * through the table: backend.h), the releases between them, and what the
 * session does while the connection (conn.h) waits. */
#include "tshare/share.h"

#include "backend.h"
#include "session.h"
#include "error_detail.h"
#include "wire_checks.h"
#include "log.h"
#include "session_set.h"
#include "tshare/cuda.h" /* tshare_view_recv_stream, tshare_view_cuda_device */

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

/* ---- producer side ------------------------------------------------------ */

static const char *mem_kind_name(int kind) {
  const ts_backend *b = ts_backend_for_mem_kind(kind);
  return b ? b->mem_kind_name(kind) : "unknown memory";
}

int ts_share_send_export(tshare_channel *ch, tshare_frame *f, int fd, ts_export *e, int timeout_ms,
                         uint64_t *share_id) {
  tshare_share_frame *s = &f->u.share;
  s->share_id = e->share_id = ch->next_share_id; /* only this thread changes it */
  int rc = ts_wire_check_share(s, &ch->conn.limits, ch->err, sizeof ch->err);
  if (rc == TSHARE_OK && ts_export_register(ch, e) != TSHARE_OK)
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  else if (rc == TSHARE_OK) {
    /* Registered before the send: the peer may release before we return. */
    rc = ts_channel_send(ch, f, fd, timeout_ms);
    if (rc != TSHARE_OK) ts_export_take(ch, s->share_id);
  }
  if (rc != TSHARE_OK) {
    ts_backends_export_done(ch, e);
    ts_export_drop(e);
    return rc;
  }
  ts_export_sent(ch);
  if (share_id) *share_id = s->share_id;
  TS_LOG(TS_LOG_INFO, "shared %llu (%s, allocation %llu of %llu bytes, tag '%s') with %s",
         (unsigned long long)s->share_id, mem_kind_name(s->mem_kind), (unsigned long long)s->alloc_id,
         (unsigned long long)s->alloc_size, s->tag, ch->conn.peer_label);
  return TSHARE_OK;
}

/* Both ways of sharing a view on end here; e (release and owner set) is consumed. */
static int share_view_export(tshare_channel *ch, tshare_view *v, const tshare_tensor_desc *part, void *stream,
                             const char *tag, void *user_data, ts_export *e, int timeout_ms, uint64_t *share_id) {
  int rc = TSHARE_OK;
  tshare_tensor_desc desc = *part;
  if (!tag) tag = v->tag;
  if (strlen(tag) > TSHARE_TAG_MAX) {
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_TOO_LARGE, "share: tag of %zu bytes over %d", strlen(tag),
                 TSHARE_TAG_MAX);
  } else if (ch->closed || ch->conn.wfd < 0) {
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "share: channel is closed");
  } else if (ts_channel_foreign(v->ch)) {
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE,
                 "share: the view came on a channel of process %ld, which this process was forked from: it may "
                 "only be released here",
                 v->ch->owner_pid);
  } else {
    /* From the view's first element to an offset in the producer's allocation,
     * and the layout must stay inside what the view's producer mapped. */
    uint64_t view_offset = ts_view_described(v)->frame.tensor.byte_offset;
    char why[160];
    if (desc.byte_offset > UINT64_MAX - view_offset)
      rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_OVERFLOW, "share: byte_offset %llu overflows",
                   (unsigned long long)desc.byte_offset);
    else if (desc.byte_offset += view_offset,
             (rc = ts_tensor_check(&desc, v->frame.alloc_size, NULL, NULL, why, sizeof why)) != TSHARE_OK)
      ts_errf(ch->err, sizeof ch->err, rc, "share: %s", why);
  }
  e->user_data = user_data;
  e->backend = NULL;
  if (rc != TSHARE_OK) {
    ts_export_drop(e);
    return rc;
  }
  return v->backend->share_view(ch, v, &desc, stream, tag, e, timeout_ms, share_id);
}

static void release_forwarded_view(void *view) { tshare_view_release(view); }

static int share_view(tshare_channel *ch, tshare_view *v, void *stream, const char *tag, void *user_data,
                      int timeout_ms, uint64_t *share_id) {
  ts_export *e = calloc(1, sizeof *e);
  if (!e) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  e->release = release_forwarded_view; /* the view is held until the third process releases */
  e->owner = v;
  tshare_tensor_desc whole = ts_view_described(v)->desc;
  whole.byte_offset = 0;
  return share_view_export(ch, v, &whole, stream, tag, user_data, e, timeout_ms, share_id);
}

int tshare_share_view(tshare_channel *ch, tshare_view *v, void *stream, const char *tag, void *user_data,
                      int timeout_ms, uint64_t *share_id) {
  if (share_id) *share_id = 0;
  if (!ch || !v) return TSHARE_E_INVALID_ARG;
  int rc = ts_channel_enter(ch, "share");
  if (rc != TSHARE_OK) {
    tshare_view_release(v); /* consumed, also when refused */
    return rc;
  }
  return ts_channel_leave(ch, share_view(ch, v, stream, tag, user_data, timeout_ms, share_id));
}

static int share_view_part(tshare_channel *ch, tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                           const char *tag, tshare_drop_fn drop, void *keep, void *user_data, int timeout_ms,
                           uint64_t *share_id) {
  ts_export *e = v && desc && drop ? calloc(1, sizeof *e) : NULL;
  if (!e) {
    if (drop) drop(keep);
    return ts_errf(ch->err, sizeof ch->err, v && desc && drop ? TSHARE_E_NOMEM : TSHARE_E_INVALID_ARG,
                   v && desc && drop ? "share: out of memory" : "share: NULL view, descriptor or drop function");
  }
  e->release = drop;
  e->owner = keep;
  return share_view_export(ch, v, desc, stream, tag, user_data, e, timeout_ms, share_id);
}

int tshare_share_view_part(tshare_channel *ch, tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                           const char *tag, tshare_drop_fn drop, void *keep, void *user_data, int timeout_ms,
                           uint64_t *share_id) {
  if (share_id) *share_id = 0;
  int rc = ch ? ts_channel_enter(ch, "share") : TSHARE_E_INVALID_ARG;
  if (rc != TSHARE_OK) {
    if (drop) drop(keep); /* exactly once, also when refused */
    return rc;
  }
  return ts_channel_leave(ch, share_view_part(ch, v, desc, stream, tag, drop, keep, user_data, timeout_ms, share_id));
}

static void finish_export(tshare_channel *ch, ts_export *e, int status) {
  ts_backends_export_done(ch, e);
  if (ch->opts.on_release) ch->opts.on_release(ch->opts.cb_user, e->share_id, e->user_data, status);
  e->release(e->owner);
  free(e);
}

int ts_share_apply_release(tshare_channel *ch, const tshare_release_frame *r, bool strict) {
  int rc = TSHARE_OK;
  for (uint32_t i = 0; i < r->count; i++) {
    ts_export *e = ts_export_take(ch, r->share_ids[i]);
    if (!e && !strict) continue;
    if (!e) {
      /* Keep going: the other ids in the frame are still real releases. */
      rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "release: peer %s released share %llu, which is not outstanding", ch->conn.peer_label,
                   (unsigned long long)r->share_ids[i]);
      continue;
    }
    TS_LOG(TS_LOG_DEBUG, "share %llu released by %s", (unsigned long long)e->share_id, ch->conn.peer_label);
    finish_export(ch, e, TSHARE_OK);
  }
  return rc;
}

void ts_share_drop_all(tshare_channel *ch, int status) {
  ts_backends_peer_gone(ch);
  ts_set_peer_gone(ch);
  /* Taken out whole under the lock, finished outside it. */
  pthread_mutex_lock(&ch->lock);
  ts_u64map gone = ch->exports;
  memset(&ch->exports, 0, sizeof ch->exports);
  pthread_mutex_unlock(&ch->lock);
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&gone, &pos, &key, &value);) finish_export(ch, value, status);
  ts_u64map_free(&gone);
}

/* ---- consumer side ------------------------------------------------------ */

/* A view a forked child inherited: its channel is its parent's, so nothing
 * is queued or sent; the child only drops its own mapping of the memory
 * where its backend has one to drop. */
static void release_in_child(tshare_view *v) {
  if (v->backend->release_in_child) v->backend->release_in_child(v);
}

void tshare_view_release(tshare_view *v) {
  if (!v) return;
  tshare_channel *ch = v->ch;
  if (ts_channel_foreign(ch)) {
    release_in_child(v);
  } else if (v->backend->release(v) == TS_RELEASE_NOW) {
    TS_LOG(TS_LOG_INFO, "released share %llu of %s", (unsigned long long)v->share_id, ch->conn.peer_label);
    pthread_mutex_lock(&ch->lock);
    ts_share_queue_release_locked(ch, v->share_id);
    pthread_mutex_unlock(&ch->lock);
    ts_share_send_releases_now(ch);
  }
  free(v);
  ts_channel_unref(ch);
}

void ts_share_free_incoming(tshare_channel *ch) {
  for (size_t i = 0; i < ch->in_len; i++) {
    ts_incoming *in = &ch->incoming[(ch->in_head + i) % ch->in_cap];
    if (in->fd >= 0) {
      close(in->fd);
      ts_conn_hold_fds(&ch->conn, -1);
    }
  }
  free(ch->incoming);
  ch->incoming = NULL;
  ch->in_len = ch->in_cap = ch->in_head = 0;
  ts_set_free_queued(ch);
}

/* A share this end will not hold: released back, the peer told. */
static void refuse_share(tshare_channel *ch, const tshare_share_frame *s, const char *why) {
  ts_backends_share_dropped(ch, s->share_id);
  ts_share_release_back(ch, s->share_id);
  if (ch->refused++ == 0) ch->refused_first = s->share_id;
  ts_errf(ch->err, sizeof ch->err, TSHARE_E_LIMIT, "receive: refused share %llu from peer %s: %s; released back",
          (unsigned long long)s->share_id, ch->conn.peer_label, why);
  TS_LOG(TS_LOG_WARN, "%s", ch->err);
}

int ts_share_fd_lost(tshare_channel *ch, const tshare_frame *f, int lost) {
  if (f->type != TSHARE_FRAME_SHARE)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_LIMIT, "receive: the fd of a %s frame could not be kept",
                   tshare_frame_type_name(f->type));
  const tshare_share_frame *s = &f->u.share;
  if (lost == TS_FD_OVER_BUDGET) {
    char why[128];
    snprintf(why, sizeof why, "%zu shares with fds already wait for tshare_view_recv() (max_unclaimed_fds)",
             ch->conn.fdq.budget);
    refuse_share(ch, s, why);
    return TSHARE_OK;
  }
  ts_backends_share_dropped(ch, s->share_id);
  ts_share_release_back(ch, s->share_id);
  struct rlimit rl;
  unsigned long long limit = getrlimit(RLIMIT_NOFILE, &rl) == 0 ? (unsigned long long)rl.rlim_cur : 0;
  ts_errf(ch->err, sizeof ch->err, TSHARE_E_LIMIT,
          "receive: share %llu from peer %s came without its fd: %s (%s, RLIMIT_NOFILE %llu); release views "
          "or raise the limit (ulimit -n); the share was released back",
          (unsigned long long)s->share_id, ch->conn.peer_label,
          lost == ENFILE ? "the system's file table is full" : "this process has no free fd",
          lost == ENFILE ? "ENFILE" : "EMFILE", limit);
  TS_LOG(TS_LOG_WARN, "%s", ch->err);
  return TSHARE_E_LIMIT;
}

static int enqueue_incoming(tshare_channel *ch, const tshare_frame *f, int fd) {
  if (ch->in_len >= TS_INCOMING_MAX) {
    if (fd >= 0) close(fd);
    char why[96];
    snprintf(why, sizeof why, "%d shares already wait for tshare_view_recv()", TS_INCOMING_MAX);
    refuse_share(ch, &f->u.share, why);
    return TSHARE_OK;
  }
  if (ch->in_len == ch->in_cap) {
    size_t cap = ch->in_cap ? ch->in_cap * 2 : 16;
    ts_incoming *ring = malloc(cap * sizeof *ring);
    if (!ring) {
      if (fd >= 0) close(fd);
      ts_backends_share_dropped(ch, f->u.share.share_id);
      ts_share_release_back(ch, f->u.share.share_id);
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
    }
    for (size_t i = 0; i < ch->in_len; i++) ring[i] = ch->incoming[(ch->in_head + i) % ch->in_cap];
    free(ch->incoming);
    ch->incoming = ring;
    ch->in_cap = cap;
    ch->in_head = 0;
  }
  ts_incoming *slot = &ch->incoming[(ch->in_head + ch->in_len++) % ch->in_cap];
  slot->frame = *f;
  slot->fd = fd;
  if (fd >= 0) ts_conn_hold_fds(&ch->conn, 1); /* counts against the budget until taken */
  ch->refused = 0;
  ch->refusal_told = false;
  return TSHARE_OK;
}

/* Releases go out before this end may block (the peer may wait for them),
 * or once a batch gathered: while frames are buffered, a stream of shares
 * is answered with one release frame per batch rather than one per share. */
#define RELEASE_BATCH 16
static bool releases_batched(tshare_channel *ch) {
  pthread_mutex_lock(&ch->lock);
  bool due = ch->pending.len >= RELEASE_BATCH;
  pthread_mutex_unlock(&ch->lock);
  return due;
}

/* Before a receive may block: the backends' housekeeping (releases whose GPU
 * work finished are queued), pending releases out (all when all_releases),
 * then, with nothing of the peer's to read, the backends' idle work. */
static int housekeeping(tshare_channel *ch, int64_t deadline, bool all_releases, ts_backend_wait *wait) {
  int rc = ts_backends_housekeeping(ch, deadline, wait);
  bool nothing_to_read = ts_conn_buffered(&ch->conn) == 0;
  if (rc == TSHARE_OK && (all_releases || nothing_to_read || releases_batched(ch)))
    rc = ts_share_flush_pending(ch, deadline);
  if (rc == TSHARE_OK && nothing_to_read) rc = ts_backends_idle(ch, deadline); /* a timeout: owed, as above */
  return rc;
}

/* How long a receive waits at a time for room for what it owes, and then for
 * the peer's frames, while the peer does not make room: a close from another
 * thread is seen between turns. */
#define TS_OWED_SLICE_MS 10

/* The sooner of a deadline and one slice_ms from now (one coarse clock read). */
static int64_t slice_of(int64_t deadline, int slice_ms) {
  int64_t slice = ts_turn_deadline(slice_ms);
  return deadline >= 0 && deadline < slice ? deadline : slice;
}

int ts_session_recv_by(tshare_channel *ch, tshare_frame *f, int *fd_out, int *fd_lost, int64_t deadline) {
  bool woken = false;
  for (;;) {
    if (ts_channel_close_waits(ch))
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE,
                     "receive: the channel was closed while this call waited (tshare_channel_close from another "
                     "thread or a callback); the handle is gone once this call returns");
    ts_backend_wait wait = TS_BACKEND_IDLE;
    ts_conn_look_begins(&ch->conn);
    int rc = housekeeping(ch, slice_of(deadline, TS_OWED_SLICE_MS), woken, &wait);
    /* A peer that does not make room for what this end owes (nothing of it
     * went: it goes with a later turn) may still have sent frames: they are
     * read now, or an event loop would find the fd readable forever and two
     * such ends could wait on each other. */
    if (rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT) return rc;
    bool owed = rc == TSHARE_E_TIMEOUT;
    /* A backend's waiting work (releases waiting for the GPU) is looked at
     * again at once while it is fresh, then every millisecond. */
    int64_t by = deadline; /* the usual turn: no second clock read */
    if (wait != TS_BACKEND_IDLE || owed)
      by = slice_of(deadline, wait == TS_BACKEND_SOON ? 0 : wait != TS_BACKEND_IDLE ? 1 : TS_OWED_SLICE_MS);
    rc = ts_conn_recv_by(&ch->conn, f, fd_out, fd_lost, by);
    woken = rc == TS_CONN_WOKEN; /* releases were queued: out with them before waiting on */
    if (woken || (rc == TSHARE_E_TIMEOUT && (wait != TS_BACKEND_IDLE || owed) && ts_remaining(deadline) != 0)) continue;
    return rc;
  }
}

/* Receive and handle one frame. A share is returned through share/fd when the
 * caller asked for one (share != NULL), otherwise queued. After the peer's
 * bye no share comes, so a receive ends there (TSHARE_END); but its releases
 * still come until it closes, and past_bye reads on for them. */
static int drive_once(tshare_channel *ch, int64_t deadline, tshare_frame *share, int *fd, bool *got_share,
                      bool past_bye) {
  *got_share = false;
  /* A share is read straight into the caller's frame (read only when
   * *got_share): a whole frame copied costs more than its decoding. */
  tshare_frame mine, *fr = share ? share : &mine;
  int frame_fd, fd_lost;
  int rc;
  if (ch->peer_bye && !past_bye) { /* nothing more comes; what this end owes still goes */
    ts_backend_wait wait;
    rc = housekeeping(ch, deadline, false, &wait);
    if (rc == TSHARE_E_PEER_CLOSED) ts_share_drop_all(ch, rc);
    return rc == TSHARE_OK ? TSHARE_END : rc;
  }
  rc = ts_session_recv_by(ch, fr, &frame_fd, &fd_lost, deadline);
  if (rc == TSHARE_E_PEER_CLOSED) ts_share_drop_all(ch, rc);
  if (rc != TSHARE_OK) return rc;
  const ts_backend *owner = ts_backend_for_received(fr); /* frames of a backend's own: chunks, events, retires */
  if (!owner && fr->type == TSHARE_FRAME_RETIRE) { /* nothing here is kept of that kind: nothing to close */
    if (frame_fd >= 0) close(frame_fd);
    TS_LOG(TS_LOG_WARN, "%s retires memory of kind %u, which no backend of this end keeps: ignored",
           ch->conn.peer_label, (unsigned)fr->u.retire.mem_kind);
    return TSHARE_OK;
  }
  if (frame_fd >= 0 && !owner && fr->type != TSHARE_FRAME_SHARE &&
      fr->type != TSHARE_FRAME_SET) { /* only these carry memory */
    close(frame_fd);
    frame_fd = -1;
  }
  if (fr->type != TSHARE_FRAME_SET) ts_set_on_other_frame(ch, fr->type);
  if (owner) return owner->on_frame(ch, fr, frame_fd, fd_lost);
  switch (fr->type) {
  case TSHARE_FRAME_SET:
    return ts_set_on_frame(ch, fr, frame_fd, fd_lost);
  case TSHARE_FRAME_RELEASE:
    return ts_share_apply_release(ch, &fr->u.release, true);
  case TSHARE_FRAME_SHARE:
    if ((rc = ts_backends_on_share(ch, fr)) != TSHARE_OK) {
      if (frame_fd >= 0) close(frame_fd);
      ts_share_release_back(ch, fr->u.share.share_id);
      return rc;
    }
    if (fd_lost) return ts_share_fd_lost(ch, fr, fd_lost); /* refused; the loop goes on to the next frame */
    if (share) {
      *fd = frame_fd;
      *got_share = true;
      return TSHARE_OK;
    }
    return enqueue_incoming(ch, fr, frame_fd);
  case TSHARE_FRAME_BYE:
    ch->peer_bye = true;
    (void)ts_backends_idle(ch, ts_deadline(0)); /* no share comes after it: idle work need not wait */
    return TSHARE_END;
  case TSHARE_FRAME_ERROR:
    ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_ERROR, "peer %s reported %s: %s", ch->conn.peer_label,
            tshare_status_name(fr->u.error.code), fr->u.error.message);
    TS_LOG(TS_LOG_WARN, "%s", ch->err);
    return TSHARE_E_PEER_ERROR;
  default: /* a second hello, or a frame of a backend this end has not */
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "receive: unexpected %s frame",
                   tshare_frame_type_name(fr->type));
  }
}

int ts_share_drive(tshare_channel *ch, int timeout_ms) {
  bool got;
  return drive_once(ch, ts_deadline(timeout_ms), NULL, NULL, &got, true);
}

static int channel_poll(tshare_channel *ch, int timeout_ms) {
  bool got;
  /* Once the peer said bye the answer is TSHARE_END at once, after what it
   * still sent (its releases) was read without waiting. */
  bool ended = ch->peer_bye;
  int rc = drive_once(ch, ended ? TS_DEADLINE_PASSED : ts_deadline(timeout_ms), NULL, NULL, &got, true);
  /* Drain whatever else is already buffered without waiting. */
  while (rc == TSHARE_OK) {
    int more = drive_once(ch, TS_DEADLINE_PASSED, NULL, NULL, &got, true);
    if (more == TSHARE_E_TIMEOUT) break;
    rc = more;
  }
  if (ch->peer_bye && (rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT || rc == TSHARE_E_PEER_CLOSED)) return TSHARE_END;
  return rc;
}

int tshare_channel_poll(tshare_channel *ch, int timeout_ms) {
  if (!ch) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "poll", channel_poll(ch, timeout_ms));
}

static int wait_released(tshare_channel *ch, uint64_t share_id, int timeout_ms) {
  int64_t deadline = ts_deadline(timeout_ms);
  for (;;) {
    bool done = share_id ? tshare_share_is_released(ch, share_id) != 0 : tshare_channel_outstanding(ch) == 0;
    if (done) return TSHARE_OK;
    bool got;
    int rc = drive_once(ch, deadline, NULL, NULL, &got, true);
    if (rc == TSHARE_E_PEER_CLOSED) return TSHARE_OK; /* everything it held was dropped */
    if (rc == TSHARE_END) continue;                   /* a peer that said bye still sends its releases */
    if (rc != TSHARE_OK) {
      if (rc == TSHARE_E_TIMEOUT)
        ts_errf(ch->err, sizeof ch->err, rc, "wait for release: %zu shares still held by %s", tshare_channel_outstanding(ch),
                ch->conn.peer_label);
      return rc;
    }
  }
}

int tshare_channel_wait_released(tshare_channel *ch, uint64_t share_id, int timeout_ms) {
  if (!ch) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "wait for release", wait_released(ch, share_id, timeout_ms));
}

static int peek_share(tshare_channel *ch, int timeout_ms, tshare_share_info *info) {
  if (ch->closed) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "receive: channel is closed");
  int64_t deadline = ts_deadline(timeout_ms);
  while (!ch->in_len) {
    bool got;
    int rc = drive_once(ch, deadline, NULL, NULL, &got, false);
    if (rc != TSHARE_OK) return rc;
  }
  const tshare_share_frame *s = &ch->incoming[ch->in_head].frame.u.share;
  info->share_id = s->share_id;
  info->device_type = s->device_type;
  const ts_backend *b = ts_backend_for_mem_kind(s->mem_kind);
  if (b && b->device_of) info->cuda_device = b->device_of(s);
  return TSHARE_OK;
}

int tshare_channel_peek_share(tshare_channel *ch, int timeout_ms, tshare_share_info *info) {
  if (!ch || !info) return TSHARE_E_INVALID_ARG;
  memset(info, 0, sizeof *info);
  info->cuda_device = -1;
  TS_CHANNEL_CALL(ch, "receive", peek_share(ch, timeout_ms, info));
}

int tshare_view_recv(tshare_channel *ch, int timeout_ms, tshare_view **out) {
  return tshare_view_recv_stream(ch, NULL, timeout_ms, out);
}

/* The backend's import, or in remote mode its import_remote (a backend
 * without one cannot leave the bytes on the producer). */
static int import_view(tshare_channel *ch, const tshare_frame *f, int *fd, void *stream, bool remote, tshare_view *v) {
  const tshare_share_frame *s = &f->u.share;
  if (!v->backend)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "import: share %llu is memory of kind %u, which no backend of this end imports",
                   (unsigned long long)s->share_id, s->mem_kind);
  if (!remote) return v->backend->import(ch, f, fd, stream, v);
  if (!v->backend->import_remote)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "receive: share %llu is %s, mapped here, not read remotely (remote views come over ucx:// "
                   "channels): receive it with tshare_view_recv()",
                   (unsigned long long)s->share_id, v->backend->mem_kind_name(s->mem_kind));
  return v->backend->import_remote(ch, f, v);
}

static int view_recv(tshare_channel *ch, void *stream, bool remote, int timeout_ms, tshare_view **out) {
  if (ch->closed) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "receive: channel is closed");
  tshare_frame f;
  int fd = -1;
  if (ch->in_len) {
    ts_incoming *in = &ch->incoming[ch->in_head];
    f = in->frame;
    fd = in->fd;
    if (fd >= 0) ts_conn_hold_fds(&ch->conn, -1);
    ch->in_head = (ch->in_head + 1) % ch->in_cap;
    ch->in_len--;
  } else {
    int64_t deadline = ts_deadline(timeout_ms);
    for (;;) {
      bool got;
      int rc = drive_once(ch, deadline, &f, &fd, &got, false);
      if (rc != TSHARE_OK) return rc;
      if (got) break;
    }
  }
  tshare_view *v = calloc(1, sizeof *v);
  if (!v) {
    if (fd >= 0) close(fd);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  }
  const tshare_share_frame *s = &f.u.share;
  int rc;
  v->device = -1;
  v->backend = ts_backend_for_mem_kind(s->mem_kind);
  rc = import_view(ch, &f, &fd, stream, remote, v);
  if (fd >= 0) close(fd); /* a mapping keeps the first fd of its allocation, if any */
  if (rc != TSHARE_OK) {
    free(v);
    ts_share_release_back(ch, s->share_id); /* the producer still holds the memory for this share */
    TS_LOG(TS_LOG_WARN, "refused share %llu from %s, released back: %s", (unsigned long long)s->share_id,
           ch->conn.peer_label, ch->err);
    return rc;
  }
  v->ch = ch;
  atomic_fetch_add(&ch->refs, 1);
  v->share_id = s->share_id;
  v->device_type = s->device_type;
  v->desc = s->tensor;
  v->frame = *s;
  memcpy(v->tag, s->tag, s->tag_len);
  v->tag[s->tag_len] = '\0';
  TS_LOG(TS_LOG_INFO, "received share %llu (%s, tag '%s') from %s", (unsigned long long)v->share_id, v->backend->name,
         v->tag, ch->conn.peer_label);
  *out = v;
  return TSHARE_OK;
}

int tshare_view_recv_stream(tshare_channel *ch, void *stream, int timeout_ms, tshare_view **out) {
  if (!out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  if (!ch) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "receive", view_recv(ch, stream, false, timeout_ms, out));
}

int tshare_view_recv_remote(tshare_channel *ch, int timeout_ms, tshare_view **out) {
  if (!out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  if (!ch) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "receive", view_recv(ch, NULL, true, timeout_ms, out));
}

static int view_read(tshare_view *v, int64_t offset, void *dst, size_t len) {
  tshare_channel *ch = v->ch;
  if (!v->backend->read_remote || v->data)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG,
                   "read: share %llu is not a remote view (tshare_view_recv_remote): its bytes are at "
                   "tshare_view_data()",
                   (unsigned long long)v->share_id);
  if (!dst && len) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG, "read: NULL destination");
  return v->backend->read_remote(ch, v, offset, dst, len);
}

int tshare_view_read(tshare_view *view, int64_t offset, void *dst, size_t len) {
  if (!view) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(view->ch, "read", view_read(view, offset, dst, len));
}

void *tshare_view_data(const tshare_view *v) { return v ? v->data : NULL; }
const tshare_tensor_desc *tshare_view_desc(const tshare_view *v) { return v ? &ts_view_described((tshare_view *)v)->desc : NULL; }
const char *tshare_view_tag(const tshare_view *v) { return v ? v->tag : ""; }
uint64_t tshare_view_share_id(const tshare_view *v) { return v ? v->share_id : 0; }
int tshare_view_device_type(const tshare_view *v) { return v ? v->device_type : 0; }
int tshare_view_cuda_device(const tshare_view *v) {
  return v && v->device_type == TSHARE_DEVICE_CUDA && v->memory ? v->device : -1;
}
