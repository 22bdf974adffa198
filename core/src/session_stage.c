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
#include "vec.h"
#include "wire_checks.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Staging buffers a channel keeps before idle ones are let go: a model's
 * tensors each have one, and are written again at every update. */
#define TS_STAGE_KEEP_MAX 4096
/* A share's key is its device address (user space: bit 63 clear), a set
 * memory's its allocation id with bit 63 set: the two never meet. */
#define TS_STAGE_SET_KEY(alloc_id) ((alloc_id) | (UINT64_C(1) << 63))

TS_VEC_DEFINE(ts_stage_vec, tshare_host_buffer *)

typedef struct ts_stage_cache {
  ts_u64map by_key;   /* key -> tshare_host_buffer (the cache's reference) */
  ts_stage_vec busy;  /* buffers replaced while the peer still read them: let go once it is done */
} ts_stage_cache;

/* Bytes of every staging buffer of this process (all channels), kept or
 * still read: bounded by half this machine's memory. */
static _Atomic uint64_t staged_bytes;

/* Asked by every CUDA share and set send: a same-host channel answers from
 * its transport's capabilities alone, before any backend lookup. */
bool ts_stage_applies(tshare_channel *ch) {
  if (ts_conn_caps(&ch->conn) & TS_TRANSPORT_SAME_HOST) return false;
  const ts_backend *host = ts_set_host_backend();
  return host && host->share_remote;
}

/* Whether ch's peer places staged GPU bytes on a GPU (what, "share" or
 * "set", names the call in the error). */
static int peer_takes_staged(tshare_channel *ch, const char *what) {
  if (ch->conn.peer.capabilities & TSHARE_CAP_UCX_STAGED) return TSHARE_OK;
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                 "%s: peer %s does not place GPU memory read over UCX on a GPU (no ucx-staged capability in its "
                 "hello: built without CUDA, no usable GPU there, or an older tshare)",
                 what, ch->conn.peer_label);
}

static uint64_t memory_bytes(void) {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : UINT64_MAX;
}

static void let_go(tshare_host_buffer *buf) {
  atomic_fetch_sub(&staged_bytes, tshare_host_buffer_size(buf));
  tshare_host_buffer_destroy(buf); /* its registration follows, and the peer is told */
}

/* key's buffer out of the cache: let go, or, while the peer still reads it,
 * kept (and counted) until it is done. */
static void forget(ts_stage_cache *c, uint64_t key) {
  tshare_host_buffer *buf = ts_u64map_remove(&c->by_key, key);
  if (!buf) return;
  if (tshare_host_buffer_outstanding(buf) == 0 || ts_stage_vec_push(&c->busy, buf) != TSHARE_OK) let_go(buf);
}

/* Replaced buffers the peer is done with go. */
static void sweep(ts_stage_cache *c) {
  for (size_t i = 0; i < c->busy.len;) {
    if (tshare_host_buffer_outstanding(c->busy.items[i]) != 0) {
      i++;
      continue;
    }
    let_go(c->busy.items[i]);
    ts_stage_vec_remove(&c->busy, i, 1);
  }
}

/* Room for want more bytes: replaced buffers the peer is done with go, and
 * when there are too many buffers or too many bytes, the kept ones nothing
 * reads. False when the bytes still read leave no room. */
static bool make_room(ts_stage_cache *c, uint64_t want) {
  sweep(c);
  uint64_t limit = memory_bytes() / 2;
  if (c->by_key.count < TS_STAGE_KEEP_MAX && atomic_load(&staged_bytes) + want <= limit) return true;
  ts_id_vec idle = {0};
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&c->by_key, &pos, &key, &value);)
    if (tshare_host_buffer_outstanding(value) == 0) (void)ts_id_vec_push(&idle, key);
  for (size_t i = 0; i < idle.len; i++) forget(c, idle.items[i]);
  ts_id_vec_free(&idle);
  return atomic_load(&staged_bytes) + want <= limit;
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
  if (!make_room(c, want))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM,
                   "share: staging %llu bytes of GPU memory for %s: this process's staging buffers would take %llu "
                   "bytes, over half this machine's memory (%llu bytes); wait for the peers' releases",
                   (unsigned long long)want, ch->conn.peer_label,
                   (unsigned long long)(atomic_load(&staged_bytes) + want), (unsigned long long)memory_bytes());
  tshare_error err;
  int rc = tshare_host_buffer_create((size_t)want, "tshare-gpu-staging", &buf, &err);
  if (rc != TSHARE_OK)
    return ts_errf(ch->err, sizeof ch->err, rc, "share: a staging buffer of %llu bytes: %s", (unsigned long long)want,
                   err.message);
  if (ts_u64map_put(&c->by_key, key, buf) != 0) {
    tshare_host_buffer_destroy(buf);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  }
  atomic_fetch_add(&staged_bytes, tshare_host_buffer_size(buf));
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
  int rc = peer_takes_staged(ch, "share"); /* before any copy */
  if (rc != TSHARE_OK) return rc;
  int64_t deadline = ts_deadline(timeout_ms);
  /* Only the bytes the layout touches cross: [begin, end) from ptr. */
  uint64_t begin = 0, end = 0;
  char why[160];
  rc = ts_tensor_check(desc, UINT64_C(1) << 62, &begin, &end, why, sizeof why);
  if (rc != TSHARE_OK) return ts_errf(ch->err, sizeof ch->err, rc, "share: %s", why);
  tshare_host_buffer *buf = NULL;
  rc = stage_take(ch, (uint64_t)(uintptr_t)ptr, end - begin, &buf);
  if (rc == TSHARE_OK && end > begin)
    rc = device->stage_out((const char *)ptr + begin, end - begin, stream, tshare_host_buffer_data(buf),
                           ts_remaining(deadline), ch->err, sizeof ch->err);
  if (rc != TSHARE_OK) return rc;
  tshare_tensor_desc staged = *desc;
  staged.byte_offset -= begin;
  return ts_set_host_backend()->share_remote(ch, buf, &staged, TSHARE_DEVICE_CUDA, tag, user_data,
                                             ts_remaining(deadline), share_id);
}

int ts_stage_set_check(tshare_channel *ch, const ts_set_source *src) {
  const ts_backend *host = ts_set_host_backend();
  if (!src->backend->set_stage_out || !host->set_send_remote)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "set: %s memory cannot be staged for a peer on another host", src->backend->name);
  return peer_takes_staged(ch, "set"); /* offered only beside TSHARE_CAP_UCX_SETS */
}

int ts_stage_set_mem(tshare_channel *ch, const ts_set_source *src, void *stream, tshare_frame *f, ts_keep_ref *hold,
                     int timeout_ms) {
  const ts_backend *host = ts_set_host_backend();
  int64_t deadline = ts_deadline(timeout_ms);
  tshare_host_buffer *buf = NULL;
  int rc = stage_take(ch, TS_STAGE_SET_KEY(src->alloc_id), src->size, &buf);
  if (rc == TSHARE_OK && src->size)
    rc = src->backend->set_stage_out(src, stream, tshare_host_buffer_data(buf), ts_remaining(deadline), ch->err,
                                     sizeof ch->err);
  if (rc != TSHARE_OK) return rc;
  f->u.set.u.mem.device_type = TSHARE_DEVICE_CUDA;
  rc = host->set_send_remote(ch, buf, f, ts_remaining(deadline));
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
  for (size_t pos = 0; ts_u64map_next(&c->by_key, &pos, &key, &value);) let_go(value);
  for (size_t i = 0; i < c->busy.len; i++) let_go(c->busy.items[i]); /* the channel's shares went with it */
  ts_u64map_free(&c->by_key);
  ts_stage_vec_free(&c->busy);
  free(c);
  ch->stages = NULL;
}

void ts_stage_free_in_child(tshare_channel *ch) {
  ts_stage_cache *c = ch->stages;
  if (!c) return;
  ts_u64map_free(&c->by_key); /* the buffers are the parent's */
  ts_stage_vec_free(&c->busy);
  free(c);
  ch->stages = NULL;
}
