/* A few large blocks kept after their free for the next allocation of about
 * their size. A model sent again and again allocates the same tens of
 * kilobytes per hand-off on each end (the producer's record of what a sent
 * set keeps alive, the consumer's members of a received set); at that size
 * glibc's malloc first consolidates its fast bins, which made those
 * allocations a fifth of a hand-off's CPU time. Blocks are taken and given
 * back with one atomic exchange each: any thread, no lock. */
#ifndef TSHARE_SPARE_BLOCKS_H
#define TSHARE_SPARE_BLOCKS_H

#include <stdatomic.h>
#include <stddef.h>

#define TS_SPARE_SLOTS 4 /* blocks kept: a set in flight to a few consumers at once */

typedef struct ts_spare_blocks {
  _Atomic(void *) slot[TS_SPARE_SLOTS];
} ts_spare_blocks;

/* A block of at least size bytes (not zeroed): a spare one when one is big
 * enough, else a new one. NULL when out of memory. Free it with
 * ts_spare_free on the same cache. */
void *ts_spare_alloc(ts_spare_blocks *c, size_t size);
/* Keep p (from ts_spare_alloc on c; NULL is ignored) for a later
 * allocation, or free it when every slot is taken. */
void ts_spare_free(ts_spare_blocks *c, void *p);

#endif
