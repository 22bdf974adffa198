/* Internal layout of a channel, shared by channel.c (framed I/O, hello) and
 * share.c (the lifetime protocol). */
#ifndef TSHARE_CHANNEL_INTERNAL_H
#define TSHARE_CHANNEL_INTERNAL_H

#include "clock.h"
#include "tshare/channel.h"
#include "u64map.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TS_INCOMING_MAX 4096   /* shares received but not yet taken by view_recv */
#define TS_FD_OVER_BUDGET (-1) /* ts_fd_entry.lost: closed because the channel held its max_unclaimed_fds */

/* An fd that came with the bytes of a read, waiting for the frame it rides on.
 * The kernel ends a read at the end of the one message whose fds it returns,
 * so those fds belong to the frame holding the read's last byte, `at`. */
typedef struct ts_fd_entry {
  int fd;      /* -1 when it could not be kept */
  int lost;    /* why not: an errno (EMFILE, ENFILE) or TS_FD_OVER_BUDGET; 0 when kept */
  uint64_t at; /* stream offset of the last byte of the read that brought it */
} ts_fd_entry;

/* What a sent share keeps alive; release() runs once when the peer releases it
 * or the channel ends. */
typedef struct ts_export {
  uint64_t share_id;
  void *user_data;
  void (*release)(void *owner);
  void *owner;
  int event_slot; /* CUDA event slot the share holds, -1 if none */
} ts_export;

/* One mapped allocation on the consumer side. */
typedef struct ts_mapping {
  uint64_t alloc_id;
  void *base;
  size_t size;
  unsigned long ino, dev; /* of the memfd: a reused alloc_id cannot alias another file */
  size_t views;           /* live views into it */
  int fd;                 /* the memfd, kept so views can be shared on */
  uint64_t forward_id;    /* this process's alloc id for it when shared on */
} ts_mapping;

/* A received share, as the consumer holds it. */
struct tshare_view {
  struct tshare_channel *ch; /* holds a reference */
  ts_mapping *mapping;       /* host shares */
  void *cuda_import;         /* CUDA shares: the process-wide mapping (ts_cuda_import) */
  void *stream;              /* CUDA shares: the stream the view is used on */
  void *ctx;                 /* CUDA shares: the context that maps it */
  int cuda_device;           /* CUDA shares: that context's ordinal */
  uint64_t share_id;
  int device_type;
  void *data;
  tshare_tensor_desc desc;
  tshare_share_frame frame; /* as received: what a forward sends on */
  char tag[TSHARE_TAG_MAX + 1];
};

typedef struct ts_incoming {
  tshare_frame frame;
  int fd;
} ts_incoming;

struct tshare_channel {
  atomic_int refs;           /* the user's handle + one per live view */
  pthread_mutex_t send_lock; /* one frame write at a time */
  pthread_mutex_t lock;      /* mappings, pending releases, closed flag */

  tshare_channel_kind kind;
  int rfd, wfd; /* equal for sockets; -1 once closed */
  int wake_fd;  /* eventfd: a release is queued; written and closed under lock */
  bool woken;   /* under lock: releases were queued since the driver last looked */
  bool waiting; /* under lock: the driving thread is blocked in a receive */
  bool closed;  /* the user closed it; views may still live */
  /* ts_thread_tag() of the thread that last sent or received: releases from
   * any other thread go out at once (ts_share_send_releases_now). Only a
   * hint: a stale value costs a batch or a system call, never correctness. */
  atomic_ulong driver;
  /* Under send_lock: the end of a frame whose start went out before a send
   * timed out. It is sent before anything else (the peer cannot skip a frame
   * it has begun), so the timed-out send counts as done. */
  uint8_t tail[TSHARE_WIRE_FRAME_MAX];
  size_t tail_len;
  atomic_bool tail_pending; /* tail_len > 0, readable without the lock */
  /* Bytes read while a send waited for room (driving thread only): a peer
   * blocked sending to us (releases) must not keep us from sending to it.
   * Fed to the decoder before anything new is read. */
  uint8_t *spill;
  size_t spill_len, spill_off;
  bool spill_eof;
  int broken; /* sticky receive-side failure, 0 if none */
  bool peer_bye;
  char err[TSHARE_ERROR_MSG_MAX];

  tshare_decoder *dec;
  tshare_wire_limits limits;
  tshare_hello self, peer;
  long peer_kpid; /* the pid of the hello's writer as the kernel reports it; 0 when unknown */
  /* Who the peer is, as a key for state kept across channels (the CUDA
   * import cache): its kernel pid and start time where the kernel shows
   * them, else this channel's own serial. A hello's pid is only a claim: two
   * containers' producers both say pid 1. */
  uint64_t peer_key;
  char peer_label[96]; /* how messages name the peer: "'name' (pid N)" */
  uint8_t minor;       /* agreed: min(ours, peer's) */
  tshare_channel_options opts;
  char name[TSHARE_HELLO_NAME_MAX + 1];

  /* fds received but not yet claimed by a frame, oldest first (driving thread) */
  ts_fd_entry *fdq;
  size_t fdq_head, fdq_len, fdq_cap;
  uint64_t rx_bytes; /* bytes read from the peer so far: the stream offset of the next one */
  uint64_t fed;      /* bytes handed to the decoder so far */
  /* fds this end holds for the peer's frames: queued above, or in shares
   * waiting in `incoming`. Past fd_budget an arriving fd is closed at once
   * and its share refused, so no peer can fill this process's fd table. */
  size_t held_fds, fd_budget;

  /* producer side: shares sent and not yet released */
  uint64_t next_share_id;
  ts_u64map exports;

  /* consumer side */
  ts_u64map mappings; /* alloc_id -> ts_mapping, under lock */
  uint64_t *pending;  /* share ids released but not yet sent, under lock */
  size_t npending, pending_cap;
  ts_incoming *incoming; /* ring of received shares */
  size_t in_head, in_len, in_cap;
  /* Shares refused because the channel held too many unreceived ones; the
   * peer is told with an error frame before their releases go out. */
  uint64_t refused, refused_first;
  bool refusal_told;

  struct ts_cuda_chan *cuda; /* event pools, releases waiting on the GPU; NULL until used */
};

/* channel.c */
unsigned long ts_thread_tag(void); /* a nonzero number per thread */
/* The key for memory a share says is owned by claimed_pid (its origin_pid,
 * 0 when the peer's own): peer_key for the peer's own memory; for memory it
 * forwards, its claim kept apart from every other channel's. */
uint64_t ts_channel_origin_key(const tshare_channel *ch, uint32_t claimed_pid);
int ts_channel_send(tshare_channel *ch, const tshare_frame *f, int fd, int timeout_ms);
/* From any thread, with send_lock held: f goes out now, whole or with its end
 * kept as the tail, and true comes back; or nothing goes (the socket is full,
 * an earlier frame's end is still waiting, the peer is gone) and false comes
 * back. Never waits, never reads, never writes ch->err: those belong to the
 * driving thread. */
bool ts_channel_send_now_locked(tshare_channel *ch, const tshare_frame *f);
/* The next frame. A frame announcing an fd comes with it in *fd_out, or with
 * *fd_out -1 and *fd_lost saying why it could not be kept (an errno such as
 * EMFILE, or TS_FD_OVER_BUDGET); a missing fd is a protocol error. fds riding
 * on frames that announce none are closed. */
int ts_channel_recv_raw(tshare_channel *ch, tshare_frame *f, int *fd_out, int *fd_lost, int timeout_ms);
void ts_channel_unref(tshare_channel *ch);

/* share.c */
int ts_share_apply_release(tshare_channel *ch, const tshare_release_frame *r);
/* A share whose fd could not be kept (lost: an errno or TS_FD_OVER_BUDGET):
 * released back to the peer, and the reason put in ch->err. Returns
 * TSHARE_E_LIMIT, or TSHARE_OK for a refusal the peer is told about. */
int ts_share_fd_lost(tshare_channel *ch, const tshare_frame *f, int lost);
void ts_share_drop_all(tshare_channel *ch, int status); /* peer gone or channel closed */
int ts_share_flush_pending(tshare_channel *ch, int timeout_ms);
/* After a release was queued (ch->lock not held): from a thread other than
 * the driving one, while the driving thread is not blocked in a receive,
 * send the queued releases now if that needs no waiting. */
void ts_share_send_releases_now(tshare_channel *ch);

/* Tell the driving thread that releases are queued (with ch->lock held). The
 * eventfd is written only while it is blocked in a receive: a driver that is
 * not blocked looks at `woken` before it blocks, so the common case (the
 * driving thread released the view itself) costs no system call. */
void ts_channel_wake_locked(tshare_channel *ch);
void ts_share_queue_release_locked(tshare_channel *ch, uint64_t share_id); /* with ch->lock held */
int ts_share_send_export(tshare_channel *ch, tshare_frame *f, int fd, ts_export *e, int timeout_ms, uint64_t *share_id);
void ts_export_drop(ts_export *e); /* a share that never went out: release what it held, free it */
void ts_share_free_incoming(tshare_channel *ch);
void ts_share_free_mappings(tshare_channel *ch);

/* hostmem.c: references held by shares */
struct tshare_host_buffer;
uint64_t ts_host_next_alloc_id(void); /* host allocation ids, unique in the process */
void ts_host_buffer_retain(struct tshare_host_buffer *buf);
void ts_host_buffer_release(void *buf);

#endif
