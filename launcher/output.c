#include "output.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
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

void out_queue_free(out_queue *q) {
  free(q->data);
  q->data = NULL;
  q->head = q->len = q->cap = 0;
}

void out_sink_init(out_sink *s, int fd) {
  memset(s, 0, sizeof *s);
  s->fd = fd;
  s->writer = -1;
}

void out_sink_add(out_sink *s, out_queue *q) {
  if (s->nqueues < OUT_SINK_QUEUES_MAX) s->queues[s->nqueues++] = q;
}

bool out_sink_pending(const out_sink *s) {
  for (int i = 0; i < s->nqueues; i++)
    if (s->queues[i]->len > s->queues[i]->head) return true;
  return false;
}

/* Once poll says the fd takes bytes, a write of at most PIPE_BUF does not
 * block: a pipe has a free page, a Unix socket a quarter of its buffer, a
 * file never waits. The fd's flags (O_NONBLOCK) are left alone: the shell
 * and whatever else writes to the same terminal or pipe share them. */
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
  if (!s->gone && !sink_ready(s->fd, block ? -1 : 0)) return false;
  size_t n = q->len - q->head < PIPE_BUF ? q->len - q->head : PIPE_BUF;
  ssize_t w = s->gone ? (ssize_t)(q->len - q->head) : write(s->fd, q->data + q->head, n);
  if (w < 0 && errno == EINTR) return true;
  if (w < 0 && errno == EAGAIN) return block; /* an O_NONBLOCK fd someone else set: wait in poll */
  if (w <= 0) {                               /* EPIPE and the like: nobody will read this */
    s->gone = true;
    return true;
  }
  s->writer = q->data[q->head + (size_t)w - 1] == '\n' ? -1 : i;
  q->head += (size_t)w;
  if (q->head == q->len) q->head = q->len = 0;
  return true;
}

void out_sink_flush(out_sink *s, bool block) {
  while (write_chunk(s, block)) {
  }
}
