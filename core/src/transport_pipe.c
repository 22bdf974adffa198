/* The pipe transport: a read pipe and a write pipe, bytes only (no fds, no
 * credentials: the peer is who it says it is). */
#include "conn.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

static ssize_t pipe_read(ts_conn *c, uint8_t *buf, size_t cap) {
  ssize_t r = read(c->rfd, buf, cap);
  if (r > 0) c->rx_bytes += (uint64_t)r;
  return r;
}

/* write() to a pipe whose reader is gone raises SIGPIPE. Block it on this
 * thread for the write and swallow the one we caused, leaving any SIGPIPE
 * that was already pending for the application. */
static ssize_t pipe_write(ts_conn *c, const uint8_t *buf, size_t n, int fd) {
  (void)fd; /* never one: ts_conn_send refuses fds without TS_TRANSPORT_PASSES_FDS */
  sigset_t pipe_set, old_set, pending;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set);
  sigpending(&pending);
  int was_pending = sigismember(&pending, SIGPIPE);
  ssize_t r = write(c->wfd, buf, n);
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

const ts_transport ts_transport_pipes = {
    .name = "pipe",
    .caps = TS_TRANSPORT_SAME_HOST,
    .read = pipe_read,
    .write = pipe_write,
    TS_STREAM_FRAME_OPS,
    .close = ts_stream_close,
};
