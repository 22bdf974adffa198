/* The session's releases on the consumer side: share ids released by views
 * (from any thread) wait on the pending list under ch->lock, and go out in
 * release frames from the thread that drives the channel, or at once from
 * another thread when that needs no waiting. */
#include "error_detail.h"
#include "session.h"
#include "session_set.h"
#include "wire_checks.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Move the oldest queued release ids, at most one frame's worth, into a
 * release frame (with ch->lock held); its count is 0 when none were queued. */
static void take_pending_locked(tshare_channel *ch, tshare_frame *f) {
  ts_frame_clear(f, TSHARE_FRAME_RELEASE); /* the ids past the count are never read */
  uint32_t n =
      ch->pending.len < ch->conn.limits.max_release_ids ? (uint32_t)ch->pending.len : ch->conn.limits.max_release_ids;
  if (n == 0) return; /* pending may still be NULL */
  memcpy(f->u.release.share_ids, ch->pending.items, n * sizeof(uint64_t));
  ts_id_vec_remove(&ch->pending, 0, n);
  f->u.release.count = n;
}

/* Tell the peer, before their releases reach it, that shares were refused:
 * otherwise a producer would only see them come back unused. */
static void send_refusal_notice(tshare_channel *ch) {
  if (!ch->refused || ch->refusal_told) return;
  ch->refusal_told = true; /* once until a share is taken again: a flood gets one notice, not one per share */
  char msg[TSHARE_ERROR_TEXT_MAX + 1];
  snprintf(msg, sizeof msg,
           "refused share %llu, and refuses more while %zu fds of shares wait here for tshare_view_recv() "
           "(max_unclaimed_fds); each is released back",
           (unsigned long long)ch->refused_first, ch->conn.fdq.budget);
  ts_conn_send_error(&ch->conn, TSHARE_E_LIMIT, msg);
}

/* A release frame that did not go out: its ids are queued again. */
static bool push_pending_locked(tshare_channel *ch, uint64_t share_id);

/* Releases that found no room, back on the list. The driving thread that
 * put them back wakes nobody: a wake would end its own next wait at once, a
 * spin while the peer makes no room. Another thread tells it (tell_driver). */
static void put_back(tshare_channel *ch, const tshare_frame *f, bool tell_driver) {
  pthread_mutex_lock(&ch->lock);
  for (uint32_t i = 0; i < f->u.release.count; i++) (void)push_pending_locked(ch, f->u.release.share_ids[i]);
  if (tell_driver) ts_conn_wake(&ch->conn);
  pthread_mutex_unlock(&ch->lock);
}

int ts_share_flush_pending(tshare_channel *ch, int64_t deadline) {
  send_refusal_notice(ch);
  pthread_mutex_lock(&ch->lock);
  bool notices = ts_set_notices_waiting_locked(ch), releases = ch->pending.len > 0;
  pthread_mutex_unlock(&ch->lock);
  if (!notices && !releases) return TSHARE_OK; /* the usual turn of a receive: one look, no clock read */
  /* Layouts lost go first: the peer forgets them before it sees the sets
   * refused come back, and sends their builders whole next. */
  int rc = notices ? ts_set_send_notices(ch, deadline) : TSHARE_OK;
  if (rc != TSHARE_OK) return rc;
  for (;;) {
    tshare_frame f;
    pthread_mutex_lock(&ch->lock);
    take_pending_locked(ch, &f);
    pthread_mutex_unlock(&ch->lock);
    if (f.u.release.count == 0) return TSHARE_OK;
    rc = ts_channel_send(ch, &f, -1, ts_remaining(deadline));
    if (rc == TSHARE_E_TIMEOUT) put_back(ch, &f, false); /* nothing went: they go with a later flush */
    if (rc != TSHARE_OK) return rc;               /* a dead peer no longer needs the releases */
  }
}

void ts_share_send_releases_now(tshare_channel *ch) {
  /* The driving thread's own releases wait for its next receive, which sends
   * them in batches; a blocked driving thread was woken and sends them. The
   * send lock is only tried: a driving thread that holds it sends them. */
  if (ts_conn_driven_by_caller(&ch->conn)) return;
  pthread_mutex_lock(&ch->lock);
  /* A layout lost waits to go ahead of them: the driving thread sends both. */
  if (ch->closed || ch->pending.len == 0 || ts_conn_driver_blocked(&ch->conn) || ts_set_notices_waiting_locked(ch)) {
    pthread_mutex_unlock(&ch->lock);
    return;
  }
  tshare_frame f;
  take_pending_locked(ch, &f);
  pthread_mutex_unlock(&ch->lock);
  if (ts_conn_send_now(&ch->conn, &f)) return;
  put_back(ch, &f, true); /* nothing went: back to the driving thread, which is told */
}

/* A release on the pending list, with ch->lock held. False: not queued. */
static bool push_pending_locked(tshare_channel *ch, uint64_t share_id) {
  if (ch->closed) return false; /* closing dropped everything the peer gave us */
  /* Out of memory: the share stays outstanding at the producer until the
   * channel closes, which frees it. Degraded, never lost data. */
  return ts_id_vec_push(&ch->pending, share_id) == TSHARE_OK;
}

/* Queue a release for the driving thread and wake it if it is blocked in a
 * receive. Called with ch->lock held, which also keeps wake_fd open. */
void ts_share_queue_release_locked(tshare_channel *ch, uint64_t share_id) {
  if (push_pending_locked(ch, share_id)) ts_conn_wake(&ch->conn);
}

/* Release a share back at once, unused. */
void ts_share_release_back(tshare_channel *ch, uint64_t share_id) {
  pthread_mutex_lock(&ch->lock);
  ts_share_queue_release_locked(ch, share_id);
  pthread_mutex_unlock(&ch->lock);
}

