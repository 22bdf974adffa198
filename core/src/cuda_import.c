/* The process-wide import cache: each allocation of each producer is opened
 * once per context (opening costs tens of microseconds and a second open of
 * one handle in one context is refused by some drivers), shared by every view
 * into it, and kept open while idle only where its owner promised a retire
 * notice before freeing it: closing after the owner freed it is undefined
 * behaviour in CUDA. VMM mappings are keyed by (origin, allocation id,
 * context), where the origin is a key no peer can forge (channel.h's
 * peer_key: two producers in two containers may both say pid 1 and number
 * their allocations alike); the allocation id is unique in its process, so
 * an address freed and reused never maps stale memory. Legacy mappings are
 * keyed by the handle's own bytes: the handle names the allocation, and the
 * same one reached from its owner and through a forwarder opens once. */
#include "cuda_internal.h"
#include "error_detail.h"
#include "log.h"
#include "u64map.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct ts_cuda_mapping {
  uint64_t origin; /* ts_channel_origin_key() of whoever shared it (its owner, once the owner did) */
  uint64_t alloc_id;
  CUcontext ctx;
  bool legacy;                       /* found by handle, not by origin and id */
  uint8_t handle[TSHARE_HANDLE_MAX]; /* legacy */
  CUdeviceptr ptr;
  size_t size;
  int fd; /* VMM memory of one chunk: the fd it was imported from, else -1 */
  int nchunks;          /* VMM memory of several chunks mapped side by side: how many (else 0) */
  uint64_t *chunk_size; /* their sizes, to unmap each as it was mapped */
  size_t views;
  bool keep_idle;                                /* the owner sends a retire notice before it frees */
  bool gone;                                     /* the owner retired it or went away: close at the last view */
  bool idle;                                     /* on the idle list: no views, kept open for the next share */
  struct ts_cuda_mapping *same_key;              /* the next mapping in its hash slot */
  struct ts_cuda_mapping *prev, *next;           /* every mapping, for retiring by origin */
  struct ts_cuda_mapping *idle_prev, *idle_next; /* idle ones, least recently used first */
};

/* Under ts_cuda_lock. A consumer may hold views into thousands of
 * allocations, and every share looks one up: mappings are found by a hash of
 * (origin, allocation, context), and the idle ones close in LRU order. */
static ts_u64map by_key;
static ts_cuda_mapping *all;
static ts_cuda_mapping *idle_oldest, *idle_newest;
static size_t idle_count, idle_bytes;
static size_t max_idle = 1024;               /* a model's state_dict is hundreds of segments */
static size_t max_idle_bytes = (size_t)32 << 30;

static void trim_locked(void);

void tshare_cuda_set_import_cache_limits(size_t count, size_t bytes) {
  pthread_mutex_lock(&ts_cuda_lock);
  max_idle = count;
  max_idle_bytes = bytes;
  trim_locked();
  pthread_mutex_unlock(&ts_cuda_lock);
}

/* The identity a share asks for. */
typedef struct mapping_id {
  uint64_t origin, alloc_id;
  CUcontext ctx;
  const CUipcMemHandle *handle; /* legacy; NULL for VMM */
} mapping_id;

static uint64_t mix(uint64_t h) {
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  return h;
}

/* u64map keys are neither 0 (empty) nor UINT64_MAX (deleted). */
static uint64_t key_of(uint64_t origin, uint64_t alloc_id, CUcontext ctx, const uint8_t *handle) {
  uint64_t h = (uint64_t)(uintptr_t)ctx * 0x9e3779b97f4a7c15ull;
  if (handle) {
    for (int i = 0; i < TSHARE_HANDLE_MAX; i += 8) {
      uint64_t w;
      memcpy(&w, handle + i, 8);
      h = mix(h ^ w);
    }
  } else {
    h = mix(h ^ alloc_id) ^ mix(origin);
  }
  h = mix(h);
  return h % (UINT64_MAX - 1) + 1;
}

static uint64_t key_of_mapping(const ts_cuda_mapping *m) {
  return key_of(m->origin, m->alloc_id, m->ctx, m->legacy ? m->handle : NULL);
}

static bool same_identity(const ts_cuda_mapping *m, const mapping_id *id) {
  if (m->ctx != id->ctx || m->legacy != (id->handle != NULL)) return false;
  if (m->legacy) return memcmp(m->handle, id->handle->reserved, TSHARE_HANDLE_MAX) == 0;
  return m->origin == id->origin && m->alloc_id == id->alloc_id;
}

static void idle_unlink(ts_cuda_mapping *m) {
  if (!m->idle) return;
  if (m->idle_prev)
    m->idle_prev->idle_next = m->idle_next;
  else
    idle_oldest = m->idle_next;
  if (m->idle_next)
    m->idle_next->idle_prev = m->idle_prev;
  else
    idle_newest = m->idle_prev;
  m->idle_prev = m->idle_next = NULL;
  m->idle = false;
  idle_count--;
  idle_bytes -= m->size;
}

static void idle_append(ts_cuda_mapping *m) {
  m->idle = true;
  m->idle_prev = idle_newest;
  m->idle_next = NULL;
  if (idle_newest)
    idle_newest->idle_next = m;
  else
    idle_oldest = m;
  idle_newest = m;
  idle_count++;
  idle_bytes += m->size;
}

/* Index a new mapping; false when out of memory (then it is in nothing). */
static bool insert_locked(ts_cuda_mapping *m) {
  uint64_t key = key_of_mapping(m);
  m->same_key = ts_u64map_get(&by_key, key);
  if (ts_u64map_put(&by_key, key, m) != 0) return false;
  m->prev = NULL;
  m->next = all;
  if (all) all->prev = m;
  all = m;
  return true;
}

/* Give the mapping back to the driver and free it (it is in no list). */
static void unmap_and_free(ts_cuda_mapping *imp) {
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  if (cu && ts_cuda_push(imp->ctx)) {
    if (imp->nchunks) {
      uint64_t off = 0;
      for (int i = 0; i < imp->nchunks; off += imp->chunk_size[i++]) cu->cuMemUnmap(imp->ptr + off, imp->chunk_size[i]);
      cu->cuMemAddressFree(imp->ptr, imp->size);
    } else if (!imp->legacy) {
      cu->cuMemUnmap(imp->ptr, imp->size);
      cu->cuMemAddressFree(imp->ptr, imp->size);
    } else {
      cu->cuIpcCloseMemHandle(imp->ptr);
    }
    ts_cuda_pop();
  }
  if (imp->fd >= 0) close(imp->fd);
  free(imp->chunk_size);
  free(imp);
}

static void close_locked(ts_cuda_mapping *imp) {
  idle_unlink(imp);
  uint64_t key = key_of_mapping(imp);
  ts_cuda_mapping *head = ts_u64map_get(&by_key, key);
  if (head == imp) {
    if (imp->same_key)
      (void)ts_u64map_replace(&by_key, key, imp->same_key);
    else
      ts_u64map_remove(&by_key, key);
  } else {
    for (ts_cuda_mapping *i = head; i; i = i->same_key)
      if (i->same_key == imp) {
        i->same_key = imp->same_key;
        break;
      }
  }
  if (imp->prev)
    imp->prev->next = imp->next;
  else
    all = imp->next;
  if (imp->next) imp->next->prev = imp->prev;
  ts_cuda_counters.import_closes++;
  TS_LOG(TS_LOG_DEBUG, "closed the mapping of GPU allocation %llu (%zu bytes%s)", (unsigned long long)imp->alloc_id,
         imp->size, imp->nchunks ? ", several chunks" : "");
  unmap_and_free(imp);
}

/* Close idle mappings, least recently used first, until the bounds hold. */
static void trim_locked(void) {
  while (idle_oldest && (idle_count > max_idle || idle_bytes > max_idle_bytes)) close_locked(idle_oldest);
}

/* Several chunks into one reserved range, each at its offset: a tensor that
 * spans them sees one contiguous allocation, as in its owner's process. */
static CUresult vmm_map_chunks(const ts_cuda_api *cu, int n, const int *fds, const uint64_t *sizes, size_t size,
                               CUdeviceptr *ptr) {
  CUdevice dev;
  CUresult rc = cu->cuCtxGetDevice(&dev);
  if (rc == CUDA_SUCCESS) rc = cu->cuMemAddressReserve(ptr, size, 0, 0, 0);
  if (rc != CUDA_SUCCESS) return rc;
  uint64_t off = 0;
  int mapped = 0;
  for (; mapped < n && rc == CUDA_SUCCESS; off += sizes[mapped++]) {
    CUmemGenericAllocationHandle h;
    rc = cu->cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fds[mapped],
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (rc != CUDA_SUCCESS) break;
    rc = cu->cuMemMap(*ptr + off, sizes[mapped], 0, h, 0);
    cu->cuMemRelease(h); /* the mapping keeps the memory */
    if (rc != CUDA_SUCCESS) break;
  }
  if (rc == CUDA_SUCCESS) {
    CUmemAccessDesc access;
    memset(&access, 0, sizeof access);
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = (int)dev;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    rc = cu->cuMemSetAccess(*ptr, size, &access, 1);
  }
  if (rc != CUDA_SUCCESS) {
    off = 0;
    for (int i = 0; i < mapped; off += sizes[i++]) cu->cuMemUnmap(*ptr + off, sizes[i]);
    cu->cuMemAddressFree(*ptr, size);
  }
  return rc;
}

/* VMM memory of one chunk, from its fd. The mapping holds the physical
 * memory: it stays valid even after its owner released it, until it is
 * unmapped here. */
static CUresult vmm_map(const ts_cuda_api *cu, int fd, size_t size, CUdeviceptr *ptr) {
  uint64_t one = size;
  return vmm_map_chunks(cu, 1, &fd, &one, size, ptr);
}

/* A fresh mapping of the allocation from its handle, fd or chunks, entered
 * in the cache (ts_cuda_lock held): *out, or a status with err written. */
static int open_locked(const ts_cuda_api *cu, uint64_t origin, uint64_t alloc_id, CUcontext ctx,
                       const CUipcMemHandle *handle, int *fdp, const ts_vmm_chunks *chunks, size_t size,
                       ts_cuda_mapping **out, char *err, size_t cap) {
  bool vmm = fdp && *fdp >= 0;
  ts_cuda_mapping *imp = calloc(1, sizeof *imp);
  if (!imp) return ts_errf(err, cap, TSHARE_E_NOMEM, "import: out of memory");
  CUresult rc = CUDA_ERROR_INVALID_CONTEXT;
  if (chunks && !(imp->chunk_size = malloc((size_t)chunks->n * sizeof *imp->chunk_size))) rc = CUDA_ERROR_OUT_OF_MEMORY;
  else if (ts_cuda_push(ctx)) {
    rc = chunks ? vmm_map_chunks(cu, chunks->n, chunks->fd, chunks->size, size, &imp->ptr)
         : vmm  ? vmm_map(cu, *fdp, size, &imp->ptr)
                : cu->cuIpcOpenMemHandle(&imp->ptr, *handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    ts_cuda_pop();
  }
  if (rc != CUDA_SUCCESS) {
    free(imp->chunk_size);
    free(imp);
    if (rc == CUDA_ERROR_PEER_ACCESS_UNSUPPORTED || rc == CUDA_ERROR_TOO_MANY_PEERS)
      return ts_errf(err, cap, TSHARE_E_UNSUPPORTED,
                     "import: this GPU cannot map the producer's GPU memory: peer access between them is not "
                     "possible (%s)",
                     ts_cuda_strerror(rc));
    return ts_cuda_fail(err, cap, vmm ? "import: mapping the VMM fd" : "import: cudaIpcOpenMemHandle", rc);
  }
  imp->fd = vmm && !chunks ? *fdp : -1;
  if (chunks) {
    imp->nchunks = chunks->n;
    for (int i = 0; i < chunks->n; i++) imp->chunk_size[i] = chunks->size[i];
    ts_cuda_counters.fd_imports++;
  } else if (vmm) {
    *fdp = -1;
    ts_cuda_counters.fd_imports++;
  } else {
    ts_cuda_counters.imports++;
  }
  imp->origin = origin;
  imp->alloc_id = alloc_id;
  imp->ctx = ctx;
  imp->legacy = !vmm;
  if (!vmm) memcpy(imp->handle, handle->reserved, TSHARE_HANDLE_MAX);
  imp->size = size;
  if (!insert_locked(imp)) {
    unmap_and_free(imp);
    return ts_errf(err, cap, TSHARE_E_NOMEM, "import: out of memory");
  }
  *out = imp;
  return TSHARE_OK;
}

int ts_cuda_import_get(uint64_t origin, uint64_t alloc_id, CUcontext ctx, const CUipcMemHandle *handle, int *fdp,
                       const ts_vmm_chunks *chunks, size_t size, bool keep_idle, ts_cuda_mapping **out, char *err,
                       size_t cap) {
  *out = NULL;
  int status = TSHARE_OK;
  const ts_cuda_api *cu = ts_cuda_require(err, cap, &status);
  if (!cu) return status;
  pthread_mutex_lock(&ts_cuda_lock);
  /* A retired mapping still in use shares its slot with the fresh one that
   * replaced it: take the live one, else the retired one (to reopen). */
  bool vmm = fdp && *fdp >= 0;
  mapping_id id = {origin, alloc_id, ctx, vmm ? NULL : handle};
  ts_cuda_mapping *imp = NULL;
  for (ts_cuda_mapping *i =
           ts_u64map_get(&by_key, key_of(origin, alloc_id, ctx, vmm ? NULL : (const uint8_t *)handle->reserved));
       i; i = i->same_key)
    if (same_identity(i, &id) && (!imp || imp->gone)) imp = i;
  if (imp && imp->gone && imp->views && imp->legacy && imp->size == size) {
    /* Retired but still in use, and shared again: this share holds the
     * allocation too, and a second open of one handle in one context is
     * refused by some drivers. It still closes at its last view. */
    ts_cuda_counters.import_hits++;
  } else if (imp && !imp->gone) {
    if (imp->size != size) {
      pthread_mutex_unlock(&ts_cuda_lock);
      return ts_errf(err, cap, TSHARE_E_PROTOCOL, "import: allocation %llu came back with %zu bytes, not %zu",
                     (unsigned long long)alloc_id, size, imp->size);
    }
    /* Its owner's word (only owners promise retire notices): retire and
     * disconnect find it under the owner from now on. */
    if (keep_idle) {
      imp->origin = origin;
      imp->alloc_id = alloc_id;
    }
    ts_cuda_counters.import_hits++;
  } else {
    if (imp && imp->views == 0) close_locked(imp); /* retired but asked for again: reopen fresh */
    int rc = open_locked(cu, origin, alloc_id, ctx, handle, fdp, chunks, size, &imp, err, cap);
    if (rc != TSHARE_OK) {
      pthread_mutex_unlock(&ts_cuda_lock);
      return rc;
    }
  }
  idle_unlink(imp);
  imp->keep_idle = keep_idle;
  imp->views++;
  pthread_mutex_unlock(&ts_cuda_lock);
  *out = imp;
  return TSHARE_OK;
}

CUdeviceptr ts_cuda_import_ptr(const ts_cuda_mapping *imp) { return imp->ptr; }
int ts_cuda_import_fd(const ts_cuda_mapping *imp) { return imp->fd; }

void ts_cuda_import_hold(ts_cuda_mapping *imp, bool hit) {
  pthread_mutex_lock(&ts_cuda_lock);
  idle_unlink(imp);
  imp->views++;
  if (hit) ts_cuda_counters.import_hits++;
  pthread_mutex_unlock(&ts_cuda_lock);
}

size_t ts_cuda_import_size(const ts_cuda_mapping *imp) { return imp->size; }
CUcontext ts_cuda_import_ctx(const ts_cuda_mapping *imp) { return imp->ctx; }

void ts_cuda_import_put(ts_cuda_mapping *imp) {
  pthread_mutex_lock(&ts_cuda_lock);
  if (--imp->views == 0) {
    if (imp->gone || !imp->keep_idle) {
      close_locked(imp);
    } else {
      idle_append(imp);
      trim_locked();
    }
  }
  pthread_mutex_unlock(&ts_cuda_lock);
}

static void retire_where_locked(uint64_t origin, bool any_alloc, uint64_t alloc_id) {
  for (ts_cuda_mapping *i = all, *next; i; i = next) {
    next = i->next;
    if (i->origin != origin || (!any_alloc && i->alloc_id != alloc_id)) continue;
    i->gone = true;
    if (i->views == 0) close_locked(i);
  }
}

void ts_cuda_import_retire(uint64_t origin, uint64_t alloc_id) {
  pthread_mutex_lock(&ts_cuda_lock);
  retire_where_locked(origin, false, alloc_id);
  pthread_mutex_unlock(&ts_cuda_lock);
}

void ts_cuda_import_origin_gone(uint64_t origin) {
  pthread_mutex_lock(&ts_cuda_lock);
  retire_where_locked(origin, true, 0);
  pthread_mutex_unlock(&ts_cuda_lock);
}
