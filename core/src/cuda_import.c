/* The process-wide import cache: each allocation of each producer is opened
 * once per context (opening costs tens of microseconds and a second open of
 * one handle in one context is refused by some drivers), shared by every view
 * into it, and kept open while idle only where its owner promised a retire
 * notice before freeing it: closing after the owner freed it is undefined
 * behaviour in CUDA. Keys carry the allocation's buffer id, unique in its
 * process, so an address freed and reused never maps stale memory. */
#include "cuda_internal.h"
#include "error_detail.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct ts_cuda_mapping {
  uint32_t origin_pid;
  uint64_t alloc_id;
  CUcontext ctx;
  CUdeviceptr ptr;
  size_t size;
  int fd; /* VMM memory: the fd it was imported from, else -1 */
  size_t views;
  bool keep_idle; /* the owner sends a retire notice before it frees */
  bool gone;      /* the owner retired it or went away: close at the last view */
  uint64_t tick;  /* last use, for least-recently-used closing */
  struct ts_cuda_mapping *next;
};

static ts_cuda_mapping *imports; /* under ts_cuda_lock */
static uint64_t tick;
static size_t max_idle = 64;
static size_t max_idle_bytes = (size_t)4 << 30;

void tshare_cuda_set_import_cache_limits(size_t count, size_t bytes) {
  pthread_mutex_lock(&ts_cuda_lock);
  max_idle = count;
  max_idle_bytes = bytes;
  pthread_mutex_unlock(&ts_cuda_lock);
}

static void close_locked(ts_cuda_mapping *imp) {
  ts_cuda_mapping **pp = &imports;
  while (*pp && *pp != imp) pp = &(*pp)->next;
  if (*pp) *pp = imp->next;
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  if (cu && ts_cuda_push(imp->ctx)) {
    if (imp->fd >= 0) {
      cu->cuMemUnmap(imp->ptr, imp->size);
      cu->cuMemAddressFree(imp->ptr, imp->size);
    } else {
      cu->cuIpcCloseMemHandle(imp->ptr);
    }
    ts_cuda_pop();
  }
  if (imp->fd >= 0) close(imp->fd);
  ts_cuda_counters.import_closes++;
  free(imp);
}

/* Close idle mappings, oldest first, until the bounds hold. */
static void trim_locked(void) {
  for (;;) {
    size_t n = 0, bytes = 0;
    ts_cuda_mapping *oldest = NULL;
    for (ts_cuda_mapping *i = imports; i; i = i->next) {
      if (i->views) continue;
      n++;
      bytes += i->size;
      if (!oldest || i->tick < oldest->tick) oldest = i;
    }
    if (!oldest || (n <= max_idle && bytes <= max_idle_bytes)) return;
    close_locked(oldest);
  }
}

/* Map VMM memory from its fd: import, reserve, map, grant this context's
 * device access. The mapping holds the physical memory: it stays valid even
 * after its owner released it, until it is unmapped here. */
static CUresult vmm_map(const ts_cuda_api *cu, int fd, size_t size, CUdeviceptr *ptr) {
  CUdevice dev;
  CUmemGenericAllocationHandle h;
  CUresult rc = cu->cuCtxGetDevice(&dev);
  if (rc != CUDA_SUCCESS ||
      (rc = cu->cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) !=
          CUDA_SUCCESS)
    return rc;
  bool reserved = false;
  if ((rc = cu->cuMemAddressReserve(ptr, size, 0, 0, 0)) == CUDA_SUCCESS) {
    reserved = true;
    rc = cu->cuMemMap(*ptr, size, 0, h, 0);
  }
  cu->cuMemRelease(h); /* the mapping keeps the memory */
  if (rc == CUDA_SUCCESS) {
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = (int)dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    rc = cu->cuMemSetAccess(*ptr, size, &access, 1);
    if (rc != CUDA_SUCCESS) cu->cuMemUnmap(*ptr, size);
  }
  if (rc != CUDA_SUCCESS && reserved) cu->cuMemAddressFree(*ptr, size);
  return rc;
}

int ts_cuda_import_get(uint32_t origin_pid, uint64_t alloc_id, CUcontext ctx, const CUipcMemHandle *handle, int *fdp,
                       size_t size, bool keep_idle, ts_cuda_mapping **out, char *err, size_t cap) {
  *out = NULL;
  int status = TSHARE_OK;
  const ts_cuda_api *cu = ts_cuda_require(err, cap, &status);
  if (!cu) return status;
  pthread_mutex_lock(&ts_cuda_lock);
  ts_cuda_mapping *imp = imports;
  while (imp && !(imp->origin_pid == origin_pid && imp->alloc_id == alloc_id && imp->ctx == ctx)) imp = imp->next;
  if (imp && !imp->gone) {
    if (imp->size != size) {
      pthread_mutex_unlock(&ts_cuda_lock);
      return ts_errf(err, cap, TSHARE_E_PROTOCOL, "import: allocation %llu of pid %u came back with %zu bytes, not %zu",
                     (unsigned long long)alloc_id, origin_pid, size, imp->size);
    }
    ts_cuda_counters.import_hits++;
  } else {
    if (imp && imp->views == 0) close_locked(imp); /* retired but asked for again: reopen fresh */
    imp = calloc(1, sizeof *imp);
    if (!imp) {
      pthread_mutex_unlock(&ts_cuda_lock);
      return ts_errf(err, cap, TSHARE_E_NOMEM, "import: out of memory");
    }
    CUresult rc = CUDA_ERROR_INVALID_CONTEXT;
    bool vmm = fdp && *fdp >= 0;
    if (ts_cuda_push(ctx)) {
      rc = vmm ? vmm_map(cu, *fdp, size, &imp->ptr)
               : cu->cuIpcOpenMemHandle(&imp->ptr, *handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
      ts_cuda_pop();
    }
    if (rc != CUDA_SUCCESS) {
      free(imp);
      pthread_mutex_unlock(&ts_cuda_lock);
      if (rc == CUDA_ERROR_PEER_ACCESS_UNSUPPORTED || rc == CUDA_ERROR_TOO_MANY_PEERS)
        return ts_errf(err, cap, TSHARE_E_UNSUPPORTED,
                       "import: this GPU cannot map the producer's GPU memory: peer access between them is not "
                       "possible (%s)",
                       ts_cuda_strerror(rc));
      return ts_cuda_fail(err, cap, vmm ? "import: mapping the VMM fd" : "import: cudaIpcOpenMemHandle", rc);
    }
    imp->fd = vmm ? *fdp : -1;
    if (vmm) {
      *fdp = -1;
      ts_cuda_counters.fd_imports++;
    } else {
      ts_cuda_counters.imports++;
    }
    imp->origin_pid = origin_pid;
    imp->alloc_id = alloc_id;
    imp->ctx = ctx;
    imp->size = size;
    imp->next = imports;
    imports = imp;
  }
  imp->keep_idle = keep_idle;
  imp->views++;
  imp->tick = ++tick;
  pthread_mutex_unlock(&ts_cuda_lock);
  *out = imp;
  return TSHARE_OK;
}

CUdeviceptr ts_cuda_import_ptr(const ts_cuda_mapping *imp) { return imp->ptr; }
int ts_cuda_import_fd(const ts_cuda_mapping *imp) { return imp->fd; }

void ts_cuda_import_put(ts_cuda_mapping *imp) {
  pthread_mutex_lock(&ts_cuda_lock);
  imp->tick = ++tick;
  if (--imp->views == 0) {
    if (imp->gone || !imp->keep_idle)
      close_locked(imp);
    else
      trim_locked();
  }
  pthread_mutex_unlock(&ts_cuda_lock);
}

static void retire_where_locked(uint32_t origin_pid, bool any_alloc, uint64_t alloc_id) {
  for (ts_cuda_mapping *i = imports, *next; i; i = next) {
    next = i->next;
    if (i->origin_pid != origin_pid || (!any_alloc && i->alloc_id != alloc_id)) continue;
    i->gone = true;
    if (i->views == 0) close_locked(i);
  }
}

void ts_cuda_import_retire(uint32_t origin_pid, uint64_t alloc_id) {
  pthread_mutex_lock(&ts_cuda_lock);
  retire_where_locked(origin_pid, false, alloc_id);
  pthread_mutex_unlock(&ts_cuda_lock);
}

void ts_cuda_import_origin_gone(uint32_t origin_pid) {
  pthread_mutex_lock(&ts_cuda_lock);
  retire_where_locked(origin_pid, true, 0);
  pthread_mutex_unlock(&ts_cuda_lock);
}
