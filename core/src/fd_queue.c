/* fds waiting for their frame: see fd_queue.h. */
#include "fd_queue.h"

#include "tshare/errors.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

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

/* The taken entries before head make room when the storage is full. */
static bool push(ts_fd_queue *q, ts_fd_entry e) {
  if (q->head > 0 && q->entries.len == q->entries.cap) {
    ts_fd_entry_vec_remove(&q->entries, 0, q->head);
    q->head = 0;
  }
  return ts_fd_entry_vec_push(&q->entries, e) == TSHARE_OK;
}

/* A lost fd right behind another lost one joins its entry: the queue grows
 * with the fds kept (the budget), not with the fds a peer sends. The frames
 * between two losses of a run are then taken to have lost one too; that only
 * matters to a frame that announces an fd it never sent, which is refused
 * either way. */
static bool join_lost_run(ts_fd_queue *q, uint64_t at) {
  if (ts_fd_queue_len(q) == 0) return false;
  ts_fd_entry *tail = &q->entries.items[q->entries.len - 1];
  if (tail->fd >= 0) return false;
  tail->last = at;
  return true;
}

int ts_fd_queue_take(ts_fd_queue *q, const int *fds, size_t n, bool cut, uint64_t at) {
  ts_fd_entry e = {.fd = -1, .lost = 0, .at = at, .last = at};
  if (n == 0 && !cut) return TSHARE_OK;
  for (size_t i = 1; i < n; i++) close(fds[i]);
  if (n == 0) {
    e.lost = fd_shortage_errno();
  } else if (q->held >= q->budget) {
    close(fds[0]); /* at once: nothing of it is kept but the entry's offsets */
    e.lost = TS_FD_OVER_BUDGET;
  } else {
    e.fd = fds[0];
  }
  if (e.fd < 0 && join_lost_run(q, at)) return TSHARE_OK;
  if (!push(q, e)) {
    if (e.fd >= 0) close(e.fd);
    return TSHARE_E_NOMEM;
  }
  if (e.fd >= 0) q->held++;
  return TSHARE_OK;
}

ts_fd_entry ts_fd_queue_frame(ts_fd_queue *q, uint64_t end, bool *found) {
  ts_fd_entry first = {.fd = -1, .lost = 0, .at = 0, .last = 0};
  *found = false;
  while (ts_fd_queue_len(q) && q->entries.items[q->head].at < end) {
    ts_fd_entry e = q->entries.items[q->head];
    if (e.last >= end)
      q->entries.items[q->head].at = end; /* a run of losses going on into the next frames */
    else
      q->head++;
    if (e.fd >= 0) q->held--;
    if (!*found) {
      first = e;
      *found = true;
    } else if (e.fd >= 0) {
      close(e.fd);
    }
  }
  if (ts_fd_queue_len(q) == 0) q->entries.len = q->head = 0;
  return first;
}

void ts_fd_queue_close_all(ts_fd_queue *q) {
  bool found;
  ts_fd_entry e = ts_fd_queue_frame(q, UINT64_MAX, &found);
  if (found && e.fd >= 0) close(e.fd);
  ts_fd_entry_vec_free(&q->entries);
  q->head = 0;
}
