/* The session's memory backends: how one kind of memory is imported into a
 * view, let go of, and shared on. backend_host.c (sealed memfds) and
 * backend_cuda.c (CUDA IPC handles and VMM fds; backend_cuda_none.c without the
 * toolkit) are peers behind this table: session_share.c picks one by a share's
 * mem_kind and looks inside neither. CUDA's own frames (events, retire
 * notices) and its housekeeping stay behind cuda_hooks.h. */
#ifndef TSHARE_BACKEND_H
#define TSHARE_BACKEND_H

#include "tshare/channel.h"
#include "tshare/tensor.h"
#include "tshare/wire.h"

#include <stdint.h>

struct tshare_view;
struct ts_export;

typedef struct ts_backend {
  const char *name;
  /* Capabilities this end offers in its hello over a channel of this kind. */
  uint64_t (*hello_caps)(tshare_channel_kind kind);
  /* Map share f into view v (v->ch is not set yet). *fdp is the fd that came
   * with the frame or -1; a backend that keeps it sets *fdp to -1. */
  int (*import)(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, struct tshare_view *v);
  /* The view is done: let go of its memory, queue its release, free v and
   * drop its channel reference. Any thread; never blocks. */
  void (*release)(struct tshare_view *v);
  /* Share (part of) v on ch: desc is relative to the allocation and checked
   * against it; e (release, owner and user_data set) is consumed. */
  int (*share_view)(tshare_channel *ch, struct tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                    const char *tag, struct ts_export *e, int timeout_ms, uint64_t *share_id);
  /* The peer is gone or the channel closes: drop what it might keep mapped. */
  void (*peer_gone)(tshare_channel *ch);
  /* The channel's last reference is going away. */
  void (*chan_free)(tshare_channel *ch);
} ts_backend;

extern const ts_backend ts_host_backend; /* backend_host.c */
extern const ts_backend ts_cuda_backend; /* backend_cuda.c, or backend_cuda_none.c */

/* Every backend, for what concerns them all (hello, peer gone, free). */
#define TS_BACKENDS                                                                                                    \
  { &ts_host_backend, &ts_cuda_backend }

#endif
