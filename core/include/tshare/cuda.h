/* tshare/cuda.h - sharing GPU memory with CUDA IPC.
 *
 * The driver is loaded at run time: a binary built with CUDA starts on a
 * machine without one, and every call here then returns TSHARE_E_NO_DEVICE
 * with the reason. A build without the CUDA toolkit returns
 * TSHARE_E_UNSUPPORTED. tshare brings no CUDA runtime of its own: in a LibTorch
 * (or any CUDA runtime) process it works in the same primary contexts, and a
 * stream argument is a cudaStream_t / CUstream of the caller (NULL: the
 * device's legacy default stream).
 *
 * Producer. Memory is exported once per allocation and the handle is cached,
 * so a stream of tensors costs one message each. Three ways in:
 *   - owned buffers (tshare_cuda_buffer_create): exported at allocation time,
 *     before any data is written, which is safe on every driver. Where the
 *     device supports it they are CUDA VMM memory exported as a POSIX fd, a
 *     capability that travels with SCM_RIGHTS and that only its receivers
 *     can map (socket channels only); otherwise, or when asked for, a legacy
 *     cudaIpcMemHandle, a bearer token any local process holding its 64
 *     bytes can map (works over pipes too);
 *   - slabs (tshare_cuda_slab_*): one owned allocation carved into many
 *     buffers, so the consumer opens it once however many tensors pass;
 *   - any device pointer (tshare_share_cuda), e.g. a caching allocator's
 *     tensor: the whole allocation is found and travels as handle + offset.
 *     Where the driver zeroes memory on export (Windows/WSL2, see below) the
 *     export is guarded.
 * The producer records an inter-process event on the given stream after the
 * work that wrote the tensor; the consumer's stream waits on it, so neither
 * side syncs the host on the hot path. Events come from a per-channel pool,
 * each announced once; a slot is reused only after its share was released.
 * Where the stream has no work left when the share is made, no event is
 * needed and none is sent; a consumer skips the wait on one that has already
 * completed.
 *
 * Consumer. tshare_view_recv_stream() maps the allocation (once per process
 * and producer allocation, cached) on the device whose UUID the producer
 * named, whatever CUDA_VISIBLE_DEVICES says, and makes the stream wait on the
 * producer's event. A view released with tshare_view_release() is given back
 * once the work queued on that stream before the release has finished (at
 * once when the stream is idle).
 *
 * The zeroing bug. Some drivers (Windows and WSL2) zero an allocation when
 * cudaIpcGetMemHandle is called after data was written to it. The export
 * guard snapshots the whole allocation, exports, compares and restores what
 * changed. TSHARE_EXPORT_GUARD=auto|on|off (default auto: on under WSL, or
 * when a probe at the first export of foreign memory sees zeroing).
 */
#ifndef TSHARE_CUDA_H
#define TSHARE_CUDA_H

#include "tshare/channel.h"
#include "tshare/errors.h"
#include "tshare/share.h"
#include "tshare/tensor.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- devices ------------------------------------------------------------ */

/* Load the driver. TSHARE_OK when at least one device is usable; otherwise
 * TSHARE_E_NO_DEVICE (or TSHARE_E_UNSUPPORTED in a build without CUDA) with
 * the reason in err. Cheap after the first call. */
TSHARE_API int tshare_cuda_init(tshare_error *err);

TSHARE_API int tshare_cuda_device_count(void); /* 0 when CUDA is unusable */

/* The device's UUID (16 bytes), as the driver reports it. */
TSHARE_API int tshare_cuda_device_uuid(int ordinal, uint8_t uuid[16]);

/* The ordinal under which this process sees the device, or -1. */
TSHARE_API int tshare_cuda_device_from_uuid(const uint8_t uuid[16]);

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (nvidia-smi's form); out >= 41 bytes. */
TSHARE_API void tshare_cuda_uuid_format(const uint8_t uuid[16], char *out, size_t cap);

/* ---- the export guard --------------------------------------------------- */

typedef enum tshare_export_guard {
  TSHARE_EXPORT_GUARD_AUTO = 0,
  TSHARE_EXPORT_GUARD_ON = 1,
  TSHARE_EXPORT_GUARD_OFF = 2
} tshare_export_guard;

/* Override TSHARE_EXPORT_GUARD for this process. */
TSHARE_API void tshare_cuda_set_export_guard(tshare_export_guard policy);

/* 1 if exports of foreign memory are guarded now, 0 if not, negative without
 * CUDA. why (optional) gets a static sentence saying which rule decided. */
TSHARE_API int tshare_cuda_export_guard_active(const char **why);

typedef struct tshare_cuda_export_stats {
  uint64_t exports;       /* cuIpcGetMemHandle calls made */
  uint64_t cache_hits;    /* shares that reused a cached handle */
  uint64_t guarded;       /* exports made under the guard */
  uint64_t restored;      /* guarded exports that found the memory changed and restored it */
  uint64_t imports;       /* cuIpcOpenMemHandle calls made */
  uint64_t import_hits;   /* received shares served by an open mapping */
  uint64_t import_closes; /* mappings closed */
  uint64_t host_syncs;    /* shares sent without an event (stream synchronised instead) */
  uint64_t events;        /* CUDA events tshare holds now (pools, opened peer events, release events) */
  uint64_t fd_exports;    /* owned allocations made as VMM memory with an fd capability */
  uint64_t fd_imports;    /* VMM mappings made from a received fd */
} tshare_cuda_export_stats;

TSHARE_API void tshare_cuda_stats(tshare_cuda_export_stats *out);

/* Bounds on mappings kept open with no view (idle), least recently used
 * closed first. Defaults: 1024 mappings, 32 GiB (a model's state_dict is
 * hundreds of allocations: each kept means its next set maps nothing). */
TSHARE_API void tshare_cuda_set_import_cache_limits(size_t max_idle, size_t max_idle_bytes);

/* ---- owned buffers and slabs -------------------------------------------- */

typedef struct tshare_cuda_buffer tshare_cuda_buffer;

/* How an owned allocation travels. */
typedef enum tshare_cuda_handle_kind {
  TSHARE_CUDA_HANDLE_AUTO = 0,  /* the process default: TSHARE_CUDA_HANDLES=auto|fd|legacy, else auto, which
                                   is an fd where the device supports it and legacy elsewhere */
  TSHARE_CUDA_HANDLE_FD = 1,    /* VMM memory with an fd capability, or TSHARE_E_UNSUPPORTED */
  TSHARE_CUDA_HANDLE_LEGACY = 2 /* cuMemAlloc memory with a cudaIpcMemHandle (a bearer token) */
} tshare_cuda_handle_kind;

/* Override TSHARE_CUDA_HANDLES for this process's later allocations. */
TSHARE_API void tshare_cuda_set_handle_kind(tshare_cuda_handle_kind kind);

/* 1 if the device can export VMM memory as POSIX fds, 0 if not, negative
 * when CUDA is unusable or the ordinal is not a device. */
TSHARE_API int tshare_cuda_fd_handles_supported(int device);

/* Allocate size bytes on device ordinal and export them before anything is
 * written. The memory is zeroed. VMM allocations are rounded up to the
 * device's granularity (2 MiB on current GPUs): many small tensors belong in
 * a slab. */
TSHARE_API int tshare_cuda_buffer_create(int device, size_t size, tshare_cuda_buffer **out, tshare_error *err);
TSHARE_API int tshare_cuda_buffer_create_kind(int device, size_t size, tshare_cuda_handle_kind kind,
                                              tshare_cuda_buffer **out, tshare_error *err);

/* TSHARE_MEM_CUDA_FD or TSHARE_MEM_CUDA_IPC (wire.h): how buf travels. A
 * buffer of fd kind needs a socket channel whose peer imports fds. */
TSHARE_API int tshare_cuda_buffer_mem_kind(const tshare_cuda_buffer *buf);

TSHARE_API void *tshare_cuda_buffer_ptr(const tshare_cuda_buffer *buf); /* device address */
TSHARE_API size_t tshare_cuda_buffer_size(const tshare_cuda_buffer *buf);
TSHARE_API int tshare_cuda_buffer_device(const tshare_cuda_buffer *buf);

/* Drop the caller's reference. The memory lives on while shares of it are
 * outstanding, and a slab piece goes back to its slab only then. */
TSHARE_API void tshare_cuda_buffer_release(tshare_cuda_buffer *buf);

typedef struct tshare_cuda_slab tshare_cuda_slab;

/* One owned, exported allocation of size bytes, carved into buffers. */
TSHARE_API int tshare_cuda_slab_create(int device, size_t size, tshare_cuda_slab **out, tshare_error *err);
TSHARE_API int tshare_cuda_slab_create_kind(int device, size_t size, tshare_cuda_handle_kind kind,
                                            tshare_cuda_slab **out, tshare_error *err);

/* A buffer of bytes (rounded up to 256) inside the slab. TSHARE_AGAIN when
 * no free range is large enough now (pieces come back as they are released). */
TSHARE_API int tshare_cuda_slab_alloc(tshare_cuda_slab *slab, size_t bytes, tshare_cuda_buffer **out);

TSHARE_API size_t tshare_cuda_slab_free_bytes(const tshare_cuda_slab *slab);
TSHARE_API void tshare_cuda_slab_release(tshare_cuda_slab *slab); /* pieces keep it alive */

/* ---- sharing ------------------------------------------------------------- */

/* Share a tensor inside buf (desc->byte_offset is relative to the buffer's
 * start). stream: the stream whose work wrote the tensor. The share holds a
 * reference on buf until it is released. */
TSHARE_API int tshare_share_cuda_buffer(tshare_channel *ch, tshare_cuda_buffer *buf, const tshare_tensor_desc *desc,
                                        void *stream, const char *tag, void *user_data, int timeout_ms,
                                        uint64_t *share_id);

/* Share a tensor at data (desc->byte_offset is relative to data) in memory
 * tshare does not own, such as a LibTorch tensor. The caller keeps the memory
 * alive until the channel's on_release callback reports this share. */
TSHARE_API int tshare_share_cuda(tshare_channel *ch, const void *data, const tshare_tensor_desc *desc, void *stream,
                                 const char *tag, void *user_data, int timeout_ms, uint64_t *share_id);

/* The same, with something kept alive for the share: drop(keep) runs once,
 * on the thread that drives the channel, after the share is released or
 * dropped, or at once when it fails. This is how a bridge holds a caching
 * allocator's block (LibTorch: the Storage). For cudaMalloc memory it may run
 * up to about 100 ms after the release: the keep then holds the segment
 * while the consumer keeps it mapped for the next share (docs/cuda.md, "held
 * while the consumer keeps them"), so repeated hand-offs skip the consumer's
 * open and close. */
TSHARE_API int tshare_share_cuda_keep(tshare_channel *ch, const void *data, const tshare_tensor_desc *desc,
                                      void *stream, const char *tag, tshare_drop_fn drop, void *keep, void *user_data,
                                      int timeout_ms, uint64_t *share_id);

/* A received CUDA view is shared on with tshare_share_view() or
 * tshare_share_view_part() (share.h); stream orders the third process after
 * work queued on it (NULL: the view's stream). */

/* ---- receiving ------------------------------------------------------------ */

/* Like tshare_view_recv(); a CUDA share is mapped for use on stream (its
 * context picks the device; NULL: the producer's device as seen here) and the
 * stream waits on the producer's event. The view's release waits for the
 * work queued on the stream before it. Host shares ignore the stream. Over
 * a ucx:// channel GPU memory the peer staged lands on the stream's device
 * (NULL: the calling thread's current device, else 0), ready for any
 * stream once the call returns. */
TSHARE_API int tshare_view_recv_stream(tshare_channel *ch, void *stream, int timeout_ms, tshare_view **out);

/* The ordinal of the device whose context maps a CUDA view; -1 otherwise. */
TSHARE_API int tshare_view_cuda_device(const tshare_view *view);

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_CUDA_H */
