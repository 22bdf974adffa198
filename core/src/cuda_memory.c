/* Owned buffers and slabs: tshare's own GPU allocations (legacy or VMM),
 * the pieces of a slab, and the references shares and peers hold on them.
 * Exports of any memory: cuda_export.c. */
#include "cuda_internal.h"
#include "error_detail.h"

#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SLAB_ALIGN 256             /* what cudaMalloc guarantees: any dtype, vector loads */

typedef struct range {
  size_t off, len;
} range;

struct ts_cuda_alloc {
  ts_cuda_export x; /* x.fd >= 0: VMM memory, x.size rounded to the granularity */
  CUmemGenericAllocationHandle mem; /* VMM: the physical allocation */
  size_t refs;      /* buffers in it, the slab handle; under ts_cuda_lock */
  size_t peer_refs; /* channels whose peer may keep it mapped */
  bool is_slab;
  range *free; /* slab: free ranges sorted by offset */
  size_t nfree, cap_free, free_bytes;
};

struct tshare_cuda_buffer {
  ts_cuda_alloc *alloc;
  size_t offset, size;
  size_t refs; /* the caller's + one per outstanding share */
};

struct tshare_cuda_slab {
  ts_cuda_alloc *alloc;
};

/* ---- owned allocations ---------------------------------------------------- */

/* ---- how owned memory travels -------------------------------------------- */

static int handle_policy = -1; /* tshare_cuda_handle_kind; -1: not yet read from the environment */

void tshare_cuda_set_handle_kind(tshare_cuda_handle_kind kind) {
  pthread_mutex_lock(&ts_cuda_lock);
  handle_policy = kind;
  pthread_mutex_unlock(&ts_cuda_lock);
}

static tshare_cuda_handle_kind default_handle_kind(void) {
  pthread_mutex_lock(&ts_cuda_lock);
  if (handle_policy < 0) {
    const char *env = getenv("TSHARE_CUDA_HANDLES");
    handle_policy = TSHARE_CUDA_HANDLE_AUTO;
    if (env && strcmp(env, "fd") == 0) handle_policy = TSHARE_CUDA_HANDLE_FD;
    if (env && strcmp(env, "legacy") == 0) handle_policy = TSHARE_CUDA_HANDLE_LEGACY;
  }
  tshare_cuda_handle_kind k = (tshare_cuda_handle_kind)handle_policy;
  pthread_mutex_unlock(&ts_cuda_lock);
  return k;
}

/* The VMM calls and POSIX-fd export both have to be there. */
static bool device_exports_fds(const ts_cuda_api *cu, CUdevice dev) {
  int vmm = 0, fds = 0;
  return cu->cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) ==
             CUDA_SUCCESS &&
         vmm &&
         cu->cuDeviceGetAttribute(&fds, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev) ==
             CUDA_SUCCESS &&
         fds;
}

int tshare_cuda_fd_handles_supported(int device) {
  int status = TSHARE_OK;
  char err[TSHARE_ERROR_MSG_MAX];
  const ts_cuda_api *cu = ts_cuda_require(err, sizeof err, &status);
  if (!cu) return status;
  CUdevice dev;
  if (device < 0 || device >= tshare_cuda_device_count() || cu->cuDeviceGet(&dev, device) != CUDA_SUCCESS)
    return TSHARE_E_INVALID_ARG;
  return device_exports_fds(cu, dev) ? 1 : 0;
}

/* Physical memory, mapped read-write for its device and exported as an fd:
 * the fd is a capability, so only processes it is sent to can map it. Sizes
 * are rounded up to the allocation granularity (2 MiB on current GPUs). */
static CUresult vmm_create(const ts_cuda_api *cu, CUdevice dev, size_t size, ts_cuda_alloc *a) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = (int)dev;
  size_t gran = 0;
  CUresult rc = cu->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (rc != CUDA_SUCCESS) return rc;
  if (gran == 0) gran = 1;
  size_t rounded = (size + gran - 1) / gran * gran;
  bool created = false, reserved = false, mapped = false;
  int fd = -1;
  if ((rc = cu->cuMemCreate(&a->mem, rounded, &prop, 0)) != CUDA_SUCCESS) goto fail;
  created = true;
  if ((rc = cu->cuMemAddressReserve(&a->x.base, rounded, 0, 0, 0)) != CUDA_SUCCESS) goto fail;
  reserved = true;
  if ((rc = cu->cuMemMap(a->x.base, rounded, 0, a->mem, 0)) != CUDA_SUCCESS) goto fail;
  mapped = true;
  CUmemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if ((rc = cu->cuMemSetAccess(a->x.base, rounded, &access, 1)) != CUDA_SUCCESS ||
      (rc = cu->cuMemExportToShareableHandle(&fd, a->mem, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) !=
          CUDA_SUCCESS)
    goto fail;
  fcntl(fd, F_SETFD, FD_CLOEXEC); /* a role spawned by this process must not inherit the capability */
  a->x.fd = fd;
  a->x.size = rounded;
  return CUDA_SUCCESS;
fail:
  if (mapped) cu->cuMemUnmap(a->x.base, rounded);
  if (reserved) cu->cuMemAddressFree(a->x.base, rounded);
  if (created) cu->cuMemRelease(a->mem);
  a->x.base = 0;
  return rc;
}

static void vmm_free(const ts_cuda_api *cu, ts_cuda_alloc *a) {
  cu->cuMemUnmap(a->x.base, a->x.size);
  cu->cuMemAddressFree(a->x.base, a->x.size);
  cu->cuMemRelease(a->mem); /* the physical memory goes once every importer unmapped it too */
  close(a->x.fd);
}

/* ---- owned allocations ---------------------------------------------------- */

static uint64_t vmm_ids; /* under ts_cuda_lock; VMM memory has no driver buffer id */
#define VMM_ID_BASE ((uint64_t)1 << 62) /* far above the driver's ids, which count up from 1 */

/* A slab's free ranges: all of it, at first. False: out of memory. */
static bool slab_ranges_init(ts_cuda_alloc *a) {
  a->free = malloc(sizeof *a->free);
  if (!a->free) return false;
  a->free[0] = (range){0, a->x.size};
  a->nfree = a->cap_free = 1;
  a->free_bytes = a->x.size;
  return true;
}

/* Where a new allocation goes and how it travels: the driver, the device's
 * context, and whether it is VMM memory (fds) or legacy; the arguments
 * checked. A status, with msg written. */
static int alloc_where(int device, size_t size, tshare_cuda_handle_kind kind, const ts_cuda_api **cu, CUcontext *ctx,
                       CUdevice *dev, bool *vmm, char *msg, size_t cap) {
  int status = TSHARE_OK;
  *cu = ts_cuda_require(msg, cap, &status);
  if (!*cu) return status;
  if (size == 0 || size > ((size_t)1 << 48)) {
    status = ts_errf(msg, cap, TSHARE_E_INVALID_ARG, "cuda buffer: size %zu outside 1..2^48", size);
    return status;
  }
  if (kind != TSHARE_CUDA_HANDLE_AUTO && kind != TSHARE_CUDA_HANDLE_FD && kind != TSHARE_CUDA_HANDLE_LEGACY) {
    status = ts_errf(msg, cap, TSHARE_E_INVALID_ARG, "cuda buffer: unknown handle kind %d", (int)kind);
    return status;
  }
  int count = tshare_cuda_device_count();
  *ctx = device >= 0 && device < count ? ts_cuda_primary_ctx(device) : NULL;
  if (!*ctx || (*cu)->cuDeviceGet(dev, device) != CUDA_SUCCESS) {
    status = ts_errf(msg, cap, TSHARE_E_INVALID_ARG, "cuda buffer: device %d: this process sees %d device(s)",
                     device, count);
    return status;
  }
  if (kind == TSHARE_CUDA_HANDLE_AUTO) kind = default_handle_kind();
  bool fds = device_exports_fds(*cu, *dev);
  if (kind == TSHARE_CUDA_HANDLE_FD && !fds) {
    status = ts_errf(msg, cap, TSHARE_E_UNSUPPORTED,
                     "cuda buffer: device %d cannot export memory as POSIX fds (CUDA VMM); use legacy handles", device);
    return status;
  }
  *vmm = fds && kind != TSHARE_CUDA_HANDLE_LEGACY;
  return TSHARE_OK;
}

static int alloc_create(int device, size_t size, tshare_cuda_handle_kind kind, bool slab, ts_cuda_alloc **out,
                        tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX];
  *out = NULL;
  /* Set by alloc_where on success; initialised for the compiler, which cannot
   * see that a failure never reads them. */
  const ts_cuda_api *cu = NULL;
  CUcontext ctx = NULL;
  CUdevice dev = 0;
  bool vmm = false;
  int status = alloc_where(device, size, kind, &cu, &ctx, &dev, &vmm, msg, sizeof msg);
  if (status != TSHARE_OK) goto fail;
  ts_cuda_alloc *a = calloc(1, sizeof *a);
  if (!a) {
    status = ts_errf(msg, sizeof msg, TSHARE_E_NOMEM, "cuda buffer: out of memory");
    goto fail;
  }
  ts_cuda_push(ctx);
  CUresult rc;
  unsigned long long id = 0;
  CUuuid uuid;
  a->x.ctx = ctx;
  a->x.size = size;
  a->x.ordinal = device;
  a->x.fd = -1;
  /* Exported first, before any byte is written: safe on every driver. */
  if (vmm)
    rc = vmm_create(cu, dev, size, a);
  else if ((rc = cu->cuMemAlloc(&a->x.base, size)) == CUDA_SUCCESS &&
           (rc = cu->cuIpcGetMemHandle(&a->x.handle, a->x.base)) == CUDA_SUCCESS)
    rc = cu->cuPointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, a->x.base);
  if (rc == CUDA_SUCCESS && (rc = cu->cuDeviceGetUuid(&uuid, dev)) == CUDA_SUCCESS &&
      (rc = cu->cuMemsetD8(a->x.base, 0, a->x.size)) == CUDA_SUCCESS)
    rc = cu->cuCtxSynchronize();
  if (rc != CUDA_SUCCESS) {
    if (a->x.fd >= 0)
      vmm_free(cu, a);
    else if (a->x.base)
      cu->cuMemFree(a->x.base);
    ts_cuda_pop();
    free(a);
    char what[96];
    snprintf(what, sizeof what, "cuda buffer: %zu bytes on device %d%s", size, device,
             vmm ? " (VMM, fd handle)" : "");
    status = ts_cuda_fail(msg, sizeof msg, what, rc);
    goto fail;
  }
  ts_cuda_pop();
  memcpy(a->x.uuid, uuid.bytes, 16);
  a->refs = 1;
  a->is_slab = slab;
  if (slab && !slab_ranges_init(a)) {
    a->refs = 0;
    ts_cuda_push(ctx);
    if (vmm)
      vmm_free(cu, a);
    else
      cu->cuMemFree(a->x.base);
    ts_cuda_pop();
    free(a);
    status = ts_errf(msg, sizeof msg, TSHARE_E_NOMEM, "cuda slab: out of memory");
    goto fail;
  }
  pthread_mutex_lock(&ts_cuda_lock);
  if (vmm) {
    a->x.buffer_id = VMM_ID_BASE + ++vmm_ids;
    ts_cuda_counters.fd_exports++;
  } else {
    a->x.buffer_id = id;
    ts_cuda_counters.exports++;
    ts_cuda_export_cache_put(&a->x); /* the legacy handle also serves tshare_share_cuda() on a pointer into it */
  }
  pthread_mutex_unlock(&ts_cuda_lock);
  ts_error_fill(err, TSHARE_OK, "");
  *out = a;
  return TSHARE_OK;
fail:
  ts_error_fill(err, status, msg);
  return status;
}

/* With ts_cuda_lock held; frees a when nothing holds it any more. */
static void alloc_maybe_free_locked(ts_cuda_alloc *a) {
  if (a->refs || a->peer_refs) return;
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  if (a->x.fd < 0) ts_cuda_export_cache_remove(a->x.base);
  if (cu && ts_cuda_push(a->x.ctx)) {
    if (a->x.fd >= 0)
      vmm_free(cu, a);
    else
      cu->cuMemFree(a->x.base);
    ts_cuda_pop();
  } else if (a->x.fd >= 0) {
    close(a->x.fd);
  }
  free(a->free);
  free(a);
}

static atomic_uint unused_generation;

unsigned ts_cuda_alloc_unused_generation(void) {
  return atomic_load_explicit(&unused_generation, memory_order_acquire);
}

static void alloc_unref_locked(ts_cuda_alloc *a) {
  if (--a->refs == 0 && a->peer_refs) atomic_fetch_add_explicit(&unused_generation, 1, memory_order_release);
  alloc_maybe_free_locked(a);
}

const ts_cuda_export *ts_cuda_alloc_export(const ts_cuda_alloc *a) { return &a->x; }

void ts_cuda_alloc_peer_retain(ts_cuda_alloc *a) {
  pthread_mutex_lock(&ts_cuda_lock);
  a->peer_refs++;
  pthread_mutex_unlock(&ts_cuda_lock);
}

void ts_cuda_alloc_peer_release(ts_cuda_alloc *a) {
  pthread_mutex_lock(&ts_cuda_lock);
  a->peer_refs--;
  alloc_maybe_free_locked(a);
  pthread_mutex_unlock(&ts_cuda_lock);
}

bool ts_cuda_alloc_unused(const ts_cuda_alloc *a) {
  pthread_mutex_lock(&ts_cuda_lock);
  bool unused = a->refs == 0;
  pthread_mutex_unlock(&ts_cuda_lock);
  return unused;
}

/* ---- buffers ------------------------------------------------------------- */

int tshare_cuda_buffer_create(int device, size_t size, tshare_cuda_buffer **out, tshare_error *err) {
  return tshare_cuda_buffer_create_kind(device, size, TSHARE_CUDA_HANDLE_AUTO, out, err);
}

int tshare_cuda_buffer_create_kind(int device, size_t size, tshare_cuda_handle_kind kind, tshare_cuda_buffer **out,
                                   tshare_error *err) {
  if (!out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  tshare_cuda_buffer *b = calloc(1, sizeof *b);
  if (!b) {
    ts_error_fill(err, TSHARE_E_NOMEM, "cuda buffer: out of memory");
    return TSHARE_E_NOMEM;
  }
  int rc = alloc_create(device, size, kind, false, &b->alloc, err);
  if (rc != TSHARE_OK) {
    free(b);
    return rc;
  }
  b->size = size;
  b->refs = 1;
  *out = b;
  return TSHARE_OK;
}

void *tshare_cuda_buffer_ptr(const tshare_cuda_buffer *b) {
  return b ? (void *)(uintptr_t)(b->alloc->x.base + b->offset) : NULL;
}
size_t tshare_cuda_buffer_size(const tshare_cuda_buffer *b) { return b ? b->size : 0; }
int tshare_cuda_buffer_device(const tshare_cuda_buffer *b) { return b ? b->alloc->x.ordinal : -1; }
int tshare_cuda_buffer_mem_kind(const tshare_cuda_buffer *b) {
  return !b ? 0 : b->alloc->x.fd >= 0 ? TSHARE_MEM_CUDA_FD : TSHARE_MEM_CUDA_IPC;
}
ts_cuda_alloc *ts_cuda_buffer_alloc(const tshare_cuda_buffer *b) { return b->alloc; }
size_t ts_cuda_buffer_offset(const tshare_cuda_buffer *b) { return b->offset; }

void ts_cuda_buffer_retain(tshare_cuda_buffer *b) {
  pthread_mutex_lock(&ts_cuda_lock);
  b->refs++;
  pthread_mutex_unlock(&ts_cuda_lock);
}

/* Give a piece's range back, merging it with free neighbours. */
static void slab_give_back_locked(ts_cuda_alloc *a, size_t off, size_t len) {
  size_t i = 0;
  while (i < a->nfree && a->free[i].off < off) i++;
  bool merge_prev = i > 0 && a->free[i - 1].off + a->free[i - 1].len == off;
  bool merge_next = i < a->nfree && off + len == a->free[i].off;
  a->free_bytes += len;
  if (merge_prev && merge_next) {
    a->free[i - 1].len += len + a->free[i].len;
    memmove(&a->free[i], &a->free[i + 1], (a->nfree - i - 1) * sizeof *a->free);
    a->nfree--;
  } else if (merge_prev) {
    a->free[i - 1].len += len;
  } else if (merge_next) {
    a->free[i].off = off;
    a->free[i].len += len;
  } else {
    if (a->nfree == a->cap_free) {
      range *r = realloc(a->free, (a->cap_free * 2) * sizeof *r);
      if (!r) { /* the range stays lost to the slab until it is freed; never reused twice */
        a->free_bytes -= len;
        return;
      }
      a->free = r;
      a->cap_free *= 2;
    }
    memmove(&a->free[i + 1], &a->free[i], (a->nfree - i) * sizeof *a->free);
    a->free[i] = (range){off, len};
    a->nfree++;
  }
}

void tshare_cuda_buffer_release(tshare_cuda_buffer *b) {
  if (!b) return;
  pthread_mutex_lock(&ts_cuda_lock);
  if (--b->refs == 0) {
    ts_cuda_alloc *a = b->alloc;
    if (a->is_slab) slab_give_back_locked(a, b->offset, b->size);
    free(b);
    alloc_unref_locked(a);
  }
  pthread_mutex_unlock(&ts_cuda_lock);
}

void ts_cuda_buffer_release_cb(void *b) { tshare_cuda_buffer_release(b); }

/* ---- slabs --------------------------------------------------------------- */

int tshare_cuda_slab_create(int device, size_t size, tshare_cuda_slab **out, tshare_error *err) {
  return tshare_cuda_slab_create_kind(device, size, TSHARE_CUDA_HANDLE_AUTO, out, err);
}

int tshare_cuda_slab_create_kind(int device, size_t size, tshare_cuda_handle_kind kind, tshare_cuda_slab **out,
                                 tshare_error *err) {
  if (!out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  tshare_cuda_slab *s = calloc(1, sizeof *s);
  if (!s) {
    ts_error_fill(err, TSHARE_E_NOMEM, "cuda slab: out of memory");
    return TSHARE_E_NOMEM;
  }
  int rc = alloc_create(device, size, kind, true, &s->alloc, err);
  if (rc != TSHARE_OK) {
    free(s);
    return rc;
  }
  *out = s;
  return TSHARE_OK;
}

int tshare_cuda_slab_alloc(tshare_cuda_slab *s, size_t bytes, tshare_cuda_buffer **out) {
  if (!out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  if (!s || bytes == 0 || bytes > s->alloc->x.size) return TSHARE_E_INVALID_ARG;
  size_t need = (bytes + SLAB_ALIGN - 1) / SLAB_ALIGN * SLAB_ALIGN;
  tshare_cuda_buffer *b = calloc(1, sizeof *b);
  if (!b) return TSHARE_E_NOMEM;
  pthread_mutex_lock(&ts_cuda_lock);
  ts_cuda_alloc *a = s->alloc;
  size_t i = 0;
  while (i < a->nfree && a->free[i].len < need) i++; /* first fit */
  if (i == a->nfree) {
    pthread_mutex_unlock(&ts_cuda_lock);
    free(b);
    return TSHARE_AGAIN;
  }
  b->alloc = a;
  b->offset = a->free[i].off;
  b->size = need;
  b->refs = 1;
  a->free[i].off += need;
  a->free[i].len -= need;
  a->free_bytes -= need;
  if (a->free[i].len == 0) {
    memmove(&a->free[i], &a->free[i + 1], (a->nfree - i - 1) * sizeof *a->free);
    a->nfree--;
  }
  a->refs++;
  pthread_mutex_unlock(&ts_cuda_lock);
  *out = b;
  return TSHARE_OK;
}

size_t tshare_cuda_slab_free_bytes(const tshare_cuda_slab *s) {
  if (!s) return 0;
  pthread_mutex_lock(&ts_cuda_lock);
  size_t n = s->alloc->free_bytes;
  pthread_mutex_unlock(&ts_cuda_lock);
  return n;
}

void tshare_cuda_slab_release(tshare_cuda_slab *s) {
  if (!s) return;
  pthread_mutex_lock(&ts_cuda_lock);
  alloc_unref_locked(s->alloc);
  pthread_mutex_unlock(&ts_cuda_lock);
  free(s);
}
