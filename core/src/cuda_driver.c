#include "cuda_driver.h"

#include "tshare/errors.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* cuda.h maps most calls to a versioned ABI name with a macro; stringifying
 * through a second macro expands it, so the name looked up is the one a
 * program compiled against this header would call. */
#define TS_STR2(x) #x
#define TS_ABI_NAME(x) TS_STR2(x)

static ts_cuda_api api;
static const ts_cuda_api *_Atomic loaded; /* set once, after a successful init */
static int load_status = TSHARE_OK;
static char load_why[256];
static pthread_once_t once = PTHREAD_ONCE_INIT;

#define TS_MAX_DEVICES 64
static pthread_mutex_t ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext primary[TS_MAX_DEVICES];

const char *ts_cuda_strerror(CUresult rc) {
  const char *name = NULL;
  if (api.cuGetErrorName && api.cuGetErrorName(rc, &name) == CUDA_SUCCESS && name) return name;
  return "CUDA_ERROR_UNKNOWN";
}

static void *lookup(void *lib, const char *name) {
  /* The global scope first: an LD_PRELOADed stand-in wins over the driver. */
  void *p = dlsym(RTLD_DEFAULT, name);
  return p ? p : dlsym(lib, name);
}

static void load_once(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    load_status = TSHARE_E_NO_DEVICE;
    snprintf(load_why, sizeof load_why, "no CUDA device: the NVIDIA driver (libcuda.so.1) is not installed (%s)",
             dlerror());
    return;
  }
#define TS_CUDA_LOOKUP(name, ret, args)                                                                               \
  *(void **)&api.name = lookup(lib, TS_ABI_NAME(name));                                                               \
  if (!api.name) {                                                                                                    \
    load_status = TSHARE_E_NO_DEVICE;                                                                                 \
    snprintf(load_why, sizeof load_why, "no CUDA device: the driver lacks %s (older than CUDA 12?)",                 \
             TS_ABI_NAME(name));                                                                                      \
    return;                                                                                                           \
  }
  TS_CUDA_FUNCS(TS_CUDA_LOOKUP)
#undef TS_CUDA_LOOKUP
  CUresult rc = api.cuInit(0);
  if (rc != CUDA_SUCCESS) {
    load_status = TSHARE_E_NO_DEVICE;
    snprintf(load_why, sizeof load_why, "no CUDA device: cuInit failed with %s", ts_cuda_strerror(rc));
    return;
  }
  int count = 0;
  rc = api.cuDeviceGetCount(&count);
  if (rc != CUDA_SUCCESS || count == 0) {
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    load_status = TSHARE_E_NO_DEVICE;
    snprintf(load_why, sizeof load_why, "no CUDA device: the driver sees no GPU (CUDA_VISIBLE_DEVICES=%s)",
             cvd ? cvd : "unset");
    return;
  }
  loaded = &api;
}

const ts_cuda_api *ts_cuda(int *status, const char **why) {
  pthread_once(&once, load_once);
  if (status) *status = loaded ? TSHARE_OK : load_status;
  if (why) *why = loaded ? "" : load_why;
  return loaded;
}

const ts_cuda_api *ts_cuda_if_loaded(void) { return loaded; }

CUcontext ts_cuda_primary_ctx(int ordinal) {
  if (!loaded || ordinal < 0 || ordinal >= TS_MAX_DEVICES) return NULL;
  pthread_mutex_lock(&ctx_lock);
  CUcontext ctx = primary[ordinal];
  if (!ctx) {
    CUdevice dev;
    if (api.cuDeviceGet(&dev, ordinal) == CUDA_SUCCESS && api.cuDevicePrimaryCtxRetain(&ctx, dev) == CUDA_SUCCESS)
      primary[ordinal] = ctx;
    else
      ctx = NULL;
  }
  pthread_mutex_unlock(&ctx_lock);
  return ctx;
}

int ts_cuda_primary_ordinal(CUcontext ctx) {
  int ordinal = -1;
  pthread_mutex_lock(&ctx_lock);
  for (int i = 0; ctx && i < TS_MAX_DEVICES && ordinal < 0; i++)
    if (primary[i] == ctx) ordinal = i;
  pthread_mutex_unlock(&ctx_lock);
  return ordinal;
}

bool ts_cuda_push(CUcontext ctx) { return ctx && api.cuCtxPushCurrent(ctx) == CUDA_SUCCESS; }

void ts_cuda_pop(void) {
  CUcontext ignored;
  api.cuCtxPopCurrent(&ignored);
}
