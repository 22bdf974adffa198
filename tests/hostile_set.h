/* A hand-rolled producer of tensor sets: set frames written straight to the
 * socket (hostile_peer.h), right or wrong in one way, and what the consumer
 * side checks of a set it refuses. For tests built on a socket-only channel
 * at the producer's end (frames must not overtake the channel's own). */
#ifndef TSHARE_TEST_HOSTILE_SET_H
#define TSHARE_TEST_HOSTILE_SET_H

#include "hostile_peer.h"
#include "tshare/set.h"

#include <stdbool.h>
#include <sys/mman.h>

static inline tshare_frame set_step(uint8_t op, uint64_t set_id) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SET;
  f.u.set.op = op;
  f.u.set.set_id = set_id;
  return f;
}

static inline tshare_frame set_begin_frame(uint64_t id, uint32_t count, uint32_t mem_count, uint32_t names_bytes,
                                           uint32_t meta_bytes) {
  tshare_frame f = set_step(TSHARE_SET_BEGIN, id);
  f.u.set.u.begin = (tshare_set_begin_frame){
      .count = count, .mem_count = mem_count, .names_bytes = names_bytes, .meta_bytes = meta_bytes};
  return f;
}

/* A set of count tensors in one memory, names_bytes of names, no metadata. */
static inline void send_begin(tshare_channel *ch, uint64_t id, uint32_t count, uint32_t names_bytes) {
  tshare_frame f = set_begin_frame(id, count, 1, names_bytes, 0);
  send_raw(ch, &f, -1);
}

/* Memory `index` of set id: host memory with memfd attached, or (any other
 * kind) a CUDA handle of zeros. */
static inline void send_mem_at(tshare_channel *ch, uint64_t id, uint32_t index, int memfd, uint8_t kind) {
  tshare_frame f = set_step(TSHARE_SET_MEM, id);
  bool host = kind == TSHARE_MEM_HOST_MEMFD;
  f.flags = host ? TSHARE_FRAME_FLAG_FD_ATTACHED : 0;
  f.u.set.u.mem = (tshare_set_mem_frame){.index = index, .alloc_id = id * 100 + index, .mem_kind = kind,
                                         .alloc_size = 4096, .device_type = host ? TSHARE_DEVICE_CPU : TSHARE_DEVICE_CUDA,
                                         .handle_len = host ? 0 : TSHARE_HANDLE_MAX};
  send_raw(ch, &f, host ? memfd : -1);
}

static inline void send_mem(tshare_channel *ch, uint64_t id, int memfd, uint8_t kind) {
  send_mem_at(ch, id, 0, memfd, kind);
}

static inline tshare_frame set_member_frame(uint64_t id, uint32_t index, uint32_t mem_index, const char *name,
                                            const tshare_tensor_desc *desc) {
  tshare_frame f = set_step(TSHARE_SET_MEMBER, id);
  tshare_set_member_frame *m = &f.u.set.u.member;
  m->index = index;
  m->mem_index = mem_index;
  m->name_len = (uint16_t)strlen(name);
  memcpy(m->name, name, m->name_len);
  m->tensor = *desc;
  return f;
}

/* Tensor index of set id: 16 floats at offset in memory 0. */
static inline void send_member(tshare_channel *ch, uint64_t id, uint32_t index, const char *name, uint64_t offset) {
  int64_t n = 16;
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, &n, offset);
  tshare_frame f = set_member_frame(id, index, 0, name, &d);
  send_raw(ch, &f, -1);
}

static inline void send_meta(tshare_channel *ch, uint64_t id, uint32_t offset, const void *bytes, uint16_t len) {
  tshare_frame f = set_step(TSHARE_SET_META, id);
  f.u.set.u.meta.offset = offset;
  f.u.set.u.meta.len = len;
  memcpy(f.u.set.u.meta.bytes, bytes, len);
  send_raw(ch, &f, -1);
}

static inline void send_end(tshare_channel *ch, uint64_t id) {
  tshare_frame f = set_step(TSHARE_SET_END, id);
  send_raw(ch, &f, -1);
}

/* A frame the encoder would refuse: encoded right, then the first `len`
 * bytes equal to `find` overwritten with `with`, and written with fd. */
static inline void send_patched(tshare_channel *ch, const tshare_frame *f, int fd, const void *find, const void *with,
                                size_t len) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t n;
  CHECK_RC(tshare_wire_encode(f, buf, sizeof buf, &n, NULL), TSHARE_OK, "");
  uint8_t *at = memmem(buf, n, find, len);
  CHECK(at != NULL);
  memcpy(at, with, len);
  CHECK(send_with_fd(tshare_channel_fd(ch), buf, n, fd, 0) == (ssize_t)n);
}

/* A memfd of 4096 bytes, sealed against shrinking as the host backend asks. */
static inline int sealed_memfd(void) {
  int fd = memfd_create("tshare-evil", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  CHECK(fd >= 0 && ftruncate(fd, 4096) == 0 && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
  return fd;
}

/* Waits until the consumer released id back: a release of an id this end
 * never registered comes back as a protocol error naming it. */
static inline void wait_released_back(tshare_channel *ch, uint64_t id) {
  char want[64];
  snprintf(want, sizeof want, "released share %llu,", (unsigned long long)id);
  int64_t until = now_ms() + 10000;
  while (now_ms() < until)
    if (tshare_channel_poll(ch, 1000) == TSHARE_E_PROTOCOL && strstr(tshare_channel_last_error(ch), want)) return;
  TS_FAIL("share %llu was not released back", (unsigned long long)id);
}

/* The next set is refused with status want, the message naming cause. */
static inline void expect_refused(tshare_channel *ch, int want, const char *cause) {
  tshare_set *s = (tshare_set *)1;
  CHECK_RC(tshare_set_recv(ch, 5000, &s), want, tshare_channel_last_error(ch));
  CHECK(s == NULL);
  const char *msg = tshare_channel_last_error(ch);
  printf("%s\n", msg);
  if (!strstr(msg, cause)) TS_FAIL("'%s' does not say '%s'", msg, cause);
}

#endif
