/* The CUDA backend's table (backend.h) and what concerns all of it: a
 * channel's CUDA state, the events tshare counts, the hello, housekeeping,
 * the peer gone and the channel freed. Its other files: backend_cuda.h. */
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

/* Every event tshare creates, opens or destroys goes through these, so the
 * statistics show how many it holds (a stream of shares must not grow it). */
static CUresult count_event(CUresult rc, int delta) {
  if (rc == CUDA_SUCCESS) {
    pthread_mutex_lock(&ts_cuda_lock);
    ts_cuda_counters.events += (uint64_t)(int64_t)delta;
    pthread_mutex_unlock(&ts_cuda_lock);
  }
  return rc;
}

CUresult ts_cuda_event_create(const ts_cuda_api *cu, CUevent *ev, unsigned flags) {
  return count_event(cu->cuEventCreate(ev, flags), 1);
}

CUresult ts_cuda_event_open(const ts_cuda_api *cu, CUevent *ev, CUipcEventHandle h) {
  return count_event(cu->cuIpcOpenEventHandle(ev, h), 1);
}

void ts_cuda_event_destroy(const ts_cuda_api *cu, CUevent ev) {
  (void)count_event(cu->cuEventDestroy(ev), -1);
}

/* This backend's state in ch: NULL until the channel first uses CUDA. The
 * slot is set once (under the channel's lock) and cleared only when the
 * channel is freed, so it is read without the lock; atomically, as another
 * thread may be setting it. */
struct ts_cuda_chan *ts_cuda_chan_if_used(tshare_channel *ch) {
  return __atomic_load_n(ts_backend_data(ch, &ts_cuda_backend), __ATOMIC_ACQUIRE);
}

/* The lock only on first use: every share and import asks. */
struct ts_cuda_chan *ts_cuda_chan_of(tshare_channel *ch) {
  void **slot = ts_backend_data(ch, &ts_cuda_backend);
  struct ts_cuda_chan *c = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  if (c) return c;
  pthread_mutex_lock(&ch->lock);
  c = *slot;
  if (!c) {
    c = calloc(1, sizeof(struct ts_cuda_chan));
    __atomic_store_n(slot, c, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&ch->lock);
  return c;
}

/* ---- hello ---------------------------------------------------------------- */

/* The driver's inter-process handles open only on the machine that made
 * them: a peer that may be on another host (UCX) is offered none. fd
 * handles need fd passing too, which the sender checks on the channel
 * before it sends one. */
static uint64_t cuda_hello_caps(uint32_t transport_caps) {
  if (!(transport_caps & TS_TRANSPORT_SAME_HOST)) return 0;
  return TSHARE_CAP_CUDA_IPC | TSHARE_CAP_CUDA_FD | TSHARE_CAP_CUDA_HELD | TSHARE_CAP_SET_CUDA;
}

static void cuda_hello_devices(tshare_hello *h) {
  if (!ts_cuda_if_loaded()) return;
  int n = tshare_cuda_device_count();
  for (int i = 0; i < n && h->device_count < TSHARE_HELLO_DEVICES_MAX; i++)
    if (tshare_cuda_device_uuid(i, h->device_uuids[h->device_count]) == TSHARE_OK) h->device_count++;
}

/* ---- frames and housekeeping --------------------------------------------- */

static int cuda_housekeeping(tshare_channel *ch, int64_t deadline, ts_backend_wait *busy) {
  *busy = TS_BACKEND_IDLE;
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  if (!c) return TSHARE_OK;
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  ts_cuda_finish_drains(ch, c, cu, busy);
  return ts_cuda_send_notices(ch, c, cu, deadline);
}

static void cuda_peer_gone(tshare_channel *ch) {
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  if (!c) return;
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&c->lent, &pos, &key, &value);) {
    lent_alloc *pm = value;
    ts_cuda_alloc_peer_release(pm->alloc);
    free(pm);
  }
  ts_u64map_free(&c->lent);
  ts_cuda_watched_runs_free(c);
  ts_anchors_drop_all(&c->anchors);
  for (size_t pos = 0; ts_u64map_next(&c->kept_runs, &pos, &key, &value);) ts_cuda_import_put(value);
  ts_u64map_free(&c->kept_runs);
  c->kept_notices.len = 0;
  c->freed_notices.len = 0;
  c->retiring.len = 0; /* the origin's mappings all close below */
  if (ch->conn.peer_key) ts_cuda_import_origin_gone(ch->conn.peer_key);
}

static void cuda_chan_free(tshare_channel *ch) {
  struct ts_cuda_chan *c = ts_cuda_chan_if_used(ch);
  if (!c) return;
  cuda_peer_gone(ch);
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  for (size_t i = 0; i < c->drains.len; i++) {
    if (cu) {
      cu->cuEventSynchronize(c->drains.items[i].done);
      ts_cuda_event_destroy(cu, c->drains.items[i].done);
    }
    ts_cuda_drain_put(&c->drains.items[i]);
  }
  ts_cuda_chunk_set_free(ch, c->gathering);
  c->gathering = NULL;
  uint64_t key;
  void *set;
  for (size_t i = 0; ts_u64map_next(&c->chunk_sets, &i, &key, &set);) ts_cuda_chunk_set_free(ch, set);
  ts_u64map_free(&c->chunk_sets);
  for (size_t i = 0; ts_u64map_next(&c->held_shares, &i, &key, &set);) ts_cuda_import_put(set);
  ts_u64map_free(&c->held_shares);
  ts_id_vec_free(&c->kept_notices);
  if (cu) {
    for (uint32_t i = 0; i < c->nslots; i++) ts_cuda_event_destroy(cu, c->pool[i]);
    for (uint32_t i = 0; c->events && i < TSHARE_EVENT_SLOTS_MAX; i++)
      if (c->events[i].ev) ts_cuda_event_destroy(cu, c->events[i].ev);
    for (size_t i = 0; i < c->nspares; i++) ts_cuda_event_destroy(cu, c->spares[i].ev);
  }
  free(c->events);
  drain_list_free(&c->drains);
  ts_id_vec_free(&c->closed_notices);
  ts_id_vec_free(&c->retiring);
  ts_id_vec_free(&c->freed_notices);
  free(c);
  *ts_backend_data(ch, &ts_cuda_backend) = NULL;
}

/* Event and retire frames, and the chunk frames gathered for a share. */
static int cuda_on_frame(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost) {
  if (f->type == TSHARE_FRAME_CHUNK) return ts_cuda_on_chunk(ch, f, fd, fd_lost);
  if (fd >= 0) close(fd); /* only chunks carry memory */
  return f->type == TSHARE_FRAME_EVENT ? ts_cuda_on_event(ch, f) : ts_cuda_on_retire(ch, f);
}

static const char *cuda_mem_kind_name(int kind) {
  return kind == TSHARE_MEM_CUDA_FD     ? "CUDA VMM fd"
         : kind == TSHARE_MEM_CUDA_HELD ? "CUDA VMM memory kept mapped"
                                        : "CUDA IPC handle";
}

static int cuda_device_of(const tshare_share_frame *s) { return tshare_cuda_device_from_uuid(s->device_uuid); }

const ts_backend ts_cuda_backend = {
    .name = "cuda",
    .mem_kinds = TS_MEM_KIND_BIT(TSHARE_MEM_CUDA_IPC) | TS_MEM_KIND_BIT(TSHARE_MEM_CUDA_FD) |
                 TS_MEM_KIND_BIT(TSHARE_MEM_CUDA_HELD),
    .frame_types = TS_FRAME_TYPE_BIT(TSHARE_FRAME_EVENT) | TS_FRAME_TYPE_BIT(TSHARE_FRAME_RETIRE) |
                   TS_FRAME_TYPE_BIT(TSHARE_FRAME_CHUNK),
    .mem_kind_name = cuda_mem_kind_name,
    .device_of = cuda_device_of,
    .hello_caps = cuda_hello_caps,
    .hello_fields = cuda_hello_devices,
    .peer_gone = cuda_peer_gone,
    .chan_free = cuda_chan_free,
    .on_frame = cuda_on_frame,
    .on_share = ts_cuda_on_share,
    .share_dropped = ts_cuda_share_dropped,
    .housekeeping = cuda_housekeeping,
    .idle = ts_cuda_idle,
    .before_close = ts_cuda_before_close,
    .export_done = ts_cuda_export_done,
    .import = ts_cuda_import_view,
    .release = ts_cuda_view_release,
    .share_view = ts_cuda_share_view,
    .memory_ref_locked = ts_cuda_memory_ref_locked,
    .memory_unref_locked = ts_cuda_memory_unref_locked,
    .set_source_new = ts_cuda_set_source_new,
    .set_source_free = ts_cuda_set_source_free,
    .set_check = ts_cuda_set_check,
    .set_keep_state = ts_cuda_set_keep_state,
    .set_again_hold = ts_cuda_set_again_hold,
    .set_send_mem = ts_cuda_set_send_mem,
    .set_order = ts_cuda_set_order,
    .stage_out = ts_cuda_stage_out, /* to a peer on another host: staged in host memory */
    .set_stage_out = ts_cuda_set_stage_out,
    .set_wait = ts_cuda_set_wait,
    .set_release = ts_cuda_set_release,
};

