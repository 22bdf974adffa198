/* Remote host memory over UCX, the consumer's "fetch" mode
 * (backend_ucx.h): the rkey frame's key is unpacked once per allocation;
 * each share's bytes are read with ucp_get_nbx into a landing buffer of
 * this process's (registered, pooled per channel), and the share is
 * released at once: the view is a copy, and the producer's memory is free
 * for its next use as soon as the bytes are here.
 *
 * Trust: what the peer says of its memory (the region, the share's layout)
 * only decides what is read from the peer; what is written here is bounded
 * by the landing buffer, sized from the share's checked layout. */
#include "backend_ucx.h"

#include "backend_host.h"
#include "error_detail.h"
#include "log.h"
#include "wire_checks.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define UCX_FETCH_TIMEOUT_MS 30000 /* a read the peer's worker does not serve in this time fails the share */
#define UCX_IDLE_LANDINGS 4        /* landing buffers kept for reuse per channel */
/* ucp_ep_rkey_unpack takes no length: it reads as far as the key's own
 * fields say. A key is unpacked from a zeroed copy this much longer than
 * any key, so that what a malformed one makes UCX read is ours. */
#define UCX_KEY_READ_MAX (64u << 10)

/* ---- keys ------------------------------------------------------------------ */

void ts_ucx_drop_remote_locked(ucx_chan *u, const ts_ucx_link *link, uint64_t alloc_id) {
  (void)link; /* held: rkeys belong to its endpoint */
  ucx_remote *r = ts_u64map_remove(&u->remotes, alloc_id);
  if (!r) return;
  if (r->rkey) u->ucx->ucp_rkey_destroy(r->rkey);
  free(r);
}

int ts_ucx_on_rkey(tshare_channel *ch, const tshare_frame *f) {
  const tshare_rkey_frame *k = &f->u.rkey;
  ucx_chan *u = ts_ucx_chan(ch);
  ts_ucx_link link;
  if (!u || !ts_ucx_link_of(&ch->conn, &link))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "receive: an rkey frame on a channel not over UCX");
  ucx_remote *r = calloc(1, sizeof *r);
  if (!r) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  r->address = k->address;
  r->length = k->length;
  uint8_t *key = calloc(1, UCX_KEY_READ_MAX);
  if (!key) {
    free(r);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  }
  memcpy(key, k->key, k->key_len);
  pthread_mutex_lock(link.lock);
  ts_ucx_drop_remote_locked(u, &link, k->alloc_id); /* a region that changed replaces the old one */
  ts_ucs_status st = u->ucx->ucp_ep_rkey_unpack(link.ep, key, &r->rkey);
  if (st == TS_UCS_OK && ts_u64map_put(&u->remotes, k->alloc_id, r) != 0) {
    u->ucx->ucp_rkey_destroy(r->rkey);
    st = TS_UCS_ERR_LAST; /* out of memory, said below */
  }
  pthread_mutex_unlock(link.lock);
  free(key);
  if (st == TS_UCS_OK) return TSHARE_OK;
  free(r);
  /* The shares that name this allocation are refused when they come: the
   * channel goes on. */
  TS_LOG(TS_LOG_WARN, "%s sent an rkey for allocation %llu that UCX cannot unpack (%u bytes): %s", ch->conn.peer_label,
         (unsigned long long)k->alloc_id, (unsigned)k->key_len,
         st == TS_UCS_ERR_LAST ? "out of memory" : ts_ucx_strerror(st));
  return TSHARE_OK;
}

/* ---- landing buffers ------------------------------------------------------ */

/* The registration and this landing's reference go; the memory lives on
 * while a share or a set builder of this process holds its buffer. */
static void landing_free(const ts_ucx_api *ucx, ucx_landing *l) {
  if (l->memh) ucx->ucp_mem_unmap(ucx->context, l->memh);
  tshare_host_buffer_destroy(l->buf);
  free(l);
}

/* An idle landing buffer of at least size bytes (and not wastefully more),
 * or a new one, registered so that UCX reads straight into it. */
static int landing_take(tshare_channel *ch, ucx_chan *u, size_t size, ucx_landing **out) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t want = size ? (size + page - 1) / page * page : page;
  pthread_mutex_lock(&ch->lock);
  for (size_t i = 0; i < u->idle.len; i++) {
    ucx_landing *l = u->idle.items[i];
    if (l->size >= want && l->size / 2 <= want) {
      ucx_landing_vec_remove(&u->idle, i, 1);
      l->refs = 1;
      pthread_mutex_unlock(&ch->lock);
      *out = l;
      return TSHARE_OK;
    }
  }
  pthread_mutex_unlock(&ch->lock);
  /* Checked before mapping: with overcommit, a mapping of any size may
   * succeed, and the get would then pull that much from the peer. */
  long pages = sysconf(_SC_PHYS_PAGES);
  if (pages > 0 && want / page > (size_t)pages)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM,
                   "import: a landing buffer of %zu bytes exceeds this machine's memory (%zu bytes)", want,
                   (size_t)pages * page);
  ucx_landing *l = calloc(1, sizeof *l);
  if (!l) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "import: out of memory");
  tshare_error err;
  int rc = tshare_host_buffer_create(want, "tshare-ucx-landing", &l->buf, &err);
  if (rc != TSHARE_OK) {
    free(l);
    return ts_errf(ch->err, sizeof ch->err, rc, "import: a landing buffer of %zu bytes: %s", want, err.message);
  }
  l->base = tshare_host_buffer_data(l->buf);
  l->size = tshare_host_buffer_size(l->buf);
  l->refs = 1;
  ts_ucp_mem_map_params mp = {.field_mask = TS_UCP_MEM_MAP_PARAM_FIELD_ADDRESS | TS_UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                              .address = l->base,
                              .length = l->size};
  if (u->ucx->ucp_mem_map(u->ucx->context, &mp, &l->memh) != TS_UCS_OK) l->memh = NULL; /* UCX copies then */
  *out = l;
  return TSHARE_OK;
}

/* A landing buffer nothing here reads any more: reused for the next fetch,
 * unless its buffer was shared on (a share or a set builder holds it: the
 * next fetch must not write under its readers). */
static void landing_give_back_locked(ucx_chan *u, ucx_landing *l) {
  if (ts_host_buffer_held_by_others(l->buf) || ucx_landing_vec_push(&u->idle, l) != TSHARE_OK) landing_free(u->ucx, l);
}

void ts_ucx_fetch_trim(tshare_channel *ch, ucx_chan *u) {
  for (;;) {
    pthread_mutex_lock(&ch->lock);
    ucx_landing *l = NULL;
    if (u->idle.len > UCX_IDLE_LANDINGS) {
      l = u->idle.items[0];
      ucx_landing_vec_remove(&u->idle, 0, 1);
    }
    pthread_mutex_unlock(&ch->lock);
    if (!l) return;
    landing_free(u->ucx, l);
  }
}

/* ---- the read ------------------------------------------------------------- */

int64_t ts_ucx_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Read len bytes at the peer's address into dst (link's lock held).
 * TS_UCS_OK, UCX's error, or TS_UCS_INPROGRESS when the peer did not serve
 * it in time: dst may then still be written, and must be kept. */
static ts_ucs_status get_locked(tshare_channel *ch, const ts_ucx_api *ucx, const ts_ucx_link *link, void *dst,
                                size_t len, uint64_t address, ts_ucp_rkey_h rkey, int64_t until) {
  ts_ucp_request_param p = {0};
  void *req = ucx->ucp_get_nbx(link->ep, dst, len, address, rkey, &p);
  if (!req) return TS_UCS_OK;
  if (TS_UCS_PTR_IS_ERR(req)) return TS_UCS_PTR_STATUS(req);
  ts_ucs_status st;
  while ((st = ucx->ucp_request_check_status(req)) == TS_UCS_INPROGRESS) {
    if (ts_ucx_peer_failed_locked(&ch->conn) || ts_ucx_now_ms() > until) break;
    if (!ucx->ucp_worker_progress(link->worker)) {
      /* Writers of other threads get their turn; no yield: a read of a few
       * KiB takes microseconds, a yield on a busy machine a time slice. */
      pthread_mutex_unlock(link->lock);
      pthread_mutex_lock(link->lock);
    }
  }
  ucx->ucp_request_free(req); /* a request still in progress completes on its own, into dst */
  return st;
}

ts_ucs_status ts_ucx_get_remote_until(tshare_channel *ch, ucx_chan *u, const ts_ucx_link *link, uint64_t alloc_id,
                                      uint64_t address, void *dst, size_t len, int64_t until) {
  if (len == 0) return TS_UCS_OK;
  pthread_mutex_lock(link->lock);
  const ucx_remote *now = ts_u64map_get(&u->remotes, alloc_id); /* still there: only this thread drops keys */
  ts_ucs_status st = now ? get_locked(ch, u->ucx, link, dst, len, address, now->rkey, until) : TS_UCS_ERR_NO_ELEM;
  pthread_mutex_unlock(link->lock);
  return st;
}

ts_ucs_status ts_ucx_get_remote(tshare_channel *ch, ucx_chan *u, const ts_ucx_link *link, uint64_t alloc_id,
                                uint64_t address, void *dst, size_t len) {
  return ts_ucx_get_remote_until(ch, u, link, alloc_id, address, dst, len, ts_ucx_now_ms() + UCX_FETCH_TIMEOUT_MS);
}

/* The bytes of share s that its layout touches, [*begin, *end) of the
 * allocation, and the region its key reads: checked against each other. */
static int fetch_span(tshare_channel *ch, const tshare_share_frame *s, const ucx_remote *r, uint64_t *begin,
                      uint64_t *end) {
  char why[160];
  int rc = ts_tensor_check(&s->tensor, s->alloc_size, begin, end, why, sizeof why);
  if (rc != TSHARE_OK)
    return ts_errf(ch->err, sizeof ch->err, rc, "import: share %llu: %s", (unsigned long long)s->share_id, why);
  if (s->alloc_size > r->length)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_OUT_OF_BOUNDS,
                   "import: share %llu claims %llu bytes of allocation %llu, whose registered region has %llu",
                   (unsigned long long)s->share_id, (unsigned long long)s->alloc_size,
                   (unsigned long long)s->alloc_id, (unsigned long long)r->length);
  if (*end - *begin > SIZE_MAX / 2)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_TOO_LARGE, "import: share %llu spans %llu bytes",
                   (unsigned long long)s->share_id, (unsigned long long)(*end - *begin));
  return TSHARE_OK;
}

/* The peer's region for s's allocation, copied out (false: no usable key
 * came for it). */
static bool remote_of(ucx_chan *u, const ts_ucx_link *link, uint64_t alloc_id, ucx_remote *out) {
  pthread_mutex_lock(link->lock);
  ucx_remote *r = ts_u64map_get(&u->remotes, alloc_id);
  if (r) *out = *r;
  pthread_mutex_unlock(link->lock);
  return r != NULL;
}

/* len bytes at the peer's address (allocation alloc_id, for share_id's
 * sake) into a landing buffer, *out. */
static int read_into_landing(tshare_channel *ch, ucx_chan *u, const ts_ucx_link *link, uint64_t share_id,
                             uint64_t alloc_id, uint64_t address, size_t len, ucx_landing **out) {
  ucx_landing *l = NULL;
  int rc = landing_take(ch, u, len, &l);
  if (rc != TSHARE_OK) return rc;
  ts_ucs_status st = ts_ucx_get_remote(ch, u, link, alloc_id, address, l->base, len);
  if (st == TS_UCS_INPROGRESS) {
    if (ucx_landing_vec_push(&u->stranded, l) != TSHARE_OK) TS_LOG(TS_LOG_WARN, "a landing buffer is leaked");
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_CLOSED,
                   "import: reading share %llu from %s did not finish in %d ms (the peer's process must drive its "
                   "channel for its memory to be read over TCP)",
                   (unsigned long long)share_id, ch->conn.peer_label, UCX_FETCH_TIMEOUT_MS);
  }
  if (st != TS_UCS_OK) {
    pthread_mutex_lock(&ch->lock);
    landing_give_back_locked(u, l);
    pthread_mutex_unlock(&ch->lock);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_CLOSED, "import: reading share %llu from %s failed: %s",
                   (unsigned long long)share_id, ch->conn.peer_label, ts_ucx_strerror(st));
  }
  *out = l;
  return TSHARE_OK;
}

/* Bytes [begin, end) of share s's allocation (region r) into a new landing
 * buffer, *out: host memory, or GPU memory (for work on stream) where the
 * peer staged GPU bytes. */
static int fetch_span_into(tshare_channel *ch, ucx_chan *u, const ts_ucx_link *link, const tshare_share_frame *s,
                           const ucx_remote *r, uint64_t begin, uint64_t end, void *stream, ucx_landing **out) {
  if (s->device_type == TSHARE_DEVICE_CUDA) /* GPU bytes the peer staged: placed on a GPU here */
    return ts_ucx_device_land(ch, u, link, s->alloc_id, r->address + begin, end - begin, stream, out);
  return read_into_landing(ch, u, link, s->share_id, s->alloc_id, r->address + begin, (size_t)(end - begin), out);
}

static int no_key(tshare_channel *ch, const tshare_share_frame *s) {
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                 "import: share %llu names allocation %llu, for which no usable rkey came",
                 (unsigned long long)s->share_id, (unsigned long long)s->alloc_id);
}

/* Where a landing's bytes are in this process, and on which device. */
static void view_of_landing(tshare_view *v, ucx_landing *l, void *stream) {
  v->memory = l;
  if (!l->on_device) {
    v->data = l->base;
    return;
  }
  v->data = (void *)(uintptr_t)l->device_ptr;
  v->ctx = l->ctx;
  v->device = l->device;
  v->stream = stream;
}

/* The share's bytes into a landing buffer: v->memory, v->data. */
static int fetch(tshare_channel *ch, ucx_chan *u, const ts_ucx_link *link, const tshare_share_frame *s, void *stream,
                 tshare_view *v) {
  ucx_remote r;
  if (!remote_of(u, link, s->alloc_id, &r)) return no_key(ch, s);
  uint64_t begin = 0, end = 0;
  ucx_landing *l = NULL;
  int rc = fetch_span(ch, s, &r, &begin, &end);
  if (rc == TSHARE_OK) rc = fetch_span_into(ch, u, link, s, &r, begin, end, stream, &l);
  if (rc != TSHARE_OK) return rc;
  l->begin = begin; /* where its first byte is in the producer's allocation */
  view_of_landing(v, l, stream);
  if (end > begin) v->data = (char *)v->data + (s->tensor.byte_offset - begin); /* an empty tensor: no byte */
  return TSHARE_OK;
}

/* The channel's UCX state and link for remote memory s (a share, or a
 * set's memory under the set's id), or the peer's error: remote memory on a
 * channel that is not over UCX. */
static int over_ucx(tshare_channel *ch, const tshare_share_frame *s, ucx_chan **u, ts_ucx_link *link) {
  *u = ts_ucx_chan(ch);
  if (*u && ts_ucx_link_of(&ch->conn, link)) return TSHARE_OK;
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                 "import: share or set %llu is remote memory on a channel not over UCX",
                 (unsigned long long)s->share_id);
}

int ts_ucx_import(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, tshare_view *v) {
  (void)fdp;
  const tshare_share_frame *s = &f->u.share;
  ucx_chan *u;
  ts_ucx_link link;
  int rc = over_ucx(ch, s, &u, &link);
  if (rc == TSHARE_OK) rc = fetch(ch, u, &link, s, stream, v);
  if (rc != TSHARE_OK) return rc;
  /* The bytes are here: the producer may reuse its memory now. */
  ts_share_release_back(ch, s->share_id);
  (void)ts_share_flush_pending(ch, TS_DEADLINE_PASSED);
  return TSHARE_OK;
}

/* Remote mode: where the share's bytes are, checked as a fetch's would be;
 * nothing read, nothing released (the view's release does it). */
int ts_ucx_import_remote(tshare_channel *ch, const tshare_frame *f, tshare_view *v) {
  const tshare_share_frame *s = &f->u.share;
  ucx_chan *u;
  ts_ucx_link link;
  int rc = over_ucx(ch, s, &u, &link);
  if (rc != TSHARE_OK) return rc;
  if (s->device_type != TSHARE_DEVICE_CPU)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "receive: share %llu is GPU memory the peer staged: remote views read host memory; receive it "
                   "with tshare_view_recv() to have it on this end's GPU",
                   (unsigned long long)s->share_id);
  ucx_remote r;
  if (!remote_of(u, &link, s->alloc_id, &r)) return no_key(ch, s);
  uint64_t begin = 0, end = 0;
  rc = fetch_span(ch, s, &r, &begin, &end);
  if (rc != TSHARE_OK) return rc;
  ucx_landing *l = calloc(1, sizeof *l);
  if (!l) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "import: out of memory");
  *l = (ucx_landing){.remote = true, .alloc_id = s->alloc_id, .address = r.address, .begin = begin, .end = end,
                     .origin = s->tensor.byte_offset, .refs = 1};
  v->memory = l;
  v->data = NULL; /* read with tshare_view_read() */
  return TSHARE_OK;
}

/* Bytes [origin + offset, + len) of a remote view, inside its span, through
 * a landing buffer (a read that is never served writes there, not into the
 * caller's dst). */
int ts_ucx_read_remote(tshare_channel *ch, tshare_view *v, int64_t offset, void *dst, size_t len) {
  ucx_landing *at = v->memory;
  ucx_chan *u = ts_ucx_chan(ch);
  ts_ucx_link link;
  if (!at || !at->remote)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG, "read: share %llu is not a remote view",
                   (unsigned long long)v->share_id);
  if (!u || !ts_ucx_link_of(&ch->conn, &link))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_CLOSED, "read: the channel to %s is closed",
                   ch->conn.peer_label);
  /* origin and the span are below 2^62 (checked at import), offset too
   * before it is added: no overflow. */
  bool near = offset >= -(INT64_C(1) << 62) && offset <= (INT64_C(1) << 62);
  int64_t first = near ? (int64_t)at->origin + offset : -1;
  if (!near || first < (int64_t)at->begin || (uint64_t)first > at->end || len > at->end - (uint64_t)first)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_OUT_OF_BOUNDS,
                   "read: %zu bytes at %lld from element 0 of share %llu lie outside the %llu bytes its layout "
                   "touches (%lld to %lld)",
                   len, (long long)offset, (unsigned long long)v->share_id,
                   (unsigned long long)(at->end - at->begin), (long long)at->begin - (long long)at->origin,
                   (long long)at->end - (long long)at->origin);
  if (len == 0) return TSHARE_OK;
  ucx_landing *l = NULL;
  int rc = read_into_landing(ch, u, &link, v->share_id, at->alloc_id, at->address + (uint64_t)first, len, &l);
  if (rc != TSHARE_OK) return rc;
  memcpy(dst, l->base, len);
  pthread_mutex_lock(&ch->lock);
  landing_give_back_locked(u, l);
  pthread_mutex_unlock(&ch->lock);
  return TSHARE_OK;
}

/* A set's memory: the whole allocation (its members are checked against
 * it when they come), bounded with the set's other copies by this
 * machine's memory. The set is released whole once complete. */
int ts_ucx_import_in_set(tshare_channel *ch, const tshare_frame *f, uint64_t *copied, tshare_view *v) {
  const tshare_share_frame *s = &f->u.share;
  ucx_chan *u;
  ts_ucx_link link;
  int rc = over_ucx(ch, s, &u, &link);
  if (rc != TSHARE_OK) return rc;
  ucx_remote r;
  if (!remote_of(u, &link, s->alloc_id, &r)) return no_key(ch, s);
  if (s->alloc_size > r.length)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_OUT_OF_BOUNDS,
                   "import: set %llu claims %llu bytes of allocation %llu, whose registered region has %llu",
                   (unsigned long long)s->share_id, (unsigned long long)s->alloc_size,
                   (unsigned long long)s->alloc_id, (unsigned long long)r.length);
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  long pages = sysconf(_SC_PHYS_PAGES);
  uint64_t want = (s->alloc_size + page - 1) / page * page;
  if (s->device_type != TSHARE_DEVICE_CUDA && pages > 0 && *copied + want > (uint64_t)pages * page)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM,
                   "import: the set's landing buffers would take %llu bytes, over this machine's memory (%llu bytes)",
                   (unsigned long long)(*copied + want), (unsigned long long)pages * page);
  ucx_landing *l = NULL;
  rc = fetch_span_into(ch, u, &link, s, &r, 0, s->alloc_size, NULL, &l);
  if (rc != TSHARE_OK) return rc;
  if (!l->on_device) *copied += want; /* host memory: bounded by this machine's */
  l->begin = 0; /* the whole allocation */
  view_of_landing(v, l, NULL);
  if (!s->alloc_size) v->data = NULL;
  return TSHARE_OK;
}

struct tshare_host_buffer *ts_ucx_memory_host_buffer(void *memory) { return ((ucx_landing *)memory)->buf; }

void ts_ucx_memory_ref_locked(tshare_channel *ch, void *memory) {
  (void)ch;
  ((ucx_landing *)memory)->refs++;
}

/* One reference less; the last one gives a host landing back to the pool
 * and frees GPU memory after the work queued on stream. */
static void unref_locked(tshare_channel *ch, ucx_landing *l, void *stream) {
  ucx_chan *u = ts_ucx_chan(ch);
  if (--l->refs != 0 || !u) return; /* no u: a forked child's copy, its parent's to free */
  if (l->on_device) ts_ucx_device_free_locked(u, l, stream);
  else landing_give_back_locked(u, l);
}

void ts_ucx_memory_unref_locked(tshare_channel *ch, void *memory) { unref_locked(ch, memory, NULL); }

ts_release_done ts_ucx_release(tshare_view *v) {
  tshare_channel *ch = v->ch;
  ucx_landing *l = v->memory;
  if (l && l->remote) { /* nothing here: the producer's memory goes back now */
    free(l);
    return TS_RELEASE_NOW;
  }
  pthread_mutex_lock(&ch->lock);
  if (v->memory) unref_locked(ch, v->memory, v->stream);
  pthread_mutex_unlock(&ch->lock);
  return TS_RELEASE_LATER; /* released when it was fetched */
}

/* ---- the channel ---------------------------------------------------------- */

void ts_ucx_fetch_peer_gone(tshare_channel *ch, ucx_chan *u) {
  ts_ucx_link link;
  bool linked = ts_ucx_link_of(&ch->conn, &link);
  if (linked) pthread_mutex_lock(link.lock);
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&u->remotes, &pos, &key, &value);) {
    ucx_remote *r = value;
    if (linked && r->rkey) u->ucx->ucp_rkey_destroy(r->rkey);
    free(r);
  }
  ts_u64map_free(&u->remotes);
  if (linked) pthread_mutex_unlock(link.lock);
}

void ts_ucx_fetch_free(ucx_chan *u) {
  ts_ucx_device_chan_free(u);
  for (size_t i = 0; i < u->idle.len; i++) landing_free(u->ucx, u->idle.items[i]);
  for (size_t i = 0; i < u->stranded.len; i++) landing_free(u->ucx, u->stranded.items[i]);
  ucx_landing_vec_free(&u->idle);
  ucx_landing_vec_free(&u->stranded);
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&u->remotes, &pos, &key, &value);) free(value); /* their endpoint went */
  ts_u64map_free(&u->remotes);
}
