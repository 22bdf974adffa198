/* The producer's exports: what each share sent on a channel keeps alive until
 * the peer releases it, in ch->exports under the share's id.
 *
 * One lock discipline: ch->exports and ch->next_share_id are changed and read
 * only under ch->lock. The thread inside a call registers and sends shares
 * and applies the peer's releases (session_share.c, session_set_send.c), but
 * the accessors (tshare_channel_outstanding, tshare_share_is_released) may run
 * on any thread meanwhile, e.g. a sender polling for a release while another
 * thread receives. The lock is held only around the map itself: an export's
 * release and the on_release callback run after it was taken out, unlocked
 * (a callback may call the channel again). An export leaves the map only on
 * the thread inside a call, so that thread may use one it found after the
 * lock was let go. */
#include "tshare/share.h"

#include "session.h"

#include <stdlib.h>

void ts_export_drop(ts_export *e) {
  e->release(e->owner);
  free(e);
}

int ts_export_register(tshare_channel *ch, ts_export *e) {
  pthread_mutex_lock(&ch->lock);
  e->share_id = ch->next_share_id;
  int rc = ts_u64map_put(&ch->exports, e->share_id, e);
  pthread_mutex_unlock(&ch->lock);
  return rc == 0 ? TSHARE_OK : TSHARE_E_NOMEM;
}

void ts_export_sent(tshare_channel *ch) {
  pthread_mutex_lock(&ch->lock);
  ch->next_share_id++;
  pthread_mutex_unlock(&ch->lock);
}

ts_export *ts_export_take(tshare_channel *ch, uint64_t share_id) {
  pthread_mutex_lock(&ch->lock);
  ts_export *e = ts_u64map_remove(&ch->exports, share_id);
  pthread_mutex_unlock(&ch->lock);
  return e;
}

ts_export *ts_export_find(tshare_channel *ch, uint64_t share_id) {
  pthread_mutex_lock(&ch->lock);
  ts_export *e = ts_u64map_get(&ch->exports, share_id);
  pthread_mutex_unlock(&ch->lock);
  return e;
}

size_t tshare_channel_outstanding(const tshare_channel *ch) {
  if (!ch) return 0;
  tshare_channel *c = (tshare_channel *)ch; /* logically const: only the lock is taken */
  pthread_mutex_lock(&c->lock);
  size_t n = c->exports.count;
  pthread_mutex_unlock(&c->lock);
  return n;
}

int tshare_share_is_released(const tshare_channel *ch, uint64_t share_id) {
  if (!ch || share_id == 0) return -1;
  tshare_channel *c = (tshare_channel *)ch; /* logically const: only the lock is taken */
  pthread_mutex_lock(&c->lock);
  int released = share_id >= c->next_share_id ? -1 : ts_u64map_get(&c->exports, share_id) ? 0 : 1;
  pthread_mutex_unlock(&c->lock);
  return released;
}
