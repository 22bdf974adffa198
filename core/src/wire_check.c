/* The wire's frame checks: what a share, a set step, a ring frame and a chunk
 * frame must be, whoever holds one. The encoder refuses to send a frame that
 * breaks them and the decoder refuses to hand one out; the session checks
 * the frames it builds with the same functions, so a rule lives once. */
#include "error_detail.h"
#include "wire_checks.h"
#include "wire_rules.h"
#include "tshare/errors.h"

#include <string.h>

/* The ring and chunk frames' rules, the same for the encoder and the decoder. */
int ts_wire_check_ring(const tshare_ring_frame *g, uint8_t flags, char *err, size_t cap) {
  if (g->op < TSHARE_RING_SETUP || g->op > TSHARE_RING_NUDGE)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "ring: unknown op %u", (unsigned)g->op);
  if ((g->op == TSHARE_RING_SETUP) != ((flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "ring: only a setup frame carries an fd");
  return TSHARE_OK;
}

int ts_wire_check_chunk(const tshare_chunk_frame *k, uint8_t flags, uint64_t max_alloc_size, char *err, size_t cap) {
  if (k->count < 2 || k->count > TSHARE_CHUNKS_MAX || k->index == 0 || k->index >= k->count || k->size == 0 ||
      k->size > max_alloc_size)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "chunk: index %u of %u, %llu bytes", k->index, k->count,
                   (unsigned long long)k->size);
  if (!(flags & TSHARE_FRAME_FLAG_FD_ATTACHED))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "chunk: a chunk frame carries its fd");
  return TSHARE_OK;
}

int ts_wire_check_rkey(const tshare_rkey_frame *k, uint8_t flags, uint64_t max_alloc_size, char *err, size_t cap) {
  if (k->key_len == 0 || k->key_len > TSHARE_RKEY_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "rkey: a key of %u bytes (1..%d)", (unsigned)k->key_len,
                   TSHARE_RKEY_MAX);
  if (k->length == 0 || k->length > max_alloc_size || k->address + k->length < k->address)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "rkey: a region of %llu bytes at %#llx (1..%llu, not wrapping)",
                   (unsigned long long)k->length, (unsigned long long)k->address, (unsigned long long)max_alloc_size);
  if (flags & TSHARE_FRAME_FLAG_FD_ATTACHED) return ts_errf(err, cap, TSHARE_E_MALFORMED, "rkey: an rkey frame carries no fd");
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
  if (b->layout_slot > TSHARE_SET_LAYOUT_SLOTS)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: layout slot %u outside 0..%u", (unsigned)b->layout_slot,
                   TSHARE_SET_LAYOUT_SLOTS);
  return TSHARE_OK;
}

static int check_set_again(const tshare_set_again_frame *a, char *err, size_t cap) {
  if (a->layout_slot == 0 || a->layout_slot > TSHARE_SET_LAYOUT_SLOTS)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: sent again from layout slot %u, outside 1..%u",
                   (unsigned)a->layout_slot, TSHARE_SET_LAYOUT_SLOTS);
  if (a->layout_id == 0) return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: sent again from layout id 0");
  if (a->meta_bytes > TSHARE_SET_META_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: sent again with %u bytes of metadata, over %u", a->meta_bytes,
                   TSHARE_SET_META_MAX);
  return TSHARE_OK;
}

/* A layout the receiver of sets lost: named as an AGAIN names it, and by
 * the frame's set_id too. */
static int check_set_dropped(uint64_t set_id, const tshare_set_dropped_frame *d, char *err, size_t cap) {
  if (d->layout_slot == 0 || d->layout_slot > TSHARE_SET_LAYOUT_SLOTS)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: layout dropped from slot %u, outside 1..%u",
                   (unsigned)d->layout_slot, TSHARE_SET_LAYOUT_SLOTS);
  if (d->layout_id != set_id)
    return ts_errf(err, cap, TSHARE_E_MALFORMED,
                   "set: layout %llu dropped in a frame of set %llu (the same id, never 0)",
                   (unsigned long long)d->layout_id, (unsigned long long)set_id);
  return TSHARE_OK;
}

/* What a CUDA memory of a set adds: a handle exactly where legacy IPC needs
 * one, and only the share flags a set memory can carry. */
static int check_set_mem_cuda(const tshare_set_mem_frame *m, char *err, size_t cap) {
  const uint32_t known = TSHARE_SHARE_FLAG_RETIRE_NOTICE | TSHARE_SHARE_FLAG_CHUNKS | TSHARE_SHARE_FLAG_HOLD_OFFER;
  if (!ts_wire_set_mem_has_flags(m->mem_kind)) { /* host memory: only a memfd may be offered to keep */
    if (m->share_flags && (m->mem_kind != TSHARE_MEM_HOST_MEMFD || m->share_flags != TSHARE_SHARE_FLAG_RETIRE_NOTICE))
      return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: memory %u: host memory of mem_kind %u with share flags %#x "
                     "(a host memfd knows %#x)", m->index, (unsigned)m->mem_kind, m->share_flags,
                     TSHARE_SHARE_FLAG_RETIRE_NOTICE);
    return TSHARE_OK;
  }
  if ((m->mem_kind == TSHARE_MEM_CUDA_IPC) != (m->handle_len == TSHARE_HANDLE_MAX))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: memory %u: mem_kind %u with %u handle bytes", m->index,
                   (unsigned)m->mem_kind, (unsigned)m->handle_len);
  if (m->share_flags & ~known)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: memory %u: share flags %#x (a set memory knows %#x)",
                   m->index, m->share_flags, known);
  if ((m->share_flags & TSHARE_SHARE_FLAG_CHUNKS) && m->mem_kind != TSHARE_MEM_CUDA_FD)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: memory %u: chunks of mem_kind %u (only VMM fds come in chunks)",
                   m->index, (unsigned)m->mem_kind);
  if ((m->share_flags & TSHARE_SHARE_FLAG_HOLD_OFFER) && m->mem_kind != TSHARE_MEM_CUDA_FD)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: memory %u: a hold offered for mem_kind %u (only VMM fds are "
                   "offered to keep)", m->index, (unsigned)m->mem_kind);
  return TSHARE_OK;
}

static int check_set_mem(const tshare_set_mem_frame *m, uint8_t flags, const tshare_wire_limits *limits, char *err,
                         size_t cap) {
  if (m->index >= TSHARE_SET_MEMBERS_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: memory index %u over %u", m->index, TSHARE_SET_MEMBERS_MAX);
  if (m->mem_kind < TSHARE_MEM_HOST_MEMFD || m->mem_kind > TSHARE_MEM_KIND_LAST)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: memory %u of unknown mem_kind %u", m->index,
                   (unsigned)m->mem_kind);
  if (m->handle_len > TSHARE_HANDLE_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: memory %u: handle_len %u over %d", m->index,
                   (unsigned)m->handle_len, TSHARE_HANDLE_MAX);
  bool host = ts_wire_kind_is_host(m->mem_kind) || m->mem_kind == TSHARE_MEM_UCX_REMOTE; /* CPU memory, no handle */
  /* Remote memory may hold GPU bytes staged in host memory (TSHARE_CAP_UCX_STAGED). */
  bool staged = m->mem_kind == TSHARE_MEM_UCX_REMOTE && m->device_type == TSHARE_DEVICE_CUDA;
  if ((host != (m->device_type == TSHARE_DEVICE_CPU) && !staged) || (host && m->handle_len != 0))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: memory %u: mem_kind %u with device_type %u and %u handle bytes",
                   m->index, (unsigned)m->mem_kind, (unsigned)m->device_type, (unsigned)m->handle_len);
  if (ts_wire_kind_takes_fd(m->mem_kind) != ((flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: memory %u: mem_kind %u and the fd-attached flag disagree",
                   m->index, (unsigned)m->mem_kind);
  if (m->alloc_size > limits->max_alloc_size)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: memory %u: alloc_size %llu over max_alloc_size %llu", m->index,
                   (unsigned long long)m->alloc_size, (unsigned long long)limits->max_alloc_size);
  return check_set_mem_cuda(m, err, cap);
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
  tshare_wire_limits limits = ts_wire_limits_clamp(limits_in);
  if (f->set_id == 0) return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: set_id is 0");
  if (f->op != TSHARE_SET_MEM && (flags & TSHARE_FRAME_FLAG_FD_ATTACHED))
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: only a memory frame carries an fd");
  if ((flags & TSHARE_FRAME_FLAG_HAS_EVENT) && f->op != TSHARE_SET_END)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: only the end frame carries an event");
  switch (f->op) {
  case TSHARE_SET_BEGIN:
    return check_set_begin(&f->u.begin, err, cap);
  case TSHARE_SET_MEM:
    return check_set_mem(&f->u.mem, flags, &limits, err, cap);
  case TSHARE_SET_AGAIN:
    return check_set_again(&f->u.again, err, cap);
  case TSHARE_SET_DROPPED:
    return check_set_dropped(f->set_id, &f->u.dropped, err, cap);
  case TSHARE_SET_MEMBER:
    return check_set_member(&f->u.member, &limits, err, cap);
  case TSHARE_SET_META:
    if (f->u.meta.len == 0 || f->u.meta.len > TSHARE_SET_META_CHUNK_MAX ||
        (uint64_t)f->u.meta.offset + f->u.meta.len > TSHARE_SET_META_MAX)
      return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "set: metadata chunk of %u bytes at %u (chunks 1..%u, total %u)",
                     (unsigned)f->u.meta.len, f->u.meta.offset, TSHARE_SET_META_CHUNK_MAX, TSHARE_SET_META_MAX);
    return TSHARE_OK;
  case TSHARE_SET_END:
    if ((flags & TSHARE_FRAME_FLAG_HAS_EVENT) && f->u.end.event_slot >= TSHARE_EVENT_SLOTS_MAX)
      return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: end frame's event slot %u over %d", f->u.end.event_slot,
                     TSHARE_EVENT_SLOTS_MAX - 1);
    return TSHARE_OK;
  default:
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "set: unknown op %u", (unsigned)f->op);
  }
}

int ts_wire_check_share(const tshare_share_frame *s, const tshare_wire_limits *limits_in, char *err, size_t cap) {
  tshare_wire_limits limits = ts_wire_limits_clamp(limits_in);
  if (s->share_id == 0) return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: share_id is 0");
  switch (s->mem_kind) {
  case TSHARE_MEM_HOST_MEMFD:
  case TSHARE_MEM_HOST_KEPT:
  case TSHARE_MEM_HOST_FD:
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
  case TSHARE_MEM_UCX_REMOTE: /* host memory, or GPU bytes staged there (TSHARE_CAP_UCX_STAGED) */
    if (s->device_type != TSHARE_DEVICE_CPU && s->device_type != TSHARE_DEVICE_CUDA)
      return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: remote host memory with device_type %u",
                     (unsigned)s->device_type);
    if (s->handle_len != 0)
      return ts_errf(err, cap, TSHARE_E_MALFORMED, "share: remote host memory carries %u handle bytes",
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
