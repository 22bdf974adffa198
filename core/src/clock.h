/* Internal monotonic deadlines for timeouts given in milliseconds.
 *
 * A deadline is read from the coarse clock (CLOCK_MONOTONIC_COARSE, behind
 * the precise one by at most its tick of 1-4 ms) where that is precise
 * enough: a read of it costs a few ns where the precise one costs ~20 ns on
 * bare metal and ~80 ns on a VM's clock source, and a receive or a send
 * that finds its frame waiting reads them several times. A timeout of T ms
 * still lasts at least T ms: at most two ticks longer from T of 50 ms on
 * (two: on a loaded VM the coarse clock's updates come up to a tick late),
 * exactly as asked below that (the precise clock), and the precise clock
 * decides the last ticks before a deadline. */
#ifndef TSHARE_CLOCK_H
#define TSHARE_CLOCK_H

#include <stdint.h>

int64_t ts_now_ms(void);
int64_t ts_now_us(void);
int64_t ts_coarse_now_us(void);      /* the coarse clock: behind ts_now_us() by up to its tick */
int64_t ts_deadline(int timeout_ms); /* < 0 (wait forever) gives -1: no deadline */
int ts_remaining(int64_t deadline);  /* -1 none, 0 expired, else ms left (never more than are) */
/* A deadline already passed, made without reading a clock: look, don't
 * wait. ts_deadline(0) gives it. */
#define TS_DEADLINE_PASSED 0
/* A deadline for a turn of the library's own work, never a caller's timeout:
 * from TS_TURN_COARSE_MS on, one read of the coarse clock, cheap enough for
 * every receive (a timeout under 50 ms reads the precise one). It lasts at
 * least ms and up to two ticks more; shorter turns as ts_deadline(). */
#define TS_TURN_COARSE_MS 10
int64_t ts_turn_deadline(int ms);

#endif
