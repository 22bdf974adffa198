/* The demo's GPU side. The demo fills and checks its patterns in host memory
 * and moves them to and from GPU memory with these, so demo.c reads the same
 * with or without CUDA: demo_gpu.c uses the driver tshare loads, and
 * demo_gpu_none.c (a build without CUDA) answers as tshare_cuda_init() does. */
#ifndef TSHARE_DEMO_GPU_H
#define TSHARE_DEMO_GPU_H

#include "tshare/errors.h"

#include <stddef.h>

/* Make device 0 current on this thread (unless a context already is) and
 * create a stream for the copies. */
int demo_gpu_open(void **stream, tshare_error *err);

/* Queue a copy of n bytes from host memory to GPU memory on stream. Shares
 * made on that stream afterwards are ordered after it: no host wait. */
int demo_gpu_upload(void *stream, void *device_dst, const void *host_src, size_t n, tshare_error *err);

/* Copy n bytes from GPU memory to host memory on stream and wait for it. */
int demo_gpu_download(void *stream, void *host_dst, const void *device_src, size_t n, tshare_error *err);

#endif
