/* Tensor sets (set.h) on the consumer side: the assembly of a set's frames
 * (wire.h: begin, memories, members, metadata, end) into a set whose
 * tensors stay valid until the set and every view taken from it are
 * released, in one release of its id. Each memory of a set is mapped once
 * through the backend of its kind, like a share's allocation; device
 * memories are let go of together through its set_release hook, which may
 * hold the release until the GPU work on them ran. The producer's side:
 * session_set_send.c.
 * One concern: a received set, from its first frame to its release; its
 * steps share the set under assembly, which no other file needs to see. */
#include "tshare/set.h"

#include "backend.h"
#include "session.h"
#include "error_detail.h"
#include "log.h"
#include "session_set.h"
#include "spare_blocks.h"
#include "wire_checks.h"

#include <errno.h>
#include <stdarg.h>
#include <sched.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>


/* ---- names: unique in a set, looked up by hash ---------------------------- */

/* FNV-1a, kept off the map's reserved keys 0 and UINT64_MAX. */
static uint64_t name_hash(const char *name) {
  uint64_t h = 1469598103934665603ull;
  for (const unsigned char *p = (const unsigned char *)name; *p; p++) h = (h ^ *p) * 1099511628211ull;
  return h % (UINT64_MAX - 1) + 1;
}

/* The index of name among the n names of owner, or -1. The map holds the
 * first name of each hash; a different name with the same hash is found by
 * a scan, so a collision costs time, never a wrong answer. */
long ts_set_name_lookup(const ts_u64map *index, const char *name, ts_set_name_at_fn name_at, const void *owner, size_t n) {
  void *hit = ts_u64map_get(index, name_hash(name));
  if (!hit) return -1;
  size_t first = (size_t)(uintptr_t)hit - 1;
  if (strcmp(name_at(owner, first), name) == 0) return (long)first;
  for (size_t i = 0; i < n; i++)
    if (strcmp(name_at(owner, i), name) == 0) return (long)i;
  return -1;
}

/* Record name i (known not to be a duplicate): 0, or -1 out of memory. */
int ts_set_name_insert(ts_u64map *index, const char *name, size_t i) {
  uint64_t h = name_hash(name);
  if (ts_u64map_get(index, h)) return 0;
  return ts_u64map_put(index, h, (void *)(uintptr_t)(i + 1));
}

/* ---- consumer: a received set ------------------------------------------- */

typedef struct set_entry {
  uint32_t name_at; /* offset in names */
  uint32_t mem;
  tshare_tensor_desc desc; /* its place: at byte_offset of its memory's base */
} set_entry;

/* One memory of a set, mapped by the backend of its kind. */
typedef struct set_mem {
  const ts_backend *backend;
  void *memory; /* the backend's mapping, one reference of the set's */
  void *base;   /* its first byte; NULL when empty */
  uint64_t alloc_id, size;
  /* device memory: where it is mapped, and what a view shared on names */
  void *ctx;
  int device;
  uint8_t mem_kind, device_type, handle_len;
  uint32_t share_flags;
  uint8_t handle[TSHARE_HANDLE_MAX];
  uint8_t device_uuid[16];
} set_mem;

struct tshare_set {
  tshare_channel *ch; /* a reference once handed to the user */
  uint64_t set_id;
  atomic_int refs; /* the handle + one per view */
  uint32_t count, mem_count, names_bytes, meta_len;
  uint32_t mems_got, members_got, names_got, meta_got;
  uint64_t copied;     /* bytes its memories copied into this process (remote memory) */
  bool released_back;  /* a copy: released back once complete, not at its last reference */
  uint8_t layout_slot; /* 1..TSHARE_SET_LAYOUT_SLOTS: its begin frame asked this end to keep its layout */
  set_mem *mems;
  struct set_catalog *catalog; /* its members and names */
  uint8_t *meta;
};

/* A set's members (over 500 bytes each), their names and the index of the
 * names: written as the members come, read-only once the set is whole, and
 * then shared (counted) by the layout kept of it and every set sent again
 * from that layout. A model sent again costs no copy of its hundreds of
 * members (each set has memories of its own; a member's data is its
 * memory's base plus its offset). */
typedef struct set_catalog {
  atomic_int refs;
  uint64_t layout_id; /* non-zero once a layout kept of it: tshare_set_layout() */
  set_entry *entries;
  char *names; /* each NUL-terminated */
  ts_u64map by_name;
} set_catalog;

/* Members and names are large blocks, allocated per set whole (glibc
 * consolidates its fast bins first at that size): spares are kept. */
static ts_spare_blocks spare_entries, spare_mems, spare_names;

/* Layout ids count up per process: one names one catalog for good. */
static atomic_uint_least64_t next_layout_id = 1;

static set_catalog *catalog_ref(set_catalog *c) {
  if (c) atomic_fetch_add(&c->refs, 1);
  return c;
}

static void catalog_unref(set_catalog *c) {
  if (!c || atomic_fetch_sub(&c->refs, 1) != 1) return;
  ts_spare_free(&spare_entries, c->entries);
  ts_spare_free(&spare_names, c->names);
  ts_u64map_free(&c->by_name);
  free(c);
}

/* An empty catalog for count members and names_bytes of names, or NULL. */
static set_catalog *catalog_new(uint32_t count, uint32_t names_bytes) {
  set_catalog *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  atomic_init(&c->refs, 1);
  c->entries = ts_spare_alloc(&spare_entries, count * sizeof *c->entries);
  c->names = ts_spare_alloc(&spare_names, (size_t)names_bytes + count);
  if (!c->entries || !c->names) {
    catalog_unref(c);
    return NULL;
  }
  return c;
}

static const set_entry *entry_of(const tshare_set *s, size_t i) { return &s->catalog->entries[i]; }
static const char *name_of(const tshare_set *s, size_t i) { return s->catalog->names + entry_of(s, i)->name_at; }

/* Where member e of s starts: NULL in empty memory. */
static void *member_data(const tshare_set *s, const set_entry *e) {
  void *base = s->mems[e->mem].base;
  return base ? (char *)base + e->desc.byte_offset : NULL;
}

/* A set member's view: the view, and the set it keeps alive. */
typedef struct set_view {
  struct tshare_view view; /* first: freed through its address */
  tshare_set *set;
  const ts_backend *mem_backend; /* of its memory */
  size_t member;
  _Atomic int described; /* VIEW_*: its desc and frame, filled when first read */
} set_view;

enum { VIEW_UNDESCRIBED = 0, VIEW_DESCRIBING, VIEW_DESCRIBED };

/* The channel's sets: the one being received, and those complete but not yet
 * taken by tshare_set_recv(). */
#define TS_SETS_WAITING_MAX 64
typedef struct ts_set_rx {
  tshare_set *partial;
  uint64_t refused_id; /* frames of a refused set that still come are dropped */
  tshare_set *waiting[TS_SETS_WAITING_MAX];
  size_t head, len;
  int refusal; /* the status of a set refused since the last tshare_set_recv(), with its detail */
  char refusal_msg[TSHARE_ERROR_MSG_MAX];
  /* Layouts kept for sets sent again (TSHARE_SET_AGAIN): each a set that
   * came whole, its members and memories without mappings, the memories
   * named by the kinds this end keeps them mapped as; its set_id is the
   * layout id. */
  tshare_set *layouts[TSHARE_SET_LAYOUT_SLOTS];
} ts_set_rx;

/* Drop the set's mappings (ch->lock held): all of them, or the host ones
 * only (the device ones went through the backend's set_release). */
static void drop_mappings_locked(tshare_channel *ch, tshare_set *s, bool device_too) {
  for (uint32_t i = 0; i < s->mems_got; i++)
    if (device_too || !s->mems[i].backend->set_release) s->mems[i].backend->memory_unref_locked(ch, s->mems[i].memory);
  s->mems_got = 0;
}

/* The set's device memories (of one backend: the producer's builder sends
 * no other) let go of through it: TS_RELEASE_LATER when it queues the
 * set's release itself, once the GPU work on them ran. */
static ts_release_done release_device_memories(tshare_channel *ch, tshare_set *s) {
  const ts_backend *device = NULL;
  void **memories = NULL;
  size_t n = 0;
  bool no_room = false;
  for (uint32_t i = 0; i < s->mems_got; i++) {
    if (!s->mems[i].backend->set_release) continue;
    if (!memories && !(memories = malloc(s->mems_got * sizeof *memories))) {
      no_room = true;
      break;
    }
    device = s->mems[i].backend;
    memories[n++] = s->mems[i].memory;
  }
  ts_release_done done = TS_RELEASE_NOW;
  if (n) {
    done = device->set_release(ch, memories, n, s->set_id);
  } else if (no_room) { /* out of memory for the list: one by one, not waiting for the GPU */
    pthread_mutex_lock(&ch->lock);
    for (uint32_t i = 0; i < s->mems_got; i++)
      if (s->mems[i].backend->set_release) s->mems[i].backend->memory_unref_locked(ch, s->mems[i].memory);
    pthread_mutex_unlock(&ch->lock);
  }
  free(memories);
  return done;
}

static void set_free(tshare_set *s) {
  ts_spare_free(&spare_mems, s->mems);
  catalog_unref(s->catalog);
  free(s->meta);
  free(s);
}

/* The last reference went: its memory is let go of and the producer told,
 * in one release of the set's id. */
static void set_unref(tshare_set *s) {
  if (atomic_fetch_sub(&s->refs, 1) != 1) return;
  tshare_channel *ch = s->ch;
  if (ts_channel_foreign(ch)) { /* a forked child's copy: only its own mappings go */
    for (uint32_t i = 0; i < s->mems_got; i++)
      if (s->mems[i].backend->memory_unref_in_child) s->mems[i].backend->memory_unref_in_child(ch, s->mems[i].memory);
  } else {
    ts_release_done device = release_device_memories(ch, s);
    pthread_mutex_lock(&ch->lock);
    drop_mappings_locked(ch, s, false);
    if (device == TS_RELEASE_NOW && !s->released_back) ts_share_queue_release_locked(ch, s->set_id);
    pthread_mutex_unlock(&ch->lock);
    ts_share_send_releases_now(ch);
    TS_LOG(TS_LOG_INFO, "released tensor set %llu of %s", (unsigned long long)s->set_id, ch->conn.peer_label);
  }
  set_free(s);
  ts_channel_unref(ch);
}

static ts_set_rx *set_rx(tshare_channel *ch) {
  if (!ch->set_rx) ch->set_rx = calloc(1, sizeof *ch->set_rx);
  return ch->set_rx;
}

/* The reason set_id was refused waits for tshare_set_recv(). */
static void note_refusal(tshare_channel *ch, ts_set_rx *rx, int status, uint64_t set_id, bool told, const char *why) {
  rx->refusal = status;
  ts_errf(rx->refusal_msg, sizeof rx->refusal_msg, status, "receive: refused tensor set %llu from peer %s: %s%s",
          (unsigned long long)set_id, ch->conn.peer_label, why, told ? "; released back" : "");
  TS_LOG(TS_LOG_WARN, "%s", rx->refusal_msg);
}

/* Slot (1..TSHARE_SET_LAYOUT_SLOTS) holds no layout now, and the peer,
 * which may count on layout_id there, is told that it is lost. */
static void drop_layout(tshare_channel *ch, ts_set_rx *rx, unsigned slot, uint64_t layout_id) {
  tshare_set **kept = &rx->layouts[slot - 1];
  if (*kept) set_free(*kept);
  *kept = NULL;
  pthread_mutex_lock(&ch->lock);
  ts_set_notice_dropped_locked(ch, slot, layout_id);
  pthread_mutex_unlock(&ch->lock);
}

/* The set in progress is refused: its mappings go, the peer gets its release
 * back (unless it is gone), and the reason waits for tshare_set_recv(). A
 * set whose begin asked for a layout slot leaves that slot empty: the peer
 * gave it to this set's layout, which is not kept. */
TS_PRINTF(4, 5) static int refuse_set(tshare_channel *ch, int status, bool tell_peer, const char *fmt, ...) {
  ts_set_rx *rx = ch->set_rx;
  tshare_set *s = rx->partial;
  char why[TSHARE_ERROR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  rx->partial = NULL;
  rx->refused_id = s->set_id;
  if (tell_peer && s->layout_slot) drop_layout(ch, rx, s->layout_slot, s->set_id);
  pthread_mutex_lock(&ch->lock);
  drop_mappings_locked(ch, s, true);
  if (tell_peer) ts_share_queue_release_locked(ch, s->set_id);
  pthread_mutex_unlock(&ch->lock);
  note_refusal(ch, rx, status, s->set_id, tell_peer, why);
  set_free(s);
  return TSHARE_OK;
}

/* A set begins: with a catalog of its own to fill, or (sent again) with
 * the layout's catalog, shared. */
static int begin_set(tshare_channel *ch, ts_set_rx *rx, const tshare_set_frame *f, set_catalog *shared) {
  const tshare_set_begin_frame *b = &f->u.begin;
  tshare_set *s = calloc(1, sizeof *s);
  if (s) {
    s->set_id = f->set_id;
    s->count = b->count;
    s->mem_count = b->mem_count;
    s->names_bytes = b->names_bytes;
    s->meta_len = b->meta_bytes;
    s->layout_slot = b->layout_slot;
    s->mems = ts_spare_alloc(&spare_mems, b->mem_count * sizeof *s->mems);
    s->catalog = shared ? catalog_ref(shared) : catalog_new(b->count, b->names_bytes);
    s->meta = b->meta_bytes ? malloc(b->meta_bytes) : NULL;
  }
  rx->partial = s;
  if (!s || !s->mems || !s->catalog || (b->meta_bytes && !s->meta)) {
    if (!s) { /* nothing to keep: released back at once */
      pthread_mutex_lock(&ch->lock);
      ts_share_queue_release_locked(ch, f->set_id);
      pthread_mutex_unlock(&ch->lock);
      rx->refused_id = f->set_id;
      if (b->layout_slot) drop_layout(ch, rx, b->layout_slot, f->set_id);
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory for a tensor set");
    }
    return refuse_set(ch, TSHARE_E_NOMEM, true, "out of memory for %u tensors", b->count);
  }
  return TSHARE_OK;
}

/* Memory frame m as the share of the set's id its backend imports. */
static tshare_frame share_of_mem(uint64_t set_id, const tshare_set_mem_frame *m) {
  tshare_frame share;
  /* The share's own fields only: a whole frame is three times their size. */
  share.type = TSHARE_FRAME_SHARE;
  share.flags = share.major = share.minor = 0;
  tshare_share_frame *f = &share.u.share;
  /* Not the tensor's shape and strides (a memory has none: ndim 0), over
   * two thirds of a share frame: a model's hundreds of memories per set. */
  memset(f, 0, offsetof(tshare_share_frame, tensor.shape));
  f->tensor.byte_offset = 0;
  f->tag_len = 0;
  f->tag[0] = '\0';
  f->origin_pid = 0;
  f->share_id = set_id;
  f->alloc_id = m->alloc_id;
  f->alloc_size = m->alloc_size;
  f->mem_kind = m->mem_kind;
  f->device_type = m->device_type;
  f->handle_len = m->handle_len;
  memcpy(f->handle, m->handle, m->handle_len);
  memcpy(f->device_uuid, m->device_uuid, 16);
  f->share_flags = m->share_flags;
  return share;
}

/* Map one memory of the set through the backend of its kind, as a share of
 * the set's id: what came before it for it (chunk frames) is taken by the
 * backend's on_share, and its import maps it (once per allocation: the
 * backend's mappings are shared). */
static int add_mem(tshare_channel *ch, tshare_set *s, const tshare_set_mem_frame *m, int *fd) {
  if (m->index != s->mems_got || m->index >= s->mem_count || s->members_got)
    return refuse_set(ch, TSHARE_E_PROTOCOL, true, "memory %u out of order (%u of %u came)", m->index, s->mems_got,
                      s->mem_count);
  const ts_backend *be = ts_backend_for_mem_kind(m->mem_kind);
  /* Host memory goes the sets' own way: a memfd, an unsealed file, or a
   * memfd this end keeps mapped (TSHARE_MEM_HOST_KEPT: its import checks
   * that it does, with the same size). */
  bool host = m->mem_kind == TSHARE_MEM_HOST_MEMFD || m->mem_kind == TSHARE_MEM_HOST_FD ||
              m->mem_kind == TSHARE_MEM_HOST_KEPT;
  /* Remote memory is copied here by its backend (import_in_set). */
  bool copied = be && be->import_in_set;
  if (!be || (!host && !copied && !be->set_release))
    return refuse_set(ch, TSHARE_E_UNSUPPORTED, true, "memory %u is %s memory, which this end does not take in sets",
                      m->index, be ? be->mem_kind_name(m->mem_kind) : "unknown");
  tshare_frame share = share_of_mem(s->set_id, m);
  if (host) share.u.share.share_flags = 0; /* kept only once the set is taken whole (keep_host_memories) */
  struct tshare_view probe; /* an import fills the fields before the descriptor (1.3 KiB that it never reads) */
  memset(&probe, 0, offsetof(struct tshare_view, desc));
  int rc = ts_backends_on_share(ch, &share); /* as for a share: chunks that came for it, or stray ones */
  if (rc == TSHARE_OK)
    rc = copied ? be->import_in_set(ch, &share, &s->copied, &probe) : be->import(ch, &share, fd, NULL, &probe);
  if (rc != TSHARE_OK) return refuse_set(ch, rc, true, "memory %u: %s", m->index, ch->err);
  set_mem *sm = &s->mems[s->mems_got++];
  *sm = (set_mem){.backend = be, .memory = probe.memory, .base = probe.data, .alloc_id = m->alloc_id,
                  .size = m->alloc_size, .ctx = probe.ctx, .device = probe.device, .mem_kind = m->mem_kind,
                  .device_type = m->device_type, .handle_len = m->handle_len, .share_flags = m->share_flags};
  memcpy(sm->handle, m->handle, m->handle_len);
  memcpy(sm->device_uuid, m->device_uuid, 16);
  return TSHARE_OK;
}

/* A memory frame of a set refused before it: what came for it goes. */
static void skip_mem(tshare_channel *ch, const tshare_set_frame *f) {
  tshare_frame share = share_of_mem(f->set_id, &f->u.mem);
  if (ts_backends_on_share(ch, &share) == TSHARE_OK) ts_backends_share_dropped(ch, f->set_id);
}

static const char *set_name_at(const void *owner, size_t i) { return name_of(owner, i); }

static int add_member(tshare_channel *ch, tshare_set *s, const tshare_set_member_frame *m) {
  if (s->mems_got != s->mem_count || m->index != s->members_got || m->index >= s->count)
    return refuse_set(ch, TSHARE_E_PROTOCOL, true, "tensor %u out of order (%u of %u came, %u of %u memories)",
                      m->index, s->members_got, s->count, s->mems_got, s->mem_count);
  if (m->mem_index >= s->mem_count)
    return refuse_set(ch, TSHARE_E_PROTOCOL, true, "tensor %u points into memory %u of %u", m->index, m->mem_index,
                      s->mem_count);
  if ((uint64_t)s->names_got + m->name_len > s->names_bytes)
    return refuse_set(ch, TSHARE_E_PROTOCOL, true, "names take more than the %u bytes the set announced",
                      s->names_bytes);
  const set_mem *mem = &s->mems[m->mem_index];
  char why[160];
  int rc = ts_tensor_check(&m->tensor, mem->size, NULL, NULL, why, sizeof why);
  if (rc != TSHARE_OK) return refuse_set(ch, rc, true, "tensor %u ('%s'): %s", m->index, m->name, why);
  if (ts_set_name_lookup(&s->catalog->by_name, m->name, set_name_at, s, s->members_got) >= 0)
    return refuse_set(ch, TSHARE_E_PROTOCOL, true, "two tensors are named '%s'", m->name);
  set_entry *e = &s->catalog->entries[s->members_got];
  e->name_at = s->names_got + s->members_got; /* each name is followed by its NUL */
  memcpy(s->catalog->names + e->name_at, m->name, (size_t)m->name_len + 1);
  if (ts_set_name_insert(&s->catalog->by_name, m->name, s->members_got) != 0)
    return refuse_set(ch, TSHARE_E_NOMEM, true, "out of memory");
  e->mem = m->mem_index;
  e->desc = m->tensor;
  s->names_got += m->name_len;
  s->members_got++;
  return TSHARE_OK;
}

static int add_meta(tshare_channel *ch, tshare_set *s, const tshare_set_meta_frame *m) {
  if (s->members_got != s->count || m->offset != s->meta_got || (uint64_t)m->offset + m->len > s->meta_len)
    return refuse_set(ch, TSHARE_E_PROTOCOL, true, "metadata chunk of %u bytes at %u out of order (%u of %u came)",
                      (unsigned)m->len, m->offset, s->meta_got, s->meta_len);
  memcpy(s->meta + m->offset, m->bytes, m->len);
  s->meta_got += m->len;
  return TSHARE_OK;
}

/* The end frame's event: the work on the set's device memory waits for the
 * producer's, through that memory's backend (false: ch->err says why not). */
static bool wait_for_producer(tshare_channel *ch, tshare_set *s, const tshare_frame *end) {
  for (uint32_t i = 0; i < s->mems_got; i++) {
    const set_mem *m = &s->mems[i];
    if (m->backend->set_wait) return m->backend->set_wait(ch, end, m->memory) == TSHARE_OK;
  }
  snprintf(ch->err, sizeof ch->err, "an event came with a set of no device memory");
  return false;
}

/* The set is taken: host memories it offered to keep are kept now, so that a
 * refused set leaves no mapping behind. */
static void keep_host_memories(tshare_channel *ch, tshare_set *s) {
  pthread_mutex_lock(&ch->lock);
  for (uint32_t i = 0; i < s->mems_got; i++) {
    const set_mem *m = &s->mems[i];
    if (m->share_flags && !m->backend->set_release && m->backend->memory_keep_locked)
      m->backend->memory_keep_locked(ch, m->memory, m->share_flags);
  }
  pthread_mutex_unlock(&ch->lock);
}

/* Every memory of the set is a copy in this process (read over UCX). */
static bool set_is_copy(const tshare_set *s) {
  for (uint32_t i = 0; i < s->mems_got; i++)
    if (!s->mems[i].backend->views_are_copies) return false;
  return s->mems_got > 0;
}

/* A frame of a set that never began: the peer may wait for that set's
 * release, so it gets one; the set's further frames are dropped. */
static void release_stray_set(tshare_channel *ch, ts_set_rx *rx, uint64_t set_id) {
  rx->refused_id = set_id;
  pthread_mutex_lock(&ch->lock);
  ts_share_queue_release_locked(ch, set_id);
  pthread_mutex_unlock(&ch->lock);
}

/* ---- consumer: layouts of sets sent again ------------------------------- */

/* The kind memory m is named by once this end keeps it mapped until its
 * owner retires it; 0 when it is not such memory. */
static uint8_t kept_kind_of(const set_mem *m) {
  if (!ts_set_mem_keepable(m->mem_kind, m->share_flags)) return 0;
  /* A legacy IPC segment stays named by its handle: the import cache finds
   * its idle mapping by it (and the producer's anchor keeps it alive). */
  if (m->mem_kind == TSHARE_MEM_CUDA_IPC) return TSHARE_MEM_CUDA_IPC;
  return m->device_type == TSHARE_DEVICE_CPU ? TSHARE_MEM_HOST_KEPT : TSHARE_MEM_CUDA_HELD;
}

/* The layout of s (members, names and memories, no mappings), or NULL when
 * a memory is one this end does not keep mapped, or out of memory. */
static tshare_set *layout_of(const tshare_set *s) {
  tshare_set *t = calloc(1, sizeof *t);
  if (!t) return NULL;
  t->set_id = s->set_id;
  t->count = s->count;
  t->mem_count = s->mem_count;
  t->names_bytes = s->names_bytes;
  t->mems = ts_spare_alloc(&spare_mems, s->mem_count * sizeof *t->mems);
  t->catalog = catalog_ref(s->catalog); /* read-only from here */
  if (!t->mems) {
    set_free(t);
    return NULL;
  }
  for (uint32_t i = 0; i < s->mem_count; i++) {
    set_mem m = s->mems[i];
    m.mem_kind = kept_kind_of(&s->mems[i]);
    if (!m.mem_kind) {
      set_free(t);
      return NULL;
    }
    m.memory = m.base = m.ctx = NULL;
    if (m.mem_kind != TSHARE_MEM_CUDA_IPC) m.handle_len = 0;
    /* Host memory is kept already; a held run keeps its retire notice. */
    m.share_flags = m.device_type == TSHARE_DEVICE_CPU ? 0 : m.share_flags & ~(TSHARE_SHARE_FLAG_CHUNKS | TSHARE_SHARE_FLAG_HOLD_OFFER);
    t->mems[i] = m;
  }
  /* Written before s is handed to the user (it waits in the channel still),
   * and never again: the sets sent again from t read it. */
  if (!t->catalog->layout_id) t->catalog->layout_id = atomic_fetch_add(&next_layout_id, 1);
  return t;
}

/* s came whole and asked for its layout to be kept: it replaces what its
 * slot held (the slot is left empty where the layout cannot be kept, so a
 * set sent again from it is refused, never served from an older one; the
 * peer is told, and sends that set whole next). */
static void keep_layout(tshare_channel *ch, ts_set_rx *rx, const tshare_set *s) {
  tshare_set *t = layout_of(s);
  if (!t) {
    drop_layout(ch, rx, s->layout_slot, s->set_id);
    return;
  }
  tshare_set **slot = &rx->layouts[s->layout_slot - 1];
  if (*slot) set_free(*slot);
  *slot = t;
}

/* Memory i of layout t as the memory frame of the kept kind that names it. */
static tshare_set_mem_frame mem_frame_of(const tshare_set *t, uint32_t i) {
  const set_mem *m = &t->mems[i];
  tshare_set_mem_frame f;
  memset(&f, 0, sizeof f);
  f.index = i;
  f.alloc_id = m->alloc_id;
  f.mem_kind = m->mem_kind;
  f.device_type = m->device_type;
  f.alloc_size = m->size;
  f.share_flags = m->share_flags;
  f.handle_len = m->handle_len;
  memcpy(f.handle, m->handle, m->handle_len);
  memcpy(f.device_uuid, m->device_uuid, 16);
  return f;
}

/* Why a set sent again from slot a->layout_slot cannot be served, or NULL. */
static const char *again_refusal(tshare_channel *ch, const ts_set_rx *rx, const tshare_set_again_frame *a, char *why,
                                 size_t cap) {
  const tshare_set *t = rx->layouts[a->layout_slot - 1];
  if (!ts_set_again_agreed(ch))
    snprintf(why, cap, "sent again from a layout, and this channel did not agree on TSHARE_CAP_SET_AGAIN (wire %u.%u)",
             (unsigned)TSHARE_WIRE_MAJOR, (unsigned)ch->conn.minor);
  else if (!t)
    snprintf(why, cap, "sent again from layout slot %u, which holds no layout", (unsigned)a->layout_slot);
  else if (t->set_id != a->layout_id)
    snprintf(why, cap, "sent again from layout %llu in slot %u, which holds layout %llu",
             (unsigned long long)a->layout_id, (unsigned)a->layout_slot, (unsigned long long)t->set_id);
  else
    return NULL;
  return why;
}

/* A set sent again: built from the layout in its slot, each memory taken
 * as a memory frame of its kept kind would be (a kept mapping looked up:
 * one no longer kept refuses the set), members and names the layout's own
 * catalog, as they were checked when the layout came. Metadata and the end
 * follow. */
static int again_set(tshare_channel *ch, ts_set_rx *rx, const tshare_set_frame *f) {
  char why[TSHARE_ERROR_MSG_MAX];
  if (again_refusal(ch, rx, &f->u.again, why, sizeof why)) {
    drop_layout(ch, rx, f->u.again.layout_slot, f->u.again.layout_id);
    release_stray_set(ch, rx, f->set_id);
    note_refusal(ch, rx, TSHARE_E_PROTOCOL, f->set_id, true, why);
    return TSHARE_OK;
  }
  const tshare_set *t = rx->layouts[f->u.again.layout_slot - 1];
  tshare_set_frame begin = {.op = TSHARE_SET_BEGIN, .set_id = f->set_id};
  begin.u.begin = (tshare_set_begin_frame){t->count, t->mem_count, t->names_bytes, f->u.again.meta_bytes, 0};
  int rc = begin_set(ch, rx, &begin, t->catalog);
  tshare_set *s = rx->partial;
  if (rc != TSHARE_OK || !s) return rc;
  for (uint32_t i = 0; i < t->mem_count; i++) {
    tshare_set_mem_frame m = mem_frame_of(t, i);
    int fd = -1;
    rc = add_mem(ch, s, &m, &fd);
    if (rx->partial != s) { /* refused, naming the memory: the layout cannot serve again */
      drop_layout(ch, rx, f->u.again.layout_slot, f->u.again.layout_id);
      return rc;
    }
  }
  s->members_got = t->count;
  s->names_got = t->names_bytes;
  return TSHARE_OK;
}

static int end_set(tshare_channel *ch, ts_set_rx *rx, tshare_set *s, const tshare_frame *end) {
  if (s->members_got != s->count || s->meta_got != s->meta_len || s->names_got != s->names_bytes)
    return refuse_set(ch, TSHARE_E_PROTOCOL, true,
                      "ended with %u of %u tensors, %u of %u bytes of names and %u of %u bytes of metadata",
                      s->members_got, s->count, s->names_got, s->names_bytes, s->meta_got, s->meta_len);
  if (s->layout_slot && ts_set_again_agreed(ch)) keep_layout(ch, rx, s);
  if ((end->flags & TSHARE_FRAME_FLAG_HAS_EVENT) && !wait_for_producer(ch, s, end))
    return refuse_set(ch, TSHARE_E_PROTOCOL, true, "ordering after the producer's stream: %s", ch->err);
  if (rx->len == TS_SETS_WAITING_MAX)
    return refuse_set(ch, TSHARE_E_LIMIT, true, "%d sets already wait for tshare_set_recv()", TS_SETS_WAITING_MAX);
  keep_host_memories(ch, s);
  if (set_is_copy(s)) { /* every byte is here: the producer may reuse its memory now */
    s->released_back = true;
    ts_share_release_back(ch, s->set_id);
    (void)ts_share_flush_pending(ch, TS_DEADLINE_PASSED);
  }
  rx->partial = NULL;
  rx->waiting[(rx->head + rx->len++) % TS_SETS_WAITING_MAX] = s;
  return TSHARE_OK;
}

/* The message names the limit that was hit, with its value: what to raise. */
static int lost_fd(tshare_channel *ch, int lost) {
  if (lost == TS_FD_OVER_BUDGET)
    return refuse_set(ch, TSHARE_E_LIMIT, true, "an fd of it could not be kept: %zu fds already wait unclaimed "
                      "(max_unclaimed_fds)", ch->conn.fdq.budget);
  struct rlimit rl;
  unsigned long long limit = getrlimit(RLIMIT_NOFILE, &rl) == 0 ? (unsigned long long)rl.rlim_cur : 0;
  return refuse_set(ch, TSHARE_E_LIMIT, true, "an fd of it could not be kept: %s (%s, RLIMIT_NOFILE %llu); release "
                    "sets or raise the limit (ulimit -n)",
                    lost == ENFILE ? "the system's file table is full" : "this process has no free fd",
                    lost == ENFILE ? "ENFILE" : "EMFILE", limit);
}

/* A frame of set f->set_id that the decoder refused alone (a count, name or
 * metadata over the wire's bounds; ch->err says which): the framing held,
 * so the set is refused, released back once and its other frames dropped,
 * and the channel goes on. */
static int refused_by_decoder(tshare_channel *ch, ts_set_rx *rx, const tshare_set_frame *f) {
  int status = ch->conn.set_refused;
  char why[TSHARE_ERROR_MSG_MAX];
  snprintf(why, sizeof why, "%s", ch->err);
  tshare_set *s = rx->partial;
  if (s && s->set_id == f->set_id) return refuse_set(ch, status, true, "%s", why);
  if (f->set_id == rx->refused_id) return TSHARE_OK; /* the rest of a set refused already */
  if (s) refuse_set(ch, TSHARE_E_PROTOCOL, true, "cut off by a frame of set %llu", (unsigned long long)f->set_id);
  release_stray_set(ch, rx, f->set_id); /* its begin, or a frame before it */
  note_refusal(ch, rx, status, f->set_id, true, why);
  return TSHARE_OK;
}

static int on_step(tshare_channel *ch, ts_set_rx *rx, const tshare_frame *frame, int *fd, int fd_lost) {
  const tshare_set_frame *f = &frame->u.set;
  tshare_set *s = rx->partial;
  if (f->op == TS_SET_OP_REFUSED) return refused_by_decoder(ch, rx, f);
  if (f->op == TSHARE_SET_BEGIN || f->op == TSHARE_SET_AGAIN) {
    if (s) refuse_set(ch, TSHARE_E_PROTOCOL, true, "cut off by the beginning of set %llu", (unsigned long long)f->set_id);
    return f->op == TSHARE_SET_BEGIN ? begin_set(ch, rx, f, NULL) : again_set(ch, rx, f);
  }
  if (!s || s->set_id != f->set_id) {
    if (f->set_id == rx->refused_id) { /* the rest of a refused set */
      if (f->op == TSHARE_SET_MEM) skip_mem(ch, f);
      return TSHARE_OK;
    }
    if (s) refuse_set(ch, TSHARE_E_PROTOCOL, true, "cut off by a frame of set %llu", (unsigned long long)f->set_id);
    else /* reported once, released back once: the set's other frames are dropped as a refused set's */
      release_stray_set(ch, rx, f->set_id);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "receive: peer %s sent a frame of tensor set %llu, which did not begin%s", ch->conn.peer_label,
                   (unsigned long long)f->set_id, s ? "" : "; released back");
  }
  switch (f->op) {
  case TSHARE_SET_MEM:
    if (fd_lost) skip_mem(ch, f);
    return fd_lost ? lost_fd(ch, fd_lost) : add_mem(ch, s, &f->u.mem, fd);
  case TSHARE_SET_MEMBER:
    return add_member(ch, s, &f->u.member);
  case TSHARE_SET_META:
    return add_meta(ch, s, &f->u.meta);
  default:
    return end_set(ch, rx, s, frame);
  }
}

int ts_set_on_frame(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost) {
  if (f->u.set.op == TSHARE_SET_DROPPED) { /* the peer's notice: no part of a set it may be sending here */
    if (fd >= 0) close(fd);
    ts_set_slots_dropped(ch, &f->u.set.u.dropped);
    return TSHARE_OK;
  }
  ts_set_rx *rx = set_rx(ch);
  int rc = rx ? on_step(ch, rx, f, &fd, fd_lost)
              : ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory for a tensor set");
  if (fd >= 0) close(fd); /* a new mapping keeps its fd; the rest go */
  return rc;
}

void ts_set_on_other_frame(tshare_channel *ch, int type) {
  if (!ch->set_rx || !ch->set_rx->partial) return;
  /* The peer's own traffic, and the chunk or rkey frames of a memory that follows. */
  if (type == TSHARE_FRAME_RELEASE || type == TSHARE_FRAME_EVENT || type == TSHARE_FRAME_RETIRE ||
      type == TSHARE_FRAME_CHUNK || type == TSHARE_FRAME_RKEY)
    return;
  refuse_set(ch, TSHARE_E_PROTOCOL, true, "cut off by a %s frame", tshare_frame_type_name(type));
}

void ts_set_peer_gone(tshare_channel *ch) {
  if (ch->set_rx && ch->set_rx->partial)
    refuse_set(ch, TSHARE_E_PEER_CLOSED, false, "cut off: the peer closed the channel in the middle of it");
}

/* Memories the channel's host mappings do not cover: device ones and
 * copies (landing buffers of remote memory). */
static tshare_set *drop_device_mappings(tshare_channel *ch, tshare_set *s) {
  for (uint32_t i = 0; i < s->mems_got; i++)
    if (s->mems[i].backend->set_release || s->mems[i].backend->import_in_set)
      s->mems[i].backend->memory_unref_locked(ch, s->mems[i].memory);
  return s;
}

void ts_set_free_queued(tshare_channel *ch) {
  ts_set_rx *rx = ch->set_rx;
  if (!rx) return;
  /* Their host mappings are the channel's, unmapped with it; device ones
   * live in a process-wide cache and copies in the channel's pool of
   * landing buffers: let go of here. */
  if (rx->partial) set_free(drop_device_mappings(ch, rx->partial));
  for (size_t i = 0; i < rx->len; i++)
    set_free(drop_device_mappings(ch, rx->waiting[(rx->head + i) % TS_SETS_WAITING_MAX]));
  for (size_t i = 0; i < TSHARE_SET_LAYOUT_SLOTS; i++)
    if (rx->layouts[i]) set_free(rx->layouts[i]);
  free(rx);
  ch->set_rx = NULL;
}

/* ---- consumer: the public calls ----------------------------------------- */

static bool take_waiting(tshare_channel *ch, tshare_set **out) {
  ts_set_rx *rx = ch->set_rx;
  if (!rx || !rx->len) return false;
  tshare_set *s = rx->waiting[rx->head];
  rx->head = (rx->head + 1) % TS_SETS_WAITING_MAX;
  rx->len--;
  s->ch = ch;
  atomic_store(&s->refs, 1);
  atomic_fetch_add(&ch->refs, 1);
  TS_LOG(TS_LOG_INFO, "received tensor set %llu (%u tensors) from %s", (unsigned long long)s->set_id, s->count,
         ch->conn.peer_label);
  *out = s;
  return true;
}

/* A set refused since the last call is reported once, by this call. */
static int take_refusal(tshare_channel *ch) {
  ts_set_rx *rx = ch->set_rx;
  if (!rx || !rx->refusal) return TSHARE_OK;
  int rc = rx->refusal;
  rx->refusal = TSHARE_OK;
  snprintf(ch->err, sizeof ch->err, "%s", rx->refusal_msg);
  return rc;
}

static int set_recv(tshare_channel *ch, int timeout_ms, tshare_set **out) {
  if (ch->closed) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "receive: channel is closed");
  int64_t deadline = ts_deadline(timeout_ms);
  for (;;) {
    int rc = take_refusal(ch);
    if (rc != TSHARE_OK) return rc;
    if (take_waiting(ch, out)) return TSHARE_OK;
    if (ch->peer_bye) return TSHARE_END;
    /* A share waits for view_recv: reading on without waiting would draw the
     * frames behind it (and their fds) out of the stream into this end's fd
     * budget, where a binding looking for "a share or a set" between shares
     * would soon have them refused. The stream keeps them instead. */
    if (ch->in_len > 0 && ts_remaining(deadline) == 0)
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_TIMEOUT, "receive set: a single share comes first");
    rc = ts_share_drive(ch, ts_remaining(deadline));
    if (rc == TSHARE_OK || rc == TSHARE_END) continue; /* after a bye, what came before it is taken first */
    int refused = take_refusal(ch);
    if (refused != TSHARE_OK) return refused;
    return take_waiting(ch, out) ? TSHARE_OK : rc;
  }
}

int tshare_set_recv(tshare_channel *ch, int timeout_ms, tshare_set **out) {
  if (!out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  if (!ch) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "receive set", set_recv(ch, timeout_ms, out));
}

/* A look (nothing waited for), the caller's work where nothing came, then
 * the wait for what is left of the time: one call, so a close from another
 * thread meanwhile waits for its end as for any call's. */
static int set_recv_idle(tshare_channel *ch, int timeout_ms, void (*before_wait)(void *), void *arg,
                         tshare_set **out) {
  int64_t deadline = ts_deadline(timeout_ms);
  int rc = set_recv(ch, 0, out);
  if (rc != TSHARE_E_TIMEOUT) return rc;
  before_wait(arg);
  return timeout_ms == 0 ? rc : set_recv(ch, ts_remaining(deadline), out);
}

int tshare_set_recv_idle(tshare_channel *ch, int timeout_ms, void (*before_wait)(void *arg), void *arg,
                         tshare_set **out) {
  if (!out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  if (!ch || !before_wait) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "receive set", set_recv_idle(ch, timeout_ms, before_wait, arg, out));
}

uint64_t tshare_set_id(const tshare_set *s) { return s ? s->set_id : 0; }
uint64_t tshare_set_layout(const tshare_set *s) { return s ? s->catalog->layout_id : 0; }
size_t tshare_set_count(const tshare_set *s) { return s ? s->count : 0; }
const char *tshare_set_name(const tshare_set *s, size_t i) {
  return s && i < s->count ? name_of(s, i) : NULL;
}
const tshare_tensor_desc *tshare_set_desc(const tshare_set *s, size_t i) {
  return s && i < s->count ? &entry_of(s, i)->desc : NULL;
}
int tshare_set_cuda_device(const tshare_set *s, size_t i) {
  if (!s || i >= s->count) return -1;
  const set_mem *m = &s->mems[entry_of(s, i)->mem];
  return m->device_type == TSHARE_DEVICE_CUDA ? m->device : -1;
}

void *tshare_set_data(const tshare_set *s, size_t i) { return s && i < s->count ? member_data(s, entry_of(s, i)) : NULL; }

int tshare_set_is_copy(const tshare_set *s) { return s && set_is_copy(s) ? 1 : 0; }

tshare_host_buffer *tshare_set_host_buffer(const tshare_set *s, size_t i) {
  if (!s || i >= s->count) return NULL;
  const set_mem *m = &s->mems[entry_of(s, i)->mem];
  return m->backend->memory_host_buffer ? m->backend->memory_host_buffer(m->memory) : NULL;
}

long tshare_set_find(const tshare_set *s, const char *name) {
  return s && name ? ts_set_name_lookup(&s->catalog->by_name, name, set_name_at, s, s->count) : -1;
}

const void *tshare_set_meta(const tshare_set *s, size_t *len) {
  if (len) *len = s ? s->meta_len : 0;
  return s && s->meta_len ? s->meta : NULL;
}

void tshare_set_release(tshare_set *s) {
  if (s) set_unref(s);
}

/* A member view's end: its mapping reference and its hold on the set go. */
static ts_release_done member_release(tshare_view *v) {
  tshare_channel *ch = v->ch;
  pthread_mutex_lock(&ch->lock);
  ((set_view *)v)->mem_backend->memory_unref_locked(ch, v->memory);
  pthread_mutex_unlock(&ch->lock);
  set_unref(((set_view *)v)->set);
  return TS_RELEASE_LATER; /* the set is released as a whole */
}

/* A member view a forked child inherited: only its copy of the mapping goes. */
static void member_release_in_child(tshare_view *v) {
  const ts_backend *be = ((set_view *)v)->mem_backend;
  if (be->memory_unref_in_child) be->memory_unref_in_child(v->ch, v->memory);
}

/* A member shares on as any view of its memory's kind. */
static int member_share_view(tshare_channel *ch, tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                             const char *tag, ts_export *e, int timeout_ms, uint64_t *share_id) {
  return ((set_view *)v)->mem_backend->share_view(ch, v, desc, stream, tag, e, timeout_ms, share_id);
}

/* The memory's backend with a member's own release. */
static const ts_backend member_backend = {
    .name = "tensor set member",
    .release = member_release,
    .release_in_child = member_release_in_child,
    .share_view = member_share_view,
};

/* The same for a member of memory copied into this process (remote memory):
 * tshare_view_is_copy says so. */
static const ts_backend member_copy_backend = {
    .name = "tensor set member (a copy)",
    .views_are_copies = true,
    .release = member_release,
    .release_in_child = member_release_in_child,
    .share_view = member_share_view,
};

/* What the view says of its memory and its member: as a share of it would. */
static void describe_member(tshare_view *v, const tshare_set *s, size_t i) {
  const set_entry *e = entry_of(s, i);
  const set_mem *mem = &s->mems[e->mem];
  memset(&v->frame, 0, sizeof v->frame);
  v->frame.share_id = s->set_id;
  v->frame.alloc_id = mem->alloc_id;
  v->frame.alloc_size = mem->size;
  v->frame.mem_kind = mem->mem_kind;
  v->frame.device_type = mem->device_type;
  v->frame.handle_len = mem->handle_len;
  memcpy(v->frame.handle, mem->handle, mem->handle_len);
  memcpy(v->frame.device_uuid, mem->device_uuid, 16);
  v->frame.share_flags = mem->share_flags;
  v->frame.tensor = e->desc;
  v->desc = e->desc;
}

uint32_t ts_set_memory_count(const tshare_set *s, tshare_channel **ch) {
  *ch = s->ch;
  return s->mems_got;
}

void ts_set_memory_at(const tshare_set *s, uint32_t i, const ts_backend **backend, void **memory) {
  *backend = s->mems[i].backend;
  *memory = s->mems[i].memory;
}

void ts_set_ref(tshare_set *s) { atomic_fetch_add(&s->refs, 1); }

const ts_backend *ts_set_view_memory_backend(const tshare_view *v) {
  if (!v || (v->backend != &member_backend && v->backend != &member_copy_backend)) return NULL;
  return ((const set_view *)v)->mem_backend;
}

tshare_view *ts_view_described(tshare_view *v) {
  if (v->backend != &member_backend && v->backend != &member_copy_backend) return v;
  set_view *sv = (set_view *)v;
  int was = VIEW_UNDESCRIBED;
  if (atomic_load_explicit(&sv->described, memory_order_acquire) == VIEW_DESCRIBED) return v;
  if (atomic_compare_exchange_strong(&sv->described, &was, VIEW_DESCRIBING)) {
    describe_member(v, sv->set, sv->member); /* the view holds the set: its entries stay */
    atomic_store_explicit(&sv->described, VIEW_DESCRIBED, memory_order_release);
  }
  while (atomic_load_explicit(&sv->described, memory_order_acquire) != VIEW_DESCRIBED) sched_yield();
  return v;
}

int tshare_set_view(tshare_set *s, size_t i, tshare_view **out) {
  if (!out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  if (!s || i >= s->count) return TSHARE_E_INVALID_ARG;
  /* Its descriptor and frame (1.2 KiB of the view) are filled when first
   * read (ts_view_described): a view is made per memory of a set on every
   * hand-off, and most are never forwarded nor asked for their descriptor
   * (a binding has the set's); filling them, and the whole view zeroed
   * first, was the largest cost of taking a set. */
  set_view *sv = malloc(sizeof *sv);
  if (!sv) return TSHARE_E_NOMEM;
  tshare_view *v = &sv->view;
  memset(v, 0, offsetof(struct tshare_view, desc));
  v->tag[0] = '\0';
  tshare_channel *ch = s->ch;
  const set_entry *e = entry_of(s, i);
  sv->set = s;
  sv->member = i;
  atomic_init(&sv->described, VIEW_UNDESCRIBED);
  atomic_fetch_add(&s->refs, 1);
  atomic_fetch_add(&ch->refs, 1);
  pthread_mutex_lock(&ch->lock);
  const set_mem *mem = &s->mems[e->mem];
  mem->backend->memory_ref_locked(ch, mem->memory);
  v->memory = mem->memory;
  pthread_mutex_unlock(&ch->lock);
  sv->mem_backend = mem->backend;
  v->ch = ch;
  v->backend = mem->backend->views_are_copies ? &member_copy_backend : &member_backend;
  v->share_id = s->set_id;
  v->data = member_data(s, e);
  v->ctx = mem->ctx;
  v->device = mem->device;
  v->device_type = mem->device_type;
  *out = v;
  return TSHARE_OK;
}
