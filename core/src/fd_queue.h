/* fds that came with the bytes of a read, waiting for the frame they ride
 * on, and the budget of fds a connection holds for its peer.
 *
 * The kernel ends a read at the end of the one message whose fds it
 * returns, so those fds belong to the frame holding the read's last byte,
 * `at` (a stream offset). Consecutive fds that could not be kept share one
 * entry, from `at` to `last`: a peer sending a byte with an fd at a time
 * past the budget costs no memory per fd. One thread (the connection's
 * driver) uses a queue. */
#ifndef TSHARE_FD_QUEUE_H
#define TSHARE_FD_QUEUE_H

#include "conn_status.h"
#include "vec.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct ts_fd_entry {
  int fd;        /* -1 when it could not be kept */
  int lost;      /* why not: an errno (EMFILE, ENFILE) or TS_FD_OVER_BUDGET; 0 when kept */
  uint64_t at;   /* stream offset of the last byte of the read that brought it */
  uint64_t last; /* the same for the last fd of a run of lost ones; `at` otherwise */
} ts_fd_entry;

TS_VEC_DEFINE(ts_fd_entry_vec, ts_fd_entry)

typedef struct ts_fd_queue {
  ts_fd_entry_vec entries; /* oldest first from head; those before it are taken */
  size_t head;
  /* fds held for the peer's frames: queued here, or kept by the session
   * (ts_fd_queue_hold). Past budget an arriving fd is closed at once and its
   * frame comes with lost = TS_FD_OVER_BUDGET. */
  size_t held, budget;
} ts_fd_queue;

/* Entries waiting for their frame. */
static inline size_t ts_fd_queue_len(const ts_fd_queue *q) { return q->entries.len - q->head; }

/* The fds one read brought (n of them; cut: the kernel cut the control data,
 * so one could not be installed), the read's last byte at stream offset
 * `at`. A frame carries at most one fd: the first is kept while the budget
 * allows, the others closed. TSHARE_OK, or TSHARE_E_NOMEM (the fds closed). */
int ts_fd_queue_take(ts_fd_queue *q, const int *fds, size_t n, bool cut, uint64_t at);

/* The fd of the frame ending at stream offset `end`: every queued fd that
 * came with its bytes is taken off, the first returned (or why it was lost),
 * the rest closed. *found is false when none came. */
ts_fd_entry ts_fd_queue_frame(ts_fd_queue *q, uint64_t end, bool *found);

/* fds the session keeps for the peer's frames count against the budget. */
static inline void ts_fd_queue_hold(ts_fd_queue *q, long n) { q->held = (size_t)((long)q->held + n); }

/* Every queued fd closed, the storage freed. */
void ts_fd_queue_close_all(ts_fd_queue *q);

#endif
