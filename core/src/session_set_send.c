/* Tensor sets (set.h) on the producer side: the builder of named host
 * tensors and metadata, and the sending of a set as its frames (wire.h:
 * begin, memories, members, metadata, end) under one share id. */
#include "tshare/set.h"

#include "backend.h"
#include "error_detail.h"
#include "log.h"
#include "session.h"
#include "session_set.h"
#include "wire_checks.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
  for (size_t i = 0; i < b->mem_count; i++) ts_set_host_backend()->source_release(b->mems[i]);
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
  ts_set_host_backend()->source_retain(buf);
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
  if (ts_set_name_lookup(&b->names, name, builder_name_at, b, b->count) >= 0)
    return ts_errf(err, cap, TSHARE_E_INVALID_ARG, "set: a tensor named '%s' is already in the set", name);
  char why[160];
  rc = ts_tensor_check(desc, tshare_host_buffer_size(buf), NULL, NULL, why, sizeof why);
  if (rc != TSHARE_OK) return ts_errf(err, cap, rc, "set: tensor '%s': %s", name, why);
  char *copy = strdup(name);
  long mem = copy && grow((void **)&b->entries, &b->cap, b->count + 1, sizeof *b->entries) &&
                     ts_set_name_insert(&b->names, name, b->count) == 0
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
  for (size_t i = 0; i < k->count; i++) ts_set_host_backend()->source_release(k->bufs[i]);
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
    ts_set_host_backend()->source_retain(b->mems[i]);
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
  for (size_t i = 0; i < b->mem_count; i++)
    if (!tshare_host_buffer_is_sealed(b->mems[i]) && !(ch->conn.peer.capabilities & TSHARE_CAP_HOST_FD))
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                     "set: memory %zu is an unsealed file (torch's shared memory) and peer %s does not take such "
                     "files: copy it into tshare's shared memory",
                     i, ch->conn.peer_label);
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
                                     .mem_kind = tshare_host_buffer_is_sealed(b->mems[i]) ? TSHARE_MEM_HOST_MEMFD
                                                                                          : TSHARE_MEM_HOST_FD,
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

