/* Internal layout of a channel: the connection (conn.h: frames, fds, the
 * hello) and the session above it (the lifetime protocol: session_share.c,
 * session_channel.c for channel.h's calls, session_set.c for tensor sets),
 * which reaches the memory backends through their table (backend.h). */
#ifndef TSHARE_SESSION_H
#define TSHARE_SESSION_H

#include "backend.h"
#include "clock.h"
#include "conn.h"
#include "tshare/channel.h"
#include "u64map.h"
#include "vec.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TS_INCOMING_MAX 4096 /* shares received but not yet taken by view_recv */

/* What a sent share keeps alive; release() runs once when the peer releases it
 * or the channel ends. */
typedef struct ts_export {
  uint64_t share_id;
  void *user_data;
  void (*release)(void *owner);
  void *owner;
  /* What the share holds of the backend that sent it (CUDA: an event slot),
   * given back through its export_done hook; backend NULL when nothing. */
  const struct ts_backend *backend;
  int backend_slot;
} ts_export;

/* A received share, as the consumer holds it. */
struct tshare_view {
  struct tshare_channel *ch;        /* holds a reference */
  const struct ts_backend *backend; /* the memory's kind (backend.h) */
  void *memory;                     /* the backend's mapping of the share's allocation */
  void *stream;                     /* GPU memory: the stream the view is used on */
  void *ctx;                        /* GPU memory: the context that maps it */
  int device;                       /* GPU memory: that context's device ordinal */
  uint64_t share_id;
  int device_type;
  void *data;
  tshare_tensor_desc desc;
  tshare_share_frame frame; /* as received: what a forward sends on */
  char tag[TSHARE_TAG_MAX + 1];
};

/* Share or allocation ids waiting to go out in frames. */
TS_VEC_DEFINE(ts_id_vec, uint64_t)

typedef struct ts_incoming {
  tshare_frame frame;
  int fd;
} ts_incoming;

/* A set layout this end offered its peer to keep (producer side of sets
 * sent again): the builder and its generation whose set declared it, the
 * layout id (0: none, or its offer is still on its way), when it was last
 * used (least recently used goes first), and a layout the peer said it lost
 * while its offer was still on its way (never recorded then). */
typedef struct ts_set_layout_slot {
  uint64_t builder, generation, layout_id, used, dropped;
} ts_set_layout_slot;

struct tshare_channel {
  atomic_int refs;      /* the user's handle + one per live view */
  pthread_mutex_t lock; /* mappings, pending releases, closed flag; taken before the conn's locks */
  ts_conn conn;         /* the connection layer */
  bool closed;          /* the user closed it; views may still live */
  bool peer_bye;
  bool bye_sent; /* this end said bye: close does not say it again */
  char err[TSHARE_ERROR_MSG_MAX];
  tshare_channel_options opts;
  char name[TSHARE_HELLO_NAME_MAX + 1];

  /* producer side: shares sent and not yet released; both under lock
   * (ts_export_register and the other ts_export_* calls) */
  uint64_t next_share_id;
  ts_u64map exports;

  /* consumer side */
  ts_id_vec pending; /* share ids released but not yet sent, under lock */
  ts_incoming *incoming; /* ring of received shares */
  size_t in_head, in_len, in_cap;
  /* Shares refused because the channel held too many unreceived ones; the
   * peer is told with an error frame before their releases go out. */
  uint64_t refused, refused_first;
  bool refusal_told;

  void *backend_data[TS_BACKENDS_MAX]; /* each backend's own state (ts_backend_data) */
  struct ts_stage_cache *stages; /* producer: GPU memory staged for a peer on another host (session_stage.c) */
  struct ts_set_rx *set_rx;  /* tensor sets being received and waiting (session_set.c); NULL until one comes */
  ts_set_layout_slot set_layouts[TSHARE_SET_LAYOUT_SLOTS]; /* under lock (session_set_slots.c) */
  uint64_t set_layout_clock;
  /* consumer side of sets sent again: per slot, the layout this end lost and
   * has yet to tell the peer of (0: none), under lock (session_set_notices.c) */
  uint64_t set_dropped[TSHARE_SET_LAYOUT_SLOTS];

  /* Who may call (channel.h's thread and fork rules): the process that
   * opened it, one thread of it at a time. */
  long owner_pid;
  atomic_uint call_state;  /* TS_CALL_BUSY while a thread is inside a call; TS_CALL_CLOSING once closed */
  atomic_ulong call_owner; /* ts_thread_tag() of that thread, 0 when none */
  unsigned call_depth;     /* its nested calls (from its callbacks); only that thread touches it */
};

#define TS_CALL_BUSY 1u
#define TS_CALL_CLOSING 2u

static inline int ts_channel_send(tshare_channel *ch, const tshare_frame *f, int fd, int timeout_ms) {
  return ts_conn_send(&ch->conn, f, fd, timeout_ms);
}

/* session_channel.c */
void ts_channel_unref(tshare_channel *ch);

/* A channel over the connection's transport `kind` (transport.h), which
 * takes rfd and wfd as tshare_channel_open_pipes does: the public opens for
 * the public kinds, and in-process transports for tests. */
int ts_channel_open_on(ts_conn_kind kind, int rfd, int wfd, const tshare_channel_options *opts, tshare_channel **out,
                       tshare_error *err);
/* Whether ch was opened by another process: this one is a child forked
 * after it opened, and may only drop its own copies of what it holds. */
bool ts_channel_foreign(const tshare_channel *ch);
/* Begin a call named what ("receive", "share") on ch: TSHARE_OK, or a
 * refusal (TSHARE_E_BUSY: another thread is inside a call; TSHARE_E_STATE:
 * closing, or foreign) whose detail the calling thread reads with
 * tshare_channel_last_error(). The thread inside a call may call again
 * (from a callback). Every TSHARE_OK is paired with ts_channel_leave(). */
int ts_channel_enter(tshare_channel *ch, const char *what);
/* End the call; returns rc. A close asked for meanwhile happens here: the
 * caller must not touch ch afterwards. */
int ts_channel_leave(tshare_channel *ch, int rc);
/* A close is waiting for the call in progress: a wait inside it stops. */
static inline bool ts_channel_close_waits(tshare_channel *ch) {
  return atomic_load_explicit(&ch->call_state, memory_order_relaxed) == (TS_CALL_BUSY | TS_CALL_CLOSING);
}
/* The body of a public call returning a status: expr runs between enter and
 * leave, and a refusal is returned without running it. */
#define TS_CHANNEL_CALL(ch, what, expr)                                                                                \
  do {                                                                                                                 \
    int ts_entered_ = ts_channel_enter((ch), (what));                                                                  \
    return ts_entered_ != TSHARE_OK ? ts_entered_ : ts_channel_leave((ch), (expr));                                    \
  } while (0)

/* session_retire.c: the ids of ids in retire frames (closed: a
 * tshare_retire_kind; mem_kind 0 for CUDA memory, as before minor 4); those
 * that went leave ids, the rest go with a later call. */
int ts_retire_send_ids(tshare_channel *ch, uint8_t closed, uint8_t mem_kind, ts_id_vec *ids, int timeout_ms);

/* session_share.c */
/* The next frame from the peer by deadline (clock.h: a caller's loop reads
 * no clock per turn), the session's housekeeping done while it waits:
 * releases queued here or on other threads go out (the peer may wait for
 * them before it sends), GPU releases are looked after. A frame
 * announcing an fd comes with it in *fd_out, or with *fd_out -1 and *fd_lost
 * saying why it could not be kept (an errno such as EMFILE, or
 * TS_FD_OVER_BUDGET); a missing fd is a protocol error. fds riding on frames
 * that announce none are closed. */
int ts_session_recv_by(tshare_channel *ch, tshare_frame *f, int *fd_out, int *fd_lost, int64_t deadline);
/* strict: an id not outstanding is the peer's error (TSHARE_E_PROTOCOL, in
 * ch->err); else it is passed over without a word (a raw receive's, whose
 * caller may have sent that share itself). */
int ts_share_apply_release(tshare_channel *ch, const tshare_release_frame *r, bool strict);
/* A share whose fd could not be kept (lost: an errno or TS_FD_OVER_BUDGET):
 * released back to the peer, and the reason put in ch->err. Returns
 * TSHARE_E_LIMIT, or TSHARE_OK for a refusal the peer is told about. */
int ts_share_fd_lost(tshare_channel *ch, const tshare_frame *f, int lost);
void ts_share_drop_all(tshare_channel *ch, int status); /* peer gone or channel closed */
/* Releases and layout notices owed go out by deadline (clock.h); with
 * nothing owed, one look under the lock and no clock read. */
int ts_share_flush_pending(tshare_channel *ch, int64_t deadline);
/* After a release was queued (ch->lock not held): from a thread other than
 * the driving one, while the driving thread is not blocked in a receive,
 * send the queued releases now if that needs no waiting. */
void ts_share_send_releases_now(tshare_channel *ch);

/* session_release.c */
void ts_share_queue_release_locked(tshare_channel *ch, uint64_t share_id); /* with ch->lock held */
void ts_share_release_back(tshare_channel *ch, uint64_t share_id);         /* a share released at once, unused */
int ts_share_send_export(tshare_channel *ch, tshare_frame *f, int fd, ts_export *e, int timeout_ms, uint64_t *share_id);
/* session_export.c: ch->exports and ch->next_share_id change and are read
 * under ch->lock only (any thread may ask tshare_share_is_released). */
int ts_export_register(tshare_channel *ch, ts_export *e); /* under the next share id (set in e) */
void ts_export_sent(tshare_channel *ch);                  /* that id went out: the next one is new */
ts_export *ts_export_take(tshare_channel *ch, uint64_t share_id); /* removed, or NULL */
/* Found, or NULL; valid for the thread inside a call (only it removes exports). */
ts_export *ts_export_find(tshare_channel *ch, uint64_t share_id);
/* Handle one frame from the peer (after its bye too: TSHARE_END for the bye
 * itself); shares are queued for tshare_view_recv(). */
int ts_share_drive(tshare_channel *ch, int timeout_ms);
void ts_export_drop(ts_export *e); /* session_export.c: a share that never went out: release what it held, free it */
void ts_share_free_incoming(tshare_channel *ch);

#endif
