#include "demo_gpu.h"

#include "cuda_driver.h" /* the driver tshare loaded, so the demo links no NVIDIA library */
#include "tshare/cuda.h"

#include <stdio.h>

static int driver_failed(tshare_error *err, const char *what, CUresult rc) {
  err->code = TSHARE_E_CUDA;
  snprintf(err->message, sizeof err->message, "%s failed: %s", what, ts_cuda_strerror(rc));
  return TSHARE_E_CUDA;
}

int demo_gpu_open(void **stream, tshare_error *err) {
  int rc = tshare_cuda_init(err);
  if (rc != TSHARE_OK) return rc;
  const ts_cuda_api *cu = ts_cuda(NULL, NULL);
  CUcontext ctx = NULL;
  if (cu->cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) ts_cuda_push(ts_cuda_primary_ctx(0));
  CUresult crc = cu->cuStreamCreate((CUstream *)stream, CU_STREAM_NON_BLOCKING);
  return crc == CUDA_SUCCESS ? TSHARE_OK : driver_failed(err, "cuStreamCreate", crc);
}

int demo_gpu_upload(void *stream, void *device_dst, const void *host_src, size_t n, tshare_error *err) {
  CUresult crc =
      ts_cuda(NULL, NULL)->cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)device_dst, host_src, n, (CUstream)stream);
  return crc == CUDA_SUCCESS ? TSHARE_OK : driver_failed(err, "cuMemcpyHtoDAsync", crc);
}

int demo_gpu_download(void *stream, void *host_dst, const void *device_src, size_t n, tshare_error *err) {
  const ts_cuda_api *cu = ts_cuda(NULL, NULL);
  CUresult crc = cu->cuMemcpyDtoHAsync(host_dst, (CUdeviceptr)(uintptr_t)device_src, n, (CUstream)stream);
  if (crc != CUDA_SUCCESS) return driver_failed(err, "cuMemcpyDtoHAsync", crc);
  crc = cu->cuStreamSynchronize((CUstream)stream);
  return crc == CUDA_SUCCESS ? TSHARE_OK : driver_failed(err, "cuStreamSynchronize", crc);
}
