/* The receiver's side of layouts lost (wire.h: TSHARE_SET_DROPPED). A layout
 * the peer may still send sets again from, which this end no longer holds
 * (a set that would have declared it refused, an AGAIN it could not serve,
 * a layout it could not keep), is told to the peer: else the peer keeps
 * sending that builder again and every set of it is refused. One notice
 * waits per slot under ch->lock, from any step of a set's assembly, until
 * the thread that drives the channel sends it ahead of the releases of the
 * sets refused, so the peer forgets the layout before it sees them back. */
#include "session.h"
#include "session_set.h"

void ts_set_notice_dropped_locked(tshare_channel *ch, unsigned slot, uint64_t layout_id) {
  if (!ts_set_again_agreed(ch) || slot == 0 || slot > TSHARE_SET_LAYOUT_SLOTS || layout_id == 0) return;
  ch->set_dropped[slot - 1] = layout_id; /* the newest: the peer's slot records no older one */
  ts_conn_wake(&ch->conn);
}

bool ts_set_notices_waiting_locked(const tshare_channel *ch) {
  for (unsigned i = 0; i < TSHARE_SET_LAYOUT_SLOTS; i++)
    if (ch->set_dropped[i]) return true;
  return false;
}

int ts_set_send_notices(tshare_channel *ch, int64_t deadline) {
  for (unsigned i = 0; i < TSHARE_SET_LAYOUT_SLOTS; i++) {
    pthread_mutex_lock(&ch->lock);
    uint64_t layout_id = ch->set_dropped[i];
    ch->set_dropped[i] = 0;
    pthread_mutex_unlock(&ch->lock);
    if (!layout_id) continue;
    tshare_frame f = ts_set_step(TSHARE_SET_DROPPED, layout_id);
    f.u.set.u.dropped = (tshare_set_dropped_frame){(uint8_t)(i + 1), layout_id};
    int rc = ts_channel_send(ch, &f, -1, ts_remaining(deadline));
    if (rc == TSHARE_E_TIMEOUT) { /* nothing went: it waits again, unless a newer one came meanwhile */
      pthread_mutex_lock(&ch->lock);
      if (!ch->set_dropped[i]) ch->set_dropped[i] = layout_id;
      pthread_mutex_unlock(&ch->lock);
    }
    if (rc != TSHARE_OK) return rc;
  }
  return TSHARE_OK;
}
