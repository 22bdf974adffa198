/* The ring transport: frames without fds through a pair of shared-memory
 * rings (ring.h), riding on a Unix socket that carries the fd frames, the
 * nudges for a peer asleep in poll(), and the hang-up. The hello sets it up
 * when both ends asked for it; from then on it is the connection's frame
 * transport (ts_conn.t), the socket its stream.
 *
 * Order across the two paths: an fd frame goes on the socket first, then a
 * SOCKET_NEXT entry marks its place in the ring; a receive meeting that
 * entry takes the next frame from the socket. */
#ifndef TSHARE_TRANSPORT_RING_H
#define TSHARE_TRANSPORT_RING_H

#include "conn.h"
#include "ring.h"
#include "spin_policy.h"

/* The ring transport's state, c->frame_data. */
typedef struct ts_ring_link {
  ts_ring out, in;     /* the ring this end writes, and the peer's */
  tshare_decoder *dec; /* the bytes of `in`, checked like the socket's */
  uint8_t *spill;      /* ring bytes read while a send waited (driving thread) */
  size_t spill_len, spill_off;
  bool socket_next; /* the ring said: the next frame is on the socket */
  /* The two ring frames this end sends, encoded once at setup. */
  uint8_t socket_next_frame[32], nudge_frame[32];
  size_t op_len;
  unsigned markers_owed; /* under send_lock: SOCKET_NEXT entries not yet in the ring (owed_pending) */
  bool has_early;        /* early: a socket frame read before its ring entry came */
  tshare_frame early;
  ts_fd_entry early_fd;
  bool early_found;
  ts_spin_policy spin; /* when a receive spins before it sleeps (driving thread) */
  int64_t hup_recv_us; /* when a receive that would not wait last asked the socket for a hang-up */
  int64_t hup_send_us; /* when a send last asked (under send_lock) */
} ts_ring_link;

/* After both hellos, on a socket: send the ring this end writes into (cap
 * bytes), map the peer's, and make the ring c's frame transport. A failure
 * is told to the peer and ends the channel (both hellos asked for it). */
int ts_ring_transport_setup(ts_conn *c, uint32_t cap, int64_t deadline);

/* The ring state of c, NULL when c does not use the ring. */
static inline ts_ring_link *ts_ring_link_of(const ts_conn *c) {
  return ts_conn_uses_ring(c) ? (ts_ring_link *)c->frame_data : NULL;
}

#endif
