/* Retire frames out of a backend's queue of allocation ids: the one way
 * every backend that keeps or lends memory tells its peer (backend.h). */
#include "session.h"
#include "wire_checks.h"

#include <string.h>

int ts_retire_send_ids(tshare_channel *ch, uint8_t closed, uint8_t mem_kind, ts_id_vec *ids, int timeout_ms) {
  int64_t deadline = ts_deadline(timeout_ms);
  size_t at = 0;
  int rc = TSHARE_OK;
  while (at < ids->len && rc == TSHARE_OK) {
    tshare_frame f;
    ts_frame_clear(&f, TSHARE_FRAME_RETIRE);
    f.u.retire.closed = closed;
    f.u.retire.mem_kind = mem_kind;
    for (size_t i = at; i < ids->len && f.u.retire.count < TSHARE_RELEASE_MAX; i++)
      f.u.retire.alloc_ids[f.u.retire.count++] = ids->items[i];
    rc = ts_channel_send(ch, &f, -1, ts_remaining(deadline));
    if (rc == TSHARE_OK) at += f.u.retire.count;
  }
  if (at) ts_id_vec_remove(ids, 0, at);
  return rc;
}
