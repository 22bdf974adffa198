/* The connection layer: framed, EINTR-safe, SIGPIPE-safe I/O over sockets
 * and pipes, fds paired with their frames, the hello, and wake-ups. */
#include "conn.h"

#include "error_detail.h"
#include "wire_checks.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

/* write() to a pipe whose reader is gone raises SIGPIPE. Block it on this
 * thread for the write and swallow the one we caused, leaving any SIGPIPE
 * that was already pending for the application. */
static ssize_t pipe_write_nosigpipe(int fd, const void *buf, size_t n) {
  sigset_t pipe_set, old_set, pending;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set);
  sigpending(&pending);
  int was_pending = sigismember(&pending, SIGPIPE);
  ssize_t r = write(fd, buf, n);
  int saved = errno;
  if (r < 0 && saved == EPIPE && !was_pending) {
    struct timespec zero = {0, 0};
    while (sigtimedwait(&pipe_set, NULL, &zero) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old_set, NULL);
  errno = saved;
  return r;
}

#define SPILL_MAX (16u << 20) /* bytes read ahead while sending; beyond this a send just waits */

/* Why an fd could not be installed: the process's limit (EMFILE) or the
 * system's (ENFILE), asked by trying to open one more. */
static int fd_shortage_errno(void) {
  int probe = fcntl(0, F_DUPFD_CLOEXEC, 0);
  if (probe >= 0) {
    close(probe); /* freed meanwhile: the limit was still what cut it */
    return EMFILE;
  }
  return errno == ENFILE ? ENFILE : EMFILE;
}

static bool fdq_push(ts_conn *c, ts_fd_entry e) {
  if (c->fdq_head + c->fdq_len == c->fdq_cap) {
    if (c->fdq_head > 0) { /* room at the front: slide down */
      memmove(c->fdq, c->fdq + c->fdq_head, c->fdq_len * sizeof *c->fdq);
      c->fdq_head = 0;
    } else {
      size_t cap = c->fdq_cap ? c->fdq_cap * 2 : 16;
      ts_fd_entry *q = realloc(c->fdq, cap * sizeof *q);
      if (!q) return false;
      c->fdq = q;
      c->fdq_cap = cap;
    }
  }
  c->fdq[c->fdq_head + c->fdq_len++] = e;
  return true;
}

/* A lost fd right behind another lost one joins its entry: the queue grows
 * with the fds kept (the budget), not with the fds a peer sends. The frames
 * between two losses of a run are then taken to have lost one too; that only
 * matters to a frame that announces an fd it never sent, which is refused
 * either way. */
static bool join_lost_run(ts_conn *c, uint64_t at) {
  if (c->fdq_len == 0) return false;
  ts_fd_entry *tail = &c->fdq[c->fdq_head + c->fdq_len - 1];
  if (tail->fd >= 0) return false;
  tail->last = at;
  return true;
}

/* The fds one read brought, at stream offset `at` (the read's last byte).
 * A frame carries at most one fd: the first is kept (if the channel may hold
 * another), the others closed. None delivered though the kernel cut the
 * control data means this process could not install it. */
static void take_fds(ts_conn *c, const int *fds, size_t n, bool cut, uint64_t at) {
  ts_fd_entry e = {.fd = -1, .lost = 0, .at = at, .last = at};
  if (n == 0 && !cut) return;
  for (size_t i = 1; i < n; i++) close(fds[i]);
  if (n == 0) {
    e.lost = fd_shortage_errno();
  } else if (c->held_fds >= c->fd_budget) {
    close(fds[0]); /* at once: nothing of it is kept but the entry's offsets */
    e.lost = TS_FD_OVER_BUDGET;
  } else {
    e.fd = fds[0];
  }
  if (e.fd < 0 && join_lost_run(c, at)) return;
  if (!fdq_push(c, e)) {
    if (e.fd >= 0) close(e.fd);
    if (!c->broken) c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_NOMEM, "receive: out of memory");
    return;
  }
  if (e.fd >= 0) c->held_fds++;
}

/* The fd a frame ending at stream offset `end` carries: every queued fd that
 * came with its bytes is taken off the queue, the first returned (or why it
 * was lost), the rest closed. *found is false when none came. */
static ts_fd_entry fds_of_frame(ts_conn *c, uint64_t end, bool *found) {
  ts_fd_entry first = {.fd = -1, .lost = 0, .at = 0, .last = 0};
  *found = false;
  while (c->fdq_len && c->fdq[c->fdq_head].at < end) {
    ts_fd_entry e = c->fdq[c->fdq_head];
    if (e.last >= end) {
      c->fdq[c->fdq_head].at = end; /* a run of losses going on into the next frames */
    } else {
      c->fdq_head++;
      c->fdq_len--;
    }
    if (e.fd >= 0) c->held_fds--;
    if (!*found) {
      first = e;
      *found = true;
    } else if (e.fd >= 0) {
      close(e.fd);
    }
  }
  if (c->fdq_len == 0) c->fdq_head = 0;
  return first;
}

static void fdq_close_all(ts_conn *c) {
  bool found;
  ts_fd_entry e = fds_of_frame(c, UINT64_MAX, &found);
  if (found && e.fd >= 0) close(e.fd);
  free(c->fdq);
  c->fdq = NULL;
  c->fdq_cap = 0;
}

/* One read from the peer into buf: fds that come along go to the fd queue.
 * Like recvmsg: bytes read, 0 at EOF, -1 with errno. */
/* The peer went away: what `what` ("send", "receive") says about it. */
static int peer_closed(ts_conn *c, const char *what) {
  return ts_errf(c->err, c->err_cap, TSHARE_E_PEER_CLOSED, "%s: peer %s closed the channel", what, c->peer_label);
}

static ssize_t recv_into(ts_conn *c, uint8_t *buf, size_t cap) {
  if (c->kind != TSHARE_CHANNEL_SOCKET) {
    ssize_t r = read(c->rfd, buf, cap);
    if (r > 0) c->rx_bytes += (uint64_t)r;
    return r;
  }
  struct iovec iov = {.iov_base = buf, .iov_len = cap};
  union {
    char space[CMSG_SPACE(sizeof(int) * 8) + CMSG_SPACE(sizeof(struct ucred))];
    struct cmsghdr align;
  } ctl;
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctl.space;
  msg.msg_controllen = sizeof ctl.space;
  ssize_t r = recvmsg(c->rfd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (r < 0) return r;
  int fds[8];
  size_t n = 0;
  for (struct cmsghdr *m = CMSG_FIRSTHDR(&msg); m; m = CMSG_NXTHDR(&msg, m)) {
    if (m->cmsg_level == SOL_SOCKET && m->cmsg_type == SCM_CREDENTIALS && c->rx_bytes == 0 && r > 0) {
      struct ucred cred; /* the writer of the stream's first bytes: the hello */
      memcpy(&cred, CMSG_DATA(m), sizeof cred);
      c->peer_kpid = cred.pid; /* 0 when its pid namespace is not visible from here */
    }
    if (m->cmsg_level != SOL_SOCKET || m->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (m->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; i++) {
      int fd;
      memcpy(&fd, CMSG_DATA(m) + i * sizeof(int), sizeof fd);
      if (n < 8)
        fds[n++] = fd;
      else
        close(fd);
    }
  }
  if (r == 0) { /* no bytes for them to ride on */
    for (size_t i = 0; i < n; i++) close(fds[i]);
    return 0;
  }
  c->rx_bytes += (uint64_t)r;
  take_fds(c, fds, n, (msg.msg_flags & MSG_CTRUNC) != 0, c->rx_bytes - 1);
  return r;
}

/* Move up to cap bytes read ahead (a spill buffer) to dst; the count. */
static size_t take_spilled(const uint8_t *spill, size_t *off, size_t len, uint8_t *dst, size_t cap) {
  size_t n = len - *off < cap ? len - *off : cap;
  memcpy(dst, spill + *off, n);
  *off += n;
  return n;
}

/* Room left for reading ahead: bytes stay in the spill buffer until a
 * receive takes them, SPILL_MAX at most. */
static size_t spill_room(const ts_conn *c) {
  return c->spill_off == c->spill_len ? SPILL_MAX : SPILL_MAX - c->spill_len;
}

/* Read what the peer has sent into the spill buffer (a send is waiting for
 * room). Errors are left for the next receive to find. A full buffer reads
 * nothing: a read into no room returns 0, which is not the peer's end. */
static void spill_read(ts_conn *c) {
  if (spill_room(c) == 0) return;
  if (!c->spill && !(c->spill = malloc(SPILL_MAX))) return;
  if (c->spill_off == c->spill_len) c->spill_off = c->spill_len = 0;
  ssize_t r = recv_into(c, c->spill + c->spill_len, SPILL_MAX - c->spill_len);
  if (r > 0) c->spill_len += (size_t)r;
  if (r == 0) c->spill_eof = true;
}

static void wait_on_socket_too(ts_conn *c);
static void ring_spill_read(ts_conn *c);

/* Wait until the peer can take bytes, reading what it sends meanwhile. */
static int wait_writable(ts_conn *c, int64_t deadline) {
  for (;;) {
    if (ts_conn_uses_ring(c)) wait_on_socket_too(c); /* a peer whose ring is full reads nothing of ours */
    /* Reading never stops for fds: past the channel's fd budget they are
     * closed on arrival and their shares refused, so two ends that share to
     * each other both keep reading (up to SPILL_MAX bytes). */
    bool can_read = c->dec && !c->spill_eof && spill_room(c) > 0 && c->rfd >= 0;
    struct pollfd p[2] = {{.fd = c->wfd, .events = POLLOUT, .revents = 0},
                          {.fd = c->rfd, .events = POLLIN, .revents = 0}};
    int n = poll(p, can_read ? 2 : 1, ts_remaining(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ts_errsys(c->err, c->err_cap, TSHARE_E_SYSTEM, errno, "poll (send)");
    if (ts_conn_uses_ring(c)) ts_ring_reader_waits(&c->ring_in, TS_RING_AWAKE);
    if (n == 0) return ts_errf(c->err, c->err_cap, TSHARE_E_TIMEOUT, "send: timed out");
    if (p[0].revents) return TSHARE_OK; /* errors and hangups surface in the write */
    if (can_read && p[1].revents) spill_read(c);
  }
}

/* One non-blocking write of buf to the peer, fd (if >= 0) riding on its
 * first byte. Like write(): bytes written, or -1 with errno. */
static ssize_t write_once(ts_conn *c, const uint8_t *buf, size_t len, int fd) {
  if (c->kind != TSHARE_CHANNEL_SOCKET) return pipe_write_nosigpipe(c->wfd, buf, len);
  struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
  struct msghdr msg = {0};
  union {
    char space[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } ctl;
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (fd >= 0) {
    memset(&ctl, 0, sizeof ctl);
    msg.msg_control = ctl.space;
    msg.msg_controllen = sizeof ctl.space;
    struct cmsghdr *m = CMSG_FIRSTHDR(&msg);
    m->cmsg_level = SOL_SOCKET;
    m->cmsg_type = SCM_RIGHTS;
    m->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(m), &fd, sizeof fd);
  }
  return sendmsg(c->wfd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* A begun frame cannot be taken back, and cutting it would break the stream:
 * its end waits in the tail and goes first later (with send_lock held; rest
 * may point into the tail itself). */
static void keep_tail(ts_conn *c, const uint8_t *rest, size_t n) {
  memmove(c->tail, rest, n);
  c->tail_len = n;
  atomic_store(&c->tail_pending, true);
}

static int send_bytes(ts_conn *c, const uint8_t *buf, size_t len, int fd, int64_t deadline) {
  size_t off = 0;
  while (off < len) {
    ssize_t r = write_once(c, buf + off, len - off, off == 0 ? fd : -1);
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
        keep_tail(c, buf + off, len - off); /* the frame counts as sent: its fd went with its first byte */
        return TSHARE_OK;
      }
      if (rc != TSHARE_OK) return rc;
      continue;
    }
    if (r < 0 && (errno == EPIPE || errno == ECONNRESET))
      return peer_closed(c, "send");
    return ts_errsys(c->err, c->err_cap, TSHARE_E_SYSTEM, errno, "send");
  }
  return TSHARE_OK;
}

static int pay_markers_locked(ts_conn *c, int64_t deadline);

/* Send the end of a frame cut short by a timeout (with send_lock held), and
 * the ring entries owed for frames on the socket. TSHARE_E_TIMEOUT leaves
 * what is left for later. */
static int flush_tail_locked(ts_conn *c, int64_t deadline) {
  size_t n = c->tail_len;
  int rc = TSHARE_OK;
  if (n > 0) {
    c->tail_len = 0;
    atomic_store(&c->tail_pending, false);
    rc = send_bytes(c, c->tail, n, -1, deadline); /* may keep a shorter tail */
    if (rc != TSHARE_OK && c->tail_len == 0 && rc == TSHARE_E_TIMEOUT) {
      c->tail_len = n; /* nothing went: all of it is still there */
      atomic_store(&c->tail_pending, true);
    }
  }
  if (rc == TSHARE_OK) rc = pay_markers_locked(c, deadline);
  return rc;
}

/* The driving thread's chance to finish a cut frame without sending anything
 * new: at once if the socket takes it, else when poll says it can. */
static void try_flush_tail(ts_conn *c) {
  if (!atomic_load(&c->tail_pending) && !atomic_load(&c->markers_pending)) return;
  pthread_mutex_lock(&c->send_lock);
  (void)flush_tail_locked(c, ts_deadline(0));
  pthread_mutex_unlock(&c->send_lock);
}

unsigned long ts_thread_tag(void) {
  static atomic_ulong next_tag;
  static _Thread_local unsigned long tag;
  if (!tag) tag = atomic_fetch_add(&next_tag, 1) + 1;
  return tag;
}

uint32_t ts_conn_caps(const ts_conn *c) {
  uint32_t caps = TS_TRANSPORT_SAME_HOST;
  if (c->kind == TSHARE_CHANNEL_SOCKET) caps |= TS_TRANSPORT_PASSES_FDS | TS_TRANSPORT_PEER_CREDENTIALS;
  if (ts_conn_uses_ring(c)) caps |= TS_TRANSPORT_SHARED_MEMORY;
  return caps;
}

static void mark_driver(ts_conn *c) {
  unsigned long me = ts_thread_tag();
  if (atomic_load_explicit(&c->driver, memory_order_relaxed) != me)
    atomic_store_explicit(&c->driver, me, memory_order_relaxed);
}

/* ---- the ring transport: sending ---------------------------------------- */

static int ring_corrupt(ts_conn *c, const char *which) {
  if (!c->broken)
    c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL,
                        "peer %s corrupted the shared ring: its %s moved outside the ring", c->peer_label, which);
  return c->broken;
}

/* A ring frame (SOCKET_NEXT, NUDGE) encoded into buf (at ring setup). */
static size_t ring_op_frame(uint8_t *buf, size_t cap, uint8_t op) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RING;
  f.u.ring.op = op;
  size_t len = 0;
  char err[TSHARE_ERROR_MSG_MAX];
  (void)ts_wire_encode(&f, buf, cap, &len, err, sizeof err); /* cannot fail: a fixed, valid frame */
  return len;
}

/* The peer sleeps in poll() on its socket and asked to be told that the
 * ring moved: one small frame there, best effort (a full socket already
 * wakes it). Never waits; skipped while a cut frame's end is owed. */
static void nudge_peer(ts_conn *c, bool have_send_lock) {
  if (!have_send_lock && pthread_mutex_trylock(&c->send_lock) != 0) return; /* lost: its waits are sliced */
  if (c->wfd >= 0 && !atomic_load(&c->tail_pending)) {
    size_t len = c->ring_op_len;
    int saved_errno = errno;
    ssize_t r;
    while ((r = write_once(c, c->nudge_frame, len, -1)) < 0 && errno == EINTR) {
    }
    if (r > 0 && (size_t)r < len) keep_tail(c, c->nudge_frame + r, len - (size_t)r);
    errno = saved_errno;
  }
  if (!have_send_lock) pthread_mutex_unlock(&c->send_lock);
}

/* After publishing into ring_out (send_lock held). */
static void wake_ring_reader(ts_conn *c) {
  if (ts_ring_wake_reader(&c->ring_out) == TS_RING_SOCKET) nudge_peer(c, true);
}

/* Look for a hang-up on the socket without reading it: a peer that died or
 * closed while this end only watched the ring. */
static bool socket_hung_up(ts_conn *c) {
  struct pollfd p = {.fd = c->rfd, .events = POLLRDHUP, .revents = 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR));
}

/* The same, asked at most once a millisecond (*last: when it was last
 * asked), so a stream of ring calls costs no system call. */
static bool socket_hung_up_lately(ts_conn *c, int64_t *last) {
  int64_t now = ts_now_us();
  if (now - *last < 1000) return false;
  *last = now;
  return socket_hung_up(c);
}

/* About to wait in poll() on the socket: take what is in the ring (the peer
 * may itself wait for room in it) and ask its writer to nudge the socket
 * from now on, then take again what came in between. */
static void wait_on_socket_too(ts_conn *c) {
  ring_spill_read(c);
  ts_ring_reader_waits(&c->ring_in, TS_RING_SOCKET);
  ring_spill_read(c);
}

/* The ring is full: the peer is not reading. Wait in poll() on the socket
 * for its nudge (it reads, or it writes to us: read that into the spill
 * buffers so two ends that both send keep going), in slices so a lost nudge
 * costs a slice, never a hang. Once the spill buffer is full the socket's
 * bytes stay there: the wait only watches for a hang-up and sleeps its
 * slices, however much the peer sends. */
#define RING_ROOM_SLICE_MS 10
static int wait_ring_room(ts_conn *c, size_t len, int64_t deadline) {
  for (;;) {
    ts_ring_writer_waits(&c->ring_out, TS_RING_SOCKET);
    wait_on_socket_too(c);
    int room = ts_ring_room(&c->ring_out, len);
    int left = ts_remaining(deadline);
    int n = 0;
    bool can_read = spill_room(c) > 0;
    struct pollfd p = {.fd = c->rfd, .events = (short)((can_read ? POLLIN : 0) | POLLRDHUP), .revents = 0};
    if (room == 0 && left != 0) {
      n = poll(&p, 1, left < 0 || left > RING_ROOM_SLICE_MS ? RING_ROOM_SLICE_MS : left);
      if (n > 0 && can_read && (p.revents & POLLIN) && !(p.revents & (POLLHUP | POLLRDHUP | POLLERR))) spill_read(c);
    }
    ts_ring_writer_waits(&c->ring_out, TS_RING_AWAKE);
    ts_ring_reader_waits(&c->ring_in, TS_RING_AWAKE);
    if (room < 0) return ring_corrupt(c, "head");
    if (room > 0) return TSHARE_OK;
    if (n > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR)))
      return peer_closed(c, "send");
    if (n < 0 && errno != EINTR) return ts_errsys(c->err, c->err_cap, TSHARE_E_SYSTEM, errno, "poll (send)");
    if (ts_remaining(deadline) == 0)
      return ts_errf(c->err, c->err_cap, TSHARE_E_TIMEOUT, "send: timed out (peer %s does not empty its ring)",
                     c->peer_label);
  }
}

/* Frame bytes into the ring, whole (send_lock held), waiting for room. */
static int ring_put(ts_conn *c, const uint8_t *buf, size_t len, int64_t deadline) {
  /* The ring stays mapped after the peer is gone: its socket says so. */
  if (socket_hung_up_lately(c, &c->hup_send_us)) return peer_closed(c, "send");
  for (;;) {
    if (c->broken) return c->broken;
    int w = ts_ring_write(&c->ring_out, buf, len);
    if (w < 0) return ring_corrupt(c, "head");
    if (w > 0) {
      wake_ring_reader(c);
      return TSHARE_OK;
    }
    int rc = wait_ring_room(c, len, deadline);
    if (rc != TSHARE_OK) return rc;
  }
}

/* The SOCKET_NEXT entries owed for fd frames already on the socket. */
static int pay_markers_locked(ts_conn *c, int64_t deadline) {
  while (c->markers_owed > 0) {
    int rc = ring_put(c, c->socket_next_frame, c->ring_op_len, deadline);
    if (rc != TSHARE_OK) return rc;
    if (--c->markers_owed == 0) atomic_store(&c->markers_pending, false);
  }
  return TSHARE_OK;
}

/* A frame onto the ring transport (send_lock held, the tail flushed): fd
 * frames on the socket first, then their place in the ring, so a send that
 * times out on a full socket has sent nothing at all. */
static int ring_send_locked(ts_conn *c, const uint8_t *buf, size_t len, int fd, int64_t deadline) {
  if (fd < 0) return ring_put(c, buf, len, deadline);
  int rc = send_bytes(c, buf, len, fd, deadline); /* OK also when its end waits in the tail */
  if (rc != TSHARE_OK) return rc;
  c->markers_owed++;
  atomic_store(&c->markers_pending, true);
  (void)pay_markers_locked(c, deadline); /* sent either way: the entry goes before anything else */
  return TSHARE_OK;
}

/* With send_lock held. */
static bool send_now_locked(ts_conn *c, const tshare_frame *f) {
  if (c->wfd < 0 || atomic_load(&c->tail_pending) || atomic_load(&c->markers_pending)) return false;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  char err[TSHARE_ERROR_MSG_MAX];
  if (ts_wire_encode(f, buf, sizeof buf, &len, err, sizeof err) != TSHARE_OK) return false;
  if (ts_conn_uses_ring(c)) {
    if (c->broken || ts_ring_write(&c->ring_out, buf, len) <= 0) return false; /* full, or for the driver to find */
    wake_ring_reader(c);
    return true;
  }
  int saved_errno = errno;
  size_t off = 0;
  while (off < len) {
    ssize_t r = write_once(c, buf + off, len - off, -1);
    if (r > 0) {
      off += (size_t)r;
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    break; /* full, or an error the driving thread meets on its own */
  }
  errno = saved_errno;
  if (off == 0) return false;
  if (off < len) keep_tail(c, buf + off, len - off); /* from the driving thread or the next send */
  return true;
}

int ts_conn_send(ts_conn *c, const tshare_frame *f, int fd, int timeout_ms) {
  mark_driver(c);
  if (c->wfd < 0) return ts_errf(c->err, c->err_cap, TSHARE_E_STATE, "send: channel is closed");
  if (fd >= 0 && c->kind != TSHARE_CHANNEL_SOCKET)
    return ts_errf(c->err, c->err_cap, TSHARE_E_UNSUPPORTED,
                   "send: a pipe channel cannot carry fds: open a socket channel");
  if ((fd >= 0) != ((f->flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0))
    return ts_errf(c->err, c->err_cap, TSHARE_E_INVALID_ARG, "send: the fd-attached flag and the fd argument disagree");
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  int rc = ts_wire_encode(f, buf, sizeof buf, &len, c->err, c->err_cap);
  if (rc != TSHARE_OK) return rc;
  int64_t deadline = ts_deadline(timeout_ms);
  pthread_mutex_lock(&c->send_lock);
  rc = flush_tail_locked(c, deadline);
  if (rc == TSHARE_OK)
    rc = ts_conn_uses_ring(c) ? ring_send_locked(c, buf, len, fd, deadline) : send_bytes(c, buf, len, fd, deadline);
  pthread_mutex_unlock(&c->send_lock);
  return rc;
}

void ts_conn_wake(ts_conn *c) {
  pthread_mutex_lock(&c->wake_lock);
  c->woken = true;
  atomic_store(&c->wake_hint, true); /* a spinning receive sees it */
  if (c->waiting && c->wake_fd >= 0) {
    uint64_t one = 1;
    if (write(c->wake_fd, &one, sizeof one) < 0) {
      /* EAGAIN: the counter is already nonzero, the driver wakes anyway. */
    }
    if (ts_conn_uses_ring(c)) ts_ring_ring_bell(&c->ring_in); /* asleep on its ring's bell */
  }
  pthread_mutex_unlock(&c->wake_lock);
}

/* The receive side's check of `woken` (TS_CONN_WOKEN once per wake). */
static bool take_woken(ts_conn *c) {
  if (!atomic_load_explicit(&c->wake_hint, memory_order_relaxed)) return false;
  pthread_mutex_lock(&c->wake_lock);
  bool woken = c->woken;
  c->woken = false;
  atomic_store(&c->wake_hint, false);
  pthread_mutex_unlock(&c->wake_lock);
  return woken;
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

/* Wait for bytes from the peer, or for ts_conn_wake() (TS_CONN_WOKEN): the
 * caller may have work, such as releases the peer waits for before it sends
 * what this thread waits for. */
static int wait_readable(ts_conn *c, int64_t deadline) {
  for (;;) {
    pthread_mutex_lock(&c->wake_lock);
    bool woken = c->woken;
    c->woken = false;
    atomic_store(&c->wake_hint, false);
    c->waiting = !woken;
    pthread_mutex_unlock(&c->wake_lock);
    if (woken) return TS_CONN_WOKEN;
    try_flush_tail(c); /* the peer may wait for the rest of a frame before it sends */
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
      return ts_errf(c->err, c->err_cap, TSHARE_E_TIMEOUT, "receive: timed out");
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

/* Read what is available into the decoder (during the hello, no further than
 * its frame). TSHARE_OK when bytes came. */
static int read_some(ts_conn *c, int64_t deadline) {
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
      r = (ssize_t)take_spilled(c->spill, &c->spill_off, c->spill_len, space, avail);
    } else if (c->spill_eof) {
      r = 0;
    } else {
      r = recv_into(c, space, avail);
    }
    if (r > 0) {
      tshare_decoder_commit(c->dec, (size_t)r);
      c->fed += (uint64_t)r;
      return TSHARE_OK;
    }
    if (r == 0) {
      size_t pending = tshare_decoder_pending(c->dec);
      if (pending)
        return c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PEER_CLOSED,
                                   "receive: peer %s closed the channel mid-frame (%zu bytes of a frame read)",
                                   c->peer_label, pending);
      return c->broken = peer_closed(c, "receive");
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      rc = wait_readable(c, deadline);
      if (rc != TSHARE_OK) return rc;
      continue;
    }
    if (errno == ECONNRESET)
      return c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PEER_CLOSED, "receive: connection reset by peer %s",
                                 c->peer_label);
    return c->broken = ts_errsys(c->err, c->err_cap, TSHARE_E_SYSTEM, errno, "receive");
  }
}

/* A decoder failure: the stream is lost; tell the peer why we hang up (it
 * may be a version skew). */
static int decode_failed(ts_conn *c, int rc, tshare_decoder *dec, const char *where) {
  if (c->peer.pid)
    c->broken = ts_errf(c->err, c->err_cap, rc, "frame from %s%s: %s", c->peer_label, where,
                        tshare_decoder_last_error(dec));
  else
    c->broken = ts_errf(c->err, c->err_cap, rc, "first frame from the peer: %s", tshare_decoder_last_error(dec));
  ts_conn_send_error(c, rc, c->err);
  return rc;
}

/* The next frame of the socket's stream and the fd that rode on it (*found:
 * whether one came). Nudges are skipped; other ring frames are only taken
 * while the hello waits for the peer's ring. may_read false: only what is
 * already buffered (TSHARE_AGAIN when no frame is). */
static int socket_frame(ts_conn *c, tshare_frame *f, ts_fd_entry *e, bool *found, int64_t deadline, bool may_read) {
  for (;;) {
    if (c->broken) return c->broken;
    int rc = tshare_decoder_next(c->dec, f);
    if (rc == TSHARE_OK) {
      *e = fds_of_frame(c, c->fed - tshare_decoder_pending(c->dec), found);
      if (f->type != TSHARE_FRAME_RING || (c->in_setup && f->u.ring.op == TSHARE_RING_SETUP)) return TSHARE_OK;
      if (e->fd >= 0) close(e->fd);
      if (ts_conn_uses_ring(c) && f->u.ring.op == TSHARE_RING_NUDGE) continue;
      return c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL,
                                 "receive: peer %s sent a ring frame (op %u) on the socket out of place", c->peer_label,
                                 (unsigned)f->u.ring.op);
    }
    if (rc < 0) return decode_failed(c, rc, c->dec, "");
    if (!may_read) return TSHARE_AGAIN;
    rc = read_some(c, deadline);
    if (rc != TSHARE_OK) return rc;
  }
}

/* Hand a frame and its fd to the caller, checking that they agree. */
static int deliver(ts_conn *c, const tshare_frame *f, ts_fd_entry e, bool found, int *fd_out, int *fd_lost) {
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

/* ---- the ring transport: receiving -------------------------------------- */

/* Ring bytes into the ring spill buffer (a send waits for room: the peer may
 * wait for room in our direction). The peer's writer is told if it waits. */
static void ring_spill_read(ts_conn *c) {
  if (!ts_conn_uses_ring(c) || c->broken) return;
  if (!c->ring_spill && !(c->ring_spill = malloc(SPILL_MAX))) return;
  if (c->ring_spill_off == c->ring_spill_len) c->ring_spill_off = c->ring_spill_len = 0;
  long n = ts_ring_read(&c->ring_in, c->ring_spill + c->ring_spill_len, SPILL_MAX - c->ring_spill_len);
  if (n < 0) {
    (void)ring_corrupt(c, "tail");
    return;
  }
  c->ring_spill_len += (size_t)n;
  if (n > 0 && ts_ring_wake_writer(&c->ring_in) == TS_RING_SOCKET) nudge_peer(c, true);
}

/* Whether the ring may still hold the SOCKET_NEXT entry of the frame read
 * early: ring bytes not yet decoded (a partial frame in its decoder does not
 * count: the ring's writer publishes whole frames). */
static bool ring_may_hold_entry(ts_conn *c) {
  return c->ring_spill_off < c->ring_spill_len || ts_ring_available(&c->ring_in) != 0;
}

/* A frame read from the socket before its SOCKET_NEXT entry came: it waits
 * in `early`. A peer puts that entry into the ring before it sends anything
 * else but nudges on the socket, so a second one there while the ring holds
 * nothing that could be the first one's entry is the peer's fault. */
static void keep_early(ts_conn *c, const tshare_frame *f, ts_fd_entry e, bool found) {
  if (!c->has_early) {
    c->early = *f;
    c->early_fd = e;
    c->early_found = found;
    c->has_early = true;
    return;
  }
  if (e.fd >= 0) close(e.fd);
  c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL,
                      "receive: peer %s sent a %s frame on the socket before the ring entry of the %s frame it sent "
                      "there first",
                      c->peer_label, tshare_frame_type_name(f->type), tshare_frame_type_name(c->early.type));
}

/* Take the socket bytes already there, so that nudges stop making the fd
 * readable (a poll loop would spin on them). A real frame read early waits
 * for its SOCKET_NEXT entry; while it waits, the socket is still read (a
 * nudge behind it would keep the fd readable forever), unless the ring may
 * hold that entry: the caller takes the ring first. A hang-up is left for the
 * caller to see, after the ring is empty. */
static void drain_nudges(ts_conn *c) {
  while (!c->broken && !(c->has_early && ring_may_hold_entry(c))) {
    tshare_frame f;
    ts_fd_entry e;
    bool found;
    int rc = socket_frame(c, &f, &e, &found, 0, false);
    if (rc == TSHARE_OK) {
      keep_early(c, &f, e, found);
      continue;
    }
    if (rc != TSHARE_AGAIN) return;
    if (c->spill_off == c->spill_len) {
      struct pollfd p = {.fd = c->rfd, .events = POLLIN | POLLRDHUP, .revents = 0};
      if (poll(&p, 1, 0) <= 0 || !(p.revents & POLLIN) || (p.revents & (POLLHUP | POLLRDHUP | POLLERR))) return;
    }
    if (read_some(c, ts_deadline(0)) != TSHARE_OK) return;
  }
}

#define RING_SLEEP_SLICE_US 100000 /* a sleeping receive looks for a hang-up this often */

#define SPIN_LOOK_EVERY 16 /* pauses between looks at the clock and at the peer (~1-3 us) */
#define SPIN_GAVE_UP 1     /* spin_on_ring: nothing came; sleep */

/* Spin on the ring for up to budget_ns (the policy says how long and when to
 * give up early), then tell the policy how it went. TSHARE_OK once bytes
 * came, TS_CONN_WOKEN, an error, or SPIN_GAVE_UP. */
static int spin_on_ring(ts_conn *c, uint32_t budget_ns) {
  uint64_t start = ts_spin_clock_ns(), last = start;
  for (unsigned i = 1;; i++) {
    if (take_woken(c)) return TS_CONN_WOKEN;
    long avail = ts_ring_available(&c->ring_in);
    if (avail < 0) return ring_corrupt(c, "tail");
    if (avail > 0) {
      ts_spin_learn(&c->spin, TS_SPIN_CAUGHT);
      return TSHARE_OK;
    }
    ts_cpu_relax();
    if (i % SPIN_LOOK_EVERY != 0) continue;
    uint64_t now = ts_spin_clock_ns();
    int why = ts_spin_should_stop(&c->spin, now - start, now - last, budget_ns, ts_ring_reader_asleep(&c->ring_out));
    if (why != TS_SPIN_GOING) {
      ts_spin_learn(&c->spin, why);
      return SPIN_GAVE_UP;
    }
    last = now;
  }
}

/* Wait for bytes in the ring: spin while the policy says it can pay, then
 * sleep on the bell (in slices, asking the socket for a hang-up after each),
 * or return TS_CONN_WOKEN. With no time left, a poll loop's end asks for a
 * nudge. */
static int wait_ring(ts_conn *c, int64_t deadline) {
  uint32_t budget = ts_remaining(deadline) != 0
                        ? ts_spin_plan(&c->spin, ts_spin_cpus_milli(), ts_ring_reader_asleep(&c->ring_out))
                        : 0;
  if (budget > 0) {
    int rc = spin_on_ring(c, budget);
    if (rc != SPIN_GAVE_UP) return rc;
  }
  for (;;) {
    if (take_woken(c)) return TS_CONN_WOKEN;
    long avail = ts_ring_available(&c->ring_in);
    if (avail < 0) return ring_corrupt(c, "tail");
    if (avail > 0) return TSHARE_OK;
    try_flush_tail(c); /* the peer may wait for the rest of an fd frame */
    int left = ts_remaining(deadline);
    if (left == 0) {
      if (atomic_load(&c->pollable)) { /* ask for a nudge, then look once more: no wake-up falls between */
        drain_nudges(c);
        if (c->broken) return c->broken;
        ts_ring_reader_waits(&c->ring_in, TS_RING_SOCKET);
        if ((avail = ts_ring_available(&c->ring_in)) != 0) {
          ts_ring_reader_waits(&c->ring_in, TS_RING_AWAKE);
          if (avail < 0) return ring_corrupt(c, "tail");
          return TSHARE_OK;
        }
      }
      /* Poll loops ask each time (their poll said POLLHUP), others at most once a millisecond. */
      bool hung_up = atomic_load(&c->pollable) ? socket_hung_up(c) : socket_hung_up_lately(c, &c->hup_recv_us);
      if (hung_up && ts_ring_available(&c->ring_in) == 0)
        return c->broken = peer_closed(c, "receive");
      return ts_errf(c->err, c->err_cap, TSHARE_E_TIMEOUT, "receive: timed out");
    }
    uint32_t seen = atomic_load_explicit(&c->ring_in.ctl->bell, memory_order_acquire);
    pthread_mutex_lock(&c->wake_lock);
    bool woken = c->woken;
    c->waiting = !woken;
    pthread_mutex_unlock(&c->wake_lock);
    if (woken) continue; /* the loop's top takes it */
    ts_ring_reader_waits(&c->ring_in, TS_RING_FUTEX);
    avail = ts_ring_available(&c->ring_in);
    if (avail == 0) {
      long slice = atomic_load(&c->tail_pending) || atomic_load(&c->markers_pending) ? 1000 : RING_SLEEP_SLICE_US;
      if (left > 0 && (long)left * 1000 < slice) slice = (long)left * 1000;
      ts_ring_sleep(&c->ring_in, seen, slice);
    }
    ts_ring_reader_waits(&c->ring_in, TS_RING_AWAKE);
    pthread_mutex_lock(&c->wake_lock);
    c->waiting = false;
    pthread_mutex_unlock(&c->wake_lock);
    if (avail == 0 && ts_ring_available(&c->ring_in) == 0 && socket_hung_up(c))
      return c->broken = peer_closed(c, "receive");
  }
}

/* Ring bytes into the ring's decoder: from the spill first, else the ring. */
static int ring_fill(ts_conn *c, int64_t deadline) {
  for (;;) {
    uint8_t *space;
    size_t cap;
    int rc = tshare_decoder_space(c->ring_dec, &space, &cap);
    if (rc != TSHARE_OK) return ts_errf(c->err, c->err_cap, rc, "receive: %s", tshare_decoder_last_error(c->ring_dec));
    if (c->ring_spill_off < c->ring_spill_len) {
      tshare_decoder_commit(c->ring_dec, take_spilled(c->ring_spill, &c->ring_spill_off, c->ring_spill_len, space, cap));
      return TSHARE_OK;
    }
    long n = ts_ring_read(&c->ring_in, space, cap); /* copied out: the peer cannot change what is decoded */
    if (n < 0) return ring_corrupt(c, "tail");
    if (n > 0) {
      tshare_decoder_commit(c->ring_dec, (size_t)n);
      if (ts_ring_wake_writer(&c->ring_in) == TS_RING_SOCKET) nudge_peer(c, false);
      return TSHARE_OK;
    }
    rc = wait_ring(c, deadline);
    if (rc != TSHARE_OK) return rc;
  }
}

static int ring_recv(ts_conn *c, tshare_frame *f, int *fd_out, int *fd_lost, int64_t deadline) {
  for (;;) {
    if (c->broken) return c->broken;
    if (c->socket_next) {
      ts_fd_entry e;
      bool found;
      int rc = TSHARE_OK;
      if (c->has_early) {
        *f = c->early;
        e = c->early_fd;
        found = c->early_found;
        c->has_early = false;
      } else {
        rc = socket_frame(c, f, &e, &found, deadline, true);
      }
      if (rc != TSHARE_OK) return rc;
      c->socket_next = false;
      return deliver(c, f, e, found, fd_out, fd_lost);
    }
    int rc = tshare_decoder_next(c->ring_dec, f);
    if (rc == TSHARE_OK) {
      if (f->type == TSHARE_FRAME_RING && f->u.ring.op == TSHARE_RING_SOCKET_NEXT) {
        c->socket_next = true;
        continue;
      }
      if (f->type == TSHARE_FRAME_RING || (f->flags & TSHARE_FRAME_FLAG_FD_ATTACHED))
        return c->broken = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL,
                                   "receive: peer %s put a %s frame into the ring that does not belong there",
                                   c->peer_label, tshare_frame_type_name(f->type));
      return TSHARE_OK;
    }
    if (rc < 0) return decode_failed(c, rc, c->ring_dec, " (ring)");
    rc = ring_fill(c, deadline);
    if (rc != TSHARE_OK) return rc;
  }
}

int ts_conn_recv(ts_conn *c, tshare_frame *f, int *fd_out, int *fd_lost, int timeout_ms) {
  *fd_out = -1;
  *fd_lost = 0;
  mark_driver(c);
  if (c->rfd < 0) return ts_errf(c->err, c->err_cap, TSHARE_E_STATE, "receive: channel is closed");
  int64_t deadline = ts_deadline(timeout_ms);
  if (ts_conn_uses_ring(c)) return ring_recv(c, f, fd_out, fd_lost, deadline);
  ts_fd_entry e;
  bool found;
  int rc = socket_frame(c, f, &e, &found, deadline, true);
  if (rc != TSHARE_OK) return rc;
  return deliver(c, f, e, found, fd_out, fd_lost);
}

static int read_boot_id(uint8_t out[16]) {
  memset(out, 0, 16);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
  if (!f) return -1;
  char text[64] = {0};
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  int k = 0;
  for (size_t i = 0; i < n && k < 32; i++) {
    char c = text[i];
    int v = c >= '0' && c <= '9'   ? c - '0'
            : c >= 'a' && c <= 'f' ? c - 'a' + 10
            : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                   : -1;
    if (v < 0) continue;
    out[k / 2] = (uint8_t)(out[k / 2] | (k % 2 ? v : v << 4));
    k++;
  }
  return k == 32 ? 0 : -1;
}

static bool all_zero(const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i]) return false;
  return true;
}

/* The kernel's credentials of a socket's peer: nothing a peer says about
 * itself counts before this. */
static int check_peer_cred(ts_conn *c, long allow_uid, struct ucred *cred) {
  socklen_t len = sizeof *cred;
  if (getsockopt(c->rfd, SOL_SOCKET, SO_PEERCRED, cred, &len) != 0)
    return ts_errsys(c->err, c->err_cap, TSHARE_E_SYSTEM, errno, "channel: getsockopt(SO_PEERCRED)");
  long allow = allow_uid;
  if (cred->uid == getuid() || allow == TSHARE_ANY_UID || (allow >= 0 && (uid_t)allow == cred->uid)) return TSHARE_OK;
  return ts_errf(c->err, c->err_cap, TSHARE_E_PERMISSION,
                 "channel: the peer (pid %ld) runs as uid %ld, this process as uid %ld; set allow_uid in the channel "
                 "options to accept it",
                 (long)cred->pid, (long)cred->uid, (long)getuid());
}

/* How messages name the peer: by the pid the kernel reports where there is
 * one (a hello's pid is only the peer's word), else by its word, said so
 * (pipes; a peer in a pid namespace not visible from here; a hand-rolled
 * peer whose hello came without credentials). */
static void name_peer(ts_conn *c) {
  if (c->peer_kpid > 0)
    snprintf(c->peer_label, sizeof c->peer_label, "'%s' (pid %ld)", c->peer.name, (long)c->peer_kpid);
  else
    snprintf(c->peer_label, sizeof c->peer_label, "'%s' (says pid %u)", c->peer.name, c->peer.pid);
}

/* The start time of a process in clock ticks since boot (/proc/PID/stat field
 * 22): with the pid, it names one process for the life of the machine. */
static uint64_t start_time_of(long pid) {
  char path[64], text[1024];
  snprintf(path, sizeof path, "/proc/%ld/stat", pid);
  FILE *f = fopen(path, "re");
  if (!f) return 0;
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  const char *p = strrchr(text, ')'); /* the name may hold anything; fields follow the last ')' */
  unsigned long long start = 0;
  if (p &&
      sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu", &start) != 1)
    start = 0;
  return start;
}

#define KEY_BY_CHANNEL (1ull << 63) /* keys that name a channel, not a process */

static uint64_t peer_key_of(ts_conn *c) {
  static atomic_uint_fast64_t serials;
  uint64_t serial = (uint64_t)atomic_fetch_add(&serials, 1) + 1;
  if (c->peer_kpid <= 0) return KEY_BY_CHANNEL | (serial << 32);
  return ((uint64_t)c->peer_kpid | (start_time_of(c->peer_kpid) << 32)) & ~KEY_BY_CHANNEL;
}

uint64_t ts_conn_origin_key(const ts_conn *c, uint32_t claimed_pid) {
  if (claimed_pid == 0 || claimed_pid == c->peer.pid) return c->peer_key;
  /* Forwarded: the claim is kept, but only among this peer's own. */
  uint64_t h = c->peer_key * 0x9e3779b97f4a7c15ull ^ (uint64_t)claimed_pid * 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  return KEY_BY_CHANNEL | (h >> 1);
}

/* The most fds of the peer's shares this end holds before it refuses more:
 * a quarter of the soft RLIMIT_NOFILE, at most TS_FD_BUDGET_MAX. */
static size_t default_fd_budget(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 256;
  if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur / 4 > TS_FD_BUDGET_MAX) return TS_FD_BUDGET_MAX;
  return rl.rlim_cur / 4 < 8 ? 8 : (size_t)(rl.rlim_cur / 4);
}

/* Both hellos: ours out, the peer's in. */
static int exchange_hellos(ts_conn *c, int64_t deadline) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_HELLO;
  f.u.hello = c->self;
  int rc = ts_conn_send(c, &f, -1, ts_remaining(deadline));
  int fd = -1, fd_lost;
  /* The peer may send its first frames right behind its hello: they stay on
   * the socket, where a poll loop started once the channel is open sees them. */
  c->frame_at_a_time = true;
  while (rc == TSHARE_OK && (rc = ts_conn_recv(c, &f, &fd, &fd_lost, ts_remaining(deadline))) == TS_CONN_WOKEN) {
  }
  c->frame_at_a_time = false;
  if (rc != TSHARE_OK) {
    char why[TSHARE_ERROR_MSG_MAX];
    snprintf(why, sizeof why, "%s", c->err);
    return ts_errf(c->err, c->err_cap, rc, "hello: %s", why);
  }
  if (fd >= 0) close(fd);
  if (f.type == TSHARE_FRAME_ERROR)
    return ts_errf(c->err, c->err_cap, TSHARE_E_PEER_ERROR, "hello: peer refused the channel: %s (%s)",
                   f.u.error.message, tshare_status_name(f.u.error.code));
  if (f.type != TSHARE_FRAME_HELLO) {
    rc = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL, "hello: expected a hello frame, got %s",
                 tshare_frame_type_name(f.type));
    ts_conn_send_error(c, rc, c->err);
    return rc;
  }
  c->peer = f.u.hello;
  return TSHARE_OK;
}

/* Both ends send the ring they will write into and map the other's. A setup
 * that fails ends the channel: both hellos asked for the ring. */
static int ring_setup(ts_conn *c, uint32_t cap, int64_t deadline) {
  int memfd = -1;
  int rc = ts_ring_create(&c->ring_out, cap, &memfd, c->err, c->err_cap);
  tshare_frame f;
  memset(&f, 0, sizeof f);
  if (rc == TSHARE_OK) {
    f.type = TSHARE_FRAME_RING;
    f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
    f.u.ring.op = TSHARE_RING_SETUP;
    f.u.ring.capacity = cap;
    rc = ts_conn_send(c, &f, memfd, ts_remaining(deadline));
    close(memfd);
  }
  if (rc != TSHARE_OK) {
    ts_conn_send_error(c, rc, c->err);
    return rc;
  }
  ts_fd_entry e = {.fd = -1, .lost = 0, .at = 0, .last = 0};
  bool found = false;
  c->in_setup = true;
  while ((rc = socket_frame(c, &f, &e, &found, deadline, true)) == TS_CONN_WOKEN) {
  }
  c->in_setup = false;
  if (rc != TSHARE_OK) {
    char why[TSHARE_ERROR_MSG_MAX];
    snprintf(why, sizeof why, "%s", c->err);
    return ts_errf(c->err, c->err_cap, rc, "ring setup: %s", why);
  }
  if (f.type == TSHARE_FRAME_ERROR) {
    if (e.fd >= 0) close(e.fd);
    return ts_errf(c->err, c->err_cap, TSHARE_E_PEER_ERROR, "ring setup: peer refused the channel: %s (%s)",
                   f.u.error.message, tshare_status_name(f.u.error.code));
  }
  if (f.type != TSHARE_FRAME_RING || !found || e.fd < 0) {
    if (e.fd >= 0) close(e.fd);
    if (found && e.lost)
      rc = ts_errf(c->err, c->err_cap, TSHARE_E_LIMIT, "ring setup: the peer's ring could not be received: %s",
                   e.lost == TS_FD_OVER_BUDGET ? "the channel holds its fd budget" : strerror(e.lost));
    else
      rc = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL, "ring setup: expected the peer's ring, got a %s frame%s",
                   tshare_frame_type_name(f.type), found ? "" : " without an fd");
  } else {
    rc = ts_ring_attach(&c->ring_in, e.fd, f.u.ring.capacity, c->err, c->err_cap);
    close(e.fd);
    if (rc == TSHARE_OK && !(c->ring_dec = tshare_decoder_create(&c->limits)))
      rc = ts_errf(c->err, c->err_cap, TSHARE_E_NOMEM, "ring setup: out of memory");
    if (rc != TSHARE_OK) ts_ring_unmap(&c->ring_in);
  }
  if (rc != TSHARE_OK) {
    ts_conn_send_error(c, rc, c->err);
    return rc;
  }
  ts_spin_init(&c->spin, c->spin_us);
  ts_spin_refresh_cpus(); /* the affinity or the quota may have changed since the last channel opened */
  c->ring_op_len = ring_op_frame(c->socket_next_frame, sizeof c->socket_next_frame, TSHARE_RING_SOCKET_NEXT);
  (void)ring_op_frame(c->nudge_frame, sizeof c->nudge_frame, TSHARE_RING_NUDGE); /* the same length */
  /* Until the first receive, the peer's first frames also nudge the socket:
   * a poll loop started now must not sleep through them. */
  ts_ring_reader_waits(&c->ring_in, TS_RING_SOCKET);
  return TSHARE_OK;
}

int ts_conn_hello(ts_conn *c, const tshare_hello *self, long allow_uid, int timeout_ms) {
  int64_t deadline = ts_deadline(timeout_ms);
  c->self = *self;
  c->self.major = TSHARE_WIRE_MAJOR;
  c->self.minor = TSHARE_WIRE_MINOR;
  c->self.pid = (uint32_t)getpid();
  c->self.uid = (uint32_t)getuid();
  read_boot_id(c->self.boot_id);
  bool socket = c->kind == TSHARE_CHANNEL_SOCKET;
  struct ucred cred = {0, 0, 0};
  int rc = socket ? check_peer_cred(c, allow_uid, &cred) : TSHARE_OK;
  /* Who wrote the peer's hello, as the kernel attaches it to the bytes
   * (SCM_CREDENTIALS): SO_PEERCRED names whoever created a socketpair, which
   * is not the peer once the pair was handed out. Both ends ask before their
   * hello, so each one's hello carries it. */
  int on = 1, off = 0;
  if (rc == TSHARE_OK && socket) setsockopt(c->rfd, SOL_SOCKET, SO_PASSCRED, &on, sizeof on);
  if (rc == TSHARE_OK) rc = exchange_hellos(c, deadline);
  if (socket) setsockopt(c->rfd, SOL_SOCKET, SO_PASSCRED, &off, sizeof off);
  if (rc != TSHARE_OK) return rc;
  name_peer(c);
  c->peer_key = peer_key_of(c);
  if (!all_zero(c->self.boot_id, 16) && !all_zero(c->peer.boot_id, 16) &&
      memcmp(c->self.boot_id, c->peer.boot_id, 16) != 0)
    rc = ts_errf(c->err, c->err_cap, TSHARE_E_PEER_MISMATCH,
                 "hello: peer %s runs under another boot id: shares cannot cross machines or boots", c->peer_label);
  else if (socket && c->peer.uid != (uint32_t)cred.uid)
    rc = ts_errf(c->err, c->err_cap, TSHARE_E_PROTOCOL, "hello: peer %s claims uid %u, the kernel says %ld",
                 c->peer_label, c->peer.uid, (long)cred.uid);
  if (rc != TSHARE_OK) {
    ts_conn_send_error(c, rc, c->err);
    return rc;
  }
  const uint8_t ours = TSHARE_WIRE_MINOR;
  c->minor = c->peer.minor < ours ? c->peer.minor : ours;
  if (socket && c->minor >= 2 && (c->self.capabilities & c->peer.capabilities & TSHARE_CAP_RING))
    return ring_setup(c, TS_RING_CAP_DEFAULT, deadline);
  return TSHARE_OK;
}

static int set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return -1;
  return 0;
}

int ts_conn_init(ts_conn *c, tshare_channel_kind kind, int rfd, int wfd, const tshare_wire_limits *limits,
                 unsigned fd_budget, char *err, size_t err_cap) {
  memset(c, 0, sizeof *c);
  c->kind = kind;
  c->rfd = rfd;
  c->wfd = wfd;
  c->err = err;
  c->err_cap = err_cap;
  pthread_mutex_init(&c->send_lock, NULL);
  pthread_mutex_init(&c->wake_lock, NULL);
  c->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  c->limits = limits ? *limits : tshare_wire_limits_default();
  c->fd_budget = fd_budget ? fd_budget : default_fd_budget();
  snprintf(c->peer.name, sizeof c->peer.name, "?");
  snprintf(c->peer_label, sizeof c->peer_label, "'?'");
  c->dec = tshare_decoder_create(&c->limits);
  if (!c->dec) return ts_errf(err, err_cap, TSHARE_E_NOMEM, "channel: out of memory");
  if (c->wake_fd < 0) return ts_errsys(err, err_cap, TSHARE_E_SYSTEM, errno, "channel: eventfd");
  if (rfd < 0 || wfd < 0) return ts_errf(err, err_cap, TSHARE_E_INVALID_ARG, "channel: bad fd");
  if (set_nonblocking(rfd) != 0 || set_nonblocking(wfd) != 0)
    return ts_errsys(err, err_cap, TSHARE_E_SYSTEM, errno, "channel: fcntl(O_NONBLOCK) on fd %d/%d", rfd, wfd);
  if (kind == TSHARE_CHANNEL_SOCKET) {
    int type = 0;
    socklen_t len = sizeof type;
    if (getsockopt(rfd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM)
      return ts_errf(err, err_cap, TSHARE_E_INVALID_ARG, "channel: fd %d is not a stream socket", rfd);
  }
  return TSHARE_OK;
}

bool ts_conn_send_now(ts_conn *c, const tshare_frame *f) {
  if (pthread_mutex_trylock(&c->send_lock) != 0) return false; /* the one sending will be told */
  bool sent = send_now_locked(c, f);
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
  if (c->wfd < 0 || (!atomic_load(&c->tail_pending) && !atomic_load(&c->markers_pending))) return;
  pthread_mutex_lock(&c->send_lock);
  (void)flush_tail_locked(c, ts_deadline(timeout_ms));
  pthread_mutex_unlock(&c->send_lock);
}

size_t ts_conn_buffered(ts_conn *c) {
  if (!c->dec) return 0;
  size_t n = tshare_decoder_pending(c->dec);
  if (ts_conn_uses_ring(c)) {
    long avail = ts_ring_available(&c->ring_in);
    n += tshare_decoder_pending(c->ring_dec) + (c->ring_spill_len - c->ring_spill_off) + (avail > 0 ? (size_t)avail : 0) +
         (c->socket_next || c->has_early);
  }
  return n;
}

int ts_conn_poll_fd(ts_conn *c) {
  if (ts_conn_uses_ring(c) && !atomic_exchange(&c->pollable, true))
    ts_ring_reader_waits(&c->ring_in, TS_RING_SOCKET);
  return c->rfd;
}

void ts_conn_close(ts_conn *c) {
  fdq_close_all(c);
  pthread_mutex_lock(&c->wake_lock);
  pthread_mutex_lock(&c->send_lock);
  if (c->rfd >= 0) close(c->rfd);
  if (c->wfd >= 0 && c->wfd != c->rfd) close(c->wfd);
  c->rfd = c->wfd = -1;
  if (c->wake_fd >= 0) close(c->wake_fd);
  c->wake_fd = -1;
  ts_ring_unmap(&c->ring_in); /* under both locks: a waker rings ring_in's bell, a sender writes ring_out */
  ts_ring_unmap(&c->ring_out);
  pthread_mutex_unlock(&c->send_lock);
  pthread_mutex_unlock(&c->wake_lock);
  if (c->has_early && c->early_fd.fd >= 0) close(c->early_fd.fd);
  c->has_early = false;
  tshare_decoder_destroy(c->dec);
  c->dec = NULL;
  tshare_decoder_destroy(c->ring_dec);
  c->ring_dec = NULL;
  free(c->spill);
  c->spill = NULL;
  free(c->ring_spill);
  c->ring_spill = NULL;
}

void ts_conn_close_fork_copy(ts_conn *c) {
  /* The parent's thread that held a lock at fork does not run here; what it
   * was changing in this process's heap (spill buffers, decoders, the fd
   * queue) is left as it is, and goes when the child exits or execs. */
  if (c->rfd >= 0) close(c->rfd);
  if (c->wfd >= 0 && c->wfd != c->rfd) close(c->wfd);
  c->rfd = c->wfd = -1;
  if (c->wake_fd >= 0) close(c->wake_fd);
  c->wake_fd = -1;
  ts_ring_unmap(&c->ring_in);
  ts_ring_unmap(&c->ring_out);
}

void ts_conn_destroy(ts_conn *c) {
  pthread_mutex_destroy(&c->send_lock);
  pthread_mutex_destroy(&c->wake_lock);
}
