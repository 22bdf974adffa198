/* Stand-ins for the driver calls on the hand-off path (bench_cuda_calls.h). */
#include "bench_cuda_calls.h"

#include "cuda_driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Every driver call the share call, the import and the release of a CUDA
 * hand-off may make (read from core/src/backend_cuda_*.c and cuda_*.c),
 * with the first-use ones (events, mappings) and the checks of a device. */
#define BC_FUNCS(X)                                                                                                   \
  X(cuCtxGetCurrent, (CUcontext * pctx), (pctx))                                                                      \
  X(cuCtxPushCurrent, (CUcontext ctx), (ctx))                                                                         \
  X(cuCtxPopCurrent, (CUcontext * pctx), (pctx))                                                                      \
  X(cuCtxGetDevice, (CUdevice * device), (device))                                                                    \
  X(cuStreamGetCtx, (CUstream stream, CUcontext * pctx), (stream, pctx))                                              \
  X(cuStreamQuery, (CUstream stream), (stream))                                                                       \
  X(cuStreamSynchronize, (CUstream stream), (stream))                                                                 \
  X(cuStreamWaitEvent, (CUstream stream, CUevent ev, unsigned int flags), (stream, ev, flags))                        \
  X(cuEventRecord, (CUevent ev, CUstream stream), (ev, stream))                                                       \
  X(cuEventQuery, (CUevent ev), (ev))                                                                                 \
  X(cuEventSynchronize, (CUevent ev), (ev))                                                                           \
  X(cuEventCreate, (CUevent * ev, unsigned int flags), (ev, flags))                                                   \
  X(cuEventDestroy, (CUevent ev), (ev))                                                                               \
  X(cuIpcGetMemHandle, (CUipcMemHandle * h, CUdeviceptr p), (h, p))                                                   \
  X(cuIpcOpenMemHandle, (CUdeviceptr * p, CUipcMemHandle h, unsigned int flags), (p, h, flags))                       \
  X(cuIpcCloseMemHandle, (CUdeviceptr p), (p))                                                                        \
  X(cuIpcGetEventHandle, (CUipcEventHandle * h, CUevent ev), (h, ev))                                                 \
  X(cuIpcOpenEventHandle, (CUevent * ev, CUipcEventHandle h), (ev, h))                                                \
  X(cuPointerGetAttribute, (void *data, CUpointer_attribute attr, CUdeviceptr p), (data, attr, p))                    \
  X(cuMemGetAddressRange, (CUdeviceptr * base, size_t *size, CUdeviceptr p), (base, size, p))                         \
  X(cuDeviceGet, (CUdevice * dev, int ordinal), (dev, ordinal))                                                       \
  X(cuDeviceGetCount, (int *count), (count))                                                                          \
  X(cuDeviceGetUuid, (CUuuid * uuid, CUdevice dev), (uuid, dev))                                                      \
  X(cuDeviceCanAccessPeer, (int *can, CUdevice dev, CUdevice peer), (can, dev, peer))                                 \
  X(cuDeviceGetAttribute, (int *value, CUdevice_attribute attr, CUdevice dev), (value, attr, dev))

#define BC_INDEX(fn, params, args) BC_IDX_##fn,
enum { BC_FUNCS(BC_INDEX) BC_N };
#undef BC_INDEX
_Static_assert(BC_N <= BC_FUNCS_MAX, "bc_tally holds every function");

#define BC_NAME(fn, params, args) #fn,
static const char *const names[BC_N] = {BC_FUNCS(BC_NAME)};
#undef BC_NAME

/* cuda.h maps most names to a versioned ABI name with a macro; a second
 * macro expands it before it is stringified, as the core's lookup does. */
#define BC_STR2(x) #x
#define BC_ABI_NAME(x) BC_STR2(x)

static _Atomic int phase = BC_OFF;
static atomic_ulong calls[BC_PHASES][BC_N], ns[BC_PHASES][BC_N];
static void *driver;
static pthread_once_t resolved = PTHREAD_ONCE_INIT;

#define BC_REAL(fn, params, args) static CUresult(CUDAAPI *real_##fn) params;
BC_FUNCS(BC_REAL)
#undef BC_REAL

static void resolve(void) {
  driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!driver) return;
#define BC_LOOKUP(fn, params, args) *(void **)&real_##fn = dlsym(driver, BC_ABI_NAME(fn));
  BC_FUNCS(BC_LOOKUP)
#undef BC_LOOKUP
}

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void tally(int p, int fn, uint64_t spent) {
  atomic_fetch_add_explicit(&calls[p][fn], 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&ns[p][fn], spent, memory_order_relaxed);
}

/* The stand-in of fn: forwards; counts and times while a phase is set. */
#define BC_STAND_IN(fn, params, args)                                                                                 \
  CUresult CUDAAPI fn params {                                                                                        \
    pthread_once(&resolved, resolve);                                                                                 \
    if (!real_##fn) return CUDA_ERROR_NOT_FOUND;                                                                      \
    int bc_phase_now_ = atomic_load_explicit(&phase, memory_order_relaxed);                                           \
    if (bc_phase_now_ == BC_OFF) return real_##fn args;                                                               \
    uint64_t bc_t0_ = now_ns();                                                                                       \
    CUresult bc_rc_ = real_##fn args;                                                                                 \
    tally(bc_phase_now_, BC_IDX_##fn, now_ns() - bc_t0_);                                                             \
    return bc_rc_;                                                                                                    \
  }
BC_FUNCS(BC_STAND_IN)
#undef BC_STAND_IN

int bc_active(const void *table, char *why, size_t cap) {
  const ts_cuda_api *t = table;
  pthread_once(&resolved, resolve);
  const char *missing = NULL;
#define BC_CHECK(fn, params, args)                                                                                    \
  if (!missing && (!t || t->fn != fn || !real_##fn)) missing = BC_ABI_NAME(fn);
  BC_FUNCS(BC_CHECK)
#undef BC_CHECK
  if (missing)
    snprintf(why, cap, "the driver table does not call this program's stand-in of %s (built without exports?)",
             missing);
  return missing == NULL;
}

void bc_set_phase(bc_phase p) { atomic_store_explicit(&phase, (int)p, memory_order_relaxed); }

void bc_reset(void) {
  for (int p = 0; p < BC_PHASES; p++)
    for (int i = 0; i < BC_N; i++) {
      atomic_store(&calls[p][i], 0);
      atomic_store(&ns[p][i], 0);
    }
}

const char *bc_name(int fn) { return fn >= 0 && fn < BC_N ? names[fn] : "?"; }

void *bc_real(const char *abi_name) {
  pthread_once(&resolved, resolve);
  return driver ? dlsym(driver, abi_name) : NULL;
}

void bc_encode(bc_phase p, char *out, size_t cap) {
  size_t at = 0;
  out[0] = 0;
  for (int i = 0; i < BC_N && at < cap; i++) {
    unsigned long c = atomic_load(&calls[p][i]);
    if (c)
      at += (size_t)snprintf(out + at, cap - at, "%d:%lu:%lu,", i, c, (unsigned long)atomic_load(&ns[p][i]));
  }
}

void bc_decode(const char *text, long n, bc_tally *out) {
  memset(out, 0, sizeof *out);
  out->n = BC_N;
  int i, used;
  unsigned long c, spent;
  while (n > 0 && text && sscanf(text, "%d:%lu:%lu,%n", &i, &c, &spent, &used) == 3) {
    if (i >= 0 && i < BC_N) {
      out->calls[i] = (double)c / (double)n;
      out->us[i] = (double)spent / 1000.0 / (double)n;
    }
    text += used;
  }
}

void bc_tally_of(bc_phase p, long n, bc_tally *out) {
  char text[BC_N * 48];
  bc_encode(p, text, sizeof text);
  bc_decode(text, n, out);
}

double bc_tally_us(const bc_tally *t) {
  double us = 0;
  for (int i = 0; i < t->n; i++) us += t->us[i];
  return us;
}

double bc_tally_calls(const bc_tally *t) {
  double c = 0;
  for (int i = 0; i < t->n; i++) c += t->calls[i];
  return c;
}

void bc_tally_describe(const bc_tally *t, char *out, size_t cap) {
  size_t at = 0;
  out[0] = 0;
  for (int i = 0; i < t->n && at < cap; i++)
    if (t->calls[i] >= 0.005)
      at += (size_t)snprintf(out + at, cap - at, "%s%s %.2g", at ? ", " : "", names[i] + 2, t->calls[i]);
  if (!at) snprintf(out, cap, "none");
}
