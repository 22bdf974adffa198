/* The driver, the devices by UUID, and the export guard's policy. */
#include "cuda_internal.h"
#include "error_detail.h"

#include <ctype.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

pthread_mutex_t ts_cuda_lock = PTHREAD_MUTEX_INITIALIZER;
tshare_cuda_export_stats ts_cuda_counters;

const ts_cuda_api *ts_cuda_require(char *err, size_t cap, int *status) {
  int st;
  const char *why;
  const ts_cuda_api *cu = ts_cuda(&st, &why);
  if (!cu) *status = ts_errf(err, cap, st, "%s", why);
  return cu;
}

int ts_cuda_fail(char *err, size_t cap, const char *what, CUresult rc) {
  int status = TSHARE_E_CUDA;
  if (rc == CUDA_ERROR_OUT_OF_MEMORY) status = TSHARE_E_NOMEM;
  return ts_errf(err, cap, status, "%s: %s", what, ts_cuda_strerror(rc));
}

int tshare_cuda_init(tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX];
  int rc = TSHARE_OK;
  if (!ts_cuda_require(msg, sizeof msg, &rc)) {
    ts_error_fill(err, rc, msg);
    return rc;
  }
  ts_error_fill(err, TSHARE_OK, "");
  return TSHARE_OK;
}

/* The devices this process sees and their UUIDs, read from the driver once:
 * the set is fixed when the driver initializes (CUDA_VISIBLE_DEVICES), and
 * asking it for a UUID again costs a call into the kernel on every share. */
#define DEVICES_CACHED 64
static struct {
  int count;
  uint8_t uuid[DEVICES_CACHED][16];
  bool known[DEVICES_CACHED];
} devices;
static pthread_once_t devices_once = PTHREAD_ONCE_INIT;

static int driver_uuid(const ts_cuda_api *cu, int ordinal, uint8_t uuid[16]) {
  CUdevice dev;
  CUuuid u;
  if (cu->cuDeviceGet(&dev, ordinal) != CUDA_SUCCESS || cu->cuDeviceGetUuid(&u, dev) != CUDA_SUCCESS)
    return TSHARE_E_INVALID_ARG;
  memcpy(uuid, u.bytes, 16);
  return TSHARE_OK;
}

static void read_devices(void) {
  const ts_cuda_api *cu = ts_cuda(NULL, NULL);
  int n = 0;
  if (!cu || cu->cuDeviceGetCount(&n) != CUDA_SUCCESS) return;
  devices.count = n;
  for (int i = 0; i < n && i < DEVICES_CACHED; i++) devices.known[i] = driver_uuid(cu, i, devices.uuid[i]) == TSHARE_OK;
}

int tshare_cuda_device_count(void) {
  pthread_once(&devices_once, read_devices);
  return devices.count;
}

int tshare_cuda_device_uuid(int ordinal, uint8_t uuid[16]) {
  int n = tshare_cuda_device_count();
  if (ordinal < 0 || ordinal >= n) return n ? TSHARE_E_INVALID_ARG : TSHARE_E_NO_DEVICE;
  if (ordinal >= DEVICES_CACHED) {
    const ts_cuda_api *cu = ts_cuda(NULL, NULL);
    return cu ? driver_uuid(cu, ordinal, uuid) : TSHARE_E_NO_DEVICE;
  }
  if (!devices.known[ordinal]) return TSHARE_E_INVALID_ARG;
  memcpy(uuid, devices.uuid[ordinal], 16);
  return TSHARE_OK;
}

int tshare_cuda_device_from_uuid(const uint8_t uuid[16]) {
  int n = tshare_cuda_device_count();
  for (int i = 0; i < n; i++) {
    uint8_t u[16];
    if (tshare_cuda_device_uuid(i, u) == TSHARE_OK && memcmp(u, uuid, 16) == 0) return i;
  }
  return -1;
}

void tshare_cuda_uuid_format(const uint8_t u[16], char *out, size_t cap) {
  snprintf(out, cap, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2], u[3],
           u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

void tshare_cuda_stats(tshare_cuda_export_stats *out) {
  pthread_mutex_lock(&ts_cuda_lock);
  *out = ts_cuda_counters;
  pthread_mutex_unlock(&ts_cuda_lock);
}

/* ---- the export guard's policy ----------------------------------------- */

static _Atomic int policy_override = -1; /* -1: the environment decides */
static int probe_state;                   /* 0 not run, 1 zeroes, 2 keeps data; under ts_cuda_lock */

void tshare_cuda_set_export_guard(tshare_export_guard policy) { policy_override = (int)policy; }

static tshare_export_guard policy_now(void) {
  int o = policy_override;
  if (o >= 0) return (tshare_export_guard)o;
  const char *env = getenv("TSHARE_EXPORT_GUARD");
  if (env && strcmp(env, "on") == 0) return TSHARE_EXPORT_GUARD_ON;
  if (env && strcmp(env, "off") == 0) return TSHARE_EXPORT_GUARD_OFF;
  return TSHARE_EXPORT_GUARD_AUTO; /* unset, "auto", or a typo: the safe choice */
}

/* WSL kernels say so in their release string ("5.15.153.1-microsoft-standard-WSL2"). */
static bool kernel_is_wsl(void) {
  FILE *f = fopen("/proc/sys/kernel/osrelease", "re");
  if (!f) return false;
  char rel[256] = {0};
  size_t n = fread(rel, 1, sizeof rel - 1, f);
  fclose(f);
  for (size_t i = 0; i < n; i++) rel[i] = (char)tolower((unsigned char)rel[i]);
  return strstr(rel, "microsoft") || strstr(rel, "wsl");
}

/* Write a pattern into a fresh allocation, export it, and look: the same
 * sequence that loses data on an affected driver. Runs once per process, at
 * the first export of memory tshare does not own, in that memory's context. */
static int run_probe(CUcontext ctx) {
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  enum { WORDS = 4096 };
  if (!cu || !ts_cuda_push(ctx)) return 0;
  int result = 0;
  CUdeviceptr p = 0;
  if (cu->cuMemAlloc(&p, WORDS * 4) == CUDA_SUCCESS) {
    uint32_t *host = malloc(WORDS * 4);
    CUipcMemHandle h;
    if (host && cu->cuMemsetD32(p, 0x5a5a5a5au, WORDS) == CUDA_SUCCESS && cu->cuCtxSynchronize() == CUDA_SUCCESS &&
        cu->cuIpcGetMemHandle(&h, p) == CUDA_SUCCESS && cu->cuMemcpyDtoH(host, p, WORDS * 4) == CUDA_SUCCESS) {
      result = 2;
      for (int i = 0; i < WORDS; i++)
        if (host[i] != 0x5a5a5a5au) result = 1;
      ts_cuda_counters.exports++;
    }
    free(host);
    cu->cuMemFree(p);
  }
  ts_cuda_pop();
  return result;
}

bool ts_cuda_guard_wanted(CUcontext ctx) {
  switch (policy_now()) {
  case TSHARE_EXPORT_GUARD_ON:
    return true;
  case TSHARE_EXPORT_GUARD_OFF:
    return false;
  default:
    break;
  }
  if (kernel_is_wsl()) return true;
  if (probe_state == 0 && ctx) probe_state = run_probe(ctx);
  return probe_state == 1;
}

int tshare_cuda_export_guard_active(const char **why) {
  const char *dummy;
  if (!why) why = &dummy;
  switch (policy_now()) {
  case TSHARE_EXPORT_GUARD_ON:
    *why = "on: asked for (TSHARE_EXPORT_GUARD=on or tshare_cuda_set_export_guard)";
    return 1;
  case TSHARE_EXPORT_GUARD_OFF:
    *why = "off: asked for (TSHARE_EXPORT_GUARD=off or tshare_cuda_set_export_guard)";
    return 0;
  default:
    break;
  }
  if (kernel_is_wsl()) {
    *why = "on: auto, the kernel is WSL's, whose driver zeroes exported memory";
    return 1;
  }
  int status;
  const char *reason;
  const ts_cuda_api *cu = ts_cuda(&status, &reason);
  if (!cu) {
    *why = "off: no CUDA device";
    return status;
  }
  pthread_mutex_lock(&ts_cuda_lock);
  if (probe_state == 0) {
    CUcontext ctx = NULL;
    if (cu->cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || !ctx) ctx = ts_cuda_primary_ctx(0);
    probe_state = run_probe(ctx);
  }
  int state = probe_state;
  pthread_mutex_unlock(&ts_cuda_lock);
  if (state == 1) {
    *why = "on: auto, a probe saw this driver zero memory exported after a write";
    return 1;
  }
  *why = state == 2 ? "off: auto, a probe saw this driver keep exported memory intact"
                    : "off: auto, the probe could not run";
  return 0;
}
