/* An emulated affected driver, for LD_PRELOAD: cudaIpcGetMemHandle and
 * cuIpcGetMemHandle zero the whole allocation they export, as the Windows and
 * WSL2 drivers do when data was written before the export. Every call zeroes
 * (the worst case), so a path that exports twice is caught too. The test GPUs
 * run native Linux drivers, which keep the data; this makes the bug testable
 * there. */
#define _GNU_SOURCE
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdio.h>

typedef CUresult (*get_handle_fn)(CUipcMemHandle *, CUdeviceptr);
typedef CUresult (*range_fn)(CUdeviceptr *, size_t *, CUdeviceptr);
typedef CUresult (*memset_fn)(CUdeviceptr, unsigned char, size_t);
typedef CUresult (*sync_fn)(void);
typedef cudaError_t (*rt_get_handle_fn)(cudaIpcMemHandle_t *, void *);

static void *driver(const char *name) {
  static void *lib;
  if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  return lib ? dlsym(lib, name) : NULL;
}

static void zero_allocation(CUdeviceptr p) {
  range_fn range = (range_fn)driver("cuMemGetAddressRange_v2");
  memset_fn set = (memset_fn)driver("cuMemsetD8_v2");
  sync_fn sync = (sync_fn)driver("cuCtxSynchronize");
  CUdeviceptr base;
  size_t size;
  if (range && set && sync && range(&base, &size, p) == CUDA_SUCCESS) {
    set(base, 0, size);
    sync();
  }
}

CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr p) {
  get_handle_fn real = (get_handle_fn)driver("cuIpcGetMemHandle");
  if (!real) return CUDA_ERROR_NOT_INITIALIZED;
  CUresult rc = real(handle, p);
  if (rc == CUDA_SUCCESS) zero_allocation(p);
  return rc;
}

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *handle, void *p) {
  rt_get_handle_fn real = (rt_get_handle_fn)dlsym(RTLD_NEXT, "cudaIpcGetMemHandle");
  if (!real) return cudaErrorInitializationError;
  cudaError_t rc = real(handle, p);
  if (rc == cudaSuccess) zero_allocation((CUdeviceptr)(uintptr_t)p);
  return rc;
}
