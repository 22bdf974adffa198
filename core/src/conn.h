/* The connection layer: frames and their fds over one transport (a Unix
 * stream socket, a pair of pipes, shared-memory rings riding on a socket;
 * transport.h), the hello (hello.h), and waking the thread that drives it.
 * It knows nothing of shares or of the session's public types: the session
 * layer above calls it, never the other way round. Where the session has
 * work to do while this layer waits (releases queued from other threads),
 * the wait returns TS_CONN_WOKEN and the session decides.
 *
 * Statuses: the public tshare_status values, plus the few of
 * conn_status.h, which the session handles or maps with
 * ts_conn_status_public() before they leave the library.
 *
 * One thread drives a connection (send, receive). ts_conn_wake() and
 * ts_conn_send_now() may be called from any thread. */
#ifndef TSHARE_CONN_H
#define TSHARE_CONN_H

#include "clock.h"
#include "conn_status.h"
#include "fd_queue.h"
#include "transport.h"
#include "tshare/wire.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* allow_uid for ts_conn_hello: accept a peer of any uid. The value of the
 * public TSHARE_ANY_UID, which the session passes through. */
#define TS_CONN_ANY_UID (-2L)

typedef struct ts_conn {
  ts_conn_kind kind;
  const ts_transport *stream; /* the bytes: by kind (socket, pipes) */
  const ts_transport *t;      /* the frames: the stream's own, or the ring the hello set up */
  void *stream_data;          /* the stream's own state, if it has any */
  void *frame_data;           /* the frame transport's (the ring's), NULL for a stream */
  int rfd, wfd;               /* equal for sockets; -1 once closed */
  char *err;                  /* where failures are described (the channel's detail) */
  size_t err_cap;
  /* The status of the set frame last handed up with op TS_SET_OP_REFUSED
   * (wire_checks.h): the decoder refused it alone, framing intact; err
   * says why. Read by the receiving thread right after that frame. */
  int set_refused;

  pthread_mutex_t send_lock; /* one frame write at a time */
  /* Under send_lock: the end of a frame whose start went out before a send
   * timed out. It is sent before anything else (the peer cannot skip a frame
   * it has begun), so the timed-out send counts as done. */
  uint8_t tail[TSHARE_WIRE_FRAME_MAX];
  size_t tail_len;
  atomic_bool tail_pending; /* tail_len > 0, readable without the lock */
  atomic_bool owed_pending; /* the frame transport owes bytes before new frames (flush_owed) */

  pthread_mutex_t wake_lock; /* woken, waiting, wake_fd, and the transport's mappings against close */
  atomic_bool wake_hint;     /* woken was set: read by a spinning receive without the lock */
  int wake_fd;               /* eventfd written by ts_conn_wake() while the driver is blocked */
  bool woken;                /* ts_conn_wake() was called since the driver last looked */
  bool waiting;              /* the driving thread is blocked in a receive */
  /* ts_thread_tag() of the thread that last sent or received. Only a hint:
   * a stale value costs a batch or a system call, never correctness. */
  atomic_ulong driver;

  /* Bytes read while a send waited for room (driving thread only): a peer
   * blocked sending to us must not keep us from sending to it. Fed to the
   * decoder before anything new is read. */
  uint8_t *spill;
  size_t spill_len, spill_off;
  bool spill_eof;
  int broken;           /* sticky receive-side failure, 0 if none */
  bool frame_at_a_time; /* reads stop at the end of the frame they begin (the hello) */
  bool in_setup;        /* the hello waits for the peer's ring: its setup frame is taken */
  atomic_bool pollable; /* tshare_channel_fd() was asked for: a ring's sleep asks for a socket nudge */
  long spin_us;         /* the override of a ring's spin budget in us; -1: adaptive (spin_policy.h) */

  tshare_decoder *dec; /* the stream's bytes */
  tshare_wire_limits limits;
  tshare_hello self, peer;
  uint8_t minor;  /* agreed: min(ours, peer's) */
  long peer_kpid; /* the pid of the hello's writer as the kernel reports it; 0 when unknown */
  /* Who the peer is, as a key for state kept across channels (the CUDA
   * import cache): its kernel pid and start time where the kernel shows
   * them, else this connection's own serial. A hello's pid is only a claim:
   * two containers' producers both say pid 1. */
  uint64_t peer_key;
  char peer_label[96]; /* how messages name the peer: "'name' (pid N)" */
  /* Set by the session before the hello: whether this peer may be served at
   * all (ts_hello_check_same_boot for memory that cannot cross machines).
   * Asked as soon as its hello came, before its claims are checked and before
   * anything (a ring) is set up for it; NULL admits every peer. */
  int (*admit_peer)(struct ts_conn *c);

  ts_fd_queue fdq;   /* fds received but not yet claimed by a frame (driving thread) */
  uint64_t rx_bytes; /* stream bytes read from the peer so far: the offset of the next one */
  uint64_t fed;      /* stream bytes handed to the decoder so far */
} ts_conn;

unsigned long ts_thread_tag(void); /* a nonzero number per thread */

/* The TS_TRANSPORT_* bits of c's transport. SHARED_MEMORY is known once the
 * hello has agreed on it; the others from ts_conn_init on. */
uint32_t ts_conn_caps(const ts_conn *c);

/* Set up c on fds it owns from now on, also when this fails (ts_conn_close
 * closes them). limits NULL: the defaults; fd_budget 0: a quarter of the soft
 * RLIMIT_NOFILE, at most TS_FD_BUDGET_MAX. */
#define TS_FD_BUDGET_MAX 4096
int ts_conn_init(ts_conn *c, ts_conn_kind kind, int rfd, int wfd, const tshare_wire_limits *limits, unsigned fd_budget,
                 char *err, size_t err_cap);

/* The hello: see hello.h. */
int ts_conn_hello(ts_conn *c, const tshare_hello *self, long allow_uid, int timeout_ms);

/* Send a frame with fd (or -1) beside it; waits up to timeout_ms for room,
 * reading what the peer sends meanwhile. */
int ts_conn_send(ts_conn *c, const tshare_frame *f, int fd, int timeout_ms);
/* From any thread: send f now, whole or with its end kept as the tail, and
 * return true; or send nothing (another thread sends, the socket is full, an
 * earlier frame's end is still waiting, the peer is gone) and return false.
 * Never waits, never reads, never writes the error detail. */
bool ts_conn_send_now(ts_conn *c, const tshare_frame *f);
/* Tell the peer about an error (best effort, 100 ms at most); the detail
 * being reported is kept. */
int ts_conn_send_error(ts_conn *c, int code, const char *message);
/* Finish a frame a timeout cut short, waiting up to timeout_ms. */
void ts_conn_flush_tail(ts_conn *c, int timeout_ms);

/* A receive is about to send what this end owes, then look (see the
 * transport table's look_begins). */
void ts_conn_look_begins(ts_conn *c);
/* The next frame by deadline (clock.h), see session.h's ts_session_recv_by;
 * or TS_CONN_WOKEN when ts_conn_wake() was called before one came. */
int ts_conn_recv_by(ts_conn *c, tshare_frame *f, int *fd_out, int *fd_lost, int64_t deadline);
/* Bytes received that do not form a frame yet, or wait in the ring (0: a
 * receive would wait). */
size_t ts_conn_buffered(ts_conn *c);
/* Whether shared-memory rings carry this connection's frames. */
static inline bool ts_conn_uses_ring(const ts_conn *c) { return c->t == &ts_transport_ring; }
/* The fd a poll loop watches (the socket, or the read pipe). On a ring
 * connection this also asks the peer to nudge the socket whenever the ring
 * gets bytes while this end is not in a receive. */
int ts_conn_poll_fd(ts_conn *c);

/* From any thread: make the driving thread's receive return TS_CONN_WOKEN
 * (at once if it is blocked, else before it would block). Costs a system
 * call only while it is blocked. */
void ts_conn_wake(ts_conn *c);
bool ts_conn_driver_blocked(ts_conn *c);         /* blocked in a receive right now (a hint) */
bool ts_conn_driven_by_caller(const ts_conn *c); /* the calling thread drove it last */

/* fds the session keeps for the peer's frames count against the budget. */
static inline void ts_conn_hold_fds(ts_conn *c, long n) { ts_fd_queue_hold(&c->fdq, n); }

/* The key for memory a frame says is owned by claimed_pid (0: the peer's
 * own): see hello.h. */
uint64_t ts_conn_origin_key(const ts_conn *c, uint32_t claimed_pid);

/* Close the fds and free the buffers (a ts_conn_send_now racing with it sends
 * nothing); ts_conn_destroy frees the locks once no other thread can call. */
void ts_conn_close(ts_conn *c);
/* A forked child's copy: its fds closed and its ring mappings dropped
 * without taking the locks (a thread of the parent may have held them at
 * fork); nothing is written. */
void ts_conn_close_fork_copy(ts_conn *c);
void ts_conn_destroy(ts_conn *c);

#endif
