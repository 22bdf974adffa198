/* The backend table: the one way from the session to the kinds of memory.
 * A backend says which memory kinds it imports and which frame types it
 * handles, and gets hooks for the hello, for its frames, for housekeeping
 * before a receive may block, for a close, and for views (import, release,
 * share on). The session (session_*.c) looks a backend up by mem_kind or
 * frame type, or loops over them all (the ts_backends_* calls below), and
 * never names one.
 *
 * Built-in backends: backend_host.c (sealed memfds) and backend_cuda*.c
 * (CUDA IPC handles and VMM fds; backend_cuda_none.c without the toolkit),
 * listed in backends.c. Adding one touches no session file: write its table
 * and add it to backends.c's list.
 *
 * Registration from outside the library (a test's backend, compiled only
 * into the test program, tests/test_backends.c): ts_backend_register()
 * before any channel opens, from a program linked against libtshare.a (the
 * call is not exported from libtshare.so). It appends to the same list, so
 * the session finds it as it finds the built-in ones; for the memory kinds
 * and frame types it claims it stands in for a built-in backend, since the
 * wire has no kinds of its own for it.
 *
 * Per-channel state: each backend keeps its own behind ts_backend_data(ch,
 * backend), a slot of the channel's that the backend allocates (in its
 * chan_init hook, or lazily) and frees in chan_free. Per-view state: the
 * view's `memory` (the backend's mapping of the share), and its stream,
 * context and device where the memory has them.
 *
 * Hooks marked optional may be NULL. Locking: hooks run on the thread that
 * drives the channel without ch->lock, except release (any thread). */
#ifndef TSHARE_BACKEND_H
#define TSHARE_BACKEND_H

#include "tshare/channel.h"
#include "tshare/tensor.h"
#include "tshare/wire.h"

#include "tshare/share.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

struct tshare_view;
struct ts_export;
struct ts_backend;

/* Something a producer keeps alive for a share: retain adds a reference,
 * drop lets one go (drop NULL: nothing to keep). */
typedef struct ts_keep_ref {
  void (*retain)(void *keep);
  tshare_drop_fn drop;
  void *keep;
} ts_keep_ref;

/* A tensor set's memory on a producer, described by the backend that owns
 * its kind (set_source_new): members with the same backend and alloc_id
 * share it. The backend's own fields follow this head; refs counts the
 * builder and the sent sets that hold it (set_source_free at the last). */
typedef struct ts_set_source {
  const struct ts_backend *backend;
  atomic_int refs;
  uint64_t alloc_id;
  uint64_t size;   /* bytes of the memory */
  int device;      /* the device ordinal it lives on */
} ts_set_source;

/* How a producer's memory would travel to a peer in a set right now: with
 * nothing to let the peer keep it mapped, offered to be kept (its frame
 * promises a retire notice), or named as memory the peer keeps mapped (no
 * fd, no handle): only sets of such memory are sent again as one frame. */
typedef enum ts_keep_state {
  TS_KEEP_NONE = 0,
  TS_KEEP_OFFERED = 1,
  TS_KEEP_KEPT = 2
} ts_keep_state;

/* What a release hook did with the view's memory. */
typedef enum ts_release_done {
  /* Let go now: the session queues the release for the peer and sends it
   * when it can. */
  TS_RELEASE_NOW = 0,
  /* Not yet (the GPU still uses it: the backend queues the release itself
   * later), or not this view's to send (a tensor set's member). */
  TS_RELEASE_LATER = 1
} ts_release_done;

/* Whether a backend's housekeeping left work that waits (releases waiting
 * for a GPU) and how soon to look again: work queued moments ago usually
 * finishes within microseconds, so the session spins briefly before it
 * sleeps. */
typedef enum ts_backend_wait {
  TS_BACKEND_IDLE = 0, /* nothing waits */
  TS_BACKEND_SOON = 1, /* look again at once */
  TS_BACKEND_LATER = 2 /* look again in a millisecond */
} ts_backend_wait;

#define TS_MEM_KIND_BIT(kind) (1u << (kind))
#define TS_FRAME_TYPE_BIT(type) (1u << (type))

typedef struct ts_backend {
  const char *name;
  uint32_t mem_kinds;   /* TS_MEM_KIND_BIT of each TSHARE_MEM_* it imports */
  uint32_t frame_types; /* TS_FRAME_TYPE_BIT of each frame type on_frame takes */
  bool views_are_copies; /* its views hold a copy of the producer's memory (tshare_view_is_copy) */
  /* What a memory kind of its own is, for logs ("host memfd"). */
  const char *(*mem_kind_name)(int mem_kind);
  /* Optional: the local device ordinal a share of its memory lives on, -1
   * if none here (tshare_channel_peek_share). */
  int (*device_of)(const tshare_share_frame *s);

  /* ---- hello ---- */
  /* Capabilities this end offers over a transport with these TS_TRANSPORT_*
   * capabilities (conn.h). */
  uint64_t (*hello_caps)(uint32_t transport_caps);
  /* Optional: fields of its own in this end's hello (CUDA: device UUIDs). */
  void (*hello_fields)(tshare_hello *h);

  /* ---- the channel ---- */
  /* Optional: the channel opens; allocate state (ts_backend_data). */
  int (*chan_init)(tshare_channel *ch);
  /* The peer is gone or the channel closes: drop what it might keep mapped. */
  void (*peer_gone)(tshare_channel *ch);
  /* The channel's last reference is going away: free everything. */
  void (*chan_free)(tshare_channel *ch);
  /* Optional: the same in a forked child: only memory of this process's
   * own goes, touching nothing its parent uses. */
  void (*chan_free_in_child)(tshare_channel *ch);

  /* ---- frames and housekeeping ---- */
  /* Optional: a frame of a type in frame_types, or a retire frame naming
   * one of its memory kinds, with the fd that came with it (consumed) or -1
   * and fd_lost (why it could not be kept). */
  int (*on_frame)(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost);
  /* Optional: every share frame, before it is queued or refused: what came
   * for it beside the frame is filed under its id (an error refuses it). */
  int (*on_share)(tshare_channel *ch, const tshare_frame *f);
  /* Optional: a share is refused or dropped before its import: what was
   * filed under its id goes. */
  void (*share_dropped)(tshare_channel *ch, uint64_t share_id);
  /* Optional: before every receive may block: work that finished is done
   * with (releases queued), notices go out by deadline (clock.h); *wait as
   * above. A deadline, not a timeout: a turn with nothing to send, the usual
   * one, reads no clock. */
  int (*housekeeping)(tshare_channel *ch, int64_t deadline, ts_backend_wait *wait);
  /* Optional: a receive is about to wait, its releases sent and nothing of
   * the peer's buffered, or the peer said bye: work that could wait until
   * now (unmapping or closing memory its owner retired) is done here, off
   * the path of the next hand-off, and what it owes the peer goes by
   * deadline. TSHARE_E_TIMEOUT: it did not all go (a later turn sends it). */
  int (*idle)(tshare_channel *ch, int64_t deadline);
  /* Optional: before this end closes, while the peer can still answer. */
  void (*before_close)(tshare_channel *ch, int timeout_ms);
  /* Optional: a share this backend sent was released, dropped, or never
   * went out: what it held of the backend's (an event slot) is free. */
  void (*export_done)(tshare_channel *ch, const struct ts_export *e);

  /* ---- views ---- */
  /* Map share f into view v (v->ch is not set yet). *fdp is the fd that came
   * with the frame or -1; a backend that keeps it sets *fdp to -1. */
  int (*import)(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, struct tshare_view *v);
  /* Optional, for a backend whose views are copies: a tensor set's memory
   * f (a share of the set's id) copied into view v as import would, but
   * nothing is released here: the set is released whole once complete.
   * *copied is the bytes the set's earlier memories copied; the backend
   * adds this memory's and refuses a set whose total it cannot hold. */
  int (*import_in_set)(tshare_channel *ch, const tshare_frame *f, uint64_t *copied, struct tshare_view *v);
  /* Optional, remote mode (tshare_view_recv_remote), for a backend whose
   * views are copies: import_remote reads nothing and keeps the share (the
   * producer holds its memory until the view's release, which is then
   * TS_RELEASE_NOW); read_remote copies len bytes of the view's memory,
   * starting offset bytes from its element [0,...,0] (inside the layout's
   * span: checked here), into dst. */
  int (*import_remote)(tshare_channel *ch, const tshare_frame *f, struct tshare_view *v);
  int (*read_remote)(tshare_channel *ch, struct tshare_view *v, int64_t offset, void *dst, size_t len);
  /* Optional: the host buffer of this process's that holds a view's
   * `memory` (a copy landed in tshare_host_buffer memory), or NULL. */
  struct tshare_host_buffer *(*memory_host_buffer)(void *memory);
  /* The view is done: let go of its memory. Any thread; never blocks. The
   * session then queues the release (TS_RELEASE_NOW), frees v and drops
   * its channel reference. */
  ts_release_done (*release)(struct tshare_view *v);
  /* Optional: the same for a view a forked child inherited: only this
   * process's own mapping goes, nothing is queued. */
  void (*release_in_child)(struct tshare_view *v);
  /* Share (part of) v on ch: desc is relative to the allocation and checked
   * against it; e (release, owner and user_data set) is consumed. */
  int (*share_view)(tshare_channel *ch, struct tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                    const char *tag, struct ts_export *e, int timeout_ms, uint64_t *share_id);

  /* ---- memory held by more than one view (tensor sets), optional ---- */
  /* A producer's memory object (host: a tshare_host_buffer) kept alive by
   * one more share, and let go of by it. */
  void (*source_retain)(void *source);
  void (*source_release)(void *source);
  /* Optional: how the producer's memory object goes to ch in a set: *kept
   * when the peer keeps it mapped (no fd travels); else with its fd, and
   * *share_flags say whether the peer may keep it (it is then lent to ch).
   * Without the hook it always travels with its fd. */
  int (*source_lend)(tshare_channel *ch, void *source, bool *kept, uint32_t *share_flags);
  /* Optional: host memory of a set (source, a tshare_host_buffer) on a
   * channel that carries no fds: remote_check says whether ch's peer takes
   * it another way (an error in ch->err); send_remote sends what must
   * precede it (its rkey frame) and the memory frame f (type, op, set_id and
   * index set; the rest filled here). */
  int (*set_remote_check)(tshare_channel *ch, void *source);
  int (*set_send_remote)(tshare_channel *ch, void *source, tshare_frame *f, int timeout_ms);
  /* Optional: a share of host memory (source, a tshare_host_buffer) on a
   * channel that carries no fds, read by the peer; device_type
   * TSHARE_DEVICE_CUDA marks GPU bytes staged there (session_stage.c), which
   * set_send_remote also keeps when f's device_type says so. */
  int (*share_remote)(tshare_channel *ch, void *source, const tshare_tensor_desc *desc, int device_type,
                      const char *tag, void *user_data, int timeout_ms, uint64_t *share_id);
  /* Optional: how the producer's memory object would go to ch in a set right
   * now (ts_keep_state), asking nothing of anyone. Without it: TS_KEEP_NONE. */
  ts_keep_state (*source_keep_state)(tshare_channel *ch, void *source);
  /* One more or one less reference on a view's `memory` (ch->lock held);
   * the last one unmaps it. */
  void (*memory_ref_locked)(tshare_channel *ch, void *memory);
  void (*memory_unref_locked)(tshare_channel *ch, void *memory);
  /* The same in a forked child: only its own copy of the mapping goes. */
  void (*memory_unref_in_child)(tshare_channel *ch, void *memory);
  /* Optional: a set this end took whole (not refused) offered to let it
   * keep memory mapped (its memory frame's share_flags): kept as a share's
   * would be (ch->lock held). A refused set keeps nothing new. */
  void (*memory_keep_locked)(tshare_channel *ch, void *memory, uint32_t share_flags);

  /* ---- device memories of tensor sets, optional ----
   * A backend without them has its memory refused in sets. Host memory
   * goes the sets' own way (session_set*.c), through the hooks above. */
  /* Producer: the memory holding a member: foreign memory at ptr (buf NULL)
   * or the backend's own buffer buf, laid out as desc from there (checked
   * to lie inside buf). *out is new (refs 1), *offset where ptr or buf
   * starts in it; user_keep (optional)
   * is what keeps foreign memory alive (the source takes a reference for
   * the memory's own use); *member_keep gets what keeps this member alive
   * (a reference taken: own buffers), or a zeroed one. last (optional) is
   * the memory the builder's previous device member went into: one that
   * holds foreign memory at ptr alive may serve as *out (a reference taken),
   * with no driver call. */
  int (*set_source_new)(void *ptr, void *buf, const tshare_tensor_desc *desc, const ts_keep_ref *user_keep,
                        ts_set_source *last, ts_set_source **out, uint64_t *offset, ts_keep_ref *member_keep,
                        char *err, size_t cap);
  void (*set_source_free)(ts_set_source *src);
  /* Producer: whether ch's peer takes this memory in a set, before any
   * frame of the set goes (an error in ch->err). */
  int (*set_check)(tshare_channel *ch, const ts_set_source *src);
  /* Optional: how src would go to ch right now (ts_keep_state), as
   * source_keep_state. Without it: TS_KEEP_NONE (never sent again as one
   * frame). */
  ts_keep_state (*set_keep_state)(tshare_channel *ch, const ts_set_source *src);
  /* Optional: src goes again from the peer's kept layout (no memory frame):
   * *hold gets what the set keeps until its release, as set_send_mem's
   * (zeroed: nothing). A failure sends the set whole instead. */
  int (*set_again_hold)(tshare_channel *ch, const ts_set_source *src, ts_keep_ref *hold);
  /* Producer: send src as memory frame f (type, op, set_id and index set;
   * the rest filled here), after what must precede it (chunk frames).
   * *hold gets what the set keeps until its release (zeroed: nothing). */
  int (*set_send_mem)(tshare_channel *ch, const ts_set_source *src, tshare_frame *f, ts_keep_ref *hold,
                      int timeout_ms);
  /* Producer: after the last member: the set's one ordering point on stream
   * (NULL: the default stream) of src's device, into the end frame (flags
   * and event) and e (what it holds, given back by export_done). */
  int (*set_order)(tshare_channel *ch, const ts_set_source *src, void *stream, tshare_frame *end,
                   struct ts_export *e, int timeout_ms);
  /* Optional, staging (session_stage.c): the bytes of GPU memory copied to
   * host memory dst once the work queued on stream (of its device) so far
   * is done; the call returns when they are there, or TSHARE_E_TIMEOUT
   * when that work did not finish in timeout_ms (< 0: no limit; nothing
   * is copied then). stage_out reads len bytes at ptr, set_stage_out the
   * whole of src. */
  int (*stage_out)(const void *ptr, uint64_t len, void *stream, void *dst, int timeout_ms, char *err, size_t cap);
  int (*set_stage_out)(const ts_set_source *src, void *stream, void *dst, int timeout_ms, char *err, size_t cap);
  /* Consumer: a set's memory is mapped through on_share and import as a
   * share of the set's id (stream NULL) would be, one memory at a time. */
  /* Consumer: the end frame's event: work on the default stream of
   * memory's device waits for it. */
  int (*set_wait)(tshare_channel *ch, const tshare_frame *end, void *memory);
  /* Consumer: the set's n memories of this backend are done with (its last
   * reference went; any thread, never blocks). TS_RELEASE_NOW: let go of
   * here, the session queues the release; TS_RELEASE_LATER: work queued on
   * them still runs, and the backend queues set_id's release once it ran.
   * set_id 0: a pin's references (session_set_pin.c), let go of the same
   * way once that work ran, with no release to queue. */
  ts_release_done (*set_release)(tshare_channel *ch, void *const *memories, size_t n, uint64_t set_id);
} ts_backend;

/* ---- the registry (backends.c) ---- */

#define TS_BACKENDS_MAX 8

/* Add a backend (a test's) before any channel opens. TSHARE_E_LIMIT when
 * TS_BACKENDS_MAX are registered, TSHARE_E_INVALID_ARG for a table that
 * misses a required hook or claims a memory kind or frame type another
 * registered backend has (a built-in one's it takes over). */
int ts_backend_register(const ts_backend *b);

/* The backend that imports mem_kind, or NULL. */
const ts_backend *ts_backend_for_mem_kind(int mem_kind);
/* The backend whose on_frame takes frames of this type, or NULL. */
const ts_backend *ts_backend_for_frame(int type);
/* The backend whose on_frame takes this received frame, or NULL: by its
 * type, except a retire frame naming a memory kind (minor 4), which goes to
 * the backend of that kind (NULL if it has no on_frame: the session refuses
 * such a frame). */
const ts_backend *ts_backend_for_received(const tshare_frame *f);
/* The backend's state slot in ch (NULL until it puts something there). */
void **ts_backend_data(tshare_channel *ch, const ts_backend *b);

/* Every backend in turn, for what concerns them all. */
uint64_t ts_backends_hello(tshare_hello *self, uint32_t transport_caps); /* returns the capabilities */
int ts_backends_chan_init(tshare_channel *ch);
void ts_backends_peer_gone(tshare_channel *ch);
void ts_backends_chan_free(tshare_channel *ch);
void ts_backends_chan_free_in_child(tshare_channel *ch);
int ts_backends_on_share(tshare_channel *ch, const tshare_frame *f);
void ts_backends_share_dropped(tshare_channel *ch, uint64_t share_id);
int ts_backends_housekeeping(tshare_channel *ch, int64_t deadline, ts_backend_wait *wait);
int ts_backends_idle(tshare_channel *ch, int64_t deadline);
void ts_backends_before_close(tshare_channel *ch, int timeout_ms);
void ts_backends_export_done(tshare_channel *ch, const struct ts_export *e);

#endif
