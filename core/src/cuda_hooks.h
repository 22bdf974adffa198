/* What the channel and the lifetime protocol ask of the CUDA side. Built from
 * cuda_share.c with CUDA, from cuda_none.c without: the callers need no #if. */
#ifndef TSHARE_CUDA_HOOKS_H
#define TSHARE_CUDA_HOOKS_H

#include "tshare/channel.h"
#include "tshare/wire.h"

#include <stdbool.h>
#include <stdint.h>

struct tshare_view;

/* Hello: capability bits and the UUIDs of the devices (when the driver is
 * already loaded; a hello never loads it). */
uint64_t ts_cuda_hello_caps(void);
void ts_cuda_hello_devices(tshare_hello *h);

/* Event and retire frames from the peer. */
int ts_cuda_on_frame(tshare_channel *ch, const tshare_frame *f);

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

/* Map a CUDA share into view v (consumer side). *fdp is the fd that came with
 * the frame (VMM memory) or -1; a new mapping takes it and sets *fdp to -1. */
int ts_cuda_import(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, struct tshare_view *v);

/* Share (part of) received CUDA view v on ch; desc->byte_offset is relative to
 * the producer's allocation and already checked. e is consumed. */
struct ts_export;
int ts_cuda_share_view(tshare_channel *ch, struct tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                       const char *tag, struct ts_export *e, int timeout_ms, uint64_t *share_id);

/* A CUDA view's release: queued until its stream's work is done. */
void ts_cuda_view_release(struct tshare_view *v);

/* A share holding event slot `slot` was released or dropped. */
void ts_cuda_slot_free(tshare_channel *ch, int slot);

/* The peer is gone or the channel closes: drop what it might have kept mapped. */
void ts_cuda_peer_gone(tshare_channel *ch);

/* The channel's last reference is going away. */
void ts_cuda_chan_free(tshare_channel *ch);

#endif
