#include "tshare/wire.h"

#include "bytes.h"
#include "error_detail.h"
#include "wire_checks.h"
#include "tshare/errors.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

tshare_wire_limits tshare_wire_limits_default(void) {
  tshare_wire_limits l;
  l.max_payload = TSHARE_WIRE_FRAME_MAX - TSHARE_WIRE_HEADER_SIZE;
  l.max_ndim = TSHARE_MAX_NDIM;
  l.max_tag = TSHARE_TAG_MAX;
  l.max_release_ids = TSHARE_RELEASE_MAX;
  l.max_alloc_size = (uint64_t)1 << 48;
  return l;
}

static tshare_wire_limits clamp_limits(const tshare_wire_limits *in) {
  tshare_wire_limits d = tshare_wire_limits_default();
  if (!in) return d;
  tshare_wire_limits l = *in;
  if (l.max_payload > d.max_payload) l.max_payload = d.max_payload;
  if (l.max_ndim > d.max_ndim) l.max_ndim = d.max_ndim;
  if (l.max_tag > d.max_tag) l.max_tag = d.max_tag;
  if (l.max_release_ids > d.max_release_ids) l.max_release_ids = d.max_release_ids;
  return l;
}

const char *tshare_frame_type_name(int type) {
  switch (type) {
  case TSHARE_FRAME_HELLO:
    return "hello";
  case TSHARE_FRAME_SHARE:
    return "share";
  case TSHARE_FRAME_RELEASE:
    return "release";
  case TSHARE_FRAME_BYE:
    return "bye";
  case TSHARE_FRAME_ERROR:
    return "error";
  case TSHARE_FRAME_EVENT:
    return "event";
  case TSHARE_FRAME_RETIRE:
    return "retire";
  case TSHARE_FRAME_RING:
    return "ring";
  case TSHARE_FRAME_CHUNK:
    return "chunk";
  case TSHARE_FRAME_SET:
    return "set";
  default:
    return "unknown";
  }
}

static bool type_known(int type) { return type >= TSHARE_FRAME_HELLO && type <= TSHARE_FRAME_SET; }

static bool kind_takes_fd(int kind) { return kind == TSHARE_MEM_HOST_MEMFD || kind == TSHARE_MEM_CUDA_FD; }

/* The ring and chunk frames' rules, the same for the encoder and the decoder. */
static int check_ring(const tshare_ring_frame *g, uint8_t flags, char *err, size_t cap) {
  if (g->op < TSHARE_RING_SETUP || g->op > TSHARE_RING_NUDGE)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "ring: unknown op %u", (unsigned)g->op);
  if ((g->op == TSHARE_RING_SETUP) != ((flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "ring: only a setup frame carries an fd");
  return TSHARE_OK;
}

static int check_chunk(const tshare_chunk_frame *k, uint8_t flags, uint64_t max_alloc_size, char *err, size_t cap) {
  if (k->count < 2 || k->count > TSHARE_CHUNKS_MAX || k->index == 0 || k->index >= k->count || k->size == 0 ||
      k->size > max_alloc_size)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "chunk: index %u of %u, %llu bytes", k->index, k->count,
                   (unsigned long long)k->size);
  if (!(flags & TSHARE_FRAME_FLAG_FD_ATTACHED))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "chunk: a chunk frame carries its fd");
  return TSHARE_OK;
}

/* Well-formed UTF-8 (no overlong forms, surrogates or code points past
 * U+10FFFF) without NUL: what a member's name must be. */
static bool utf8_name_ok(const char *s, size_t n) {
  const unsigned char *p = (const unsigned char *)s;
  for (size_t i = 0; i < n;) {
    unsigned c = p[i];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (c == 0 || len == 0 || len > n - i) return false;
    uint32_t cp = len == 1 ? c : c & (0x7Fu >> len);
    for (size_t k = 1; k < len; k++) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3Fu);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

static int check_set_begin(const tshare_set_begin_frame *b, char *err, size_t cap) {
  if (b->count == 0 || b->count > TSHARE_SET_MEMBERS_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: %u tensors outside 1..%u", b->count, TSHARE_SET_MEMBERS_MAX);
  if (b->mem_count == 0 || b->mem_count > b->count)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: %u memories for %u tensors (1..tensors)", b->mem_count,
                   b->count);
  uint64_t names_most = (uint64_t)b->count * TSHARE_SET_NAME_MAX;
  if (names_most > TSHARE_SET_NAMES_MAX) names_most = TSHARE_SET_NAMES_MAX;
  if (b->names_bytes < b->count || b->names_bytes > names_most)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: %u bytes of names for %u tensors (%u..%llu)", b->names_bytes,
                   b->count, b->count, (unsigned long long)names_most);
  if (b->meta_bytes > TSHARE_SET_META_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: %u bytes of metadata over %u", b->meta_bytes,
                   TSHARE_SET_META_MAX);
  return TSHARE_OK;
}

static int check_set_mem(const tshare_set_mem_frame *m, uint8_t flags, const tshare_wire_limits *limits, char *err,
                         size_t cap) {
  if (m->index >= TSHARE_SET_MEMBERS_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: memory index %u over %u", m->index, TSHARE_SET_MEMBERS_MAX);
  if (m->mem_kind < TSHARE_MEM_HOST_MEMFD || m->mem_kind > TSHARE_MEM_CUDA_HELD)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: memory %u of unknown mem_kind %u", m->index,
                   (unsigned)m->mem_kind);
  if (m->handle_len > TSHARE_HANDLE_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: memory %u: handle_len %u over %d", m->index,
                   (unsigned)m->handle_len, TSHARE_HANDLE_MAX);
  bool host = m->mem_kind == TSHARE_MEM_HOST_MEMFD;
  if (host != (m->device_type == TSHARE_DEVICE_CPU) || (host && m->handle_len != 0))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: memory %u: mem_kind %u with device_type %u and %u handle bytes",
                   m->index, (unsigned)m->mem_kind, (unsigned)m->device_type, (unsigned)m->handle_len);
  if (kind_takes_fd(m->mem_kind) != ((flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: memory %u: mem_kind %u and the fd-attached flag disagree",
                   m->index, (unsigned)m->mem_kind);
  if (m->alloc_size > limits->max_alloc_size)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: memory %u: alloc_size %llu over max_alloc_size %llu", m->index,
                   (unsigned long long)m->alloc_size, (unsigned long long)limits->max_alloc_size);
  return TSHARE_OK;
}

static int check_set_member(const tshare_set_member_frame *m, const tshare_wire_limits *limits, char *err, size_t cap) {
  if (m->index >= TSHARE_SET_MEMBERS_MAX || m->mem_index >= TSHARE_SET_MEMBERS_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: tensor %u (memory %u) over %u", m->index, m->mem_index,
                   TSHARE_SET_MEMBERS_MAX);
  if (m->name_len == 0 || m->name_len > TSHARE_SET_NAME_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: tensor %u: name of %u bytes outside 1..%u", m->index,
                   (unsigned)m->name_len, TSHARE_SET_NAME_MAX);
  if (!utf8_name_ok(m->name, m->name_len))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: tensor %u: name is not UTF-8 without NUL bytes", m->index);
  if (m->tensor.ndim < 0 || (uint32_t)m->tensor.ndim > limits->max_ndim)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: tensor %u: ndim %d over max_ndim %u", m->index,
                   (int)m->tensor.ndim, limits->max_ndim);
  /* Its memory's size comes in another frame: here only the arithmetic. */
  char why[160];
  int rc = ts_tensor_check(&m->tensor, UINT64_MAX, NULL, NULL, why, sizeof why);
  if (rc != TSHARE_OK) return ts_errf(err, cap, rc, "set: tensor %u: %s", m->index, why);
  return TSHARE_OK;
}

int ts_wire_check_set(const tshare_set_frame *f, uint8_t flags, const tshare_wire_limits *limits_in, char *err,
                      size_t cap) {
  tshare_wire_limits limits = clamp_limits(limits_in);
  if (f->set_id == 0) return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: set_id is 0");
  if (f->op != TSHARE_SET_MEM && (flags & TSHARE_FRAME_FLAG_FD_ATTACHED))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: only a memory frame carries an fd");
  if (flags & TSHARE_FRAME_FLAG_HAS_EVENT) return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: a set frame has no event");
  switch (f->op) {
  case TSHARE_SET_BEGIN:
    return check_set_begin(&f->u.begin, err, cap);
  case TSHARE_SET_MEM:
    return check_set_mem(&f->u.mem, flags, &limits, err, cap);
  case TSHARE_SET_MEMBER:
    return check_set_member(&f->u.member, &limits, err, cap);
  case TSHARE_SET_META:
    if (f->u.meta.len == 0 || f->u.meta.len > TSHARE_SET_META_CHUNK_MAX ||
        (uint64_t)f->u.meta.offset + f->u.meta.len > TSHARE_SET_META_MAX)
      return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: metadata chunk of %u bytes at %u (chunks 1..%u, total %u)",
                     (unsigned)f->u.meta.len, f->u.meta.offset, TSHARE_SET_META_CHUNK_MAX, TSHARE_SET_META_MAX);
    return TSHARE_OK;
  case TSHARE_SET_END:
    return TSHARE_OK;
  default:
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: unknown op %u", (unsigned)f->op);
  }
}

int ts_wire_check_share(const tshare_share_frame *s, const tshare_wire_limits *limits_in, char *err, size_t cap) {
  tshare_wire_limits limits = clamp_limits(limits_in);
  if (s->share_id == 0) return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: share_id is 0");
  switch (s->mem_kind) {
  case TSHARE_MEM_HOST_MEMFD:
    if (s->device_type != TSHARE_DEVICE_CPU)
      return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: host memfd with device_type %u", (unsigned)s->device_type);
    if (s->handle_len != 0)
      return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: host memfd carries %u handle bytes",
                     (unsigned)s->handle_len);
    break;
  case TSHARE_MEM_CUDA_IPC:
    if (s->device_type != TSHARE_DEVICE_CUDA)
      return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: CUDA IPC memory with device_type %u",
                     (unsigned)s->device_type);
    if (s->handle_len != TSHARE_HANDLE_MAX)
      return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: CUDA IPC handle_len %u, expected %d",
                     (unsigned)s->handle_len, TSHARE_HANDLE_MAX);
    break;
  case TSHARE_MEM_CUDA_FD:
  case TSHARE_MEM_CUDA_HELD:
    if (s->device_type != TSHARE_DEVICE_CUDA)
      return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: CUDA fd memory with device_type %u",
                     (unsigned)s->device_type);
    if (s->handle_len != 0)
      return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: CUDA fd memory carries %u handle bytes",
                     (unsigned)s->handle_len);
    break;
  default:
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: unknown mem_kind %u", (unsigned)s->mem_kind);
  }
  if (s->handle_len > TSHARE_HANDLE_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "share: handle_len %u over %d", (unsigned)s->handle_len,
                   TSHARE_HANDLE_MAX);
  if (s->tensor.ndim < 0 || (uint32_t)s->tensor.ndim > limits.max_ndim)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "share: ndim %d over max_ndim %u", (int)s->tensor.ndim,
                   limits.max_ndim);
  if (s->tag_len > limits.max_tag)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "share: tag_len %u over max_tag %u", (unsigned)s->tag_len,
                   limits.max_tag);
  if (memchr(s->tag, '\0', s->tag_len)) return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: tag contains a NUL byte");
  if (s->alloc_size > limits.max_alloc_size)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "share: alloc_size %llu over max_alloc_size %llu",
                   (unsigned long long)s->alloc_size, (unsigned long long)limits.max_alloc_size);
  char why[160];
  int rc = ts_tensor_check(&s->tensor, s->alloc_size, NULL, NULL, why, sizeof why);
  if (rc != TSHARE_OK) return ts_errf(err, cap, rc, "share %llu: %s", (unsigned long long)s->share_id, why);
  return TSHARE_OK;
}

/* ---- encoding ---------------------------------------------------------- */

static void put_desc(ts_writer *w, const tshare_tensor_desc *t) {
  ts_put_u8(w, t->dtype.code);
  ts_put_u8(w, t->dtype.bits);
  ts_put_u16(w, t->dtype.lanes);
  ts_put_u8(w, (uint8_t)t->ndim);
  ts_put_u64(w, t->byte_offset);
  for (int i = 0; i < t->ndim; i++) ts_put_u64(w, (uint64_t)t->shape[i]);
  for (int i = 0; i < t->ndim; i++) ts_put_u64(w, (uint64_t)t->strides[i]);
}

static int encode_set(const tshare_set_frame *f, uint8_t flags, ts_writer *w, char *err, size_t cap) {
  int rc = ts_wire_check_set(f, flags, NULL, err, cap);
  if (rc != TSHARE_OK) return rc;
  ts_put_u8(w, f->op);
  ts_put_u64(w, f->set_id);
  switch (f->op) {
  case TSHARE_SET_BEGIN:
    ts_put_u32(w, f->u.begin.count);
    ts_put_u32(w, f->u.begin.mem_count);
    ts_put_u32(w, f->u.begin.names_bytes);
    ts_put_u32(w, f->u.begin.meta_bytes);
    break;
  case TSHARE_SET_MEM: {
    const tshare_set_mem_frame *m = &f->u.mem;
    ts_put_u32(w, m->index);
    ts_put_u64(w, m->alloc_id);
    ts_put_u8(w, m->mem_kind);
    ts_put_u8(w, m->device_type);
    ts_put_u8(w, m->handle_len);
    ts_put_u64(w, m->alloc_size);
    ts_put_bytes(w, m->device_uuid, 16);
    ts_put_bytes(w, m->handle, m->handle_len);
    break;
  }
  case TSHARE_SET_MEMBER:
    ts_put_u32(w, f->u.member.index);
    ts_put_u32(w, f->u.member.mem_index);
    ts_put_u16(w, f->u.member.name_len);
    ts_put_bytes(w, f->u.member.name, f->u.member.name_len);
    put_desc(w, &f->u.member.tensor);
    break;
  case TSHARE_SET_META:
    ts_put_u32(w, f->u.meta.offset);
    ts_put_u16(w, f->u.meta.len);
    ts_put_bytes(w, f->u.meta.bytes, f->u.meta.len);
    break;
  }
  return TSHARE_OK;
}

static int encode_payload(const tshare_frame *f, ts_writer *w, char *err, size_t cap) {
  switch (f->type) {
  case TSHARE_FRAME_HELLO: {
    const tshare_hello *h = &f->u.hello;
    size_t name_len = strnlen(h->name, TSHARE_HELLO_NAME_MAX);
    if (h->device_count > TSHARE_HELLO_DEVICES_MAX)
      return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "hello: device_count %u over %d", h->device_count,
                     TSHARE_HELLO_DEVICES_MAX);
    ts_put_u32(w, h->pid);
    ts_put_u32(w, h->uid);
    ts_put_bytes(w, h->boot_id, 16);
    ts_put_u64(w, h->capabilities);
    ts_put_u8(w, (uint8_t)name_len);
    ts_put_bytes(w, h->name, name_len);
    ts_put_u8(w, (uint8_t)h->device_count);
    for (uint32_t i = 0; i < h->device_count; i++) ts_put_bytes(w, h->device_uuids[i], 16);
    return TSHARE_OK;
  }
  case TSHARE_FRAME_SHARE: {
    const tshare_share_frame *s = &f->u.share;
    int rc = ts_wire_check_share(s, NULL, err, cap);
    if (rc != TSHARE_OK) return rc;
    if (kind_takes_fd(s->mem_kind) != ((f->flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0))
      return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: mem_kind %u and the fd-attached flag disagree",
                     (unsigned)s->mem_kind);
    ts_put_u64(w, s->share_id);
    ts_put_u64(w, s->alloc_id);
    ts_put_u8(w, s->mem_kind);
    ts_put_u8(w, s->device_type);
    ts_put_u8(w, s->handle_len);
    ts_put_u8(w, (uint8_t)s->tensor.ndim);
    ts_put_u8(w, s->tensor.dtype.code);
    ts_put_u8(w, s->tensor.dtype.bits);
    ts_put_u16(w, s->tensor.dtype.lanes);
    ts_put_u8(w, s->tag_len);
    ts_put_u64(w, s->alloc_size);
    ts_put_u64(w, s->tensor.byte_offset);
    ts_put_u32(w, s->event_slot);
    ts_put_u32(w, s->event_generation);
    ts_put_bytes(w, s->device_uuid, 16);
    ts_put_bytes(w, s->handle, s->handle_len);
    for (int i = 0; i < s->tensor.ndim; i++) ts_put_u64(w, (uint64_t)s->tensor.shape[i]);
    for (int i = 0; i < s->tensor.ndim; i++) ts_put_u64(w, (uint64_t)s->tensor.strides[i]);
    ts_put_bytes(w, s->tag, s->tag_len);
    ts_put_u32(w, s->origin_pid);
    ts_put_u32(w, s->share_flags);
    return TSHARE_OK;
  }
  case TSHARE_FRAME_EVENT:
    if (f->u.event.slot >= TSHARE_EVENT_SLOTS_MAX)
      return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "event: slot %u over %d", f->u.event.slot, TSHARE_EVENT_SLOTS_MAX);
    ts_put_u32(w, f->u.event.slot);
    ts_put_bytes(w, f->u.event.handle, TSHARE_HANDLE_MAX);
    return TSHARE_OK;
  case TSHARE_FRAME_RETIRE: {
    const tshare_retire_frame *r = &f->u.retire;
    if (r->count == 0 || r->count > TSHARE_RELEASE_MAX)
      return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "retire: count %u outside 1..%d", r->count, TSHARE_RELEASE_MAX);
    if (r->closed > 2) return ts_errf(err, cap, TSHARE_E_MALFORMED, "retire: closed is %u", (unsigned)r->closed);
    ts_put_u8(w, r->closed);
    ts_put_u32(w, r->count);
    for (uint32_t i = 0; i < r->count; i++) ts_put_u64(w, r->alloc_ids[i]);
    return TSHARE_OK;
  }
  case TSHARE_FRAME_RING: {
    int rc = check_ring(&f->u.ring, f->flags, err, cap);
    if (rc != TSHARE_OK) return rc;
    ts_put_u8(w, f->u.ring.op);
    ts_put_u32(w, f->u.ring.capacity);
    return TSHARE_OK;
  }
  case TSHARE_FRAME_CHUNK: {
    const tshare_chunk_frame *k = &f->u.chunk;
    int rc = check_chunk(k, f->flags, UINT64_MAX, err, cap);
    if (rc != TSHARE_OK) return rc;
    ts_put_u64(w, k->alloc_id);
    ts_put_u32(w, k->index);
    ts_put_u32(w, k->count);
    ts_put_u64(w, k->size);
    return TSHARE_OK;
  }
  case TSHARE_FRAME_SET:
    return encode_set(&f->u.set, f->flags, w, err, cap);
  case TSHARE_FRAME_RELEASE: {
    const tshare_release_frame *r = &f->u.release;
    if (r->count == 0 || r->count > TSHARE_RELEASE_MAX)
      return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "release: count %u outside 1..%d", r->count, TSHARE_RELEASE_MAX);
    ts_put_u32(w, r->count);
    for (uint32_t i = 0; i < r->count; i++) ts_put_u64(w, r->share_ids[i]);
    return TSHARE_OK;
  }
  case TSHARE_FRAME_BYE:
    ts_put_u32(w, f->u.bye.reason);
    return TSHARE_OK;
  case TSHARE_FRAME_ERROR: {
    size_t n = strnlen(f->u.error.message, TSHARE_ERROR_TEXT_MAX);
    ts_put_u32(w, (uint32_t)f->u.error.code);
    ts_put_u16(w, (uint16_t)n);
    ts_put_bytes(w, f->u.error.message, n);
    return TSHARE_OK;
  }
  default:
    return ts_errf(err, cap, TSHARE_E_UNKNOWN_TYPE, "cannot encode frame type %u", (unsigned)f->type);
  }
}

int ts_wire_encode(const tshare_frame *f, uint8_t *buf, size_t cap, size_t *len, char *err, size_t err_cap) {
  if (!f || !buf || !len) return ts_errf(err, err_cap, TSHARE_E_INVALID_ARG, "encode: NULL argument");
  if (f->flags & ~TSHARE_FRAME_FLAGS_KNOWN)
    return ts_errf(err, err_cap, TSHARE_E_MALFORMED, "encode: unknown flags 0x%x", (unsigned)f->flags);
  if (cap < TSHARE_WIRE_HEADER_SIZE)
    return ts_errf(err, err_cap, TSHARE_E_TOO_LARGE, "encode: buffer of %zu bytes is too small", cap);
  ts_writer w = {buf + TSHARE_WIRE_HEADER_SIZE, cap - TSHARE_WIRE_HEADER_SIZE, false};
  int rc = encode_payload(f, &w, err, err_cap);
  if (rc != TSHARE_OK) return rc;
  if (w.overflow)
    return ts_errf(err, err_cap, TSHARE_E_TOO_LARGE, "encode: %s frame does not fit in %zu bytes",
                   tshare_frame_type_name(f->type), cap);
  size_t payload = (size_t)(w.p - (buf + TSHARE_WIRE_HEADER_SIZE));
  ts_writer h = {buf, TSHARE_WIRE_HEADER_SIZE, false};
  const uint8_t magic[4] = {TSHARE_WIRE_MAGIC_0, TSHARE_WIRE_MAGIC_1, TSHARE_WIRE_MAGIC_2, TSHARE_WIRE_MAGIC_3};
  ts_put_bytes(&h, magic, 4);
  ts_put_u8(&h, TSHARE_WIRE_MAJOR);
  ts_put_u8(&h, TSHARE_WIRE_MINOR);
  ts_put_u8(&h, f->type);
  ts_put_u8(&h, f->flags);
  ts_put_u32(&h, (uint32_t)payload);
  *len = TSHARE_WIRE_HEADER_SIZE + payload;
  return TSHARE_OK;
}

/* ---- decoding ---------------------------------------------------------- */

struct tshare_decoder {
  tshare_wire_limits limits;
  uint8_t *buf;
  size_t cap;   /* header + max_payload */
  size_t start; /* first unconsumed byte */
  size_t end;   /* one past the last buffered byte */
  int failed;   /* sticky status after an error */
  char err[TSHARE_ERROR_MSG_MAX];
};

tshare_decoder *tshare_decoder_create(const tshare_wire_limits *limits) {
  tshare_decoder *d = calloc(1, sizeof *d);
  if (!d) return NULL;
  d->limits = clamp_limits(limits);
  d->cap = TSHARE_WIRE_HEADER_SIZE + (size_t)d->limits.max_payload;
  d->buf = malloc(d->cap);
  if (!d->buf) {
    free(d);
    return NULL;
  }
  return d;
}

void tshare_decoder_destroy(tshare_decoder *d) {
  if (!d) return;
  free(d->buf);
  free(d);
}

const char *tshare_decoder_last_error(const tshare_decoder *d) {
  if (!d) return "decoder is NULL";
  return d->err[0] ? d->err : "no error";
}

size_t tshare_decoder_pending(const tshare_decoder *d) { return d ? d->end - d->start : 0; }

int tshare_decoder_space(tshare_decoder *d, uint8_t **ptr, size_t *avail) {
  if (d->failed) return d->failed;
  if (d->start > 0) { /* compact so a whole frame always fits from buf[0] */
    memmove(d->buf, d->buf + d->start, d->end - d->start);
    d->end -= d->start;
    d->start = 0;
  }
  if (d->end == d->cap)
    return d->failed = ts_errf(d->err, sizeof d->err, TSHARE_E_TOO_LARGE,
                               "decoder buffer full (%zu bytes) without a complete frame", d->cap);
  *ptr = d->buf + d->end;
  *avail = d->cap - d->end;
  return TSHARE_OK;
}

void tshare_decoder_commit(tshare_decoder *d, size_t n) {
  if (n > d->cap - d->end) n = d->cap - d->end;
  d->end += n;
}

int tshare_decoder_feed(tshare_decoder *d, const void *bytes, size_t n) {
  const uint8_t *src = bytes;
  while (n > 0) {
    uint8_t *dst;
    size_t avail;
    int rc = tshare_decoder_space(d, &dst, &avail);
    if (rc != TSHARE_OK) return rc;
    size_t take = n < avail ? n : avail;
    memcpy(dst, src, take);
    tshare_decoder_commit(d, take);
    src += take;
    n -= take;
    if (n > 0) /* more than one frame's worth: the caller must call next() between feeds */
      return d->failed =
                 ts_errf(d->err, sizeof d->err, TSHARE_E_TOO_LARGE,
                         "fed %zu bytes beyond the decoder's %zu-byte buffer; call next() between feeds", n, d->cap);
  }
  return TSHARE_OK;
}

TS_PRINTF(3, 4) static int fail(tshare_decoder *d, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(d->err, sizeof d->err, fmt, ap);
  va_end(ap);
  return d->failed = status;
}

static int decode_hello(tshare_decoder *d, ts_reader *r, tshare_hello *h) {
  memset(h, 0, sizeof *h);
  h->pid = ts_get_u32(r);
  h->uid = ts_get_u32(r);
  ts_get_bytes(r, h->boot_id, 16);
  h->capabilities = ts_get_u64(r);
  uint8_t name_len = ts_get_u8(r);
  if (name_len > TSHARE_HELLO_NAME_MAX)
    return fail(d, TSHARE_E_TOO_LARGE, "hello: name length %u over %d", name_len, TSHARE_HELLO_NAME_MAX);
  ts_get_bytes(r, h->name, name_len);
  if (memchr(h->name, '\0', name_len)) return fail(d, TSHARE_E_MALFORMED, "hello: name contains a NUL byte");
  uint8_t count = ts_get_u8(r);
  if (count > TSHARE_HELLO_DEVICES_MAX)
    return fail(d, TSHARE_E_TOO_LARGE, "hello: device_count %u over %d", count, TSHARE_HELLO_DEVICES_MAX);
  h->device_count = count;
  for (unsigned i = 0; i < count; i++) ts_get_bytes(r, h->device_uuids[i], 16);
  return TSHARE_OK;
}

static int decode_share(tshare_decoder *d, ts_reader *r, uint8_t flags, tshare_share_frame *s) {
  memset(s, 0, sizeof *s);
  s->share_id = ts_get_u64(r);
  s->alloc_id = ts_get_u64(r);
  s->mem_kind = ts_get_u8(r);
  s->device_type = ts_get_u8(r);
  s->handle_len = ts_get_u8(r);
  uint8_t ndim = ts_get_u8(r);
  s->tensor.dtype.code = ts_get_u8(r);
  s->tensor.dtype.bits = ts_get_u8(r);
  s->tensor.dtype.lanes = ts_get_u16(r);
  s->tag_len = ts_get_u8(r);
  s->alloc_size = ts_get_u64(r);
  s->tensor.byte_offset = ts_get_u64(r);
  s->event_slot = ts_get_u32(r);
  s->event_generation = ts_get_u32(r);
  ts_get_bytes(r, s->device_uuid, 16);
  /* Counts are checked against their limits before they size any read. */
  if (s->handle_len > TSHARE_HANDLE_MAX)
    return fail(d, TSHARE_E_TOO_LARGE, "share: handle_len %u over %d", s->handle_len, TSHARE_HANDLE_MAX);
  if (ndim > d->limits.max_ndim)
    return fail(d, TSHARE_E_TOO_LARGE, "share: ndim %u over max_ndim %u", ndim, d->limits.max_ndim);
  if (s->tag_len > d->limits.max_tag)
    return fail(d, TSHARE_E_TOO_LARGE, "share: tag_len %u over max_tag %u", s->tag_len, d->limits.max_tag);
  s->tensor.ndim = ndim;
  ts_get_bytes(r, s->handle, s->handle_len);
  for (int i = 0; i < ndim; i++) s->tensor.shape[i] = (int64_t)ts_get_u64(r);
  for (int i = 0; i < ndim; i++) s->tensor.strides[i] = (int64_t)ts_get_u64(r);
  ts_get_bytes(r, s->tag, s->tag_len);
  if (r->short_read) return TSHARE_OK; /* reported as truncation by the caller */
  if (r->left >= 8) { /* minor 1 fields; a minor-0 sender ends here */
    s->origin_pid = ts_get_u32(r);
    s->share_flags = ts_get_u32(r);
  }
  if (kind_takes_fd(s->mem_kind) != ((flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0))
    return fail(d, TSHARE_E_MALFORMED, "share: mem_kind %u and the fd-attached flag (%d) disagree", s->mem_kind,
                (flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0);
  int rc = ts_wire_check_share(s, &d->limits, d->err, sizeof d->err);
  if (rc != TSHARE_OK) return d->failed = rc;
  return TSHARE_OK;
}

/* Lengths are checked before they size a read; the rest by ts_wire_check_set. */
static int decode_set(tshare_decoder *d, ts_reader *r, uint8_t flags, tshare_set_frame *f) {
  f->op = ts_get_u8(r);
  f->set_id = ts_get_u64(r);
  switch (f->op) {
  case TSHARE_SET_BEGIN:
    f->u.begin.count = ts_get_u32(r);
    f->u.begin.mem_count = ts_get_u32(r);
    f->u.begin.names_bytes = ts_get_u32(r);
    f->u.begin.meta_bytes = ts_get_u32(r);
    break;
  case TSHARE_SET_MEM: {
    tshare_set_mem_frame *m = &f->u.mem;
    m->index = ts_get_u32(r);
    m->alloc_id = ts_get_u64(r);
    m->mem_kind = ts_get_u8(r);
    m->device_type = ts_get_u8(r);
    m->handle_len = ts_get_u8(r);
    m->alloc_size = ts_get_u64(r);
    ts_get_bytes(r, m->device_uuid, 16);
    if (m->handle_len > TSHARE_HANDLE_MAX)
      return fail(d, TSHARE_E_TOO_LARGE, "set: handle_len %u over %d", m->handle_len, TSHARE_HANDLE_MAX);
    ts_get_bytes(r, m->handle, m->handle_len);
    break;
  }
  case TSHARE_SET_MEMBER: {
    tshare_set_member_frame *m = &f->u.member;
    m->index = ts_get_u32(r);
    m->mem_index = ts_get_u32(r);
    m->name_len = ts_get_u16(r);
    if (m->name_len > TSHARE_SET_NAME_MAX)
      return fail(d, TSHARE_E_TOO_LARGE, "set: tensor %u: name of %u bytes over %u", m->index, m->name_len,
                  TSHARE_SET_NAME_MAX);
    ts_get_bytes(r, m->name, m->name_len);
    m->tensor.dtype.code = ts_get_u8(r);
    m->tensor.dtype.bits = ts_get_u8(r);
    m->tensor.dtype.lanes = ts_get_u16(r);
    uint8_t ndim = ts_get_u8(r);
    if (ndim > d->limits.max_ndim)
      return fail(d, TSHARE_E_TOO_LARGE, "set: tensor %u: ndim %u over max_ndim %u", m->index, ndim,
                  d->limits.max_ndim);
    m->tensor.ndim = ndim;
    m->tensor.byte_offset = ts_get_u64(r);
    for (int i = 0; i < ndim; i++) m->tensor.shape[i] = (int64_t)ts_get_u64(r);
    for (int i = 0; i < ndim; i++) m->tensor.strides[i] = (int64_t)ts_get_u64(r);
    break;
  }
  case TSHARE_SET_META:
    f->u.meta.offset = ts_get_u32(r);
    f->u.meta.len = ts_get_u16(r);
    if (f->u.meta.len > TSHARE_SET_META_CHUNK_MAX)
      return fail(d, TSHARE_E_TOO_LARGE, "set: metadata chunk of %u bytes over %u", f->u.meta.len,
                  TSHARE_SET_META_CHUNK_MAX);
    ts_get_bytes(r, f->u.meta.bytes, f->u.meta.len);
    break;
  }
  if (r->short_read) return TSHARE_OK; /* reported as truncation by the caller */
  int rc = ts_wire_check_set(f, flags, &d->limits, d->err, sizeof d->err);
  return rc == TSHARE_OK ? TSHARE_OK : (d->failed = rc);
}

int tshare_decoder_next(tshare_decoder *d, tshare_frame *out) {
  if (!d || !out) return TSHARE_E_INVALID_ARG;
  if (d->failed) return d->failed;
  size_t have = d->end - d->start;
  if (have < TSHARE_WIRE_HEADER_SIZE) {
    /* Reject a wrong magic as soon as its bytes are here, not after 12 bytes. */
    static const uint8_t magic[4] = {TSHARE_WIRE_MAGIC_0, TSHARE_WIRE_MAGIC_1, TSHARE_WIRE_MAGIC_2,
                                     TSHARE_WIRE_MAGIC_3};
    size_t n = have < 4 ? have : 4;
    if (memcmp(d->buf + d->start, magic, n) != 0)
      return fail(d, TSHARE_E_BAD_MAGIC, "header: bad magic in the first %zu bytes", n);
    return TSHARE_AGAIN;
  }
  ts_reader h = {d->buf + d->start, have, false};
  uint8_t magic[4];
  ts_get_bytes(&h, magic, 4);
  uint8_t major = ts_get_u8(&h), minor = ts_get_u8(&h), type = ts_get_u8(&h), flags = ts_get_u8(&h);
  uint32_t length = ts_get_u32(&h);
  if (magic[0] != TSHARE_WIRE_MAGIC_0 || magic[1] != TSHARE_WIRE_MAGIC_1 || magic[2] != TSHARE_WIRE_MAGIC_2 ||
      magic[3] != TSHARE_WIRE_MAGIC_3)
    return fail(d, TSHARE_E_BAD_MAGIC, "header: bad magic %02x %02x %02x %02x", magic[0], magic[1], magic[2], magic[3]);
  if (major != TSHARE_WIRE_MAJOR)
    return fail(d, TSHARE_E_VERSION, "header: peer speaks wire version %u.x, this side speaks %d.x", major,
                TSHARE_WIRE_MAJOR);
  if (!type_known(type))
    return fail(d, TSHARE_E_UNKNOWN_TYPE, "header: unknown frame type %u (wire %u.%u)", type, major, minor);
  if (flags & ~TSHARE_FRAME_FLAGS_KNOWN)
    return fail(d, TSHARE_E_MALFORMED, "header: unknown flags 0x%x in a %s frame", flags, tshare_frame_type_name(type));
  if (length > d->limits.max_payload)
    return fail(d, TSHARE_E_TOO_LARGE, "header: payload length %u over max_payload %u", length, d->limits.max_payload);
  if (have < TSHARE_WIRE_HEADER_SIZE + (size_t)length) return TSHARE_AGAIN;

  ts_reader r = {d->buf + d->start + TSHARE_WIRE_HEADER_SIZE, length, false};
  memset(out, 0, sizeof *out);
  out->type = type;
  out->flags = flags;
  out->major = major;
  out->minor = minor;
  int rc = TSHARE_OK;
  switch (type) {
  case TSHARE_FRAME_HELLO:
    rc = decode_hello(d, &r, &out->u.hello);
    out->u.hello.major = major;
    out->u.hello.minor = minor;
    break;
  case TSHARE_FRAME_SHARE:
    rc = decode_share(d, &r, flags, &out->u.share);
    break;
  case TSHARE_FRAME_RELEASE: {
    uint32_t count = ts_get_u32(&r);
    if (!r.short_read && (count == 0 || count > d->limits.max_release_ids))
      return fail(d, TSHARE_E_TOO_LARGE, "release: count %u outside 1..%u", count, d->limits.max_release_ids);
    out->u.release.count = count;
    for (uint32_t i = 0; i < count && !r.short_read; i++) out->u.release.share_ids[i] = ts_get_u64(&r);
    break;
  }
  case TSHARE_FRAME_BYE:
    out->u.bye.reason = ts_get_u32(&r);
    break;
  case TSHARE_FRAME_ERROR: {
    out->u.error.code = (int32_t)ts_get_u32(&r);
    uint16_t n = ts_get_u16(&r);
    if (!r.short_read && n > TSHARE_ERROR_TEXT_MAX)
      return fail(d, TSHARE_E_TOO_LARGE, "error: message length %u over %d", n, TSHARE_ERROR_TEXT_MAX);
    ts_get_bytes(&r, out->u.error.message, n);
    break;
  }
  case TSHARE_FRAME_EVENT:
    out->u.event.slot = ts_get_u32(&r);
    if (!r.short_read && out->u.event.slot >= TSHARE_EVENT_SLOTS_MAX)
      return fail(d, TSHARE_E_TOO_LARGE, "event: slot %u over %d", out->u.event.slot, TSHARE_EVENT_SLOTS_MAX);
    ts_get_bytes(&r, out->u.event.handle, TSHARE_HANDLE_MAX);
    break;
  case TSHARE_FRAME_RETIRE: {
    out->u.retire.closed = ts_get_u8(&r);
    uint32_t count = ts_get_u32(&r);
    if (!r.short_read && out->u.retire.closed > 2)
      return fail(d, TSHARE_E_MALFORMED, "retire: closed is %u", out->u.retire.closed);
    if (!r.short_read && (count == 0 || count > d->limits.max_release_ids))
      return fail(d, TSHARE_E_TOO_LARGE, "retire: count %u outside 1..%u", count, d->limits.max_release_ids);
    out->u.retire.count = count;
    for (uint32_t i = 0; i < count && !r.short_read; i++) out->u.retire.alloc_ids[i] = ts_get_u64(&r);
    break;
  }
  case TSHARE_FRAME_CHUNK: {
    tshare_chunk_frame *k = &out->u.chunk;
    k->alloc_id = ts_get_u64(&r);
    k->index = ts_get_u32(&r);
    k->count = ts_get_u32(&r);
    k->size = ts_get_u64(&r);
    char why[TSHARE_ERROR_MSG_MAX];
    if (!r.short_read && (rc = check_chunk(k, flags, d->limits.max_alloc_size, why, sizeof why)) != TSHARE_OK)
      return fail(d, rc, "%s", why);
    break;
  }
  case TSHARE_FRAME_SET:
    rc = decode_set(d, &r, flags, &out->u.set);
    break;
  case TSHARE_FRAME_RING: {
    out->u.ring.op = ts_get_u8(&r);
    out->u.ring.capacity = ts_get_u32(&r);
    char why[TSHARE_ERROR_MSG_MAX];
    if (!r.short_read && (rc = check_ring(&out->u.ring, flags, why, sizeof why)) != TSHARE_OK)
      return fail(d, rc, "%s", why);
    break;
  }
  }
  if (rc != TSHARE_OK) return rc;
  if (r.short_read)
    return fail(d, TSHARE_E_TRUNCATED, "%s: payload of %u bytes ends before its fields do",
                tshare_frame_type_name(type), length);
  /* Trailing bytes are fields of a newer minor version: ignored by rule. */
  d->start += TSHARE_WIRE_HEADER_SIZE + (size_t)length;
  if (d->start == d->end) d->start = d->end = 0;
  return TSHARE_OK;
}

int tshare_wire_check_share(const tshare_share_frame *share, const tshare_wire_limits *limits, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX] = "";
  int rc = ts_wire_check_share(share, limits, msg, sizeof msg);
  ts_error_fill(err, rc, msg);
  return rc;
}

int tshare_wire_check_set(const tshare_set_frame *set, uint8_t flags, const tshare_wire_limits *limits,
                          tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX] = "";
  int rc = set ? ts_wire_check_set(set, flags, limits, msg, sizeof msg)
               : ts_errf(msg, sizeof msg, TSHARE_E_INVALID_ARG, "set: NULL frame");
  ts_error_fill(err, rc, msg);
  return rc;
}

int tshare_wire_encode(const tshare_frame *frame, uint8_t *buf, size_t cap, size_t *len, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX] = "";
  int rc = ts_wire_encode(frame, buf, cap, len, msg, sizeof msg);
  ts_error_fill(err, rc, msg);
  return rc;
}
