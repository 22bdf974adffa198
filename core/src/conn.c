/* The connection layer's common part: sending with a tail for frames a
 * timeout cut short, reading ahead while a send waits, the decoder loop
 * every transport's receive shares, fds paired with their frames, and
 * wake-ups. What differs by transport sits behind the table of
 * transport.h; the hello is in hello.c. */
#include "conn.h"

#include "error_detail.h"
#include "wire_checks.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

int ts_conn_status_public(int status) {
  switch (status) {
  case TS_CONN_WOKEN:
    return TSHARE_AGAIN;
  case TS_FD_OVER_BUDGET:
    return TSHARE_E_LIMIT;
  case TS_RING_CORRUPT:
    return TSHARE_E_PROTOCOL;
  default:
    return TSHARE_E_STATE;
  }
}

uint32_t ts_conn_caps(const ts_conn *c) { return c->t ? c->t->caps : 0; }

unsigned long ts_thread_tag(void) {
  static atomic_ulong next_tag;
  static _Thread_local unsigned long tag;
  if (!tag) tag = atomic_fetch_add(&next_tag, 1) + 1;
  return tag;
}

static void mark_driver(ts_conn *c) {
  unsigned long me = ts_thread_tag();
  if (atomic_load_explicit(&c->driver, memory_order_relaxed) != me)
    atomic_store_explicit(&c->driver, me, memory_order_relaxed);
}

void ts_conn_take_fds(ts_conn *c, const int *fds, size_t n, bool cut) {
  if (ts_fd_queue_take(&c->fdq, fds, n, cut, c->rx_bytes - 1) != TSHARE_OK && !c->broken)
    c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_NOMEM, "receive: out of memory");
}

int ts_conn_peer_closed(ts_conn *c, const char *what) {
  return ts_errf(c->err, c->err_cap, TSHARE_E_PEER_CLOSED, "%s: peer %s closed the channel", what, c->peer_label);
}

/* ---- reading ahead while a send waits ------------------------------------ */

size_t ts_conn_spill_room(const ts_conn *c) {
  return c->spill_off == c->spill_len ? TS_SPILL_MAX : TS_SPILL_MAX - c->spill_len;
}

/* Errors are left for the next receive to find. A full buffer reads
 * nothing: a read into no room returns 0, which is not the peer's end. */
void ts_conn_spill_read(ts_conn *c) {
  if (ts_conn_spill_room(c) == 0) return;
  if (!c->spill && !(c->spill = malloc(TS_SPILL_MAX))) return;
  if (c->spill_off == c->spill_len) c->spill_off = c->spill_len = 0;
  ssize_t r = c->stream->read(c, c->spill + c->spill_len, TS_SPILL_MAX - c->spill_len);
  if (r > 0) c->spill_len += (size_t)r;
  if (r == 0) c->spill_eof = true;
}

/* ---- sending -------------------------------------------------------------- */

/* Wait until the peer can take bytes, reading what it sends meanwhile. */
static int wait_writable(ts_conn *c, int64_t deadline) {
  for (;;) {
    if (c->t->send_wait) c->t->send_wait(c, true);
    /* Reading never stops for fds: past the channel's fd budget they are
     * closed on arrival and their shares refused, so two ends that share to
     * each other both keep reading (up to TS_SPILL_MAX bytes). */
    bool can_read = c->dec && !c->spill_eof && ts_conn_spill_room(c) > 0 && c->rfd >= 0;
    struct pollfd p[2] = {{.fd = c->wfd, .events = POLLOUT, .revents = 0},
                          {.fd = c->rfd, .events = POLLIN, .revents = 0}};
    int n = poll(p, can_read ? 2 : 1, ts_remaining(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ts_errsys(c->err, c->err_cap, TSHARE_E_SYSTEM, errno, "poll (send)");
    if (c->t->send_wait) c->t->send_wait(c, false);
    if (n == 0) return ts_err_text(c->err, c->err_cap, TSHARE_E_TIMEOUT, "send: timed out");
    if (p[0].revents) return TSHARE_OK; /* errors and hangups surface in the write */
    if (can_read && p[1].revents) ts_conn_spill_read(c);
  }
}

/* A begun frame cannot be taken back, and cutting it would break the stream:
 * its end waits in the tail and goes first later (rest may point into the
 * tail itself). */
void ts_conn_keep_tail(ts_conn *c, const uint8_t *rest, size_t n) {
  memmove(c->tail, rest, n);
  c->tail_len = n;
  atomic_store(&c->tail_pending, true);
}

int ts_stream_send(ts_conn *c, const uint8_t *buf, size_t len, int fd, int64_t deadline) {
  size_t off = 0;
  while (off < len) {
    ssize_t r = c->stream->write(c, buf + off, len - off, off == 0 ? fd : -1);
    if (r > 0) {
      off += (size_t)r;
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno == ETOOMANYREFS && off == 0) {
      /* The kernel caps fds in flight to a peer that does not read (a
       * stopped consumer): that is back-pressure like a full buffer. */
      int left = ts_remaining(deadline);
      if (left == 0)
        return ts_errf(c->err, c->err_cap, TSHARE_E_TIMEOUT, "send: peer %s does not take the fds already in flight",
                       c->peer_label);
      usleep(1000);
      continue;
    }
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int rc = wait_writable(c, deadline);
      if (rc == TSHARE_E_TIMEOUT && off > 0) {
        ts_conn_keep_tail(c, buf + off, len - off); /* the frame counts as sent: its fd went with its first byte */
        return TSHARE_OK;
      }
      if (rc != TSHARE_OK) return rc;
      continue;
    }
    if (r < 0 && (errno == EPIPE || errno == ECONNRESET)) return ts_conn_peer_closed(c, "send");
    return ts_errsys(c->err, c->err_cap, TSHARE_E_SYSTEM, errno, "send");
  }
  return TSHARE_OK;
}

bool ts_stream_send_now(ts_conn *c, const uint8_t *buf, size_t len) {
  int saved_errno = errno;
  size_t off = 0;
  while (off < len) {
    ssize_t r = c->stream->write(c, buf + off, len - off, -1);
    if (r > 0) {
      off += (size_t)r;
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    break; /* full, or an error the driving thread meets on its own */
  }
  errno = saved_errno;
  if (off == 0) return false;
  if (off < len) ts_conn_keep_tail(c, buf + off, len - off); /* from the driving thread or the next send */
  return true;
}

/* Send the end of a frame cut short by a timeout (with send_lock held), and
 * what the transport owes. TSHARE_E_TIMEOUT leaves what is left for later. */
static int flush_tail_locked(ts_conn *c, int64_t deadline) {
  size_t n = c->tail_len;
  int rc = TSHARE_OK;
  if (n > 0) {
    c->tail_len = 0;
    atomic_store(&c->tail_pending, false);
    rc = ts_stream_send(c, c->tail, n, -1, deadline); /* may keep a shorter tail */
    if (rc != TSHARE_OK && c->tail_len == 0 && rc == TSHARE_E_TIMEOUT) {
      c->tail_len = n; /* nothing went: all of it is still there */
      atomic_store(&c->tail_pending, true);
    }
  }
  if (rc == TSHARE_OK && c->t->flush_owed) rc = c->t->flush_owed(c, deadline);
  return rc;
}

static bool owes(const ts_conn *c) { return atomic_load(&c->tail_pending) || atomic_load(&c->owed_pending); }

/* The driving thread's chance to finish a cut frame without sending anything
 * new: at once if the stream takes it, else when poll says it can. */
void ts_conn_try_flush(ts_conn *c) {
  if (!owes(c)) return;
  pthread_mutex_lock(&c->send_lock);
  (void)flush_tail_locked(c, ts_deadline(0));
  pthread_mutex_unlock(&c->send_lock);
}

int ts_conn_send(ts_conn *c, const tshare_frame *f, int fd, int timeout_ms) {
  mark_driver(c);
  if (c->wfd < 0) return ts_errf(c->err, c->err_cap, TSHARE_E_STATE, "send: channel is closed");
  if (fd >= 0 && !(ts_conn_caps(c) & TS_TRANSPORT_PASSES_FDS))
    return ts_errf(c->err, c->err_cap, TSHARE_E_UNSUPPORTED,
                   "send: a %s channel cannot carry fds: open a socket channel", c->t->name);
  if ((fd >= 0) != ((f->flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0))
    return ts_errf(c->err, c->err_cap, TSHARE_E_INVALID_ARG, "send: the fd-attached flag and the fd argument disagree");
  if (fd < 0 && c->t->send_frame_now) { /* no copy, no clock read: where there is room, the usual case */
    pthread_mutex_lock(&c->send_lock);
    bool sent = !owes(c) && c->t->send_frame_now(c, f);
    pthread_mutex_unlock(&c->send_lock);
    if (sent) return TSHARE_OK;
  }
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  int rc = ts_wire_encode(f, buf, sizeof buf, &len, c->err, c->err_cap);
  if (rc != TSHARE_OK) return rc;
  int64_t deadline = ts_deadline(timeout_ms);
  pthread_mutex_lock(&c->send_lock);
  rc = flush_tail_locked(c, deadline);
  if (rc == TSHARE_OK) rc = c->t->send(c, buf, len, fd, deadline);
  pthread_mutex_unlock(&c->send_lock);
  return rc;
}

bool ts_conn_send_now(ts_conn *c, const tshare_frame *f) {
  if (pthread_mutex_trylock(&c->send_lock) != 0) return false; /* the one sending will be told */
  bool sent = false;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  char err[TSHARE_ERROR_MSG_MAX];
  if (c->wfd >= 0 && !owes(c) && c->t->send_frame_now) sent = c->t->send_frame_now(c, f);
  if (!sent && c->wfd >= 0 && !owes(c) && ts_wire_encode(f, buf, sizeof buf, &len, err, sizeof err) == TSHARE_OK)
    sent = c->t->send_now(c, buf, len);
  pthread_mutex_unlock(&c->send_lock);
  return sent;
}

int ts_conn_send_error(ts_conn *c, int code, const char *message) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_ERROR;
  f.u.error.code = code;
  snprintf(f.u.error.message, sizeof f.u.error.message, "%s", message ? message : tshare_status_str(code));
  char keep[TSHARE_ERROR_MSG_MAX]; /* sending must not overwrite the error being reported */
  snprintf(keep, sizeof keep, "%s", c->err);
  int rc = ts_conn_send(c, &f, -1, 100);
  snprintf(c->err, c->err_cap, "%s", keep);
  return rc;
}

void ts_conn_flush_tail(ts_conn *c, int timeout_ms) {
  if (c->wfd < 0 || !owes(c)) return;
  pthread_mutex_lock(&c->send_lock);
  (void)flush_tail_locked(c, ts_deadline(timeout_ms));
  pthread_mutex_unlock(&c->send_lock);
}

/* ---- wake-ups ------------------------------------------------------------- */

void ts_conn_wake(ts_conn *c) {
  pthread_mutex_lock(&c->wake_lock);
  c->woken = true;
  atomic_store(&c->wake_hint, true); /* a spinning receive sees it */
  if (c->waiting && c->wake_fd >= 0) {
    uint64_t one = 1;
    if (write(c->wake_fd, &one, sizeof one) < 0) {
      /* EAGAIN: the counter is already nonzero, the driver wakes anyway. */
    }
    if (c->t->wake) c->t->wake(c); /* asleep elsewhere than in poll() */
  }
  pthread_mutex_unlock(&c->wake_lock);
}

bool ts_conn_take_woken(ts_conn *c) {
  if (!atomic_load_explicit(&c->wake_hint, memory_order_relaxed)) return false;
  pthread_mutex_lock(&c->wake_lock);
  bool woken = c->woken;
  c->woken = false;
  atomic_store(&c->wake_hint, false);
  pthread_mutex_unlock(&c->wake_lock);
  return woken;
}

bool ts_conn_set_waiting(ts_conn *c, bool waiting) {
  pthread_mutex_lock(&c->wake_lock);
  bool ok = !(waiting && c->woken);
  c->waiting = waiting && ok;
  pthread_mutex_unlock(&c->wake_lock);
  return ok;
}

bool ts_conn_driver_blocked(ts_conn *c) {
  pthread_mutex_lock(&c->wake_lock);
  bool blocked = c->waiting;
  pthread_mutex_unlock(&c->wake_lock);
  return blocked;
}

bool ts_conn_driven_by_caller(const ts_conn *c) {
  return atomic_load_explicit(&c->driver, memory_order_relaxed) == ts_thread_tag();
}

/* ---- receiving ------------------------------------------------------------ */

/* Wait for bytes from the peer, or for ts_conn_wake() (TS_CONN_WOKEN): the
 * caller may have work, such as releases the peer waits for before it sends
 * what this thread waits for. */
int ts_stream_wait(ts_conn *c, int64_t deadline) {
  for (;;) {
    pthread_mutex_lock(&c->wake_lock);
    bool woken = c->woken;
    c->woken = false;
    atomic_store(&c->wake_hint, false);
    c->waiting = !woken;
    pthread_mutex_unlock(&c->wake_lock);
    if (woken) return TS_CONN_WOKEN;
    ts_conn_try_flush(c); /* the peer may wait for the rest of a frame before it sends */
    bool tail = atomic_load(&c->tail_pending);
    struct pollfd p[3] = {{.fd = c->rfd, .events = POLLIN, .revents = 0},
                          {.fd = c->wake_fd, .events = POLLIN, .revents = 0},
                          {.fd = c->wfd, .events = POLLOUT, .revents = 0}};
    int n = poll(p, tail ? 3 : 2, ts_remaining(deadline));
    if (n > 0 && tail && (p[2].revents & POLLOUT) && !p[0].revents && !p[1].revents) continue;
    int err = errno;
    pthread_mutex_lock(&c->wake_lock);
    c->waiting = false;
    pthread_mutex_unlock(&c->wake_lock);
    if (n < 0 && err == EINTR) continue;
    if (n < 0) return ts_errsys(c->err, c->err_cap, TSHARE_E_SYSTEM, err, "poll (receive)");
    if (p[1].revents & POLLIN) {
      uint64_t count; /* the waker set `woken` too: the loop's top returns */
      if (read(c->wake_fd, &count, sizeof count) < 0) {
        /* EAGAIN: another reader drained it; nothing to do */
      }
    }
    if (p[0].revents) return TSHARE_OK;
    if (n == 0 && ts_remaining(deadline) == 0)
      return ts_err_text(c->err, c->err_cap, TSHARE_E_TIMEOUT, "receive: timed out");
  }
}

/* The bytes that complete the frame whose first `have` bytes end at `end`
 * (the decoder keeps a frame's start at the front of its buffer): the header,
 * then the payload its length field announces. */
static size_t rest_of_frame(const uint8_t *end, size_t have) {
  if (have < TSHARE_WIRE_HEADER_SIZE) return TSHARE_WIRE_HEADER_SIZE - have;
  const uint8_t *len = end - have + 8;
  uint64_t payload = (uint64_t)len[0] | (uint64_t)len[1] << 8 | (uint64_t)len[2] << 16 | (uint64_t)len[3] << 24;
  return (size_t)(TSHARE_WIRE_HEADER_SIZE + payload - have);
}

/* The peer's end of the stream: mid-frame or between frames. */
static int stream_ended(ts_conn *c) {
  size_t pending = tshare_decoder_pending(c->dec);
  if (pending)
    return c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PEER_CLOSED,
                               "receive: peer %s closed the channel mid-frame (%zu bytes of a frame read)",
                               c->peer_label, pending);
  return c->broken = ts_conn_peer_closed(c, "receive");
}

/* Read what is available into the decoder (during the hello, no further than
 * its frame). TSHARE_OK when bytes came. */
int ts_stream_fill(ts_conn *c, int64_t deadline) {
  for (;;) {
    uint8_t *space;
    size_t avail;
    int rc = tshare_decoder_space(c->dec, &space, &avail);
    if (rc != TSHARE_OK) return ts_errf(c->err, c->err_cap, rc, "receive: %s", tshare_decoder_last_error(c->dec));
    if (c->frame_at_a_time) {
      size_t rest = rest_of_frame(space, tshare_decoder_pending(c->dec));
      if (rest > 0 && rest < avail) avail = rest;
    }
    ssize_t r;
    if (c->spill_off < c->spill_len) { /* read ahead while a send waited */
      r = (ssize_t)ts_take_spilled(c->spill, &c->spill_off, c->spill_len, space, avail);
    } else if (c->spill_eof) {
      r = 0;
    } else {
      r = c->stream->read(c, space, avail);
    }
    if (r > 0) {
      tshare_decoder_commit(c->dec, (size_t)r);
      c->fed += (uint64_t)r;
      return TSHARE_OK;
    }
    if (r == 0) return stream_ended(c);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      rc = ts_stream_wait(c, deadline);
      if (rc != TSHARE_OK) return rc;
      continue;
    }
    if (errno == ECONNRESET)
      return c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PEER_CLOSED, "receive: connection reset by peer %s",
                                 c->peer_label);
    if (errno == ETIMEDOUT) /* a transport with heartbeats heard nothing for its timeout */
      return c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PEER_CLOSED,
                                 "receive: peer %s is unreachable: nothing came from it within its heartbeat timeout",
                                 c->peer_label);
    return c->broken = ts_errsys(c->err, c->err_cap, TSHARE_E_SYSTEM, errno, "receive");
  }
}

/* A decoder failure: the stream is lost; tell the peer why we hang up (it
 * may be a version skew). */
static int decode_failed(ts_conn *c, int rc, tshare_decoder *dec, const char *where) {
  if (c->peer.pid)
    c->broken =
        ts_errf(c->err, c->err_cap, rc, "frame from %s%s: %s", c->peer_label, where, tshare_decoder_last_error(dec));
  else
    c->broken = ts_errf(c->err, c->err_cap, rc, "first frame from the peer: %s", tshare_decoder_last_error(dec));
  ts_conn_send_error(c, rc, c->err);
  return rc;
}

int ts_conn_decode(ts_conn *c, tshare_decoder *dec, int (*fill)(ts_conn *, int64_t), const char *where, tshare_frame *f,
                   int64_t deadline, bool may_read) {
  for (;;) {
    if (c->broken) return c->broken;
    int refused;
    int rc = ts_decoder_next(dec, f, &refused);
    if (rc == TSHARE_OK && refused != TSHARE_OK) { /* one set frame refused; the stream goes on */
      c->set_refused = refused;
      ts_errf(c->err, c->err_cap, refused, "frame from %s%s: %s", c->peer_label, where, tshare_decoder_last_error(dec));
    }
    if (rc == TSHARE_OK) return TSHARE_OK;
    if (rc < 0) return decode_failed(c, rc, dec, where);
    if (!may_read) return TSHARE_AGAIN;
    rc = fill(c, deadline);
    if (rc != TSHARE_OK) return rc;
  }
}

int ts_stream_frame(ts_conn *c, tshare_frame *f, ts_fd_entry *e, bool *found, int64_t deadline, bool may_read) {
  for (;;) {
    int rc = ts_conn_decode(c, c->dec, ts_stream_fill, "", f, deadline, may_read);
    if (rc != TSHARE_OK) return rc;
    *e = ts_fd_queue_frame(&c->fdq, c->fed - tshare_decoder_pending(c->dec), found);
    if (f->type != TSHARE_FRAME_RING || (c->in_setup && f->u.ring.op == TSHARE_RING_SETUP)) return TSHARE_OK;
    if (e->fd >= 0) close(e->fd);
    if (ts_conn_uses_ring(c) && f->u.ring.op == TSHARE_RING_NUDGE) continue;
    return c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL,
                               "receive: peer %s sent a ring frame (op %u) on the socket out of place", c->peer_label,
                               (unsigned)f->u.ring.op);
  }
}

int ts_stream_recv(ts_conn *c, tshare_frame *f, ts_fd_entry *e, bool *found, int64_t deadline) {
  return ts_stream_frame(c, f, e, found, deadline, true);
}

int ts_conn_deliver(ts_conn *c, const tshare_frame *f, ts_fd_entry e, bool found, int *fd_out, int *fd_lost) {
  if (!(f->flags & TSHARE_FRAME_FLAG_FD_ATTACHED)) {
    if (e.fd >= 0) close(e.fd); /* riding on a frame that announces none */
    return TSHARE_OK;
  }
  if (!found)
    return c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL,
                               "receive: %s frame from peer %s says an fd is attached but none arrived",
                               tshare_frame_type_name(f->type), c->peer_label);
  *fd_out = e.fd;
  *fd_lost = e.lost;
  return TSHARE_OK;
}

void ts_conn_look_begins(ts_conn *c) {
  if (c->rfd >= 0 && c->t->look_begins) c->t->look_begins(c);
}

int ts_conn_recv_by(ts_conn *c, tshare_frame *f, int *fd_out, int *fd_lost, int64_t deadline) {
  *fd_out = -1;
  *fd_lost = 0;
  mark_driver(c);
  if (c->rfd < 0) return ts_errf(c->err, c->err_cap, TSHARE_E_STATE, "receive: channel is closed");
  ts_fd_entry e;
  bool found;
  int rc = c->t->recv(c, f, &e, &found, deadline);
  if (rc != TSHARE_OK) return rc;
  return ts_conn_deliver(c, f, e, found, fd_out, fd_lost);
}

size_t ts_stream_buffered(ts_conn *c) { return c->dec ? tshare_decoder_pending(c->dec) : 0; }
size_t ts_conn_buffered(ts_conn *c) { return c->dec ? c->t->buffered(c) : 0; }

int ts_stream_poll_fd(ts_conn *c) { return c->rfd; }
int ts_conn_poll_fd(ts_conn *c) { return c->t->poll_fd(c); }

/* ---- opening and closing -------------------------------------------------- */

/* The most fds of the peer's shares this end holds before it refuses more:
 * a quarter of the soft RLIMIT_NOFILE, at most TS_FD_BUDGET_MAX. */
static size_t default_fd_budget(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 256;
  if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur / 4 > TS_FD_BUDGET_MAX) return TS_FD_BUDGET_MAX;
  return rl.rlim_cur / 4 < 8 ? 8 : (size_t)(rl.rlim_cur / 4);
}

static int set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return -1;
  return 0;
}

int ts_conn_init(ts_conn *c, ts_conn_kind kind, int rfd, int wfd, const tshare_wire_limits *limits, unsigned fd_budget,
                 char *err, size_t err_cap) {
  memset(c, 0, sizeof *c);
  c->kind = kind;
  c->stream = c->t = ts_transport_of(kind);
  c->rfd = rfd;
  c->wfd = wfd;
  c->err = err;
  c->err_cap = err_cap;
  pthread_mutex_init(&c->send_lock, NULL);
  pthread_mutex_init(&c->wake_lock, NULL);
  c->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  c->limits = limits ? *limits : tshare_wire_limits_default();
  c->fdq.budget = fd_budget ? fd_budget : default_fd_budget();
  snprintf(c->peer.name, sizeof c->peer.name, "?");
  snprintf(c->peer_label, sizeof c->peer_label, "'?'");
  if (!c->stream) { /* closing must still work: the stream functions need no state */
    c->stream = c->t = &ts_transport_pipes;
    return ts_errf(err, err_cap, TSHARE_E_INVALID_ARG, "channel: unknown transport %d", (int)kind);
  }
  c->dec = tshare_decoder_create(&c->limits);
  if (!c->dec) return ts_errf(err, err_cap, TSHARE_E_NOMEM, "channel: out of memory");
  if (c->wake_fd < 0) return ts_errsys(err, err_cap, TSHARE_E_SYSTEM, errno, "channel: eventfd");
  if (rfd < 0 || wfd < 0) return ts_errf(err, err_cap, TSHARE_E_INVALID_ARG, "channel: bad fd");
  if (set_nonblocking(rfd) != 0 || set_nonblocking(wfd) != 0)
    return ts_errsys(err, err_cap, TSHARE_E_SYSTEM, errno, "channel: fcntl(O_NONBLOCK) on fd %d/%d", rfd, wfd);
  return c->stream->check ? c->stream->check(c) : TSHARE_OK;
}

void ts_stream_close(ts_conn *c, bool fork_copy) {
  (void)fork_copy;
  if (c->rfd >= 0) close(c->rfd);
  if (c->wfd >= 0 && c->wfd != c->rfd) close(c->wfd);
  c->rfd = c->wfd = -1;
}

void ts_conn_close(ts_conn *c) {
  ts_fd_queue_close_all(&c->fdq);
  pthread_mutex_lock(&c->wake_lock);
  pthread_mutex_lock(&c->send_lock);
  if (c->t != c->stream) c->t->close(c, false); /* under both locks: a waker or a sender may touch its state */
  c->stream->close(c, false);
  if (c->wake_fd >= 0) close(c->wake_fd);
  c->wake_fd = -1;
  pthread_mutex_unlock(&c->send_lock);
  pthread_mutex_unlock(&c->wake_lock);
  tshare_decoder_destroy(c->dec);
  c->dec = NULL;
  free(c->spill);
  c->spill = NULL;
}

void ts_conn_close_fork_copy(ts_conn *c) {
  /* The parent's thread that held a lock at fork does not run here; what it
   * was changing in this process's heap (spill buffers, decoders, the fd
   * queue) is left as it is, and goes when the child exits or execs. */
  if (c->t != c->stream) c->t->close(c, true);
  c->stream->close(c, true);
  if (c->wake_fd >= 0) close(c->wake_fd);
  c->wake_fd = -1;
}

void ts_conn_destroy(ts_conn *c) {
  pthread_mutex_destroy(&c->send_lock);
  pthread_mutex_destroy(&c->wake_lock);
}
