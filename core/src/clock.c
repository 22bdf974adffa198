#include "clock.h"

#include <time.h>

int64_t ts_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t ts_now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int64_t ts_deadline(int timeout_ms) { return timeout_ms < 0 ? -1 : ts_now_ms() + timeout_ms; }

int ts_remaining(int64_t deadline) {
  if (deadline < 0) return -1;
  int64_t left = deadline - ts_now_ms();
  if (left <= 0) return 0;
  return left > 0x7fffffff ? 0x7fffffff : (int)left;
}
