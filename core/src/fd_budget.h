/* A process-wide budget of fds that memory kept past its use may hold.
 * The fd table is the process's, and every channel keeps memory of its own
 * peer: without one budget, four consumers of a few hundred tensors each
 * would exhaust a default `ulimit -n` of 1024 with fds nobody uses. */
#ifndef TSHARE_FD_BUDGET_H
#define TSHARE_FD_BUDGET_H

#include <stdatomic.h>
#include <stdbool.h>

typedef struct ts_fd_budget {
  atomic_long used;
  long most; /* at most this many, and never over a quarter of RLIMIT_NOFILE */
} ts_fd_budget;

#define TS_FD_BUDGET_INIT(most) {0, (most)}

/* Room for n more fds: true and counted, or false and nothing counted. */
bool ts_fd_budget_take(ts_fd_budget *b, long n);
void ts_fd_budget_give(ts_fd_budget *b, long n);

#endif
