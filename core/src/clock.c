/* Deadlines from the coarse clock where it is precise enough: see clock.h. */
#include "clock.h"

#include <stdatomic.h>
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

static struct timespec coarse_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return ts;
}

int64_t ts_coarse_now_us(void) {
  struct timespec ts = coarse_now();
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static int64_t coarse_now_ms(void) {
  struct timespec ts = coarse_now();
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Process-wide, read once: how far the coarse clock may lag the precise one
 * (its resolution, whole ms rounded up). -1: not read yet; 0: not usable
 * (unknown, or too coarse to bound a timeout), every read is precise. */
#define COARSE_TICK_MAX_MS 10
static _Atomic int coarse_tick = -1;

static int coarse_tick_ms(void) {
  int tick = atomic_load_explicit(&coarse_tick, memory_order_relaxed);
  if (tick >= 0) return tick;
  struct timespec res;
  tick = 0;
  if (clock_getres(CLOCK_MONOTONIC_COARSE, &res) == 0 && res.tv_sec == 0) {
    long ms = (res.tv_nsec + 999999) / 1000000 + 1; /* +1: the ms the precise clock truncates */
    if (ms <= COARSE_TICK_MAX_MS) tick = (int)ms;
  }
  atomic_store_explicit(&coarse_tick, tick, memory_order_relaxed);
  return tick;
}

/* Below this a timeout's deadline is read from the precise clock: a few ms
 * of the coarse clock's slack would be much of it. */
#define COARSE_TIMEOUT_MIN_MS 50

int64_t ts_deadline(int timeout_ms) {
  if (timeout_ms < 0) return -1;
  if (timeout_ms == 0) return TS_DEADLINE_PASSED; /* a look: no clock read */
  int tick = coarse_tick_ms();
  if (tick == 0 || timeout_ms < COARSE_TIMEOUT_MIN_MS) return ts_now_ms() + timeout_ms;
  /* The coarse clock is behind by up to a tick, and on a loaded VM, whose
   * tick interrupts come late, by up to two: no sooner than timeout_ms. */
  return coarse_now_ms() + 2 * tick + timeout_ms;
}

int64_t ts_turn_deadline(int ms) {
  int tick = coarse_tick_ms();
  /* Two ticks of slack, as ts_deadline() takes: a turn over before it began
   * (the coarse clock lagging by its whole length) would be a spin. */
  return ms >= TS_TURN_COARSE_MS && tick > 0 ? coarse_now_ms() + 2 * tick + ms : ts_deadline(ms);
}

int ts_remaining(int64_t deadline) {
  if (deadline < 0) return -1;
  int tick = coarse_tick_ms();
  int64_t left = -1;
  if (tick > 0) {
    int64_t most = deadline - coarse_now_ms(); /* the coarse clock is behind: at least this much has passed */
    if (most <= 0) return 0;
    /* And at most two ticks more (see ts_deadline); the last few ticks,
     * and all of a short timeout, are measured by the precise clock. */
    left = most > 4 * tick ? most - 2 * tick : -1;
  }
  if (left <= 0) left = deadline - ts_now_ms(); /* the last ticks: the precise clock */
  if (left <= 0) return 0;
  return left > 0x7fffffff ? 0x7fffffff : (int)left;
}
