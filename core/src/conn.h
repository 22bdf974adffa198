/* The connection layer: frames and their fds over one transport (a Unix
 * stream socket, or a pair of pipes), the hello, and waking the thread that
 * drives it. It knows nothing of shares: the session layer above (session_share.c,
 * backend_host.c, backend_cuda.c) calls it, never the other way round. Where the
 * session has work to do while this layer waits (releases queued from other
 * threads), the wait returns TS_CONN_WOKEN and the session decides.
 *
 * One thread drives a connection (send, receive). ts_conn_wake() and
 * ts_conn_send_now() may be called from any thread. */
#ifndef TSHARE_CONN_H
#define TSHARE_CONN_H

#include "clock.h"
#include "ring.h"
#include "spin_policy.h"
#include "tshare/channel.h"
#include "tshare/wire.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TS_FD_OVER_BUDGET (-1) /* ts_fd_entry.lost: closed because the connection held its fd budget */

/* ts_conn_recv(): a wait was cut short because ts_conn_wake() was called
 * (nothing was received). Not a tshare_status: it never leaves the library. */
#define TS_CONN_WOKEN 100

/* An fd that came with the bytes of a read, waiting for the frame it rides on.
 * The kernel ends a read at the end of the one message whose fds it returns,
 * so those fds belong to the frame holding the read's last byte, `at`.
 * Consecutive fds that could not be kept share one entry, from `at` to
 * `last`: a peer sending a byte with an fd at a time past the budget costs
 * no memory per fd. */
typedef struct ts_fd_entry {
  int fd;        /* -1 when it could not be kept */
  int lost;      /* why not: an errno (EMFILE, ENFILE) or TS_FD_OVER_BUDGET; 0 when kept */
  uint64_t at;   /* stream offset of the last byte of the read that brought it */
  uint64_t last; /* the same for the last fd of a run of lost ones; `at` otherwise */
} ts_fd_entry;

typedef struct ts_conn {
  tshare_channel_kind kind;
  int rfd, wfd; /* equal for sockets; -1 once closed */
  char *err;    /* where failures are described (the channel's detail) */
  size_t err_cap;

  pthread_mutex_t send_lock; /* one frame write at a time */
  /* Under send_lock: the end of a frame whose start went out before a send
   * timed out. It is sent before anything else (the peer cannot skip a frame
   * it has begun), so the timed-out send counts as done. */
  uint8_t tail[TSHARE_WIRE_FRAME_MAX];
  size_t tail_len;
  /* Under send_lock, ring transport: frames already on the socket whose
   * SOCKET_NEXT entries did not fit into the ring yet. They go first too. */
  unsigned markers_owed;
  atomic_bool tail_pending;    /* tail_len > 0, readable without the lock */
  atomic_bool markers_pending; /* markers_owed > 0, likewise */

  pthread_mutex_t wake_lock; /* woken, waiting, wake_fd, and the rings' mappings against close */
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
  int broken; /* sticky receive-side failure, 0 if none */
  bool frame_at_a_time; /* reads stop at the end of the frame they begin (the hello) */

  tshare_decoder *dec;
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

  /* The ring transport (sockets whose hellos both asked for it): frames
   * without fds go through ring_out; an fd frame goes on the socket and a
   * SOCKET_NEXT entry in the ring marks its place in the order. */
  ts_ring ring_out, ring_in; /* ring_in.ctl NULL: the socket carries everything */
  tshare_decoder *ring_dec;  /* the bytes of ring_in, checked like the socket's */
  uint8_t *ring_spill;       /* ring bytes read while a send waited (driving thread) */
  size_t ring_spill_len, ring_spill_off;
  bool socket_next;          /* the ring said: the next frame is on the socket */
  /* The two ring frames this end sends, encoded once at setup. */
  uint8_t socket_next_frame[32], nudge_frame[32];
  size_t ring_op_len;
  bool in_setup;             /* the hello is waiting for the peer's ring */
  bool has_early;            /* early: a socket frame read before its ring entry came */
  tshare_frame early;
  ts_fd_entry early_fd;
  bool early_found;
  atomic_bool pollable;      /* tshare_channel_fd() was asked for: sleep flags ask for a socket nudge */
  long spin_us;              /* the override of the spin budget in us; -1: adaptive (spin_policy.h) */
  ts_spin_policy spin;       /* when a ring receive spins before it sleeps (driving thread) */
  int64_t hup_recv_us;       /* when a receive that would not wait last asked the socket for a hang-up */
  int64_t hup_send_us;       /* when a ring send last asked (under send_lock) */

  /* fds received but not yet claimed by a frame, oldest first (driving thread) */
  ts_fd_entry *fdq;
  size_t fdq_head, fdq_len, fdq_cap;
  uint64_t rx_bytes; /* bytes read from the peer so far: the stream offset of the next one */
  uint64_t fed;      /* bytes handed to the decoder so far */
  /* fds held for the peer's frames: queued above, or kept by the session
   * (ts_conn_hold_fds). Past fd_budget an arriving fd is closed at once and
   * its frame comes with lost = TS_FD_OVER_BUDGET. */
  size_t held_fds, fd_budget;
} ts_conn;

/* What a connection's transport can do. The session and the backends ask
 * these (ts_conn_caps) instead of reading which transport it is. */
#define TS_TRANSPORT_PASSES_FDS (1u << 0)       /* a frame can carry an fd (SCM_RIGHTS or a dup) */
#define TS_TRANSPORT_PEER_CREDENTIALS (1u << 1) /* the kernel names the peer's uid and pid */
#define TS_TRANSPORT_SAME_HOST (1u << 2)        /* the peer runs on this machine, in this boot */
#define TS_TRANSPORT_SHARED_MEMORY (1u << 3)    /* frames travel through memory both ends map */

/* The TS_TRANSPORT_* bits of c's transport. SHARED_MEMORY is known once the
 * hello has agreed on it; the others from ts_conn_init on. */
uint32_t ts_conn_caps(const ts_conn *c);

unsigned long ts_thread_tag(void); /* a nonzero number per thread */

/* Set up c on fds it owns from now on, also when this fails (ts_conn_close
 * closes them). limits NULL: the defaults; fd_budget 0: a quarter of the soft
 * RLIMIT_NOFILE, at most TS_FD_BUDGET_MAX. */
#define TS_FD_BUDGET_MAX 4096
int ts_conn_init(ts_conn *c, tshare_channel_kind kind, int rfd, int wfd, const tshare_wire_limits *limits,
                 unsigned fd_budget, char *err, size_t err_cap);

/* The hello: self (name, capabilities, devices filled by the caller; the rest
 * here) goes out, the peer's comes in and is checked (boot id; on sockets the
 * uid, with SO_PEERCRED, against allow_uid as in tshare_channel_options).
 * When both hellos carry TSHARE_CAP_RING, each end then sends the ring it
 * will write into and maps the peer's. */
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

/* The next frame, see session.h's ts_channel_recv_raw; or
 * TS_CONN_WOKEN when ts_conn_wake() was called before one came. */
int ts_conn_recv(ts_conn *c, tshare_frame *f, int *fd_out, int *fd_lost, int timeout_ms);
/* Bytes received that do not form a frame yet, or wait in the ring (0: a
 * receive would wait). */
size_t ts_conn_buffered(ts_conn *c);
/* Whether the ring transport carries this connection's frames. */
static inline bool ts_conn_uses_ring(const ts_conn *c) { return c->ring_in.ctl != NULL; }
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
static inline void ts_conn_hold_fds(ts_conn *c, long n) { c->held_fds = (size_t)((long)c->held_fds + n); }

/* The key for memory a frame says is owned by claimed_pid (0: the peer's
 * own): peer_key for the peer's own memory; for memory it forwards, its
 * claim kept apart from every other peer's. */
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
