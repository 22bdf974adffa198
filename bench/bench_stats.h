/* bench_stats: clocks, latency samples and what a process holds (fds, RSS). */
#ifndef TSHARE_BENCH_STATS_H
#define TSHARE_BENCH_STATS_H

#include <stddef.h>
#include <stdint.h>

uint64_t bs_now_ns(void); /* CLOCK_MONOTONIC */

typedef struct bs_samples {
  double *v;
  size_t n, cap;
} bs_samples;

void bs_add(bs_samples *s, double value); /* out of memory: the sample is dropped */
/* The p-th percentile (0..100, nearest rank) of what was added; sorts in place. NaN when empty. */
double bs_percentile(bs_samples *s, double p);
void bs_clear(bs_samples *s);
void bs_free(bs_samples *s);

/* Copy src into dst, cut to cap - 1 bytes: messages that may be cut. */
void bs_copy(char *dst, size_t cap, const char *src);

long bs_open_fds(void); /* entries in /proc/self/fd */
long bs_rss_kib(void);  /* resident set, from /proc/self/statm */

#endif
