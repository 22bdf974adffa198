/* What the lifetime protocol asks of the CUDA side beyond its backend table
 * (backend.h): its frames, its GPU-side housekeeping, its event slots. Built
 * from backend_cuda.c with CUDA, from backend_cuda_none.c without: the callers need no
 * #if. */
#ifndef TSHARE_CUDA_HOOKS_H
#define TSHARE_CUDA_HOOKS_H

#include "tshare/channel.h"
#include "tshare/wire.h"

#include <stdbool.h>
#include <stdint.h>

struct tshare_view;

/* Hello: the UUIDs of the devices (when the driver is already loaded; a
 * hello never loads it). The backend itself is ts_cuda_backend (backend.h). */
void ts_cuda_hello_devices(tshare_hello *h);

/* Event and retire frames from the peer. */
int ts_cuda_on_frame(tshare_channel *ch, const tshare_frame *f);

/* Chunk frames: gathered (fd kept, counted against the fd budget; fd -1 with
 * fd_lost when it could not be kept) until their share comes. */
int ts_cuda_on_chunk(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost);
/* A share frame arrived: the chunks gathered for it are filed under its id
 * (an error when they and the share disagree). */
int ts_cuda_on_share(tshare_channel *ch, const tshare_frame *f);
/* A share is refused or dropped before its import: its chunks' fds close. */
void ts_cuda_drop_chunks(tshare_channel *ch, uint64_t share_id);

/* Driver-side housekeeping before every receive: releases whose GPU work has
 * finished move to the pending list, retire notices and acks go out.
 * *gpu_wait says whether releases still wait for the GPU and how soon to
 * look again: a release queued moments ago usually finishes within
 * microseconds, so the caller spins briefly before it sleeps. */
typedef enum ts_gpu_wait {
  TS_GPU_IDLE = 0, /* nothing waits */
  TS_GPU_SOON = 1, /* the newest waiting release is under TS_GPU_SPIN_US old: look again at once */
  TS_GPU_LATER = 2 /* look again in a millisecond */
} ts_gpu_wait;
#define TS_GPU_SPIN_US 200
int ts_cuda_flush(tshare_channel *ch, int timeout_ms, ts_gpu_wait *gpu_wait);

/* Before this end closes: the peer is asked to close the mappings it keeps
 * of segments held for it (cuda_anchor.h) and given up to timeout_ms to
 * answer (or hang up), so that none is freed under its mapping. */
void ts_cuda_before_close(tshare_channel *ch, int timeout_ms);

/* A share holding event slot `slot` was released or dropped. */
void ts_cuda_slot_free(tshare_channel *ch, int slot);

#endif
