/* Meeting a peer across hosts: a TCP listener at HOST:PORT (ucx_address.h),
 * where the two ends exchange, before any UCX traffic, the channel's name,
 * the shared token and their UCP worker addresses; then a UCX channel opens
 * on the endpoint (transport_ucx.h) and says its hello over UCX.
 *
 * The token (tshare_channel_options.token, else TSHARE_TOKEN) is compared in
 * constant time; a peer with a wrong or missing one is refused with a reason
 * both ends can read. The TCP connection stays open for the channel's life:
 * its end is the peer's end (a killed peer is seen at once). */
#ifndef TSHARE_UCX_BOOTSTRAP_H
#define TSHARE_UCX_BOOTSTRAP_H

#include "tshare/channel.h"

#include <stddef.h>

#define TS_UCX_TOKEN_MAX 255
#define TS_UCX_TOKEN_ENV "TSHARE_TOKEN"

typedef struct ts_ucx_listener ts_ucx_listener;

/* Bind and listen at address ("ucx://HOST:PORT/NAME"); msg says why not. */
int ts_ucx_listen(const char *address, ts_ucx_listener **out, char *msg, size_t cap);
/* As tshare_listener_accept(), for a UCX listener. */
int ts_ucx_accept(ts_ucx_listener *l, const tshare_channel_options *opts, int timeout_ms, tshare_channel **out,
                  tshare_error *err);
/* As tshare_connect(), to a UCX address. */
int ts_ucx_connect(const char *address, const tshare_channel_options *opts, int timeout_ms, tshare_channel **out,
                   tshare_error *err);
int ts_ucx_listener_fd(const ts_ucx_listener *l);
const char *ts_ucx_listener_address(const ts_ucx_listener *l);
void ts_ucx_listener_close(ts_ucx_listener *l);

#endif
