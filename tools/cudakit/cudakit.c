#include "cudakit.h"

#include "kernels_ptx.h"

#include <stdio.h>
#include <string.h>

#define MAX_CTX 16

typedef struct kernels {
  CUcontext ctx;
  CUfunction fill, spin, count, read_sum;
} kernels;

static kernels loaded[MAX_CTX];

const ts_cuda_api *ck_init(char *why, size_t cap) {
  int status;
  const char *reason;
  const ts_cuda_api *cu = ts_cuda(&status, &reason);
  if (!cu) {
    snprintf(why, cap, "%s", reason);
    return NULL;
  }
  CUcontext cur = NULL;
  if (cu->cuCtxGetCurrent(&cur) != CUDA_SUCCESS || !cur) {
    CUcontext ctx = ts_cuda_primary_ctx(0);
    if (!ctx || cu->cuCtxPushCurrent(ctx) != CUDA_SUCCESS) {
      snprintf(why, cap, "no CUDA device: cannot make device 0's context current");
      return NULL;
    }
  }
  return cu;
}

/* The kernels of the current context, loaded on first use; NULL on failure. */
static const kernels *functions(void) {
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  CUcontext ctx;
  if (!cu || cu->cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) return NULL;
  int i = 0;
  while (i < MAX_CTX && loaded[i].ctx && loaded[i].ctx != ctx) i++;
  if (i == MAX_CTX) return NULL;
  if (!loaded[i].ctx) {
    CUmodule m;
    if (cu->cuModuleLoadData(&m, kernels_ptx) != CUDA_SUCCESS ||
        cu->cuModuleGetFunction(&loaded[i].fill, m, "tk_fill_i32") != CUDA_SUCCESS ||
        cu->cuModuleGetFunction(&loaded[i].spin, m, "tk_spin_fill_i32") != CUDA_SUCCESS ||
        cu->cuModuleGetFunction(&loaded[i].count, m, "tk_count_bad_i32") != CUDA_SUCCESS ||
        cu->cuModuleGetFunction(&loaded[i].read_sum, m, "tk_read_sum_u32") != CUDA_SUCCESS)
      return NULL;
    loaded[i].ctx = ctx;
  }
  return &loaded[i];
}

static unsigned blocks_for(size_t n) {
  size_t b = (n + 255) / 256;
  return b == 0 ? 1 : b > 1024 ? 1024 : (unsigned)b;
}

CUresult ck_fill(CUdeviceptr p, size_t n, int base, int step, CUstream stream) {
  const kernels *k = functions();
  if (!k) return CUDA_ERROR_INVALID_CONTEXT;
  unsigned long long nn = n;
  void *args[] = {&p, &nn, &base, &step};
  return ts_cuda_if_loaded()->cuLaunchKernel(k->fill, blocks_for(n), 1, 1, 256, 1, 1, 0, stream, args, NULL);
}

CUresult ck_spin_fill(CUdeviceptr p, size_t n, int base, int step, uint64_t spin_ns, CUstream stream) {
  const kernels *k = functions();
  if (!k) return CUDA_ERROR_INVALID_CONTEXT;
  unsigned long long nn = n, ns = spin_ns;
  void *args[] = {&p, &nn, &base, &step, &ns};
  return ts_cuda_if_loaded()->cuLaunchKernel(k->spin, 1, 1, 1, 256, 1, 1, 0, stream, args, NULL);
}

CUresult ck_count_bad(CUdeviceptr p, size_t n, int base, int step, CUstream stream, unsigned long long *bad) {
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  const kernels *k = functions();
  if (!cu || !k) return CUDA_ERROR_INVALID_CONTEXT;
  CUdeviceptr d = 0;
  CUresult rc = cu->cuMemAlloc(&d, sizeof *bad);
  if (rc != CUDA_SUCCESS) return rc;
  unsigned long long nn = n, zero = 0;
  void *args[] = {&p, &nn, &base, &step, &d};
  if ((rc = cu->cuMemcpyHtoDAsync(d, &zero, sizeof zero, stream)) == CUDA_SUCCESS &&
      (rc = cu->cuLaunchKernel(k->count, blocks_for(n), 1, 1, 256, 1, 1, 0, stream, args, NULL)) == CUDA_SUCCESS &&
      (rc = cu->cuMemcpyDtoHAsync(bad, d, sizeof *bad, stream)) == CUDA_SUCCESS)
    rc = cu->cuStreamSynchronize(stream);
  cu->cuMemFree(d);
  return rc;
}

CUresult ck_read_sum(CUdeviceptr p, size_t bytes, CUdeviceptr out, CUstream stream) {
  const kernels *k = functions();
  if (!k) return CUDA_ERROR_INVALID_CONTEXT;
  unsigned long long n = bytes / 16;
  void *args[] = {&p, &n, &out};
  return ts_cuda_if_loaded()->cuLaunchKernel(k->read_sum, blocks_for(n), 1, 1, 256, 1, 1, 0, stream, args,
                                             NULL);
}

size_t ck_count_bad_host(const int32_t *v, size_t n, int base, int step) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++)
    if (v[i] != base + (int32_t)i * step) bad++;
  return bad;
}
