/* tshare/rendezvous.h - channels between processes that meet by a socket path.
 *
 * tshare-launch wires its roles itself. Processes started some other way
 * meet through a Unix socket: one listens on a path, the others connect to
 * it, and every accepted connection is a channel of its own.
 *
 * The socket lives in a private directory. tshare_listen() creates the
 * directory (mode 0700) if it does not exist, and refuses one that is a
 * symlink, that another user owns, or that group or others may enter
 * (TSHARE_E_PERMISSION): no other user can connect, replace the socket or
 * race its creation. Both ends then check who the other is with SO_PEERCRED
 * (channel.h: same uid unless allow_uid says otherwise).
 *
 * A name without a '/' is placed in the default directory,
 * $XDG_RUNTIME_DIR/tshare, or /tmp/tshare-UID where that is unset.
 *
 * A name "ucx://HOST:PORT/NAME" is a channel across hosts instead: the
 * listener binds TCP port PORT on HOST (0.0.0.0: every interface), both ends
 * prove the shared token (tshare_channel_options.token or TSHARE_TOKEN), and
 * frames travel in UCX active messages (docs/transport.md). UCX is opened at
 * run time: without it these calls fail with TSHARE_E_UNSUPPORTED naming the
 * missing library. tshare_listener_path() is then the address.
 */
#ifndef TSHARE_RENDEZVOUS_H
#define TSHARE_RENDEZVOUS_H

#include "tshare/channel.h"
#include "tshare/errors.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tshare_listener tshare_listener;

/* The socket path a name stands for (a path with a '/' is returned as is). */
TSHARE_API int tshare_rendezvous_path(const char *name, char *out, size_t cap, tshare_error *err);

/* Listen on name (see above). A socket file left behind by a listener that
 * is gone is replaced; a live listener on the path (even one too busy to
 * accept) is TSHARE_E_STATE. Never waits: the liveness probe is a
 * non-blocking connect, which the live listener's accept drops. */
TSHARE_API int tshare_listen(const char *name, tshare_listener **out, tshare_error *err);

/* Accept the next peer and open a channel on it (the hello and the peer
 * check included), all within timeout_ms; each hello also within the
 * options' handshake_timeout_ms. A connection that fails (a peer that hangs
 * up or never says hello, another user, another version) is dropped and the
 * accept waits for the next one: TSHARE_E_TIMEOUT when no usable peer came
 * in time, its detail naming the last one dropped. Connections are taken one
 * at a time, so a peer that never says hello delays the next by up to
 * handshake_timeout_ms. */
TSHARE_API int tshare_listener_accept(tshare_listener *l, const tshare_channel_options *opts, int timeout_ms,
                                      tshare_channel **out, tshare_error *err);

TSHARE_API int tshare_listener_fd(const tshare_listener *l);           /* readable when a peer waits */
TSHARE_API const char *tshare_listener_path(const tshare_listener *l); /* the socket's path */

/* Stop listening and remove the socket file (not the directory). Channels
 * accepted from it live on. NULL is a no-op. */
TSHARE_API void tshare_listener_close(tshare_listener *l);

/* Connect to the listener on name and open a channel, all within timeout_ms:
 * waits for the listener to appear (TSHARE_E_NOT_FOUND when it did not), for
 * room in its backlog and for its hello (TSHARE_E_TIMEOUT). */
TSHARE_API int tshare_connect(const char *name, const tshare_channel_options *opts, int timeout_ms,
                              tshare_channel **out, tshare_error *err);

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_RENDEZVOUS_H */
