/* Remote memory over UCX, the consumer's GPU side (backend_ucx.h): GPU
 * bytes a producer on another host staged in host memory
 * (session_stage.c) are read here and placed on a GPU of this process's.
 *
 * The read is double-buffered: chunks come over UCX into two pinned,
 * registered bounce buffers in turn, and while the GPU copies one chunk up
 * the next is read into the other. The bytes land in a tshare CUDA buffer
 * (tshare_cuda_buffer_create), so that what was received can be shared on
 * to this host's processes like any owned GPU memory. When the receive
 * returns, the bytes are on the GPU: ready for work on any stream. A
 * release never blocks: it records an event on the view's stream, and the
 * buffer is let go once that event completed (housekeeping, or the
 * channel's end).
 *
 * Built with the CUDA toolkit's headers only (the driver is loaded at run
 * time, cuda_driver.h); backend_ucx_device_none.c stands in without them. */
#include "backend_ucx.h"

#include "cuda_driver.h"
#include "error_detail.h"
#include "log.h"
#include "tshare/cuda.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define UCX_BOUNCE_BYTES (8u << 20) /* each of the two: a chunk of the read */

struct ucx_device {
  CUcontext ctx; /* the device's primary context */
  int device;
  CUstream stream; /* the copies up to the GPU */
  void *bounce[2];
  ts_ucp_mem_h memh[2];
  bool pinned[2];
  CUevent done[2]; /* the copy that last read bounce[i] */
  bool pending[2];
  bool stranded; /* a read that never finished may still write into the bounce buffers */
  struct ucx_device *next_stranded;
};

/* Asked at every hello over UCX, so it opens nothing: the driver where it
 * is loaded already, else whether this machine has NVIDIA's device nodes
 * (a share that comes anyway and finds no usable GPU is refused, saying
 * why, and released back). */
bool ts_ucx_device_offered(void) {
  if (ts_cuda_if_loaded()) return true;
  const char *visible = getenv("CUDA_VISIBLE_DEVICES");
  if (visible && (visible[0] == '\0' || strcmp(visible, "-1") == 0 || strcmp(visible, "NoDevFiles") == 0))
    return false; /* GPUs hidden from this process */
  if (access("/dev/nvidiactl", F_OK) != 0 && access("/dev/dxg", F_OK) != 0) return false;
  /* The driver's library loads (this opens no device; cuInit would). */
  static int driver_there = -1;
  if (driver_there < 0) {
    void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    driver_there = lib != NULL;
    if (lib) dlclose(lib);
  }
  return driver_there == 1;
}

/* The device staged bytes land on: that of stream's context, else the
 * calling thread's current context's, else 0. */
int ts_ucx_device_target(void *stream) {
  const ts_cuda_api *cu = ts_cuda(NULL, NULL);
  if (!cu) return -1;
  CUcontext ctx = NULL;
  if (stream) (void)cu->cuStreamGetCtx((CUstream)stream, &ctx);
  if (!ctx) (void)cu->cuCtxGetCurrent(&ctx);
  if (!ctx) return 0;
  int ordinal = ts_cuda_primary_ordinal(ctx);
  if (ordinal >= 0) return ordinal;
  CUdevice dev = 0;
  if (!ts_cuda_push(ctx)) return 0;
  if (cu->cuCtxGetDevice(&dev) != CUDA_SUCCESS) dev = 0;
  ts_cuda_pop();
  return (int)dev;
}

static void device_state_free(const ts_ucx_api *ucx, const ts_cuda_api *cu, struct ucx_device *d) {
  if (!d) return;
  bool entered = cu && d->ctx && ts_cuda_push(d->ctx);
  if (entered && d->stream) cu->cuStreamSynchronize(d->stream);
  for (int i = 0; i < 2; i++) {
    if (entered && d->done[i]) cu->cuEventDestroy(d->done[i]);
    if (d->memh[i]) ucx->ucp_mem_unmap(ucx->context, d->memh[i]);
    if (entered && d->pinned[i]) cu->cuMemHostUnregister(d->bounce[i]);
    if (d->bounce[i]) munmap(d->bounce[i], UCX_BOUNCE_BYTES);
  }
  if (entered && d->stream) cu->cuStreamDestroy(d->stream);
  if (entered) ts_cuda_pop();
  free(d);
}

/* The stream, events and bounce buffers for device (the channel's, made on
 * first use, made again for another device). Entered into its context. */
static int device_state(tshare_channel *ch, ucx_chan *u, const ts_cuda_api *cu, int device, struct ucx_device **out) {
  struct ucx_device *d = u->device;
  if (d && d->device == device && !d->stranded) {
    *out = d;
    return ts_cuda_push(d->ctx) ? TSHARE_OK
                                : ts_errf(ch->err, sizeof ch->err, TSHARE_E_CUDA, "import: cannot enter device %d",
                                          device);
  }
  if (d && !d->stranded) device_state_free(u->ucx, cu, d);
  else if (d) d->next_stranded = u->stranded_devices, u->stranded_devices = d; /* freed with the channel */
  u->device = NULL;
  d = calloc(1, sizeof *d);
  if (!d) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "import: out of memory");
  d->device = device;
  d->ctx = ts_cuda_primary_ctx(device);
  if (!d->ctx || !ts_cuda_push(d->ctx)) {
    free(d);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_CUDA, "import: cannot enter device %d's context", device);
  }
  CUresult rc = cu->cuStreamCreate(&d->stream, CU_STREAM_NON_BLOCKING);
  for (int i = 0; i < 2 && rc == CUDA_SUCCESS; i++) {
    rc = cu->cuEventCreate(&d->done[i], CU_EVENT_DISABLE_TIMING);
    d->bounce[i] = mmap(NULL, UCX_BOUNCE_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (d->bounce[i] == MAP_FAILED) {
      d->bounce[i] = NULL;
      ts_cuda_pop();
      device_state_free(u->ucx, cu, d);
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "import: out of memory for a bounce buffer");
    }
    /* Pinned, so the copy up runs while the next chunk is read; without,
     * the driver copies it first and the buffers still take turns. */
    d->pinned[i] = cu->cuMemHostRegister(d->bounce[i], UCX_BOUNCE_BYTES, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS;
    ts_ucp_mem_map_params mp = {.field_mask = TS_UCP_MEM_MAP_PARAM_FIELD_ADDRESS | TS_UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                                .address = d->bounce[i],
                                .length = UCX_BOUNCE_BYTES};
    if (u->ucx->ucp_mem_map(u->ucx->context, &mp, &d->memh[i]) != TS_UCS_OK) d->memh[i] = NULL; /* UCX copies then */
  }
  if (rc != CUDA_SUCCESS) {
    ts_cuda_pop();
    device_state_free(u->ucx, cu, d);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_CUDA, "import: a stream for GPU copies on device %d: %s", device,
                   ts_cuda_strerror(rc));
  }
  u->device = d;
  *out = d;
  return TSHARE_OK;
}

#define UCX_DEVICE_READ_MS 30000 /* the whole read: a peer that does not serve it in this time fails the share */

/* len bytes at address of the peer's allocation alloc_id into buf's memory
 * at dptr; entered into d's context. */
static int read_up(tshare_channel *ch, ucx_chan *u, const ts_ucx_link *link, const ts_cuda_api *cu,
                   struct ucx_device *d, uint64_t alloc_id, uint64_t address, uint64_t len, CUdeviceptr dptr) {
  CUresult rc = CUDA_SUCCESS;
  int64_t until = ts_ucx_now_ms() + UCX_DEVICE_READ_MS;
  int k = 0;
  for (uint64_t off = 0; off < len && rc == CUDA_SUCCESS; off += UCX_BOUNCE_BYTES, k ^= 1) {
    size_t n = len - off < UCX_BOUNCE_BYTES ? (size_t)(len - off) : UCX_BOUNCE_BYTES;
    if (d->pending[k] && (rc = cu->cuEventSynchronize(d->done[k])) != CUDA_SUCCESS) break; /* its copy up is done */
    d->pending[k] = false;
    ts_ucs_status st = ts_ucx_get_remote_until(ch, u, link, alloc_id, address + off, d->bounce[k], n, until);
    if (st != TS_UCS_OK) {
      d->stranded = st == TS_UCS_INPROGRESS; /* never used again: the read may still land */
      if (!d->stranded) cu->cuStreamSynchronize(d->stream);
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_CLOSED, "import: reading allocation %llu from %s: %s",
                     (unsigned long long)alloc_id, ch->conn.peer_label,
                     st == TS_UCS_INPROGRESS ? "the peer did not serve it in time" : ts_ucx_strerror(st));
    }
    rc = cu->cuMemcpyHtoDAsync(dptr + off, d->bounce[k], n, d->stream);
    if (rc == CUDA_SUCCESS) rc = cu->cuEventRecord(d->done[k], d->stream);
    d->pending[k] = rc == CUDA_SUCCESS;
  }
  CUresult synced = cu->cuStreamSynchronize(d->stream); /* on the GPU: ready for any stream */
  if (rc == CUDA_SUCCESS) rc = synced;
  d->pending[0] = d->pending[1] = false;
  if (rc != CUDA_SUCCESS)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_CUDA, "import: copying %llu bytes up to device %d: %s",
                   (unsigned long long)len, d->device, ts_cuda_strerror(rc));
  return TSHARE_OK;
}

int ts_ucx_device_land(tshare_channel *ch, ucx_chan *u, const ts_ucx_link *link, uint64_t alloc_id, uint64_t address,
                       uint64_t len, void *stream, ucx_landing **out) {
  int status = TSHARE_OK;
  const char *why = NULL;
  const ts_cuda_api *cu = ts_cuda(&status, &why);
  if (!cu) return ts_errf(ch->err, sizeof ch->err, status, "import: GPU memory staged by the peer: %s", why);
  int device = ts_ucx_device_target(stream);
  tshare_cuda_buffer *buf = NULL;
  tshare_error err;
  int rc = tshare_cuda_buffer_create(device, len ? (size_t)len : 1, &buf, &err);
  if (rc != TSHARE_OK)
    return ts_errf(ch->err, sizeof ch->err, rc, "import: %llu bytes of GPU memory on device %d: %s",
                   (unsigned long long)len, device, err.message);
  ucx_landing *l = calloc(1, sizeof *l);
  struct ucx_device *d = NULL;
  rc = l ? device_state(ch, u, cu, device, &d) : ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "import: out of memory");
  if (rc == TSHARE_OK) {
    rc = read_up(ch, u, link, cu, d, alloc_id, address, len, (CUdeviceptr)(uintptr_t)tshare_cuda_buffer_ptr(buf));
    ts_cuda_pop();
  }
  if (rc != TSHARE_OK) {
    /* A stranded read lands in the bounce buffers, never here: the buffer may go. */
    tshare_cuda_buffer_release(buf);
    free(l);
    return rc;
  }
  l->on_device = true;
  l->cuda_buf = buf;
  l->device_ptr = (uint64_t)(uintptr_t)tshare_cuda_buffer_ptr(buf);
  l->ctx = d->ctx;
  l->device = d->device;
  l->size = (size_t)len;
  l->refs = 1;
  *out = l;
  return TSHARE_OK;
}

static void landing_let_go(ucx_landing *l) {
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  if (l->event && cu && ts_cuda_push(l->ctx)) {
    cu->cuEventDestroy((CUevent)l->event);
    ts_cuda_pop();
  }
  tshare_cuda_buffer_release(l->cuda_buf); /* the memory lives on while a share of it is out */
  free(l);
}

void ts_ucx_device_free_locked(ucx_chan *u, ucx_landing *l, void *stream) {
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  CUevent ev = NULL;
  if (cu && ts_cuda_push(l->ctx)) {
    /* After the work queued on stream: the buffer is not let go before. */
    CUresult rc = cu->cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING);
    if (rc == CUDA_SUCCESS) rc = cu->cuEventRecord(ev, (CUstream)stream);
    if (rc != CUDA_SUCCESS && stream) rc = cu->cuEventRecord(ev, NULL); /* another context's stream */
    if (rc != CUDA_SUCCESS && ev) cu->cuEventDestroy(ev), ev = NULL;
    ts_cuda_pop();
  }
  l->event = ev;
  /* Without an event (no driver, no memory for one) the buffer goes now:
   * its release synchronizes with the device. */
  if (!ev || ucx_landing_vec_push(&u->freeing, l) != TSHARE_OK) landing_let_go(l);
}

ts_backend_wait ts_ucx_device_reap(tshare_channel *ch, ucx_chan *u) {
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  for (;;) {
    ucx_landing *done = NULL;
    bool waiting = false;
    pthread_mutex_lock(&ch->lock);
    for (size_t i = 0; i < u->freeing.len && !done; i++) {
      ucx_landing *l = u->freeing.items[i];
      bool finished = true;
      if (cu && ts_cuda_push(l->ctx)) {
        finished = cu->cuEventQuery((CUevent)l->event) != CUDA_ERROR_NOT_READY;
        ts_cuda_pop();
      }
      if (finished) done = l, ucx_landing_vec_remove(&u->freeing, i, 1);
      else waiting = true;
    }
    pthread_mutex_unlock(&ch->lock);
    if (!done) return waiting ? TS_BACKEND_LATER : TS_BACKEND_IDLE;
    landing_let_go(done);
  }
}

void ts_ucx_device_chan_free(ucx_chan *u) {
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  for (size_t i = 0; i < u->freeing.len; i++) {
    ucx_landing *l = u->freeing.items[i];
    if (cu && ts_cuda_push(l->ctx)) {
      cu->cuEventSynchronize((CUevent)l->event);
      ts_cuda_pop();
    }
    landing_let_go(l);
  }
  ucx_landing_vec_free(&u->freeing);
  device_state_free(u->ucx, cu, u->device);
  u->device = NULL;
  /* After the worker is gone: no stranded read can land any more. */
  for (struct ucx_device *d = u->stranded_devices, *next; d; d = next) {
    next = d->next_stranded;
    device_state_free(u->ucx, cu, d);
  }
  u->stranded_devices = NULL;
}
