/* The host backend's own declarations, shared by its files:
 *   backend_host.c         the table: import, release, share on
 *   backend_host_buffer.c  the producer's buffers (sealed memfds) and their references
 *   backend_host_keep.c    kept host mappings: what a consumer keeps mapped past its
 *                          views, what a producer lends, and their retire frames
 *                          (docs/architecture.md's glossary) */
#ifndef TSHARE_BACKEND_HOST_H
#define TSHARE_BACKEND_HOST_H

#include "session.h"
#include "u64map.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* One mapped allocation on the consumer side: a view's `memory`. */
typedef struct ts_mapping {
  uint64_t alloc_id;
  void *base;
  size_t size;
  unsigned long ino, dev; /* of the memfd: a reused alloc_id cannot alias another file */
  size_t views;           /* live views into it */
  int fd;                 /* the memfd, kept so views can be shared on */
  uint64_t forward_id;    /* this process's alloc id for it when shared on */
  bool kept;              /* kept mapped while idle, until its owner retires it */
  bool fd_budgeted;       /* its fd counts against the kept mappings' fd budget */
  bool unsealed;          /* came as TSHARE_MEM_HOST_FD: shared on as such */
  bool retired_in_use;    /* its owner retired it while views held it: its last view defers the unmap */
  struct ts_mapping *next_retired; /* in host_chan's retired list */
} ts_mapping;

/* This backend's state in a channel. */
typedef struct host_chan {
  /* consumer */
  ts_u64map mappings; /* alloc_id -> ts_mapping, under ch->lock */
  size_t kept;        /* mappings kept while idle, under ch->lock */
  ts_id_vec kept_notices; /* allocations newly kept: the producer hears so (retire, closed = KEPT) */
  /* Idle mappings their owner retired, their fds closed: unmapped once a
   * receive would wait (backend.h's idle), after the releases went. The
   * producer retires a model's memory as it waits for the next one's
   * release, and 290 munmaps (each the last reference: the pages are freed
   * there) would hold that release back by a millisecond. Only the thread
   * inside a channel call (a retire read, idle, peer gone) or the channel's
   * free touches them: views released elsewhere never reach a retired one. */
  ts_mapping *retired;
  size_t retired_count, retired_bytes;
  /* Retired mappings whose last view went afterwards (on any thread, under
   * ch->lock): moved to `retired` at the next idle, so the munmaps of a
   * model a consumer held past its retire (tensors kept across versions)
   * are not made where its tensors are dropped. */
  ts_mapping *retired_later;
  size_t retired_later_bytes;
  /* producer */
  ts_u64map lent;          /* buffer id + 1 -> struct lent_buffer: buffers the peer may keep mapped */
  ts_id_vec freed_notices; /* lent buffers gone: the peer hears so (retire, closed = FREED) */
  uint64_t unused_seen;    /* ts_host_buffers_unused_generation() when lent was last looked at */
} host_chan;

extern const ts_backend ts_host_backend;

host_chan *ts_host_chan(tshare_channel *ch);

/* backend_host_keep.c: a retired mapping whose last view went (ch->lock
 * held, m out of the mappings) left for the next idle turn to unmap; false
 * where it must go now (a closed channel, which has no idle turns left, or
 * past the bounds of what may wait). */
bool ts_host_defer_unmap_locked(tshare_channel *ch, ts_mapping *m);

/* backend_host_buffer.c: references held by shares and by lending channels */
struct tshare_host_buffer;
uint64_t ts_host_next_alloc_id(void); /* host allocation ids, unique in the process */
void ts_host_buffer_retain(struct tshare_host_buffer *buf);
void ts_host_buffer_release(void *buf);
void ts_host_buffer_lend(struct tshare_host_buffer *buf);
void ts_host_buffer_lend_end(struct tshare_host_buffer *buf);
/* Nothing but lending channels holds it: its creator destroyed it and no share is out. */
bool ts_host_buffer_only_lent(const struct tshare_host_buffer *buf);
/* Something holds it beside its creator (a share, a lending channel, a set
 * builder or sent set). */
bool ts_host_buffer_held_by_others(const struct tshare_host_buffer *buf);
/* The same, but for one reference more (a share's, about to be let go). */
bool ts_host_buffer_only_lent_but_one(const struct tshare_host_buffer *buf);
uint64_t ts_host_buffers_unused_generation(void);
/* A wrapped file not sealed against shrinking: it travels as TSHARE_MEM_HOST_FD, never lent. */
bool ts_host_buffer_unsealed(const struct tshare_host_buffer *buf);

/* backend_host.c: one view of m went (ch->lock held); the last one of a
 * mapping not kept unmaps it. */
void ts_host_drop_mapping_locked(tshare_channel *ch, ts_mapping *m);
/* The same in a forked child, touching nothing its parent uses. */
void ts_host_drop_mapping_in_child(tshare_channel *ch, ts_mapping *m);
void ts_host_unmap(ts_mapping *m);

/* backend_host_keep.c */
/* How a share of buf goes to ch: *kept when the peer keeps it mapped (no fd,
 * TSHARE_MEM_HOST_KEPT); otherwise with its fd, and *share_flags says
 * whether the peer may keep it (the buffer is then lent to the channel). */
int ts_host_lend(tshare_channel *ch, struct tshare_host_buffer *buf, bool *kept, uint32_t *share_flags);
/* The same for a buffer of a tensor set (the source_lend hook): lent only to
 * a peer with TSHARE_CAP_SET_HOST_KEPT, never an unsealed file. */
int ts_host_lend_in_set(tshare_channel *ch, void *source, bool *kept, uint32_t *share_flags);
/* How ts_host_lend_in_set would send it now, changing nothing (the
 * source_keep_state hook). */
ts_keep_state ts_host_keep_state_in_set(tshare_channel *ch, void *source);
/* A new or reused mapping m that came with share_flags (ch->lock held):
 * kept if the producer offers it and this end has room. */
void ts_host_maybe_keep_locked(tshare_channel *ch, ts_mapping *m, uint32_t share_flags);
/* A kept mapping's last view went (ch->lock held): it stays mapped; its fd
 * stays within the budget of fds of idle mappings. */
void ts_host_kept_idle_locked(ts_mapping *m);
/* The mapping a TSHARE_MEM_HOST_KEPT share names (ch->lock held), or an
 * error when this end keeps no such mapping. */
int ts_host_kept_mapping_locked(tshare_channel *ch, const tshare_share_frame *s, ts_mapping **out);
void ts_host_export_done(tshare_channel *ch, const struct ts_export *e);
int ts_host_on_retire(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost);
int ts_host_idle(tshare_channel *ch, int64_t deadline); /* unmaps what the owner retired (backend.h's idle) */
int ts_host_housekeeping(tshare_channel *ch, int64_t deadline, ts_backend_wait *wait);
void ts_host_peer_gone(tshare_channel *ch);
void ts_host_keep_free(tshare_channel *ch, host_chan *h); /* the channel goes: lent buffers and budgets too */

#endif
