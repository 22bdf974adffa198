/* Tensor sets inside the library: the hooks through which the session
 * (session_share.c) hands set frames to session_set.c and tells it what else happens
 * on the channel. */
#ifndef TSHARE_TENSOR_SET_INTERNAL_H
#define TSHARE_TENSOR_SET_INTERNAL_H

#include "session.h"
#include "tshare/wire.h"

/* A set frame from the peer, with the fd that came with it (or -1 and
 * fd_lost, as ts_session_recv says). The fd is always consumed. A set the
 * peer got wrong is refused (released back) and the error kept for the next
 * tshare_set_recv(); TSHARE_OK then, so other callers driving the channel go
 * on. */
int ts_set_on_frame(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost);
/* Another frame of type `type` came: one that may not come inside a set
 * (anything but release, event and retire) cuts off the set in progress. */
void ts_set_on_other_frame(tshare_channel *ch, int type);
/* The peer is gone: the set in progress is dropped. */
void ts_set_peer_gone(tshare_channel *ch);
/* The channel goes: sets received but never taken are freed (their
 * mappings go with the channel's). */
void ts_set_free_queued(tshare_channel *ch);

#endif
