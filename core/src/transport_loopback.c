/* The loopback transport: two ends in one process, frames and fds passed
 * through memory (an fd is dup'd on its way), for unit tests of the session
 * layer that need no socket. It behaves like a Unix socket where the session
 * can tell: frames carry fds, an fd rides on its frame's first byte, a read
 * never runs past the end of a message that carried one, the peer's close
 * reads as the end of the stream and a write after it fails with EPIPE.
 *
 * Each end's fds for the connection are real ones, so the connection's
 * poll()-based waits work unchanged: its read fd is an eventfd that is
 * readable while the end's inbox holds bytes (or the peer closed); its write
 * fd a dup of the peer's, which a write bumps. ts_loopback_pair() makes the
 * two ends; ts_conn_init(TS_CONN_LOOPBACK) on an end's fds claims it.
 *
 * An inbox holds up to LOOPBACK_INBOX_MAX bytes; a writer facing a full one
 * gets EAGAIN and polls its write fd, which is always writable: it spins
 * until the reader drains (fine for tests, not for production). */
#include "conn.h"

#include "error_detail.h"
#include "vec.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#define LOOPBACK_INBOX_MAX (64u << 20)

typedef struct lo_fd_msg {
  uint64_t start, end; /* the message's bytes in its inbox's stream: [start, end) */
  int fd;              /* dup'd on write; -1 once handed to the reader */
} lo_fd_msg;

TS_VEC_DEFINE(lo_fd_msg_vec, lo_fd_msg)

typedef struct lo_inbox {
  uint8_t *bytes; /* bytes [done, written) of the stream, from bytes[0] */
  size_t len, cap;
  uint64_t done, written;
  lo_fd_msg_vec msgs; /* oldest first */
  bool writer_gone, reader_gone;
} lo_inbox;

typedef struct lo_pair {
  pthread_mutex_t lock;
  lo_inbox inbox[2]; /* inbox[i]: what end i reads */
  int fds[2][2];     /* each end's rfd, wfd until claimed */
  bool claimed[2];
  int ends_open; /* the pair goes with the last end */
} lo_pair;

typedef struct lo_end {
  lo_pair *pair;
  int me;
} lo_end;

/* Unclaimed pairs, found by an end's fd numbers (unique in a process while
 * open): ts_conn_init gets only fds. */
TS_VEC_DEFINE(lo_pair_vec, lo_pair *)
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static lo_pair_vec registry;

static void inbox_free(lo_inbox *in) {
  for (size_t i = 0; i < in->msgs.len; i++)
    if (in->msgs.items[i].fd >= 0) close(in->msgs.items[i].fd);
  lo_fd_msg_vec_free(&in->msgs);
  free(in->bytes);
}

static bool registry_add(lo_pair *p) {
  pthread_mutex_lock(&registry_lock);
  bool ok = lo_pair_vec_push(&registry, p) == TSHARE_OK;
  pthread_mutex_unlock(&registry_lock);
  return ok;
}

/* The unclaimed end opened on (rfd, wfd), claimed; NULL when none. */
static lo_end *registry_claim(int rfd, int wfd) {
  lo_end *end = NULL;
  pthread_mutex_lock(&registry_lock);
  for (size_t i = 0; i < registry.len && !end; i++) {
    lo_pair *p = registry.items[i];
    for (int k = 0; k < 2 && !end; k++) {
      if (p->claimed[k] || p->fds[k][0] != rfd || p->fds[k][1] != wfd) continue;
      if (!(end = malloc(sizeof *end))) break;
      end->pair = p;
      end->me = k;
      p->claimed[k] = true;
      if (p->claimed[!k]) lo_pair_vec_remove(&registry, i, 1);
    }
  }
  pthread_mutex_unlock(&registry_lock);
  return end;
}

int ts_loopback_pair(int a[2], int b[2]) {
  lo_pair *p = calloc(1, sizeof *p);
  if (!p) return TSHARE_E_NOMEM;
  pthread_mutex_init(&p->lock, NULL);
  int ev0 = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK), ev1 = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  int w0 = ev1 >= 0 ? fcntl(ev1, F_DUPFD_CLOEXEC, 0) : -1, w1 = ev0 >= 0 ? fcntl(ev0, F_DUPFD_CLOEXEC, 0) : -1;
  p->fds[0][0] = ev0, p->fds[0][1] = w0, p->fds[1][0] = ev1, p->fds[1][1] = w1;
  p->ends_open = 2;
  if (ev0 < 0 || ev1 < 0 || w0 < 0 || w1 < 0 || !registry_add(p)) {
    int rc = errno == ENOMEM ? TSHARE_E_NOMEM : TSHARE_E_SYSTEM;
    for (int k = 0; k < 4; k++)
      if (p->fds[k / 2][k % 2] >= 0) close(p->fds[k / 2][k % 2]);
    pthread_mutex_destroy(&p->lock);
    free(p);
    return rc;
  }
  a[0] = ev0, a[1] = w0, b[0] = ev1, b[1] = w1;
  return TSHARE_OK;
}

static int loopback_check(ts_conn *c) {
  lo_end *end = registry_claim(c->rfd, c->wfd);
  if (!end)
    return ts_errf(c->err, c->err_cap, TSHARE_E_INVALID_ARG, "channel: fds %d/%d are not an end of a loopback pair",
                   c->rfd, c->wfd);
  c->stream_data = end;
  c->peer_kpid = getpid(); /* the peer is this process: no kernel needed to say so */
  return TSHARE_OK;
}

/* The count of bytes a read at the inbox's `done` may take (at most cap),
 * and the fd it brings: it stops before a message that carries an fd and at
 * the end of one it is in. */
static size_t read_span(lo_inbox *in, size_t cap, int *fd) {
  size_t n = in->len < cap ? in->len : cap;
  *fd = -1;
  size_t drop = 0;
  while (drop < in->msgs.len && in->msgs.items[drop].end <= in->done) drop++; /* read before */
  lo_fd_msg_vec_remove(&in->msgs, 0, drop);
  if (in->msgs.len == 0) return n;
  lo_fd_msg *m = &in->msgs.items[0];
  if (m->start > in->done) return (size_t)(m->start - in->done) < n ? (size_t)(m->start - in->done) : n;
  if ((size_t)(m->end - in->done) < n) n = (size_t)(m->end - in->done);
  *fd = m->fd;
  m->fd = -1;
  return n;
}

static ssize_t loopback_read(ts_conn *c, uint8_t *buf, size_t cap) {
  lo_end *end = c->stream_data;
  lo_inbox *in = &end->pair->inbox[end->me];
  pthread_mutex_lock(&end->pair->lock);
  ssize_t r;
  int fd = -1;
  if (in->len == 0) {
    uint64_t count;
    if (!in->writer_gone && read(c->rfd, &count, sizeof count) < 0) {
      /* EAGAIN: not signalled; either way it is reset under the lock */
    }
    r = in->writer_gone ? 0 : -1;
  } else {
    size_t n = read_span(in, cap, &fd);
    memcpy(buf, in->bytes, n);
    memmove(in->bytes, in->bytes + n, in->len - n);
    in->len -= n;
    in->done += n;
    r = (ssize_t)n;
  }
  pthread_mutex_unlock(&end->pair->lock);
  if (r < 0) {
    errno = EAGAIN;
    return -1;
  }
  c->rx_bytes += (uint64_t)r;
  if (r > 0 && fd >= 0) ts_conn_take_fds(c, &fd, 1, false);
  return r;
}

/* Room for len more bytes (and a message) in the peer's inbox. */
static bool inbox_reserve(lo_inbox *in, size_t len, bool msg) {
  if (in->len + len > in->cap) {
    size_t cap = in->cap ? in->cap : 4096;
    while (cap < in->len + len) cap *= 2;
    uint8_t *b = realloc(in->bytes, cap);
    if (!b) return false;
    in->bytes = b;
    in->cap = cap;
  }
  return !msg || lo_fd_msg_vec_reserve(&in->msgs, 1) == TSHARE_OK;
}

static ssize_t loopback_write(ts_conn *c, const uint8_t *buf, size_t len, int fd) {
  lo_end *end = c->stream_data;
  lo_inbox *out = &end->pair->inbox[!end->me];
  int copy = fd >= 0 ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
  if (fd >= 0 && copy < 0) return -1; /* errno: EMFILE and the like */
  int err = 0;
  pthread_mutex_lock(&end->pair->lock);
  if (out->reader_gone)
    err = EPIPE;
  else if (out->len + len > LOOPBACK_INBOX_MAX && out->len > 0)
    err = EAGAIN;
  else if (!inbox_reserve(out, len, copy >= 0))
    err = ENOMEM;
  if (!err) {
    if (copy >= 0) /* room reserved above: cannot fail */
      (void)lo_fd_msg_vec_push(&out->msgs, (lo_fd_msg){.start = out->written, .end = out->written + len, .fd = copy});
    memcpy(out->bytes + out->len, buf, len);
    out->len += len;
    out->written += len;
    uint64_t one = 1;
    if (write(c->wfd, &one, sizeof one) < 0) {
      /* EAGAIN: the counter is already far from zero: readable anyway */
    }
  }
  pthread_mutex_unlock(&end->pair->lock);
  if (err) {
    if (copy >= 0) close(copy);
    errno = err;
    return -1;
  }
  return (ssize_t)len;
}

/* The peer reads the end of the stream after what was sent; its writes fail
 * with EPIPE. A forked child's copy lets go of its fds only: the pair is the
 * parent's. */
static void loopback_close(ts_conn *c, bool fork_copy) {
  lo_end *end = c->stream_data;
  if (end && !fork_copy) {
    lo_pair *p = end->pair;
    pthread_mutex_lock(&p->lock);
    p->inbox[!end->me].writer_gone = true;
    p->inbox[end->me].reader_gone = true;
    uint64_t one = 1;
    if (c->wfd >= 0 && write(c->wfd, &one, sizeof one) < 0) {
      /* EAGAIN: readable anyway */
    }
    bool last = --p->ends_open == 0;
    pthread_mutex_unlock(&p->lock);
    if (last) {
      inbox_free(&p->inbox[0]);
      inbox_free(&p->inbox[1]);
      pthread_mutex_destroy(&p->lock);
      free(p);
    }
    free(end);
    c->stream_data = NULL;
  }
  ts_stream_close(c, fork_copy);
}

const ts_transport ts_transport_loopback = {
    .name = "loopback",
    .caps = TS_TRANSPORT_PASSES_FDS | TS_TRANSPORT_SAME_HOST,
    .check = loopback_check,
    .read = loopback_read,
    .write = loopback_write,
    TS_STREAM_FRAME_OPS,
    .close = loopback_close,
};
