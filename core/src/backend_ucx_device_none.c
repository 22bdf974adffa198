/* A build without the CUDA toolkit: GPU bytes staged by a peer on another
 * host cannot be placed on a GPU here, so the hello does not offer
 * TSHARE_CAP_UCX_STAGED and no peer sends them (one that does is refused). */
#include "backend_ucx.h"

#include "error_detail.h"

#include <stdlib.h>

bool ts_ucx_device_offered(void) { return false; }

int ts_ucx_device_target(void *stream) {
  (void)stream;
  return -1;
}

int ts_ucx_device_land(tshare_channel *ch, ucx_chan *u, const ts_ucx_link *link, uint64_t alloc_id, uint64_t address,
                       uint64_t len, void *stream, ucx_landing **out) {
  (void)u, (void)link, (void)alloc_id, (void)address, (void)len, (void)stream;
  *out = NULL;
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NO_DEVICE,
                 "import: GPU memory staged by the peer: tshare was built without CUDA (no CUDA toolkit at build "
                 "time)");
}

void ts_ucx_device_free_locked(ucx_chan *u, ucx_landing *l, void *stream) {
  (void)u, (void)stream;
  free(l);
}

ts_backend_wait ts_ucx_device_reap(tshare_channel *ch, ucx_chan *u) {
  (void)ch, (void)u;
  return TS_BACKEND_IDLE;
}

void ts_ucx_device_chan_free(ucx_chan *u) { ucx_landing_vec_free(&u->freeing); }
