/* The CUDA backend's producer side: GPU memory shared (tshare's own buffers,
 * another allocator's memory, views shared on) with the event pool that
 * orders the consumer after the producer's stream. */
#include "backend_cuda.h"
#include "session_stage.h"
#include "clock.h"
#include "error_detail.h"
#include "log.h"
#include "wire_checks.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

/* ---- producer ------------------------------------------------------------- */

/* A free event slot in ctx, created and announced to the peer on first use.
 * -1: no slot (another context than the pool's, the pool is full, or the
 * peer predates event frames): the caller syncs the stream instead. */
static int pool_take(tshare_channel *ch, struct ts_cuda_chan *c, CUcontext ctx, int timeout_ms, int *status) {
  *status = TSHARE_OK;
  if (ch->conn.minor < 1) return -1;
  if (!c->pool_ctx) c->pool_ctx = ctx;
  if (c->pool_ctx != ctx) return -1;
  for (uint32_t i = 0; i < c->nslots; i++)
    if (!c->busy[i]) return (int)i;
  if (c->nslots == POOL_MAX) return -1;
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  CUevent ev;
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_EVENT;
  f.u.event.slot = c->nslots;
  CUresult rc = ts_cuda_event_create(cu, &ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
  if (rc == CUDA_SUCCESS) {
    CUipcEventHandle h;
    rc = cu->cuIpcGetEventHandle(&h, ev);
    if (rc != CUDA_SUCCESS) ts_cuda_event_destroy(cu, ev);
    memcpy(f.u.event.handle, h.reserved, TSHARE_HANDLE_MAX);
  }
  if (rc != CUDA_SUCCESS) {
    *status = ts_cuda_fail(ch->err, sizeof ch->err, "share: creating an inter-process event", rc);
    return -1;
  }
  *status = ts_channel_send(ch, &f, -1, timeout_ms);
  if (*status != TSHARE_OK) {
    ts_cuda_event_destroy(cu, ev);
    return -1;
  }
  c->pool[c->nslots] = ev;
  return (int)c->nslots++;
}

/* A share that held an event slot was released or dropped. */
void ts_cuda_export_done(tshare_channel *ch, const ts_export *e) {
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  if (c && e->backend_slot >= 0 && e->backend_slot < POOL_MAX) c->busy[e->backend_slot] = false;
}

static int check_can_share(tshare_channel *ch, const char *tag) {
  if (!ch) return TSHARE_E_INVALID_ARG;
  if (ch->closed || ch->conn.wfd < 0)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "share: channel is closed");
  if (!(ts_conn_caps(&ch->conn) & TS_TRANSPORT_SAME_HOST))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "share: GPU memory cannot reach peer %s: its channel may cross hosts, and CUDA handles open only "
                   "on the machine that made them",
                   ch->conn.peer_label);
  if (!(ch->conn.peer.capabilities & TSHARE_CAP_CUDA_IPC))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                   "share: peer %s was built without CUDA and cannot import GPU memory", ch->conn.peer_label);
  if (tag && strlen(tag) > TSHARE_TAG_MAX)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_TOO_LARGE, "share: tag of %zu bytes over %d", strlen(tag),
                   TSHARE_TAG_MAX);
  if (!ts_cuda_chan_of(ch)) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  return TSHARE_OK;
}

/* Whether GPU memory that travels as fds can reach the peer. */
bool ts_cuda_fds_travel(const tshare_channel *ch) {
  return (ts_conn_caps(&ch->conn) & TS_TRANSPORT_PASSES_FDS) && (ch->conn.peer.capabilities & TSHARE_CAP_CUDA_FD);
}

/* Chunks 1..n-1 of VMM memory, each with its fd, before the share that
 * carries chunk 0: the consumer maps them side by side. */
int ts_cuda_send_chunks(tshare_channel *ch, uint64_t alloc_id, const ts_vmm_chunks *chunks, int64_t deadline) {
  for (int i = 1; i < chunks->n; i++) {
    tshare_frame f;
    memset(&f, 0, sizeof f);
    f.type = TSHARE_FRAME_CHUNK;
    f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
    f.u.chunk.alloc_id = alloc_id;
    f.u.chunk.index = (uint32_t)i;
    f.u.chunk.count = (uint32_t)chunks->n;
    f.u.chunk.size = chunks->size[i];
    int rc = ts_channel_send(ch, &f, chunks->fd[i], ts_remaining(deadline));
    if (rc != TSHARE_OK) return rc;
  }
  return TSHARE_OK;
}

/* Order the consumer after the work queued on stream (of ctx) so far:
 * nothing when it is idle, else an event of the pool (recorded; its slot in
 * e, the frame's flags and *slot / *generation), else a host sync. Returns
 * the status. */
int ts_cuda_order_after(tshare_channel *ch, CUcontext ctx, void *stream, int timeout_ms, ts_export *e,
                        uint8_t *frame_flags, uint32_t *slot_out, uint32_t *generation) {
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  e->backend = NULL;
  int status = TSHARE_OK;
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  CUresult rc = CUDA_SUCCESS;
  if (!cu || !ts_cuda_push(ctx)) {
    status = ts_errf(ch->err, sizeof ch->err, TSHARE_E_CUDA, "share: cannot enter the memory's context");
  } else if ((rc = cu->cuStreamQuery((CUstream)stream)) == CUDA_SUCCESS) {
    /* The work that wrote the tensor has finished: nothing to order the
     * consumer after, so no event (and no slot) at all. */
    ts_cuda_pop();
  } else {
    rc = CUDA_SUCCESS;
    int slot = pool_take(ch, c, ctx, timeout_ms, &status);
    if (status == TSHARE_OK && slot >= 0) {
      /* The consumer's stream waits for this point of ours: no host sync. */
      rc = cu->cuEventRecord(c->pool[slot], (CUstream)stream);
      if (rc == CUDA_SUCCESS) {
        c->busy[slot] = true;
        e->backend = &ts_cuda_backend; /* its export_done frees the slot */
        e->backend_slot = slot;
        *frame_flags |= TSHARE_FRAME_FLAG_HAS_EVENT;
        *slot_out = (uint32_t)slot;
        *generation = ++c->gen[slot];
      }
    } else if (status == TSHARE_OK) {
      rc = cu->cuStreamSynchronize((CUstream)stream);
      pthread_mutex_lock(&ts_cuda_lock);
      ts_cuda_counters.host_syncs++;
      pthread_mutex_unlock(&ts_cuda_lock);
    }
    ts_cuda_pop();
    if (status == TSHARE_OK && rc != CUDA_SUCCESS)
      status = ts_cuda_fail(ch->err, sizeof ch->err,
                            "share: ordering on the stream (is it a stream of the memory's device?)", rc);
  }
  return status;
}

/* Fill and send the share (chunks: another allocator's VMM memory, else
 * NULL; held: VMM memory the peer keeps mapped, named by its id alone, no
 * chunks, no fd); e
 * (release, owner, user_data set) is consumed. */
static int send_cuda_share(tshare_channel *ch, const ts_cuda_export *x, const ts_vmm_chunks *chunks, bool held,
                           uint64_t offset, uint32_t origin_pid, uint32_t flags, const tshare_tensor_desc *desc,
                           void *stream, const char *tag, ts_export *e, int timeout_ms, uint64_t *share_id) {
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  int fd = held ? -1 : x->fd; /* memory the peer keeps mapped travels without it */
  if ((chunks || fd >= 0) && !ts_cuda_fds_travel(ch)) {
    ts_export_drop(e);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED, "share: this GPU memory travels as %s, and %s; %s",
                   chunks ? "fds (VMM memory another allocator mapped: PyTorch's expandable segments)"
                          : "an fd capability (CUDA VMM)",
                   !(ts_conn_caps(&ch->conn) & TS_TRANSPORT_PASSES_FDS) ? "a pipe channel cannot carry fds"
                                                      : "the peer cannot import fd handles",
                   chunks ? "open a socket channel, or turn expandable segments off in the producer "
                            "(PYTORCH_CUDA_ALLOC_CONF)"
                          : "create the buffer with TSHARE_CUDA_HANDLE_LEGACY (or TSHARE_CUDA_HANDLES=legacy) for "
                            "this channel");
  }
  bool several = chunks && chunks->n > 1;
  if (several && ch->conn.minor < 2) {
    ts_export_drop(e);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                   "share: the tensor spans %d chunks of VMM memory and peer %s speaks wire 1.%u, which carries one: "
                   "update the peer's tshare",
                   chunks->n, ch->conn.peer_label, (unsigned)ch->conn.minor);
  }
  int64_t deadline = ts_deadline(timeout_ms);
  tshare_frame f;
  ts_frame_clear(&f, TSHARE_FRAME_SHARE);
  tshare_share_frame *s = &f.u.share;
  s->alloc_id = x->buffer_id;
  s->device_type = TSHARE_DEVICE_CUDA;
  if (held) {
    s->mem_kind = TSHARE_MEM_CUDA_HELD;
  } else if (fd >= 0) {
    s->mem_kind = TSHARE_MEM_CUDA_FD;
    f.flags |= TSHARE_FRAME_FLAG_FD_ATTACHED;
  } else {
    s->mem_kind = TSHARE_MEM_CUDA_IPC;
    s->handle_len = TSHARE_HANDLE_MAX;
    memcpy(s->handle, x->handle.reserved, TSHARE_HANDLE_MAX);
  }
  memcpy(s->device_uuid, x->uuid, 16);
  s->alloc_size = x->size;
  s->tensor = *desc;
  s->tensor.byte_offset = offset + desc->byte_offset;
  s->origin_pid = origin_pid;
  s->share_flags = ch->conn.minor >= 1 ? flags : 0;
  if (several) s->share_flags |= TSHARE_SHARE_FLAG_CHUNKS;
  if (tag) {
    s->tag_len = (uint8_t)strlen(tag);
    memcpy(s->tag, tag, s->tag_len);
  }
  int status = ts_cuda_order_after(ch, x->ctx, stream, timeout_ms, e, &f.flags, &s->event_slot, &s->event_generation);
  if (status == TSHARE_OK && several) status = ts_cuda_send_chunks(ch, x->buffer_id, chunks, deadline);
  if (status != TSHARE_OK) {
    if (e->backend) c->busy[e->backend_slot] = false;
    ts_export_drop(e);
    return status;
  }
  return ts_share_send_export(ch, &f, fd, e, ts_remaining(deadline), share_id);
}

static void no_release(void *owner) { (void)owner; }

/* Foreign memory: the caller keeps it alive, through keep or otherwise. */
static int share_foreign(tshare_channel *ch, const void *data, const tshare_tensor_desc *desc, void *stream,
                         const char *tag, tshare_drop_fn drop, void *keep, void *user_data, int timeout_ms,
                         uint64_t *share_id) {
  if (share_id) *share_id = 0;
  int rc = TSHARE_OK;
  if (!data || !desc)
    rc = ch ? ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG, "share: NULL argument") : TSHARE_E_INVALID_ARG;
  if (rc == TSHARE_OK && ts_stage_applies(ch)) { /* another host: the bytes go, staged; the memory is free after */
    rc = ch->closed ? ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "share: channel is closed")
                    : ts_stage_share(ch, &ts_cuda_backend, data, desc, stream, tag, user_data, timeout_ms, share_id);
    drop(keep);
    return rc;
  }
  if (rc == TSHARE_OK) rc = check_can_share(ch, tag);
  ts_cuda_export x;
  /* Memory another allocator mapped with the VMM calls (PyTorch's
   * expandable segments): the chunks the tensor touches travel as fds. */
  static _Thread_local ts_vmm_chunks chunks; /* 7 KiB: not on the stack */
  chunks.n = 0;
  CUdeviceptr ptr = (CUdeviceptr)(uintptr_t)data;
  uint64_t span_end = 0;
  bool vmm = rc == TSHARE_OK && ts_cuda_is_foreign_vmm(ptr), owned = false, watched = false, held = false;
  struct ts_cuda_chan *c = vmm ? ts_cuda_chan_of(ch) : NULL;
  if (vmm && !c) rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  if (vmm && rc == TSHARE_OK) {
    char why[160];
    rc = ts_tensor_check(desc, UINT64_C(1) << 62, NULL, &span_end, why, sizeof why);
    if (rc != TSHARE_OK) ts_errf(ch->err, sizeof ch->err, rc, "share: %s", why);
    if (rc == TSHARE_OK) rc = ts_cuda_export_vmm(ptr, span_end, &x, &chunks, ch->err, sizeof ch->err);
    /* VMM chunks stay alive in the consumer's mapping whatever their owner
     * does, so it may keep them mapped while idle: this end watches them
     * and says when they change (a retire notice). */
    if (rc == TSHARE_OK && ts_cuda_fds_travel(ch))
      rc = ts_cuda_vmm_fds(ch, c, x.buffer_id, &chunks, &owned, &watched, &held); /* else refused below */
    if (rc == TSHARE_OK) x.fd = chunks.fd[0];
  } else if (rc == TSHARE_OK) {
    rc = ts_cuda_export_of(ptr, &x, ch->err, sizeof ch->err);
  }
  ts_export *e = rc == TSHARE_OK ? calloc(1, sizeof *e) : NULL;
  if (rc == TSHARE_OK && !e) rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  if (rc != TSHARE_OK) {
    if (owned) ts_vmm_chunks_close(&chunks);
    drop(keep);
    return rc;
  }
  /* cudaMalloc memory whose release would let its owner free it: the
   * segment is held past the release instead, so the peer may keep it
   * mapped between hand-offs (cuda_anchor.h). */
  bool anchored = !vmm && x.fd < 0 && drop != no_release && ch->conn.minor >= 1 &&
                  ts_anchor_share(&ts_cuda_chan_if_used(ch)->anchors, x.buffer_id, &drop, &keep);
  e->release = drop;
  e->owner = keep;
  e->user_data = user_data;
  uint32_t flags = watched || anchored ? TSHARE_SHARE_FLAG_RETIRE_NOTICE : 0;
  if (watched && !held && (ch->conn.peer.capabilities & TSHARE_CAP_CUDA_HELD)) flags |= TSHARE_SHARE_FLAG_HOLD_OFFER;
  /* The channel's owner is this process (a forked child's calls are
   * refused), known without getpid()'s system call. */
  rc = send_cuda_share(ch, &x, vmm && !held ? &chunks : NULL, held, (uint64_t)(ptr - x.base), (uint32_t)ch->owner_pid,
                       flags, desc, stream, tag, e, timeout_ms, share_id);
  if (owned) ts_vmm_chunks_close(&chunks); /* the peer has its own; a watched run keeps them */
  return rc;
}

int tshare_share_cuda(tshare_channel *ch, const void *data, const tshare_tensor_desc *desc, void *stream,
                      const char *tag, void *user_data, int timeout_ms, uint64_t *share_id) {
  if (share_id) *share_id = 0;
  if (!ch) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "share",
                  share_foreign(ch, data, desc, stream, tag, no_release, NULL, user_data, timeout_ms, share_id));
}

int tshare_share_cuda_keep(tshare_channel *ch, const void *data, const tshare_tensor_desc *desc, void *stream,
                           const char *tag, tshare_drop_fn drop, void *keep, void *user_data, int timeout_ms,
                           uint64_t *share_id) {
  if (!drop) {
    if (share_id) *share_id = 0;
    return ch ? ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG, "share: NULL drop function")
              : TSHARE_E_INVALID_ARG;
  }
  int rc = ch ? ts_channel_enter(ch, "share") : TSHARE_E_INVALID_ARG;
  if (rc != TSHARE_OK) {
    if (share_id) *share_id = 0;
    drop(keep); /* exactly once, also when refused */
    return rc;
  }
  return ts_channel_leave(ch, share_foreign(ch, data, desc, stream, tag, drop, keep, user_data, timeout_ms, share_id));
}

/* The peer may keep owned allocation a mapped while idle: the memory is
 * freed only after it said it closed it (retire handshake). NULL: out of
 * memory (ch->err says so). */
static lent_alloc *lend(tshare_channel *ch, ts_cuda_alloc *a) {
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  uint64_t id = ts_cuda_alloc_export(a)->buffer_id;
  lent_alloc *pm = ts_u64map_get(&c->lent, MAPKEY(id));
  if (pm) return pm;
  pm = calloc(1, sizeof *pm);
  if (!pm || ts_u64map_put(&c->lent, MAPKEY(id), pm) != 0) {
    free(pm);
    ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
    return NULL;
  }
  pm->alloc = a;
  ts_cuda_alloc_peer_retain(a);
  return pm;
}

int ts_cuda_lend(tshare_channel *ch, ts_cuda_alloc *a) { return lend(ch, a) ? TSHARE_OK : TSHARE_E_NOMEM; }

static int share_cuda_buffer(tshare_channel *ch, tshare_cuda_buffer *buf, const tshare_tensor_desc *desc, void *stream,
                             const char *tag, void *user_data, int timeout_ms, uint64_t *share_id) {
  if (!buf || !desc) return ch ? ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG, "share: NULL argument")
                               : TSHARE_E_INVALID_ARG;
  if (ts_stage_applies(ch)) { /* another host: the layout is checked against the buffer, then its bytes go */
    char why[160];
    int rc = ts_tensor_check(desc, tshare_cuda_buffer_size(buf), NULL, NULL, why, sizeof why);
    if (rc != TSHARE_OK) return ts_errf(ch->err, sizeof ch->err, rc, "share: %s", why);
    if (ch->closed) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "share: channel is closed");
    return ts_stage_share(ch, &ts_cuda_backend, tshare_cuda_buffer_ptr(buf), desc, stream, tag, user_data,
                          timeout_ms, share_id);
  }
  int rc = check_can_share(ch, tag);
  if (rc != TSHARE_OK) return rc;
  /* The layout must stay inside the buffer, not just inside its slab. */
  char why[160];
  rc = ts_tensor_check(desc, tshare_cuda_buffer_size(buf), NULL, NULL, why, sizeof why);
  if (rc != TSHARE_OK) return ts_errf(ch->err, sizeof ch->err, rc, "share: %s", why);
  ts_cuda_alloc *a = ts_cuda_buffer_alloc(buf);
  const ts_cuda_export *x = ts_cuda_alloc_export(a);
  uint32_t flags = 0;
  bool held = false;
  if (ch->conn.minor >= 1) {
    flags = TSHARE_SHARE_FLAG_RETIRE_NOTICE;
    lent_alloc *pm = lend(ch, a);
    if (!pm) return TSHARE_E_NOMEM;
    /* VMM memory the peer keeps mapped goes by its id alone (its imported
     * handle holds the memory until the retire); until the peer said so,
     * the share carries the fd and offers that. */
    held = pm->peer_keeps;
    if (x->fd >= 0 && !held && (ch->conn.peer.capabilities & TSHARE_CAP_CUDA_HELD))
      flags |= TSHARE_SHARE_FLAG_HOLD_OFFER;
  }
  ts_export *e = calloc(1, sizeof *e);
  if (!e) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  e->release = ts_cuda_buffer_release_cb;
  e->owner = buf;
  e->user_data = user_data;
  ts_cuda_buffer_retain(buf);
  return send_cuda_share(ch, x, NULL, held, ts_cuda_buffer_offset(buf), (uint32_t)ch->owner_pid, flags, desc, stream, tag,
                         e, timeout_ms, share_id);
}

int tshare_share_cuda_buffer(tshare_channel *ch, tshare_cuda_buffer *buf, const tshare_tensor_desc *desc, void *stream,
                             const char *tag, void *user_data, int timeout_ms, uint64_t *share_id) {
  if (share_id) *share_id = 0;
  if (!ch) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "share", share_cuda_buffer(ch, buf, desc, stream, tag, user_data, timeout_ms, share_id));
}

int ts_cuda_share_view(tshare_channel *ch, tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                           const char *tag, ts_export *e, int timeout_ms, uint64_t *share_id) {
  int rc = check_can_share(ch, tag);
  if (rc != TSHARE_OK) {
    ts_export_drop(e);
    return rc;
  }
  /* The original allocation travels under its owner's identity, so a third
   * process that also gets it from the owner maps it once. */
  ts_cuda_export x;
  memset(&x, 0, sizeof x);
  x.buffer_id = v->frame.alloc_id;
  x.size = v->frame.alloc_size;
  x.ctx = v->ctx;
  memcpy(x.uuid, v->frame.device_uuid, 16);
  memcpy(x.handle.reserved, v->frame.handle, TSHARE_HANDLE_MAX);
  x.fd = ts_cuda_import_fd(v->memory);
  if ((v->frame.mem_kind == TSHARE_MEM_CUDA_FD || v->frame.mem_kind == TSHARE_MEM_CUDA_HELD) && x.fd < 0) {
    ts_export_drop(e);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "share: this view lies in VMM memory of several chunks, whose fds its mapping does not keep: it "
                   "cannot be shared on (share it from its owner)");
  }
  uint32_t origin = v->frame.origin_pid ? v->frame.origin_pid : v->ch->conn.peer.pid;
  tshare_tensor_desc rel = *desc; /* desc is relative to the allocation; send_cuda_share adds the offset */
  rel.byte_offset = 0;
  return send_cuda_share(ch, &x, NULL, false, desc->byte_offset, origin, 0, &rel, stream ? stream : v->stream, tag, e,
                         timeout_ms, share_id);
}


/* ---- staging for a peer on another host (session_stage.c) ---------------- */

/* The work queued on stream so far has finished, or deadline passed
 * (TSHARE_E_TIMEOUT); entered into the stream's context. An event is
 * polled rather than the stream synchronized, so that a stream that never
 * drains cannot hold the share past its timeout. */
static int wait_for_stream(const ts_cuda_api *cu, void *stream, int64_t deadline, char *err, size_t cap) {
  CUevent ev;
  CUresult rc = cu->cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING);
  if (rc == CUDA_SUCCESS) rc = cu->cuEventRecord(ev, (CUstream)stream);
  if (rc != CUDA_SUCCESS) return ts_cuda_fail(err, cap, "share: ordering the staging after the stream", rc);
  int status = TSHARE_OK;
  for (unsigned spins = 0; (rc = cu->cuEventQuery(ev)) == CUDA_ERROR_NOT_READY; spins++) {
    if (ts_remaining(deadline) == 0) {
      status = ts_errf(err, cap, TSHARE_E_TIMEOUT,
                       "share: the work queued on the stream before the share did not finish in time");
      break;
    }
    if (spins > 64) usleep(50); /* a long kernel: do not burn a core */
  }
  if (status == TSHARE_OK && rc != CUDA_SUCCESS) status = ts_cuda_fail(err, cap, "share: waiting for the stream", rc);
  ts_cuda_event_destroy(cu, ev);
  return status;
}

/* len bytes at ptr into host memory dst, after the work queued on stream so
 * far: on the memory's device (VMM memory has no context of its own: its
 * device's primary one). Nothing is copied when that work does not finish
 * in timeout_ms. */
int ts_cuda_stage_out(const void *ptr, uint64_t len, void *stream, void *dst, int timeout_ms, char *err, size_t cap) {
  int status = TSHARE_OK;
  int64_t deadline = ts_deadline(timeout_ms);
  const ts_cuda_api *cu = ts_cuda_require(err, cap, &status);
  if (!cu) return status;
  int ordinal = -1;
  CUresult rc = cu->cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)(uintptr_t)ptr);
  if (rc != CUDA_SUCCESS) return ts_cuda_fail(err, cap, "share: the memory to stage is not GPU memory", rc);
  CUcontext ctx = ts_cuda_primary_ctx(ordinal);
  if (!ctx || !ts_cuda_push(ctx))
    return ts_errf(err, cap, TSHARE_E_CUDA, "share: cannot enter device %d's context", ordinal);
  status = wait_for_stream(cu, stream, deadline, err, cap);
  if (status == TSHARE_OK) {
    /* Into pageable memory: returns once the bytes are there. */
    rc = cu->cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)ptr, (size_t)len, (CUstream)stream);
    if (rc == CUDA_SUCCESS) rc = cu->cuStreamSynchronize((CUstream)stream);
    if (rc != CUDA_SUCCESS) status = ts_cuda_fail(err, cap, "share: staging GPU memory in host memory", rc);
  }
  ts_cuda_pop();
  return status;
}
