/* Building raw frames for tests that bypass the share API (to send what a
 * hostile or hand-rolled peer would). */
#ifndef TSHARE_TEST_FRAME_UTIL_H
#define TSHARE_TEST_FRAME_UTIL_H

#include "tshare/tensor.h"
#include "tshare/wire.h"

#include <string.h>

/* Share 1 of allocation 1: a host memfd (sent beside the frame) of
 * alloc_size bytes holding tensor. */
static inline tshare_frame memfd_share_frame(uint64_t alloc_size, tshare_tensor_desc tensor) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SHARE;
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  f.u.share.share_id = 1;
  f.u.share.alloc_id = 1;
  f.u.share.mem_kind = TSHARE_MEM_HOST_MEMFD;
  f.u.share.device_type = TSHARE_DEVICE_CPU;
  f.u.share.alloc_size = alloc_size;
  f.u.share.tensor = tensor;
  return f;
}

/* A ring control frame (TSHARE_RING_NUDGE, _SOCKET_NEXT) as a peer writes it. */
static inline tshare_frame ring_op_frame(uint8_t op) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RING;
  f.u.ring.op = op;
  return f;
}

#endif
