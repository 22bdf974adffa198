/* Framed, EINTR-safe, SIGPIPE-safe I/O over sockets and pipes, and the hello. */
#include "channel_internal.h"
#include "cuda_hooks.h"

#include "error_detail.h"
#include "tshare/share.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

void tshare_channel_options_init(tshare_channel_options *o) {
  memset(o, 0, sizeof *o);
  o->name = "tshare";
  o->handshake_timeout_ms = 10000;
  o->allow_uid = -1;
  o->keep_host_fds = 1;
}

int tshare_socketpair(int fds[2], tshare_error *err) {
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    char msg[TSHARE_ERROR_MSG_MAX];
    ts_error_fill(err, ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "socketpair"), msg);
    return TSHARE_E_SYSTEM;
  }
  return TSHARE_OK;
}

tshare_channel_kind tshare_channel_kind_of(const tshare_channel *ch) { return ch->kind; }
const tshare_hello *tshare_channel_peer(const tshare_channel *ch) { return &ch->peer; }
const char *tshare_channel_last_error(const tshare_channel *ch) {
  if (!ch) return "channel is NULL";
  return ch->err[0] ? ch->err : "no error";
}
int tshare_channel_fd(const tshare_channel *ch) { return ch->rfd; }

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

static bool fdq_push(tshare_channel *ch, ts_fd_entry e) {
  if (ch->fdq_head + ch->fdq_len == ch->fdq_cap) {
    if (ch->fdq_head > 0) { /* room at the front: slide down */
      memmove(ch->fdq, ch->fdq + ch->fdq_head, ch->fdq_len * sizeof *ch->fdq);
      ch->fdq_head = 0;
    } else {
      size_t cap = ch->fdq_cap ? ch->fdq_cap * 2 : 16;
      ts_fd_entry *q = realloc(ch->fdq, cap * sizeof *q);
      if (!q) return false;
      ch->fdq = q;
      ch->fdq_cap = cap;
    }
  }
  ch->fdq[ch->fdq_head + ch->fdq_len++] = e;
  return true;
}

/* The fds one read brought, at stream offset `at` (the read's last byte).
 * A frame carries at most one fd: the first is kept (if the channel may hold
 * another), the others closed. None delivered though the kernel cut the
 * control data means this process could not install it. */
static void take_fds(tshare_channel *ch, const int *fds, size_t n, bool cut, uint64_t at) {
  ts_fd_entry e = {.fd = -1, .lost = 0, .at = at};
  if (n == 0 && !cut) return;
  for (size_t i = 1; i < n; i++) close(fds[i]);
  if (n == 0) {
    e.lost = fd_shortage_errno();
  } else if (ch->held_fds >= ch->fd_budget) {
    close(fds[0]);
    e.lost = TS_FD_OVER_BUDGET;
  } else {
    e.fd = fds[0];
  }
  if (!fdq_push(ch, e)) {
    if (e.fd >= 0) close(e.fd);
    if (!ch->broken) ch->broken = ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
    return;
  }
  if (e.fd >= 0) ch->held_fds++;
}

/* The fd a frame ending at stream offset `end` carries: every queued fd that
 * came with its bytes is taken off the queue, the first returned (or why it
 * was lost), the rest closed. *found is false when none came. */
static ts_fd_entry fds_of_frame(tshare_channel *ch, uint64_t end, bool *found) {
  ts_fd_entry first = {.fd = -1, .lost = 0, .at = 0};
  *found = false;
  while (ch->fdq_len && ch->fdq[ch->fdq_head].at < end) {
    ts_fd_entry e = ch->fdq[ch->fdq_head++];
    ch->fdq_len--;
    if (e.fd >= 0) ch->held_fds--;
    if (!*found) {
      first = e;
      *found = true;
    } else if (e.fd >= 0) {
      close(e.fd);
    }
  }
  if (ch->fdq_len == 0) ch->fdq_head = 0;
  return first;
}

static void fdq_close_all(tshare_channel *ch) {
  bool found;
  ts_fd_entry e = fds_of_frame(ch, UINT64_MAX, &found);
  if (found && e.fd >= 0) close(e.fd);
  free(ch->fdq);
  ch->fdq = NULL;
  ch->fdq_cap = 0;
}

/* One read from the peer into buf: fds that come along go to the fd queue.
 * Like recvmsg: bytes read, 0 at EOF, -1 with errno. */
static ssize_t recv_into(tshare_channel *ch, uint8_t *buf, size_t cap) {
  if (ch->kind != TSHARE_CHANNEL_SOCKET) {
    ssize_t r = read(ch->rfd, buf, cap);
    if (r > 0) ch->rx_bytes += (uint64_t)r;
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
  ssize_t r = recvmsg(ch->rfd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (r < 0) return r;
  int fds[8];
  size_t n = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS && ch->rx_bytes == 0 && r > 0) {
      struct ucred cred; /* the writer of the stream's first bytes: the hello */
      memcpy(&cred, CMSG_DATA(c), sizeof cred);
      ch->peer_kpid = cred.pid; /* 0 when its pid namespace is not visible from here */
    }
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; i++) {
      int fd;
      memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
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
  ch->rx_bytes += (uint64_t)r;
  take_fds(ch, fds, n, (msg.msg_flags & MSG_CTRUNC) != 0, ch->rx_bytes - 1);
  return r;
}

/* Read what the peer has sent into the spill buffer (a send is waiting for
 * room). Errors are left for the next receive to find. */
static void spill_read(tshare_channel *ch) {
  if (!ch->spill && !(ch->spill = malloc(SPILL_MAX))) return;
  if (ch->spill_off == ch->spill_len) ch->spill_off = ch->spill_len = 0;
  ssize_t r = recv_into(ch, ch->spill + ch->spill_len, SPILL_MAX - ch->spill_len);
  if (r > 0) ch->spill_len += (size_t)r;
  if (r == 0) ch->spill_eof = true;
}

/* Wait until the peer can take bytes, reading what it sends meanwhile. */
static int wait_writable(tshare_channel *ch, int64_t deadline) {
  for (;;) {
    /* Reading never stops for fds: past the channel's fd budget they are
     * closed on arrival and their shares refused, so two ends that share to
     * each other both keep reading (up to SPILL_MAX bytes). */
    bool can_read = ch->dec && !ch->spill_eof && ch->spill_len < SPILL_MAX && ch->rfd >= 0;
    struct pollfd p[2] = {{.fd = ch->wfd, .events = POLLOUT, .revents = 0},
                          {.fd = ch->rfd, .events = POLLIN, .revents = 0}};
    int n = poll(p, can_read ? 2 : 1, ts_remaining(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ts_errsys(ch->err, sizeof ch->err, TSHARE_E_SYSTEM, errno, "poll (send)");
    if (n == 0) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_TIMEOUT, "send: timed out");
    if (p[0].revents) return TSHARE_OK; /* errors and hangups surface in the write */
    if (can_read && p[1].revents) spill_read(ch);
  }
}

/* One non-blocking write of buf to the peer, fd (if >= 0) riding on its
 * first byte. Like write(): bytes written, or -1 with errno. */
static ssize_t write_once(tshare_channel *ch, const uint8_t *buf, size_t len, int fd) {
  if (ch->kind != TSHARE_CHANNEL_SOCKET) return pipe_write_nosigpipe(ch->wfd, buf, len);
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
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  return sendmsg(ch->wfd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* A begun frame cannot be taken back, and cutting it would break the stream:
 * its end waits in the tail and goes first later (with send_lock held; rest
 * may point into the tail itself). */
static void keep_tail(tshare_channel *ch, const uint8_t *rest, size_t n) {
  memmove(ch->tail, rest, n);
  ch->tail_len = n;
  atomic_store(&ch->tail_pending, true);
}

static int send_bytes(tshare_channel *ch, const uint8_t *buf, size_t len, int fd, int64_t deadline) {
  size_t off = 0;
  while (off < len) {
    ssize_t r = write_once(ch, buf + off, len - off, off == 0 ? fd : -1);
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
        return ts_errf(ch->err, sizeof ch->err, TSHARE_E_TIMEOUT,
                       "send: peer %s does not take the fds already in flight", ch->peer_label);
      usleep(1000);
      continue;
    }
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int rc = wait_writable(ch, deadline);
      if (rc == TSHARE_E_TIMEOUT && off > 0) {
        keep_tail(ch, buf + off, len - off); /* the frame counts as sent: its fd went with its first byte */
        return TSHARE_OK;
      }
      if (rc != TSHARE_OK) return rc;
      continue;
    }
    if (r < 0 && (errno == EPIPE || errno == ECONNRESET))
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_CLOSED, "send: peer %s closed the channel", ch->peer_label);
    return ts_errsys(ch->err, sizeof ch->err, TSHARE_E_SYSTEM, errno, "send");
  }
  return TSHARE_OK;
}

/* Send the end of a frame cut short by a timeout (with send_lock held).
 * TSHARE_E_TIMEOUT leaves what is left of it for later. */
static int flush_tail_locked(tshare_channel *ch, int64_t deadline) {
  size_t n = ch->tail_len;
  if (n == 0) return TSHARE_OK;
  ch->tail_len = 0;
  atomic_store(&ch->tail_pending, false);
  int rc = send_bytes(ch, ch->tail, n, -1, deadline); /* may keep a shorter tail */
  if (rc != TSHARE_OK && ch->tail_len == 0 && rc == TSHARE_E_TIMEOUT) {
    ch->tail_len = n; /* nothing went: all of it is still there */
    atomic_store(&ch->tail_pending, true);
  }
  return rc;
}

/* The driving thread's chance to finish a cut frame without sending anything
 * new: at once if the socket takes it, else when poll says it can. */
static void try_flush_tail(tshare_channel *ch) {
  if (!atomic_load(&ch->tail_pending)) return;
  pthread_mutex_lock(&ch->send_lock);
  (void)flush_tail_locked(ch, ts_deadline(0));
  pthread_mutex_unlock(&ch->send_lock);
}

unsigned long ts_thread_tag(void) {
  static atomic_ulong next_tag;
  static _Thread_local unsigned long tag;
  if (!tag) tag = atomic_fetch_add(&next_tag, 1) + 1;
  return tag;
}

static void mark_driver(tshare_channel *ch) {
  unsigned long me = ts_thread_tag();
  if (atomic_load_explicit(&ch->driver, memory_order_relaxed) != me)
    atomic_store_explicit(&ch->driver, me, memory_order_relaxed);
}

bool ts_channel_send_now_locked(tshare_channel *ch, const tshare_frame *f) {
  if (ch->wfd < 0 || atomic_load(&ch->tail_pending)) return false;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  char err[TSHARE_ERROR_MSG_MAX];
  if (tshare_wire_encode(f, buf, sizeof buf, &len, err, sizeof err) != TSHARE_OK) return false;
  int saved_errno = errno;
  size_t off = 0;
  while (off < len) {
    ssize_t r = write_once(ch, buf + off, len - off, -1);
    if (r > 0) {
      off += (size_t)r;
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    break; /* full, or an error the driving thread meets on its own */
  }
  errno = saved_errno;
  if (off == 0) return false;
  if (off < len) keep_tail(ch, buf + off, len - off); /* from the driving thread or the next send */
  return true;
}

int ts_channel_send(tshare_channel *ch, const tshare_frame *f, int fd, int timeout_ms) {
  mark_driver(ch);
  if (ch->wfd < 0) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "send: channel is closed");
  if (fd >= 0 && ch->kind != TSHARE_CHANNEL_SOCKET)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED, "send: a pipe channel cannot carry fds");
  if ((fd >= 0) != ((f->flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG,
                   "send: the fd-attached flag and the fd argument disagree");
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  int rc = tshare_wire_encode(f, buf, sizeof buf, &len, ch->err, sizeof ch->err);
  if (rc != TSHARE_OK) return rc;
  int64_t deadline = ts_deadline(timeout_ms);
  pthread_mutex_lock(&ch->send_lock);
  rc = flush_tail_locked(ch, deadline);
  if (rc == TSHARE_OK) rc = send_bytes(ch, buf, len, fd, deadline);
  pthread_mutex_unlock(&ch->send_lock);
  return rc;
}

void ts_channel_wake_locked(tshare_channel *ch) {
  ch->woken = true;
  if (!ch->waiting) return;
  uint64_t one = 1;
  if (write(ch->wake_fd, &one, sizeof one) < 0) {
    /* EAGAIN: the counter is already nonzero, the driver wakes anyway. */
  }
}

/* Wait for bytes from the peer. Releases queued meanwhile (by this thread
 * before it got here, or by another one while it waits) go out first: the
 * peer may be waiting for them before it sends what this thread waits for.
 * Releases that wait for the GPU are looked at again at once while fresh,
 * then every millisecond. */
static int wait_readable(tshare_channel *ch, int64_t deadline) {
  ts_gpu_wait gpu = TS_GPU_IDLE;
  for (;;) {
    pthread_mutex_lock(&ch->lock);
    bool work = ch->woken;
    ch->woken = false;
    ch->waiting = !work;
    pthread_mutex_unlock(&ch->lock);
    if (work) {
      int rc = ts_cuda_flush(ch, ts_remaining(deadline), &gpu);
      if (rc == TSHARE_OK) rc = ts_share_flush_pending(ch, ts_remaining(deadline));
      if (rc != TSHARE_OK) return rc;
      continue;
    }
    try_flush_tail(ch); /* the peer may wait for the rest of a frame before it sends */
    bool tail = atomic_load(&ch->tail_pending);
    int wait_ms = ts_remaining(deadline);
    int cap = gpu == TS_GPU_SOON ? 0 : 1;
    if (gpu != TS_GPU_IDLE && (wait_ms < 0 || wait_ms > cap)) wait_ms = cap;
    struct pollfd p[3] = {{.fd = ch->rfd, .events = POLLIN, .revents = 0},
                          {.fd = ch->wake_fd, .events = POLLIN, .revents = 0},
                          {.fd = ch->wfd, .events = POLLOUT, .revents = 0}};
    int n = poll(p, tail ? 3 : 2, wait_ms);
    if (n > 0 && tail && (p[2].revents & POLLOUT) && !p[0].revents && !p[1].revents) continue;
    int err = errno;
    pthread_mutex_lock(&ch->lock);
    ch->waiting = false;
    if (n == 0 && gpu != TS_GPU_IDLE) ch->woken = true; /* look at the GPU's releases again */
    pthread_mutex_unlock(&ch->lock);
    if (n < 0 && err == EINTR) continue;
    if (n < 0) return ts_errsys(ch->err, sizeof ch->err, TSHARE_E_SYSTEM, err, "poll (receive)");
    if (p[1].revents & POLLIN) {
      uint64_t count; /* the waker set `woken` too */
      if (read(ch->wake_fd, &count, sizeof count) < 0) {
        /* EAGAIN: another reader drained it; nothing to do */
      }
    }
    if (p[0].revents) return TSHARE_OK;
    if (n == 0 && ts_remaining(deadline) == 0)
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_TIMEOUT, "receive: timed out");
  }
}

/* Read what is available into the decoder. TSHARE_OK when bytes came. */
static int read_some(tshare_channel *ch, int64_t deadline) {
  for (;;) {
    uint8_t *space;
    size_t avail;
    int rc = tshare_decoder_space(ch->dec, &space, &avail);
    if (rc != TSHARE_OK) return ts_errf(ch->err, sizeof ch->err, rc, "receive: %s", tshare_decoder_last_error(ch->dec));
    ssize_t r;
    if (ch->spill_off < ch->spill_len) { /* read ahead while a send waited */
      r = (ssize_t)(ch->spill_len - ch->spill_off < avail ? ch->spill_len - ch->spill_off : avail);
      memcpy(space, ch->spill + ch->spill_off, (size_t)r);
      ch->spill_off += (size_t)r;
    } else if (ch->spill_eof) {
      r = 0;
    } else {
      r = recv_into(ch, space, avail);
    }
    if (r > 0) {
      tshare_decoder_commit(ch->dec, (size_t)r);
      ch->fed += (uint64_t)r;
      return TSHARE_OK;
    }
    if (r == 0) {
      size_t pending = tshare_decoder_pending(ch->dec);
      if (pending)
        return ch->broken = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_CLOSED,
                                    "receive: peer %s closed the channel mid-frame (%zu bytes of a frame read)",
                                    ch->peer_label, pending);
      return ch->broken = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_CLOSED, "receive: peer %s closed the channel",
                                  ch->peer_label);
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      rc = wait_readable(ch, deadline);
      if (rc != TSHARE_OK) return rc;
      continue;
    }
    if (errno == ECONNRESET)
      return ch->broken = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_CLOSED, "receive: connection reset by peer %s",
                                  ch->peer_label);
    return ch->broken = ts_errsys(ch->err, sizeof ch->err, TSHARE_E_SYSTEM, errno, "receive");
  }
}

int ts_channel_recv_raw(tshare_channel *ch, tshare_frame *f, int *fd_out, int *fd_lost, int timeout_ms) {
  *fd_out = -1;
  *fd_lost = 0;
  mark_driver(ch);
  if (ch->rfd < 0) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "receive: channel is closed");
  int64_t deadline = ts_deadline(timeout_ms);
  for (;;) {
    if (ch->broken) return ch->broken;
    int rc = tshare_decoder_next(ch->dec, f);
    if (rc == TSHARE_OK) {
      bool found;
      ts_fd_entry e = fds_of_frame(ch, ch->fed - tshare_decoder_pending(ch->dec), &found);
      if (!(f->flags & TSHARE_FRAME_FLAG_FD_ATTACHED)) {
        if (e.fd >= 0) close(e.fd); /* riding on a frame that announces none */
        return TSHARE_OK;
      }
      if (!found)
        return ch->broken = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                                    "receive: %s frame from peer %s says an fd is attached but none arrived",
                                    tshare_frame_type_name(f->type), ch->peer_label);
      *fd_out = e.fd;
      *fd_lost = e.lost;
      return TSHARE_OK;
    }
    if (rc < 0) {
      if (ch->peer.pid)
        ch->broken = ts_errf(ch->err, sizeof ch->err, rc, "frame from %s: %s", ch->peer_label,
                             tshare_decoder_last_error(ch->dec));
      else
        ch->broken =
            ts_errf(ch->err, sizeof ch->err, rc, "first frame from the peer: %s", tshare_decoder_last_error(ch->dec));
      /* Tell the peer why we are hanging up; it may be a version skew. */
      tshare_channel_send_error(ch, rc, ch->err);
      return rc;
    }
    rc = read_some(ch, deadline);
    if (rc != TSHARE_OK) return rc;
  }
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
static int check_peer_cred(tshare_channel *ch, struct ucred *cred) {
  socklen_t len = sizeof *cred;
  if (getsockopt(ch->rfd, SOL_SOCKET, SO_PEERCRED, cred, &len) != 0)
    return ts_errsys(ch->err, sizeof ch->err, TSHARE_E_SYSTEM, errno, "channel: getsockopt(SO_PEERCRED)");
  long allow = ch->opts.allow_uid;
  if (cred->uid == getuid() || allow == TSHARE_ANY_UID || (allow >= 0 && (uid_t)allow == cred->uid)) return TSHARE_OK;
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PERMISSION,
                 "channel: the peer (pid %ld) runs as uid %ld, this process as uid %ld; set allow_uid in the channel "
                 "options to accept it",
                 (long)cred->pid, (long)cred->uid, (long)getuid());
}

/* How messages name the peer: by the pid the kernel reports where there is
 * one (a hello's pid is only the peer's word), else by its word, said so
 * (pipes; a peer in a pid namespace not visible from here; a hand-rolled
 * peer whose hello came without credentials). */
static void name_peer(tshare_channel *ch) {
  if (ch->peer_kpid > 0)
    snprintf(ch->peer_label, sizeof ch->peer_label, "'%s' (pid %ld)", ch->peer.name, (long)ch->peer_kpid);
  else
    snprintf(ch->peer_label, sizeof ch->peer_label, "'%s' (says pid %u)", ch->peer.name, ch->peer.pid);
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

static uint64_t peer_key_of(tshare_channel *ch) {
  static atomic_uint_fast64_t serials;
  uint64_t serial = (uint64_t)atomic_fetch_add(&serials, 1) + 1;
  if (ch->peer_kpid <= 0) return KEY_BY_CHANNEL | (serial << 32);
  return ((uint64_t)ch->peer_kpid | (start_time_of(ch->peer_kpid) << 32)) & ~KEY_BY_CHANNEL;
}

uint64_t ts_channel_origin_key(const tshare_channel *ch, uint32_t claimed_pid) {
  if (claimed_pid == 0 || claimed_pid == ch->peer.pid) return ch->peer_key;
  /* Forwarded: the claim is kept, but only among this peer's own. */
  uint64_t h = ch->peer_key * 0x9e3779b97f4a7c15ull ^ (uint64_t)claimed_pid * 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  return KEY_BY_CHANNEL | (h >> 1);
}

/* The most fds of the peer's shares this end holds before it refuses more:
 * a quarter of the soft RLIMIT_NOFILE, at most TS_INCOMING_MAX. */
static size_t default_fd_budget(void) {
  struct rlimit rl;
  size_t budget = 256;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
    budget = (size_t)(rl.rlim_cur / 4);
  else if (getrlimit(RLIMIT_NOFILE, &rl) == 0)
    budget = TS_INCOMING_MAX;
  if (budget > TS_INCOMING_MAX) budget = TS_INCOMING_MAX;
  return budget < 8 ? 8 : budget;
}

static int handshake(tshare_channel *ch) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_HELLO;
  ch->self.major = TSHARE_WIRE_MAJOR;
  ch->self.minor = TSHARE_WIRE_MINOR;
  ch->self.pid = (uint32_t)getpid();
  ch->self.uid = (uint32_t)getuid();
  read_boot_id(ch->self.boot_id);
  ch->self.capabilities = ch->kind == TSHARE_CHANNEL_SOCKET ? (TSHARE_CAP_FD_PASSING | TSHARE_CAP_HOST_MEMFD) : 0;
  ch->self.capabilities |= ts_cuda_hello_caps();
  ts_cuda_hello_devices(&ch->self);
  snprintf(ch->self.name, sizeof ch->self.name, "%s", ch->name);
  f.u.hello = ch->self;
  int64_t deadline = ts_deadline(ch->opts.handshake_timeout_ms);
  int rc = ts_channel_send(ch, &f, -1, ts_remaining(deadline));
  int fd = -1, fd_lost;
  if (rc == TSHARE_OK) rc = ts_channel_recv_raw(ch, &f, &fd, &fd_lost, ts_remaining(deadline));
  if (rc != TSHARE_OK) {
    char why[TSHARE_ERROR_MSG_MAX];
    snprintf(why, sizeof why, "%s", ch->err);
    return ts_errf(ch->err, sizeof ch->err, rc, "hello: %s", why);
  }
  if (fd >= 0) close(fd);
  if (f.type == TSHARE_FRAME_ERROR)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_ERROR, "hello: peer refused the channel: %s (%s)",
                   f.u.error.message, tshare_status_name(f.u.error.code));
  if (f.type != TSHARE_FRAME_HELLO) {
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "hello: expected a hello frame, got %s",
                 tshare_frame_type_name(f.type));
    tshare_channel_send_error(ch, rc, ch->err);
    return rc;
  }
  ch->peer = f.u.hello;
  name_peer(ch);
  ch->peer_key = peer_key_of(ch);
  if (!all_zero(ch->self.boot_id, 16) && !all_zero(ch->peer.boot_id, 16) &&
      memcmp(ch->self.boot_id, ch->peer.boot_id, 16) != 0) {
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                 "hello: peer %s runs under another boot id: shares cannot cross machines or boots", ch->peer_label);
    tshare_channel_send_error(ch, rc, ch->err);
    return rc;
  }
  const uint8_t ours = TSHARE_WIRE_MINOR;
  ch->minor = ch->peer.minor < ours ? ch->peer.minor : ours;
  return TSHARE_OK;
}

static int set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return -1;
  return 0;
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
  pthread_mutex_init(&ch->send_lock, NULL);
  pthread_mutex_init(&ch->lock, NULL);
  ch->kind = kind;
  ch->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ch->rfd = rfd;
  ch->wfd = wfd;
  ch->next_share_id = 1;
  if (opts)
    ch->opts = *opts;
  else
    tshare_channel_options_init(&ch->opts);
  snprintf(ch->name, sizeof ch->name, "%s", ch->opts.name ? ch->opts.name : "tshare");
  ch->limits = ch->opts.limits ? *ch->opts.limits : tshare_wire_limits_default();
  ch->opts.limits = NULL; /* the caller's struct need not outlive this call */
  snprintf(ch->peer.name, sizeof ch->peer.name, "?");
  snprintf(ch->peer_label, sizeof ch->peer_label, "'?'");
  ch->fd_budget = ch->opts.max_unclaimed_fds ? ch->opts.max_unclaimed_fds : default_fd_budget();
  int rc = TSHARE_OK;
  ch->dec = tshare_decoder_create(&ch->limits);
  if (!ch->dec)
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "channel: out of memory");
  else if (ch->wake_fd < 0)
    rc = ts_errsys(ch->err, sizeof ch->err, TSHARE_E_SYSTEM, errno, "channel: eventfd");
  else if (rfd < 0 || wfd < 0)
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG, "channel: bad fd");
  else if (set_nonblocking(rfd) != 0 || set_nonblocking(wfd) != 0)
    rc = ts_errsys(ch->err, sizeof ch->err, TSHARE_E_SYSTEM, errno, "channel: fcntl(O_NONBLOCK) on fd %d/%d", rfd, wfd);
  else if (kind == TSHARE_CHANNEL_SOCKET) {
    int type = 0;
    socklen_t len = sizeof type;
    if (getsockopt(rfd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM)
      rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG, "channel: fd %d is not a stream socket", rfd);
  }
  struct ucred cred = {0, 0, 0};
  if (rc == TSHARE_OK && kind == TSHARE_CHANNEL_SOCKET) rc = check_peer_cred(ch, &cred);
  /* Who wrote the peer's hello, as the kernel attaches it to the bytes
   * (SCM_CREDENTIALS): SO_PEERCRED names whoever created a socketpair, which
   * is not the peer once the pair was handed out. Both ends ask before their
   * hello, so each one's hello carries it. */
  int on = 1;
  if (rc == TSHARE_OK && kind == TSHARE_CHANNEL_SOCKET) setsockopt(rfd, SOL_SOCKET, SO_PASSCRED, &on, sizeof on);
  if (rc == TSHARE_OK) rc = handshake(ch);
  int off = 0;
  if (kind == TSHARE_CHANNEL_SOCKET && rfd >= 0) setsockopt(rfd, SOL_SOCKET, SO_PASSCRED, &off, sizeof off);
  if (rc == TSHARE_OK && kind == TSHARE_CHANNEL_SOCKET && ch->peer.uid != (uint32_t)cred.uid) {
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "hello: peer %s claims uid %u, the kernel says %ld",
                 ch->peer_label, ch->peer.uid, (long)cred.uid);
    tshare_channel_send_error(ch, rc, ch->err);
  }
  if (rc != TSHARE_OK) {
    ts_error_fill(err, rc, ch->err);
    tshare_channel_close(ch);
    return rc;
  }
  ts_error_fill(err, TSHARE_OK, "");
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

int tshare_channel_send_frame(tshare_channel *ch, const tshare_frame *f, int fd, int timeout_ms) {
  if (!ch || !f) return TSHARE_E_INVALID_ARG;
  return ts_channel_send(ch, f, fd, timeout_ms);
}

int tshare_channel_recv_frame(tshare_channel *ch, tshare_frame *f, int *fd_out, int timeout_ms) {
  if (!ch || !f || !fd_out) return TSHARE_E_INVALID_ARG;
  int fd_lost;
  int rc = ts_channel_recv_raw(ch, f, fd_out, &fd_lost, timeout_ms);
  if (rc == TSHARE_OK && fd_lost) {
    (void)ts_share_fd_lost(ch, f, fd_lost); /* the frame is filled; its fd could not be kept */
    return TSHARE_E_LIMIT;
  }
  /* Applied here too, so low-level readers keep the accounting right. Ids the
   * tables do not know are not an error on this path: they belong to share
   * frames the caller sent itself with tshare_channel_send_frame(). */
  if (rc == TSHARE_OK && f->type == TSHARE_FRAME_RELEASE) (void)ts_share_apply_release(ch, &f->u.release);
  if (rc == TSHARE_E_PEER_CLOSED) ts_share_drop_all(ch, TSHARE_E_PEER_CLOSED);
  return rc;
}

int tshare_channel_send_bye(tshare_channel *ch, uint32_t reason, int timeout_ms) {
  if (!ch) return TSHARE_E_INVALID_ARG;
  int64_t deadline = ts_deadline(timeout_ms);
  int rc = ts_share_flush_pending(ch, ts_remaining(deadline));
  if (rc != TSHARE_OK) return rc;
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_BYE;
  f.u.bye.reason = reason;
  return ts_channel_send(ch, &f, -1, ts_remaining(deadline));
}

int tshare_channel_send_error(tshare_channel *ch, int code, const char *message) {
  if (!ch) return TSHARE_E_INVALID_ARG;
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_ERROR;
  f.u.error.code = code;
  snprintf(f.u.error.message, sizeof f.u.error.message, "%s", message ? message : tshare_status_str(code));
  char keep[TSHARE_ERROR_MSG_MAX]; /* sending must not overwrite the error being reported */
  memcpy(keep, ch->err, sizeof keep);
  int rc = ts_channel_send(ch, &f, -1, 100);
  memcpy(ch->err, keep, sizeof keep);
  return rc;
}

void ts_channel_unref(tshare_channel *ch) {
  if (atomic_fetch_sub(&ch->refs, 1) != 1) return;
  ts_share_free_mappings(ch);
  ts_cuda_chan_free(ch);
  pthread_mutex_destroy(&ch->send_lock);
  pthread_mutex_destroy(&ch->lock);
  free(ch->pending);
  free(ch);
}

void tshare_channel_close(tshare_channel *ch) {
  if (!ch) return;
  if (ch->wfd >= 0 && !ch->broken) ts_share_flush_pending(ch, 100);
  if (ch->wfd >= 0 && atomic_load(&ch->tail_pending)) {
    pthread_mutex_lock(&ch->send_lock);
    (void)flush_tail_locked(ch, ts_deadline(100));
    pthread_mutex_unlock(&ch->send_lock);
  }
  ts_share_drop_all(ch, TSHARE_E_PEER_CLOSED);
  ts_share_free_incoming(ch);
  fdq_close_all(ch);
  pthread_mutex_lock(&ch->lock);
  ch->closed = true;
  pthread_mutex_lock(&ch->send_lock);
  if (ch->rfd >= 0) close(ch->rfd);
  if (ch->wfd >= 0 && ch->wfd != ch->rfd) close(ch->wfd);
  ch->rfd = ch->wfd = -1;
  if (ch->wake_fd >= 0) close(ch->wake_fd);
  ch->wake_fd = -1;
  pthread_mutex_unlock(&ch->send_lock);
  pthread_mutex_unlock(&ch->lock);
  tshare_decoder_destroy(ch->dec);
  ch->dec = NULL;
  free(ch->spill);
  ch->spill = NULL;
  ts_channel_unref(ch);
}
