/* Where a CUDA hand-off's time goes: the driver calls on its path timed
 * alone, and per phase (share call, import, release) the calls tshare makes
 * and what is left, tshare's own work (bench_cuda_calls.h counts them). */
#ifndef TSHARE_BENCH_CUDA_PROFILE_H
#define TSHARE_BENCH_CUDA_PROFILE_H

#include "bench.h"
#include "bench_cuda_calls.h"
#include "cuda_driver.h"

/* The driver calls alone, in this process, on stream (of the current
 * context): one row each, p50 per call. */
void bench_cuda_driver_rows(bench *b, CUstream stream);

/* A hand-off's phases as its latency row measured them (p50, us). */
typedef struct bench_phases {
  double share_us, import_us, release_us;
} bench_phases;

/* The rows of one kind (key "reused", label "(b)"): phases from its
 * latency row, the producer's tally of its share calls, the consumer's
 * answer to "recvp" (n hand-offs). */
void bench_cuda_profile_rows(bench *b, const char *key, const char *label, const bench_phases *phases,
                             const bc_tally *share, const char *reply, long n);

/* Consumer side of "recvp N W": receive and release n views on stream as
 * "recvt" does, the driver calls of each phase counted after the first w;
 * the answer carries the tallies. */
int bench_cuda_consume_profiled(tshare_channel *ch, void *stream, long n, long warmup, char *reply, size_t cap);

#endif
