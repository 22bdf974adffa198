/* The CUDA driver, loaded at run time.
 *
 * tshare links no NVIDIA library: a binary must start on a machine without a
 * driver and say "no CUDA device" there. libcuda.so.1 is opened with dlopen on
 * first use and every entry point is looked up by its ABI name (the versioned
 * name cuda.h maps each call to, e.g. cuMemAlloc -> cuMemAlloc_v2).
 *
 * Lookup goes through the global scope first, so a library preloaded with
 * LD_PRELOAD can stand in for a driver call (the zeroing emulator in the tests
 * does). In a LibTorch process the same libcuda, the same primary contexts and
 * the same streams are used as the CUDA runtime's: tshare brings no runtime.
 */
#ifndef TSHARE_CUDA_DRIVER_H
#define TSHARE_CUDA_DRIVER_H

#include <cuda.h>
#include <stdbool.h>

#define TS_CUDA_FUNCS(X)                                                                                              \
  X(cuInit, CUresult, (unsigned int))                                                                                 \
  X(cuDriverGetVersion, CUresult, (int *))                                                                            \
  X(cuGetErrorName, CUresult, (CUresult, const char **))                                                              \
  X(cuGetErrorString, CUresult, (CUresult, const char **))                                                            \
  X(cuDeviceGetCount, CUresult, (int *))                                                                              \
  X(cuDeviceGet, CUresult, (CUdevice *, int))                                                                         \
  X(cuDeviceGetName, CUresult, (char *, int, CUdevice))                                                               \
  X(cuDeviceGetUuid, CUresult, (CUuuid *, CUdevice))                                                                  \
  X(cuDeviceCanAccessPeer, CUresult, (int *, CUdevice, CUdevice))                                                     \
  X(cuDevicePrimaryCtxRetain, CUresult, (CUcontext *, CUdevice))                                                      \
  X(cuCtxGetCurrent, CUresult, (CUcontext *))                                                                         \
  X(cuCtxPushCurrent, CUresult, (CUcontext))                                                                          \
  X(cuCtxPopCurrent, CUresult, (CUcontext *))                                                                         \
  X(cuCtxGetDevice, CUresult, (CUdevice *))                                                                           \
  X(cuCtxSynchronize, CUresult, (void))                                                                               \
  X(cuMemAlloc, CUresult, (CUdeviceptr *, size_t))                                                                    \
  X(cuMemFree, CUresult, (CUdeviceptr))                                                                               \
  X(cuMemGetInfo, CUresult, (size_t *, size_t *))                                                                     \
  X(cuMemGetAddressRange, CUresult, (CUdeviceptr *, size_t *, CUdeviceptr))                                           \
  X(cuPointerGetAttribute, CUresult, (void *, CUpointer_attribute, CUdeviceptr))                                      \
  X(cuMemcpyHtoD, CUresult, (CUdeviceptr, const void *, size_t))                                                      \
  X(cuMemcpyDtoH, CUresult, (void *, CUdeviceptr, size_t))                                                            \
  X(cuMemcpyHtoDAsync, CUresult, (CUdeviceptr, const void *, size_t, CUstream))                                       \
  X(cuMemcpyDtoHAsync, CUresult, (void *, CUdeviceptr, size_t, CUstream))                                             \
  X(cuMemcpyDtoDAsync, CUresult, (CUdeviceptr, CUdeviceptr, size_t, CUstream))                                        \
  X(cuMemAllocAsync, CUresult, (CUdeviceptr *, size_t, CUstream))                                                     \
  X(cuMemFreeAsync, CUresult, (CUdeviceptr, CUstream))                                                                \
  X(cuMemHostRegister, CUresult, (void *, size_t, unsigned int))                                                      \
  X(cuMemHostUnregister, CUresult, (void *))                                                                          \
  X(cuMemsetD8, CUresult, (CUdeviceptr, unsigned char, size_t))                                                       \
  X(cuMemsetD32, CUresult, (CUdeviceptr, unsigned int, size_t))                                                       \
  X(cuIpcGetMemHandle, CUresult, (CUipcMemHandle *, CUdeviceptr))                                                     \
  X(cuIpcOpenMemHandle, CUresult, (CUdeviceptr *, CUipcMemHandle, unsigned int))                                      \
  X(cuIpcCloseMemHandle, CUresult, (CUdeviceptr))                                                                     \
  X(cuIpcGetEventHandle, CUresult, (CUipcEventHandle *, CUevent))                                                     \
  X(cuIpcOpenEventHandle, CUresult, (CUevent *, CUipcEventHandle))                                                    \
  X(cuEventCreate, CUresult, (CUevent *, unsigned int))                                                               \
  X(cuEventDestroy, CUresult, (CUevent))                                                                              \
  X(cuEventRecord, CUresult, (CUevent, CUstream))                                                                     \
  X(cuEventQuery, CUresult, (CUevent))                                                                                \
  X(cuEventSynchronize, CUresult, (CUevent))                                                                          \
  X(cuEventElapsedTime, CUresult, (float *, CUevent, CUevent))                                                        \
  X(cuStreamCreate, CUresult, (CUstream *, unsigned int))                                                             \
  X(cuStreamDestroy, CUresult, (CUstream))                                                                            \
  X(cuStreamGetCtx, CUresult, (CUstream, CUcontext *))                                                                \
  X(cuStreamWaitEvent, CUresult, (CUstream, CUevent, unsigned int))                                                   \
  X(cuStreamSynchronize, CUresult, (CUstream))                                                                        \
  X(cuStreamQuery, CUresult, (CUstream))                                                                              \
  X(cuDeviceGetAttribute, CUresult, (int *, CUdevice_attribute, CUdevice))                                            \
  X(cuMemGetAllocationGranularity, CUresult,                                                                          \
    (size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags))                                        \
  X(cuMemCreate, CUresult, (CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long)) \
  X(cuMemRelease, CUresult, (CUmemGenericAllocationHandle))                                                           \
  X(cuMemAddressReserve, CUresult, (CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long))                  \
  X(cuMemAddressFree, CUresult, (CUdeviceptr, size_t))                                                                \
  X(cuMemMap, CUresult, (CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long))              \
  X(cuMemUnmap, CUresult, (CUdeviceptr, size_t))                                                                      \
  X(cuMemSetAccess, CUresult, (CUdeviceptr, size_t, const CUmemAccessDesc *, size_t))                                 \
  X(cuMemExportToShareableHandle, CUresult,                                                                           \
    (void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long))                            \
  X(cuMemImportFromShareableHandle, CUresult, (CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType))    \
  X(cuMemRetainAllocationHandle, CUresult, (CUmemGenericAllocationHandle *, void *))                                  \
  X(cuModuleLoadData, CUresult, (CUmodule *, const void *))                                                           \
  X(cuModuleGetFunction, CUresult, (CUfunction *, CUmodule, const char *))                                            \
  X(cuLaunchKernel, CUresult,                                                                                         \
    (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **))

typedef struct ts_cuda_api {
#define TS_CUDA_MEMBER(name, ret, args) ret(CUDAAPI *name) args;
  TS_CUDA_FUNCS(TS_CUDA_MEMBER)
#undef TS_CUDA_MEMBER
} ts_cuda_api;

/* Loads and initialises the driver once per process. Returns the function
 * table, or NULL with the reason in why (TSHARE_E_NO_DEVICE: no driver, no
 * device; TSHARE_E_UNSUPPORTED: built without CUDA never reaches here). */
const ts_cuda_api *ts_cuda(int *status, const char **why);

/* The table if the driver was already loaded by an earlier call, else NULL.
 * Never loads anything: cheap enough for every channel hello. */
const ts_cuda_api *ts_cuda_if_loaded(void);

/* "CUDA_ERROR_OUT_OF_MEMORY" for rc; never NULL. */
const char *ts_cuda_strerror(CUresult rc);

/* The primary context of a device ordinal, retained for the life of the
 * process (the runtime's policy too). NULL on failure. */
CUcontext ts_cuda_primary_ctx(int ordinal);

/* The device ordinal of ctx if it is a primary context retained above
 * (those are never destroyed, so the answer stays true), else -1: no driver
 * call, where cuCtxGetDevice needs ctx made current and restored. */
int ts_cuda_primary_ordinal(CUcontext ctx);

/* Make ctx current for a few calls and restore the caller's context after. */
bool ts_cuda_push(CUcontext ctx);
void ts_cuda_pop(void);

#endif
