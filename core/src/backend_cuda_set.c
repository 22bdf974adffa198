/* The CUDA backend's part in tensor sets (backend.h's set hooks). A set's
 * CUDA memory travels as a single share's does (a legacy IPC handle, VMM
 * fds in chunks, a run the consumer keeps mapped), once per allocation
 * however many members point into it; the consumer maps it through the
 * import cache like a share of the set's id. The set is ordered after the
 * producer's stream by one event, recorded once after the last member, and
 * released as one unit: its mappings wait together for the consumer's GPU
 * work. */
#include "backend_cuda.h"
#include "error_detail.h"
#include "log.h"
#include "wire_checks.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- producer ------------------------------------------------------------- */

typedef struct cuda_source {
  ts_set_source head; /* first: freed through its address */
  ts_cuda_export x;   /* the allocation (a VMM run: its chunks as one; fd -1) */
  bool vmm;           /* another allocator's VMM memory: exported anew per send */
  CUdeviceptr ptr;    /* VMM: where the member that found the run starts, */
  uint64_t extent;    /* and how far it reaches */
  tshare_cuda_buffer *buf; /* tshare's own memory: a reference */
  ts_keep_ref keep;        /* foreign memory: a reference of what keeps it alive */
} cuda_source;

static void drop_keep(ts_keep_ref *k) {
  if (k->drop) k->drop(k->keep);
  memset(k, 0, sizeof *k);
}

static void retain_buffer(void *b) { ts_cuda_buffer_retain(b); }

/* tshare's own buffer: checked against the buffer, not just its slab. */
static int own_source(cuda_source *s, tshare_cuda_buffer *buf, const tshare_tensor_desc *desc, uint64_t *offset,
                      ts_keep_ref *member_keep, char *err, size_t cap) {
  char why[160];
  int rc = ts_tensor_check(desc, tshare_cuda_buffer_size(buf), NULL, NULL, why, sizeof why);
  if (rc != TSHARE_OK) return ts_errf(err, cap, rc, "set: %s", why);
  s->x = *ts_cuda_alloc_export(ts_cuda_buffer_alloc(buf));
  s->buf = buf;
  ts_cuda_buffer_retain(buf);
  ts_cuda_buffer_retain(buf); /* the member's */
  *member_keep = (ts_keep_ref){retain_buffer, ts_cuda_buffer_release_cb, buf};
  *offset = ts_cuda_buffer_offset(buf);
  return TSHARE_OK;
}

/* Another allocator's memory at ptr: its allocation (legacy) or the run of
 * VMM chunks the member touches. */
static int foreign_source(cuda_source *s, void *ptr, const tshare_tensor_desc *desc, const ts_keep_ref *user_keep,
                          uint64_t *offset, char *err, size_t cap) {
  CUdeviceptr at = (CUdeviceptr)(uintptr_t)ptr;
  uint64_t span_end = 0;
  char why[160];
  int rc = ts_tensor_check(desc, UINT64_C(1) << 62, NULL, &span_end, why, sizeof why);
  if (rc != TSHARE_OK) return ts_errf(err, cap, rc, "set: %s", why);
  if (ts_cuda_is_foreign_vmm(at)) {
    static _Thread_local ts_vmm_chunks chunks; /* 7 KiB: not on the stack */
    rc = ts_cuda_export_vmm(at, span_end, &s->x, &chunks, err, cap);
    s->vmm = true;
    s->ptr = at;
    s->extent = span_end;
  } else {
    rc = ts_cuda_export_of(at, &s->x, err, cap);
  }
  if (rc != TSHARE_OK) return rc;
  if (user_keep && user_keep->drop) {
    s->keep = *user_keep;
    if (s->keep.retain) s->keep.retain(s->keep.keep);
  }
  *offset = (uint64_t)(at - s->x.base);
  return TSHARE_OK;
}

/* Whether last, the memory of the builder's previous member, is the legacy
 * allocation holding foreign memory at ptr. It is kept alive by that
 * member's keep (the source holds a reference), and CUDA frees no part of an
 * allocation, so an address inside its range still belongs to it: a model
 * packed into one allocation (or a segment's many blocks) is looked up in
 * the driver once, not once per member (five driver calls each). A VMM run
 * covers only the chunks its member touched, so it is looked up anew. */
static bool serves(const ts_set_source *last, void *ptr, const ts_keep_ref *user_keep, uint64_t *offset) {
  if (!last || last->backend != &ts_cuda_backend || !user_keep || !user_keep->drop) return false;
  const cuda_source *s = (const cuda_source *)last;
  CUdeviceptr at = (CUdeviceptr)(uintptr_t)ptr;
  if (s->vmm || s->buf || !s->keep.drop || at < s->x.base || at - s->x.base >= s->x.size) return false;
  *offset = (uint64_t)(at - s->x.base);
  return true;
}

int ts_cuda_set_source_new(void *ptr, void *buf, const tshare_tensor_desc *desc, const ts_keep_ref *user_keep,
                           ts_set_source *last, ts_set_source **out, uint64_t *offset, ts_keep_ref *member_keep,
                           char *err, size_t cap) {
  *out = NULL;
  memset(member_keep, 0, sizeof *member_keep);
  if (!buf && serves(last, ptr, user_keep, offset)) {
    atomic_fetch_add(&last->refs, 1);
    *out = last;
    return TSHARE_OK;
  }
  int status = TSHARE_OK;
  if (!ts_cuda_require(err, cap, &status)) return status;
  cuda_source *s = calloc(1, sizeof *s);
  if (!s) return ts_errf(err, cap, TSHARE_E_NOMEM, "set: out of memory");
  s->x.fd = -1;
  status = buf ? own_source(s, buf, desc, offset, member_keep, err, cap)
               : foreign_source(s, ptr, desc, user_keep, offset, err, cap);
  if (status != TSHARE_OK) {
    ts_cuda_set_source_free(&s->head);
    return status;
  }
  s->head.backend = &ts_cuda_backend;
  atomic_init(&s->head.refs, 1);
  s->head.alloc_id = s->x.buffer_id;
  s->head.size = s->x.size;
  s->head.device = s->x.ordinal;
  *out = &s->head;
  return TSHARE_OK;
}

void ts_cuda_set_source_free(ts_set_source *src) {
  cuda_source *s = (cuda_source *)src;
  if (s->buf) ts_cuda_buffer_release_cb(s->buf);
  drop_keep(&s->keep);
  free(s);
}

int ts_cuda_set_check(tshare_channel *ch, const ts_set_source *src) {
  const cuda_source *s = (const cuda_source *)src;
  uint64_t caps = ch->conn.peer.capabilities;
  if (!(caps & TSHARE_CAP_SET_CUDA) || !(caps & TSHARE_CAP_CUDA_IPC))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                   "set: peer %s does not receive CUDA memory in tensor sets (%s): update its tshare, or share the "
                   "CUDA tensors one by one",
                   ch->conn.peer_label,
                   !(caps & TSHARE_CAP_CUDA_IPC) ? "it was built without CUDA" : "its tshare predates them");
  if ((s->vmm || s->x.fd >= 0) && !ts_cuda_fds_travel(ch))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "set: a CUDA tensor lives in %s, which travels as fds, and %s; %s",
                   s->vmm ? "VMM memory another allocator mapped (PyTorch's expandable segments)"
                          : "a tshare buffer with an fd capability (CUDA VMM)",
                   !(ts_conn_caps(&ch->conn) & TS_TRANSPORT_PASSES_FDS) ? "a pipe channel cannot carry fds"
                                                                          : "the peer cannot import fd handles",
                   s->vmm ? "open a socket channel, or turn expandable segments off in the producer "
                            "(PYTORCH_CUDA_ALLOC_CONF)"
                          : "open a socket channel, or create the buffer with TSHARE_CUDA_HANDLE_LEGACY");
  if (!ts_cuda_chan_of(ch)) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "set: out of memory");
  return TSHARE_OK;
}

/* A segment of another allocator kept alive by s->keep: anchored like a
 * single share's (cuda_anchor.h), so the consumer may keep it mapped. */
static uint32_t anchor_segment(struct ts_cuda_chan *c, const cuda_source *s, ts_keep_ref *hold) {
  if (!s->keep.drop || !s->keep.retain) return 0;
  tshare_drop_fn drop = s->keep.drop;
  void *keep = s->keep.keep;
  s->keep.retain(keep);
  if (!ts_anchor_share(&c->anchors, s->x.buffer_id, &drop, &keep)) {
    drop(keep);
    return 0;
  }
  *hold = (ts_keep_ref){NULL, drop, keep};
  return TSHARE_SHARE_FLAG_RETIRE_NOTICE;
}

/* Another allocator's VMM run: its chunks' fds (watched, as a single
 * share's), or none when the peer keeps the run mapped. */
static int send_vmm(tshare_channel *ch, struct ts_cuda_chan *c, const cuda_source *s, tshare_frame *f,
                    int timeout_ms) {
  static _Thread_local ts_vmm_chunks chunks; /* 7 KiB: not on the stack */
  tshare_set_mem_frame *m = &f->u.set.u.mem;
  ts_cuda_export x;
  int rc = ts_cuda_export_vmm(s->ptr, s->extent, &x, &chunks, ch->err, sizeof ch->err);
  if (rc == TSHARE_OK && x.buffer_id != s->x.buffer_id)
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE,
                 "set: VMM memory at %p was mapped anew since it was added to the set: build the set again",
                 (void *)(uintptr_t)s->ptr);
  bool owned = false, watched = false, held = false;
  if (rc == TSHARE_OK) rc = ts_cuda_vmm_fds(ch, c, x.buffer_id, &chunks, &owned, &watched, &held);
  if (rc != TSHARE_OK) return rc;
  int64_t deadline = ts_deadline(timeout_ms);
  int fd = -1;
  m->share_flags = watched ? TSHARE_SHARE_FLAG_RETIRE_NOTICE : 0;
  /* As a single share offers it (to a set's peer of wire 1.6 or newer):
   * the peer keeps the run mapped and says so, after which the run goes by
   * its id (and a set of it as one frame). */
  if (watched && !held && ch->conn.minor >= 6 && (ch->conn.peer.capabilities & TSHARE_CAP_CUDA_HELD))
    m->share_flags |= TSHARE_SHARE_FLAG_HOLD_OFFER;
  if (held) {
    m->mem_kind = TSHARE_MEM_CUDA_HELD;
  } else {
    m->mem_kind = TSHARE_MEM_CUDA_FD;
    f->flags |= TSHARE_FRAME_FLAG_FD_ATTACHED;
    fd = chunks.fd[0];
    if (chunks.n > 1) {
      m->share_flags |= TSHARE_SHARE_FLAG_CHUNKS;
      rc = ts_cuda_send_chunks(ch, x.buffer_id, &chunks, deadline);
    }
  }
  if (rc == TSHARE_OK) rc = ts_channel_send(ch, f, fd, ts_remaining(deadline));
  if (owned) ts_vmm_chunks_close(&chunks); /* the peer has its own; a watched run keeps them */
  return rc;
}

int ts_cuda_set_send_mem(tshare_channel *ch, const ts_set_source *src, tshare_frame *f, ts_keep_ref *hold,
                         int timeout_ms) {
  const cuda_source *s = (const cuda_source *)src;
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  tshare_set_mem_frame *m = &f->u.set.u.mem;
  memset(hold, 0, sizeof *hold);
  m->alloc_id = s->x.buffer_id;
  m->alloc_size = s->x.size;
  m->device_type = TSHARE_DEVICE_CUDA;
  memcpy(m->device_uuid, s->x.uuid, 16);
  if (s->vmm) return send_vmm(ch, c, s, f, timeout_ms);
  if (s->buf) { /* freed only after the peer closed it */
    int rc = ts_cuda_lend(ch, ts_cuda_buffer_alloc(s->buf));
    if (rc != TSHARE_OK) return rc;
    m->share_flags = TSHARE_SHARE_FLAG_RETIRE_NOTICE;
  } else {
    m->share_flags = anchor_segment(c, s, hold);
  }
  if (s->x.fd >= 0) {
    m->mem_kind = TSHARE_MEM_CUDA_FD;
    f->flags |= TSHARE_FRAME_FLAG_FD_ATTACHED;
  } else {
    m->mem_kind = TSHARE_MEM_CUDA_IPC;
    m->handle_len = TSHARE_HANDLE_MAX;
    memcpy(m->handle, s->x.handle.reserved, TSHARE_HANDLE_MAX);
  }
  return ts_channel_send(ch, f, s->x.fd, timeout_ms);
}

/* Another allocator's cudaMalloc segment: kept by the peer while this end
 * anchors it (cuda_anchor.h) with no retire notice pending. */
static ts_keep_state segment_keep_state(struct ts_cuda_chan *c, const cuda_source *s) {
  if (s->buf || s->x.fd >= 0 || !s->keep.drop || !s->keep.retain) return TS_KEEP_NONE;
  return ts_anchor_held(&c->anchors, s->x.buffer_id) ? TS_KEEP_KEPT : TS_KEEP_OFFERED;
}

ts_keep_state ts_cuda_set_keep_state(tshare_channel *ch, const ts_set_source *src) {
  const cuda_source *s = (const cuda_source *)src;
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  if (c && !s->vmm && ch->conn.minor >= 1) return segment_keep_state(c, s);
  if (!s->vmm || !c || !(ch->conn.peer.capabilities & TSHARE_CAP_CUDA_HELD)) return TS_KEEP_NONE;
  bool watched = false, held = false;
  ts_cuda_run_state(c, s->x.buffer_id, &watched, &held);
  if (!held) return TS_KEEP_OFFERED; /* watched, or to be watched by its first send */
  /* Still the run the peer keeps: memory mapped anew since goes whole (and
   * its send says why). Memory a reference keeps alive (a LibTorch storage)
   * is looked at chunk by chunk, one driver call each: a storage resized to
   * nothing and back may sit at its old address on new chunks. Other memory
   * is exported again (a few calls per chunk, and its extent checked). */
  if (s->keep.drop) return ts_cuda_run_still_mapped(c, s->x.buffer_id) ? TS_KEEP_KEPT : TS_KEEP_NONE;
  static _Thread_local ts_vmm_chunks chunks; /* 7 KiB: not on the stack */
  ts_cuda_export x;
  char err[TSHARE_ERROR_MSG_MAX];
  if (ts_cuda_export_vmm(s->ptr, s->extent, &x, &chunks, err, sizeof err) != TSHARE_OK) return TS_KEEP_NONE;
  return x.buffer_id == s->x.buffer_id ? TS_KEEP_KEPT : TS_KEEP_NONE;
}

int ts_cuda_set_again_hold(tshare_channel *ch, const ts_set_source *src, ts_keep_ref *hold) {
  const cuda_source *s = (const cuda_source *)src;
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  memset(hold, 0, sizeof *hold);
  if (s->vmm || !c || segment_keep_state(c, s) == TS_KEEP_NONE) return TSHARE_OK; /* a watched run needs no hold */
  if (anchor_segment(c, s, hold)) return TSHARE_OK;
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_LIMIT, "set: a CUDA segment could not stay held for the peer (%d "
                 "segments held per channel at most)", ANCHORS_MAX);
}

int ts_cuda_set_order(tshare_channel *ch, const ts_set_source *src, void *stream, tshare_frame *end, ts_export *e,
                      int timeout_ms) {
  const cuda_source *s = (const cuda_source *)src;
  return ts_cuda_order_after(ch, s->x.ctx, stream, timeout_ms, e, &end->flags, &end->u.set.u.end.event_slot,
                             &end->u.set.u.end.event_generation);
}

/* ---- consumer ------------------------------------------------------------- */

int ts_cuda_set_wait(tshare_channel *ch, const tshare_frame *end, void *memory) {
  struct ts_cuda_chan *c = ts_cuda_chan_of(ch);
  if (!c) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  tshare_frame f;
  ts_frame_clear(&f, TSHARE_FRAME_SHARE);
  f.flags = TSHARE_FRAME_FLAG_HAS_EVENT;
  f.u.share.share_id = end->u.set.set_id;
  f.u.share.event_slot = end->u.set.u.end.event_slot;
  f.u.share.event_generation = end->u.set.u.end.event_generation;
  return ts_cuda_wait_on_producer_event(ch, c, ts_cuda_if_loaded(), &f, ts_cuda_import_ctx(memory), NULL);
}

void ts_cuda_memory_ref_locked(tshare_channel *ch, void *memory) {
  (void)ch;
  ts_cuda_import_hold(memory, false);
}

void ts_cuda_memory_unref_locked(tshare_channel *ch, void *memory) {
  (void)ch;
  ts_cuda_import_put(memory);
}

/* Memories mapped in other contexts than the first's (a set over several
 * devices): their default streams are waited for here. */
static void sync_other_contexts(const ts_cuda_api *cu, CUcontext first, void *const *memories, size_t n) {
  for (size_t i = 1; i < n; i++) {
    CUcontext ctx = ts_cuda_import_ctx(memories[i]);
    if (ctx == first || !ts_cuda_push(ctx)) continue;
    cu->cuStreamSynchronize(NULL);
    ts_cuda_pop();
  }
}

static void put_all(void *const *memories, size_t n) {
  for (size_t i = 0; i < n; i++) ts_cuda_import_put(memories[i]);
}

/* The consumer may have queued work on the set's tensors on the default
 * stream: the producer gets the release once it ran (one event for the
 * whole set, its mappings let go of together). set_id 0, a pin's
 * references (the tensors kept past their set's release, with work queued
 * on them since): let go of once that work ran, no release queued. */
ts_release_done ts_cuda_set_release(tshare_channel *ch, void *const *memories, size_t n, uint64_t set_id) {
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  CUcontext ctx = ts_cuda_import_ctx(memories[0]);
  CUevent done = NULL;
  bool idle = true;
  if (cu) sync_other_contexts(cu, ctx, memories, n);
  if (cu && ts_cuda_push(ctx)) {
    idle = cu->cuStreamQuery(NULL) == CUDA_SUCCESS;
    if (!idle) {
      pthread_mutex_lock(&ch->lock);
      done = c ? ts_cuda_spare_take_locked(c, ctx) : NULL;
      pthread_mutex_unlock(&ch->lock);
      if (!done && ts_cuda_event_create(cu, &done, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) done = NULL;
      if (done && cu->cuEventRecord(done, NULL) != CUDA_SUCCESS) {
        ts_cuda_event_destroy(cu, done);
        done = NULL;
      }
    }
    ts_cuda_pop();
  }
  ts_cuda_mapping **more = NULL;
  if (done && n > 1 && (more = malloc((n - 1) * sizeof *more)))
    for (size_t i = 1; i < n; i++) more[i - 1] = memories[i];
  pthread_mutex_lock(&ch->lock);
  bool queued = !idle && !ch->closed && c && done && (n == 1 || more) &&
                ts_cuda_push_drain_locked(c, set_id, done, ctx, memories[0], more, n - 1);
  if (queued) {
    ts_conn_wake(&ch->conn);
  } else {
    free(more);
    if (done) { /* no room to wait later: wait here */
      cu->cuEventSynchronize(done);
      ts_cuda_event_destroy(cu, done);
    } else if (!idle && cu && ts_cuda_push(ctx)) {
      cu->cuStreamSynchronize(NULL);
      ts_cuda_pop();
    }
    put_all(memories, n);
  }
  pthread_mutex_unlock(&ch->lock);
  return queued ? TS_RELEASE_LATER : TS_RELEASE_NOW;
}

/* The whole of src into host memory dst, after the work on stream
 * (staging: session_stage.c). */
int ts_cuda_set_stage_out(const ts_set_source *src, void *stream, void *dst, int timeout_ms, char *err, size_t cap) {
  const cuda_source *cs = (const cuda_source *)src;
  return ts_cuda_stage_out((const void *)(uintptr_t)cs->x.base, src->size, stream, dst, timeout_ms, err, cap);
}
