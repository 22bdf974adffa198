/* The hello and the peer's identity: both ends' hello frames, what the
 * kernel says about the peer where the transport knows it (uid, pid), how
 * messages name the peer, and the key state kept across channels uses for
 * it. The shared-memory ring, when both hellos ask for it, is set up right
 * after (transport_ring.h).
 *
 * Whether the peer may be served at all beyond the transport's own checks
 * (the same boot, for memory that cannot cross machines) is the session's
 * decision: it sets ts_conn.admit_peer (ts_hello_check_same_boot()), which
 * the hello asks first. */
#ifndef TSHARE_HELLO_H
#define TSHARE_HELLO_H

#include "conn.h"

/* The hello on c: self (name, capabilities, devices filled by the caller;
 * the rest here) goes out, the peer's comes in and is checked (with
 * TS_TRANSPORT_PEER_CREDENTIALS, the uid the kernel reports against
 * allow_uid: getuid(), that number, or TS_CONN_ANY_UID). When both hellos
 * carry TSHARE_CAP_RING on a transport passing fds, each end then sends the
 * ring it will write into and maps the peer's. */
int ts_conn_hello(ts_conn *c, const tshare_hello *self, long allow_uid, int timeout_ms);

/* TSHARE_OK when the peer's hello says it runs in this boot of this machine
 * (or either end could not tell), else TSHARE_E_PEER_MISMATCH with the
 * detail written. Tells the peer nothing: the caller decides. */
int ts_hello_check_same_boot(ts_conn *c);

/* The key for memory a frame says is owned by claimed_pid (0: the peer's
 * own): peer_key for the peer's own memory; for memory it forwards, its
 * claim kept apart from every other peer's. */
uint64_t ts_conn_origin_key(const ts_conn *c, uint32_t claimed_pid);

#endif
