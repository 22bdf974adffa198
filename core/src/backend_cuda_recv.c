/* The CUDA backend's consumer side: chunk frames gathered for their share,
 * shares imported (through the import cache, cuda_import.c) on the
 * announced events, and the releases that wait for the GPU. */
#include "backend_cuda.h"
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

void ts_cuda_chunk_set_free(tshare_channel *ch, struct chunk_set *set) {
  if (!set) return;
  for (uint32_t i = 0; i < set->n; i++)
    if (set->fd[i] >= 0) {
      close(set->fd[i]);
      ts_conn_hold_fds(&ch->conn, -1);
    }
  free(set);
}

/* ---- consumer ------------------------------------------------------------- */

/* The chunks of a share of several (set, filed when it came) as the import
 * cache takes them: chunk 0 is the share's own fd. */
static int gather_chunks(tshare_channel *ch, const tshare_share_frame *s, int fd0, const struct chunk_set *set,
                         ts_vmm_chunks *out) {
  if (!set)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "import: share %llu came without its chunks",
                   (unsigned long long)s->share_id);
  if (set->lost)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_LIMIT,
                   "import: share %llu spans %u chunks and not all of their fds could be kept (%s)",
                   (unsigned long long)s->share_id, set->count,
                   set->lost == TS_FD_OVER_BUDGET ? "the channel holds max_unclaimed_fds" : strerror(set->lost));
  uint64_t rest = 0;
  for (uint32_t i = 0; i < set->n; i++) rest += set->size[i];
  if (rest >= s->alloc_size)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "import: share %llu: its chunks hold %llu bytes of an allocation of %llu",
                   (unsigned long long)s->share_id, (unsigned long long)rest, (unsigned long long)s->alloc_size);
  out->n = (int)set->count;
  out->fd[0] = fd0;
  out->size[0] = s->alloc_size - rest;
  for (uint32_t i = 0; i < set->n; i++) {
    out->fd[i + 1] = set->fd[i];
    out->size[i + 1] = set->size[i];
  }
  return TSHARE_OK;
}

int ts_cuda_import_view(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, tshare_view *v) {
  struct ts_cuda_chan *c = ts_cuda_chan_of(ch);
  struct chunk_set *set = c ? ts_u64map_remove(&c->chunk_sets, f->u.share.share_id + 1) : NULL;
  ts_cuda_mapping *held = c ? ts_u64map_remove(&c->held_shares, f->u.share.share_id + 1) : NULL;
  int status = ts_cuda_import_share(ch, c, f, fdp, stream, v, set, &held);
  ts_cuda_chunk_set_free(ch, set); /* mapped or not, their fds are done with */
  if (held) ts_cuda_import_put(held); /* not taken by a view */
  return status;
}

/* Memory this end keeps mapped for the peer: the reference taken when the
 * share arrived (*held) becomes the view's. */
static int held_mapping(tshare_channel *ch, const tshare_share_frame *s, CUcontext ctx, ts_cuda_mapping **held,
                        ts_cuda_mapping **imp) {
  if (!*held)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "import: share %llu names VMM memory %llu, which this end does not keep mapped",
                   (unsigned long long)s->share_id, (unsigned long long)s->alloc_id);
  if (ts_cuda_import_ctx(*held) != ctx)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "import: share %llu is memory this end keeps mapped on the device it first received it on; "
                   "receive it there",
                   (unsigned long long)s->share_id);
  if (ts_cuda_import_size(*held) != s->alloc_size)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "import: share %llu names VMM memory %llu of %llu bytes, mapped here with %zu",
                   (unsigned long long)s->share_id, (unsigned long long)s->alloc_id, (unsigned long long)s->alloc_size,
                   ts_cuda_import_size(*held));
  *imp = *held;
  *held = NULL;
  return TSHARE_OK;
}

/* Memory that came with its handle or fds: mapped through the import cache
 * (or found there), and kept for the peer where it offers that. */
static int open_mapping(tshare_channel *ch, struct ts_cuda_chan *c, const tshare_share_frame *s, CUcontext ctx,
                        int *fdp, const struct chunk_set *set, ts_cuda_mapping **imp) {
  CUipcMemHandle h;
  memcpy(h.reserved, s->handle, TSHARE_HANDLE_MAX);
  bool vmm = s->mem_kind == TSHARE_MEM_CUDA_FD;
  if (vmm && *fdp < 0)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "import: share %llu is CUDA VMM memory without its fd",
                   (unsigned long long)s->share_id);
  ts_vmm_chunks chunks;
  chunks.n = 0;
  int status;
  if (vmm && (s->share_flags & TSHARE_SHARE_FLAG_CHUNKS) &&
      (status = gather_chunks(ch, s, *fdp, set, &chunks)) != TSHARE_OK)
    return status;
  /* Found under a key the peer cannot forge: its claimed pid may be anyone's. */
  status = ts_cuda_import_get(ts_conn_origin_key(&ch->conn, s->origin_pid), s->alloc_id, ctx, &h, vmm ? fdp : NULL,
                              chunks.n > 1 ? &chunks : NULL, (size_t)s->alloc_size,
                              (s->share_flags & TSHARE_SHARE_FLAG_RETIRE_NOTICE) != 0, imp, ch->err, sizeof ch->err);
  /* The owner watches this run and retires it: keep it for its next shares. */
  if (status == TSHARE_OK && vmm && (s->share_flags & TSHARE_SHARE_FLAG_HOLD_OFFER)) ts_cuda_keep_run(ch, c, s->alloc_id, *imp);
  return status;
}

/* The share waits on the producer's event in its slot: the view's stream
 * waits for it on the GPU (nothing to wait for when it already passed). */
int ts_cuda_wait_on_producer_event(tshare_channel *ch, struct ts_cuda_chan *c, const ts_cuda_api *cu,
                                  const tshare_frame *f, CUcontext ctx, void *stream) {
  const tshare_share_frame *s = &f->u.share;
  int status = TSHARE_OK;
  CUresult rc;
  peer_event *pe = c->events && s->event_slot < TSHARE_EVENT_SLOTS_MAX ? &c->events[s->event_slot] : NULL;
  if (!pe || !pe->announced)
    status = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "import: share %llu waits on event slot %u, which "
                     "was never announced", (unsigned long long)s->share_id, s->event_slot);
  else if ((int32_t)(s->event_generation - pe->last_gen) <= 0)
    status = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                     "import: event slot %u went back from generation %u to %u: re-recorded before it was waited "
                     "on",
                     s->event_slot, pe->last_gen, s->event_generation);
  if (status == TSHARE_OK && ts_cuda_push(ctx)) {
    rc = CUDA_SUCCESS;
    if (!pe->ev) {
      rc = ts_cuda_event_open(cu, &pe->ev, pe->handle);
      if (rc == CUDA_SUCCESS) pe->ctx = ctx;
    }
    /* The producer's work is usually done by the time its frame is here:
     * then there is nothing to wait for, and the stream stays empty (so
     * the release need not wait on the GPU either). The slot is not
     * recorded again before this share is released, so a completed
     * query speaks of this share's point. */
    if (rc == CUDA_SUCCESS) {
      rc = cu->cuEventQuery(pe->ev);
      if (rc == CUDA_ERROR_NOT_READY) rc = cu->cuStreamWaitEvent((CUstream)stream, pe->ev, 0);
    }
    ts_cuda_pop();
    if (rc != CUDA_SUCCESS) status = ts_cuda_fail(ch->err, sizeof ch->err, "import: waiting on the producer's event", rc);
    else pe->last_gen = s->event_generation;
  }
  return status;
}

int ts_cuda_import_share(tshare_channel *ch, struct ts_cuda_chan *c, const tshare_frame *f, int *fdp, void *stream,
                         tshare_view *v, const struct chunk_set *set, ts_cuda_mapping **held) {
  const tshare_share_frame *s = &f->u.share;
  int status = TSHARE_OK;
  const ts_cuda_api *cu = ts_cuda_require(ch->err, sizeof ch->err, &status);
  if (!cu) return status;
  if (!c) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "import: out of memory");
  uint32_t origin = s->origin_pid ? s->origin_pid : ch->conn.peer.pid;
  if (origin == (uint32_t)ch->owner_pid) /* the caller is the owner: a forked child's copy refuses calls */
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "import: share %llu is memory of this very process, forwarded back to its owner",
                   (unsigned long long)s->share_id);
  char uuid[48]; /* for the errors only */
  int owner_dev = tshare_cuda_device_from_uuid(s->device_uuid);
  CUcontext ctx = NULL;
  CUresult rc;
  if (stream) {
    if ((rc = cu->cuStreamGetCtx((CUstream)stream, &ctx)) != CUDA_SUCCESS)
      return ts_cuda_fail(ch->err, sizeof ch->err, "import: the stream's context", rc);
  } else if (owner_dev >= 0) {
    ctx = ts_cuda_primary_ctx(owner_dev);
  } else if (cu->cuCtxGetCurrent(&ctx) != CUDA_SUCCESS) {
    ctx = NULL;
  }
  if (!ctx) {
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    tshare_cuda_uuid_format(s->device_uuid, uuid, sizeof uuid);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NO_DEVICE,
                   "import: share %llu lives on %s, which this process does not see (CUDA_VISIBLE_DEVICES=%s); "
                   "receive it on a stream of a GPU that can reach it",
                   (unsigned long long)s->share_id, uuid, cvd ? cvd : "unset");
  }
  CUdevice here = ts_cuda_primary_ordinal(ctx);
  if (here < 0 && ts_cuda_push(ctx)) {
    cu->cuCtxGetDevice(&here);
    ts_cuda_pop();
  }
  if (owner_dev >= 0 && here != owner_dev) {
    int can = 0;
    CUdevice a, b;
    if (cu->cuDeviceGet(&a, here) == CUDA_SUCCESS && cu->cuDeviceGet(&b, owner_dev) == CUDA_SUCCESS)
      cu->cuDeviceCanAccessPeer(&can, a, b);
    if (!can) tshare_cuda_uuid_format(s->device_uuid, uuid, sizeof uuid);
    if (!can)
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                     "import: share %llu lives on GPU %d (%s) and GPU %d cannot access it: no peer access between "
                     "them",
                     (unsigned long long)s->share_id, owner_dev, uuid, (int)here);
  }
  ts_cuda_mapping *imp;
  status = s->mem_kind == TSHARE_MEM_CUDA_HELD ? held_mapping(ch, s, ctx, held, &imp)
                                               : open_mapping(ch, c, s, ctx, fdp, set, &imp);
  if (status != TSHARE_OK) return status;
  if (f->flags & TSHARE_FRAME_FLAG_HAS_EVENT) {
    status = ts_cuda_wait_on_producer_event(ch, c, cu, f, ctx, stream);
    if (status != TSHARE_OK) {
      ts_cuda_import_put(imp);
      return status;
    }
  }
  v->memory = imp;
  v->stream = stream;
  v->ctx = ctx;
  v->device = (int)here;
  v->data = (void *)(uintptr_t)(ts_cuda_import_ptr(imp) + s->tensor.byte_offset);
  return TSHARE_OK;
}

bool ts_cuda_push_drain_locked(struct ts_cuda_chan *c, uint64_t share_id, CUevent done, CUcontext ctx,
                               ts_cuda_mapping *imp, ts_cuda_mapping **more, size_t nmore) {
  return drain_list_push(&c->drains, (drain){share_id, done, ctx, imp, ts_now_us(), more, nmore}) == TSHARE_OK;
}

/* A finished drain's mappings go. */
void ts_cuda_drain_put(drain *d) {
  ts_cuda_import_put(d->imp);
  for (size_t i = 0; i < d->nmore; i++) ts_cuda_import_put(d->more[i]);
  free(d->more);
}

CUevent ts_cuda_spare_take_locked(struct ts_cuda_chan *c, CUcontext ctx) {
  for (size_t i = c->nspares; i-- > 0;)
    if (c->spares[i].ctx == ctx) {
      CUevent ev = c->spares[i].ev;
      c->spares[i] = c->spares[--c->nspares];
      return ev;
    }
  return NULL;
}

static void spare_put_locked(struct ts_cuda_chan *c, const ts_cuda_api *cu, CUcontext ctx, CUevent ev) {
  if (c->nspares < SPARES_MAX) c->spares[c->nspares++] = (spare_event){ctx, ev};
  else ts_cuda_event_destroy(cu, ev);
}

ts_release_done ts_cuda_view_release(tshare_view *v) {
  tshare_channel *ch = v->ch;
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  CUevent done = NULL;
  bool idle = false;
  /* The producer may reuse the memory once it has the release, so the
   * release waits for the work queued on the view's stream until now. An
   * empty stream has none: the release goes out at once. */
  if (cu && ts_cuda_push(v->ctx)) {
    idle = cu->cuStreamQuery((CUstream)v->stream) == CUDA_SUCCESS;
    if (!idle) {
      pthread_mutex_lock(&ch->lock);
      done = c ? ts_cuda_spare_take_locked(c, v->ctx) : NULL;
      pthread_mutex_unlock(&ch->lock);
      if (!done && ts_cuda_event_create(cu, &done, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) done = NULL;
      if (done && cu->cuEventRecord(done, (CUstream)v->stream) != CUDA_SUCCESS) {
        ts_cuda_event_destroy(cu, done);
        done = NULL;
      }
    }
    ts_cuda_pop();
  }
  if (idle) { /* nothing to wait for and nothing of the channel's to touch: no lock */
    ts_cuda_import_put(v->memory);
    return TS_RELEASE_NOW;
  }
  pthread_mutex_lock(&ch->lock);
  bool queued = !ch->closed && c && done && ts_cuda_push_drain_locked(c, v->share_id, done, v->ctx, v->memory, NULL, 0);
  if (queued) {
    ts_conn_wake(&ch->conn);
  } else {
    /* A closed channel, or no event: finish here, waiting for the GPU. */
    if (done) {
      cu->cuEventSynchronize(done);
      ts_cuda_event_destroy(cu, done);
    } else if (cu && ts_cuda_push(v->ctx)) {
      cu->cuStreamSynchronize((CUstream)v->stream);
      ts_cuda_pop();
    }
    ts_cuda_import_put(v->memory);
  }
  pthread_mutex_unlock(&ch->lock);
  return queued ? TS_RELEASE_LATER : TS_RELEASE_NOW; /* queued: the housekeeping queues it once the GPU is done */
}

/* An event slot the peer announces: opened on the first share that waits on it. */
int ts_cuda_on_event(tshare_channel *ch, const tshare_frame *f) {
  struct ts_cuda_chan *c = ts_cuda_chan_of(ch);
  if (!c) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  if (!c->events && !(c->events = calloc(TSHARE_EVENT_SLOTS_MAX, sizeof *c->events)))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  peer_event *pe = &c->events[f->u.event.slot];
  if (pe->announced)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "event: slot %u announced twice", f->u.event.slot);
  pe->announced = true;
  memcpy(pe->handle.reserved, f->u.event.handle, TSHARE_HANDLE_MAX);
  return TSHARE_OK;
}

int ts_cuda_on_chunk(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost) {
  struct ts_cuda_chan *c = ts_cuda_chan_of(ch);
  const tshare_chunk_frame *k = &f->u.chunk;
  int rc = TSHARE_OK;
  if (!c) rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  struct chunk_set *set = c ? c->gathering : NULL;
  if (rc == TSHARE_OK && set && (set->alloc_id != k->alloc_id || set->count != k->count))
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                 "chunk: peer %s sent chunks of allocation %llu, then of %llu before its share", ch->conn.peer_label,
                 (unsigned long long)set->alloc_id, (unsigned long long)k->alloc_id);
  if (rc == TSHARE_OK && !set) {
    if (!(set = calloc(1, sizeof *set))) rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
    else {
      set->alloc_id = k->alloc_id;
      set->count = k->count;
      c->gathering = set;
    }
  }
  if (rc == TSHARE_OK && k->index != set->n + 1)
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "chunk: peer %s sent chunk %u of %u after %u",
                 ch->conn.peer_label, k->index, k->count, set->n);
  if (rc != TSHARE_OK) {
    if (fd >= 0) close(fd);
    return rc;
  }
  if (fd >= 0) ts_conn_hold_fds(&ch->conn, 1); /* held until the share is imported or dropped */
  else if (!set->lost) set->lost = fd_lost ? fd_lost : EMFILE;
  set->fd[set->n] = fd;
  set->size[set->n++] = k->size;
  return TSHARE_OK;
}

/* A share of memory this end keeps mapped: a reference for it now, while the
 * peer's word stands (a retire that follows it unpins the mapping). */
static int take_held_share(tshare_channel *ch, const tshare_share_frame *s) {
  struct ts_cuda_chan *c = ts_cuda_chan_of(ch);
  ts_cuda_mapping *imp = c ? ts_u64map_get(&c->kept_runs, s->alloc_id + 1) : NULL;
  if (!imp)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "share %llu: peer %s names VMM memory %llu, which this end does not keep mapped",
                   (unsigned long long)s->share_id, ch->conn.peer_label, (unsigned long long)s->alloc_id);
  if (ts_u64map_put(&c->held_shares, s->share_id + 1, imp) != 0)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  ts_cuda_import_hold(imp, true);
  return TSHARE_OK;
}

/* What a share brought beside its frame (a chunk set's fds, a reference to a
 * kept mapping) is filed under its id until it is imported or dropped: a
 * second share with an id that waits would orphan the first's. */
static int refuse_repeated_id(tshare_channel *ch, struct ts_cuda_chan *c, uint64_t share_id) {
  ts_cuda_chunk_set_free(ch, c->gathering); /* the repeated share's own chunks */
  c->gathering = NULL;
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                 "share %llu: peer %s sent this share id again while its first share waits to be received",
                 (unsigned long long)share_id, ch->conn.peer_label);
}

static bool share_id_waits(const struct ts_cuda_chan *c, uint64_t share_id) {
  return ts_u64map_get(&c->chunk_sets, share_id + 1) || ts_u64map_get(&c->held_shares, share_id + 1);
}

int ts_cuda_on_share(tshare_channel *ch, const tshare_frame *f) {
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  if (c && share_id_waits(c, f->u.share.share_id)) return refuse_repeated_id(ch, c, f->u.share.share_id);
  if (f->u.share.mem_kind == TSHARE_MEM_CUDA_HELD && (!c || !c->gathering)) return take_held_share(ch, &f->u.share);
  struct chunk_set *set = c ? c->gathering : NULL;
  bool chunked = f->u.share.mem_kind == TSHARE_MEM_CUDA_FD && (f->u.share.share_flags & TSHARE_SHARE_FLAG_CHUNKS);
  if (!chunked && !set) return TSHARE_OK;
  if (c) c->gathering = NULL;
  int rc = TSHARE_OK;
  if (!chunked || !set || set->alloc_id != f->u.share.alloc_id || set->n + 1 != set->count)
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                 "share %llu: its chunk frames and the share disagree (%s)", (unsigned long long)f->u.share.share_id,
                 !chunked ? "chunks came before a share of one piece"
                 : !set   ? "no chunk frames came"
                          : "another allocation, or chunks missing");
  if (rc == TSHARE_OK && ts_u64map_put(&c->chunk_sets, f->u.share.share_id + 1, set) != 0)
    rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  if (rc != TSHARE_OK) ts_cuda_chunk_set_free(ch, set);
  return rc;
}

void ts_cuda_share_dropped(tshare_channel *ch, uint64_t share_id) {
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  if (!c) return;
  ts_cuda_chunk_set_free(ch, ts_u64map_remove(&c->chunk_sets, share_id + 1));
  ts_cuda_mapping *held = ts_u64map_remove(&c->held_shares, share_id + 1);
  if (held) ts_cuda_import_put(held);
}


/* Releases whose GPU work finished: their events back to the spares, their
 * mappings let go, their releases queued; *busy as the housekeeping says. */
void ts_cuda_finish_drains(tshare_channel *ch, struct ts_cuda_chan *c, const ts_cuda_api *cu, ts_backend_wait *busy) {
  pthread_mutex_lock(&ch->lock);
  size_t keep = 0;
  int64_t newest = 0;
  for (size_t i = 0; i < c->drains.len; i++) {
    drain d = c->drains.items[i];
    if (cu && cu->cuEventQuery(d.done) == CUDA_ERROR_NOT_READY) {
      c->drains.items[keep++] = d;
      if (d.queued_us > newest) newest = d.queued_us;
      continue;
    }
    if (cu) spare_put_locked(c, cu, d.ctx, d.done);
    ts_cuda_drain_put(&d);
    if (d.share_id) ts_share_queue_release_locked(ch, d.share_id); /* 0: a pin's, nothing to tell */
  }
  c->drains.len = keep;
  if (keep) *busy = ts_now_us() - newest < GPU_SPIN_US ? TS_BACKEND_SOON : TS_BACKEND_LATER;
  pthread_mutex_unlock(&ch->lock);
}
