/* Exports of GPU memory: the handle or fds a share of it travels as. Memory
 * of the caching allocator (an IPC handle, remembered in the export cache
 * and, where the driver zeroes exported memory, guarded), and memory
 * another allocator mapped with the VMM calls (its chunks' fds). */
#include "cuda_internal.h"
#include "error_detail.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT_CACHE_MAX 1024      /* allocations whose handle is remembered */
#define GUARD_CHUNK (16u << 20)    /* bytes compared per step after a guarded export */

/* ---- the export cache ---------------------------------------------------- */

typedef struct cache_entry {
  ts_cuda_export x;
  uint64_t tick;
} cache_entry;

static cache_entry cache[EXPORT_CACHE_MAX];
static size_t cache_len;
static uint64_t cache_tick;

static cache_entry *cache_find(CUdeviceptr base) {
  for (size_t i = 0; i < cache_len; i++)
    if (cache[i].x.base == base) return &cache[i];
  return NULL;
}

void ts_cuda_export_cache_put(const ts_cuda_export *x) {
  cache_entry *e = cache_find(x->base);
  if (!e && cache_len < EXPORT_CACHE_MAX) e = &cache[cache_len++];
  if (!e) { /* full: forget the least recently used; it is re-exported if it comes back */
    e = &cache[0];
    for (size_t i = 1; i < cache_len; i++)
      if (cache[i].tick < e->tick) e = &cache[i];
  }
  e->x = *x;
  e->tick = ++cache_tick;
}

void ts_cuda_export_cache_remove(CUdeviceptr base) {
  cache_entry *e = cache_find(base);
  if (e) *e = cache[--cache_len];
}

/* ---- export -------------------------------------------------------------- */

/* Snapshot, export, compare, restore: the whole allocation, so neighbours of
 * the exported tensor in the same segment are covered too. All work queued in
 * the context is finished first, or the snapshot could miss a write. */
static CUresult guarded_export(const ts_cuda_api *cu, CUdeviceptr base, size_t size, CUipcMemHandle *h,
                               bool *restored, char *err, size_t cap, int *status) {
  *restored = false;
  uint8_t *snap = malloc(size ? size : 1);
  uint8_t *chunk = malloc(size < GUARD_CHUNK ? (size ? size : 1) : GUARD_CHUNK);
  CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
  if (!snap || !chunk) {
    *status = ts_errf(err, cap, TSHARE_E_NOMEM, "export guard: no host memory for a %zu-byte snapshot", size);
    goto out;
  }
  if ((rc = cu->cuCtxSynchronize()) != CUDA_SUCCESS || (rc = cu->cuMemcpyDtoH(snap, base, size)) != CUDA_SUCCESS ||
      (rc = cu->cuIpcGetMemHandle(h, base)) != CUDA_SUCCESS) {
    *status = ts_cuda_fail(err, cap, "export guard", rc);
    goto out;
  }
  for (size_t off = 0; off < size; off += GUARD_CHUNK) {
    size_t n = size - off < GUARD_CHUNK ? size - off : GUARD_CHUNK;
    if ((rc = cu->cuMemcpyDtoH(chunk, base + off, n)) != CUDA_SUCCESS) break;
    if (memcmp(chunk, snap + off, n) != 0) {
      *restored = true;
      if ((rc = cu->cuMemcpyHtoD(base + off, snap + off, n)) != CUDA_SUCCESS) break;
    }
  }
  if (rc != CUDA_SUCCESS) *status = ts_cuda_fail(err, cap, "export guard: compare/restore", rc);
out:
  free(snap);
  free(chunk);
  return rc;
}

int ts_cuda_export_of(CUdeviceptr ptr, ts_cuda_export *out, char *err, size_t cap) {
  int status = TSHARE_OK;
  const ts_cuda_api *cu = ts_cuda_require(err, cap, &status);
  if (!cu) return status;
  CUcontext ctx = NULL;
  CUresult rc = cu->cuPointerGetAttribute(&ctx, CU_POINTER_ATTRIBUTE_CONTEXT, ptr);
  if (rc != CUDA_SUCCESS || !ctx)
    return ts_errf(err, cap, TSHARE_E_INVALID_ARG,
                   "export: %p is not device memory from cudaMalloc/cuMemAlloc (%s)", (void *)(uintptr_t)ptr,
                   ts_cuda_strerror(rc));
  if (!ts_cuda_push(ctx)) return ts_errf(err, cap, TSHARE_E_CUDA, "export: cannot enter the memory's context");
  pthread_mutex_lock(&ts_cuda_lock);
  ts_cuda_export x;
  memset(&x, 0, sizeof x);
  x.ctx = ctx;
  x.fd = -1;
  unsigned long long id = 0;
  int ordinal = -1;
  if ((rc = cu->cuMemGetAddressRange(&x.base, &x.size, ptr)) != CUDA_SUCCESS ||
      (rc = cu->cuPointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, x.base)) != CUDA_SUCCESS ||
      (rc = cu->cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, x.base)) != CUDA_SUCCESS) {
    status = ts_cuda_fail(err, cap, "export: looking up the allocation", rc);
    goto out;
  }
  if (tshare_cuda_device_uuid(ordinal, x.uuid) != TSHARE_OK) {
    status = ts_errf(err, cap, TSHARE_E_CUDA, "export: the UUID of device %d, where %p lives, is unknown", ordinal,
                     (void *)(uintptr_t)ptr);
    goto out;
  }
  x.buffer_id = id;
  x.ordinal = ordinal;
  cache_entry *e = cache_find(x.base);
  if (e && e->x.buffer_id == x.buffer_id) {
    /* Exported before: never call the driver's export twice on one
     * allocation (each call could zero it on an affected driver). */
    e->tick = ++cache_tick;
    *out = e->x;
    ts_cuda_counters.cache_hits++;
    goto out;
  }
  /* A different buffer id at a known base: that allocation was freed and the
   * address reused. The stale entry is replaced below. */
  if (ts_cuda_guard_wanted(ctx)) {
    bool restored;
    if (guarded_export(cu, x.base, x.size, &x.handle, &restored, err, cap, &status) != CUDA_SUCCESS) goto out;
    ts_cuda_counters.guarded++;
    if (restored) ts_cuda_counters.restored++;
  } else if ((rc = cu->cuIpcGetMemHandle(&x.handle, x.base)) != CUDA_SUCCESS) {
    status = ts_cuda_fail(err, cap,
                          "export: cudaIpcGetMemHandle refused the allocation (stream-ordered pool and VMM memory "
                          "cannot use legacy CUDA IPC)",
                          rc);
    goto out;
  }
  ts_cuda_counters.exports++;
  ts_cuda_export_cache_put(&x);
  *out = x;
out:
  pthread_mutex_unlock(&ts_cuda_lock);
  ts_cuda_pop();
  return status;
}

/* ---- memory mapped by another allocator with the VMM calls ---------------- */

bool ts_cuda_is_foreign_vmm(CUdeviceptr ptr) {
  int status;
  char err[TSHARE_ERROR_MSG_MAX];
  const ts_cuda_api *cu = ts_cuda_require(err, sizeof err, &status);
  if (!cu) return false;
  CUcontext ctx = NULL;
  CUmemGenericAllocationHandle h;
  /* VMM mappings have no context; cuMemAlloc memory has one. */
  if (cu->cuPointerGetAttribute(&ctx, CU_POINTER_ATTRIBUTE_CONTEXT, ptr) != CUDA_SUCCESS || ctx) return false;
  if (cu->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)ptr) != CUDA_SUCCESS) return false;
  cu->cuMemRelease(h);
  return true;
}

void ts_vmm_chunks_close(ts_vmm_chunks *chunks) {
  for (int i = 0; i < chunks->n; i++)
    if (chunks->fd[i] >= 0) close(chunks->fd[i]);
  chunks->n = 0;
}

/* One chunk: its range and identity. */
static int lookup_chunk(const ts_cuda_api *cu, CUdeviceptr at, CUdeviceptr *base, size_t *size, uint64_t *id,
                        char *err, size_t cap) {
  unsigned long long buffer_id = 0, allowed = 0;
  CUresult rc = cu->cuMemGetAddressRange(base, size, at);
  if (rc == CUDA_SUCCESS) rc = cu->cuPointerGetAttribute(&buffer_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, *base);
  if (rc == CUDA_SUCCESS)
    rc = cu->cuPointerGetAttribute(&allowed, CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, *base);
  if (rc != CUDA_SUCCESS) return ts_cuda_fail(err, cap, "export (VMM memory): looking up the chunk", rc);
  if (!(allowed & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    return ts_errf(err, cap, TSHARE_E_UNSUPPORTED,
                   "export: the VMM memory at %p was created without POSIX-fd handles (handle types 0x%llx), the "
                   "only kind tshare passes between processes",
                   (void *)(uintptr_t)*base, allowed);
  *id = buffer_id;
  return TSHARE_OK;
}

int ts_cuda_vmm_export_fds(ts_vmm_chunks *chunks, char *err, size_t cap) {
  int status = TSHARE_OK;
  const ts_cuda_api *cu = ts_cuda_require(err, cap, &status);
  if (!cu) return status;
  for (int i = 0; i < chunks->n && status == TSHARE_OK; i++) {
    CUmemGenericAllocationHandle h;
    CUresult rc = cu->cuMemRetainAllocationHandle(&h, (void *)(uintptr_t)chunks->base[i]);
    if (rc != CUDA_SUCCESS) {
      status = ts_cuda_fail(err, cap, "export (VMM memory): cuMemRetainAllocationHandle", rc);
      break;
    }
    rc = cu->cuMemExportToShareableHandle(&chunks->fd[i], h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    cu->cuMemRelease(h); /* the retain's reference, not the memory */
    if (rc != CUDA_SUCCESS) {
      chunks->fd[i] = -1;
      status = ts_cuda_fail(err, cap, "export (VMM memory): cuMemExportToShareableHandle", rc);
    }
  }
  if (status != TSHARE_OK) ts_vmm_chunks_close(chunks);
  else {
    pthread_mutex_lock(&ts_cuda_lock);
    ts_cuda_counters.exports++;
    pthread_mutex_unlock(&ts_cuda_lock);
  }
  return status;
}

int ts_cuda_export_vmm(CUdeviceptr ptr, uint64_t extent, ts_cuda_export *x, ts_vmm_chunks *chunks, char *err,
                       size_t cap) {
  int status = TSHARE_OK;
  const ts_cuda_api *cu = ts_cuda_require(err, cap, &status);
  chunks->n = 0;
  if (!cu) return status;
  memset(x, 0, sizeof *x);
  x->fd = -1;
  int ordinal = -1;
  CUresult rc = cu->cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr);
  if (rc != CUDA_SUCCESS) return ts_cuda_fail(err, cap, "export (VMM memory): its device", rc);
  uint8_t uuid[16];
  if (tshare_cuda_device_uuid(ordinal, uuid) != TSHARE_OK)
    return ts_errf(err, cap, TSHARE_E_CUDA, "export (VMM memory): the UUID of device %d is unknown", ordinal);
  /* An identity of this exact run of chunks: their buffer ids (unique per
   * allocation in this process, new when an address is mapped again). */
  uint64_t id = 0xcbf29ce484222325ull;
  CUdeviceptr at = ptr, end = ptr + (extent ? extent : 1);
  while (at < end) {
    if (chunks->n == TS_VMM_CHUNKS_MAX)
      return ts_errf(err, cap, TSHARE_E_TOO_LARGE,
                     "export: the tensor spans more than %d chunks of VMM memory (%llu bytes from %p)",
                     TS_VMM_CHUNKS_MAX, (unsigned long long)extent, (void *)(uintptr_t)ptr);
    CUdeviceptr base;
    size_t size;
    uint64_t chunk_id = 0;
    if ((status = lookup_chunk(cu, at, &base, &size, &chunk_id, err, cap)) != TSHARE_OK) return status;
    if (chunks->n == 0) x->base = base;
    else if (base != x->base + x->size) /* a hole: not one tensor's memory */
      return ts_errf(err, cap, TSHARE_E_INVALID_ARG, "export: the VMM memory at %p is not mapped contiguously",
                     (void *)(uintptr_t)at);
    chunks->fd[chunks->n] = -1;
    chunks->base[chunks->n] = base;
    chunks->id[chunks->n] = chunk_id;
    chunks->size[chunks->n++] = size;
    x->size += size;
    id = (id ^ chunk_id) * 0x100000001b3ull;
    at = base + size;
  }
  /* One chunk keeps its buffer id as the allocation's id, like cuMemAlloc
   * memory; a run of several gets the hash, kept apart by its top bit. */
  x->buffer_id = chunks->n == 1 ? chunks->id[0] : (id | (1ull << 63));
  x->ordinal = ordinal;
  memcpy(x->uuid, uuid, 16);
  x->ctx = ts_cuda_primary_ctx(ordinal);
  return TSHARE_OK;
}
