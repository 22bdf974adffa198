/* GPU memory staged in host memory for a peer on another host
 * (session_stage.h). The device backend copies the bytes out (its
 * stage_out hooks), the host backend sends the buffer as remote memory (its
 * share_remote and set_send_remote hooks): the session names neither. */
#include "session_stage.h"

#include "error_detail.h"
#include "log.h"
#include "session_set.h"
#include "tshare/hostmem.h"
#include "u64map.h"
#include "wire_checks.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Staging buffers a channel keeps before idle ones are let go: a model's
 * tensors each have one, and are written again at every update. */
#define TS_STAGE_KEEP_MAX 4096
/* A share's key is its device address (user space: bit 63 clear), a set
 * memory's its allocation id with bit 63 set: the two never meet. */
#define TS_STAGE_SET_KEY(alloc_id) ((alloc_id) | (UINT64_C(1) << 63))

typedef struct ts_stage_cache {
  ts_u64map by_key; /* key -> tshare_host_buffer (the cache's reference) */
  uint64_t bytes;   /* of every buffer in it */
} ts_stage_cache;

bool ts_stage_applies(tshare_channel *ch) {
  const ts_backend *host = ts_set_host_backend();
  return !(ts_conn_caps(&ch->conn) & TS_TRANSPORT_SAME_HOST) && host && host->share_remote;
}

static uint64_t memory_bytes(void) {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : UINT64_MAX;
}

static void forget(ts_stage_cache *c, uint64_t key) {
  tshare_host_buffer *buf = ts_u64map_remove(&c->by_key, key);
  if (!buf) return;
  c->bytes -= tshare_host_buffer_size(buf);
  tshare_host_buffer_destroy(buf); /* lives on while a share or set still reads it */
}

/* Too many buffers, or more than half this machine's memory: the ones
 * nothing reads go (their registrations follow, and the peer is told). */
static void trim(ts_stage_cache *c) {
  if (c->by_key.count <= TS_STAGE_KEEP_MAX && c->bytes <= memory_bytes() / 2) return;
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&c->by_key, &pos, &key, &value);) {
    if (tshare_host_buffer_outstanding(value) != 0) continue;
    forget(c, key);
    pos = 0; /* the map moved under the walk */
  }
}

/* The staging buffer for key, of at least size bytes (not wastefully more),
 * that nothing reads now: the one kept for key, or a new one. */
static int stage_take(tshare_channel *ch, uint64_t key, uint64_t size, tshare_host_buffer **out) {
  if (!ch->stages && !(ch->stages = calloc(1, sizeof *ch->stages)))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  ts_stage_cache *c = ch->stages;
  uint64_t want = size ? size : 1;
  tshare_host_buffer *buf = ts_u64map_get(&c->by_key, key);
  if (buf && tshare_host_buffer_outstanding(buf) == 0 && tshare_host_buffer_size(buf) >= want &&
      tshare_host_buffer_size(buf) / 2 <= want) {
    *out = buf;
    return TSHARE_OK;
  }
  forget(c, key); /* in use (its readers keep it) or the wrong size */
  trim(c);
  if (want > memory_bytes())
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM,
                   "share: staging %llu bytes of GPU memory exceeds this machine's memory (%llu bytes)",
                   (unsigned long long)want, (unsigned long long)memory_bytes());
  tshare_error err;
  int rc = tshare_host_buffer_create((size_t)want, "tshare-gpu-staging", &buf, &err);
  if (rc != TSHARE_OK)
    return ts_errf(ch->err, sizeof ch->err, rc, "share: a staging buffer of %llu bytes: %s", (unsigned long long)want,
                   err.message);
  if (ts_u64map_put(&c->by_key, key, buf) != 0) {
    tshare_host_buffer_destroy(buf);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  }
  c->bytes += tshare_host_buffer_size(buf);
  TS_LOG(TS_LOG_DEBUG, "a staging buffer of %zu bytes for %s", tshare_host_buffer_size(buf), ch->conn.peer_label);
  *out = buf;
  return TSHARE_OK;
}

int ts_stage_share(tshare_channel *ch, const ts_backend *device, const void *ptr, const tshare_tensor_desc *desc,
                   void *stream, const char *tag, void *user_data, int timeout_ms, uint64_t *share_id) {
  if (!ptr || !desc)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG, "share: NULL argument");
  if (!device->stage_out)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "share: %s memory cannot be staged for a peer on another host", device->name);
  if (tag && strlen(tag) > TSHARE_TAG_MAX)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_TOO_LARGE, "share: tag of %zu bytes over %d", strlen(tag),
                   TSHARE_TAG_MAX);
  /* Only the bytes the layout touches cross: [begin, end) from ptr. */
  uint64_t begin = 0, end = 0;
  char why[160];
  int rc = ts_tensor_check(desc, UINT64_C(1) << 62, &begin, &end, why, sizeof why);
  if (rc != TSHARE_OK) return ts_errf(ch->err, sizeof ch->err, rc, "share: %s", why);
  tshare_host_buffer *buf = NULL;
  rc = stage_take(ch, (uint64_t)(uintptr_t)ptr, end - begin, &buf);
  if (rc == TSHARE_OK && end > begin)
    rc = device->stage_out((const char *)ptr + begin, end - begin, stream, tshare_host_buffer_data(buf), ch->err,
                           sizeof ch->err);
  if (rc != TSHARE_OK) return rc;
  tshare_tensor_desc staged = *desc;
  staged.byte_offset -= begin;
  return ts_set_host_backend()->share_remote(ch, buf, &staged, TSHARE_DEVICE_CUDA, tag, user_data, timeout_ms,
                                             share_id);
}

int ts_stage_set_check(tshare_channel *ch, const ts_set_source *src) {
  const ts_backend *host = ts_set_host_backend();
  if (!src->backend->set_stage_out || !host->set_send_remote)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "set: %s memory cannot be staged for a peer on another host", src->backend->name);
  if (!(ch->conn.peer.capabilities & TSHARE_CAP_UCX_STAGED) || !(ch->conn.peer.capabilities & TSHARE_CAP_UCX_SETS))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                   "set: peer %s does not place GPU memory read over UCX on a GPU (no ucx-staged capability in its "
                   "hello: built without CUDA, no usable GPU there, or an older tshare)",
                   ch->conn.peer_label);
  return TSHARE_OK;
}

int ts_stage_set_mem(tshare_channel *ch, const ts_set_source *src, void *stream, tshare_frame *f, ts_keep_ref *hold,
                     int timeout_ms) {
  const ts_backend *host = ts_set_host_backend();
  tshare_host_buffer *buf = NULL;
  int rc = stage_take(ch, TS_STAGE_SET_KEY(src->alloc_id), src->size, &buf);
  if (rc == TSHARE_OK && src->size)
    rc = src->backend->set_stage_out(src, stream, tshare_host_buffer_data(buf), ch->err, sizeof ch->err);
  if (rc != TSHARE_OK) return rc;
  f->u.set.u.mem.device_type = TSHARE_DEVICE_CUDA;
  rc = host->set_send_remote(ch, buf, f, timeout_ms);
  if (rc != TSHARE_OK) return rc;
  /* Read by the peer until the set's release: written again only after. */
  host->source_retain(buf);
  *hold = (ts_keep_ref){.retain = host->source_retain, .drop = host->source_release, .keep = buf};
  return TSHARE_OK;
}

void ts_stage_free(tshare_channel *ch) {
  ts_stage_cache *c = ch->stages;
  if (!c) return;
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&c->by_key, &pos, &key, &value);) tshare_host_buffer_destroy(value);
  ts_u64map_free(&c->by_key);
  free(c);
  ch->stages = NULL;
}

void ts_stage_free_in_child(tshare_channel *ch) {
  ts_stage_cache *c = ch->stages;
  if (!c) return;
  ts_u64map_free(&c->by_key); /* the buffers are the parent's */
  free(c);
  ch->stages = NULL;
}
