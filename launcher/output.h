/* Role output on its way to the launcher's stdout and stderr, written without
 * ever blocking the loop that supervises the roles: a reader that stalls must
 * not hold up a timeout, a forwarded signal or a teardown. Lines wait in a
 * bounded queue per role and stream. While the reader keeps taking output, a
 * role whose queue is half full is not read from (its writes wait, as on a
 * slow terminal, and nothing is lost); once the reader took nothing for
 * OUT_STALL_S, lines are read on and those that do not fit are dropped and
 * counted (the count is reported at the end), so the roles' work goes on. */
#ifndef TSHARE_LAUNCHER_OUTPUT_H
#define TSHARE_LAUNCHER_OUTPUT_H

#include "tshare/role.h"

#include <stdbool.h>
#include <stddef.h>

/* What one role (or the launcher itself) may have waiting for one stream. */
#define OUT_PENDING_MAX (256 * 1024)
#define OUT_STALL_S 1.0

typedef struct out_queue {
  char *data;
  size_t head, len, cap;                  /* the bytes waiting are data[head, len) */
  long long dropped_lines, dropped_bytes; /* what did not fit while the reader stalled */
} out_queue;

/* Every role's queue for one stream, plus the launcher's own messages. */
#define OUT_SINK_QUEUES_MAX (TSHARE_ROLE_CHANNELS_MAX + 2)

typedef struct out_sink {
  int fd;          /* stdout or stderr, as the launcher got it */
  int nonblock_fd; /* the same terminal or pipe opened again with O_NONBLOCK, or -1 */
  out_queue *queues[OUT_SINK_QUEUES_MAX];
  int nqueues;
  int writer;             /* the queue whose line is half written (lines never interleave), -1: none */
  int next;               /* where the round robin over queues goes on */
  double last_progress_s; /* when it last wrote something, or had nothing to write */
  bool gone;              /* the reader closed its end: output is discarded, as a write would lose it */
} out_sink;

/* Queue prefix, text and '\n' as one line; a line that does not fit in
 * OUT_PENDING_MAX is dropped and counted. */
void out_queue_line(out_queue *q, const char *prefix, size_t prefix_len, const char *text, size_t n);
void out_queue_free(out_queue *q);

/* Past half of OUT_PENDING_MAX: one more read of a role's pipe (4 KiB, every
 * line prefixed) still fits, so lines are dropped only while a reader stalls. */
bool out_queue_half_full(const out_queue *q);

void out_sink_init(out_sink *s, int fd);
void out_sink_close(out_sink *s);
void out_sink_add(out_sink *s, out_queue *q);
bool out_sink_pending(const out_sink *s);

/* Output waits and the reader took none for OUT_STALL_S. */
bool out_sink_stalled(const out_sink *s, double now_s);

/* Write what the fd takes now without waiting (block: everything, waiting as
 * long as it takes, for the end of the run). now_s: the monotonic clock. */
void out_sink_flush(out_sink *s, bool block, double now_s);

#endif
