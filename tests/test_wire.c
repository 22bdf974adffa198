/* Wire format: round trips of every frame type and one test per class of
 * malformed input. Frames are built by the encoder and then corrupted through
 * the documented header layout, so each test breaks exactly one thing. */
#include "harness.h"
#include <stddef.h>
#include "tshare/errors.h"
#include "tshare/wire.h"

/* Payload offsets of a share frame (wire.c's encode order): share_id 0,
 * alloc_id 8, mem_kind 16, device_type 17, handle_len 18, ndim 19, dtype 20..23,
 * tag_len 24, alloc_size 25, byte_offset 33, event 41..48, uuid 49, handle 65,
 * then shape and strides. */
#define SHARE_ALLOC_SIZE_AT 25
#define SHARE_SHAPE_AT 65 /* with an empty handle */

static tshare_frame sample_share(void) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SHARE;
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  tshare_share_frame *s = &f.u.share;
  s->share_id = 7;
  s->alloc_id = 42;
  s->mem_kind = TSHARE_MEM_HOST_MEMFD;
  s->device_type = TSHARE_DEVICE_CPU;
  s->alloc_size = 4096;
  s->tensor.dtype = (tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1};
  s->tensor.ndim = 3;
  s->tensor.shape[0] = 2;
  s->tensor.shape[1] = 3;
  s->tensor.shape[2] = 4;
  tshare_tensor_set_contiguous(&s->tensor);
  s->tensor.byte_offset = 256;
  s->tag_len = 5;
  memcpy(s->tag, "batch", 5);
  return f;
}

static size_t encode(const tshare_frame *f, uint8_t *buf) {
  size_t len = 0;
  tshare_error terr;
  CHECK_RC(tshare_wire_encode(f, buf, TSHARE_WIRE_FRAME_MAX, &len, &terr), TSHARE_OK, terr.message);
  return len;
}

/* Decode buf[0..len) in one feed and expect status. */
static int decode(const uint8_t *buf, size_t len, tshare_frame *out) {
  tshare_decoder *d = tshare_decoder_create(NULL);
  CHECK(d);
  int rc = tshare_decoder_feed(d, buf, len);
  if (rc == TSHARE_OK) rc = tshare_decoder_next(d, out);
  if (rc < 0) printf("decoder said: %s\n", tshare_decoder_last_error(d));
  tshare_decoder_destroy(d);
  return rc;
}

static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

TS_TEST(roundtrip_hello) {
  tshare_frame f, g;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_HELLO;
  f.u.hello.pid = 1234;
  f.u.hello.uid = 1000;
  for (int i = 0; i < 16; i++) f.u.hello.boot_id[i] = (uint8_t)(i * 7);
  f.u.hello.capabilities = TSHARE_CAP_FD_PASSING | TSHARE_CAP_HOST_MEMFD;
  strcpy(f.u.hello.name, "producer 0");
  f.u.hello.device_count = 2;
  memset(f.u.hello.device_uuids[1], 0xab, 16);
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  CHECK_EQ(g.type, TSHARE_FRAME_HELLO);
  CHECK_EQ(g.u.hello.major, TSHARE_WIRE_MAJOR);
  CHECK_EQ(g.u.hello.minor, TSHARE_WIRE_MINOR);
  CHECK_EQ(g.u.hello.pid, 1234);
  CHECK_EQ(g.u.hello.uid, 1000);
  CHECK(memcmp(g.u.hello.boot_id, f.u.hello.boot_id, 16) == 0);
  CHECK_EQ(g.u.hello.capabilities, f.u.hello.capabilities);
  CHECK(strcmp(g.u.hello.name, "producer 0") == 0);
  CHECK_EQ(g.u.hello.device_count, 2);
  CHECK(memcmp(g.u.hello.device_uuids[1], f.u.hello.device_uuids[1], 16) == 0);
}

TS_TEST(roundtrip_share) {
  tshare_frame f = sample_share(), g;
  f.flags |= TSHARE_FRAME_FLAG_HAS_EVENT;
  f.u.share.event_slot = 3;
  f.u.share.event_generation = 99;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  CHECK_EQ(g.type, TSHARE_FRAME_SHARE);
  CHECK_EQ(g.flags, f.flags);
  const tshare_share_frame *a = &f.u.share, *b = &g.u.share;
  CHECK_EQ(b->share_id, 7);
  CHECK_EQ(b->alloc_id, 42);
  CHECK_EQ(b->mem_kind, a->mem_kind);
  CHECK_EQ(b->alloc_size, 4096);
  CHECK_EQ(b->event_slot, 3);
  CHECK_EQ(b->event_generation, 99);
  CHECK_EQ(b->tensor.ndim, 3);
  CHECK_EQ(b->tensor.byte_offset, 256);
  CHECK_EQ(b->tensor.dtype.code, TSHARE_DTYPE_FLOAT);
  CHECK_EQ(b->tensor.dtype.bits, 32);
  CHECK_EQ(b->tensor.dtype.lanes, 1);
  for (int i = 0; i < 3; i++) {
    CHECK_EQ(b->tensor.shape[i], a->tensor.shape[i]);
    CHECK_EQ(b->tensor.strides[i], a->tensor.strides[i]);
  }
  CHECK(strcmp(b->tag, "batch") == 0);
}

TS_TEST(roundtrip_share_cuda_ipc_handle_and_negative_strides) {
  tshare_frame f = sample_share(), g;
  f.flags = 0;
  f.u.share.mem_kind = TSHARE_MEM_CUDA_IPC;
  f.u.share.device_type = TSHARE_DEVICE_CUDA;
  f.u.share.handle_len = TSHARE_HANDLE_MAX;
  for (int i = 0; i < TSHARE_HANDLE_MAX; i++) f.u.share.handle[i] = (uint8_t)(255 - i);
  memset(f.u.share.device_uuid, 0x5a, 16);
  /* A flipped view: the last row first, walking backwards. */
  f.u.share.tensor.ndim = 2;
  f.u.share.tensor.shape[0] = 4;
  f.u.share.tensor.shape[1] = 8;
  f.u.share.tensor.strides[0] = -8;
  f.u.share.tensor.strides[1] = 1;
  f.u.share.tensor.byte_offset = 3 * 8 * 4;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  CHECK(memcmp(g.u.share.handle, f.u.share.handle, TSHARE_HANDLE_MAX) == 0);
  CHECK(memcmp(g.u.share.device_uuid, f.u.share.device_uuid, 16) == 0);
  CHECK_EQ(g.u.share.tensor.strides[0], -8);
}

TS_TEST(roundtrip_release) {
  tshare_frame f, g;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = TSHARE_RELEASE_MAX;
  for (uint32_t i = 0; i < f.u.release.count; i++) f.u.release.share_ids[i] = 1000 + i * 3;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  CHECK_EQ(g.u.release.count, TSHARE_RELEASE_MAX);
  for (uint32_t i = 0; i < g.u.release.count; i++) CHECK_EQ(g.u.release.share_ids[i], 1000 + i * 3);
}

/* Minor 1: event and retire frames, and the fields appended to a share. */
/* Minor 4: a retire frame names the memory kind of what it retires (host
 * memory); without the trailing byte, as every older peer sends it, it is
 * CUDA memory (0). A share of host memory the receiver keeps mapped carries
 * no fd. */
TS_TEST(retire_frames_name_host_memory_and_kept_host_shares_carry_no_fd) {
  tshare_frame f, g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RETIRE;
  f.u.retire.closed = TSHARE_RETIRE_KEPT;
  f.u.retire.count = 2;
  f.u.retire.alloc_ids[0] = 5;
  f.u.retire.alloc_ids[1] = 6;
  size_t cuda_len = encode(&f, buf);
  CHECK_RC(decode(buf, cuda_len, &g), TSHARE_OK, "");
  CHECK_EQ(g.u.retire.mem_kind, 0);
  f.u.retire.mem_kind = TSHARE_MEM_HOST_MEMFD;
  size_t len = encode(&f, buf);
  CHECK_EQ(len, cuda_len + 1);
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  CHECK_EQ(g.u.retire.mem_kind, TSHARE_MEM_HOST_MEMFD);
  CHECK_EQ(g.u.retire.alloc_ids[1], 6);
  buf[len - 1] = TSHARE_MEM_KIND_LAST + 1; /* a kind nobody knows: refused */
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_MALFORMED);
  f.u.retire.mem_kind = TSHARE_MEM_KIND_LAST + 1;
  size_t out = 0;
  CHECK_EQ(tshare_wire_encode(&f, buf, sizeof buf, &out, NULL), TSHARE_E_MALFORMED);

  f = sample_share();
  f.u.share.mem_kind = TSHARE_MEM_HOST_KEPT;
  f.u.share.device_type = TSHARE_DEVICE_CPU;
  f.u.share.handle_len = 0;
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED; /* a kept share with an fd: refused */
  CHECK_EQ(tshare_wire_encode(&f, buf, sizeof buf, &out, NULL), TSHARE_E_MALFORMED);
  f.flags = 0;
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.share.mem_kind, TSHARE_MEM_HOST_KEPT);
  f.u.share.device_type = TSHARE_DEVICE_CUDA; /* host memory on a GPU: refused */
  CHECK(tshare_wire_encode(&f, buf, sizeof buf, &out, NULL) != TSHARE_OK);
}

TS_TEST(roundtrip_event_retire_and_minor1_share_fields) {
  tshare_frame f, g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_EVENT;
  f.u.event.slot = TSHARE_EVENT_SLOTS_MAX - 1;
  for (int i = 0; i < TSHARE_HANDLE_MAX; i++) f.u.event.handle[i] = (uint8_t)(i * 7);
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.event.slot, TSHARE_EVENT_SLOTS_MAX - 1);
  CHECK(memcmp(g.u.event.handle, f.u.event.handle, TSHARE_HANDLE_MAX) == 0);
  f.u.event.slot = TSHARE_EVENT_SLOTS_MAX; /* over the limit: refused both ways */
  size_t len = 0;
  CHECK_EQ(tshare_wire_encode(&f, buf, sizeof buf, &len, NULL), TSHARE_E_TOO_LARGE);
  f.u.event.slot = 1;
  len = encode(&f, buf);
  put_u32(buf + TSHARE_WIRE_HEADER_SIZE, TSHARE_EVENT_SLOTS_MAX);
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_TOO_LARGE);

  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RETIRE;
  f.u.retire.closed = 1;
  f.u.retire.count = 3;
  f.u.retire.alloc_ids[0] = 0; /* a buffer id may be 0 */
  f.u.retire.alloc_ids[1] = 77;
  f.u.retire.alloc_ids[2] = UINT64_MAX;
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.retire.closed, 1);
  CHECK_EQ(g.u.retire.count, 3);
  CHECK(g.u.retire.alloc_ids[2] == UINT64_MAX);
  len = encode(&f, buf);
  buf[TSHARE_WIRE_HEADER_SIZE] = 2; /* kept mapped until retired */
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  CHECK_EQ(g.u.retire.closed, 2);
  buf[TSHARE_WIRE_HEADER_SIZE] = 3; /* closed is 0, 1 or 2 */
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_MALFORMED);

  /* A share of VMM memory the receiver keeps mapped: no fd, no handle. */
  f = sample_share();
  f.flags = 0;
  f.u.share.mem_kind = TSHARE_MEM_CUDA_HELD;
  f.u.share.device_type = TSHARE_DEVICE_CUDA;
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.share.mem_kind, TSHARE_MEM_CUDA_HELD);
  size_t ignored;
  tshare_error terr;
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED; /* it names memory already mapped: no fd */
  CHECK_EQ(tshare_wire_encode(&f, buf, TSHARE_WIRE_FRAME_MAX, &ignored, &terr), TSHARE_E_MALFORMED);
  f.flags = 0;
  f.u.share.handle_len = 8;
  CHECK_EQ(tshare_wire_encode(&f, buf, TSHARE_WIRE_FRAME_MAX, &ignored, &terr), TSHARE_E_MALFORMED);

  f = sample_share();
  f.u.share.origin_pid = 4242;
  f.u.share.share_flags = TSHARE_SHARE_FLAG_RETIRE_NOTICE;
  len = encode(&f, buf);
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  CHECK_EQ(g.u.share.origin_pid, 4242);
  CHECK_EQ(g.u.share.share_flags, TSHARE_SHARE_FLAG_RETIRE_NOTICE);
  /* A minor-0 sender's share ends before those fields: they read as 0. */
  put_u32(buf + 8, (uint32_t)(len - TSHARE_WIRE_HEADER_SIZE - 8));
  buf[5] = 0;
  CHECK_RC(decode(buf, len - 8, &g), TSHARE_OK, "");
  CHECK_EQ(g.u.share.origin_pid, 0);
  CHECK_EQ(g.u.share.share_flags, 0);
}

/* Minor 2: the ring transport's frames and VMM chunk frames. */
TS_TEST(roundtrip_ring_and_chunk_frames) {
  tshare_frame f, g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = 0;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RING;
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  f.u.ring.op = TSHARE_RING_SETUP;
  f.u.ring.capacity = 1u << 20;
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.ring.op, TSHARE_RING_SETUP);
  CHECK_EQ(g.u.ring.capacity, 1u << 20);
  f.flags = 0; /* a setup frame carries its memfd */
  CHECK_EQ(tshare_wire_encode(&f, buf, sizeof buf, &len, NULL), TSHARE_E_MALFORMED);
  f.u.ring.op = TSHARE_RING_SOCKET_NEXT;
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.ring.op, TSHARE_RING_SOCKET_NEXT);
  len = encode(&f, buf);
  buf[TSHARE_WIRE_HEADER_SIZE] = 9; /* no such op */
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_MALFORMED);
  len = encode(&f, buf);
  buf[7] = TSHARE_FRAME_FLAG_FD_ATTACHED; /* only a setup frame carries an fd */
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_MALFORMED);

  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_CHUNK;
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  f.u.chunk.alloc_id = UINT64_MAX;
  f.u.chunk.index = 2;
  f.u.chunk.count = 3;
  f.u.chunk.size = 20u << 20;
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK(g.u.chunk.alloc_id == UINT64_MAX && g.u.chunk.index == 2 && g.u.chunk.count == 3);
  CHECK(g.u.chunk.size == 20u << 20);
  len = encode(&f, buf);
  put_u32(buf + TSHARE_WIRE_HEADER_SIZE + 8, 0); /* chunk 0 rides on the share itself */
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_MALFORMED);
  len = encode(&f, buf);
  put_u32(buf + TSHARE_WIRE_HEADER_SIZE + 12, TSHARE_CHUNKS_MAX + 1);
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_MALFORMED);
  len = encode(&f, buf);
  buf[7] = 0; /* a chunk without its fd */
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_MALFORMED);
  f.u.chunk.index = 3; /* not below count: refused when encoding too */
  CHECK_EQ(tshare_wire_encode(&f, buf, sizeof buf, &len, NULL), TSHARE_E_MALFORMED);
}

TS_TEST(roundtrip_bye_and_error) {
  tshare_frame f, g;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_BYE;
  f.u.bye.reason = 5;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  CHECK_EQ(g.type, TSHARE_FRAME_BYE);
  CHECK_EQ(g.u.bye.reason, 5);
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_ERROR;
  f.u.error.code = TSHARE_E_VERSION;
  strcpy(f.u.error.message, "peer speaks 2.x");
  len = encode(&f, buf);
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  CHECK_EQ(g.u.error.code, TSHARE_E_VERSION);
  CHECK(strcmp(g.u.error.message, "peer speaks 2.x") == 0);
}

TS_TEST(stream_byte_by_byte_and_back_to_back) {
  /* Three frames fed one byte at a time come out whole and in order. */
  uint8_t stream[3 * TSHARE_WIRE_FRAME_MAX];
  size_t n = 0;
  tshare_frame a = sample_share(), b, c = sample_share();
  memset(&b, 0, sizeof b);
  b.type = TSHARE_FRAME_BYE;
  c.u.share.share_id = 8;
  n += encode(&a, stream + n);
  n += encode(&b, stream + n);
  n += encode(&c, stream + n);
  tshare_decoder *d = tshare_decoder_create(NULL);
  uint64_t seen[3];
  int frames = 0;
  for (size_t i = 0; i < n; i++) {
    CHECK_RC(tshare_decoder_feed(d, stream + i, 1), TSHARE_OK, tshare_decoder_last_error(d));
    tshare_frame out;
    int rc;
    while ((rc = tshare_decoder_next(d, &out)) == TSHARE_OK) {
      CHECK(frames < 3);
      seen[frames++] = out.type == TSHARE_FRAME_SHARE ? out.u.share.share_id : 0;
    }
    CHECK_RC(rc, TSHARE_AGAIN, tshare_decoder_last_error(d));
  }
  CHECK_EQ(frames, 3);
  CHECK_EQ(seen[0], 7);
  CHECK_EQ(seen[1], 0);
  CHECK_EQ(seen[2], 8);
  CHECK_EQ(tshare_decoder_pending(d), 0);
  tshare_decoder_destroy(d);
}

TS_TEST(newer_minor_with_trailing_fields_is_accepted) {
  tshare_frame f, g;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_BYE;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  buf[5] = TSHARE_WIRE_MINOR + 3; /* a newer minor ... */
  put_u32(buf + 8, 4 + 6);        /* ... that appended 6 bytes to bye */
  memset(buf + len, 0xee, 6);
  CHECK_RC(decode(buf, len + 6, &g), TSHARE_OK, "");
  CHECK_EQ(g.minor, TSHARE_WIRE_MINOR + 3);
}

TS_TEST(malformed_short_header_needs_more) {
  tshare_frame f = sample_share(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  encode(&f, buf);
  tshare_decoder *d = tshare_decoder_create(NULL);
  CHECK_RC(tshare_decoder_feed(d, buf, 7), TSHARE_OK, "");
  CHECK_RC(tshare_decoder_next(d, &g), TSHARE_AGAIN, tshare_decoder_last_error(d));
  CHECK_EQ(tshare_decoder_pending(d), 7); /* a channel reports this at EOF as "closed mid-frame" */
  tshare_decoder_destroy(d);
}

TS_TEST(malformed_bad_magic) {
  tshare_frame f = sample_share(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  buf[1] = 'X';
  CHECK_RC(decode(buf, len, &g), TSHARE_E_BAD_MAGIC, "");
  /* Detected from the first bytes, without waiting for a whole header. */
  CHECK_RC(decode((const uint8_t *)"GET ", 4, &g), TSHARE_E_BAD_MAGIC, "");
}

TS_TEST(malformed_other_major_version) {
  tshare_frame f = sample_share(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  buf[4] = TSHARE_WIRE_MAJOR + 1;
  CHECK_RC(decode(buf, len, &g), TSHARE_E_VERSION, "");
  buf[4] = 0;
  CHECK_RC(decode(buf, len, &g), TSHARE_E_VERSION, "");
}

TS_TEST(malformed_unknown_type) {
  tshare_frame f = sample_share(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  buf[6] = 77;
  CHECK_RC(decode(buf, len, &g), TSHARE_E_UNKNOWN_TYPE, "");
  buf[6] = 0;
  CHECK_RC(decode(buf, len, &g), TSHARE_E_UNKNOWN_TYPE, "");
}

TS_TEST(malformed_unknown_flags) {
  tshare_frame f = sample_share(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  buf[7] |= 0x80;
  CHECK_RC(decode(buf, len, &g), TSHARE_E_MALFORMED, "");
}

TS_TEST(malformed_oversized_length) {
  tshare_frame f = sample_share(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  encode(&f, buf);
  put_u32(buf + 8, 0xffffffffu);
  /* Rejected from the header alone: nothing is allocated or awaited. */
  CHECK_RC(decode(buf, TSHARE_WIRE_HEADER_SIZE, &g), TSHARE_E_TOO_LARGE, "");
  put_u32(buf + 8, TSHARE_WIRE_FRAME_MAX); /* just over max_payload */
  CHECK_RC(decode(buf, TSHARE_WIRE_HEADER_SIZE, &g), TSHARE_E_TOO_LARGE, "");
}

TS_TEST(malformed_ndim_over_limit) {
  tshare_frame f = sample_share(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  buf[TSHARE_WIRE_HEADER_SIZE + 19] = TSHARE_MAX_NDIM + 1; /* ndim byte */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_TOO_LARGE, "");
  /* A lower configured limit is honoured too. */
  tshare_wire_limits lim = tshare_wire_limits_default();
  lim.max_ndim = 2;
  tshare_decoder *d = tshare_decoder_create(&lim);
  len = encode(&f, buf);
  tshare_decoder_feed(d, buf, len);
  CHECK_RC(tshare_decoder_next(d, &g), TSHARE_E_TOO_LARGE, tshare_decoder_last_error(d));
  tshare_decoder_destroy(d);
}

TS_TEST(malformed_shape_overflow) {
  tshare_frame f = sample_share(), g;
  f.u.share.alloc_size = (uint64_t)1 << 40;
  f.u.share.tensor.ndim = 2;
  f.u.share.tensor.shape[0] = INT64_MAX / 2;
  f.u.share.tensor.shape[1] = 4;
  f.u.share.tensor.strides[0] = 4;
  f.u.share.tensor.strides[1] = 1;
  f.u.share.tensor.byte_offset = 0;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  tshare_error terr;
  /* The encoder refuses it ... */
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, &terr), TSHARE_E_OVERFLOW, terr.message);
  /* ... and a hand-made frame is refused by the decoder. */
  tshare_frame ok = sample_share();
  ok.u.share.tensor.ndim = 2;
  ok.u.share.tensor.shape[0] = 1;
  ok.u.share.tensor.shape[1] = 1;
  len = encode(&ok, buf);
  size_t shape0 = TSHARE_WIRE_HEADER_SIZE + SHARE_SHAPE_AT;
  for (int i = 0; i < 8; i++) buf[shape0 + (size_t)i] = (uint8_t)((uint64_t)(INT64_MAX / 2) >> (8 * i));
  for (int i = 0; i < 8; i++) buf[shape0 + 8 + (size_t)i] = (uint8_t)((uint64_t)4 >> (8 * i)); /* shape[1] */
  buf[shape0 + 16] = 4; /* strides[0] = 4 (low byte; was 1) */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_OVERFLOW, "");
  /* Each dimension alone fits; their product does not. */
  f.u.share.tensor.shape[0] = (int64_t)1 << 40;
  f.u.share.tensor.shape[1] = (int64_t)1 << 40;
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, &terr), TSHARE_E_OVERFLOW, terr.message);
}

TS_TEST(malformed_view_outside_allocation) {
  tshare_frame f = sample_share(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  tshare_error terr;
  f.u.share.tensor.byte_offset = 4096 - 4; /* 24 floats from 4 bytes before the end */
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, &terr), TSHARE_E_OUT_OF_BOUNDS, terr.message);
  f = sample_share();
  f.u.share.tensor.strides[0] = 1000; /* the last row lands past the end */
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, &terr), TSHARE_E_OUT_OF_BOUNDS, terr.message);
  f = sample_share();
  f.u.share.tensor.strides[0] = -12; /* negative stride reaching before the allocation */
  f.u.share.tensor.byte_offset = 0;
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, &terr), TSHARE_E_OUT_OF_BOUNDS, terr.message);
  /* The decoder applies the same rule: shrink alloc_size in a valid frame. */
  f = sample_share();
  len = encode(&f, buf);
  size_t alloc_size_at = TSHARE_WIRE_HEADER_SIZE + SHARE_ALLOC_SIZE_AT;
  memset(buf + alloc_size_at, 0, 8);
  buf[alloc_size_at] = 100;
  CHECK_RC(decode(buf, len, &g), TSHARE_E_OUT_OF_BOUNDS, "");
}

TS_TEST(malformed_truncated_payload) {
  tshare_frame f = sample_share(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  /* Claim a shorter payload: the fields run past its end. */
  put_u32(buf + 8, (uint32_t)(len - TSHARE_WIRE_HEADER_SIZE - 10));
  CHECK_RC(decode(buf, len - 10, &g), TSHARE_E_TRUNCATED, "");
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = 4;
  len = encode(&f, buf);
  put_u32(buf + 8, 4 + 8); /* count says 4 ids, one is there */
  CHECK_RC(decode(buf, TSHARE_WIRE_HEADER_SIZE + 12, &g), TSHARE_E_TRUNCATED, "");
}

TS_TEST(malformed_counts_over_limits) {
  tshare_frame f, g;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = 1;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  put_u32(buf + TSHARE_WIRE_HEADER_SIZE, 100000); /* release count */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_TOO_LARGE, "");
  put_u32(buf + TSHARE_WIRE_HEADER_SIZE, 0);
  CHECK_RC(decode(buf, len, &g), TSHARE_E_TOO_LARGE, "");
  f = sample_share();
  len = encode(&f, buf);
  buf[TSHARE_WIRE_HEADER_SIZE + 24] = TSHARE_TAG_MAX + 1; /* tag_len */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_TOO_LARGE, "");
}

TS_TEST(malformed_field_values) {
  tshare_frame f = sample_share(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  tshare_error terr;
  f.u.share.tensor.dtype.bits = 12;
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, &terr), TSHARE_E_MALFORMED, terr.message);
  f = sample_share();
  f.u.share.share_id = 0;
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, &terr), TSHARE_E_MALFORMED, terr.message);
  f = sample_share();
  f.u.share.tensor.shape[1] = -3;
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, &terr), TSHARE_E_MALFORMED, terr.message);
  f = sample_share();
  len = encode(&f, buf);
  buf[TSHARE_WIRE_HEADER_SIZE + 16] = 9; /* mem_kind */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_MALFORMED, "");
  len = encode(&f, buf);
  buf[7] = 0; /* a memfd share without its fd */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_MALFORMED, "");
}

/* ---- tensor set frames ---------------------------------------------------- */

/* Payload offsets of a set frame (wire.c's encode order): op 0, set_id 1;
 * begin: count 9, mem_count 13, names_bytes 17, meta_bytes 21; member: index
 * 9, mem_index 13, name_len 17, name 19; memory: mem_kind 21. */
#define SET_AT(off) (TSHARE_WIRE_HEADER_SIZE + (off))

static tshare_frame set_frame(uint8_t op) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SET;
  f.u.set.op = op;
  f.u.set.set_id = 99;
  return f;
}

static tshare_frame set_begin(uint32_t count, uint32_t mem_count, uint32_t names_bytes, uint32_t meta_bytes) {
  tshare_frame f = set_frame(TSHARE_SET_BEGIN);
  f.u.set.u.begin = (tshare_set_begin_frame){count, mem_count, names_bytes, meta_bytes, 0};
  return f;
}

static tshare_frame set_member(const char *name, size_t name_len) {
  tshare_frame f = set_frame(TSHARE_SET_MEMBER);
  tshare_set_member_frame *m = &f.u.set.u.member;
  m->index = 3;
  m->mem_index = 1;
  m->name_len = (uint16_t)name_len;
  memcpy(m->name, name, name_len);
  m->tensor.dtype = (tshare_dtype){TSHARE_DTYPE_BFLOAT, 16, 1};
  m->tensor.ndim = 2;
  m->tensor.shape[0] = 5;
  m->tensor.shape[1] = 7;
  tshare_tensor_set_contiguous(&m->tensor);
  m->tensor.byte_offset = 1 << 20;
  return f;
}

static tshare_frame set_mem(void) {
  tshare_frame f = set_frame(TSHARE_SET_MEM);
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  f.u.set.u.mem = (tshare_set_mem_frame){.index = 1, .alloc_id = 77, .mem_kind = TSHARE_MEM_HOST_MEMFD,
                                   .device_type = TSHARE_DEVICE_CPU, .alloc_size = 8 << 20};
  return f;
}

static void expect_encode_refused(const tshare_frame *f, int want) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  tshare_error terr;
  CHECK_RC(tshare_wire_encode(f, buf, sizeof buf, &len, &terr), want, terr.message);
  printf("  refused as expected: %s\n", terr.message);
}

TS_TEST(roundtrip_set_frames) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  tshare_frame f = set_begin(65536, 2, 16u << 20, 16u << 20), g;
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.type, TSHARE_FRAME_SET);
  CHECK_EQ(g.u.set.op, TSHARE_SET_BEGIN);
  CHECK_EQ(g.u.set.set_id, 99);
  CHECK(memcmp(&g.u.set.u.begin, &f.u.set.u.begin, sizeof f.u.set.u.begin) == 0);

  f = set_mem();
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.flags, TSHARE_FRAME_FLAG_FD_ATTACHED);
  CHECK_EQ(g.u.set.u.mem.index, 1);
  CHECK_EQ(g.u.set.u.mem.alloc_id, 77);
  CHECK_EQ(g.u.set.u.mem.alloc_size, 8 << 20);
  CHECK_EQ(g.u.set.u.mem.mem_kind, TSHARE_MEM_HOST_MEMFD);

  /* The longest name with the most dimensions still fits one frame. */
  char name[TSHARE_SET_NAME_MAX];
  memset(name, 'w', sizeof name);
  memcpy(name, "vision_tower.\xc3\xa9", 15); /* UTF-8 is fine */
  f = set_member(name, sizeof name);
  f.u.set.u.member.tensor.ndim = TSHARE_MAX_NDIM;
  for (int i = 2; i < TSHARE_MAX_NDIM; i++) f.u.set.u.member.tensor.shape[i] = 1;
  tshare_tensor_set_contiguous(&f.u.set.u.member.tensor);
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.set.u.member.name_len, TSHARE_SET_NAME_MAX);
  CHECK(memcmp(g.u.set.u.member.name, name, sizeof name) == 0 && g.u.set.u.member.name[sizeof name] == '\0');
  CHECK_EQ(g.u.set.u.member.index, 3);
  CHECK_EQ(g.u.set.u.member.mem_index, 1);
  CHECK(memcmp(&g.u.set.u.member.tensor, &f.u.set.u.member.tensor, sizeof f.u.set.u.member.tensor) == 0);
  f = set_member("x", 1);
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK(strcmp(g.u.set.u.member.name, "x") == 0);

  f = set_frame(TSHARE_SET_META);
  f.u.set.u.meta.offset = 4096;
  f.u.set.u.meta.len = TSHARE_SET_META_CHUNK_MAX;
  for (unsigned i = 0; i < TSHARE_SET_META_CHUNK_MAX; i++) f.u.set.u.meta.bytes[i] = (uint8_t)(i * 31);
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.set.u.meta.offset, 4096);
  CHECK(memcmp(g.u.set.u.meta.bytes, f.u.set.u.meta.bytes, TSHARE_SET_META_CHUNK_MAX) == 0);

  f = set_frame(TSHARE_SET_END);
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.set.op, TSHARE_SET_END);
  CHECK(strcmp(tshare_frame_type_name(TSHARE_FRAME_SET), "set") == 0);
}

TS_TEST(malformed_set_bounds) {
  expect_encode_refused(&(tshare_frame){0}, TSHARE_E_UNKNOWN_TYPE);
  tshare_frame f = set_begin(TSHARE_SET_MEMBERS_MAX + 1, 1, TSHARE_SET_MEMBERS_MAX + 1, 0);
  expect_encode_refused(&f, TSHARE_E_TOO_LARGE); /* too many tensors */
  f = set_begin(0, 0, 0, 0);
  expect_encode_refused(&f, TSHARE_E_TOO_LARGE); /* an empty set */
  f = set_begin(4, 5, 4, 0);
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* more memories than tensors */
  f = set_begin(4, 1, 4 * TSHARE_SET_NAME_MAX + 1, 0);
  expect_encode_refused(&f, TSHARE_E_TOO_LARGE); /* names longer than the members could carry */
  f = set_begin(65536, 1, TSHARE_SET_NAMES_MAX + 1, 0);
  expect_encode_refused(&f, TSHARE_E_TOO_LARGE); /* names over the total bound */
  f = set_begin(1, 1, 1, TSHARE_SET_META_MAX + 1);
  expect_encode_refused(&f, TSHARE_E_TOO_LARGE); /* metadata over the bound */
  f = set_frame(TSHARE_SET_META);
  f.u.set.u.meta.offset = TSHARE_SET_META_MAX - 10;
  f.u.set.u.meta.len = 11;
  expect_encode_refused(&f, TSHARE_E_TOO_LARGE); /* a chunk past the bound */
  f = set_member("", 0);
  expect_encode_refused(&f, TSHARE_E_TOO_LARGE); /* no name */
  f = set_frame(TSHARE_SET_END);
  f.u.set.set_id = 0;
  expect_encode_refused(&f, TSHARE_E_MALFORMED);

  /* The same bounds hold for what a peer sends: the decoder refuses them. */
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  tshare_frame g;
  f = set_begin(1, 1, 1, 0);
  size_t len = encode(&f, buf);
  put_u32(buf + SET_AT(9), TSHARE_SET_MEMBERS_MAX + 1);
  CHECK_RC(decode(buf, len, &g), TSHARE_E_TOO_LARGE, "");
  len = encode(&f, buf);
  put_u32(buf + SET_AT(21), TSHARE_SET_META_MAX + 1);
  CHECK_RC(decode(buf, len, &g), TSHARE_E_TOO_LARGE, "");
  len = encode(&f, buf);
  put_u32(buf + SET_AT(17), 2); /* two bytes of names for one tensor of at least one */
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  put_u32(buf + SET_AT(17), TSHARE_SET_NAME_MAX + 1);
  CHECK_RC(decode(buf, len, &g), TSHARE_E_TOO_LARGE, "");
  f = set_member("layer", 5);
  len = encode(&f, buf);
  buf[SET_AT(17)] = (uint8_t)(TSHARE_SET_NAME_MAX + 1);
  buf[SET_AT(18)] = (uint8_t)((TSHARE_SET_NAME_MAX + 1) >> 8); /* a name over 1 KiB */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_TOO_LARGE, "");
}

TS_TEST(malformed_set_fields) {
  tshare_frame f = set_member("bad\xff", 4);
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* not UTF-8 */
  f = set_member("a\xc0\xaf", 3);
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* an overlong form */
  f = set_member("a\0b", 3);
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* a NUL inside */
  f = set_member("w", 1);
  f.u.set.u.member.tensor.shape[0] = INT64_MAX;
  expect_encode_refused(&f, TSHARE_E_OVERFLOW);
  f = set_mem();
  f.u.set.u.mem.device_type = TSHARE_DEVICE_CUDA;
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* host memory on a GPU */
  f = set_mem();
  f.flags = 0;
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* a memfd without its fd */
  f = set_begin(1, 1, 1, 0);
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* an fd where none belongs */
  f = set_frame(9);
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* an unknown step */

  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  tshare_frame g;
  f = set_mem();
  size_t len = encode(&f, buf);
  buf[SET_AT(21)] = 9; /* mem_kind */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_MALFORMED, "");
  f = set_member("layer", 5);
  len = encode(&f, buf);
  buf[SET_AT(19 + 2)] = 0; /* a NUL in the name */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_MALFORMED, "");
  len = encode(&f, buf);
  put_u32(buf + 8, (uint32_t)(len - TSHARE_WIRE_HEADER_SIZE - 8)); /* a payload cut inside the strides */
  CHECK_RC(decode(buf, len - 8, &g), TSHARE_E_TRUNCATED, "");
  len = encode(&f, buf);
  buf[SET_AT(0)] = 0; /* op */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_MALFORMED, "");
}

/* A layout the receiver of sets lost: slot and layout id, the layout id also
 * the frame's set id; a slot outside 1..4 or another id is malformed, from
 * the encoder as from a peer. */
TS_TEST(set_dropped_frames_round_trip_and_bad_ones_are_refused) {
  tshare_frame f = set_frame(TSHARE_SET_DROPPED);
  f.u.set.u.dropped = (tshare_set_dropped_frame){TSHARE_SET_LAYOUT_SLOTS, 99};
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  tshare_frame g;
  size_t len = encode(&f, buf);
  CHECK_EQ(len, (size_t)SET_AT(1 + 8 + 1 + 8));
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  CHECK_EQ(g.u.set.op, TSHARE_SET_DROPPED);
  CHECK_EQ(g.u.set.set_id, 99);
  CHECK_EQ(g.u.set.u.dropped.layout_slot, TSHARE_SET_LAYOUT_SLOTS);
  CHECK_EQ(g.u.set.u.dropped.layout_id, 99);

  f.u.set.u.dropped.layout_slot = 0;
  expect_encode_refused(&f, TSHARE_E_MALFORMED);
  f.u.set.u.dropped.layout_slot = TSHARE_SET_LAYOUT_SLOTS + 1;
  expect_encode_refused(&f, TSHARE_E_MALFORMED);
  f.u.set.u.dropped = (tshare_set_dropped_frame){1, 0};
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* layout id 0 */
  f.u.set.u.dropped = (tshare_set_dropped_frame){1, 98};
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* another id than the set's */
  f.u.set.u.dropped = (tshare_set_dropped_frame){1, 99};
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* an fd where none belongs */

  f.flags = 0;
  len = encode(&f, buf);
  buf[SET_AT(9)] = TSHARE_SET_LAYOUT_SLOTS + 1;
  CHECK_RC(decode(buf, len, &g), TSHARE_E_MALFORMED, "");
  len = encode(&f, buf);
  memset(buf + SET_AT(10), 0, 8); /* layout id 0 */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_MALFORMED, "");
  len = encode(&f, buf);
  put_u32(buf + 8, (uint32_t)(len - TSHARE_WIRE_HEADER_SIZE - 1)); /* cut inside the layout id */
  CHECK_RC(decode(buf, len - 1, &g), TSHARE_E_TRUNCATED, "");
}

static tshare_frame set_mem_cuda(uint8_t kind, uint32_t flags) {
  tshare_frame f = set_frame(TSHARE_SET_MEM);
  f.flags = kind == TSHARE_MEM_CUDA_FD ? TSHARE_FRAME_FLAG_FD_ATTACHED : 0;
  tshare_set_mem_frame *m = &f.u.set.u.mem;
  *m = (tshare_set_mem_frame){.index = 2, .alloc_id = 1234, .mem_kind = kind, .device_type = TSHARE_DEVICE_CUDA,
                              .alloc_size = 2 << 20, .share_flags = flags};
  for (int i = 0; i < 16; i++) m->device_uuid[i] = (uint8_t)(0xa0 + i);
  if (kind == TSHARE_MEM_CUDA_IPC) {
    m->handle_len = TSHARE_HANDLE_MAX;
    for (int i = 0; i < TSHARE_HANDLE_MAX; i++) m->handle[i] = (uint8_t)(i * 7 + 1);
  }
  return f;
}

static tshare_frame set_end_with_event(uint32_t slot, uint32_t generation) {
  tshare_frame f = set_frame(TSHARE_SET_END);
  f.flags = TSHARE_FRAME_FLAG_HAS_EVENT;
  f.u.set.u.end = (tshare_set_end_frame){slot, generation};
  return f;
}

TS_TEST(roundtrip_set_cuda_memories_and_the_end_frames_event) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  tshare_frame f = set_mem_cuda(TSHARE_MEM_CUDA_IPC, TSHARE_SHARE_FLAG_RETIRE_NOTICE), g;
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.flags, 0);
  CHECK(memcmp(&g.u.set.u.mem, &f.u.set.u.mem, sizeof f.u.set.u.mem) == 0);
  f = set_mem_cuda(TSHARE_MEM_CUDA_FD, TSHARE_SHARE_FLAG_RETIRE_NOTICE | TSHARE_SHARE_FLAG_CHUNKS | TSHARE_SHARE_FLAG_HOLD_OFFER);
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.flags, TSHARE_FRAME_FLAG_FD_ATTACHED);
  CHECK(memcmp(&g.u.set.u.mem, &f.u.set.u.mem, sizeof f.u.set.u.mem) == 0);
  f = set_mem_cuda(TSHARE_MEM_CUDA_HELD, 0);
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.set.u.mem.mem_kind, TSHARE_MEM_CUDA_HELD);
  /* A host memory's frame is the one wire 1.3 had: no flags field. */
  f = set_mem();
  size_t host_len = encode(&f, buf);
  f = set_mem_cuda(TSHARE_MEM_CUDA_FD, 0);
  CHECK_EQ(encode(&f, buf), host_len + 4);

  f = set_end_with_event(TSHARE_EVENT_SLOTS_MAX - 1, 0xfffffffeu);
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.flags, TSHARE_FRAME_FLAG_HAS_EVENT);
  CHECK_EQ(g.u.set.u.end.event_slot, TSHARE_EVENT_SLOTS_MAX - 1);
  CHECK_EQ(g.u.set.u.end.event_generation, 0xfffffffeu);
  f = set_frame(TSHARE_SET_END); /* without an event: nothing after the set id */
  size_t plain = encode(&f, buf);
  CHECK_EQ(plain, TSHARE_WIRE_HEADER_SIZE + 9);
  CHECK_RC(decode(buf, plain, &g), TSHARE_OK, "");
  CHECK_EQ(g.flags, 0);
}

/* Minor 5: a host memfd of a set offered to be kept carries its share flags
 * after the 1.3 fields; one with none is the 1.3 frame byte for byte, and a
 * memfd the receiver keeps comes without its fd. */
TS_TEST(host_set_memories_carry_the_retire_notice_and_kept_ones_no_fd) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  tshare_frame f = set_mem(), g;
  size_t plain = encode(&f, buf);
  f.u.set.u.mem.share_flags = TSHARE_SHARE_FLAG_RETIRE_NOTICE;
  size_t offered = encode(&f, buf);
  CHECK_EQ(offered, plain + 4);
  CHECK_RC(decode(buf, offered, &g), TSHARE_OK, "");
  CHECK_EQ(g.u.set.u.mem.share_flags, TSHARE_SHARE_FLAG_RETIRE_NOTICE);
  CHECK_EQ(g.u.set.u.mem.mem_kind, TSHARE_MEM_HOST_MEMFD);
  f = set_mem();
  f.flags = 0;
  f.u.set.u.mem.mem_kind = TSHARE_MEM_HOST_KEPT;
  size_t kept = encode(&f, buf);
  CHECK_EQ(kept, plain);
  CHECK_RC(decode(buf, kept, &g), TSHARE_OK, "");
  CHECK_EQ(g.u.set.u.mem.mem_kind, TSHARE_MEM_HOST_KEPT);
  CHECK_EQ(g.flags & TSHARE_FRAME_FLAG_FD_ATTACHED, 0);
  CHECK_EQ(g.u.set.u.mem.alloc_id, 77);
  CHECK_EQ(g.u.set.u.mem.share_flags, 0);
}

TS_TEST(malformed_set_cuda_fields) {
  tshare_frame f = set_mem_cuda(TSHARE_MEM_CUDA_IPC, 0);
  f.u.set.u.mem.handle_len = 8;
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* a legacy handle is 64 bytes */
  f = set_mem_cuda(TSHARE_MEM_CUDA_FD, 0);
  f.u.set.u.mem.handle_len = TSHARE_HANDLE_MAX;
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* a VMM fd has no handle */
  f = set_mem_cuda(TSHARE_MEM_CUDA_IPC, TSHARE_SHARE_FLAG_CHUNKS);
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* only VMM fds come in chunks */
  f = set_mem_cuda(TSHARE_MEM_CUDA_IPC, TSHARE_SHARE_FLAG_HOLD_OFFER);
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* only a VMM run is offered to be held */
  f = set_mem_cuda(TSHARE_MEM_CUDA_HELD, TSHARE_SHARE_FLAG_HOLD_OFFER);
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* ...and not once it is held */
  f = set_mem();
  f.u.set.u.mem.share_flags = TSHARE_SHARE_FLAG_CHUNKS;
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* a host memfd knows only the retire notice */
  f = set_mem();
  f.u.set.u.mem.mem_kind = TSHARE_MEM_HOST_FD;
  f.u.set.u.mem.share_flags = TSHARE_SHARE_FLAG_RETIRE_NOTICE;
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* an unsealed file is never kept */
  f = set_mem();
  f.flags = 0;
  f.u.set.u.mem.mem_kind = TSHARE_MEM_HOST_KEPT;
  f.u.set.u.mem.share_flags = TSHARE_SHARE_FLAG_RETIRE_NOTICE;
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* nor offered again once kept */
  f = set_mem();
  f.u.set.u.mem.mem_kind = TSHARE_MEM_HOST_KEPT;
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* a kept memfd travels without its fd */
  f = set_end_with_event(TSHARE_EVENT_SLOTS_MAX, 1);
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* a slot past the pool */
  f = set_mem_cuda(TSHARE_MEM_CUDA_IPC, 0);
  f.flags = TSHARE_FRAME_FLAG_HAS_EVENT;
  expect_encode_refused(&f, TSHARE_E_MALFORMED); /* only the end frame carries the event */

  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  tshare_frame g;
  f = set_mem_cuda(TSHARE_MEM_CUDA_FD, TSHARE_SHARE_FLAG_CHUNKS);
  size_t len = encode(&f, buf);
  put_u32(buf + len - 4, 1u << 9); /* an unknown flag */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_MALFORMED, "");
  len = encode(&f, buf);
  put_u32(buf + 8, (uint32_t)(len - TSHARE_WIRE_HEADER_SIZE - 2)); /* the flags cut off */
  CHECK_RC(decode(buf, len - 2, &g), TSHARE_E_TRUNCATED, "");
  f = set_end_with_event(5, 9);
  len = encode(&f, buf);
  put_u32(buf + SET_AT(9), TSHARE_EVENT_SLOTS_MAX + 7); /* the slot */
  CHECK_RC(decode(buf, len, &g), TSHARE_E_MALFORMED, "");
  len = encode(&f, buf);
  put_u32(buf + 8, (uint32_t)(len - TSHARE_WIRE_HEADER_SIZE - 4)); /* the generation cut off */
  CHECK_RC(decode(buf, len - 4, &g), TSHARE_E_TRUNCATED, "");
}

/* Minor 5: the rkey frame (a region and its packed key, the key bounded)
 * and the remote-memory share that names it (no fd, no handle, host). */
static tshare_frame sample_rkey(void) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RKEY;
  f.u.rkey.alloc_id = 42;
  f.u.rkey.address = 0x7f0000001000ull;
  f.u.rkey.length = 64u << 20;
  f.u.rkey.key_len = TSHARE_RKEY_MAX;
  for (int i = 0; i < TSHARE_RKEY_MAX; i++) f.u.rkey.key[i] = (uint8_t)(i * 7 + 1);
  return f;
}

TS_TEST(roundtrip_rkey_frames_and_remote_shares) {
  tshare_frame f = sample_rkey(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.type, TSHARE_FRAME_RKEY);
  CHECK(g.u.rkey.alloc_id == 42 && g.u.rkey.address == 0x7f0000001000ull && g.u.rkey.length == 64u << 20);
  CHECK_EQ(g.u.rkey.key_len, TSHARE_RKEY_MAX);
  CHECK(memcmp(g.u.rkey.key, f.u.rkey.key, TSHARE_RKEY_MAX) == 0);
  CHECK(strcmp(tshare_frame_type_name(TSHARE_FRAME_RKEY), "rkey") == 0);

  f = sample_share();
  f.flags = 0;
  f.u.share.mem_kind = TSHARE_MEM_UCX_REMOTE;
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.share.mem_kind, TSHARE_MEM_UCX_REMOTE);
  f.u.share.handle_len = 8; /* the key travels in its own frame, never in the share */
  expect_encode_refused(&f, TSHARE_E_MALFORMED);
  f.u.share.handle_len = 0;
  f.u.share.device_type = TSHARE_DEVICE_CUDA; /* GPU bytes staged in host memory (TSHARE_CAP_UCX_STAGED) */
  CHECK_RC(decode(buf, encode(&f, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.share.device_type, TSHARE_DEVICE_CUDA);
  f.u.share.device_type = 3; /* no such device type */
  expect_encode_refused(&f, TSHARE_E_MALFORMED);

  tshare_frame r;
  memset(&r, 0, sizeof r);
  r.type = TSHARE_FRAME_RETIRE;
  r.u.retire.count = 1;
  r.u.retire.alloc_ids[0] = 42;
  r.u.retire.mem_kind = TSHARE_MEM_UCX_REMOTE;
  CHECK_RC(decode(buf, encode(&r, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.retire.mem_kind, TSHARE_MEM_UCX_REMOTE);
}

TS_TEST(malformed_rkey_frames) {
  tshare_frame f = sample_rkey(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  f.u.rkey.key_len = 0;
  expect_encode_refused(&f, TSHARE_E_TOO_LARGE);
  f.u.rkey.key_len = TSHARE_RKEY_MAX + 1;
  expect_encode_refused(&f, TSHARE_E_TOO_LARGE);
  f = sample_rkey();
  f.u.rkey.length = 0;
  expect_encode_refused(&f, TSHARE_E_TOO_LARGE);
  f.u.rkey.length = UINT64_MAX - 10; /* wraps past the end of the address space */
  expect_encode_refused(&f, TSHARE_E_TOO_LARGE);
  f = sample_rkey();
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  expect_encode_refused(&f, TSHARE_E_MALFORMED);

  /* The decoder's own checks, on bytes a peer could send: the key's length
   * is bounded before its bytes are read, and a region over max_alloc_size
   * (2^48 by default) is refused. */
  f = sample_rkey();
  size_t len = encode(&f, buf);
  uint8_t *key_len = buf + TSHARE_WIRE_HEADER_SIZE + 24;
  key_len[0] = (uint8_t)((TSHARE_RKEY_MAX + 1) & 0xff), key_len[1] = (uint8_t)((TSHARE_RKEY_MAX + 1) >> 8);
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_TOO_LARGE);
  key_len[0] = 0xff, key_len[1] = 0xff;
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_TOO_LARGE);
  key_len[0] = 0, key_len[1] = 0;
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_TOO_LARGE);
  len = encode(&f, buf);
  put_u32(buf + TSHARE_WIRE_HEADER_SIZE + 16 + 4, 1u << 17); /* length 2^49 */
  CHECK_EQ(decode(buf, len, &g), TSHARE_E_TOO_LARGE);
  len = encode(&f, buf);
  CHECK_EQ(decode(buf, len - 1, &g), TSHARE_AGAIN); /* a key cut short waits for its bytes */
  put_u32(buf + 8, (uint32_t)(len - TSHARE_WIRE_HEADER_SIZE - 1)); /* ... or, when the payload ends, is truncated */
  CHECK_EQ(decode(buf, len - 1, &g), TSHARE_E_TRUNCATED);

  /* Minor 6: remote memory in a set, CPU memory with no fd, handle or
   * share flags; anything else is refused. */
  tshare_frame m;
  memset(&m, 0, sizeof m);
  m.type = TSHARE_FRAME_SET;
  m.u.set.op = TSHARE_SET_MEM;
  m.u.set.set_id = 9;
  m.u.set.u.mem = (tshare_set_mem_frame){.index = 0, .alloc_id = 77, .mem_kind = TSHARE_MEM_UCX_REMOTE,
                                         .device_type = TSHARE_DEVICE_CPU, .alloc_size = 4096};
  len = encode(&m, buf);
  CHECK_RC(decode(buf, len, &g), TSHARE_OK, "");
  CHECK_EQ(g.u.set.u.mem.mem_kind, TSHARE_MEM_UCX_REMOTE);
  CHECK_EQ(g.u.set.u.mem.alloc_id, 77);
  CHECK_EQ(g.u.set.u.mem.alloc_size, 4096);
  CHECK_EQ(g.u.set.u.mem.share_flags, 0);
  tshare_frame bad = m;
  bad.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  expect_encode_refused(&bad, TSHARE_E_MALFORMED);
  tshare_frame staged = m; /* GPU bytes staged in host memory (TSHARE_CAP_UCX_STAGED) */
  staged.u.set.u.mem.device_type = TSHARE_DEVICE_CUDA;
  CHECK_RC(decode(buf, encode(&staged, buf), &g), TSHARE_OK, "");
  CHECK_EQ(g.u.set.u.mem.device_type, TSHARE_DEVICE_CUDA);
  bad = m;
  bad.u.set.u.mem.device_type = 3;
  expect_encode_refused(&bad, TSHARE_E_MALFORMED);
  bad = staged;
  bad.u.set.u.mem.handle_len = 8;
  expect_encode_refused(&bad, TSHARE_E_MALFORMED);
  bad = m;
  bad.u.set.u.mem.handle_len = 8;
  expect_encode_refused(&bad, TSHARE_E_MALFORMED);
  bad = m;
  bad.u.set.u.mem.share_flags = TSHARE_SHARE_FLAG_RETIRE_NOTICE;
  expect_encode_refused(&bad, TSHARE_E_MALFORMED);
}

/* The decoder writes a frame's header and its type's member only (a release's
 * or retire's ids up to their count), not the whole frame: what a caller's
 * frame held before, garbage included, must never show through. Each kind of
 * frame decoded into a frame full of 0xa5 bytes encodes back to the very
 * bytes it came from, and reads the same as one decoded into zeros. */
static void check_decodes_clean(const tshare_frame *f) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX], again[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(f, buf);
  static tshare_frame dirty, clean;
  memset(&dirty, 0xa5, sizeof dirty);
  memset(&clean, 0, sizeof clean);
  CHECK_RC(decode(buf, len, &dirty), TSHARE_OK, tshare_frame_type_name(f->type));
  CHECK_RC(decode(buf, len, &clean), TSHARE_OK, tshare_frame_type_name(f->type));
  CHECK_EQ(dirty.type, f->type);
  CHECK_EQ(dirty.flags, f->flags);
  size_t len2 = encode(&dirty, again);
  CHECK_EQ(len2, len);
  CHECK(memcmp(again, buf, len) == 0);
  CHECK_EQ(encode(&clean, again), len);
  CHECK(memcmp(again, buf, len) == 0);
  /* Byte for byte the same member (padding included): fields the wire
   * does not carry (a handle or tag past its length) read as zeros. */
  static const size_t member[] = {
      [TSHARE_FRAME_HELLO] = sizeof dirty.u.hello, [TSHARE_FRAME_SHARE] = sizeof dirty.u.share,
      [TSHARE_FRAME_EVENT] = sizeof dirty.u.event, [TSHARE_FRAME_BYE] = sizeof dirty.u.bye,
      [TSHARE_FRAME_ERROR] = sizeof dirty.u.error, [TSHARE_FRAME_RING] = sizeof dirty.u.ring,
      [TSHARE_FRAME_SET] = sizeof dirty.u.set,     [TSHARE_FRAME_RKEY] = sizeof dirty.u.rkey,
  };
  const void *a = &dirty.u, *b = &clean.u;
  size_t n = f->type < sizeof member / sizeof *member ? member[f->type] : 0;
  if (f->type == TSHARE_FRAME_RELEASE) /* the ids up to the count */
    n = offsetof(tshare_release_frame, share_ids) + dirty.u.release.count * sizeof(uint64_t);
  if (f->type == TSHARE_FRAME_RETIRE) {
    n = offsetof(tshare_retire_frame, alloc_ids) + dirty.u.retire.count * sizeof(uint64_t);
    CHECK_EQ(dirty.u.retire.mem_kind, clean.u.retire.mem_kind);
  }
  CHECK(n > 0 && memcmp(a, b, n) == 0);
}

static tshare_frame blank(uint8_t type) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = type;
  return f;
}

TS_TEST(decoding_into_a_used_frame_leaves_nothing_of_it) {
  tshare_frame f;
  check_decodes_clean((f = sample_share(), &f));
  f = sample_share(); /* a CUDA share: a handle, an event, a uuid, the minor-1 fields */
  f.flags = TSHARE_FRAME_FLAG_HAS_EVENT;
  f.u.share.mem_kind = TSHARE_MEM_CUDA_IPC;
  f.u.share.device_type = TSHARE_DEVICE_CUDA;
  f.u.share.handle_len = TSHARE_HANDLE_MAX;
  memset(f.u.share.handle, 0x3c, TSHARE_HANDLE_MAX);
  memset(f.u.share.device_uuid, 0x11, sizeof f.u.share.device_uuid);
  f.u.share.event_slot = 3;
  f.u.share.event_generation = 9;
  f.u.share.origin_pid = 77;
  check_decodes_clean(&f);

  f = blank(TSHARE_FRAME_HELLO);
  f.u.hello.pid = 5;
  strcpy(f.u.hello.name, "a");
  f.u.hello.device_count = 1;
  check_decodes_clean(&f);

  f = blank(TSHARE_FRAME_RELEASE);
  f.u.release.count = 3;
  for (uint32_t i = 0; i < 3; i++) f.u.release.share_ids[i] = 10 + i;
  check_decodes_clean(&f);

  f = blank(TSHARE_FRAME_RETIRE);
  f.u.retire.closed = TSHARE_RETIRE_KEPT;
  f.u.retire.count = 2;
  f.u.retire.alloc_ids[1] = 8;
  f.u.retire.mem_kind = TSHARE_MEM_HOST_MEMFD;
  check_decodes_clean(&f);
  f.u.retire.mem_kind = 0; /* CUDA memory: no trailing byte on the wire */
  check_decodes_clean(&f);

  f = blank(TSHARE_FRAME_EVENT);
  f.u.event.slot = 2;
  check_decodes_clean(&f);

  f = blank(TSHARE_FRAME_BYE);
  check_decodes_clean(&f);

  f = blank(TSHARE_FRAME_ERROR);
  f.u.error.code = TSHARE_E_LIMIT;
  strcpy(f.u.error.message, "x");
  check_decodes_clean(&f);

  f = blank(TSHARE_FRAME_RING);
  f.u.ring.op = TSHARE_RING_NUDGE;
  check_decodes_clean(&f);

  check_decodes_clean((f = set_begin(2, 1, 3, 0), &f));
  check_decodes_clean((f = set_member("ab", 2), &f));
  check_decodes_clean((f = set_mem(), &f));
  check_decodes_clean((f = sample_rkey(), &f));
}

TS_TEST(decoder_error_is_sticky) {
  tshare_frame f = sample_share(), g;
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = encode(&f, buf);
  tshare_decoder *d = tshare_decoder_create(NULL);
  uint8_t junk[TSHARE_WIRE_HEADER_SIZE] = {'n', 'o', 'p', 'e'};
  tshare_decoder_feed(d, junk, sizeof junk);
  CHECK_RC(tshare_decoder_next(d, &g), TSHARE_E_BAD_MAGIC, "");
  /* A valid frame after garbage is not trusted: framing is lost. */
  CHECK(tshare_decoder_feed(d, buf, len) == TSHARE_E_BAD_MAGIC);
  CHECK_RC(tshare_decoder_next(d, &g), TSHARE_E_BAD_MAGIC, "");
  CHECK(strstr(tshare_decoder_last_error(d), "magic") != NULL);
  tshare_decoder_destroy(d);
}

TS_TEST(status_strings_never_null) {
  for (int s = -40; s <= 5; s++) {
    CHECK(tshare_status_str(s) != NULL);
    CHECK(tshare_status_name(s) != NULL);
  }
  CHECK(strcmp(tshare_status_name(TSHARE_E_TIMEOUT), "TSHARE_E_TIMEOUT") == 0);
  CHECK(strcmp(tshare_status_str(12345), "unknown tshare status") == 0);
}

TS_TEST(dtype_itemsize_and_names) {
  char name[32];
  CHECK_EQ(tshare_dtype_itemsize((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}), 4);
  CHECK_EQ(tshare_dtype_itemsize((tshare_dtype){TSHARE_DTYPE_BFLOAT, 16, 1}), 2);
  CHECK_EQ(tshare_dtype_itemsize((tshare_dtype){TSHARE_DTYPE_COMPLEX, 128, 1}), 16);
  CHECK_EQ(tshare_dtype_itemsize((tshare_dtype){TSHARE_DTYPE_BOOL, 8, 1}), 1);
  CHECK_EQ(tshare_dtype_itemsize((tshare_dtype){TSHARE_DTYPE_INT, 8, 4}), 4);
  CHECK_EQ(tshare_dtype_itemsize((tshare_dtype){TSHARE_DTYPE_OPAQUE_HANDLE, 64, 1}), 0);
  CHECK_EQ(tshare_dtype_itemsize((tshare_dtype){TSHARE_DTYPE_BOOL, 1, 1}), 0);
  CHECK_EQ(tshare_dtype_itemsize((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 0}), 0);
  CHECK(strcmp(tshare_dtype_name((tshare_dtype){TSHARE_DTYPE_FLOAT, 16, 1}, name, sizeof name), "float16") == 0);
  CHECK(strcmp(tshare_dtype_name((tshare_dtype){TSHARE_DTYPE_BOOL, 8, 1}, name, sizeof name), "bool") == 0);
}

TS_TEST(contiguous_constructor) {
  const int64_t shape[3] = {2, 3, 4};
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 16, 1}, 3, shape, 6);
  CHECK_EQ(d.ndim, 3);
  CHECK_EQ(d.strides[0], 12);
  CHECK_EQ(d.strides[1], 4);
  CHECK_EQ(d.strides[2], 1);
  CHECK_EQ(d.byte_offset, 6);
  uint64_t b, e;
  CHECK_RC(tshare_tensor_check(&d, 54, &b, &e, NULL), TSHARE_OK, "");
  CHECK_EQ(e, 6 + 24 * 2);
  int64_t many[TSHARE_MAX_NDIM + 1];
  for (int i = 0; i <= TSHARE_MAX_NDIM; i++) many[i] = 1;
  d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 16, 1}, TSHARE_MAX_NDIM + 1, many, 0);
  CHECK_RC(tshare_tensor_check(&d, 1024, NULL, NULL, NULL), TSHARE_E_TOO_LARGE, "");
}

TS_TEST(empty_tensor_and_zero_strides) {
  tshare_tensor_desc t;
  memset(&t, 0, sizeof t);
  t.dtype = (tshare_dtype){TSHARE_DTYPE_INT, 64, 1};
  t.ndim = 2;
  t.shape[0] = 0;
  t.shape[1] = 1000000;
  t.strides[0] = 1000000;
  t.strides[1] = 1;
  t.byte_offset = 64;
  uint64_t b, e;
  tshare_error terr;
  CHECK_RC(tshare_tensor_check(&t, 64, &b, &e, &terr), TSHARE_OK, terr.message);
  CHECK_EQ(b, 64);
  CHECK_EQ(e, 64);
  /* A broadcast (stride 0) dimension touches one element however long it is. */
  t.shape[0] = 1000000;
  t.strides[0] = 0;
  t.shape[1] = 2;
  t.byte_offset = 0;
  CHECK_RC(tshare_tensor_check(&t, 16, &b, &e, &terr), TSHARE_OK, terr.message);
  CHECK_EQ(e, 16);
  /* A 0-d tensor is one element. */
  t.ndim = 0;
  t.byte_offset = 8;
  CHECK_RC(tshare_tensor_check(&t, 16, &b, &e, &terr), TSHARE_OK, terr.message);
  CHECK_RC(tshare_tensor_check(&t, 15, &b, &e, &terr), TSHARE_E_OUT_OF_BOUNDS, terr.message);
}

/* Extreme strides from a peer are refused without undefined behaviour (this
 * runs under UBSan in make asan): INT64_MIN and INT64_MAX in every position. */
TS_TEST(extreme_strides_are_refused_without_overflow) {
  const int64_t extremes[] = {INT64_MIN, INT64_MIN + 1, INT64_MIN / 2, INT64_MAX, INT64_MAX / 2 + 1};
  const uint8_t bits[] = {8, 16, 64};
  for (size_t b = 0; b < sizeof bits; b++)
    for (size_t i = 0; i < sizeof extremes / sizeof extremes[0]; i++)
      for (int64_t n = 2; n <= 3; n++) {
        tshare_tensor_desc t;
        memset(&t, 0, sizeof t);
        t.dtype = (tshare_dtype){TSHARE_DTYPE_UINT, bits[b], 1};
        t.ndim = 2;
        t.shape[0] = n;
        t.shape[1] = 2;
        t.strides[0] = extremes[i];
        t.strides[1] = 1;
        t.byte_offset = 1u << 20;
        tshare_error terr;
        int rc = tshare_tensor_check(&t, 2u << 20, NULL, NULL, &terr);
        if (rc != TSHARE_E_OUT_OF_BOUNDS && rc != TSHARE_E_OVERFLOW)
          TS_FAIL("stride %lld, shape %lld, %u bits: %s (%s)", (long long)extremes[i], (long long)n, bits[b],
                  tshare_status_name(rc), terr.message);
      }
}

TS_TEST_MAIN
