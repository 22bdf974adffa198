/* Shared by the CUDA modules: cuda_device.c (driver, devices, guard policy),
 * cuda_memory.c (owned buffers, slabs), cuda_export.c (export cache, guarded
 * export, foreign VMM chunks),
 * cuda_import.c (the process-wide import cache) and backend_cuda.c (channels:
 * event pools, shares, views, releases, retirement). */
#ifndef TSHARE_CUDA_INTERNAL_H
#define TSHARE_CUDA_INTERNAL_H

#include "cuda_driver.h"
#include "tshare/cuda.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* One lock for buffers, the export and import caches and the statistics:
 * none of them is hot enough to need finer locking. Taken after a channel's
 * lock, never before it. */
extern pthread_mutex_t ts_cuda_lock;
extern tshare_cuda_export_stats ts_cuda_counters; /* under ts_cuda_lock */

/* Load the driver or fill err with why not (NO_DEVICE). */
const ts_cuda_api *ts_cuda_require(char *err, size_t cap, int *status);

/* Fails with err naming the call and the CUDA error. */
int ts_cuda_fail(char *err, size_t cap, const char *what, CUresult rc);

/* ---- exports (cuda_export.c) ---- */

/* Everything a share frame needs to name an allocation. */
typedef struct ts_cuda_export {
  CUdeviceptr base;
  size_t size;
  uint64_t buffer_id; /* CU_POINTER_ATTRIBUTE_BUFFER_ID: unique per allocation in this process */
  int ordinal;
  CUcontext ctx;
  uint8_t uuid[16];
  CUipcMemHandle handle; /* legacy memory */
  int fd;                /* VMM memory: its POSIX-fd capability (kept by its owner), else -1 */
} ts_cuda_export;

/* The export cache: an allocation's handle remembered (owned legacy
 * allocations put theirs at creation) and forgotten when it is freed. */
void ts_cuda_export_cache_put(const ts_cuda_export *x);
void ts_cuda_export_cache_remove(CUdeviceptr base);
/* Find the allocation holding ptr and its handle, exporting it (guarded when
 * the policy says so) unless this allocation was exported before. */
int ts_cuda_export_of(CUdeviceptr ptr, ts_cuda_export *out, char *err, size_t cap);

/* Memory another allocator mapped with the CUDA VMM calls (PyTorch's
 * expandable segments): physical chunks mapped side by side into one
 * reserved range. A tensor may span several; each travels as its own fd
 * (legacy IPC handles cannot describe VMM memory). */
#define TS_VMM_CHUNKS_MAX 256
typedef struct ts_vmm_chunks {
  int n;
  int fd[TS_VMM_CHUNKS_MAX]; /* owned by the caller once filled: close them after sending */
  uint64_t size[TS_VMM_CHUNKS_MAX];
  uint64_t base[TS_VMM_CHUNKS_MAX]; /* the exporter's: where each chunk is mapped */
  uint64_t id[TS_VMM_CHUNKS_MAX];   /* and its buffer id there, new whenever the address is mapped again */
} ts_vmm_chunks;

/* Whether ptr is VMM memory this process did not create through tshare. */
bool ts_cuda_is_foreign_vmm(CUdeviceptr ptr);
/* The chunks holding bytes [ptr, ptr + extent) (their fds -1 for now); x
 * describes them as one allocation: base (the first chunk's), size (all of
 * them), buffer_id (an identity of this exact run of chunks), device,
 * primary context. */
int ts_cuda_export_vmm(CUdeviceptr ptr, uint64_t extent, ts_cuda_export *x, ts_vmm_chunks *chunks, char *err,
                       size_t cap);
/* Export each chunk as a POSIX fd (on failure none is left open). */
int ts_cuda_vmm_export_fds(ts_vmm_chunks *chunks, char *err, size_t cap);
void ts_vmm_chunks_close(ts_vmm_chunks *chunks);

/* An owned allocation: a whole buffer or a slab. */
typedef struct ts_cuda_alloc ts_cuda_alloc;
const ts_cuda_export *ts_cuda_alloc_export(const ts_cuda_alloc *a);
ts_cuda_alloc *ts_cuda_buffer_alloc(const tshare_cuda_buffer *b);
size_t ts_cuda_buffer_offset(const tshare_cuda_buffer *b);
void ts_cuda_buffer_retain(tshare_cuda_buffer *b);
void ts_cuda_buffer_release_cb(void *b); /* ts_export release */

/* References held by channels whose peer may keep the allocation mapped:
 * the memory is freed only after every such peer closed it. */
void ts_cuda_alloc_peer_retain(ts_cuda_alloc *a);
void ts_cuda_alloc_peer_release(ts_cuda_alloc *a);
bool ts_cuda_alloc_unused(const ts_cuda_alloc *a); /* only peer references left */
/* Moves each time an allocation some peer holds loses its last own
 * reference: a channel whose lent allocations were all looked at since need
 * not look again. */
unsigned ts_cuda_alloc_unused_generation(void);

/* ---- imports (cuda_import.c) ---- */

typedef struct ts_cuda_mapping ts_cuda_mapping;

/* Open (or reuse) the mapping of an allocation owned by origin (a
 * ts_channel_origin_key) in ctx.
 * Legacy memory comes as handle; VMM memory as *fdp >= 0 (a new mapping
 * keeps that fd, so views can be shared on, and sets *fdp to -1).
 * keep_idle: it may stay open with no view (the owner announces retirement). */
/* chunks (VMM memory of several chunks, fd[0] == *fdp): mapped side by side;
 * such a mapping keeps none of the fds (its views cannot be shared on). */
int ts_cuda_import_get(uint64_t origin, uint64_t alloc_id, CUcontext ctx, const CUipcMemHandle *handle, int *fdp,
                       const ts_vmm_chunks *chunks, size_t size, bool keep_idle, ts_cuda_mapping **out, char *err,
                       size_t cap);
CUdeviceptr ts_cuda_import_ptr(const ts_cuda_mapping *imp);
int ts_cuda_import_fd(const ts_cuda_mapping *imp); /* VMM: the capability the mapping came with; else -1 */
void ts_cuda_import_put(ts_cuda_mapping *imp);     /* a view is gone */
/* One more reference to a mapping already held (a pin, or a share of memory
 * the consumer keeps mapped: counted as a cache hit when hit). */
void ts_cuda_import_hold(ts_cuda_mapping *imp, bool hit);
size_t ts_cuda_import_size(const ts_cuda_mapping *imp);
CUcontext ts_cuda_import_ctx(const ts_cuda_mapping *imp);

/* The owner says the allocation goes away; true if nothing maps it any more. */
void ts_cuda_import_retire(uint64_t origin, uint64_t alloc_id);
/* The owner's process is gone: close its idle mappings. */
void ts_cuda_import_origin_gone(uint64_t origin);

/* ---- guard (cuda_device.c) ---- */
bool ts_cuda_guard_wanted(CUcontext ctx); /* may run the one-time probe in ctx */

#endif
