/* The CUDA backend's own header, shared by its files around one struct, a
 * channel's CUDA state (struct ts_cuda_chan):
 *   backend_cuda.c         the table, the channel's state, events, hello,
 *                          housekeeping, peer gone, free
 *   backend_cuda_send.c    the producer: shares, the event pool
 *   backend_cuda_recv.c    the consumer: chunk frames, imports, releases that
 *                          wait for the GPU, announced events
 *   backend_cuda_keep.c    lent memory and kept mappings (docs/architecture.md's
 *                          glossary): watched runs, kept runs, retire frames
 * Producer-side state belongs to the thread that drives the channel, like
 * the rest of a channel; the releases waiting for the GPU are under
 * ch->lock, since views are released from any thread. */
#ifndef TSHARE_BACKEND_CUDA_H
#define TSHARE_BACKEND_CUDA_H

#include "backend.h"
#include "cuda_anchor.h"
#include "cuda_internal.h"
#include "session.h"
#include "u64map.h"
#include "vec.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Releases waiting for the GPU are looked at again at once while the newest
 * is younger than this: one queued moments ago usually finishes within
 * microseconds. */
#define GPU_SPIN_US 200

#define POOL_MAX 256 /* events a producer keeps per channel; beyond that a share syncs its stream */

typedef struct peer_event {
  bool announced;
  CUipcEventHandle handle;
  CUevent ev; /* opened on first use */
  CUcontext ctx;
  uint32_t last_gen;
} peer_event;

typedef struct drain {
  uint64_t share_id;
  CUevent done; /* recorded on the view's stream at release */
  CUcontext ctx;
  ts_cuda_mapping *imp;
  int64_t queued_us;
  ts_cuda_mapping **more; /* a tensor set's other mappings (malloc'd), let go of with imp */
  size_t nmore;
} drain;

/* A release event to record again: one per release would cost a create and
 * a destroy each time. */
typedef struct spare_event {
  CUcontext ctx;
  CUevent ev;
} spare_event;

#define SPARES_MAX 64

TS_VEC_DEFINE(drain_list, drain)

typedef struct lent_alloc {
  ts_cuda_alloc *alloc;
  bool retire_queued; /* its retire notice went, or waits in the channel's freed_notices */
  bool peer_keeps;    /* VMM memory the peer said it keeps mapped until retired: shares of it go without the fd */
} lent_alloc;

struct ts_cuda_chan {
  /* producer */
  CUcontext pool_ctx;
  uint32_t nslots;
  CUevent pool[POOL_MAX];
  uint32_t gen[POOL_MAX];
  bool busy[POOL_MAX];
  ts_u64map lent; /* buffer id -> lent_alloc: lent allocations (tshare's own) the peer may keep open */
  /* consumer */
  peer_event *events; /* TSHARE_EVENT_SLOTS_MAX entries, allocated with the first event frame */
  drain_list drains; /* under ch->lock */
  spare_event spares[SPARES_MAX]; /* under ch->lock */
  size_t nspares;
  ts_id_vec closed_notices; /* TSHARE_RETIRE_CLOSED answers to send */
  /* The owner's retire notices (TSHARE_RETIRE_FREED) not acted on yet: their
   * mappings are closed and answered once a receive would wait (the idle
   * hook), so that a retire queued ahead of a share does not hold up the
   * share (a new model's set behind the retire of the model before it). */
  ts_id_vec retiring;
  int64_t retiring_since_us; /* when the oldest of them came */
  /* producer: retire notices (TSHARE_RETIRE_FREED) decided and not sent yet. What
   * they name is already marked as asked (or no longer watched), so a notice
   * a timeout held back goes with a later flush, never from the marks. */
  ts_id_vec freed_notices;
  /* Chunk frames of VMM memory, gathered until their share comes (then
   * filed under its share id until it is imported or dropped). */
  struct chunk_set *gathering;
  ts_u64map chunk_sets; /* share id + 1 -> chunk_set */
  /* producer: runs of VMM chunks (another allocator's) shared with a retire
   * notice, so the peer keeps them mapped while idle; looked at every
   * millisecond the channel is driven, and retired once a chunk was
   * unmapped or mapped anew (its buffer id changed). */
  ts_u64map watched_runs; /* run id + 1 -> watched_run */
  /* producer: cudaMalloc segments of another allocator held while the peer
   * keeps them mapped between hand-offs (cuda_anchor.h) */
  ts_anchors anchors;
  int64_t watched_checked_us; /* the last look at the runs and the anchors */
  size_t watch_pos;           /* where in watched_runs the next look goes on */
  unsigned unused_seen;       /* ts_cuda_alloc_unused_generation() when every lent allocation was last looked at */
  /* consumer: VMM mappings of the peer's watched runs this end keeps (a
   * reference each) until the peer retires them, having told the peer so
   * (retire frame, TSHARE_RETIRE_KEPT), which then shares them without their fds. */
  ts_u64map kept_runs;    /* alloc id + 1 -> ts_cuda_mapping */
  ts_u64map held_shares;  /* share id + 1 -> ts_cuda_mapping: a reference taken when such a share arrived */
  ts_id_vec kept_notices;   /* TSHARE_RETIRE_KEPT notices to send */
};

#define KEPT_RUNS_MAX 1024 /* mappings a consumer keeps for one channel's peer (a model in expandable segments is a run per tensor); past it shares keep carrying fds */

#define WATCHED_RUNS_MAX 1024 /* runs watched per channel; past it shares go without a retire notice */
#define WATCH_CHECK_US 1000 /* how often a driven channel looks at its runs and anchors */
#define WATCH_CHUNKS_PER_LOOK 32 /* chunks of watched runs a look asks the driver about, at most */

/* A watched run keeps the fds it was exported as, while the process-wide
 * budget allows: the next share of it sends them again without the
 * driver's export. Once the peer keeps the run mapped they are closed (its
 * shares go without fds). A run past the budget is watched all the same and
 * exported again for each share that carries fds. */
struct watched_run {
  int n;
  bool peer_keeps; /* the peer keeps it mapped until retired: shares of it go without fds */
  int *fd;         /* n, all -1 when the run keeps none */
  uint64_t v[];    /* n chunk bases, then their n buffer ids */
};

/* Chunks 1..count-1 of one share's VMM memory (chunk 0 rides on the share). */
struct chunk_set {
  uint64_t alloc_id;
  uint32_t count, n;
  int lost; /* why a chunk's fd could not be kept (errno or TS_FD_OVER_BUDGET), 0 if none */
  int fd[TSHARE_CHUNKS_MAX];
  uint64_t size[TSHARE_CHUNKS_MAX];
};

/* u64map keys must be nonzero; a buffer id of 0 is not ruled out. */
#define MAPKEY(buffer_id) ((buffer_id) + 1)


extern const ts_backend ts_cuda_backend;

/* backend_cuda.c */
struct ts_cuda_chan *ts_cuda_chan_if_used(tshare_channel *ch); /* NULL until the channel first uses CUDA */
struct ts_cuda_chan *ts_cuda_chan_of(tshare_channel *ch);      /* allocated on first use; NULL: out of memory */
CUresult ts_cuda_event_create(const ts_cuda_api *cu, CUevent *ev, unsigned flags);
CUresult ts_cuda_event_open(const ts_cuda_api *cu, CUevent *ev, CUipcEventHandle h);
void ts_cuda_event_destroy(const ts_cuda_api *cu, CUevent ev);

/* backend_cuda_send.c */
void ts_cuda_export_done(tshare_channel *ch, const ts_export *e);
bool ts_cuda_fds_travel(const tshare_channel *ch); /* GPU memory that travels as fds can reach the peer */
/* Chunks 1..n-1 of VMM memory alloc_id, each with its fd, before the frame
 * that carries chunk 0. */
int ts_cuda_send_chunks(tshare_channel *ch, uint64_t alloc_id, const ts_vmm_chunks *chunks, int64_t deadline);
/* Order the consumer after the work queued on stream of ctx (see there). */
int ts_cuda_order_after(tshare_channel *ch, CUcontext ctx, void *stream, int timeout_ms, ts_export *e,
                        uint8_t *frame_flags, uint32_t *slot, uint32_t *generation);
/* Lend owned allocation a to ch's peer, which may keep it mapped while idle. */
int ts_cuda_lend(tshare_channel *ch, ts_cuda_alloc *a);
int ts_cuda_share_view(tshare_channel *ch, tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                       const char *tag, ts_export *e, int timeout_ms, uint64_t *share_id);

/* backend_cuda_recv.c */
void ts_cuda_chunk_set_free(tshare_channel *ch, struct chunk_set *set);
int ts_cuda_import_view(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, tshare_view *v);
/* Share f mapped into v, with its chunks (set) or the reference to memory
 * this end keeps mapped (*held, taken when it is used); c: ch's CUDA state
 * (NULL: out of memory). */
int ts_cuda_import_share(tshare_channel *ch, struct ts_cuda_chan *c, const tshare_frame *f, int *fdp, void *stream,
                         tshare_view *v, const struct chunk_set *set, ts_cuda_mapping **held);
/* The view's stream waits on the producer's event named in share frame f. */
int ts_cuda_wait_on_producer_event(tshare_channel *ch, struct ts_cuda_chan *c, const ts_cuda_api *cu,
                                   const tshare_frame *f, CUcontext ctx, void *stream);
/* A release of share_id that waits for the GPU: done recorded on the
 * stream; the mappings go when it completed (ch->lock held). */
bool ts_cuda_push_drain_locked(struct ts_cuda_chan *c, uint64_t share_id, CUevent done, CUcontext ctx,
                               ts_cuda_mapping *imp, ts_cuda_mapping **more, size_t nmore);
CUevent ts_cuda_spare_take_locked(struct ts_cuda_chan *c, CUcontext ctx);
void ts_cuda_drain_put(drain *d); /* a finished drain's mappings go */
ts_release_done ts_cuda_view_release(tshare_view *v);
int ts_cuda_on_event(tshare_channel *ch, const tshare_frame *f);
int ts_cuda_on_chunk(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost);
int ts_cuda_on_share(tshare_channel *ch, const tshare_frame *f);
void ts_cuda_share_dropped(tshare_channel *ch, uint64_t share_id);
void ts_cuda_finish_drains(tshare_channel *ch, struct ts_cuda_chan *c, const ts_cuda_api *cu, ts_backend_wait *busy);

/* backend_cuda_set.c: the memories of tensor sets */
int ts_cuda_set_source_new(void *ptr, void *buf, const tshare_tensor_desc *desc, const ts_keep_ref *user_keep,
                           ts_set_source *last, ts_set_source **out, uint64_t *offset, ts_keep_ref *member_keep,
                           char *err, size_t cap);
void ts_cuda_set_source_free(ts_set_source *src);
/* Staging for a peer on another host: the table's stage_out hooks. */
int ts_cuda_stage_out(const void *ptr, uint64_t len, void *stream, void *dst, int timeout_ms, char *err, size_t cap);
int ts_cuda_set_stage_out(const ts_set_source *src, void *stream, void *dst, int timeout_ms, char *err, size_t cap);
int ts_cuda_set_check(tshare_channel *ch, const ts_set_source *src);
int ts_cuda_set_send_mem(tshare_channel *ch, const ts_set_source *src, tshare_frame *f, ts_keep_ref *hold,
                         int timeout_ms);
int ts_cuda_set_order(tshare_channel *ch, const ts_set_source *src, void *stream, tshare_frame *end, ts_export *e,
                      int timeout_ms);
int ts_cuda_set_wait(tshare_channel *ch, const tshare_frame *end, void *memory);
ts_release_done ts_cuda_set_release(tshare_channel *ch, void *const *memories, size_t n, uint64_t set_id);
/* How src would go to ch now (the set_keep_state hook): only VMM runs of
 * another allocator are kept by the peer until retired (TSHARE_MEM_CUDA_HELD). */
ts_keep_state ts_cuda_set_keep_state(tshare_channel *ch, const ts_set_source *src);
/* The set_again_hold hook: a segment sent again from the peer's kept layout
 * is anchored anew, as its memory frame would have been. */
int ts_cuda_set_again_hold(tshare_channel *ch, const ts_set_source *src, ts_keep_ref *hold);
void ts_cuda_memory_ref_locked(tshare_channel *ch, void *memory);
void ts_cuda_memory_unref_locked(tshare_channel *ch, void *memory);

/* backend_cuda_keep.c */
/* The fds of a VMM run's chunks for a share, watching the run (see there). */
int ts_cuda_vmm_fds(tshare_channel *ch, struct ts_cuda_chan *c, uint64_t run_id, ts_vmm_chunks *chunks, bool *owned,
                    bool *watched, bool *held);
/* Whether the run is watched for retiring, and whether the peer keeps it
 * mapped (its shares then go as TSHARE_MEM_CUDA_HELD), changing nothing. */
void ts_cuda_run_state(struct ts_cuda_chan *c, uint64_t run_id, bool *watched, bool *held);
/* Every chunk of the watched run still the allocation it was shared as: a
 * driver call per chunk, where exporting the run again takes four and more. */
bool ts_cuda_run_still_mapped(struct ts_cuda_chan *c, uint64_t run_id);
void ts_cuda_watched_runs_free(struct ts_cuda_chan *c);
void ts_cuda_keep_run(tshare_channel *ch, struct ts_cuda_chan *c, uint64_t alloc_id, ts_cuda_mapping *imp);
void ts_cuda_drop_kept_run(struct ts_cuda_chan *c, uint64_t alloc_id);
int ts_cuda_on_retire(tshare_channel *ch, const tshare_frame *f);
int ts_cuda_send_notices(tshare_channel *ch, struct ts_cuda_chan *c, const ts_cuda_api *cu, int64_t deadline);
/* The backend table's idle entry: the owner's retires left for later
 * (c->retiring) acted on, their answers sent. */
int ts_cuda_idle(tshare_channel *ch, int64_t deadline);
void ts_cuda_before_close(tshare_channel *ch, int timeout_ms);

#endif
