/* Anchors: a producer's hold on another allocator's cudaMalloc segment (the
 * memory of PyTorch's default caching allocator) while its peer keeps the
 * segment's IPC mapping open between hand-offs.
 *
 * CUDA leaves closing an IPC mapping after its owner freed the memory
 * undefined, so a consumer may keep such a mapping past its last view only
 * while the producer guarantees the segment is not freed. A caching
 * allocator frees a segment only once no block in it is allocated: so the
 * producer keeps what the last released share of the segment kept alive
 * (the caller's keep, a tensor's storage), instead of dropping it at the
 * release. A newer release replaces it (any block holds the segment). Once
 * the segment went ANCHOR_IDLE_US without a share, the producer sends a
 * retire notice; the consumer closes its idle mapping and answers; only then
 * is the keep dropped, and the allocator may free the segment.
 *
 * What it costs: memory the producer's program dropped stays allocated
 * until that answer (one share's storage per segment, at most ANCHORS_MAX
 * segments per channel), about ANCHOR_IDLE_US plus a round trip while the
 * producer drives the channel. State belongs to the channel's driving
 * thread. */
#ifndef TSHARE_CUDA_ANCHOR_H
#define TSHARE_CUDA_ANCHOR_H

#include "u64map.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ANCHORS_MAX 1024        /* segments held per channel (a model's state_dict is hundreds); past it shares
                                   go without a retire notice */
#define ANCHOR_IDLE_US 100000   /* a segment this long without a share is retired, unless
                                   TSHARE_CUDA_ANCHOR_IDLE_MS says otherwise */

typedef struct ts_anchors {
  ts_u64map by_id; /* segment buffer id + 1 -> struct anchor */
  bool off; /* the peer is gone: releases drop their keep at once */
} ts_anchors;

/* A share of segment alloc_id whose release would call drop(keep): if the
 * segment can be anchored, *drop and *keep are replaced by the anchor's
 * (its release parks the keep) and true is returned: the share may promise
 * a retire notice. false leaves them as they were. */
bool ts_anchor_share(ts_anchors *set, uint64_t alloc_id, void (**drop)(void *), void **keep);

/* Segments idle since before now_us - ANCHOR_IDLE_US, with no retire notice
 * pending: into ids (at most cap), each now waiting for the peer's answer. */
size_t ts_anchors_idle(ts_anchors *set, int64_t now_us, uint64_t *ids, size_t cap);

/* Before a close: every segment not yet asked about, into ids (at most
 * cap), each now waiting for the peer's answer. */
size_t ts_anchors_retire_all(ts_anchors *set, uint64_t *ids, size_t cap);
/* How many retire notices wait for the peer's answer. */
size_t ts_anchors_pending(const ts_anchors *set);

/* The peer closed its mapping of alloc_id. false: not an anchor of this
 * channel (the caller looks elsewhere). */
bool ts_anchor_closed(ts_anchors *set, uint64_t alloc_id);

/* The peer is gone (its mappings with it): every keep dropped now. */
void ts_anchors_drop_all(ts_anchors *set);

/* Whether alloc_id is anchored with no retire notice pending: its peer
 * keeps the segment mapped, and keeps it until it answers a notice. */
bool ts_anchor_held(const ts_anchors *set, uint64_t alloc_id);

/* How many segments are anchored (statistics, tests). */
size_t ts_anchors_count(const ts_anchors *set);

#endif
