/* libFuzzer target for the frame decoder, share and tensor-set validation.
 *
 * The first input byte picks how the rest is cut into feeds (framing must not
 * depend on how bytes arrive). Every frame the decoder accepts must pass the
 * encoder's validation and survive an encode/decode round trip unchanged:
 * whatever a peer can get past the decoder, this side could have sent. */
#include "tshare/errors.h"
#include "tshare/wire.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A set frame's fields as sent are its fields as received; a member's name
 * is NUL-terminated at its length. */
static void check_set_round_trip(const tshare_set_frame *a, const tshare_set_frame *b) {
  if (a->op != b->op || a->set_id != b->set_id) abort();
  switch (a->op) {
  case TSHARE_SET_BEGIN:
    if (memcmp(&a->u.begin, &b->u.begin, sizeof a->u.begin) != 0) abort();
    break;
  case TSHARE_SET_MEM:
    if (a->u.mem.index != b->u.mem.index || a->u.mem.alloc_id != b->u.mem.alloc_id ||
        a->u.mem.alloc_size != b->u.mem.alloc_size || a->u.mem.mem_kind != b->u.mem.mem_kind)
      abort();
    break;
  case TSHARE_SET_MEMBER:
    if (a->u.member.name_len != b->u.member.name_len || a->u.member.mem_index != b->u.member.mem_index ||
        strlen(b->u.member.name) != b->u.member.name_len || strcmp(a->u.member.name, b->u.member.name) != 0 ||
        memcmp(&a->u.member.tensor, &b->u.member.tensor, sizeof a->u.member.tensor) != 0)
      abort();
    break;
  case TSHARE_SET_META:
    if (a->u.meta.offset != b->u.meta.offset || a->u.meta.len != b->u.meta.len ||
        memcmp(a->u.meta.bytes, b->u.meta.bytes, a->u.meta.len) != 0)
      abort();
    break;
  }
}

static void round_trip(const tshare_frame *f) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  if (tshare_wire_encode(f, buf, sizeof buf, &len, NULL) != TSHARE_OK) abort(); /* accepted but not sendable */
  tshare_decoder *d = tshare_decoder_create(NULL);
  tshare_frame g;
  if (!d || tshare_decoder_feed(d, buf, len) != TSHARE_OK || tshare_decoder_next(d, &g) != TSHARE_OK) abort();
  tshare_decoder_destroy(d);
  if (g.type != f->type || g.flags != f->flags) abort();
  if (f->type == TSHARE_FRAME_SHARE) {
    const tshare_share_frame *a = &f->u.share, *b = &g.u.share;
    if (a->share_id != b->share_id || a->alloc_size != b->alloc_size || a->tensor.ndim != b->tensor.ndim ||
        a->tensor.byte_offset != b->tensor.byte_offset ||
        memcmp(a->tensor.shape, b->tensor.shape, sizeof a->tensor.shape) != 0 ||
        memcmp(a->tensor.strides, b->tensor.strides, sizeof a->tensor.strides) != 0 || strcmp(a->tag, b->tag) != 0)
      abort();
    uint64_t begin, end;
    if (tshare_tensor_check(&a->tensor, a->alloc_size, &begin, &end, NULL) != TSHARE_OK) abort();
    if (begin > end || end > a->alloc_size) abort();
  }
  if (f->type == TSHARE_FRAME_SET) check_set_round_trip(&f->u.set, &g.u.set);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  size_t chunk = (size_t)(data[0] % 17) + 1;
  data++;
  size--;
  tshare_decoder *d = tshare_decoder_create(NULL);
  if (!d) return 0;
  size_t off = 0;
  int rc = TSHARE_OK;
  while (off < size && rc >= 0) {
    size_t n = size - off < chunk ? size - off : chunk;
    rc = tshare_decoder_feed(d, data + off, n);
    off += n;
    tshare_frame f;
    while (rc >= 0 && (rc = tshare_decoder_next(d, &f)) == TSHARE_OK) round_trip(&f);
  }
  if (rc < 0 && tshare_decoder_last_error(d)[0] == '\0') abort(); /* every error says why */
  tshare_decoder_destroy(d);
  return 0;
}
