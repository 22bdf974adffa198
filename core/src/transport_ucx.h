/* The UCX transport's endpoint: one UCP worker per channel (its fd is what
 * poll loops watch), one UCP endpoint to the peer's worker, and the
 * bootstrap TCP socket the two ends met on, kept open as the peer's
 * heartbeat of last resort (its end is the peer's end).
 *
 * Made in two steps around the bootstrap's exchange of worker addresses
 * (ucx_bootstrap.c): ts_ucx_endpoint_new() gives this end's address,
 * ts_ucx_endpoint_connect() connects to the peer's and hands out the fds a
 * connection is opened on: ts_conn_init(TS_CONN_UCX, rfd, wfd) claims the
 * endpoint by them (as the loopback transport's ends are claimed). */
#ifndef TSHARE_TRANSPORT_UCX_H
#define TSHARE_TRANSPORT_UCX_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>

typedef struct ts_ucx_endpoint ts_ucx_endpoint;

/* A worker of the process's UCP context and its address (valid until the
 * endpoint goes). TSHARE_E_UNSUPPORTED without UCX, the reason in msg. */
int ts_ucx_endpoint_new(ts_ucx_endpoint **out, const void **address, size_t *address_len, char *msg, size_t cap);

/* Connect e to the peer's worker address, and wait (up to timeout_ms) until
 * UCX has set up what carries it: the channel's first frames then leave at
 * once. e takes boot_fd. On success *rfd
 * and *wfd are the fds for ts_conn_init(TS_CONN_UCX, ...), which owns e from
 * then on; on failure e and boot_fd are freed. */
int ts_ucx_endpoint_connect(ts_ucx_endpoint *e, const void *peer_address, size_t len, int boot_fd, int timeout_ms,
                            int *rfd, int *wfd, char *msg, size_t cap);

/* Free an endpoint that was never connected. NULL is a no-op. */
void ts_ucx_endpoint_free(ts_ucx_endpoint *e);

/* What remote memory (backend_ucx*.c) reads through: the worker and the
 * endpoint of a connection over UCX, and the lock every UCP call on that
 * worker takes (the transport's own calls take it too). */
struct ts_conn;
typedef struct ts_ucx_link {
  struct ts_ucp_worker *worker;
  struct ts_ucp_ep *ep;
  pthread_mutex_t *lock;
} ts_ucx_link;

/* c's link, or false when c is not a connection over UCX (or is closed). */
bool ts_ucx_link_of(const struct ts_conn *c, ts_ucx_link *out);
/* Whether UCX said the peer failed or its bootstrap socket ended (lock held). */
bool ts_ucx_peer_failed_locked(const struct ts_conn *c);

#endif
