/* A build without CUDA: the demo's GPU side says why there is none, in the
 * library's words. */
#include "demo_gpu.h"

#include "tshare/cuda.h"

int demo_gpu_open(void **stream, tshare_error *err) {
  *stream = NULL;
  return tshare_cuda_init(err); /* never TSHARE_OK in this build */
}

int demo_gpu_upload(void *stream, void *device_dst, const void *host_src, size_t n, tshare_error *err) {
  (void)stream, (void)device_dst, (void)host_src, (void)n;
  return tshare_cuda_init(err);
}

int demo_gpu_download(void *stream, void *host_dst, const void *device_src, size_t n, tshare_error *err) {
  (void)stream, (void)host_dst, (void)device_src, (void)n;
  return tshare_cuda_init(err);
}
