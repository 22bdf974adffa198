/* The wire's encoder: a frame struct into its bytes, header and payload, in
 * the layout wire.h tables. Each frame type has its own writer below, picked
 * by one dispatch on the type; every frame is checked by the same rules the
 * decoder applies (wire_check.c) before a byte of it is written, so this side
 * never sends what the other side must refuse. */
#include "bytes.h"
#include "error_detail.h"
#include "wire_checks.h"
#include "wire_rules.h"
#include "tshare/errors.h"

#include <string.h>

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
    if (f->u.begin.layout_slot) ts_put_u8(w, f->u.begin.layout_slot); /* minor 6, only when asked for */
    break;
  case TSHARE_SET_AGAIN:
    ts_put_u8(w, f->u.again.layout_slot);
    ts_put_u64(w, f->u.again.layout_id);
    ts_put_u32(w, f->u.again.meta_bytes);
    break;
  case TSHARE_SET_DROPPED:
    ts_put_u8(w, f->u.dropped.layout_slot);
    ts_put_u64(w, f->u.dropped.layout_id);
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
    if (ts_wire_set_mem_has_flags(m->mem_kind) || ts_wire_set_mem_appends_flags(m->mem_kind, m->share_flags))
      ts_put_u32(w, m->share_flags);
    break;
  }
  case TSHARE_SET_END:
    if (flags & TSHARE_FRAME_FLAG_HAS_EVENT) {
      ts_put_u32(w, f->u.end.event_slot);
      ts_put_u32(w, f->u.end.event_generation);
    }
    break;
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

static int encode_hello(const tshare_hello *h, ts_writer *w, char *err, size_t cap) {
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

static int encode_share(const tshare_share_frame *s, uint8_t flags, ts_writer *w, char *err, size_t cap) {
  int rc = ts_wire_check_share(s, NULL, err, cap);
  if (rc != TSHARE_OK) return rc;
  if (ts_wire_kind_takes_fd(s->mem_kind) != ((flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0))
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

static int encode_event(const tshare_event_frame *e, ts_writer *w, char *err, size_t cap) {
  if (e->slot >= TSHARE_EVENT_SLOTS_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "event: slot %u over %d", e->slot, TSHARE_EVENT_SLOTS_MAX);
  ts_put_u32(w, e->slot);
  ts_put_bytes(w, e->handle, TSHARE_HANDLE_MAX);
  return TSHARE_OK;
}

static int encode_retire(const tshare_retire_frame *r, ts_writer *w, char *err, size_t cap) {
  if (r->count == 0 || r->count > TSHARE_RELEASE_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "retire: count %u outside 1..%d", r->count, TSHARE_RELEASE_MAX);
  if (r->closed > TSHARE_RETIRE_KEPT) return ts_errf(err, cap, TSHARE_E_MALFORMED, "retire: closed is %u", (unsigned)r->closed);
  if (r->mem_kind > TSHARE_MEM_KIND_LAST)
    return ts_errf(err, cap, TSHARE_E_MALFORMED, "retire: unknown mem_kind %u", (unsigned)r->mem_kind);
  ts_put_u8(w, r->closed);
  ts_put_u32(w, r->count);
  for (uint32_t i = 0; i < r->count; i++) ts_put_u64(w, r->alloc_ids[i]);
  if (r->mem_kind) ts_put_u8(w, r->mem_kind); /* absent: CUDA memory, as every peer of minor 1-3 means */
  return TSHARE_OK;
}

static int encode_ring(const tshare_ring_frame *g, uint8_t flags, ts_writer *w, char *err, size_t cap) {
  int rc = ts_wire_check_ring(g, flags, err, cap);
  if (rc != TSHARE_OK) return rc;
  ts_put_u8(w, g->op);
  ts_put_u32(w, g->capacity);
  return TSHARE_OK;
}

static int encode_chunk(const tshare_chunk_frame *k, uint8_t flags, ts_writer *w, char *err, size_t cap) {
  int rc = ts_wire_check_chunk(k, flags, UINT64_MAX, err, cap);
  if (rc != TSHARE_OK) return rc;
  ts_put_u64(w, k->alloc_id);
  ts_put_u32(w, k->index);
  ts_put_u32(w, k->count);
  ts_put_u64(w, k->size);
  return TSHARE_OK;
}

static int encode_rkey(const tshare_rkey_frame *k, uint8_t flags, ts_writer *w, char *err, size_t cap) {
  int rc = ts_wire_check_rkey(k, flags, UINT64_MAX, err, cap);
  if (rc != TSHARE_OK) return rc;
  ts_put_u64(w, k->alloc_id);
  ts_put_u64(w, k->address);
  ts_put_u64(w, k->length);
  ts_put_u16(w, k->key_len);
  ts_put_bytes(w, k->key, k->key_len);
  return TSHARE_OK;
}

static int encode_release(const tshare_release_frame *r, ts_writer *w, char *err, size_t cap) {
  if (r->count == 0 || r->count > TSHARE_RELEASE_MAX)
    return ts_errf(err, cap, TSHARE_E_TOO_LARGE, "release: count %u outside 1..%d", r->count, TSHARE_RELEASE_MAX);
  ts_put_u32(w, r->count);
  for (uint32_t i = 0; i < r->count; i++) ts_put_u64(w, r->share_ids[i]);
  return TSHARE_OK;
}

static void encode_error(const tshare_error_frame *e, ts_writer *w) {
  size_t n = strnlen(e->message, TSHARE_ERROR_TEXT_MAX);
  ts_put_u32(w, (uint32_t)e->code);
  ts_put_u16(w, (uint16_t)n);
  ts_put_bytes(w, e->message, n);
}

/* The payload of f by its type: TSHARE_OK, or the rule it breaks in err. */
static int encode_payload(const tshare_frame *f, ts_writer *w, char *err, size_t cap) {
  switch (f->type) {
  case TSHARE_FRAME_HELLO:
    return encode_hello(&f->u.hello, w, err, cap);
  case TSHARE_FRAME_SHARE:
    return encode_share(&f->u.share, f->flags, w, err, cap);
  case TSHARE_FRAME_EVENT:
    return encode_event(&f->u.event, w, err, cap);
  case TSHARE_FRAME_RETIRE:
    return encode_retire(&f->u.retire, w, err, cap);
  case TSHARE_FRAME_RING:
    return encode_ring(&f->u.ring, f->flags, w, err, cap);
  case TSHARE_FRAME_CHUNK:
    return encode_chunk(&f->u.chunk, f->flags, w, err, cap);
  case TSHARE_FRAME_SET:
    return encode_set(&f->u.set, f->flags, w, err, cap);
  case TSHARE_FRAME_RKEY:
    return encode_rkey(&f->u.rkey, f->flags, w, err, cap);
  case TSHARE_FRAME_RELEASE:
    return encode_release(&f->u.release, w, err, cap);
  case TSHARE_FRAME_BYE:
    ts_put_u32(w, f->u.bye.reason);
    return TSHARE_OK;
  case TSHARE_FRAME_ERROR:
    encode_error(&f->u.error, w);
    return TSHARE_OK;
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

int tshare_wire_encode(const tshare_frame *frame, uint8_t *buf, size_t cap, size_t *len, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX] = "";
  int rc = ts_wire_encode(frame, buf, cap, len, msg, sizeof msg);
  ts_error_fill(err, rc, msg);
  return rc;
}
