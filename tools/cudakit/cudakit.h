/* cudakit: small GPU helpers for the tools and GPU tests (fill, a long
 * kernel, a device-side check), through tshare's run-time driver table. Not
 * part of the library's API. Each call works in the current context. */
#ifndef TSHARE_CUDAKIT_H
#define TSHARE_CUDAKIT_H

#include "cuda_driver.h"

#include <stddef.h>
#include <stdint.h>

/* The driver table, with the primary context of device 0 made current on this
 * thread; NULL with why filled when no device is usable. */
const ts_cuda_api *ck_init(char *why, size_t cap);

/* p[i] = base + i * step for i < n, queued on stream. */
CUresult ck_fill(CUdeviceptr p, size_t n, int base, int step, CUstream stream);

/* The same after spinning spin_ns nanoseconds on the GPU. */
CUresult ck_spin_fill(CUdeviceptr p, size_t n, int base, int step, uint64_t spin_ns, CUstream stream);

/* Count elements that differ from base + i * step, reading on stream (so it
 * is ordered by whatever the stream waits on), then sync that stream. */
CUresult ck_count_bad(CUdeviceptr p, size_t n, int base, int step, CUstream stream, unsigned long long *bad);

/* Add every 32-bit word of [p, p + bytes) into the device word *out, queued
 * on stream (bytes a multiple of 16): one full-width read of the buffer. */
CUresult ck_read_sum(CUdeviceptr p, size_t bytes, CUdeviceptr out, CUstream stream);

/* Host-side check of a copy: elements differing from base + i * step. */
size_t ck_count_bad_host(const int32_t *v, size_t n, int base, int step);

#endif
