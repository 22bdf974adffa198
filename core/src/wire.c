/* The wire format's shared vocabulary: the default limits and how a caller's
 * limits are clamped to the hard maxima, a frame zeroed for its type, and
 * the frame types' names used in error details. The checks are in
 * wire_check.c, the encoder in wire_encode.c, the decoder in wire_decode.c. */
#include "tshare/wire.h"

#include "wire_checks.h"
#include "wire_rules.h"

#include <stddef.h>
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

tshare_wire_limits ts_wire_limits_clamp(const tshare_wire_limits *in) {
  tshare_wire_limits d = tshare_wire_limits_default();
  if (!in) return d;
  tshare_wire_limits l = *in;
  if (l.max_payload > d.max_payload) l.max_payload = d.max_payload;
  if (l.max_ndim > d.max_ndim) l.max_ndim = d.max_ndim;
  if (l.max_tag > d.max_tag) l.max_tag = d.max_tag;
  if (l.max_release_ids > d.max_release_ids) l.max_release_ids = d.max_release_ids;
  return l;
}

/* The bytes of each type's member that ts_frame_clear zeroes. */
static const size_t cleared_member[] = {
    [TSHARE_FRAME_HELLO] = sizeof(tshare_hello),
    [TSHARE_FRAME_SHARE] = sizeof(tshare_share_frame),
    [TSHARE_FRAME_RELEASE] = offsetof(tshare_release_frame, share_ids),
    [TSHARE_FRAME_BYE] = sizeof(tshare_bye_frame),
    [TSHARE_FRAME_ERROR] = sizeof(tshare_error_frame),
    [TSHARE_FRAME_EVENT] = sizeof(tshare_event_frame),
    [TSHARE_FRAME_RETIRE] = offsetof(tshare_retire_frame, alloc_ids),
    [TSHARE_FRAME_RING] = sizeof(tshare_ring_frame),
    [TSHARE_FRAME_CHUNK] = sizeof(tshare_chunk_frame),
    [TSHARE_FRAME_SET] = sizeof(tshare_set_frame),
    [TSHARE_FRAME_RKEY] = sizeof(tshare_rkey_frame),
};

tshare_frame *ts_frame_clear(tshare_frame *f, uint8_t type) {
  size_t member = type < sizeof cleared_member / sizeof *cleared_member && cleared_member[type]
                      ? cleared_member[type]
                      : sizeof f->u; /* no such type: all of it */
  memset(f, 0, offsetof(tshare_frame, u) + member);
  if (type == TSHARE_FRAME_RETIRE) f->u.retire.mem_kind = 0; /* after the ids */
  f->type = type;
  return f;
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
  case TSHARE_FRAME_RKEY:
    return "rkey";
  default:
    return "unknown";
  }
}
