/* Tensor sets (set.h) on the producer side: the builder of named tensors (host buffers, and
 * device memory described by its backend's set hooks) and metadata, and the sending of a set
 * as its frames (wire.h: begin, memories, members, metadata, end) under one share id. */
#include "tshare/set.h"

#include "backend.h"
#include "error_detail.h"
#include "log.h"
#include "session.h"
#include "session_set.h"
#include "session_stage.h"
#include "spare_blocks.h"
#include "wire_checks.h"

#include <stdlib.h>
#include <string.h>

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
  tshare_tensor_desc desc; /* byte_offset relative to its memory */
  ts_keep_ref keep;        /* device memory: what keeps this member alive, a reference; else zeroed */
} builder_entry;

/* One memory of the set: a host buffer, or device memory a backend describes. */
typedef struct builder_mem {
  tshare_host_buffer *host; /* a reference */
  ts_set_source *device;    /* a reference */
} builder_mem;

struct tshare_set_builder {
  builder_entry *entries;
  size_t count, cap;
  size_t names_bytes;
  ts_u64map names;   /* name hash -> entry index + 1 */
  builder_mem *mems;
  size_t mem_count, mem_cap, host_count;
  ts_u64map mem_by_id;    /* host buffer id -> mems index + 1 */
  ts_u64map device_by_id; /* device allocation id + 1 -> mems index + 1 */
  const ts_backend *device_backend; /* of every device memory: one kind, one device */
  ts_set_source *last_device;       /* the memory of the last device member (mems holds it) */
  int device;
  void *stream; /* the device stream the members were written on */
  uint8_t *meta;
  size_t meta_len;
  /* Who it is to a channel's layout slots (session_set_slots.c): a serial
   * of its own, and a generation bumped by every change but the metadata. */
  uint64_t serial, generation;
};

tshare_set_builder *tshare_set_builder_create(void) {
  static atomic_uint_fast64_t serials;
  tshare_set_builder *b = calloc(1, sizeof(tshare_set_builder));
  if (b) b->serial = (uint64_t)atomic_fetch_add(&serials, 1) + 1;
  return b;
}

static void source_unref(ts_set_source *src) {
  if (atomic_fetch_sub(&src->refs, 1) == 1) src->backend->set_source_free(src);
}

static void drop_keep(ts_keep_ref *k) {
  if (k->drop) k->drop(k->keep);
}

void tshare_set_builder_destroy(tshare_set_builder *b) {
  if (!b) return;
  for (size_t i = 0; i < b->count; i++) {
    free(b->entries[i].name);
    drop_keep(&b->entries[i].keep);
  }
  for (size_t i = 0; i < b->mem_count; i++) {
    if (b->mems[i].host) ts_set_host_backend()->source_release(b->mems[i].host);
    if (b->mems[i].device) source_unref(b->mems[i].device);
  }
  free(b->entries);
  free(b->mems);
  free(b->meta);
  ts_u64map_free(&b->names);
  ts_u64map_free(&b->mem_by_id);
  ts_u64map_free(&b->device_by_id);
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

/* The index of mem among the builder's memories (found by id in map, or
 * added with the reference the caller gives: then *added); -1 when out of
 * memory. */
static long find_or_add_mem(tshare_set_builder *b, ts_u64map *map, uint64_t key, builder_mem mem, bool *added) {
  *added = false;
  void *hit = ts_u64map_get(map, key);
  if (hit) return (long)((uintptr_t)hit - 1);
  if (!grow((void **)&b->mems, &b->mem_cap, b->mem_count + 1, sizeof *b->mems) ||
      ts_u64map_put(map, key, (void *)(uintptr_t)(b->mem_count + 1)) != 0)
    return -1;
  *added = true;
  b->mems[b->mem_count] = mem;
  return (long)b->mem_count++;
}

/* What every member is checked for: its name and layout, the bounds. */
static int check_new_member(tshare_set_builder *b, const char *name, const tshare_tensor_desc *desc, char *err,
                            size_t cap) {
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
  return TSHARE_OK;
}

/* Append member name (checked) in memory mem; keep is taken over. */
static int append_member(tshare_set_builder *b, const char *name, long mem, const tshare_tensor_desc *desc,
                         const ts_keep_ref *keep, char *err, size_t cap) {
  char *copy = mem >= 0 ? strdup(name) : NULL;
  if (!copy || !grow((void **)&b->entries, &b->cap, b->count + 1, sizeof *b->entries) ||
      ts_set_name_insert(&b->names, name, b->count) != 0) {
    free(copy);
    return ts_errf(err, cap, TSHARE_E_NOMEM, "set: out of memory");
  }
  b->entries[b->count++] = (builder_entry){copy, (uint32_t)mem, *desc, *keep};
  b->names_bytes += strlen(name);
  return TSHARE_OK;
}

static int builder_add(tshare_set_builder *b, const char *name, tshare_host_buffer *buf,
                       const tshare_tensor_desc *desc, char *err, size_t cap) {
  b->generation++; /* a memory may be added even when the member is not */
  int rc = check_new_member(b, name, desc, err, cap);
  if (rc != TSHARE_OK) return rc;
  char why[160];
  rc = ts_tensor_check(desc, tshare_host_buffer_size(buf), NULL, NULL, why, sizeof why);
  if (rc != TSHARE_OK) return ts_errf(err, cap, rc, "set: tensor '%s': %s", name, why);
  bool added;
  long mem = find_or_add_mem(b, &b->mem_by_id, tshare_host_buffer_id(buf), (builder_mem){buf, NULL}, &added);
  if (added) {
    ts_set_host_backend()->source_retain(buf);
    b->host_count++;
  }
  ts_keep_ref none = {NULL, NULL, NULL};
  return append_member(b, name, mem, desc, &none, err, cap);
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

/* The memory of a device member, found or added (src's reference taken
 * over either way). */
static int device_mem(tshare_set_builder *b, const char *name, ts_set_source *src, long *mem, char *err, size_t cap) {
  if (b->device_backend && (b->device_backend != src->backend || b->device != src->device)) {
    int rc = ts_errf(err, cap, TSHARE_E_UNSUPPORTED,
                     "set: tensor '%s' lives on %s device %d and the set's other device tensors on device %d: a set "
                     "carries one device's memory (send a set per device)",
                     name, src->backend->name, src->device, b->device);
    source_unref(src);
    return rc;
  }
  /* Read before src may go: the set's one device from here on. */
  const ts_backend *backend = src->backend;
  int device = src->device;
  bool added;
  *mem = find_or_add_mem(b, &b->device_by_id, src->alloc_id + 1, (builder_mem){NULL, src}, &added);
  if (!added) source_unref(src); /* the memory is in the set already, or none was added */
  if (*mem < 0) return ts_errf(err, cap, TSHARE_E_NOMEM, "set: out of memory");
  b->device_backend = backend;
  b->device = device;
  b->last_device = b->mems[*mem].device;
  return TSHARE_OK;
}

/* A device member: foreign memory at ptr (with user_keep, or none) or the
 * backend's buffer buf. user_keep's reference is the builder's from here on. */
static int builder_add_device(tshare_set_builder *b, const char *name, void *ptr, void *buf,
                              const tshare_tensor_desc *desc, const ts_keep_ref *user_keep, char *err, size_t cap) {
  const ts_backend *be = ts_backend_for_mem_kind(TSHARE_MEM_CUDA_IPC);
  int rc = check_new_member(b, name, desc, err, cap);
  if (rc == TSHARE_OK && (!be || !be->set_source_new))
    rc = ts_errf(err, cap, TSHARE_E_UNSUPPORTED, "set: tensor '%s' is device memory, which this build of tshare "
                 "does not carry in sets", name);
  ts_set_source *src = NULL;
  uint64_t offset = 0;
  b->generation++;
  ts_keep_ref member_keep = {NULL, NULL, NULL};
  if (rc == TSHARE_OK)
    rc = be->set_source_new(ptr, buf, desc, user_keep, b->last_device, &src, &offset, &member_keep, err, cap);
  if (rc != TSHARE_OK) {
    if (user_keep) user_keep->drop(user_keep->keep);
    return rc;
  }
  if (user_keep) member_keep = *user_keep;
  tshare_tensor_desc in_mem = *desc;
  in_mem.byte_offset += offset;
  char why[160];
  uint64_t size = src->size;
  long mem = -1;
  rc = ts_tensor_check(&in_mem, size, NULL, NULL, why, sizeof why);
  if (rc != TSHARE_OK) {
    ts_errf(err, cap, rc, "set: tensor '%s' reaches past its allocation of %llu bytes: %s", name,
            (unsigned long long)size, why);
    source_unref(src);
  } else if ((rc = device_mem(b, name, src, &mem, err, cap)) == TSHARE_OK) {
    rc = append_member(b, name, mem, &in_mem, &member_keep, err, cap);
  }
  if (rc != TSHARE_OK) drop_keep(&member_keep);
  return rc;
}

/* keep (optional) is dropped on failure, also when refused here. */
static int add_device_call(tshare_set_builder *b, const char *name, void *ptr, void *buf,
                           const tshare_tensor_desc *desc, const ts_keep_ref *keep, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX] = "";
  int rc;
  if (b && name && (ptr || buf) && desc) {
    rc = builder_add_device(b, name, ptr, buf, desc, keep, msg, sizeof msg);
  } else {
    rc = ts_errf(msg, sizeof msg, TSHARE_E_INVALID_ARG, "set: NULL builder, name, pointer or descriptor");
    if (keep) keep->drop(keep->keep);
  }
  ts_error_fill(err, rc, msg);
  return rc;
}

int tshare_set_builder_add_cuda(tshare_set_builder *b, const char *name, void *ptr, const tshare_tensor_desc *desc,
                                tshare_error *err) {
  return add_device_call(b, name, ptr, NULL, desc, NULL, err);
}

int tshare_set_builder_add_cuda_keep(tshare_set_builder *b, const char *name, void *ptr,
                                     const tshare_tensor_desc *desc, void (*retain)(void *keep), tshare_drop_fn drop,
                                     void *keep, tshare_error *err) {
  if (!retain || !drop) {
    if (drop) drop(keep);
    char msg[TSHARE_ERROR_MSG_MAX];
    int rc = ts_errf(msg, sizeof msg, TSHARE_E_INVALID_ARG, "set: NULL retain or drop function");
    ts_error_fill(err, rc, msg);
    return rc;
  }
  ts_keep_ref k = {retain, drop, keep};
  return add_device_call(b, name, ptr, NULL, desc, &k, err);
}

int tshare_set_builder_add_cuda_buffer(tshare_set_builder *b, const char *name, tshare_cuda_buffer *buf,
                                       const tshare_tensor_desc *desc, tshare_error *err) {
  return add_device_call(b, name, NULL, buf, desc, NULL, err);
}

void tshare_set_builder_set_stream(tshare_set_builder *b, void *stream) {
  /* The same stream again (a caller that sets it before every send) changes
   * nothing: the set may still go again from its layout. */
  if (!b || b->stream == stream) return;
  b->stream = stream;
  b->generation++; /* its ordering goes with the members' frames */
}

int tshare_set_builder_set_meta(tshare_set_builder *b, const void *meta, size_t len, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX] = "";
  int rc = TSHARE_OK;
  uint8_t *copy = b && len == b->meta_len ? b->meta : NULL; /* a version sent again: the buffer is reused */
  if (!b || (len && !meta))
    rc = ts_errf(msg, sizeof msg, TSHARE_E_INVALID_ARG, "set: NULL builder or metadata");
  else if (len > TSHARE_SET_META_MAX)
    rc = ts_errf(msg, sizeof msg, TSHARE_E_TOO_LARGE, "set: %zu bytes of metadata over %u", len, TSHARE_SET_META_MAX);
  else if (len && !copy && !(copy = malloc(len)))
    rc = ts_errf(msg, sizeof msg, TSHARE_E_NOMEM, "set: out of memory");
  if (rc == TSHARE_OK) {
    if (len) memmove(copy, meta, len);
    if (copy != b->meta) free(b->meta);
    b->meta = copy;
    b->meta_len = len;
  }
  ts_error_fill(err, rc, msg);
  return rc;
}

/* ---- producer: sending -------------------------------------------------- */

/* What a sent set keeps alive until its release: a reference on each host
 * buffer and device memory, each device member's keep, and what the
 * backend holds for a memory while the peer may keep it mapped. */
typedef struct set_keep {
  size_t nmems, nkeeps, nholds;
  builder_mem *mems;
  ts_keep_ref *keeps; /* nkeeps member keeps, then nholds holds (up to nmems) */
} set_keep;
static ts_spare_blocks spare_keeps; /* one set_keep per hand-off, tens of KiB for a model */

static void set_keep_release(void *owner) {
  set_keep *k = owner;
  for (size_t i = 0; i < k->nmems; i++) {
    if (k->mems[i].host) ts_set_host_backend()->source_release(k->mems[i].host);
    if (k->mems[i].device) source_unref(k->mems[i].device);
  }
  for (size_t i = 0; i < k->nkeeps + k->nholds; i++) drop_keep(&k->keeps[i]);
  ts_spare_free(&spare_keeps, k);
}

static size_t device_keeps(const tshare_set_builder *b) {
  size_t n = 0;
  for (size_t i = 0; i < b->count; i++) n += b->entries[i].keep.drop != NULL;
  return n;
}

static ts_export *set_export(const tshare_set_builder *b, void *user_data) {
  size_t nkeeps = device_keeps(b);
  ts_export *e = malloc(sizeof *e);
  set_keep *k = ts_spare_alloc(&spare_keeps, sizeof *k + b->mem_count * sizeof(builder_mem) +
                                                 (nkeeps + b->mem_count) * sizeof(ts_keep_ref));
  if (!e || !k) {
    free(e);
    ts_spare_free(&spare_keeps, k);
    return NULL;
  }
  k->mems = (builder_mem *)(k + 1);
  k->keeps = (ts_keep_ref *)(k->mems + b->mem_count);
  k->nmems = b->mem_count;
  k->nholds = 0;
  k->nkeeps = 0;
  for (size_t i = 0; i < b->mem_count; i++) {
    k->mems[i] = b->mems[i];
    if (b->mems[i].host) ts_set_host_backend()->source_retain(b->mems[i].host);
    if (b->mems[i].device) atomic_fetch_add(&b->mems[i].device->refs, 1);
  }
  for (size_t i = 0; i < b->count; i++) {
    const ts_keep_ref *m = &b->entries[i].keep;
    if (!m->drop) continue;
    if (m->retain) m->retain(m->keep);
    k->keeps[k->nkeeps++] = *m;
  }
  *e = (ts_export){.user_data = user_data, .release = set_keep_release, .owner = k};
  return e;
}

/* A set sent again names no memory: the backends' holds for it (anchored
 * segments) are taken here. false: one could not be; the set goes whole. */
static bool hold_again(tshare_channel *ch, const tshare_set_builder *b, set_keep *k) {
  for (size_t i = 0; i < b->mem_count; i++) {
    const ts_set_source *src = b->mems[i].device;
    if (!src || !src->backend->set_again_hold) continue;
    ts_keep_ref hold = {NULL, NULL, NULL};
    if (src->backend->set_again_hold(ch, src, &hold) != TSHARE_OK) {
      for (size_t j = 0; j < k->nholds; j++) drop_keep(&k->keeps[k->nkeeps + j]);
      k->nholds = 0;
      return false;
    }
    if (hold.drop) k->keeps[k->nkeeps + k->nholds++] = hold;
  }
  return true;
}

static int check_can_send(tshare_channel *ch, const tshare_set_builder *b) {
  if (ch->closed || ch->conn.wfd < 0) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_STATE, "set: channel is closed");
  if (b->count == 0) return ts_errf(ch->err, sizeof ch->err, TSHARE_E_INVALID_ARG, "set: the set has no tensors");
  bool passes_fds = ts_conn_caps(&ch->conn) & TS_TRANSPORT_PASSES_FDS;
  const ts_backend *host = ts_set_host_backend();
  if (b->host_count && !passes_fds && !host->set_remote_check)
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_UNSUPPORTED,
                   "set: host memory travels as fds, which a pipe channel cannot carry: open a socket channel");
  if (ch->conn.minor < 3 || !(ch->conn.peer.capabilities & TSHARE_CAP_TENSOR_SETS))
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                   "set: peer %s does not receive tensor sets (it speaks wire %u.%u; sets need %d.3 or newer): "
                   "upgrade it, or share the tensors one by one",
                   ch->conn.peer_label, (unsigned)ch->conn.peer.major, (unsigned)ch->conn.peer.minor,
                   TSHARE_WIRE_MAJOR);
  bool staged = ts_stage_applies(ch);
  for (size_t i = 0; i < b->mem_count; i++) {
    const ts_set_source *src = b->mems[i].device;
    int rc = !src ? TSHARE_OK : staged ? ts_stage_set_check(ch, src) : src->backend->set_check(ch, src);
    if (rc == TSHARE_OK && !src && !passes_fds) rc = host->set_remote_check(ch, b->mems[i].host);
    if (rc != TSHARE_OK) return rc;
    if (!src && passes_fds && !tshare_host_buffer_is_sealed(b->mems[i].host) &&
        !(ch->conn.peer.capabilities & TSHARE_CAP_HOST_FD))
      return ts_errf(ch->err, sizeof ch->err, TSHARE_E_PEER_MISMATCH,
                     "set: memory %zu is an unsealed file (torch's shared memory) and peer %s does not take such "
                     "files: copy it into tshare's shared memory",
                     i, ch->conn.peer_label);
  }
  return TSHARE_OK;
}

static int send_step(tshare_channel *ch, const tshare_frame *f, int fd, int64_t deadline) {
  return ts_channel_send(ch, f, fd, ts_remaining(deadline));
}

/* Host memory i: its memfd attached, or, where the peer keeps it mapped, a
 * frame naming it (TSHARE_MEM_HOST_KEPT); lent to a peer that may keep it.
 * Over a channel without fds, remote memory its backend describes. */
static int send_host_mem(tshare_channel *ch, tshare_host_buffer *buf, tshare_frame *f, int64_t deadline) {
  const ts_backend *host = ts_set_host_backend();
  if (!(ts_conn_caps(&ch->conn) & TS_TRANSPORT_PASSES_FDS)) /* checked: read remotely (UCX) */
    return host->set_send_remote(ch, buf, f, ts_remaining(deadline));
  bool kept = false;
  uint32_t share_flags = 0;
  int rc = host->source_lend ? host->source_lend(ch, buf, &kept, &share_flags) : TSHARE_OK;
  if (rc != TSHARE_OK) return rc;
  int kind = kept                                ? TSHARE_MEM_HOST_KEPT
             : tshare_host_buffer_is_sealed(buf) ? TSHARE_MEM_HOST_MEMFD
                                                 : TSHARE_MEM_HOST_FD;
  f->flags = (uint8_t)(kept ? 0 : TSHARE_FRAME_FLAG_FD_ATTACHED);
  f->u.set.u.mem.alloc_id = tshare_host_buffer_id(buf);
  f->u.set.u.mem.mem_kind = (uint8_t)kind;
  f->u.set.u.mem.device_type = TSHARE_DEVICE_CPU;
  f->u.set.u.mem.alloc_size = tshare_host_buffer_size(buf);
  f->u.set.u.mem.share_flags = share_flags;
  return send_step(ch, f, kept ? -1 : tshare_host_buffer_fd(buf), deadline);
}

/* Memory i: a host buffer (above), or what its backend sends for it (what
 * it holds for the set goes with the set's export, or at once where the
 * peer already released the set). */
static int send_mem(tshare_channel *ch, const tshare_set_builder *b, size_t i, uint64_t id, int64_t deadline,
                    bool *keepable) {
  tshare_frame f = ts_set_step(TSHARE_SET_MEM, id);
  const builder_mem *m = &b->mems[i];
  f.u.set.u.mem.index = (uint32_t)i;
  int rc;
  if (m->device) {
    ts_keep_ref hold = {NULL, NULL, NULL};
    rc = ts_stage_applies(ch) ? ts_stage_set_mem(ch, m->device, b->stream, &f, &hold, ts_remaining(deadline))
                              : m->device->backend->set_send_mem(ch, m->device, &f, &hold, ts_remaining(deadline));
    ts_export *e = ts_export_find(ch, id);
    set_keep *k = e ? e->owner : NULL;
    if (hold.drop && k) k->keeps[k->nkeeps + k->nholds++] = hold;
    else drop_keep(&hold);
  } else {
    rc = send_host_mem(ch, m->host, &f, deadline);
  }
  /* The peer keeps a layout of the set only where it keeps every memory. */
  if (!ts_set_mem_keepable(f.u.set.u.mem.mem_kind, f.u.set.u.mem.share_flags)) *keepable = false;
  return rc;
}

/* The memories and members of the set (*keepable: whether the peer keeps
 * every memory mapped, so that it may keep the set's layout). */
static int send_members(tshare_channel *ch, const tshare_set_builder *b, uint64_t id, int64_t deadline,
                        bool *keepable) {
  int rc = TSHARE_OK;
  for (size_t i = 0; i < b->mem_count && rc == TSHARE_OK; i++) rc = send_mem(ch, b, i, id, deadline, keepable);
  for (size_t i = 0; i < b->count && rc == TSHARE_OK; i++) {
    tshare_frame f = ts_set_step(TSHARE_SET_MEMBER, id);
    tshare_set_member_frame *m = &f.u.set.u.member;
    m->index = (uint32_t)i;
    m->mem_index = b->entries[i].mem;
    m->name_len = (uint16_t)strlen(b->entries[i].name);
    memcpy(m->name, b->entries[i].name, m->name_len);
    m->tensor = b->entries[i].desc;
    rc = send_step(ch, &f, -1, deadline);
  }
  return rc;
}

static int send_meta(tshare_channel *ch, const tshare_set_builder *b, uint64_t id, int64_t deadline) {
  int rc = TSHARE_OK;
  for (size_t off = 0; off < b->meta_len && rc == TSHARE_OK; off += TSHARE_SET_META_CHUNK_MAX) {
    tshare_frame f = ts_set_step(TSHARE_SET_META, id);
    size_t n = b->meta_len - off < TSHARE_SET_META_CHUNK_MAX ? b->meta_len - off : TSHARE_SET_META_CHUNK_MAX;
    f.u.set.u.meta.offset = (uint32_t)off;
    f.u.set.u.meta.len = (uint16_t)n;
    memcpy(f.u.set.u.meta.bytes, b->meta + off, n);
    rc = send_step(ch, &f, -1, deadline);
  }
  return rc;
}

/* The set's one ordering point: after every member was written on the
 * builder's stream, recorded once (its event on the end frame). */
static int order_after_members(tshare_channel *ch, const tshare_set_builder *b, tshare_frame *end, uint64_t id,
                               int64_t deadline) {
  ts_export *e = ts_export_find(ch, id);
  if (!e) return TSHARE_OK; /* the peer released what came of it already */
  if (ts_stage_applies(ch)) return TSHARE_OK; /* staging waited for the stream: the bytes are in host memory */
  for (size_t i = 0; i < b->mem_count; i++) {
    const ts_set_source *src = b->mems[i].device;
    if (src) return src->backend->set_order(ch, src, b->stream, end, e, ts_remaining(deadline));
  }
  return TSHARE_OK;
}

/* The least of how b's memories would go to ch now: TS_KEEP_KEPT when the
 * peer keeps every one mapped (asked per memory, not per member). */
static ts_keep_state keep_state(tshare_channel *ch, const tshare_set_builder *b) {
  const ts_backend *host = ts_set_host_backend();
  ts_keep_state least = TS_KEEP_KEPT;
  bool staged = ts_stage_applies(ch);
  for (size_t i = 0; i < b->mem_count && least != TS_KEEP_NONE; i++) {
    const ts_set_source *src = b->mems[i].device;
    if (src && staged) return TS_KEEP_NONE; /* read into the peer's own memory: nothing it keeps */
    ts_keep_state state = src ? (src->backend->set_keep_state ? src->backend->set_keep_state(ch, src) : TS_KEEP_NONE)
                          : host->source_keep_state ? host->source_keep_state(ch, b->mems[i].host)
                                                    : TS_KEEP_NONE;
    if (state < least) least = state;
  }
  return least;
}

/* The set's first frame: its begin (offering the peer to keep its layout in
 * plan's slot), or, sent again, the layout it comes from. */
static tshare_frame first_frame(const tshare_set_builder *b, uint64_t id, const ts_set_again_plan *plan) {
  if (plan->layout_id) {
    tshare_frame f = ts_set_step(TSHARE_SET_AGAIN, id);
    f.u.set.u.again = (tshare_set_again_frame){(uint8_t)plan->slot, plan->layout_id, (uint32_t)b->meta_len};
    return f;
  }
  tshare_frame f = ts_set_step(TSHARE_SET_BEGIN, id);
  f.u.set.u.begin = (tshare_set_begin_frame){(uint32_t)b->count, (uint32_t)b->mem_count, (uint32_t)b->names_bytes,
                                             (uint32_t)b->meta_len, (uint8_t)plan->slot};
  return f;
}

static int set_send(tshare_channel *ch, const tshare_set_builder *b, void *user_data, int timeout_ms,
                    uint64_t *set_id) {
  int rc = check_can_send(ch, b);
  if (rc != TSHARE_OK) return rc;
  ts_set_again_plan plan = {0, 0};
  if (ts_set_again_agreed(ch)) plan = ts_set_slots_plan(ch, b->serial, b->generation, keep_state(ch, b));
  ts_export *e = set_export(b, user_data);
  if (!e || ts_export_register(ch, e) != TSHARE_OK) {
    if (e) ts_export_drop(e);
    return ts_errf(ch->err, sizeof ch->err, TSHARE_E_NOMEM, "set: out of memory");
  }
  uint64_t id = e->share_id;
  if (plan.layout_id && !hold_again(ch, b, e->owner)) plan.layout_id = 0; /* whole, its slot offered anew */
  int64_t deadline = ts_deadline(timeout_ms);
  tshare_frame f = first_frame(b, id, &plan);
  rc = send_step(ch, &f, -1, deadline);
  if (rc != TSHARE_OK) { /* nothing went: the set never existed */
    ts_export_drop(ts_export_take(ch, id));
    return rc;
  }
  /* Registered before the first frame, and kept from here on whatever
   * happens: the peer releases a set it got only part of. */
  ts_export_sent(ch);
  if (set_id) *set_id = id;
  bool keepable = true;
  rc = plan.layout_id ? TSHARE_OK : send_members(ch, b, id, deadline, &keepable);
  if (rc == TSHARE_OK) rc = send_meta(ch, b, id, deadline);
  f = ts_set_step(TSHARE_SET_END, id);
  if (rc == TSHARE_OK && b->device_backend) rc = order_after_members(ch, b, &f, id, deadline);
  if (rc == TSHARE_OK) rc = send_step(ch, &f, -1, deadline);
  if (plan.slot && !plan.layout_id) /* the peer keeps the layout of a set that came whole, of kept memories */
    ts_set_slots_declared(ch, plan.slot, b->serial, b->generation, rc == TSHARE_OK && keepable ? id : 0);
  if (rc == TSHARE_OK)
    TS_LOG(TS_LOG_INFO, "sent tensor set %llu (%zu tensors in %zu memories, %zu bytes of metadata%s) to %s",
           (unsigned long long)id, b->count, b->mem_count, b->meta_len,
           plan.layout_id ? ", again from its layout" : "", ch->conn.peer_label);
  return rc;
}

int tshare_set_send(tshare_channel *ch, const tshare_set_builder *b, void *user_data, int timeout_ms,
                    uint64_t *set_id) {
  if (set_id) *set_id = 0;
  if (!ch || !b) return TSHARE_E_INVALID_ARG;
  TS_CHANNEL_CALL(ch, "send set", set_send(ch, b, user_data, timeout_ms, set_id));
}

