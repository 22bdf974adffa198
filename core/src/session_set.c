/* Tensor sets (set.h): the builder and sender on the producer side, and on
 * the consumer side the assembly of a set's frames (wire.h: begin, memories,
 * members, metadata, end) into a set whose tensors stay valid until the set
 * and every view taken from it are released, in one release of its id. The
 * memory is the host backend's: each memory of a set is mapped once through
 * it, like a share's allocation. */
#include "tshare/set.h"

#include "backend.h"
#include "session.h"
#include "error_detail.h"
#include "log.h"
#include "session_set.h"
#include "wire_checks.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


/* A set's memory is host memory: the backend of that kind maps it, keeps
 * the producer's buffers and counts the views of a mapping. */
static const ts_backend *host_backend(void) { return ts_backend_for_mem_kind(TSHARE_MEM_HOST_MEMFD); }

/* ---- names: unique in a set, looked up by hash ---------------------------- */

/* FNV-1a, kept off the map's reserved keys 0 and UINT64_MAX. */
static uint64_t name_hash(const char *name) {
  uint64_t h = 1469598103934665603ull;
  for (const unsigned char *p = (const unsigned char *)name; *p; p++) h = (h ^ *p) * 1099511628211ull;
  return h % (UINT64_MAX - 1) + 1;
}

typedef const char *(*name_at_fn)(const void *owner, size_t i);

/* The index of name among the n names of owner, or -1. The map holds the
 * first name of each hash; a different name with the same hash is found by
 * a scan, so a collision costs time, never a wrong answer. */
static long name_lookup(const ts_u64map *index, const char *name, name_at_fn name_at, const void *owner, size_t n) {
  void *hit = ts_u64map_get(index, name_hash(name));
  if (!hit) return -1;
  size_t first = (size_t)(uintptr_t)hit - 1;
  if (strcmp(name_at(owner, first), name) == 0) return (long)first;
  for (size_t i = 0; i < n; i++)
    if (strcmp(name_at(owner, i), name) == 0) return (long)i;
  return -1;
}

/* Record name i (known not to be a duplicate): 0, or -1 out of memory. */
static int name_insert(ts_u64map *index, const char *name, size_t i) {
  uint64_t h = name_hash(name);
  if (ts_u64map_get(index, h)) return 0;
  return ts_u64map_put(index, h, (void *)(uintptr_t)(i + 1));
}

/* A member's name and layout as the wire checks them. */
static int check_member(const char *name, size_t name_len, const tshare_tensor_desc *desc, char *err, size_t cap) {
  if (name_len == 0 || name_len > TSHARE_SET_NAME_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: a name of %zu bytes, outside 1..%u", name_len,
                   TSHARE_SET_NAME_MAX);
  tshare_set_frame f;
  memset(&f, 0, sizeof f);
  f.op = TSHARE_SET_MEMBER;
  f.set_id = 1;
  f.u.member.name_len = (uint16_t)name_len;
  memcpy(f.u.member.name, name, name_len);
  f.u.member.tensor = *desc;
  return ts_wire_check_set(&f, 0, NULL, err, cap);
}

/* ---- producer: the builder ---------------------------------------------- */

typedef struct builder_entry {
  char *name;
  uint32_t mem;
  tshare_tensor_desc desc;
} builder_entry;

struct tshare_set_builder {
  builder_entry *entries;
  size_t count, cap;
  size_t names_bytes;
  ts_u64map names;          /* name hash -> entry index + 1 */
  tshare_host_buffer **mems; /* one reference each */
  size_t mem_count, mem_cap;
  ts_u64map mem_by_id; /* buffer id -> mems index + 1 */
  uint8_t *meta;
  size_t meta_len;
};

tshare_set_builder *tshare_set_builder_create(void) { return calloc(1, sizeof(tshare_set_builder)); }

void tshare_set_builder_destroy(tshare_set_builder *b) {
  if (!b) return;
  for (size_t i = 0; i < b->count; i++) free(b->entries[i].name);
  for (size_t i = 0; i < b->mem_count; i++) host_backend()->source_release(b->mems[i]);
  free(b->entries);
  free(b->mems);
  free(b->meta);
  ts_u64map_free(&b->names);
  ts_u64map_free(&b->mem_by_id);
  free(b);
}

size_t tshare_set_builder_count(const tshare_set_builder *b) { return b ? b->count : 0; }

static const char *builder_name_at(const void *owner, size_t i) {
  return ((const tshare_set_builder *)owner)->entries[i].name;
}

static bool grow(void **array, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return true;
  size_t n = *cap ? *cap * 2 : 16;
  while (n < need) n *= 2;
  void *p = realloc(*array, n * elem);
  if (!p) return false;
  *array = p;
  *cap = n;
  return true;
}

/* The index of buf among the builder's memories, added with a reference
 * the first time; -1 when out of memory. */
static long builder_mem(tshare_set_builder *b, tshare_host_buffer *buf) {
  uint64_t id = tshare_host_buffer_id(buf);
  void *hit = ts_u64map_get(&b->mem_by_id, id);
  if (hit) return (long)((uintptr_t)hit - 1);
  if (!grow((void **)&b->mems, &b->mem_cap, b->mem_count + 1, sizeof *b->mems) ||
      ts_u64map_put(&b->mem_by_id, id, (void *)(uintptr_t)(b->mem_count + 1)) != 0)
    return -1;
  host_backend()->source_retain(buf);
  b->mems[b->mem_count] = buf;
  return (long)b->mem_count++;
}

static int builder_add(tshare_set_builder *b, const char *name, tshare_host_buffer *buf,
                       const tshare_tensor_desc *desc, char *err, size_t cap) {
  size_t name_len = strlen(name);
  int rc = check_member(name, name_len, desc, err, cap);
  if (rc != TSHARE_OK) return rc;
  if (b->count == TSHARE_SET_MEMBERS_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: already %u tensors, the most a set holds",
                   TSHARE_SET_MEMBERS_MAX);
  if (b->names_bytes + name_len > TSHARE_SET_NAMES_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: names would take %zu bytes, over %u",
                   b->names_bytes + name_len, TSHARE_SET_NAMES_MAX);
  if (name_lookup(&b->names, name, builder_name_at, b, b->count) >= 0)
    return ts_errf(err, cap, TSHARE_E_INVALID_ARG, "set: a tensor named '%s' is already in the set", name);
  char why[160];
  rc = ts_tensor_check(desc, tshare_host_buffer_size(buf), NULL, NULL, why, sizeof why);
  if (rc != TSHARE_OK) return ts_errf(err, cap, rc, "set: tensor '%s': %s", name, why);
  char *copy = strdup(name);
  long mem = copy && grow((void **)&b->entries, &b->cap, b->count + 1, sizeof *b->entries) &&
                     name_insert(&b->names, name, b->count) == 0
                 ? builder_mem(b, buf)
                 : -1;
  if (mem < 0) {
    free(copy);
    return ts_errf(err, cap, TSHARE_E_NOMEM, "set: out of memory");
  }
  b->entries[b->count++] = (builder_entry){copy, (uint32_t)mem, *desc};
  b->names_bytes += name_len;
  return TSHARE_OK;
}

int tshare_set_builder_add_host(tshare_set_builder *b, const char *name, tshare_host_buffer *buf,
                                const tshare_tensor_desc *desc, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX] = "";
  int rc = b && name && buf && desc ? builder_add(b, name, buf, desc, msg, sizeof msg)
                                    : ts_errf(msg, sizeof msg, TSHARE_E_INVALID_ARG,
                                              "set: NULL builder, name, buffer or descriptor");
  ts_error_fill(err, rc, msg);
  return rc;
}

int tshare_set_builder_add_cuda(tshare_set_builder *b, const char *name, void *ptr, const tshare_tensor_desc *desc,
                                tshare_error *err) {
  (void)b, (void)ptr, (void)desc;
  char msg[TSHARE_ERROR_MSG_MAX];
  int rc = ts_errf(msg, sizeof msg, TSHARE_E_UNSUPPORTED,
                   "set: tensor '%s' is CUDA memory, and tensor sets carry host memory only in this version: share "
                   "CUDA tensors one by one (tshare_share_cuda)",
                   name ? name : "");
  ts_error_fill(err, rc, msg);
  return rc;
}

int tshare_set_builder_set_meta(tshare_set_builder *b, const void *meta, size_t len, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX] = "";
  int rc = TSHARE_OK;
  uint8_t *copy = NULL;
  if (!b || (len && !meta))
    rc = ts_errf(msg, sizeof msg, TSHARE_E_INVALID_ARG, "set: NULL builder or metadata");
  else if (len > TSHARE_SET_META_MAX)
    rc = ts_errf(msg, sizeof msg, TSHARE_E_TOO_LARGE, "set: %zu bytes of metadata over %u", len,
                 TSHARE_SET_META_MAX);
  else if (len && !(copy = malloc(len)))
    rc = ts_errf(msg, sizeof msg, TSHARE_E_NOMEM, "set: out of memory");
  if (rc == TSHARE_OK) {
    if (len) memcpy(copy, meta, len);
    free(b->meta);
    b->meta = copy;
    b->meta_len = len;
  }
  ts_error_fill(err, rc, msg);
  return rc;
}

/* ---- producer: sending -------------------------------------------------- */

/* What a sent set keeps alive until its release: a reference on each buffer. */
typedef struct set_keep {
  size_t count;
  tshare_host_buffer *bufs[];
} set_keep;

static void set_keep_release(void *owner) {
  set_keep *k = owner;
  for (size_t i = 0; i < k->count; i++) host_backend()->source_release(k->bufs[i]);
  free(k);
}

static ts_export *set_export(const tshare_set_builder *b, void *user_data) {
  ts_export *e = malloc(sizeof *e);
  set_keep *k = malloc(sizeof *k + b->mem_count * sizeof k->bufs[0]);
  if (!e || !k) {
    free(e);
    free(k);
    return NULL;
  }
  k->count = b->mem_count;
  for (size_t i = 0; i < b->mem_count; i++) {
    k->bufs[i] = b->mems[i];
    host_backend()->source_retain(b->mems[i]);
  }
  *e = (ts_export){.user_data = user_data, .release = set_keep_release, .owner = k};
  return e;
}

static int check_can_send(tshare_channel *ch, const tshare_set_builder *b) {
  if (ch->closed || ch->conn.wfd < 0) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "set: channel is closed");
  if (b->count == 0) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG, "set: the set has no tensors");
  if (!(ts_conn_caps(&ch->conn) & TS_TRANSPORT_PASSES_FDS))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "set: host memory travels as fds, which a pipe channel cannot carry: open a socket channel");
  if (ch->conn.minor < 3 || !(ch->conn.peer.capabilities & TSHARE_CAP_TENSOR_SETS))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                   "set: peer %s does not receive tensor sets (it speaks wire %u.%u; sets need %d.3 or newer): "
                   "upgrade it, or share the tensors one by one",
                   ch->conn.peer_label, (unsigned)ch->conn.peer.major, (unsigned)ch->conn.peer.minor,
                   TSHARE_WIRE_MAJOR);
  return TSHARE_OK;
}

static tshare_frame set_step(uint8_t op, uint64_t set_id) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SET;
  f.u.set.op = op;
  f.u.set.set_id = set_id;
  return f;
}

static int send_step(tshare_channel *ch, const tshare_frame *f, int fd, int64_t deadline) {
  return ts_channel_send(ch, f, fd, ts_remaining(deadline));
}

static int send_members(tshare_channel *ch, const tshare_set_builder *b, uint64_t id, int64_t deadline) {
  int rc = TSHARE_OK;
  for (size_t i = 0; i < b->mem_count && rc == TSHARE_OK; i++) {
    tshare_frame f = set_step(TSHARE_SET_MEM, id);
    f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
    f.u.set.u.mem = (tshare_set_mem_frame){.index = (uint32_t)i,
                                     .alloc_id = tshare_host_buffer_id(b->mems[i]),
                                     .mem_kind = TSHARE_MEM_HOST_MEMFD,
                                     .device_type = TSHARE_DEVICE_CPU,
                                     .alloc_size = tshare_host_buffer_size(b->mems[i])};
    rc = send_step(ch, &f, tshare_host_buffer_fd(b->mems[i]), deadline);
  }
  for (size_t i = 0; i < b->count && rc == TSHARE_OK; i++) {
    tshare_frame f = set_step(TSHARE_SET_MEMBER, id);
    tshare_set_member_frame *m = &f.u.set.u.member;
    m->index = (uint32_t)i;
    m->mem_index = b->entries[i].mem;
    m->name_len = (uint16_t)strlen(b->entries[i].name);
    memcpy(m->name, b->entries[i].name, m->name_len);
    m->tensor = b->entries[i].desc;
    rc = send_step(ch, &f, -1, deadline);
  }
  for (size_t off = 0; off < b->meta_len && rc == TSHARE_OK; off += TSHARE_SET_META_CHUNK_MAX) {
    tshare_frame f = set_step(TSHARE_SET_META, id);
    size_t n = b->meta_len - off < TSHARE_SET_META_CHUNK_MAX ? b->meta_len - off : TSHARE_SET_META_CHUNK_MAX;
    f.u.set.u.meta.offset = (uint32_t)off;
    f.u.set.u.meta.len = (uint16_t)n;
    memcpy(f.u.set.u.meta.bytes, b->meta + off, n);
    rc = send_step(ch, &f, -1, deadline);
  }
  return rc;
}

static int set_send(tshare_channel *ch, const tshare_set_builder *b, void *user_data, int timeout_ms,
                    uint64_t *set_id) {
  int rc = check_can_send(ch, b);
  if (rc != TSHARE_OK) return rc;
  ts_export *e = set_export(b, user_data);
  uint64_t id = ch->next_share_id;
  if (!e || ts_u64map_put(&ch->exports, id, e) != 0) {
    if (e) ts_export_drop(e);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "set: out of memory");
  }
  e->share_id = id;
  int64_t deadline = ts_deadline(timeout_ms);
  tshare_frame f = set_step(TSHARE_SET_BEGIN, id);
  f.u.set.u.begin = (tshare_set_begin_frame){(uint32_t)b->count, (uint32_t)b->mem_count, (uint32_t)b->names_bytes,
                                       (uint32_t)b->meta_len};
  rc = send_step(ch, &f, -1, deadline);
  if (rc != TSHARE_OK) { /* nothing went: the set never existed */
    ts_export_drop(ts_u64map_remove(&ch->exports, id));
    return rc;
  }
  /* Registered before the first frame, and kept from here on whatever
   * happens: the peer releases a set it got only part of. */
  ch->next_share_id++;
  if (set_id) *set_id = id;
  rc = send_members(ch, b, id, deadline);
  f = set_step(TSHARE_SET_END, id);
  if (rc == TSHARE_OK) rc = send_step(ch, &f, -1, deadline);
  if (rc == TSHARE_OK)
    TS_LOG(TS_LOG_INFO, "sent tensor set %llu (%zu tensors in %zu memories, %zu bytes of metadata) to %s",
           (unsigned long long)id, b->count, b->mem_count, b->meta_len, ch->conn.peer_label);
  return rc;
}

int tshare_set_send(tshare_channel *ch, const tshare_set_builder *b, void *user_data, int timeout_ms,
                    uint64_t *set_id) {
  if (set_id) *set_id = 0;
  if (!ch || !b) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "send set", set_send(ch, b, user_data, timeout_ms, set_id));
}

/* ---- consumer: a received set ------------------------------------------- */

typedef struct set_entry {
  uint32_t name_at; /* offset in names */
  uint32_t mem;
  tshare_tensor_desc desc;
  void *data;
} set_entry;

/* One memory of a set, mapped by the host backend. */
typedef struct set_mem {
  void *memory; /* the backend's mapping, one reference of the set's */
  void *base;   /* its first byte; NULL when empty */
  uint64_t alloc_id, size;
} set_mem;

struct tshare_set {
  tshare_channel *ch; /* a reference once handed to the user */
  uint64_t set_id;
  atomic_int refs; /* the handle + one per view */
  uint32_t count, mem_count, names_bytes, meta_len;
  uint32_t mems_got, members_got, names_got, meta_got;
  set_mem *mems;
  set_entry *entries;
  char *names; /* each NUL-terminated */
  uint8_t *meta;
  ts_u64map by_name;
};

/* A set member's view: the view, and the set it keeps alive. */
typedef struct set_view {
  struct tshare_view view; /* first: freed through its address */
  tshare_set *set;
} set_view;

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
} ts_set_rx;

/* Drop the set's mappings (ch->lock held). */
static void drop_mappings_locked(tshare_channel *ch, tshare_set *s) {
  for (uint32_t i = 0; i < s->mems_got; i++) host_backend()->memory_unref_locked(ch, s->mems[i].memory);
  s->mems_got = 0;
}

static void set_free(tshare_set *s) {
  free(s->mems);
  free(s->entries);
  free(s->names);
  free(s->meta);
  ts_u64map_free(&s->by_name);
  free(s);
}

/* The last reference went: its memory is let go of and the producer told,
 * in one release of the set's id. */
static void set_unref(tshare_set *s) {
  if (atomic_fetch_sub(&s->refs, 1) != 1) return;
  tshare_channel *ch = s->ch;
  if (ts_channel_foreign(ch)) { /* a forked child's copy: only its own mappings go */
    for (uint32_t i = 0; i < s->mems_got; i++) host_backend()->memory_unref_in_child(ch, s->mems[i].memory);
  } else {
    pthread_mutex_lock(&ch->lock);
    drop_mappings_locked(ch, s);
    ts_share_queue_release_locked(ch, s->set_id);
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

/* The set in progress is refused: its mappings go, the peer gets its release
 * back (unless it is gone), and the reason waits for tshare_set_recv(). */
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
  pthread_mutex_lock(&ch->lock);
  drop_mappings_locked(ch, s);
  if (tell_peer) ts_share_queue_release_locked(ch, s->set_id);
  pthread_mutex_unlock(&ch->lock);
  rx->refusal = status;
  ts_errf(rx->refusal_msg, sizeof rx->refusal_msg, status, "receive: refused tensor set %llu from peer %s: %s%s",
          (unsigned long long)s->set_id, ch->conn.peer_label, why, tell_peer ? "; released back" : "");
  TS_LOG(TS_LOG_WARN, "%s", rx->refusal_msg);
  set_free(s);
  return TSHARE_OK;
}

static int begin_set(tshare_channel *ch, ts_set_rx *rx, const tshare_set_frame *f) {
  const tshare_set_begin_frame *b = &f->u.begin;
  tshare_set *s = calloc(1, sizeof *s);
  if (s) {
    s->set_id = f->set_id;
    s->count = b->count;
    s->mem_count = b->mem_count;
    s->names_bytes = b->names_bytes;
    s->meta_len = b->meta_bytes;
    s->mems = calloc(b->mem_count, sizeof *s->mems);
    s->entries = calloc(b->count, sizeof *s->entries);
    s->names = malloc((size_t)b->names_bytes + b->count);
    s->meta = b->meta_bytes ? malloc(b->meta_bytes) : NULL;
  }
  rx->partial = s;
  if (!s || !s->mems || !s->entries || !s->names || (b->meta_bytes && !s->meta)) {
    if (!s) { /* nothing to keep: released back at once */
      pthread_mutex_lock(&ch->lock);
      ts_share_queue_release_locked(ch, f->set_id);
      pthread_mutex_unlock(&ch->lock);
      rx->refused_id = f->set_id;
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory for a tensor set");
    }
    return refuse_set(ch, TSHARE_E_NOMEM, true, "out of memory for %u tensors", b->count);
  }
  return TSHARE_OK;
}

/* Map one memory of the set through the host backend, as a share's. */
static int add_mem(tshare_channel *ch, tshare_set *s, const tshare_set_mem_frame *m, int *fd) {
  if (m->index != s->mems_got || m->index >= s->mem_count || s->members_got)
    return refuse_set(ch, TSHARE_E_PROTOCOL, true, "memory %u out of order (%u of %u came)", m->index, s->mems_got,
                      s->mem_count);
  if (m->mem_kind != TSHARE_MEM_HOST_MEMFD)
    return refuse_set(ch, TSHARE_E_UNSUPPORTED, true,
                      "memory %u is %s memory, and tensor sets carry host memory only in this version", m->index,
                      m->device_type == TSHARE_DEVICE_CUDA ? "CUDA" : "non-host");
  tshare_frame share;
  memset(&share, 0, sizeof share);
  share.type = TSHARE_FRAME_SHARE;
  share.u.share.share_id = s->set_id;
  share.u.share.alloc_id = m->alloc_id;
  share.u.share.alloc_size = m->alloc_size;
  share.u.share.mem_kind = TSHARE_MEM_HOST_MEMFD;
  struct tshare_view probe;
  memset(&probe, 0, sizeof probe);
  int rc = host_backend()->import(ch, &share, fd, NULL, &probe);
  if (rc != TSHARE_OK) return refuse_set(ch, rc, true, "memory %u: %s", m->index, ch->err);
  s->mems[s->mems_got++] = (set_mem){probe.memory, probe.data, m->alloc_id, m->alloc_size};
  return TSHARE_OK;
}

static const char *set_name_at(const void *owner, size_t i) {
  const tshare_set *s = owner;
  return s->names + s->entries[i].name_at;
}

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
  if (name_lookup(&s->by_name, m->name, set_name_at, s, s->members_got) >= 0)
    return refuse_set(ch, TSHARE_E_PROTOCOL, true, "two tensors are named '%s'", m->name);
  set_entry *e = &s->entries[s->members_got];
  e->name_at = s->names_got + s->members_got; /* each name is followed by its NUL */
  memcpy(s->names + e->name_at, m->name, (size_t)m->name_len + 1);
  if (name_insert(&s->by_name, m->name, s->members_got) != 0)
    return refuse_set(ch, TSHARE_E_NOMEM, true, "out of memory");
  e->mem = m->mem_index;
  e->desc = m->tensor;
  e->data = mem->base ? (char *)mem->base + m->tensor.byte_offset : NULL;
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

static int end_set(tshare_channel *ch, ts_set_rx *rx, tshare_set *s) {
  if (s->members_got != s->count || s->meta_got != s->meta_len || s->names_got != s->names_bytes)
    return refuse_set(ch, TSHARE_E_PROTOCOL, true,
                      "ended with %u of %u tensors, %u of %u bytes of names and %u of %u bytes of metadata",
                      s->members_got, s->count, s->names_got, s->names_bytes, s->meta_got, s->meta_len);
  if (rx->len == TS_SETS_WAITING_MAX)
    return refuse_set(ch, TSHARE_E_LIMIT, true, "%d sets already wait for tshare_set_recv()", TS_SETS_WAITING_MAX);
  rx->partial = NULL;
  rx->waiting[(rx->head + rx->len++) % TS_SETS_WAITING_MAX] = s;
  return TSHARE_OK;
}

static int lost_fd(tshare_channel *ch, int lost) {
  return refuse_set(ch, TSHARE_E_LIMIT, true, "an fd of it could not be kept: %s",
                    lost == TS_FD_OVER_BUDGET ? "too many fds wait unclaimed (max_unclaimed_fds)"
                    : lost == ENFILE          ? "the system's file table is full (ENFILE)"
                                              : "this process has no free fd (EMFILE; raise ulimit -n)");
}

static int on_step(tshare_channel *ch, ts_set_rx *rx, const tshare_set_frame *f, int *fd, int fd_lost) {
  tshare_set *s = rx->partial;
  if (f->op == TSHARE_SET_BEGIN) {
    if (s) refuse_set(ch, TSHARE_E_PROTOCOL, true, "cut off by the beginning of set %llu", (unsigned long long)f->set_id);
    return begin_set(ch, rx, f);
  }
  if (!s || s->set_id != f->set_id) {
    if (f->set_id == rx->refused_id) return TSHARE_OK; /* the rest of a refused set */
    if (s) refuse_set(ch, TSHARE_E_PROTOCOL, true, "cut off by a frame of set %llu", (unsigned long long)f->set_id);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PROTOCOL,
                   "receive: peer %s sent a frame of tensor set %llu, which did not begin", ch->conn.peer_label,
                   (unsigned long long)f->set_id);
  }
  switch (f->op) {
  case TSHARE_SET_MEM:
    return fd_lost ? lost_fd(ch, fd_lost) : add_mem(ch, s, &f->u.mem, fd);
  case TSHARE_SET_MEMBER:
    return add_member(ch, s, &f->u.member);
  case TSHARE_SET_META:
    return add_meta(ch, s, &f->u.meta);
  default:
    return end_set(ch, rx, s);
  }
}

int ts_set_on_frame(tshare_channel *ch, const tshare_frame *f, int fd, int fd_lost) {
  ts_set_rx *rx = set_rx(ch);
  int rc = rx ? on_step(ch, rx, &f->u.set, &fd, fd_lost)
              : ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "receive: out of memory for a tensor set");
  if (fd >= 0) close(fd); /* a new mapping keeps its fd; the rest go */
  return rc;
}

void ts_set_on_other_frame(tshare_channel *ch, int type) {
  if (!ch->set_rx || !ch->set_rx->partial) return;
  if (type == TSHARE_FRAME_RELEASE || type == TSHARE_FRAME_EVENT || type == TSHARE_FRAME_RETIRE) return;
  refuse_set(ch, TSHARE_E_PROTOCOL, true, "cut off by a %s frame", tshare_frame_type_name(type));
}

void ts_set_peer_gone(tshare_channel *ch) {
  if (ch->set_rx && ch->set_rx->partial)
    refuse_set(ch, TSHARE_E_PEER_CLOSED, false, "cut off: the peer closed the channel in the middle of it");
}

void ts_set_free_queued(tshare_channel *ch) {
  ts_set_rx *rx = ch->set_rx;
  if (!rx) return;
  /* Their mappings are the channel's, unmapped with it. */
  if (rx->partial) set_free(rx->partial);
  for (size_t i = 0; i < rx->len; i++) set_free(rx->waiting[(rx->head + i) % TS_SETS_WAITING_MAX]);
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

uint64_t tshare_set_id(const tshare_set *s) { return s ? s->set_id : 0; }
size_t tshare_set_count(const tshare_set *s) { return s ? s->count : 0; }
const char *tshare_set_name(const tshare_set *s, size_t i) {
  return s && i < s->count ? s->names + s->entries[i].name_at : NULL;
}
const tshare_tensor_desc *tshare_set_desc(const tshare_set *s, size_t i) {
  return s && i < s->count ? &s->entries[i].desc : NULL;
}
void *tshare_set_data(const tshare_set *s, size_t i) { return s && i < s->count ? s->entries[i].data : NULL; }

long tshare_set_find(const tshare_set *s, const char *name) {
  return s && name ? name_lookup(&s->by_name, name, set_name_at, s, s->count) : -1;
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
  host_backend()->memory_unref_locked(ch, v->memory);
  pthread_mutex_unlock(&ch->lock);
  set_unref(((set_view *)v)->set);
  return TS_RELEASE_LATER; /* the set is released as a whole */
}

/* A member view a forked child inherited: only its copy of the mapping goes. */
static void member_release_in_child(tshare_view *v) { host_backend()->memory_unref_in_child(v->ch, v->memory); }

/* A member shares on as any host view: its mapping's memfd travels. */
static int member_share_view(tshare_channel *ch, tshare_view *v, const tshare_tensor_desc *desc, void *stream,
                             const char *tag, ts_export *e, int timeout_ms, uint64_t *share_id) {
  return host_backend()->share_view(ch, v, desc, stream, tag, e, timeout_ms, share_id);
}

/* The host backend with a member's own release. */
static const ts_backend member_backend = {
    .name = "host (tensor set)",
    .release = member_release,
    .release_in_child = member_release_in_child,
    .share_view = member_share_view,
};

int tshare_set_view(tshare_set *s, size_t i, tshare_view **out) {
  if (!out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  if (!s || i >= s->count) return TSHARE_E_INVALID_ARG;
  set_view *sv = calloc(1, sizeof *sv);
  if (!sv) return TSHARE_E_NOMEM;
  tshare_view *v = &sv->view;
  tshare_channel *ch = s->ch;
  const set_entry *e = &s->entries[i];
  sv->set = s;
  atomic_fetch_add(&s->refs, 1);
  atomic_fetch_add(&ch->refs, 1);
  pthread_mutex_lock(&ch->lock);
  const set_mem *mem = &s->mems[e->mem];
  host_backend()->memory_ref_locked(ch, mem->memory);
  v->memory = mem->memory;
  pthread_mutex_unlock(&ch->lock);
  v->ch = ch;
  v->backend = &member_backend;
  v->share_id = s->set_id;
  v->device_type = TSHARE_DEVICE_CPU;
  v->data = e->data;
  v->desc = e->desc;
  v->frame.share_id = s->set_id;
  v->frame.alloc_id = mem->alloc_id;
  v->frame.alloc_size = mem->size;
  v->frame.mem_kind = TSHARE_MEM_HOST_MEMFD;
  v->frame.device_type = TSHARE_DEVICE_CPU;
  v->frame.tensor = e->desc;
  *out = v;
  return TSHARE_OK;
}
