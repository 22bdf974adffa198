/* A build without the CUDA toolkit: every CUDA call says so, and the
 * backend's hooks do nothing (the hello does not offer CUDA, so no peer
 * sends any) but refuse CUDA's frames and shares. */
#include "backend.h"
#include "session.h"
#include "error_detail.h"
#include "tshare/cuda.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define NO_CUDA "tshare was built without CUDA (no CUDA toolkit at build time)"

int tshare_cuda_init(tshare_error *err) {
  ts_error_fill(err, TSHARE_E_UNSUPPORTED, NO_CUDA);
  return TSHARE_E_UNSUPPORTED;
}
int tshare_cuda_device_count(void) { return 0; }
int tshare_cuda_device_uuid(int ordinal, uint8_t uuid[16]) {
  (void)ordinal;
  memset(uuid, 0, 16);
  return TSHARE_E_UNSUPPORTED;
}
int tshare_cuda_device_from_uuid(const uint8_t uuid[16]) {
  (void)uuid;
  return -1;
}
void tshare_cuda_uuid_format(const uint8_t u[16], char *out, size_t cap) {
  snprintf(out, cap, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2], u[3],
           u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}
void tshare_cuda_set_export_guard(tshare_export_guard policy) { (void)policy; }
int tshare_cuda_export_guard_active(const char **why) {
  if (why) *why = NO_CUDA;
  return TSHARE_E_UNSUPPORTED;
}
void tshare_cuda_stats(tshare_cuda_export_stats *out) { memset(out, 0, sizeof *out); }
void tshare_cuda_set_import_cache_limits(size_t max_idle, size_t max_idle_bytes) {
  (void)max_idle;
  (void)max_idle_bytes;
}
int tshare_cuda_buffer_create(int device, size_t size, tshare_cuda_buffer **out, tshare_error *err) {
  (void)device;
  (void)size;
  if (out) *out = NULL;
  return tshare_cuda_init(err);
}
int tshare_cuda_buffer_create_kind(int device, size_t size, tshare_cuda_handle_kind kind, tshare_cuda_buffer **out,
                                   tshare_error *err) {
  (void)kind;
  return tshare_cuda_buffer_create(device, size, out, err);
}
int tshare_cuda_slab_create_kind(int device, size_t size, tshare_cuda_handle_kind kind, tshare_cuda_slab **out,
                                 tshare_error *err) {
  (void)kind;
  return tshare_cuda_slab_create(device, size, out, err);
}
void tshare_cuda_set_handle_kind(tshare_cuda_handle_kind kind) { (void)kind; }
int tshare_cuda_fd_handles_supported(int device) {
  (void)device;
  return TSHARE_E_UNSUPPORTED;
}
int tshare_cuda_buffer_mem_kind(const tshare_cuda_buffer *buf) {
  (void)buf;
  return 0;
}
void *tshare_cuda_buffer_ptr(const tshare_cuda_buffer *buf) {
  (void)buf;
  return NULL;
}
size_t tshare_cuda_buffer_size(const tshare_cuda_buffer *buf) {
  (void)buf;
  return 0;
}
int tshare_cuda_buffer_device(const tshare_cuda_buffer *buf) {
  (void)buf;
  return -1;
}
void tshare_cuda_buffer_release(tshare_cuda_buffer *buf) { (void)buf; }
int tshare_cuda_slab_create(int device, size_t size, tshare_cuda_slab **out, tshare_error *err) {
  (void)device;
  (void)size;
  if (out) *out = NULL;
  return tshare_cuda_init(err);
}
int tshare_cuda_slab_alloc(tshare_cuda_slab *slab, size_t bytes, tshare_cuda_buffer **out) {
  (void)slab;
  (void)bytes;
  if (out) *out = NULL;
  return TSHARE_E_UNSUPPORTED;
}
size_t tshare_cuda_slab_free_bytes(const tshare_cuda_slab *slab) {
  (void)slab;
  return 0;
}
void tshare_cuda_slab_release(tshare_cuda_slab *slab) { (void)slab; }

static int unsupported(tshare_channel *ch, uint64_t *share_id) {
  if (share_id) *share_id = 0;
  if (!ch) return TSHARE_E_UNSUPPORTED;
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED, "share: %s", NO_CUDA);
}
int tshare_share_cuda_buffer(tshare_channel *ch, tshare_cuda_buffer *buf, const tshare_tensor_desc *desc, void *stream,
                             const char *tag, void *user_data, int timeout_ms, uint64_t *share_id) {
  (void)buf, (void)desc, (void)stream, (void)tag, (void)user_data, (void)timeout_ms;
  return unsupported(ch, share_id);
}
int tshare_share_cuda(tshare_channel *ch, const void *data, const tshare_tensor_desc *desc, void *stream,
                      const char *tag, void *user_data, int timeout_ms, uint64_t *share_id) {
  (void)data, (void)desc, (void)stream, (void)tag, (void)user_data, (void)timeout_ms;
  return unsupported(ch, share_id);
}
int tshare_share_cuda_keep(tshare_channel *ch, const void *data, const tshare_tensor_desc *desc, void *stream,
                           const char *tag, tshare_drop_fn drop, void *keep, void *user_data, int timeout_ms,
                           uint64_t *share_id) {
  (void)data, (void)desc, (void)stream, (void)tag, (void)user_data, (void)timeout_ms;
  if (drop) drop(keep);
  return unsupported(ch, share_id);
}
static int cuda_share_view(tshare_channel *ch, struct tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                           const char *tag, struct ts_export *e, int timeout_ms, uint64_t *share_id) {
  (void)v, (void)desc, (void)stream, (void)tag, (void)timeout_ms; /* no CUDA view can exist here */
  ts_export_drop(e);
  return unsupported(ch, share_id);
}

/* Event, retire and chunk frames: this end offered no CUDA. */
static int cuda_on_frame(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost) {
  (void)fd_lost;
  if (fd >= 0) close(fd);
  if (f->type == TSHARE_FRAME_CHUNK)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "receive: a chunk frame, but this end offered no CUDA");
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "receive: %s frame, but this side offered no CUDA",
                 tshare_frame_type_name(f->type));
}
static int cuda_import(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, struct tshare_view *v) {
  (void)fdp, (void)stream, (void)v;
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED, "import: share %llu is CUDA memory; %s",
                 (unsigned long long)f->u.share.share_id, NO_CUDA);
}
static uint64_t cuda_hello_caps(uint32_t transport_caps) {
  (void)transport_caps;
  return 0; /* this build imports no GPU memory */
}
static ts_release_done cuda_view_release(struct tshare_view *v) {
  (void)v; /* no CUDA view can exist here */
  return TS_RELEASE_NOW;
}
static const char *cuda_mem_kind_name(int kind) {
  (void)kind;
  return "CUDA memory";
}

static void cuda_nothing(tshare_channel *ch) { (void)ch; }

const ts_backend ts_cuda_backend = {
    .name = "cuda (not built)",
    .mem_kinds = TS_MEM_KIND_BIT(TSHARE_MEM_CUDA_IPC) | TS_MEM_KIND_BIT(TSHARE_MEM_CUDA_FD) |
                 TS_MEM_KIND_BIT(TSHARE_MEM_CUDA_HELD),
    .frame_types = TS_FRAME_TYPE_BIT(TSHARE_FRAME_EVENT) | TS_FRAME_TYPE_BIT(TSHARE_FRAME_RETIRE) |
                   TS_FRAME_TYPE_BIT(TSHARE_FRAME_CHUNK),
    .mem_kind_name = cuda_mem_kind_name,
    .hello_caps = cuda_hello_caps,
    .peer_gone = cuda_nothing,
    .chan_free = cuda_nothing,
    .on_frame = cuda_on_frame,
    .import = cuda_import,
    .release = cuda_view_release,
    .share_view = cuda_share_view,
};
