/* Tensor sets inside the library: the hooks through which the session
 * (session_share.c) hands set frames to session_set.c and tells it what else happens
 * on the channel. */
#ifndef TSHARE_TENSOR_SET_INTERNAL_H
#define TSHARE_TENSOR_SET_INTERNAL_H

#include "session.h"
#include "tshare/set.h"
#include "tshare/wire.h"

#include <string.h>

/* v, its descriptor and frame filled in first if it is a set member's view
 * (tshare_set_view leaves them until something reads them: a forward, the
 * descriptor asked for). Any thread. */
tshare_view *ts_view_described(tshare_view *v);

/* The backend of the memory a set member's view maps, or NULL for any other
 * view (session_set_pin.c). */
const struct ts_backend *ts_set_view_memory_backend(const tshare_view *v);

/* The number of s's memories, and its channel; memory i's backend and
 * mapping, as the set holds them. */
uint32_t ts_set_memory_count(const tshare_set *s, tshare_channel **ch);
void ts_set_memory_at(const tshare_set *s, uint32_t i, const struct ts_backend **backend, void **memory);
/* One more reference on s (tshare_set_release lets go of it). */
void ts_set_ref(tshare_set *s);

/* A set frame from the peer, with the fd that came with it (or -1 and
 * fd_lost, as ts_session_recv_by says). The fd is always consumed. A set the
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

/* A set frame's step op of set_id, its fields zero. */
static inline tshare_frame ts_set_step(uint8_t op, uint64_t set_id) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SET;
  f.u.set.op = op;
  f.u.set.set_id = set_id;
  return f;
}

/* Whether sets may be sent again as one frame on ch (TSHARE_SET_AGAIN, the
 * begin frame's layout_slot): both ends offered TSHARE_CAP_SET_AGAIN. */
static inline bool ts_set_again_agreed(const tshare_channel *ch) {
  return ch->conn.minor >= 6 && (ch->conn.self.capabilities & ch->conn.peer.capabilities & TSHARE_CAP_SET_AGAIN);
}

/* What a set's send does (session_set_slots.c): slot 0 sends it whole as
 * today; else the set's layout is in slot (1..TSHARE_SET_LAYOUT_SLOTS) of
 * the peer's: with layout_id, the set goes again from it as one frame;
 * without, it goes whole and offers the peer to keep its layout there. */
typedef struct ts_set_again_plan {
  unsigned slot;
  uint64_t layout_id;
} ts_set_again_plan;

/* The plan for a set of builder's generation whose memories would all go as
 * state (the least of theirs) now; the slot is claimed for it. */
ts_set_again_plan ts_set_slots_plan(tshare_channel *ch, uint64_t builder, uint64_t generation, ts_keep_state state);
/* The set that offered slot went out whole as layout_id, or (0) it did not,
 * or one of its memories went in a frame the peer keeps no layout of. */
void ts_set_slots_declared(tshare_channel *ch, unsigned slot, uint64_t builder, uint64_t generation,
                           uint64_t layout_id);

/* The peer lost the layout d names (TSHARE_SET_DROPPED): forgotten if its
 * slot still records it, else ignored. Never refuses anything. */
void ts_set_slots_dropped(tshare_channel *ch, const tshare_set_dropped_frame *d);

/* The receiver's notices of layouts lost (session_set_notices.c). Queue one
 * (ch->lock held): slot (1..TSHARE_SET_LAYOUT_SLOTS) no longer holds
 * layout_id; one waits per slot, the newest. None on a channel that did not
 * agree on TSHARE_CAP_SET_AGAIN. */
void ts_set_notice_dropped_locked(tshare_channel *ch, unsigned slot, uint64_t layout_id);
/* Whether a notice waits to go (ch->lock held). */
bool ts_set_notices_waiting_locked(const tshare_channel *ch);
/* Send the notices that wait by deadline (clock.h), from the thread that
 * drives the channel, before its releases (ts_share_flush_pending, which
 * looks first whether any wait): TSHARE_OK, or the send's status
 * (TSHARE_E_TIMEOUT: what did not go waits for a later flush). */
int ts_set_send_notices(tshare_channel *ch, int64_t deadline);

/* Whether memory sent as mem_kind with share_flags is kept mapped by the
 * peer until its owner retires it (then a layout of it may be kept): the
 * kept kinds, and the kinds they come from, offered to be kept. */
static inline bool ts_set_mem_keepable(uint8_t mem_kind, uint32_t share_flags) {
  bool notice = (share_flags & TSHARE_SHARE_FLAG_RETIRE_NOTICE) != 0;
  return mem_kind == TSHARE_MEM_HOST_KEPT || mem_kind == TSHARE_MEM_CUDA_HELD ||
         (notice && (mem_kind == TSHARE_MEM_HOST_MEMFD || mem_kind == TSHARE_MEM_CUDA_FD ||
                     mem_kind == TSHARE_MEM_CUDA_IPC));
}

/* A set's memory is host memory: the backend of that kind maps it, keeps
 * the producer's buffers and counts the views of a mapping. */
static inline const ts_backend *ts_set_host_backend(void) { return ts_backend_for_mem_kind(TSHARE_MEM_HOST_MEMFD); }

/* Names, unique in a set, indexed by hash (session_set.c). */
typedef const char *(*ts_set_name_at_fn)(const void *owner, size_t i);
/* The index of name among the n names of owner, or -1. */
long ts_set_name_lookup(const ts_u64map *index, const char *name, ts_set_name_at_fn name_at, const void *owner,
                        size_t n);
/* Record name i (known not to be a duplicate): 0, or -1 out of memory. */
int ts_set_name_insert(ts_u64map *index, const char *name, size_t i);

#endif
