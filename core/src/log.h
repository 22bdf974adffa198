/* What the library says about its work, to stderr, when TSHARE_LOG asks:
 * warn (the default: refusals and a peer's errors), info (channels opened
 * and closed, shares sent, views mapped and released), debug (every frame's
 * kind, mappings opened and closed). A line is
 * "tshare[PID] LEVEL: message", written whole. Off costs one relaxed load. */
#ifndef TSHARE_LOG_H
#define TSHARE_LOG_H

#include "error_detail.h"

#include <stdatomic.h>
#include <stdbool.h>

enum { TS_LOG_WARN = 1, TS_LOG_INFO = 2, TS_LOG_DEBUG = 3 };

extern atomic_int ts_log_level; /* 0 until TSHARE_LOG is read */
int ts_log_read_level(void);    /* reads TSHARE_LOG once */

static inline bool ts_log_on(int level) {
  int now = atomic_load_explicit(&ts_log_level, memory_order_relaxed);
  return level <= (now ? now : ts_log_read_level());
}

void ts_log_write(int level, const char *fmt, ...) TS_PRINTF(2, 3);

#define TS_LOG(level, ...)                                                                                             \
  do {                                                                                                                 \
    if (ts_log_on(level)) ts_log_write(level, __VA_ARGS__);                                                            \
  } while (0)

#endif
