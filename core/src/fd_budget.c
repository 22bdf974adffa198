#include "fd_budget.h"

#include <sys/resource.h>

/* The budget's bound now: its most, or a quarter of the fd limit where that is less. */
static long budget_bound(const ts_fd_budget *b) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && (long)(rl.rlim_cur / 4) < b->most)
    return (long)(rl.rlim_cur / 4);
  return b->most;
}

bool ts_fd_budget_take(ts_fd_budget *b, long n) {
  if (atomic_fetch_add(&b->used, n) + n <= budget_bound(b)) return true;
  atomic_fetch_sub(&b->used, n);
  return false;
}

void ts_fd_budget_give(ts_fd_budget *b, long n) { atomic_fetch_sub(&b->used, n); }
