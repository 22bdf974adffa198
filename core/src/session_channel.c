/* channel.h's calls: opening a channel (the connection's hello, with what
 * the session's backends can import), low-level frame I/O, bye, close. */
#include "backend.h"
#include "session.h"
#include "session_stage.h"

#include "error_detail.h"
#include "hello.h"
#include "log.h"
#include "tshare/share.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

void tshare_channel_options_init(tshare_channel_options *o) {
  memset(o, 0, sizeof *o);
  o->name = "tshare";
  o->handshake_timeout_ms = 10000;
  o->allow_uid = -1;
  o->keep_host_fds = 1;
  o->transport = TSHARE_TRANSPORT_DEFAULT;
  o->spin_us = -1;
}

/* The transport a socket channel asks for: the option, else the environment,
 * else the ring. */
static bool wants_ring(const tshare_channel_options *o) {
  if (o->transport == TSHARE_TRANSPORT_RING) return true;
  if (o->transport == TSHARE_TRANSPORT_SOCKET) return false;
  const char *env = getenv("TSHARE_TRANSPORT");
  if (env && strcmp(env, "socket") == 0) return false;
  if (env && *env && strcmp(env, "ring") != 0)
    TS_LOG(TS_LOG_WARN, "TSHARE_TRANSPORT=%s is neither ring nor socket: ring", env);
  return true;
}

#define SPIN_US_ADAPTIVE (-1) /* the default: spin only while it can pay (spin_policy.h) */
#define SPIN_US_MAX 1000000

static long spin_budget_us(const tshare_channel_options *o) {
  if (o->spin_us >= 0) return o->spin_us > SPIN_US_MAX ? SPIN_US_MAX : o->spin_us;
  const char *env = getenv("TSHARE_SPIN_US");
  if (env && *env) {
    char *end;
    long v = strtol(env, &end, 10);
    if (*end == '\0' && v >= 0) return v > SPIN_US_MAX ? SPIN_US_MAX : v;
    TS_LOG(TS_LOG_WARN, "TSHARE_SPIN_US=%s is not a number of microseconds: the adaptive default", env);
  }
  return SPIN_US_ADAPTIVE;
}

int tshare_socketpair(int fds[2], tshare_error *err) {
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    char msg[TSHARE_ERROR_MSG_MAX];
    ts_error_fill(err, ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "socketpair"), msg);
    return TSHARE_E_SYSTEM;
  }
  return TSHARE_OK;
}

/* ---- who may call: the opening process, one thread at a time ----------- */

/* This process's pid, kept by an atfork handler: every call compares it with
 * its channel's owner, and getpid() would cost a system call each time. */
static atomic_long process_pid;
static pthread_once_t watch_forks_once = PTHREAD_ONCE_INIT;

static void note_pid(void) { atomic_store(&process_pid, (long)getpid()); }

static void watch_forks(void) {
  note_pid();
  pthread_atfork(NULL, NULL, note_pid);
}

bool ts_channel_foreign(const tshare_channel *ch) {
  return ch->owner_pid != atomic_load_explicit(&process_pid, memory_order_relaxed);
}

/* A refused call's detail, kept for the refused thread: the channel's own
 * detail belongs to the thread inside a call (or to the parent process). */
static _Thread_local struct {
  const tshare_channel *ch;
  char msg[TSHARE_ERROR_MSG_MAX];
} refusal;

static int refuse(const tshare_channel *ch, int status, const char *what) {
  refusal.ch = ch;
  if (status == TSHARE_E_BUSY)
    snprintf(refusal.msg, sizeof refusal.msg,
             "%s: another thread is inside a call on channel '%s': one thread at a time may call a channel "
             "(only tshare_view_release may run beside it)",
             what, ch->name);
  else if (ts_channel_foreign(ch))
    snprintf(refusal.msg, sizeof refusal.msg,
             "%s: channel '%s' belongs to process %ld (opened before fork); this process (%ld) may only release "
             "its views and close its copy, which sends nothing",
             what, ch->name, ch->owner_pid, atomic_load(&process_pid));
  else
    snprintf(refusal.msg, sizeof refusal.msg, "%s: channel '%s' was closed by another call", what, ch->name);
  return status;
}

int ts_channel_enter(tshare_channel *ch, const char *what) {
  if (ts_channel_foreign(ch)) return refuse(ch, TSHARE_E_STATE, what);
  unsigned long me = ts_thread_tag();
  if (atomic_load_explicit(&ch->call_owner, memory_order_relaxed) == me) {
    ch->call_depth++; /* a callback of this thread's call */
    return TSHARE_OK;
  }
  unsigned idle = 0;
  if (!atomic_compare_exchange_strong_explicit(&ch->call_state, &idle, TS_CALL_BUSY, memory_order_acquire,
                                               memory_order_relaxed))
    return refuse(ch, idle & TS_CALL_CLOSING ? TSHARE_E_STATE : TSHARE_E_BUSY, what);
  atomic_store_explicit(&ch->call_owner, me, memory_order_relaxed);
  ch->call_depth = 1;
  refusal.ch = NULL;
  return TSHARE_OK;
}

static void close_now(tshare_channel *ch);

int ts_channel_leave(tshare_channel *ch, int rc) {
  if (--ch->call_depth > 0) return rc;
  atomic_store_explicit(&ch->call_owner, 0, memory_order_relaxed);
  unsigned was = atomic_fetch_and_explicit(&ch->call_state, ~TS_CALL_BUSY, memory_order_acq_rel);
  if (was & TS_CALL_CLOSING) { /* asked for while this call ran */
    /* The handle may be gone once closed: what this call said stays on this
     * thread, where tshare_channel_last_error finds it by the pointer alone. */
    refusal.ch = ch;
    snprintf(refusal.msg, sizeof refusal.msg, "%s", ch->err);
    close_now(ch);
  }
  return rc;
}

tshare_channel_kind tshare_channel_kind_of(const tshare_channel *ch) {
  return (tshare_channel_kind)ch->conn.kind; /* the values agree (transport.h) */
}
const tshare_hello *tshare_channel_peer(const tshare_channel *ch) { return &ch->conn.peer; }
const char *tshare_channel_last_error(const tshare_channel *ch) {
  if (!ch) return "channel is NULL";
  if (refusal.ch == ch) return refusal.msg;
  return ch->err[0] ? ch->err : "no error";
}
int tshare_channel_fd(const tshare_channel *ch) {
  /* The first time, asking for the fd is what makes a ring channel nudge it,
   * a write into the ring's control page: a call like the others, logically
   * const. Once asked, and on other channels, it is a read any thread may
   * make. */
  tshare_channel *c = (tshare_channel *)ch;
  bool asks = ts_conn_uses_ring(&c->conn) && !atomic_load(&c->conn.pollable);
  if (!asks && !ts_channel_foreign(c)) return c->conn.rfd;
  if (ts_channel_enter(c, "fd") != TSHARE_OK) return -1;
  int fd = ts_conn_poll_fd(&c->conn);
  /* A close asked for meanwhile closes the fd as this call leaves: its
   * number, handed out, could name another file by the time it is used. */
  bool closing = ts_channel_close_waits(c);
  ts_channel_leave(c, TSHARE_OK);
  return closing ? -1 : fd;
}
tshare_transport tshare_channel_transport(const tshare_channel *ch) {
  if (ch->conn.kind == TS_CONN_UCX) return TSHARE_TRANSPORT_UCX;
  return ts_conn_uses_ring(&ch->conn) ? TSHARE_TRANSPORT_RING : TSHARE_TRANSPORT_SOCKET;
}

tshare_gpu_path tshare_channel_gpu_path(const tshare_channel *ch) {
  if (!ch) return TSHARE_GPU_PATH_NONE;
  uint64_t peer = ch->conn.peer.capabilities;
  if (ts_conn_caps(&ch->conn) & TS_TRANSPORT_SAME_HOST)
    return peer & TSHARE_CAP_CUDA_IPC ? TSHARE_GPU_PATH_IPC : TSHARE_GPU_PATH_NONE;
  return peer & TSHARE_CAP_UCX_STAGED ? TSHARE_GPU_PATH_STAGED : TSHARE_GPU_PATH_NONE;
}

static int open_channel(tshare_channel_kind kind, int rfd, int wfd, const tshare_channel_options *opts,
                        tshare_channel **out, tshare_error *err) {
  *out = NULL;
  tshare_channel *ch = calloc(1, sizeof *ch);
  if (!ch) {
    close(rfd);
    if (wfd != rfd) close(wfd);
    ts_error_fill(err, TSHARE_E_NOMEM, "channel: out of memory");
    return TSHARE_E_NOMEM;
  }
  atomic_init(&ch->refs, 1);
  pthread_once(&watch_forks_once, watch_forks);
  ch->owner_pid = atomic_load(&process_pid);
  pthread_mutex_init(&ch->lock, NULL);
  ch->next_share_id = 1;
  if (opts)
    ch->opts = *opts;
  else
    tshare_channel_options_init(&ch->opts);
  snprintf(ch->name, sizeof ch->name, "%s", ch->opts.name ? ch->opts.name : "tshare");
  int rc =
      ts_conn_init(&ch->conn, (ts_conn_kind)kind, rfd, wfd, ch->opts.limits, ch->opts.max_unclaimed_fds, ch->err,
                   sizeof ch->err);
  ch->opts.limits = NULL; /* the caller's struct need not outlive this call */
  if (rc == TSHARE_OK && ts_backends_chan_init(ch) != TSHARE_OK)
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "channel: out of memory");
  if (rc == TSHARE_OK) {
    /* What this end can import: the backends' capabilities. */
    tshare_hello self;
    memset(&self, 0, sizeof self);
    snprintf(self.name, sizeof self.name, "%s", ch->name);
    self.capabilities = ts_backends_hello(&self, ts_conn_caps(&ch->conn));
    if (kind == TSHARE_CHANNEL_SOCKET && wants_ring(&ch->opts)) self.capabilities |= TSHARE_CAP_RING;
    ch->conn.spin_us = spin_budget_us(&ch->opts);
    /* Shares are memory of this machine: a peer that runs in another boot
     * (or on another host) is refused, and told why, before anything else.
     * A transport across hosts carries such peers: what it carries never
     * names this machine's memory, and the bootstrap's token admitted it. */
    if (ts_conn_caps(&ch->conn) & TS_TRANSPORT_SAME_HOST) ch->conn.admit_peer = ts_hello_check_same_boot;
    rc = ts_conn_hello(&ch->conn, &self, ch->opts.allow_uid, ch->opts.handshake_timeout_ms);
  }
  if (rc != TSHARE_OK) {
    ts_error_fill(err, rc, ch->err);
    ch->bye_sent = true; /* a channel that never opened says no bye */
    tshare_channel_close(ch);
    return rc;
  }
  ts_error_fill(err, TSHARE_OK, "");
  TS_LOG(TS_LOG_INFO, "channel '%s' open to %s over %s (its capabilities 0x%llx)", ch->name, ch->conn.peer_label,
         kind == TSHARE_CHANNEL_PIPES   ? "pipes"
         : kind == TSHARE_CHANNEL_UCX   ? "UCX"
         : ts_conn_uses_ring(&ch->conn) ? "a socket and shared-memory rings"
                                        : "a socket",
         (unsigned long long)ch->conn.peer.capabilities);
  *out = ch;
  return TSHARE_OK;
}

int tshare_channel_open_socket(int fd, const tshare_channel_options *opts, tshare_channel **out, tshare_error *err) {
  return open_channel(TSHARE_CHANNEL_SOCKET, fd, fd, opts, out, err);
}

int tshare_channel_open_pipes(int read_fd, int write_fd, const tshare_channel_options *opts, tshare_channel **out,
                              tshare_error *err) {
  return open_channel(TSHARE_CHANNEL_PIPES, read_fd, write_fd, opts, out, err);
}

int ts_channel_open_on(ts_conn_kind kind, int rfd, int wfd, const tshare_channel_options *opts, tshare_channel **out,
                       tshare_error *err) {
  return open_channel((tshare_channel_kind)kind, rfd, wfd, opts, out, err);
}

int tshare_channel_send_frame(tshare_channel *ch, const tshare_frame *f, int fd, int timeout_ms) {
  if (!ch || !f) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "send", ts_conn_send(&ch->conn, f, fd, timeout_ms));
}

static int recv_frame(tshare_channel *ch, tshare_frame *f, int *fd_out, int timeout_ms) {
  int fd_lost;
  int rc = ts_session_recv_by(ch, f, fd_out, &fd_lost, ts_deadline(timeout_ms));
  if (rc == TSHARE_OK && fd_lost) {
    (void)ts_share_fd_lost(ch, f, fd_lost); /* the frame is filled; its fd could not be kept */
    return TSHARE_E_LIMIT;
  }
  /* Applied here too, so low-level readers keep the accounting right. Ids the
   * tables do not know are not an error on this path: they belong to share
   * frames the caller sent itself with tshare_channel_send_frame(). */
  if (rc == TSHARE_OK && f->type == TSHARE_FRAME_RELEASE) (void)ts_share_apply_release(ch, &f->u.release, false);
  if (rc == TSHARE_E_PEER_CLOSED) ts_share_drop_all(ch, TSHARE_E_PEER_CLOSED);
  return rc;
}

int tshare_channel_recv_frame(tshare_channel *ch, tshare_frame *f, int *fd_out, int timeout_ms) {
  if (!ch || !f || !fd_out) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "receive", recv_frame(ch, f, fd_out, timeout_ms));
}

static int send_bye(tshare_channel *ch, uint32_t reason, int timeout_ms) {
  int64_t deadline = ts_deadline(timeout_ms);
  /* What a turn of the channel would have sent goes before the bye: a retire
   * of memory dropped since the last turn (else the peer keeps it mapped
   * until it closes, however long that is after the bye), and the releases. */
  ts_backend_wait wait;
  int rc = ts_backends_housekeeping(ch, deadline, &wait);
  if (rc == TSHARE_E_PEER_CLOSED) return rc;
  if (rc != TSHARE_OK) /* best effort: the bye goes all the same (what is left goes with the close) */
    TS_LOG(TS_LOG_INFO, "bye on channel '%s': what it owed did not all go first: %s", ch->name, ch->err);
  rc = ts_share_flush_pending(ch, deadline);
  if (rc != TSHARE_OK) return rc;
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_BYE;
  f.u.bye.reason = reason;
  rc = ts_conn_send(&ch->conn, &f, -1, ts_remaining(deadline));
  if (rc == TSHARE_OK) ch->bye_sent = true;
  return rc;
}

int tshare_channel_send_bye(tshare_channel *ch, uint32_t reason, int timeout_ms) {
  if (!ch) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "bye", send_bye(ch, reason, timeout_ms));
}

int tshare_channel_send_error(tshare_channel *ch, int code, const char *message) {
  if (!ch) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "error", ts_conn_send_error(&ch->conn, code, message));
}

/* A forked child's last reference to its copy of a channel: only memory of
 * its own goes. The CUDA state stays (the driver's state after fork is not
 * this process's to use), and so do the shares sent before fork (what keeps
 * them alive belongs to the parent's code) and locks a thread the child does
 * not have may hold: all of it goes when the child exits or execs. */
static void free_in_child(tshare_channel *ch) {
  ts_stage_free_in_child(ch);
  ts_backends_chan_free_in_child(ch); /* this process's own mappings (of host memory) */
  ts_share_free_incoming(ch);
  ts_id_vec_free(&ch->pending);
  free(ch);
}

void ts_channel_unref(tshare_channel *ch) {
  if (atomic_fetch_sub(&ch->refs, 1) != 1) return;
  if (ts_channel_foreign(ch)) {
    free_in_child(ch);
    return;
  }
  ts_stage_free(ch); /* before the backends: a staging buffer's registration goes with its channel */
  ts_backends_chan_free(ch);
  ts_conn_destroy(&ch->conn);
  pthread_mutex_destroy(&ch->lock);
  ts_id_vec_free(&ch->pending);
  free(ch);
}

static void close_now(tshare_channel *ch) {
  if (ch->conn.peer.major) /* it opened */
    TS_LOG(TS_LOG_INFO, "channel '%s' to %s closed; %zu shares it still held dropped", ch->name, ch->conn.peer_label,
           tshare_channel_outstanding(ch));
  /* A clean end for the peer (TSHARE_END, not TSHARE_E_PEER_CLOSED): the
   * bye goes after the releases, best effort. */
  if (ch->conn.wfd >= 0 && !ch->conn.broken) {
    ts_backends_before_close(ch, 100); /* memory kept for the peer's mappings: answered before it goes */
    if (ch->bye_sent)
      ts_share_flush_pending(ch, ts_deadline(100));
    else
      (void)send_bye(ch, 0, 100); /* which flushes the releases first */
  }
  ts_conn_flush_tail(&ch->conn, 100);
  ts_share_drop_all(ch, TSHARE_E_PEER_CLOSED);
  ts_share_free_incoming(ch);
  pthread_mutex_lock(&ch->lock);
  ch->closed = true; /* views released from now on queue nothing */
  ts_conn_close(&ch->conn);
  pthread_mutex_unlock(&ch->lock);
  ts_channel_unref(ch);
}

/* A forked child closes its copy of its parent's channel: nothing goes to
 * the peer and nothing both processes share changes (the socket's state,
 * the rings); its own copies of the fds and ring mappings are dropped
 * unless a lock that a thread of the parent held at fork is in the way. */
static void close_in_child(tshare_channel *ch) {
  bool locks_free = false;
  if (pthread_mutex_trylock(&ch->conn.wake_lock) == 0) {
    locks_free = pthread_mutex_trylock(&ch->conn.send_lock) == 0;
    if (locks_free) pthread_mutex_unlock(&ch->conn.send_lock);
    pthread_mutex_unlock(&ch->conn.wake_lock);
  }
  if (locks_free)
    ts_conn_close(&ch->conn); /* closes and unmaps, writes nothing */
  else
    ts_conn_close_fork_copy(&ch->conn); /* the socket must not outlive the parent through this child */
  ch->closed = true;
  ts_channel_unref(ch);
}

void tshare_channel_close(tshare_channel *ch) {
  if (!ch) return;
  if (ts_channel_foreign(ch)) {
    close_in_child(ch);
    return;
  }
  if (atomic_load_explicit(&ch->call_owner, memory_order_relaxed) == ts_thread_tag()) {
    /* From a callback inside this thread's call: the call closes it as it returns. */
    atomic_fetch_or(&ch->call_state, TS_CALL_CLOSING);
    return;
  }
  atomic_fetch_add(&ch->refs, 1); /* the wake-up below must not outlive a close the other thread does */
  unsigned was = atomic_fetch_or(&ch->call_state, TS_CALL_CLOSING);
  if (was & TS_CALL_CLOSING)
    TS_LOG(TS_LOG_WARN, "channel '%s' closed twice: the second close does nothing", ch->name);
  else if (was & TS_CALL_BUSY)
    ts_conn_wake(&ch->conn); /* the thread inside stops waiting and closes it as its call returns */
  else
    close_now(ch);
  ts_channel_unref(ch);
}
