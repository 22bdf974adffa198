/* The few CUDA calls the stress tool makes itself (device 0, the default
 * stream, synchronous): free memory, filling and checking a pattern. */
#include "stress.h"

#ifdef TSHARE_HAVE_CUDA
#include "cudakit.h"

static const ts_cuda_api *api(void) {
  static const ts_cuda_api *cu;
  static bool tried;
  if (!tried) {
    char why[256];
    tried = true;
    cu = ck_init(why, sizeof why);
  }
  return cu;
}

bool stress_gpu_on;

long long stress_gpu_free_bytes(void) {
  if (!stress_gpu_on) return -1; /* host runs never load CUDA */
  const ts_cuda_api *cu = api();
  size_t free_b = 0, total = 0;
  if (!cu || !ts_cuda_push(ts_cuda_primary_ctx(0))) return -1;
  CUresult rc = cu->cuMemGetInfo(&free_b, &total);
  ts_cuda_pop();
  return rc == CUDA_SUCCESS ? (long long)free_b : -1;
}

int stress_gpu_fill(void *dev, size_t n, int32_t base) {
  const ts_cuda_api *cu = api();
  if (!cu || !ts_cuda_push(ts_cuda_primary_ctx(0))) return -1;
  CUresult rc = ck_fill((CUdeviceptr)(uintptr_t)dev, n, base, 1, NULL);
  if (rc == CUDA_SUCCESS) rc = cu->cuCtxSynchronize();
  ts_cuda_pop();
  return rc == CUDA_SUCCESS ? 0 : -1;
}

long long stress_gpu_count_bad(void *dev, size_t n, int32_t base) {
  const ts_cuda_api *cu = api();
  if (!cu || !ts_cuda_push(ts_cuda_primary_ctx(0))) return -1;
  unsigned long long bad = 0;
  CUresult rc = ck_count_bad((CUdeviceptr)(uintptr_t)dev, n, base, 1, NULL, &bad);
  ts_cuda_pop();
  return rc == CUDA_SUCCESS ? (long long)bad : -1;
}

#else

bool stress_gpu_on;
long long stress_gpu_free_bytes(void) { return -1; }
int stress_gpu_fill(void *dev, size_t n, int32_t base) {
  (void)dev, (void)n, (void)base;
  return -1;
}
long long stress_gpu_count_bad(void *dev, size_t n, int32_t base) {
  (void)dev, (void)n, (void)base;
  return -1;
}

#endif
