/* Internal monotonic deadlines for timeouts given in milliseconds. */
#ifndef TSHARE_CLOCK_H
#define TSHARE_CLOCK_H

#include <stdint.h>

int64_t ts_now_ms(void);
int64_t ts_now_us(void);
int64_t ts_deadline(int timeout_ms); /* < 0 (wait forever) gives -1: no deadline */
int ts_remaining(int64_t deadline);  /* -1 none, 0 expired, else ms left */

#endif
