/* Opening libucp at run time and the process's one UCP context. */
#include "ucx_api.h"

#include "tshare/errors.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

static ts_ucx_api api;
static const ts_ucx_api *loaded; /* set once, by load_once */
static char load_why[320];
static pthread_once_t once = PTHREAD_ONCE_INIT;

const char *ts_ucx_strerror(ts_ucs_status status) {
  if (loaded) return api.ucs_status_string(status);
  return "a UCX error";
}

/* The context: active messages carry the frames, wake-ups make the worker's
 * fd pollable, RMA is what remote memory will read with. Workers of this one
 * context are driven from the threads of different channels. */
static int make_context(void) {
  ts_ucp_config *config = NULL;
  ts_ucs_status st = api.ucp_config_read(NULL, NULL, &config);
  if (st != TS_UCS_OK) {
    snprintf(load_why, sizeof load_why, "UCX: reading its configuration (UCX_* variables) failed: %s",
             api.ucs_status_string(st));
    return TSHARE_E_UNSUPPORTED;
  }
  ts_ucp_params params = {0};
  params.field_mask = TS_UCP_PARAM_FIELD_FEATURES | TS_UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = TS_UCP_FEATURE_AM | TS_UCP_FEATURE_WAKEUP | TS_UCP_FEATURE_RMA;
  params.mt_workers_shared = 1;
  st = api.ucp_init_version(TS_UCP_API_MAJOR, TS_UCP_API_MINOR, &params, config, &api.context);
  api.ucp_config_release(config);
  if (st != TS_UCS_OK) {
    snprintf(load_why, sizeof load_why, "UCX: ucp_init failed: %s (check UCX_TLS and UCX_NET_DEVICES)",
             api.ucs_status_string(st));
    return TSHARE_E_UNSUPPORTED;
  }
  return TSHARE_OK;
}

static void load_once(void) {
  const char *name = getenv(TS_UCX_LIBRARY_ENV);
  if (!name || !*name) name = "libucp.so.0";
  void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(load_why, sizeof load_why,
             "UCX is not installed: %s could not be opened (%s); install UCX (Debian: apt-get install libucx0, or "
             "scripts/install-deps.sh)",
             name, dlerror());
    return;
  }
  /* ucs_status_string lives in libucs, which libucp depends on: dlsym on
   * libucp's handle searches its dependencies too. */
#define TS_UCX_LOOKUP(fn, ret, args)                                                                                   \
  *(void **)&api.fn = dlsym(lib, #fn);                                                                                 \
  if (!api.fn) {                                                                                                       \
    snprintf(load_why, sizeof load_why, "UCX: %s lacks %s (UCX older than 1.13?)", name, #fn);                        \
    return;                                                                                                            \
  }
  TS_UCX_FUNCS(TS_UCX_LOOKUP)
#undef TS_UCX_LOOKUP
  if (make_context() == TSHARE_OK) loaded = &api;
}

const ts_ucx_api *ts_ucx(int *status, const char **why) {
  pthread_once(&once, load_once);
  if (status) *status = loaded ? TSHARE_OK : TSHARE_E_UNSUPPORTED;
  if (why) *why = loaded ? "" : load_why;
  return loaded;
}
