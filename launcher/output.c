#include "output.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Room for want bytes from data[0]: what was written goes first, then the
 * buffer grows, never past OUT_PENDING_MAX. */
static bool reserve(out_queue *q, size_t want) {
  if (want <= q->cap) return true;
  if (q->head) {
    memmove(q->data, q->data + q->head, q->len - q->head);
    want -= q->head;
    q->len -= q->head;
    q->head = 0;
    if (want <= q->cap) return true;
  }
  size_t cap = q->cap ? q->cap : 4096;
  while (cap < want) cap *= 2;
  if (cap > OUT_PENDING_MAX) cap = OUT_PENDING_MAX;
  char *grown = realloc(q->data, cap);
  if (!grown) return false;
  q->data = grown;
  q->cap = cap;
  return true;
}

void out_queue_line(out_queue *q, const char *prefix, size_t prefix_len, const char *text, size_t n) {
  size_t need = prefix_len + n + 1;
  if (q->len - q->head + need > OUT_PENDING_MAX || !reserve(q, q->len + need)) {
    q->dropped_lines++;
    q->dropped_bytes += (long long)(n + 1);
    return;
  }
  memcpy(q->data + q->len, prefix, prefix_len);
  memcpy(q->data + q->len + prefix_len, text, n);
  q->data[q->len + prefix_len + n] = '\n';
  q->len += need;
}

bool out_queue_half_full(const out_queue *q) { return q->len - q->head >= OUT_PENDING_MAX / 2; }

void out_queue_free(out_queue *q) {
  free(q->data);
  q->data = NULL;
  q->head = q->len = q->cap = 0;
}

/* The fd's terminal or pipe opened again, O_NONBLOCK in a description of our
 * own: the flag on fd itself would reach the shell and everything else that
 * shares it, and would stay if we were killed. A terminal can block a write
 * that poll called possible (one stopped by Ctrl-S); this one says EAGAIN.
 * Not for a regular file (it would be written from offset 0) nor a socket
 * (it cannot be opened again; poll's promise holds there). */
static int open_nonblocking(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !(S_ISCHR(st.st_mode) || S_ISFIFO(st.st_mode))) return -1;
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  return open(path, O_WRONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
}

void out_sink_init(out_sink *s, int fd) {
  memset(s, 0, sizeof *s);
  s->fd = fd;
  s->nonblock_fd = open_nonblocking(fd);
  s->writer = -1;
}

void out_sink_close(out_sink *s) {
  if (s->nonblock_fd >= 0) close(s->nonblock_fd);
  s->nonblock_fd = -1;
}

void out_sink_add(out_sink *s, out_queue *q) {
  if (s->nqueues < OUT_SINK_QUEUES_MAX) s->queues[s->nqueues++] = q;
}

bool out_sink_pending(const out_sink *s) {
  for (int i = 0; i < s->nqueues; i++)
    if (s->queues[i]->len > s->queues[i]->head) return true;
  return false;
}

bool out_sink_stalled(const out_sink *s, double now_s) {
  return out_sink_pending(s) && now_s - s->last_progress_s >= OUT_STALL_S;
}

/* Terminals and pipes are written through nonblock_fd. Elsewhere, once poll
 * says the fd takes bytes, a write of at most PIPE_BUF does not block either:
 * a Unix socket has a quarter of its buffer free, a file never waits. */
static bool sink_ready(int fd, int timeout_ms) {
  struct pollfd p = {.fd = fd, .events = POLLOUT, .revents = 0};
  int r;
  do r = poll(&p, 1, timeout_ms);
  while (r < 0 && errno == EINTR);
  return r > 0;
}

/* The queue to write from: the one whose line is half written, else the next
 * one with bytes, round robin, so a chatty role does not starve the others. */
static int pick_queue(out_sink *s) {
  if (s->writer >= 0 && s->queues[s->writer]->len > s->queues[s->writer]->head) return s->writer;
  s->writer = -1;
  for (int k = 0; k < s->nqueues; k++) {
    int i = (s->next + k) % s->nqueues;
    if (s->queues[i]->len > s->queues[i]->head) {
      s->next = (i + 1) % s->nqueues;
      return i;
    }
  }
  return -1;
}

/* One write of at most PIPE_BUF bytes; false when nothing more goes now. */
static bool write_chunk(out_sink *s, bool block) {
  int i = pick_queue(s);
  if (i < 0) return false;
  out_queue *q = s->queues[i];
  int fd = block || s->nonblock_fd < 0 ? s->fd : s->nonblock_fd;
  if (!s->gone && !sink_ready(fd, block ? -1 : 0)) return false;
  size_t n = q->len - q->head < PIPE_BUF ? q->len - q->head : PIPE_BUF;
  ssize_t w = s->gone ? (ssize_t)(q->len - q->head) : write(fd, q->data + q->head, n);
  if (w < 0 && errno == EINTR) return true;
  if (w < 0 && errno == EAGAIN) return block; /* full after all, or O_NONBLOCK set by someone: poll again */
  if (w <= 0) {                               /* EPIPE and the like: nobody will read this */
    s->gone = true;
    return true;
  }
  s->writer = q->data[q->head + (size_t)w - 1] == '\n' ? -1 : i;
  q->head += (size_t)w;
  if (q->head == q->len) q->head = q->len = 0;
  return true;
}

void out_sink_flush(out_sink *s, bool block, double now_s) {
  bool wrote = false;
  while (write_chunk(s, block)) wrote = true;
  if (wrote || !out_sink_pending(s)) s->last_progress_s = now_s;
}
