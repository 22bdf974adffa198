#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

atomic_int ts_log_level;

int ts_log_read_level(void) {
  const char *v = getenv("TSHARE_LOG");
  int level = TS_LOG_WARN;
  bool bad = false;
  if (v && *v) {
    if (strcmp(v, "debug") == 0)
      level = TS_LOG_DEBUG;
    else if (strcmp(v, "info") == 0)
      level = TS_LOG_INFO;
    else
      bad = strcmp(v, "warn") != 0;
  }
  int unread = 0; /* the first reader says what was wrong, once */
  if (atomic_compare_exchange_strong(&ts_log_level, &unread, level) && bad)
    ts_log_write(TS_LOG_WARN, "TSHARE_LOG='%s' is not warn, info or debug: using warn", v);
  return atomic_load(&ts_log_level);
}

void ts_log_write(int level, const char *fmt, ...) {
  static const char *const names[] = {"", "warn", "info", "debug"};
  char line[512];
  int n = snprintf(line, sizeof line, "tshare[%ld] %s: ", (long)getpid(), names[level]);
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
  va_end(ap);
  size_t len = (size_t)n + (m < 0                                     ? 0
                            : (size_t)m < sizeof line - (size_t)n - 1 ? (size_t)m
                                                                      : sizeof line - (size_t)n - 2);
  line[len++] = '\n';
  ssize_t w = write(STDERR_FILENO, line, len); /* one write: lines from several processes do not mix */
  (void)w;
}
