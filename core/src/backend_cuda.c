/* CUDA shares on a channel: the producer's event pool and the allocations
 * its peer may keep mapped; the consumer's announced events, imports, and
 * the releases that wait for the GPU. Producer-side state belongs to the
 * thread that drives the channel, like the rest of a channel; the releases
 * waiting for the GPU are under ch->lock, since views are released from any
 * thread. */
#include "backend.h"
#include "cuda_anchor.h"
#include "session.h"
#include "clock.h"
#include "cuda_hooks.h"
#include "cuda_internal.h"
#include "error_detail.h"
#include "wire_checks.h"
#include "log.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#define POOL_MAX 256 /* events a producer keeps per channel; beyond that a share syncs its stream */

typedef struct peer_event {
  bool announced;
  CUipcEventHandle handle;
  CUevent ev; /* opened on first use */
  CUcontext ctx;
  uint32_t last_gen;
} peer_event;

typedef struct drain {
  uint64_t share_id;
  CUevent done; /* recorded on the view's stream at release */
  CUcontext ctx;
  ts_cuda_mapping *imp;
  int64_t queued_us;
} drain;

/* A release event to record again: one per release would cost a create and
 * a destroy each time. */
typedef struct spare_event {
  CUcontext ctx;
  CUevent ev;
} spare_event;

#define SPARES_MAX 64

/* Allocation ids waiting to go out in retire frames. */
typedef struct id_list {
  uint64_t *ids;
  size_t n, cap;
} id_list;

/* Room for `more` ids past the last. */
static bool id_list_reserve(id_list *l, size_t more) {
  if (l->cap - l->n >= more) return true;
  size_t cap = l->cap ? l->cap : 16;
  while (cap - l->n < more) cap *= 2;
  uint64_t *ids = realloc(l->ids, cap * sizeof *ids);
  if (!ids) return false;
  l->ids = ids;
  l->cap = cap;
  return true;
}

static bool id_list_push(id_list *l, uint64_t id) {
  if (!id_list_reserve(l, 1)) return false;
  l->ids[l->n++] = id;
  return true;
}

/* The first n ids went out: only the rest wait. */
static void id_list_drop_front(id_list *l, size_t n) {
  if (n == 0) return; /* ids may be NULL */
  memmove(l->ids, l->ids + n, (l->n - n) * sizeof *l->ids);
  l->n -= n;
}

typedef struct peer_mapped {
  ts_cuda_alloc *alloc;
  bool retire_queued; /* its retire notice went, or waits in the channel's retires */
} peer_mapped;

struct ts_cuda_chan {
  /* producer */
  CUcontext pool_ctx;
  uint32_t nslots;
  CUevent pool[POOL_MAX];
  uint32_t gen[POOL_MAX];
  bool busy[POOL_MAX];
  ts_u64map mapped; /* buffer id -> peer_mapped: owned allocations the peer may keep open */
  /* consumer */
  peer_event *events; /* TSHARE_EVENT_SLOTS_MAX entries, allocated with the first event frame */
  drain *drains;      /* under ch->lock */
  size_t ndrain, cap_drain;
  spare_event spares[SPARES_MAX]; /* under ch->lock */
  size_t nspares;
  id_list acks; /* retire acks to send */
  /* producer: retire notices (closed = 0) decided and not sent yet. What
   * they name is already marked as asked (or no longer watched), so a notice
   * a timeout held back goes with a later flush, never from the marks. */
  id_list retires;
  /* Chunk frames of VMM memory, gathered until their share comes (then
   * filed under its share id until it is imported or dropped). */
  struct chunk_set *gathering;
  ts_u64map chunk_sets; /* share id + 1 -> chunk_set */
  /* producer: runs of VMM chunks (another allocator's) shared with a retire
   * notice, so the peer keeps them mapped while idle; looked at every
   * millisecond the channel is driven, and retired once a chunk was
   * unmapped or mapped anew (its buffer id changed). */
  ts_u64map vmm_runs; /* run id + 1 -> vmm_run */
  /* producer: cudaMalloc segments of another allocator held while the peer
   * keeps them mapped between hand-offs (cuda_anchor.h) */
  ts_anchors anchors;
  int64_t watched_checked_us; /* the last look at the runs and the anchors */
  /* consumer: VMM mappings of the peer's watched runs this end keeps (a
   * reference each) until the peer retires them, having told the peer so
   * (retire frame, closed = 2), which then shares them without their fds. */
  ts_u64map pins;       /* alloc id + 1 -> ts_cuda_mapping */
  ts_u64map held_refs;  /* share id + 1 -> ts_cuda_mapping: a reference taken when such a share arrived */
  id_list holds;        /* notices to send */
};

#define PINS_MAX 64 /* mappings a consumer keeps for one channel's peer; past it shares keep carrying fds */

#define VMM_RUNS_MAX 256 /* runs watched per channel; past it shares go without a retire notice */
#define WATCH_CHECK_US 1000 /* how often a driven channel looks at its runs and anchors */

/* A watched run keeps the fds it was exported as, while the process-wide
 * budget allows: the next share of it sends them again without the
 * driver's export. Once the peer keeps the run mapped they are closed (its
 * shares go without fds). A run past the budget is watched all the same and
 * exported again for each share that carries fds. */
struct vmm_run {
  int n;
  bool peer_holds; /* the peer keeps it mapped until retired: shares of it go without fds */
  int *fd;         /* n, all -1 when the run keeps none */
  uint64_t v[];    /* n chunk bases, then their n buffer ids */
};

/* Fds kept by watched runs of every channel of this process: the fd table
 * is the process's, and a producer feeding several consumers watches each
 * run once per channel (four consumers of 200 tensors of expandable
 * segments would keep over 2000). */
#define RUN_FDS_MAX 256
static atomic_long run_fds_kept;

/* The budget: RUN_FDS_MAX, or a quarter of the fd limit where that is less. */
static long run_fds_budget(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur / 4 < RUN_FDS_MAX)
    return (long)(rl.rlim_cur / 4);
  return RUN_FDS_MAX;
}

/* r keeps the fresh fds of chunks if the budget has room for them. */
static bool run_keep_fds(struct vmm_run *r, const ts_vmm_chunks *chunks) {
  long n = r->n;
  if (atomic_fetch_add(&run_fds_kept, n) + n > run_fds_budget()) {
    atomic_fetch_sub(&run_fds_kept, n);
    return false;
  }
  for (int i = 0; i < r->n; i++) r->fd[i] = chunks->fd[i];
  return true;
}

static void run_close_fds(struct vmm_run *r) {
  if (r->n == 0 || r->fd[0] < 0) return;
  for (int i = 0; i < r->n; i++) {
    close(r->fd[i]);
    r->fd[i] = -1;
  }
  atomic_fetch_sub(&run_fds_kept, r->n);
}

static void vmm_run_free(struct vmm_run *r) {
  if (r) run_close_fds(r);
  free(r);
}

/* A newly watched run of chunks, keeping no fds yet. */
static struct vmm_run *vmm_run_new(const ts_vmm_chunks *chunks) {
  size_t n = (size_t)chunks->n;
  struct vmm_run *r = malloc(sizeof *r + 2 * n * sizeof(uint64_t) + n * sizeof(int));
  if (!r) return NULL;
  r->n = chunks->n;
  r->peer_holds = false;
  r->fd = (int *)(r->v + 2 * n);
  for (size_t i = 0; i < n; i++) {
    r->v[i] = chunks->base[i];
    r->v[n + i] = chunks->id[i];
    r->fd[i] = -1;
  }
  return r;
}

/* Start watching the run of chunks (fds fresh from the export): true if it
 * kept the fds, which the caller then must not close. */
static bool vmm_run_watch(tshare_channel *ch, struct ts_cuda_chan *c, uint64_t run_id, const ts_vmm_chunks *chunks,
                          bool *watched) {
  if (c->vmm_runs.count >= VMM_RUNS_MAX || ch->conn.minor < 1) return false;
  struct vmm_run *r = vmm_run_new(chunks);
  if (!r || ts_u64map_put(&c->vmm_runs, run_id + 1, r) != 0) {
    free(r);
    return false;
  }
  *watched = true;
  return run_keep_fds(r, chunks);
}

/* The chunks' fds: those the watched run keeps when it keeps them, else new
 * ones, which a newly watched run keeps where the budget allows (*owned
 * false) or the caller closes after sending (*owned true). *watched: the
 * share may promise a retire notice. */
static int vmm_fds(tshare_channel *ch, struct ts_cuda_chan *c, uint64_t run_id, ts_vmm_chunks *chunks, bool *owned,
                   bool *watched, bool *held) {
  struct vmm_run *r = ts_u64map_get(&c->vmm_runs, run_id + 1);
  *owned = false;
  *watched = r != NULL;
  *held = r && r->peer_holds;
  if (*held) return TSHARE_OK; /* the peer has it mapped: no fds travel */
  if (r && r->fd[0] >= 0) {
    for (int i = 0; i < chunks->n; i++) chunks->fd[i] = r->fd[i];
    return TSHARE_OK;
  }
  int rc = ts_cuda_vmm_export_fds(chunks, ch->err, sizeof ch->err);
  if (rc != TSHARE_OK) return rc;
  *owned = r || !vmm_run_watch(ch, c, run_id, chunks, watched);
  return TSHARE_OK;
}

/* Runs whose chunks are no longer where they were, as their owner's
 * allocator left them: into ids (up to cap), no longer watched. */
static size_t vmm_runs_gone(struct ts_cuda_chan *c, const ts_cuda_api *cu, uint64_t *ids, size_t cap) {
  size_t n = 0;
  uint64_t key;
  void *value;
  for (size_t pos = 0; n < cap && ts_u64map_next(&c->vmm_runs, &pos, &key, &value);) {
    struct vmm_run *r = value;
    bool same = true;
    for (int i = 0; same && i < r->n; i++) {
      unsigned long long id = 0;
      same = cu->cuPointerGetAttribute(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, (CUdeviceptr)r->v[i]) == CUDA_SUCCESS &&
             id == r->v[r->n + i];
    }
    if (same) continue;
    TS_LOG(TS_LOG_DEBUG, "VMM memory %llu (%d chunks) is no longer mapped as it was shared: retiring it",
           (unsigned long long)(key - 1), r->n);
    ids[n++] = key - 1;
    vmm_run_free(ts_u64map_remove(&c->vmm_runs, key));
  }
  return n;
}

static void vmm_runs_free(struct ts_cuda_chan *c) {
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&c->vmm_runs, &pos, &key, &value);) vmm_run_free(value);
  ts_u64map_free(&c->vmm_runs);
}

/* Chunks 1..count-1 of one share's VMM memory (chunk 0 rides on the share). */
struct chunk_set {
  uint64_t alloc_id;
  uint32_t count, n;
  int lost; /* why a chunk's fd could not be kept (errno or TS_FD_OVER_BUDGET), 0 if none */
  int fd[TSHARE_CHUNKS_MAX];
  uint64_t size[TSHARE_CHUNKS_MAX];
};

static void chunk_set_free(tshare_channel *ch, struct chunk_set *set) {
  if (!set) return;
  for (uint32_t i = 0; i < set->n; i++)
    if (set->fd[i] >= 0) {
      close(set->fd[i]);
      ts_conn_hold_fds(&ch->conn, -1);
    }
  free(set);
}

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

static CUresult event_create(const ts_cuda_api *cu, CUevent *ev, unsigned flags) {
  return count_event(cu->cuEventCreate(ev, flags), 1);
}

static CUresult event_open(const ts_cuda_api *cu, CUevent *ev, CUipcEventHandle h) {
  return count_event(cu->cuIpcOpenEventHandle(ev, h), 1);
}

static void event_destroy(const ts_cuda_api *cu, CUevent ev) {
  (void)count_event(cu->cuEventDestroy(ev), -1);
}

/* u64map keys must be nonzero; a buffer id of 0 is not ruled out. */
#define MAPKEY(buffer_id) ((buffer_id) + 1)

static struct ts_cuda_chan *chan_of(tshare_channel *ch) {
  pthread_mutex_lock(&ch->lock);
  if (!ch->cuda) ch->cuda = calloc(1, sizeof *ch->cuda);
  struct ts_cuda_chan *c = ch->cuda;
  pthread_mutex_unlock(&ch->lock);
  return c;
}

/* ---- hello ---------------------------------------------------------------- */

static uint64_t cuda_hello_caps(tshare_channel_kind kind) {
  (void)kind; /* fd handles need a socket: the sender checks the channel before it sends one */
  return TSHARE_CAP_CUDA_IPC | TSHARE_CAP_CUDA_FD | TSHARE_CAP_CUDA_HELD;
}

void ts_cuda_hello_devices(tshare_hello *h) {
  if (!ts_cuda_if_loaded()) return;
  int n = tshare_cuda_device_count();
  for (int i = 0; i < n && h->device_count < TSHARE_HELLO_DEVICES_MAX; i++)
    if (tshare_cuda_device_uuid(i, h->device_uuids[h->device_count]) == TSHARE_OK) h->device_count++;
}

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
  CUresult rc = event_create(cu, &ev, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
  if (rc == CUDA_SUCCESS) {
    CUipcEventHandle h;
    rc = cu->cuIpcGetEventHandle(&h, ev);
    if (rc != CUDA_SUCCESS) event_destroy(cu, ev);
    memcpy(f.u.event.handle, h.reserved, TSHARE_HANDLE_MAX);
  }
  if (rc != CUDA_SUCCESS) {
    *status = ts_cuda_fail(ch->err, sizeof ch->err, "share: creating an inter-process event", rc);
    return -1;
  }
  *status = ts_channel_send(ch, &f, -1, timeout_ms);
  if (*status != TSHARE_OK) {
    event_destroy(cu, ev);
    return -1;
  }
  c->pool[c->nslots] = ev;
  return (int)c->nslots++;
}

void ts_cuda_slot_free(tshare_channel *ch, int slot) {
  if (ch->cuda && slot >= 0 && slot < POOL_MAX) ch->cuda->busy[slot] = false;
}

static int check_can_share(tshare_channel *ch, const char *tag) {
  if (!ch) return TSHARE_E_INVALID_ARG;
  if (ch->closed || ch->conn.wfd < 0)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "share: channel is closed");
  if (!(ch->conn.peer.capabilities & TSHARE_CAP_CUDA_IPC))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                   "share: peer %s was built without CUDA and cannot import GPU memory", ch->conn.peer_label);
  if (tag && strlen(tag) > TSHARE_TAG_MAX)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_TOO_LARGE, "share: tag of %zu bytes over %d", strlen(tag),
                   TSHARE_TAG_MAX);
  if (!chan_of(ch)) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  return TSHARE_OK;
}

/* Whether GPU memory that travels as fds can reach the peer. */
static bool fds_travel(const tshare_channel *ch) {
  return (ts_conn_caps(&ch->conn) & TS_TRANSPORT_PASSES_FDS) && (ch->conn.peer.capabilities & TSHARE_CAP_CUDA_FD);
}

/* Chunks 1..n-1 of VMM memory, each with its fd, before the share that
 * carries chunk 0: the consumer maps them side by side. */
static int send_chunks(tshare_channel *ch, const ts_cuda_export *x, const ts_vmm_chunks *chunks, int64_t deadline) {
  for (int i = 1; i < chunks->n; i++) {
    tshare_frame f;
    memset(&f, 0, sizeof f);
    f.type = TSHARE_FRAME_CHUNK;
    f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
    f.u.chunk.alloc_id = x->buffer_id;
    f.u.chunk.index = (uint32_t)i;
    f.u.chunk.count = (uint32_t)chunks->n;
    f.u.chunk.size = chunks->size[i];
    int rc = ts_channel_send(ch, &f, chunks->fd[i], ts_remaining(deadline));
    if (rc != TSHARE_OK) return rc;
  }
  return TSHARE_OK;
}

/* Fill and send the share (chunks: another allocator's VMM memory, else
 * NULL; held: such memory the peer keeps mapped, named by its id alone, no chunks); e
 * (release, owner, user_data set) is consumed. */
static int send_cuda_share(tshare_channel *ch, const ts_cuda_export *x, const ts_vmm_chunks *chunks, bool held,
                           uint64_t offset, uint32_t origin_pid, uint32_t flags, const tshare_tensor_desc *desc,
                           void *stream, const char *tag, ts_export *e, int timeout_ms, uint64_t *share_id) {
  struct ts_cuda_chan *c = ch->cuda;
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  if ((chunks || x->fd >= 0) && !fds_travel(ch)) {
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
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SHARE;
  tshare_share_frame *s = &f.u.share;
  s->alloc_id = x->buffer_id;
  s->device_type = TSHARE_DEVICE_CUDA;
  if (held) {
    s->mem_kind = TSHARE_MEM_CUDA_HELD;
  } else if (x->fd >= 0) {
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
  e->event_slot = -1;
  int status = TSHARE_OK;
  CUresult rc = CUDA_SUCCESS;
  if (!ts_cuda_push(x->ctx)) {
    status = ts_errf(ch->err, sizeof ch->err, TSHARE_E_CUDA, "share: cannot enter the memory's context");
  } else if ((rc = cu->cuStreamQuery((CUstream)stream)) == CUDA_SUCCESS) {
    /* The work that wrote the tensor has finished: nothing to order the
     * consumer after, so no event (and no slot) at all. */
    ts_cuda_pop();
  } else {
    rc = CUDA_SUCCESS;
    int slot = pool_take(ch, c, x->ctx, timeout_ms, &status);
    if (status == TSHARE_OK && slot >= 0) {
      /* The consumer's stream waits for this point of ours: no host sync. */
      rc = cu->cuEventRecord(c->pool[slot], (CUstream)stream);
      if (rc == CUDA_SUCCESS) {
        c->busy[slot] = true;
        e->event_slot = slot;
        f.flags |= TSHARE_FRAME_FLAG_HAS_EVENT;
        s->event_slot = (uint32_t)slot;
        s->event_generation = ++c->gen[slot];
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
  if (status == TSHARE_OK && several) status = send_chunks(ch, x, chunks, deadline);
  if (status != TSHARE_OK) {
    if (e->event_slot >= 0) c->busy[e->event_slot] = false;
    ts_export_drop(e);
    return status;
  }
  return ts_share_send_export(ch, &f, x->fd, e, ts_remaining(deadline), share_id);
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
  if (rc == TSHARE_OK) rc = check_can_share(ch, tag);
  ts_cuda_export x;
  /* Memory another allocator mapped with the VMM calls (PyTorch's
   * expandable segments): the chunks the tensor touches travel as fds. */
  static _Thread_local ts_vmm_chunks chunks; /* 7 KiB: not on the stack */
  chunks.n = 0;
  CUdeviceptr ptr = (CUdeviceptr)(uintptr_t)data;
  uint64_t span_end = 0;
  bool vmm = rc == TSHARE_OK && ts_cuda_is_foreign_vmm(ptr), owned = false, watched = false, held = false;
  struct ts_cuda_chan *c = vmm ? chan_of(ch) : NULL;
  if (vmm && !c) rc = ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  if (vmm && rc == TSHARE_OK) {
    char why[160];
    rc = ts_tensor_check(desc, UINT64_C(1) << 62, NULL, &span_end, why, sizeof why);
    if (rc != TSHARE_OK) ts_errf(ch->err, sizeof ch->err, rc, "share: %s", why);
    if (rc == TSHARE_OK) rc = ts_cuda_export_vmm(ptr, span_end, &x, &chunks, ch->err, sizeof ch->err);
    /* VMM chunks stay alive in the consumer's mapping whatever their owner
     * does, so it may keep them mapped while idle: this end watches them
     * and says when they change (a retire notice). */
    if (rc == TSHARE_OK && fds_travel(ch))
      rc = vmm_fds(ch, c, x.buffer_id, &chunks, &owned, &watched, &held); /* else refused below */
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
                  ts_anchor_share(&ch->cuda->anchors, x.buffer_id, &drop, &keep);
  e->release = drop;
  e->owner = keep;
  e->user_data = user_data;
  uint32_t flags = watched || anchored ? TSHARE_SHARE_FLAG_RETIRE_NOTICE : 0;
  if (watched && !held && (ch->conn.peer.capabilities & TSHARE_CAP_CUDA_HELD)) flags |= TSHARE_SHARE_FLAG_HOLD_OFFER;
  rc = send_cuda_share(ch, &x, vmm && !held ? &chunks : NULL, held, (uint64_t)(ptr - x.base), (uint32_t)getpid(),
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

static int share_cuda_buffer(tshare_channel *ch, tshare_cuda_buffer *buf, const tshare_tensor_desc *desc, void *stream,
                             const char *tag, void *user_data, int timeout_ms, uint64_t *share_id) {
  if (!buf || !desc) return ch ? ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG, "share: NULL argument")
                               : TSHARE_E_INVALID_ARG;
  int rc = check_can_share(ch, tag);
  if (rc != TSHARE_OK) return rc;
  /* The layout must stay inside the buffer, not just inside its slab. */
  char why[160];
  rc = ts_tensor_check(desc, tshare_cuda_buffer_size(buf), NULL, NULL, why, sizeof why);
  if (rc != TSHARE_OK) return ts_errf(ch->err, sizeof ch->err, rc, "share: %s", why);
  ts_cuda_alloc *a = ts_cuda_buffer_alloc(buf);
  const ts_cuda_export *x = ts_cuda_alloc_export(a);
  struct ts_cuda_chan *c = ch->cuda;
  uint32_t flags = 0;
  if (ch->conn.minor >= 1) {
    /* The peer may keep this allocation mapped while idle; the memory is
     * freed only after it said it closed it (retire handshake). */
    flags = TSHARE_SHARE_FLAG_RETIRE_NOTICE;
    if (!ts_u64map_get(&c->mapped, MAPKEY(x->buffer_id))) {
      peer_mapped *pm = calloc(1, sizeof *pm);
      if (!pm || ts_u64map_put(&c->mapped, MAPKEY(x->buffer_id), pm) != 0) {
        free(pm);
        return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
      }
      pm->alloc = a;
      ts_cuda_alloc_peer_retain(a);
    }
  }
  ts_export *e = calloc(1, sizeof *e);
  if (!e) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "share: out of memory");
  e->release = ts_cuda_buffer_release_cb;
  e->owner = buf;
  e->user_data = user_data;
  ts_cuda_buffer_retain(buf);
  return send_cuda_share(ch, x, NULL, false, ts_cuda_buffer_offset(buf), (uint32_t)getpid(), flags, desc, stream, tag,
                         e, timeout_ms, share_id);
}

int tshare_share_cuda_buffer(tshare_channel *ch, tshare_cuda_buffer *buf, const tshare_tensor_desc *desc, void *stream,
                             const char *tag, void *user_data, int timeout_ms, uint64_t *share_id) {
  if (share_id) *share_id = 0;
  if (!ch) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "share", share_cuda_buffer(ch, buf, desc, stream, tag, user_data, timeout_ms, share_id));
}

static int cuda_share_view(tshare_channel *ch, tshare_view *v, const tshare_tensor_desc *desc, void *stream,
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
  x.fd = ts_cuda_import_fd(v->cuda_import);
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

static int cuda_import_set(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, tshare_view *v,
                           const struct chunk_set *set, ts_cuda_mapping **held);

static int cuda_import(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, tshare_view *v) {
  struct ts_cuda_chan *c = chan_of(ch);
  struct chunk_set *set = c ? ts_u64map_remove(&c->chunk_sets, f->u.share.share_id + 1) : NULL;
  ts_cuda_mapping *held = c ? ts_u64map_remove(&c->held_refs, f->u.share.share_id + 1) : NULL;
  int status = cuda_import_set(ch, f, fdp, stream, v, set, &held);
  chunk_set_free(ch, set); /* mapped or not, their fds are done with */
  if (held) ts_cuda_import_put(held); /* not taken by a view */
  return status;
}

/* After a VMM share of a watched run came in with its fds: keep the mapping
 * (a reference of its own) and tell the peer, which sends the run's next
 * shares without them. Best effort: without it the fds keep coming. */
static void pin(tshare_channel *ch, struct ts_cuda_chan *c, uint64_t alloc_id, ts_cuda_mapping *imp) {
  if (!(ch->conn.peer.capabilities & TSHARE_CAP_CUDA_HELD) || c->pins.count >= PINS_MAX ||
      ts_u64map_get(&c->pins, alloc_id + 1))
    return;
  if (!id_list_push(&c->holds, alloc_id)) return;
  if (ts_u64map_put(&c->pins, alloc_id + 1, imp) != 0) {
    c->holds.n--;
    return;
  }
  ts_cuda_import_hold(imp, false);
}

static void unpin(struct ts_cuda_chan *c, uint64_t alloc_id) {
  ts_cuda_mapping *imp = ts_u64map_remove(&c->pins, alloc_id + 1);
  if (imp) ts_cuda_import_put(imp);
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
  if (status == TSHARE_OK && vmm && (s->share_flags & TSHARE_SHARE_FLAG_HOLD_OFFER)) pin(ch, c, s->alloc_id, *imp);
  return status;
}

static int cuda_import_set(tshare_channel *ch, const tshare_frame *f, int *fdp, void *stream, tshare_view *v,
                           const struct chunk_set *set, ts_cuda_mapping **held) {
  const tshare_share_frame *s = &f->u.share;
  int status = TSHARE_OK;
  const ts_cuda_api *cu = ts_cuda_require(ch->err, sizeof ch->err, &status);
  if (!cu) return status;
  struct ts_cuda_chan *c = chan_of(ch);
  if (!c) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "import: out of memory");
  uint32_t origin = s->origin_pid ? s->origin_pid : ch->conn.peer.pid;
  if (origin == (uint32_t)getpid())
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "import: share %llu is memory of this very process, forwarded back to its owner",
                   (unsigned long long)s->share_id);
  char uuid[48];
  tshare_cuda_uuid_format(s->device_uuid, uuid, sizeof uuid);
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
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NO_DEVICE,
                   "import: share %llu lives on %s, which this process does not see (CUDA_VISIBLE_DEVICES=%s); "
                   "receive it on a stream of a GPU that can reach it",
                   (unsigned long long)s->share_id, uuid, cvd ? cvd : "unset");
  }
  CUdevice here = -1;
  if (ts_cuda_push(ctx)) {
    cu->cuCtxGetDevice(&here);
    ts_cuda_pop();
  }
  if (owner_dev >= 0 && here != owner_dev) {
    int can = 0;
    CUdevice a, b;
    if (cu->cuDeviceGet(&a, here) == CUDA_SUCCESS && cu->cuDeviceGet(&b, owner_dev) == CUDA_SUCCESS)
      cu->cuDeviceCanAccessPeer(&can, a, b);
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
        rc = event_open(cu, &pe->ev, pe->handle);
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
    if (status != TSHARE_OK) {
      ts_cuda_import_put(imp);
      return status;
    }
  }
  v->cuda_import = imp;
  v->stream = stream;
  v->ctx = ctx;
  v->cuda_device = (int)here;
  v->data = (void *)(uintptr_t)(ts_cuda_import_ptr(imp) + s->tensor.byte_offset);
  return TSHARE_OK;
}

static bool push_drain_locked(struct ts_cuda_chan *c, uint64_t share_id, CUevent done, CUcontext ctx,
                              ts_cuda_mapping *imp) {
  if (c->ndrain == c->cap_drain) {
    size_t cap = c->cap_drain ? c->cap_drain * 2 : 16;
    drain *d = realloc(c->drains, cap * sizeof *d);
    if (!d) return false;
    c->drains = d;
    c->cap_drain = cap;
  }
  c->drains[c->ndrain++] = (drain){share_id, done, ctx, imp, ts_now_us()};
  return true;
}

static CUevent spare_take_locked(struct ts_cuda_chan *c, CUcontext ctx) {
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
  else event_destroy(cu, ev);
}

static void cuda_view_release(tshare_view *v) {
  tshare_channel *ch = v->ch;
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
      done = ch->cuda ? spare_take_locked(ch->cuda, v->ctx) : NULL;
      pthread_mutex_unlock(&ch->lock);
      if (!done && event_create(cu, &done, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) done = NULL;
      if (done && cu->cuEventRecord(done, (CUstream)v->stream) != CUDA_SUCCESS) {
        event_destroy(cu, done);
        done = NULL;
      }
    }
    ts_cuda_pop();
  }
  pthread_mutex_lock(&ch->lock);
  bool queued = !idle && !ch->closed && ch->cuda && done &&
                push_drain_locked(ch->cuda, v->share_id, done, v->ctx, v->cuda_import);
  if (queued) {
    ts_conn_wake(&ch->conn);
  } else {
    /* An idle stream, a closed channel, or no event: finish here (waiting
     * for the GPU in the last two cases). */
    if (done) {
      cu->cuEventSynchronize(done);
      event_destroy(cu, done);
    } else if (!idle && cu && ts_cuda_push(v->ctx)) {
      cu->cuStreamSynchronize((CUstream)v->stream);
      ts_cuda_pop();
    }
    ts_cuda_import_put(v->cuda_import);
    ts_share_queue_release_locked(ch, v->share_id);
  }
  pthread_mutex_unlock(&ch->lock);
  if (!queued) ts_share_send_releases_now(ch);
  free(v);
  ts_channel_unref(ch);
}

/* ---- frames and housekeeping --------------------------------------------- */

int ts_cuda_on_frame(tshare_channel *ch, const tshare_frame *f) {
  struct ts_cuda_chan *c = chan_of(ch);
  if (!c) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  if (f->type == TSHARE_FRAME_EVENT) {
    if (!c->events && !(c->events = calloc(TSHARE_EVENT_SLOTS_MAX, sizeof *c->events)))
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
    peer_event *pe = &c->events[f->u.event.slot];
    if (pe->announced)
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL, "event: slot %u announced twice", f->u.event.slot);
    pe->announced = true;
    memcpy(pe->handle.reserved, f->u.event.handle, TSHARE_HANDLE_MAX);
    return TSHARE_OK;
  }
  const tshare_retire_frame *r = &f->u.retire;
  for (uint32_t i = 0; i < r->count; i++) {
    if (r->closed == 1) { /* our peer closed its mapping: one reference less on the memory */
      peer_mapped *pm = ts_u64map_remove(&c->mapped, MAPKEY(r->alloc_ids[i]));
      if (pm) {
        ts_cuda_alloc_peer_release(pm->alloc);
        free(pm);
      } else {
        (void)ts_anchor_closed(&c->anchors, r->alloc_ids[i]);
      }
    } else if (r->closed == 2) { /* our peer keeps this run mapped: its next shares go without fds */
      struct vmm_run *run = ts_u64map_get(&c->vmm_runs, r->alloc_ids[i] + 1);
      if (run) { /* else retired meanwhile: the peer hears of it */
        run->peer_holds = true;
        run_close_fds(run); /* its mapping holds the memory: no share of it needs them now */
      }
    } else { /* the owner frees it: close it (now if idle) and say so */
      unpin(c, r->alloc_ids[i]);
      TS_LOG(TS_LOG_DEBUG, "peer %s retires allocation %llu", ch->conn.peer_label, (unsigned long long)r->alloc_ids[i]);
      ts_cuda_import_retire(ch->conn.peer_key, r->alloc_ids[i]);
      if (!id_list_push(&c->acks, r->alloc_ids[i]))
        return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "retire: out of memory");
    }
  }
  return TSHARE_OK;
}

int ts_cuda_on_chunk(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost) {
  struct ts_cuda_chan *c = chan_of(ch);
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
static int take_held(tshare_channel *ch, const tshare_share_frame *s) {
  struct ts_cuda_chan *c = chan_of(ch);
  ts_cuda_mapping *imp = c ? ts_u64map_get(&c->pins, s->alloc_id + 1) : NULL;
  if (!imp)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "share %llu: peer %s names VMM memory %llu, which this end does not keep mapped",
                   (unsigned long long)s->share_id, ch->conn.peer_label, (unsigned long long)s->alloc_id);
  if (ts_u64map_put(&c->held_refs, s->share_id + 1, imp) != 0)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory");
  ts_cuda_import_hold(imp, true);
  return TSHARE_OK;
}

/* What a share brought beside its frame (a chunk set's fds, a reference to a
 * kept mapping) is filed under its id until it is imported or dropped: a
 * second share with an id that waits would orphan the first's. */
static int refuse_repeated_id(tshare_channel *ch, struct ts_cuda_chan *c, uint64_t share_id) {
  chunk_set_free(ch, c->gathering); /* the repeated share's own chunks */
  c->gathering = NULL;
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                 "share %llu: peer %s sent this share id again while its first share waits to be received",
                 (unsigned long long)share_id, ch->conn.peer_label);
}

static bool share_id_waits(const struct ts_cuda_chan *c, uint64_t share_id) {
  return ts_u64map_get(&c->chunk_sets, share_id + 1) || ts_u64map_get(&c->held_refs, share_id + 1);
}

int ts_cuda_on_share(tshare_channel *ch, const tshare_frame *f) {
  struct ts_cuda_chan *c = ch->cuda;
  if (c && share_id_waits(c, f->u.share.share_id)) return refuse_repeated_id(ch, c, f->u.share.share_id);
  if (f->u.share.mem_kind == TSHARE_MEM_CUDA_HELD && (!c || !c->gathering)) return take_held(ch, &f->u.share);
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
  if (rc != TSHARE_OK) chunk_set_free(ch, set);
  return rc;
}

void ts_cuda_drop_chunks(tshare_channel *ch, uint64_t share_id) {
  struct ts_cuda_chan *c = ch->cuda;
  if (!c) return;
  chunk_set_free(ch, ts_u64map_remove(&c->chunk_sets, share_id + 1));
  ts_cuda_mapping *held = ts_u64map_remove(&c->held_refs, share_id + 1);
  if (held) ts_cuda_import_put(held);
}

/* ids in retire frames (closed as given), in order; *sent (optional): how
 * many went before a frame could not, which the caller must not send again. */
static int send_retire(tshare_channel *ch, uint8_t closed, const uint64_t *ids, size_t n, int timeout_ms,
                       size_t *sent) {
  int64_t deadline = ts_deadline(timeout_ms);
  int rc = TSHARE_OK;
  size_t at = 0;
  while (at < n && rc == TSHARE_OK) {
    tshare_frame f;
    memset(&f, 0, sizeof f);
    f.type = TSHARE_FRAME_RETIRE;
    f.u.retire.closed = closed;
    for (size_t i = at; i < n && f.u.retire.count < TSHARE_RELEASE_MAX; i++)
      f.u.retire.alloc_ids[f.u.retire.count++] = ids[i];
    rc = ts_channel_send(ch, &f, -1, ts_remaining(deadline));
    if (rc == TSHARE_OK) at += f.u.retire.count;
  }
  if (sent) *sent = at;
  return rc;
}

/* The ids of l in retire frames (closed as given); those that went leave l,
 * the rest go with a later flush. */
static int send_ids(tshare_channel *ch, uint8_t closed, id_list *l, int timeout_ms) {
  size_t sent = 0;
  int rc = l->n ? send_retire(ch, closed, l->ids, l->n, timeout_ms, &sent) : TSHARE_OK;
  id_list_drop_front(l, sent);
  return rc;
}

/* Runs whose chunks were unmapped and segments idle long enough: their
 * retire notices queued (up to one frame's worth a look; room is made
 * first, so that nothing is marked that the queue could not take). */
static bool queue_watched_retires(struct ts_cuda_chan *c, const ts_cuda_api *cu, int64_t now) {
  if (!id_list_reserve(&c->retires, TSHARE_RELEASE_MAX)) return false;
  uint64_t *ids = c->retires.ids + c->retires.n;
  size_t n = cu && c->vmm_runs.count ? vmm_runs_gone(c, cu, ids, TSHARE_RELEASE_MAX) : 0;
  n += ts_anchors_idle(&c->anchors, now, ids + n, TSHARE_RELEASE_MAX - n);
  c->retires.n += n;
  return true;
}

/* Owned allocations nobody holds any more: the peer is told, closes them
 * and answers; the memory is freed after the answer. Their notices queued
 * (up to one frame's worth a flush). */
static bool queue_unused_allocs(struct ts_cuda_chan *c) {
  if (!c->mapped.count) return true;
  if (!id_list_reserve(&c->retires, TSHARE_RELEASE_MAX)) return false;
  uint64_t key;
  void *value;
  for (size_t pos = 0, n = 0; n < TSHARE_RELEASE_MAX && ts_u64map_next(&c->mapped, &pos, &key, &value);) {
    peer_mapped *pm = value;
    if (pm->retire_queued || !ts_cuda_alloc_unused(pm->alloc)) continue;
    pm->retire_queued = true;
    c->retires.ids[c->retires.n++] = key - 1;
    n++;
  }
  return true;
}

static int retire_nomem(tshare_channel *ch) {
  return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "retire: out of memory");
}

int ts_cuda_flush(tshare_channel *ch, int timeout_ms, ts_gpu_wait *busy) {
  *busy = TS_GPU_IDLE;
  struct ts_cuda_chan *c = ch->cuda;
  if (!c) return TSHARE_OK;
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  pthread_mutex_lock(&ch->lock);
  size_t keep = 0;
  int64_t newest = 0;
  for (size_t i = 0; i < c->ndrain; i++) {
    drain d = c->drains[i];
    if (cu && cu->cuEventQuery(d.done) == CUDA_ERROR_NOT_READY) {
      c->drains[keep++] = d;
      if (d.queued_us > newest) newest = d.queued_us;
      continue;
    }
    if (cu) spare_put_locked(c, cu, d.ctx, d.done);
    ts_cuda_import_put(d.imp);
    ts_share_queue_release_locked(ch, d.share_id);
  }
  c->ndrain = keep;
  if (keep) *busy = ts_now_us() - newest < TS_GPU_SPIN_US ? TS_GPU_SOON : TS_GPU_LATER;
  pthread_mutex_unlock(&ch->lock);

  int64_t deadline = ts_deadline(timeout_ms);
  int64_t now = ts_now_us();
  if ((c->vmm_runs.count || ts_anchors_count(&c->anchors)) && now - c->watched_checked_us >= WATCH_CHECK_US) {
    c->watched_checked_us = now;
    if (!queue_watched_retires(c, cu, now)) return retire_nomem(ch);
  }
  if (!queue_unused_allocs(c)) return retire_nomem(ch);
  int rc = send_ids(ch, 0, &c->retires, ts_remaining(deadline));
  if (rc == TSHARE_OK) rc = send_ids(ch, 2, &c->holds, ts_remaining(deadline));
  if (rc == TSHARE_OK) rc = send_ids(ch, 1, &c->acks, ts_remaining(deadline));
  return rc;
}

void ts_cuda_before_close(tshare_channel *ch, int timeout_ms) {
  struct ts_cuda_chan *c = ch->cuda;
  if (!c || !ts_anchors_count(&c->anchors)) return;
  int64_t deadline = ts_deadline(timeout_ms);
  /* Notices queued earlier go too: the wait below is for their answers as well. */
  size_t n;
  do {
    if (!id_list_reserve(&c->retires, TSHARE_RELEASE_MAX)) return;
    n = ts_anchors_retire_all(&c->anchors, c->retires.ids + c->retires.n, TSHARE_RELEASE_MAX);
    c->retires.n += n;
  } while (n > 0);
  if (send_ids(ch, 0, &c->retires, ts_remaining(deadline)) != TSHARE_OK) return;
  /* A peer that hangs up has closed its idle mappings first (its close, or
   * its exit, does that before the socket goes). */
  while (ts_anchors_pending(&c->anchors) && ts_remaining(deadline) != 0) {
    int rc = ts_share_drive(ch, ts_remaining(deadline));
    if (rc != TSHARE_OK && rc != TSHARE_END) break;
  }
}

static void cuda_peer_gone(tshare_channel *ch) {
  struct ts_cuda_chan *c = ch->cuda;
  if (!c) return;
  uint64_t key;
  void *value;
  for (size_t pos = 0; ts_u64map_next(&c->mapped, &pos, &key, &value);) {
    peer_mapped *pm = value;
    ts_cuda_alloc_peer_release(pm->alloc);
    free(pm);
  }
  ts_u64map_free(&c->mapped);
  vmm_runs_free(c);
  ts_anchors_drop_all(&c->anchors);
  for (size_t pos = 0; ts_u64map_next(&c->pins, &pos, &key, &value);) ts_cuda_import_put(value);
  ts_u64map_free(&c->pins);
  c->holds.n = 0;
  c->retires.n = 0;
  if (ch->conn.peer_key) ts_cuda_import_origin_gone(ch->conn.peer_key);
}

static void cuda_chan_free(tshare_channel *ch) {
  struct ts_cuda_chan *c = ch->cuda;
  if (!c) return;
  cuda_peer_gone(ch);
  const ts_cuda_api *cu = ts_cuda_if_loaded();
  for (size_t i = 0; i < c->ndrain; i++) {
    if (cu) {
      cu->cuEventSynchronize(c->drains[i].done);
      event_destroy(cu, c->drains[i].done);
    }
    ts_cuda_import_put(c->drains[i].imp);
  }
  chunk_set_free(ch, c->gathering);
  c->gathering = NULL;
  uint64_t key;
  void *set;
  for (size_t i = 0; ts_u64map_next(&c->chunk_sets, &i, &key, &set);) chunk_set_free(ch, set);
  ts_u64map_free(&c->chunk_sets);
  for (size_t i = 0; ts_u64map_next(&c->held_refs, &i, &key, &set);) ts_cuda_import_put(set);
  ts_u64map_free(&c->held_refs);
  free(c->holds.ids);
  if (cu) {
    for (uint32_t i = 0; i < c->nslots; i++) event_destroy(cu, c->pool[i]);
    for (uint32_t i = 0; c->events && i < TSHARE_EVENT_SLOTS_MAX; i++)
      if (c->events[i].ev) event_destroy(cu, c->events[i].ev);
    for (size_t i = 0; i < c->nspares; i++) event_destroy(cu, c->spares[i].ev);
  }
  free(c->events);
  free(c->drains);
  free(c->acks.ids);
  free(c->retires.ids);
  free(c);
  ch->cuda = NULL;
}

const ts_backend ts_cuda_backend = {
    .name = "cuda",
    .hello_caps = cuda_hello_caps,
    .import = cuda_import,
    .release = cuda_view_release,
    .share_view = cuda_share_view,
    .peer_gone = cuda_peer_gone,
    .chan_free = cuda_chan_free,
};
