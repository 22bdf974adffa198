/* Remote host memory over UCX: the backend's table and the producer
 * (backend_ucx.h). A host buffer shared over a UCX channel is registered
 * with ucp_mem_map the first time, its packed rkey travels once in an rkey
 * frame, and every share of it is a frame alone. The registration stays
 * while the buffer lives: a buffer held by nothing but this channel (its
 * creator destroyed it, no share is out) is unregistered, let go, and the
 * peer told to drop its key (a retire frame, FREED, of this memory kind). */
#include "backend_ucx.h"

#include "backend_host.h"
#include "error_detail.h"
#include "log.h"
#include "tshare/cuda.h"
#include "tshare/hostmem.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

ucx_chan *ts_ucx_chan(tshare_channel *ch) { return *ts_backend_data(ch, &ts_ucx_backend); }

bool ts_ucx_carries_host(tshare_channel *ch) {
  ts_ucx_link link;
  return ts_ucx_link_of(&ch->conn, &link);
}

/* ---- producer: registrations --------------------------------------------- */

static void region_free(const ts_ucx_api *ucx, ucx_region *r) {
  if (r->packed) ucx->ucp_rkey_buffer_release(r->packed);
  if (r->memh) ucx->ucp_mem_unmap(ucx->context, r->memh);
  ts_host_buffer_lend_end(r->buf);
  free(r);
}

/* buf's registration for this channel's peer, made on first use. */
static int region_of(tshare_channel *ch, ucx_chan *u, tshare_host_buffer *buf, ucx_region **out) {
  ucx_region *r = ts_u64map_get(&u->regions, tshare_host_buffer_id(buf));
  if (r) {
    *out = r;
    return TSHARE_OK;
  }
  r = calloc(1, sizeof *r);
  if (!r) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  r->buf = buf;
  ts_host_buffer_lend(buf);
  ts_ucp_mem_map_params mp = {.field_mask = TS_UCP_MEM_MAP_PARAM_FIELD_ADDRESS | TS_UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                              .address = tshare_host_buffer_data(buf),
                              .length = tshare_host_buffer_size(buf)};
  ts_ucs_status st = u->ucx->ucp_mem_map(u->ucx->context, &mp, &r->memh);
  if (st == TS_UCS_OK) st = u->ucx->ucp_rkey_pack(u->ucx->context, r->memh, &r->packed, &r->packed_len);
  else r->memh = NULL;
  if (st != TS_UCS_OK || r->packed_len == 0 || r->packed_len > TSHARE_RKEY_MAX) {
    size_t len = r->packed_len;
    region_free(u->ucx, r);
    if (st == TS_UCS_OK)
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                     "share: UCX packed a remote key of %zu bytes (the wire carries 1..%d)", len, TSHARE_RKEY_MAX);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_SYSTEM, "share: registering %zu bytes with UCX failed: %s",
                   tshare_host_buffer_size(buf), ts_ucx_strerror(st));
  }
  if (ts_u64map_put(&u->regions, tshare_host_buffer_id(buf), r) != 0) {
    region_free(u->ucx, r);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  }
  TS_LOG(TS_LOG_DEBUG, "registered host buffer %llu (%zu bytes) for %s, a key of %zu bytes",
         (unsigned long long)tshare_host_buffer_id(buf), tshare_host_buffer_size(buf), ch->conn.peer_label,
         r->packed_len);
  *out = r;
  return TSHARE_OK;
}

/* The rkey frame, once per registration: the shares that follow name it. */
static int send_key(tshare_channel *ch, ucx_region *r, int timeout_ms) {
  if (r->key_sent) return TSHARE_OK;
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RKEY;
  f.u.rkey.alloc_id = tshare_host_buffer_id(r->buf);
  f.u.rkey.address = (uint64_t)(uintptr_t)tshare_host_buffer_data(r->buf);
  f.u.rkey.length = tshare_host_buffer_size(r->buf);
  f.u.rkey.key_len = (uint16_t)r->packed_len;
  memcpy(f.u.rkey.key, r->packed, r->packed_len);
  int rc = ts_channel_send(ch, &f, -1, timeout_ms);
  if (rc == TSHARE_OK) r->key_sent = true;
  return rc;
}

static int share_remote(tshare_channel *ch, ucx_chan *u, tshare_host_buffer *buf, const tshare_tensor_desc *desc,
                        int device_type, const char *tag, void *user_data, int timeout_ms, uint64_t *share_id) {
  if (!(ch->conn.peer.capabilities & TSHARE_CAP_UCX_REMOTE))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                   "share: peer %s does not read remote memory over UCX (no ucx-remote capability in its hello)",
                   ch->conn.peer_label);
  if (ts_host_buffer_unsealed(buf))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "share: the memory is an unsealed file, which its owner may shrink under a remote read: copy it "
                   "into tshare_host_buffer_create() memory");
  int64_t deadline = ts_deadline(timeout_ms);
  ucx_region *r = NULL;
  int rc = region_of(ch, u, buf, &r);
  if (rc == TSHARE_OK) rc = send_key(ch, r, ts_remaining(deadline));
  if (rc != TSHARE_OK) return rc;
  ts_export *e = malloc(sizeof *e);
  if (!e) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  *e = (ts_export){.user_data = user_data, .release = ts_host_buffer_release, .owner = buf};
  ts_host_buffer_retain(buf); /* the share's own hold, until the peer's release */
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SHARE;
  tshare_share_frame *s = &f.u.share;
  s->alloc_id = tshare_host_buffer_id(buf);
  s->mem_kind = TSHARE_MEM_UCX_REMOTE;
  s->device_type = (uint8_t)device_type; /* CUDA: staged GPU bytes, placed on a GPU by the peer */
  s->alloc_size = tshare_host_buffer_size(buf);
  s->tensor = *desc;
  s->tag_len = (uint8_t)(tag ? strlen(tag) : 0);
  if (s->tag_len) memcpy(s->tag, tag, s->tag_len);
  return ts_share_send_export(ch, &f, -1, e, ts_remaining(deadline), share_id);
}

int ts_ucx_share_host(tshare_channel *ch, tshare_host_buffer *buf, const tshare_tensor_desc *desc, int device_type,
                      const char *tag, void *user_data, int timeout_ms, uint64_t *share_id) {
  ucx_chan *u = ts_ucx_chan(ch);
  if (!u || !ts_ucx_carries_host(ch))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "share: the channel has no UCX connection");
  size_t tag_len = tag ? strlen(tag) : 0;
  if (tag_len > TSHARE_TAG_MAX)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_TOO_LARGE, "share: tag of %zu bytes over %d", tag_len,
                   TSHARE_TAG_MAX);
  /* device_type CUDA comes from the session's staging, which checked the peer. */
  return share_remote(ch, u, buf, desc, device_type, tag, user_data, timeout_ms, share_id);
}

/* The host table's share_remote hook. */
int ts_ucx_share_remote(tshare_channel *ch, void *source, const tshare_tensor_desc *desc, int device_type,
                        const char *tag, void *user_data, int timeout_ms, uint64_t *share_id) {
  return ts_ucx_share_host(ch, source, desc, device_type, tag, user_data, timeout_ms, share_id);
}

/* ---- producer: tensor sets --------------------------------------------------- */

int ts_ucx_set_remote_check(tshare_channel *ch, void *source) {
  tshare_host_buffer *buf = source;
  if (!ts_ucx_chan(ch) || !ts_ucx_carries_host(ch))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "set: host memory travels as fds, which a pipe channel cannot carry: open a socket channel");
  if (ch->conn.minor < 6 || !(ch->conn.peer.capabilities & TSHARE_CAP_UCX_SETS))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                   "set: peer %s does not read tensor sets over UCX (it speaks wire %u.%u; sets of remote memory "
                   "need %d.6 or newer): upgrade it, or share the tensors one by one",
                   ch->conn.peer_label, (unsigned)ch->conn.peer.major, (unsigned)ch->conn.peer.minor,
                   TSHARE_WIRE_MAJOR);
  if (ts_host_buffer_unsealed(buf))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "set: a memory is an unsealed file, which its owner may shrink under a remote read: copy it "
                   "into tshare_host_buffer_create() memory");
  return TSHARE_OK;
}

/* The set's memory frame for buf, after its rkey frame (once per
 * registration). The set's own hold keeps buf until the peer's release. */
int ts_ucx_set_send_remote(tshare_channel *ch, void *source, tshare_frame *f, int timeout_ms) {
  tshare_host_buffer *buf = source;
  ucx_chan *u = ts_ucx_chan(ch);
  int64_t deadline = ts_deadline(timeout_ms);
  ucx_region *r = NULL;
  int rc = region_of(ch, u, buf, &r);
  if (rc == TSHARE_OK) rc = send_key(ch, r, ts_remaining(deadline));
  if (rc != TSHARE_OK) return rc;
  tshare_set_mem_frame *m = &f->u.set.u.mem;
  f->flags = 0;
  m->alloc_id = tshare_host_buffer_id(buf);
  m->mem_kind = TSHARE_MEM_UCX_REMOTE;
  if (m->device_type != TSHARE_DEVICE_CUDA) m->device_type = TSHARE_DEVICE_CPU; /* CUDA: staged by the session */
  m->alloc_size = tshare_host_buffer_size(buf);
  m->share_flags = 0;
  return ts_channel_send(ch, f, -1, ts_remaining(deadline));
}

/* Buffers nothing but this channel holds: unregistered and let go, the
 * peer told to drop their keys. */
static void retire_unused(ucx_chan *u) {
  uint64_t generation = ts_host_buffers_unused_generation();
  if (generation == u->unused_seen) return;
  u->unused_seen = generation;
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&u->regions, &pos, &key, &value);) {
    ucx_region *r = value;
    if (!ts_host_buffer_only_lent(r->buf)) continue;
    bool told = r->key_sent;
    ts_u64map_remove(&u->regions, key);
    pos = 0; /* the map moved under the walk */
    region_free(u->ucx, r);
    if (told && ts_id_vec_push(&u->retired, key) != TSHARE_OK)
      TS_LOG(TS_LOG_WARN, "out of memory: the peer keeps the key of buffer %llu", (unsigned long long)key);
  }
}

static int ucx_housekeeping(tshare_channel *ch, int64_t deadline, ts_backend_wait *wait) {
  *wait = TS_BACKEND_IDLE;
  ucx_chan *u = ts_ucx_chan(ch);
  if (!u) return TSHARE_OK;
  ts_ucx_fetch_trim(ch, u);
  *wait = ts_ucx_device_reap(ch, u); /* GPU landings released while the GPU still used them */
  if (!ts_ucx_carries_host(ch)) return TSHARE_OK; /* nothing registered: the channel is not over UCX */
  retire_unused(u);
  int rc = u->retired.len ? ts_retire_send_ids(ch, TSHARE_RETIRE_FREED, TSHARE_MEM_UCX_REMOTE, &u->retired,
                                              ts_remaining(deadline))
                          : TSHARE_OK;
  if (rc == TSHARE_E_PEER_CLOSED) { /* nobody is left to tell; the receive reports the end */
    u->retired.len = 0;
    return TSHARE_OK;
  }
  return rc;
}

/* ---- frames ---------------------------------------------------------------- */

/* An rkey frame, or a retire frame of this memory kind: the producer let
 * go of those regions, their keys go. */
static int ucx_on_frame(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost) {
  (void)fd_lost;
  if (fd >= 0) close(fd);
  if (f->type == TSHARE_FRAME_RKEY) return ts_ucx_on_rkey(ch, f);
  ucx_chan *u = ts_ucx_chan(ch);
  ts_ucx_link link;
  if (f->u.retire.closed != TSHARE_RETIRE_FREED)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "retire: remote memory is only ever freed (closed %u)",
                   (unsigned)f->u.retire.closed);
  if (!u || !ts_ucx_link_of(&ch->conn, &link)) return TSHARE_OK;
  pthread_mutex_lock(link.lock);
  for (uint32_t i = 0; i < f->u.retire.count; i++) ts_ucx_drop_remote_locked(u, &link, f->u.retire.alloc_ids[i]);
  pthread_mutex_unlock(link.lock);
  return TSHARE_OK;
}

/* ---- the channel ----------------------------------------------------------- */

static int ucx_chan_init(tshare_channel *ch) {
  /* UCX is loaded only where a ucx:// address opened the channel: the
   * backend's state exists on those channels alone. */
  ts_ucx_link link;
  if (!ts_ucx_link_of(&ch->conn, &link)) return TSHARE_OK;
  const ts_ucx_api *ucx = ts_ucx(NULL, NULL);
  if (!ucx) return TSHARE_OK;
  ucx_chan *u = calloc(1, sizeof *u);
  if (!u) return TSHARE_E_NOMEM;
  u->ucx = ucx;
  *ts_backend_data(ch, &ts_ucx_backend) = u;
  return TSHARE_OK;
}

static void ucx_peer_gone(tshare_channel *ch) {
  ucx_chan *u = ts_ucx_chan(ch);
  if (!u) return;
  u->retired.len = 0;
  ts_ucx_fetch_peer_gone(ch, u); /* rkeys go while their endpoint still exists */
}

/* After the connection closed (its worker is gone: no read of the peer's
 * can be served any more), what was registered is let go. */
static void ucx_chan_free(tshare_channel *ch) {
  void **slot = ts_backend_data(ch, &ts_ucx_backend);
  ucx_chan *u = *slot;
  if (!u) return;
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&u->regions, &pos, &key, &value);) region_free(u->ucx, value);
  ts_u64map_free(&u->regions);
  ts_id_vec_free(&u->retired);
  ts_ucx_fetch_free(u);
  free(u);
  *slot = NULL;
}

/* A forked child's copy: the registrations and buffers are its parent's. */
static void ucx_chan_free_in_child(tshare_channel *ch) { *ts_backend_data(ch, &ts_ucx_backend) = NULL; }

static uint64_t ucx_hello_caps(uint32_t transport_caps) {
  /* Offered where fds cannot travel to another host; a share checks that the channel is
   * really over UCX before it goes this way. */
  if (transport_caps & (TS_TRANSPORT_PASSES_FDS | TS_TRANSPORT_SAME_HOST)) return 0;
  uint64_t caps = TSHARE_CAP_UCX_REMOTE | TSHARE_CAP_TENSOR_SETS | TSHARE_CAP_UCX_SETS; /* sets of remote memory */
  /* GPU bytes staged by the peer are placed on a GPU only where one is usable. */
  return ts_ucx_device_offered() ? caps | TSHARE_CAP_UCX_STAGED : caps;
}

/* Staged GPU bytes land on the receiving thread's device (peeked before the
 * receive, which may name another stream's). */
static int ucx_device_of(const tshare_share_frame *s) {
  return s->device_type == TSHARE_DEVICE_CUDA ? ts_ucx_device_target(NULL) : -1;
}

static const char *ucx_mem_kind_name(int mem_kind) {
  (void)mem_kind;
  return "memory read over UCX";
}

/* A view read over UCX shared on: what landed here is this process's own
 * memory (a tshare host or CUDA buffer), shared as such; the new share holds
 * that buffer, so the view itself is let go at once. */
static int ucx_share_view(tshare_channel *ch, tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                          const char *tag, ts_export *e, int timeout_ms, uint64_t *share_id) {
  ucx_landing *l = v->memory;
  void *user_data = e->user_data;
  int rc = TSHARE_OK;
  if (!l || l->remote)
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                 "share: a remote view has no bytes here: read them (tshare_view_read) into memory of this process's "
                 "and share that");
  else if (desc->byte_offset < l->begin)
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_OUT_OF_BOUNDS,
                 "share: the layout starts at byte %llu, before the %llu the view holds",
                 (unsigned long long)desc->byte_offset, (unsigned long long)l->begin);
  if (rc != TSHARE_OK) {
    ts_export_drop(e);
    return rc;
  }
  tshare_tensor_desc here = *desc;
  here.byte_offset -= l->begin; /* relative to what landed here */
  rc = l->on_device ? tshare_share_cuda_buffer(ch, l->cuda_buf, &here, stream, tag, user_data, timeout_ms, share_id)
                    : tshare_share_host(ch, l->buf, &here, tag, user_data, timeout_ms, share_id);
  ts_export_drop(e); /* the view's hold: the new share holds the buffer itself */
  return rc;
}

const ts_backend ts_ucx_backend = {
    .name = "ucx",
    .mem_kinds = TS_MEM_KIND_BIT(TSHARE_MEM_UCX_REMOTE),
    .frame_types = TS_FRAME_TYPE_BIT(TSHARE_FRAME_RKEY),
    .views_are_copies = true,
    .mem_kind_name = ucx_mem_kind_name,
    .device_of = ucx_device_of,
    .hello_caps = ucx_hello_caps,
    .chan_init = ucx_chan_init,
    .peer_gone = ucx_peer_gone,
    .chan_free = ucx_chan_free,
    .chan_free_in_child = ucx_chan_free_in_child,
    .on_frame = ucx_on_frame,
    .housekeeping = ucx_housekeeping,
    .import = ts_ucx_import,
    .import_in_set = ts_ucx_import_in_set,
    .import_remote = ts_ucx_import_remote,
    .read_remote = ts_ucx_read_remote,
    .memory_host_buffer = ts_ucx_memory_host_buffer,
    .release = ts_ucx_release,
    .share_view = ucx_share_view,
    .memory_ref_locked = ts_ucx_memory_ref_locked,
    .memory_unref_locked = ts_ucx_memory_unref_locked,
};
