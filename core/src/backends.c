/* The registry of memory backends (backend.h): the built-in list, the
 * backends registered at run time, and the loops the session makes over
 * them. A backend's index in the list is its slot in each channel's
 * backend_data. Lookups by memory kind or frame type go from the last
 * registered to the first, so a registered backend stands in for a
 * built-in one for the kinds it claims: the wire has no kinds of its own
 * for it (a test's backend in one process). */
#include "backend.h"
#include "clock.h"
#include "session.h"

#include <stdatomic.h>

extern const ts_backend ts_host_backend; /* backend_host.c */
extern const ts_backend ts_cuda_backend; /* backend_cuda.c, or backend_cuda_none.c */
extern const ts_backend ts_ucx_backend;  /* backend_ucx.c */

#define BUILT_IN 3
static const ts_backend *backends[TS_BACKENDS_MAX] = {&ts_host_backend, &ts_cuda_backend, &ts_ucx_backend};
/* Published after its entry is written: a reader sees whole entries only. */
static atomic_size_t backend_count = BUILT_IN;

static size_t count(void) { return atomic_load_explicit(&backend_count, memory_order_acquire); }

/* Whether b claims a kind or frame type another registered backend has. */
static bool claims_overlap(const ts_backend *b) {
  for (size_t i = BUILT_IN; i < count(); i++)
    if ((backends[i]->mem_kinds & b->mem_kinds) || (backends[i]->frame_types & b->frame_types)) return true;
  return false;
}

int ts_backend_register(const ts_backend *b) {
  if (!b || !b->name || !b->mem_kind_name || !b->hello_caps || !b->peer_gone || !b->chan_free || !b->import || !b->release ||
      !b->share_view || (b->frame_types && !b->on_frame) || claims_overlap(b))
    return TSHARE_E_INVALID_ARG;
  size_t n = count();
  if (n == TS_BACKENDS_MAX) return TSHARE_E_LIMIT;
  backends[n] = b;
  atomic_store_explicit(&backend_count, n + 1, memory_order_release);
  return TSHARE_OK;
}

const ts_backend *ts_backend_for_mem_kind(int mem_kind) {
  if (mem_kind < 0 || mem_kind >= 32) return NULL;
  for (size_t i = count(); i-- > 0;)
    if (backends[i]->mem_kinds & TS_MEM_KIND_BIT(mem_kind)) return backends[i];
  return NULL;
}

const ts_backend *ts_backend_for_frame(int type) {
  if (type < 0 || type >= 32) return NULL;
  for (size_t i = count(); i-- > 0;)
    if (backends[i]->frame_types & TS_FRAME_TYPE_BIT(type)) return backends[i];
  return NULL;
}

const ts_backend *ts_backend_for_received(const tshare_frame *f) {
  /* A retire frame names the memory kind of what it retires since minor 4;
   * before, only CUDA memory was retired, and its backend claims the type. */
  if (f->type == TSHARE_FRAME_RETIRE && f->u.retire.mem_kind) {
    const ts_backend *b = ts_backend_for_mem_kind(f->u.retire.mem_kind);
    return b && b->on_frame ? b : NULL;
  }
  return ts_backend_for_frame(f->type);
}

void **ts_backend_data(tshare_channel *ch, const ts_backend *b) {
  for (size_t i = 0; i < count(); i++)
    if (backends[i] == b) return &ch->backend_data[i];
  return NULL;
}

uint64_t ts_backends_hello(tshare_hello *self, uint32_t transport_caps) {
  uint64_t caps = 0;
  for (size_t i = 0; i < count(); i++) {
    caps |= backends[i]->hello_caps(transport_caps);
    if (backends[i]->hello_fields) backends[i]->hello_fields(self);
  }
  return caps;
}

int ts_backends_chan_init(tshare_channel *ch) {
  for (size_t i = 0; i < count(); i++) {
    int rc = backends[i]->chan_init ? backends[i]->chan_init(ch) : TSHARE_OK;
    if (rc != TSHARE_OK) return rc;
  }
  return TSHARE_OK;
}

void ts_backends_peer_gone(tshare_channel *ch) {
  for (size_t i = 0; i < count(); i++) backends[i]->peer_gone(ch);
}

void ts_backends_chan_free(tshare_channel *ch) {
  for (size_t i = 0; i < count(); i++) backends[i]->chan_free(ch);
}

void ts_backends_chan_free_in_child(tshare_channel *ch) {
  for (size_t i = 0; i < count(); i++)
    if (backends[i]->chan_free_in_child) backends[i]->chan_free_in_child(ch);
}

int ts_backends_on_share(tshare_channel *ch, const tshare_frame *f) {
  for (size_t i = 0; i < count(); i++) {
    int rc = backends[i]->on_share ? backends[i]->on_share(ch, f) : TSHARE_OK;
    if (rc != TSHARE_OK) return rc;
  }
  return TSHARE_OK;
}

void ts_backends_share_dropped(tshare_channel *ch, uint64_t share_id) {
  for (size_t i = 0; i < count(); i++)
    if (backends[i]->share_dropped) backends[i]->share_dropped(ch, share_id);
}

int ts_backends_housekeeping(tshare_channel *ch, int64_t deadline, ts_backend_wait *wait) {
  *wait = TS_BACKEND_IDLE;
  for (size_t i = 0; i < count(); i++) {
    if (!backends[i]->housekeeping) continue;
    ts_backend_wait mine = TS_BACKEND_IDLE;
    int rc = backends[i]->housekeeping(ch, deadline, &mine);
    /* The soonest look any backend asks for. */
    if (mine == TS_BACKEND_SOON || (mine == TS_BACKEND_LATER && *wait == TS_BACKEND_IDLE)) *wait = mine;
    if (rc != TSHARE_OK) return rc;
  }
  return TSHARE_OK;
}

int ts_backends_idle(tshare_channel *ch, int64_t deadline) {
  int status = TSHARE_OK;
  for (size_t i = 0; i < count(); i++) {
    int rc = backends[i]->idle ? backends[i]->idle(ch, deadline) : TSHARE_OK;
    if (status == TSHARE_OK) status = rc; /* every backend's idle work runs; the first failure is told */
  }
  return status;
}

void ts_backends_before_close(tshare_channel *ch, int timeout_ms) {
  for (size_t i = 0; i < count(); i++)
    if (backends[i]->before_close) backends[i]->before_close(ch, timeout_ms);
}

void ts_backends_export_done(tshare_channel *ch, const struct ts_export *e) {
  if (e->backend && e->backend->export_done) e->backend->export_done(ch, e);
}

int tshare_view_is_copy(const tshare_view *v) { return v && v->backend && v->backend->views_are_copies ? 1 : 0; }
