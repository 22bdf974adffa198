/* The wire's decoder, sans-IO: bytes fed in, whole frames taken out. The
 * header is read and checked first (magic, major, type, flags, length), then
 * the payload by one reader per frame type, picked by one dispatch on the
 * type. Every length and count is checked against its limit before it sizes
 * a read, and each frame against the rules the encoder applies too
 * (wire_check.c). The first error sticks: framing is lost after it. */
#include "tshare/wire.h"

#include "bytes.h"
#include "error_detail.h"
#include "wire_checks.h"
#include "wire_rules.h"
#include "tshare/errors.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>

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
  d->limits = ts_wire_limits_clamp(limits);
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

/* The decoders below fill a member ts_frame_clear() zeroed. */
static int decode_hello(tshare_decoder *d, ts_reader *r, tshare_hello *h) {
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
  if (r->left >= 8) {                  /* minor 1 fields; a minor-0 sender ends here */
    s->origin_pid = ts_get_u32(r);
    s->share_flags = ts_get_u32(r);
  }
  if (ts_wire_kind_takes_fd(s->mem_kind) != ((flags & TSHARE_FRAME_FLAG_FD_ATTACHED) != 0))
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
    if (r->left >= 1) f->u.begin.layout_slot = ts_get_u8(r); /* minor 6, when not 0 */
    break;
  case TSHARE_SET_AGAIN:
    f->u.again.layout_slot = ts_get_u8(r);
    f->u.again.layout_id = ts_get_u64(r);
    f->u.again.meta_bytes = ts_get_u32(r);
    break;
  case TSHARE_SET_DROPPED:
    f->u.dropped.layout_slot = ts_get_u8(r);
    f->u.dropped.layout_id = ts_get_u64(r);
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
    if (ts_wire_set_mem_has_flags(m->mem_kind) || (ts_wire_kind_is_host(m->mem_kind) && r->left >= 4))
      m->share_flags = ts_get_u32(r); /* a host memory's: minor 5, when not 0 */
    break;
  }
  case TSHARE_SET_END:
    if (flags & TSHARE_FRAME_FLAG_HAS_EVENT) {
      f->u.end.event_slot = ts_get_u32(r);
      f->u.end.event_generation = ts_get_u32(r);
    }
    break;
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

/* Counts are checked only when their bytes were there: a short payload is
 * reported as truncation, after the dispatch. */
static int decode_release(tshare_decoder *d, ts_reader *r, tshare_release_frame *out) {
  uint32_t count = ts_get_u32(r);
  if (!r->short_read && (count == 0 || count > d->limits.max_release_ids))
    return fail(d, TSHARE_E_TOO_LARGE, "release: count %u outside 1..%u", count, d->limits.max_release_ids);
  out->count = count;
  for (uint32_t i = 0; i < count && !r->short_read; i++) out->share_ids[i] = ts_get_u64(r);
  return TSHARE_OK;
}

static int decode_error(tshare_decoder *d, ts_reader *r, tshare_error_frame *out) {
  out->code = (int32_t)ts_get_u32(r);
  uint16_t n = ts_get_u16(r);
  if (!r->short_read && n > TSHARE_ERROR_TEXT_MAX)
    return fail(d, TSHARE_E_TOO_LARGE, "error: message length %u over %d", n, TSHARE_ERROR_TEXT_MAX);
  ts_get_bytes(r, out->message, n);
  return TSHARE_OK;
}

static int decode_event(tshare_decoder *d, ts_reader *r, tshare_event_frame *out) {
  out->slot = ts_get_u32(r);
  if (!r->short_read && out->slot >= TSHARE_EVENT_SLOTS_MAX)
    return fail(d, TSHARE_E_TOO_LARGE, "event: slot %u over %d", out->slot, TSHARE_EVENT_SLOTS_MAX);
  ts_get_bytes(r, out->handle, TSHARE_HANDLE_MAX);
  return TSHARE_OK;
}

static int decode_retire(tshare_decoder *d, ts_reader *r, tshare_retire_frame *out) {
  out->closed = ts_get_u8(r);
  uint32_t count = ts_get_u32(r);
  if (!r->short_read && out->closed > TSHARE_RETIRE_KEPT) return fail(d, TSHARE_E_MALFORMED, "retire: closed is %u", out->closed);
  if (!r->short_read && (count == 0 || count > d->limits.max_release_ids))
    return fail(d, TSHARE_E_TOO_LARGE, "retire: count %u outside 1..%u", count, d->limits.max_release_ids);
  out->count = count;
  for (uint32_t i = 0; i < count && !r->short_read; i++) out->alloc_ids[i] = ts_get_u64(r);
  out->mem_kind = r->left ? ts_get_u8(r) : 0; /* minor 4; absent from older peers: CUDA memory */
  if (out->mem_kind > TSHARE_MEM_KIND_LAST) return fail(d, TSHARE_E_MALFORMED, "retire: unknown mem_kind %u", out->mem_kind);
  return TSHARE_OK;
}

static int decode_chunk(tshare_decoder *d, ts_reader *r, uint8_t flags, tshare_chunk_frame *k) {
  k->alloc_id = ts_get_u64(r);
  k->index = ts_get_u32(r);
  k->count = ts_get_u32(r);
  k->size = ts_get_u64(r);
  char why[TSHARE_ERROR_MSG_MAX];
  int rc = r->short_read ? TSHARE_OK : ts_wire_check_chunk(k, flags, d->limits.max_alloc_size, why, sizeof why);
  return rc == TSHARE_OK ? TSHARE_OK : fail(d, rc, "%s", why);
}

static int decode_rkey(tshare_decoder *d, ts_reader *r, uint8_t flags, tshare_rkey_frame *k) {
  k->alloc_id = ts_get_u64(r);
  k->address = ts_get_u64(r);
  k->length = ts_get_u64(r);
  k->key_len = ts_get_u16(r);
  if (r->short_read) return TSHARE_OK;
  char why[TSHARE_ERROR_MSG_MAX];
  int rc = ts_wire_check_rkey(k, flags, d->limits.max_alloc_size, why, sizeof why);
  if (rc != TSHARE_OK) return fail(d, rc, "%s", why); /* before the key's bytes: key_len is bounded first */
  ts_get_bytes(r, k->key, k->key_len);
  return TSHARE_OK;
}

static int decode_ring(tshare_decoder *d, ts_reader *r, uint8_t flags, tshare_ring_frame *g) {
  g->op = ts_get_u8(r);
  g->capacity = ts_get_u32(r);
  char why[TSHARE_ERROR_MSG_MAX];
  int rc = r->short_read ? TSHARE_OK : ts_wire_check_ring(g, flags, why, sizeof why);
  return rc == TSHARE_OK ? TSHARE_OK : fail(d, rc, "%s", why);
}

/* A frame's header, read and checked before any of its payload. */
typedef struct frame_header {
  uint8_t major, minor, type, flags;
  uint32_t length;
} frame_header;

static bool type_known(int type) { return type >= TSHARE_FRAME_HELLO && type <= TSHARE_FRAME_RKEY; }

/* TSHARE_OK once the header and its whole payload are buffered, TSHARE_AGAIN
 * while bytes are missing, or the header's fault (the decoder failed). */
static int read_header(tshare_decoder *d, frame_header *fh) {
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
  *fh = (frame_header){major, minor, type, flags, length};
  return TSHARE_OK;
}

/* The payload into out by the header's type (a known one: read_header saw to
 * that). A payload cut short is left to the caller, which reports it. */
static int decode_payload(tshare_decoder *d, ts_reader *r, const frame_header *fh, tshare_frame *out) {
  switch (fh->type) {
  case TSHARE_FRAME_HELLO: {
    int rc = decode_hello(d, r, &out->u.hello);
    out->u.hello.major = fh->major;
    out->u.hello.minor = fh->minor;
    return rc;
  }
  case TSHARE_FRAME_SHARE:
    return decode_share(d, r, fh->flags, &out->u.share);
  case TSHARE_FRAME_RELEASE:
    return decode_release(d, r, &out->u.release);
  case TSHARE_FRAME_BYE:
    out->u.bye.reason = ts_get_u32(r);
    return TSHARE_OK;
  case TSHARE_FRAME_ERROR:
    return decode_error(d, r, &out->u.error);
  case TSHARE_FRAME_EVENT:
    return decode_event(d, r, &out->u.event);
  case TSHARE_FRAME_RETIRE:
    return decode_retire(d, r, &out->u.retire);
  case TSHARE_FRAME_CHUNK:
    return decode_chunk(d, r, fh->flags, &out->u.chunk);
  case TSHARE_FRAME_SET:
    return decode_set(d, r, fh->flags, &out->u.set);
  case TSHARE_FRAME_RING:
    return decode_ring(d, r, fh->flags, &out->u.ring);
  case TSHARE_FRAME_RKEY:
    return decode_rkey(d, r, fh->flags, &out->u.rkey);
  }
  return TSHARE_OK;
}

/* A set frame whose payload broke a rule, though its header was sound and
 * its whole payload is here: the frame is known to end where its length
 * says, and the set it belongs to is named (op and a set_id read, not 0).
 * Its fields are forgotten but for the set_id. */
static bool refusable_alone(const frame_header *fh, tshare_frame *out) {
  if (fh->type != TSHARE_FRAME_SET || fh->length < 1 + 8 || out->u.set.set_id == 0) return false;
  uint64_t set_id = out->u.set.set_id;
  memset(&out->u.set, 0, sizeof out->u.set);
  out->u.set.op = TS_SET_OP_REFUSED;
  out->u.set.set_id = set_id;
  return true;
}

int ts_decoder_next(tshare_decoder *d, tshare_frame *out, int *refused) {
  if (!d || !out) return TSHARE_E_INVALID_ARG;
  if (refused) *refused = TSHARE_OK;
  if (d->failed) return d->failed;
  frame_header fh = {0};
  int rc = read_header(d, &fh);
  if (rc != TSHARE_OK) return rc;

  ts_reader r = {d->buf + d->start + TSHARE_WIRE_HEADER_SIZE, fh.length, false};
  ts_frame_clear(out, fh.type);
  out->flags = fh.flags;
  out->major = fh.major;
  out->minor = fh.minor;
  rc = decode_payload(d, &r, &fh, out);
  if (rc == TSHARE_OK && r.short_read)
    rc = fail(d, TSHARE_E_TRUNCATED, "%s: payload of %u bytes ends before its fields do",
              tshare_frame_type_name(fh.type), fh.length);
  if (rc != TSHARE_OK) {
    if (!refused || !refusable_alone(&fh, out)) return rc;
    *refused = rc; /* framing is intact: the decoder goes on after this frame */
    d->failed = TSHARE_OK;
  }
  /* Trailing bytes are fields of a newer minor version: ignored by rule. */
  d->start += TSHARE_WIRE_HEADER_SIZE + (size_t)fh.length;
  if (d->start == d->end) d->start = d->end = 0;
  return TSHARE_OK;
}

int tshare_decoder_next(tshare_decoder *d, tshare_frame *out) { return ts_decoder_next(d, out, NULL); }
