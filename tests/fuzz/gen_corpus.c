/* Writes the seed corpus: one valid frame of each type and a few streams.
 * Run: gen_corpus DIR (the committed tests/fuzz/corpus came from this);
 * gen_corpus --sets DIR writes fuzz_sets' seeds (tests/fuzz/corpus_sets). */
#include "fuzz_sets_ops.h"
#include "tshare/wire.h"

#include <stdio.h>
#include <string.h>

static void write_seed(const char *dir, const char *name, const tshare_frame *frames, int n, uint8_t chunk) {
  uint8_t buf[8 * TSHARE_WIRE_FRAME_MAX];
  size_t len = 0;
  buf[len++] = chunk; /* the fuzz target's first byte: feed size */
  for (int i = 0; i < n; i++) {
    size_t l;
    if (tshare_wire_encode(&frames[i], buf + len, sizeof buf - len, &l, NULL) != 0) {
      fprintf(stderr, "cannot encode %s\n", name);
      return;
    }
    len += l;
  }
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f) return;
  fwrite(buf, 1, len, f);
  fclose(f);
}

/* frame encoded with its first stride replaced by stride afterwards, found
 * by its 8 bytes (a stride of 1 right after shape[0] = 2). */
static void write_stride_seed(const char *dir, const char *name, const tshare_frame *frame, int64_t stride) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX + 1];
  size_t len;
  buf[0] = 7;
  if (tshare_wire_encode(frame, buf + 1, sizeof buf - 1, &len, NULL) != 0) return;
  const uint8_t pattern[16] = {2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0};
  for (size_t i = 1; i + 16 <= len + 1; i++)
    if (memcmp(buf + i, pattern, 16) == 0) {
      for (int b = 0; b < 8; b++) buf[i + 8 + (size_t)b] = (uint8_t)((uint64_t)stride >> (8 * b));
      break;
    }
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f) return;
  fwrite(buf, 1, len + 1, f);
  fclose(f);
}

static tshare_frame set_step(uint8_t op) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SET;
  f.u.set.op = op;
  f.u.set.set_id = 5;
  return f;
}

/* A whole tensor set (two tensors in one memfd, metadata), and a member with
 * the longest name and the most dimensions. */
static void write_set_seeds(const char *dir) {
  tshare_frame f[6];
  f[0] = set_step(TSHARE_SET_BEGIN);
  f[0].u.set.u.begin = (tshare_set_begin_frame){.count = 2, .mem_count = 1, .names_bytes = 13, .meta_bytes = 4};
  f[1] = set_step(TSHARE_SET_MEM);
  f[1].flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  f[1].u.set.u.mem = (tshare_set_mem_frame){.alloc_id = 9, .mem_kind = TSHARE_MEM_HOST_MEMFD,
                                      .device_type = TSHARE_DEVICE_CPU, .alloc_size = 1 << 16};
  for (int i = 0; i < 2; i++) {
    tshare_set_member_frame *m = &f[2 + i].u.set.u.member;
    f[2 + i] = set_step(TSHARE_SET_MEMBER);
    m->index = (uint32_t)i;
    m->name_len = (uint16_t)(i ? 6 : 7);
    memcpy(m->name, i ? "bias.0" : "weight0", m->name_len);
    m->tensor.dtype = (tshare_dtype){TSHARE_DTYPE_BFLOAT, 16, 1};
    m->tensor.ndim = 2;
    m->tensor.shape[0] = 16;
    m->tensor.shape[1] = 8;
    tshare_tensor_set_contiguous(&m->tensor);
    m->tensor.byte_offset = (uint64_t)i * 256;
  }
  f[4] = set_step(TSHARE_SET_META);
  f[4].u.set.u.meta.len = 4;
  memcpy(f[4].u.set.u.meta.bytes, "v=42", 4);
  f[5] = set_step(TSHARE_SET_END);
  write_seed(dir, "set_stream", f, 6, 9);
  tshare_set_member_frame *m = &f[2].u.set.u.member;
  m->name_len = TSHARE_SET_NAME_MAX;
  memset(m->name, 'n', TSHARE_SET_NAME_MAX);
  m->tensor.ndim = TSHARE_MAX_NDIM;
  for (int i = 0; i < TSHARE_MAX_NDIM; i++) m->tensor.shape[i] = i < 2 ? 2 : 1;
  tshare_tensor_set_contiguous(&m->tensor);
  write_seed(dir, "set_member_longest", f + 2, 1, 64);
}

/* ---- fuzz_sets: operation sequences ------------------------------------- */

static void write_ops(const char *dir, const char *name, const uint8_t *ops, size_t n) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (!f) return;
  fwrite(ops, 1, n, f);
  fclose(f);
}

#define OPS(dir, name, ...)                                                                                            \
  do {                                                                                                                 \
    const uint8_t ops_[] = {__VA_ARGS__};                                                                              \
    write_ops(dir, name, ops_, sizeof ops_);                                                                           \
  } while (0)

/* Set 1: two tensors ("w", "b") in one memory, 3 bytes of metadata, with the
 * second member's name, offset and the memory's fd as the seed varies them. */
static void write_set_ops(const char *dir, const char *name, uint8_t second_name, uint8_t second_offset,
                          uint8_t mem_how, uint8_t between) {
  uint8_t ops[64];
  size_t n = 0;
  const uint8_t head[] = {SET_OP_BEGIN, 0, 2, 1, 0, 1, SET_OP_MEM, 0, 0, mem_how, SET_OP_MEMBER, 0, 0, 0, 0, 0, 0};
  memcpy(ops, head, sizeof head);
  n = sizeof head;
  if (between != SET_OP_COUNT) ops[n++] = between, ops[n++] = 0; /* a share, or the peer's end, cutting in */
  const uint8_t tail[] = {SET_OP_MEMBER,   0, 1, 0, second_name, second_offset, 2, SET_OP_META, 0, 0, 2,
                          SET_OP_END,      0, SET_OP_RECV_SET,   SET_OP_RECV_VIEW};
  memcpy(ops + n, tail, sizeof tail);
  write_ops(dir, name, ops, n + sizeof tail);
}

static void write_sets_corpus(const char *dir) {
  write_set_ops(dir, "well_behaved_set", 1, 1, 0, SET_OP_COUNT);
  write_set_ops(dir, "duplicate_names", 4, 1, 0, SET_OP_COUNT);
  write_set_ops(dir, "tensor_past_its_memory", 1, 200, 0, SET_OP_COUNT);
  write_set_ops(dir, "memory_without_its_fd", 1, 1, 1, SET_OP_COUNT);
  write_set_ops(dir, "cuda_memory", 1, 1, 2, SET_OP_COUNT);
  write_set_ops(dir, "memfd_smaller_than_claimed", 1, 1, 8, SET_OP_COUNT);
  write_set_ops(dir, "cut_off_by_a_share", 1, 1, 0, SET_OP_SHARE);
  OPS(dir, "cut_off_by_another_set", SET_OP_BEGIN, 0, 1, 1, 0, 0, SET_OP_MEM, 0, 0, 0, SET_OP_BEGIN, 1, 1, 1, 0, 0,
      SET_OP_MEM, 1, 0, 0, SET_OP_MEMBER, 1, 0, 0, 0, 0, 0, SET_OP_END, 1, SET_OP_RECV_SET, SET_OP_RECV_SET);
  write_set_ops(dir, "longest_name_past_the_announced_names", 192, 1, 0, SET_OP_COUNT);
  write_set_ops(dir, "cut_off_by_the_peer_s_end", 1, 1, 0, SET_OP_PEER_EXIT);
  /* Set 1 of a memfd offered to be kept, its layout kept in slot 1; set 2
   * sent again from it, set 4 from a layout id the slot does not hold. */
  OPS(dir, "sent_again_from_a_kept_layout", SET_OP_BEGIN, 0, 1, 1, 4, 0, SET_OP_MEM, 0, 0, 16, SET_OP_MEMBER, 0, 0, 0, 0,
      0, 0, SET_OP_END, 0, SET_OP_RECV_SET, SET_OP_AGAIN, 1, 1, 0, 1, SET_OP_META, 1, 0, 2, SET_OP_END, 1,
      SET_OP_RECV_SET, SET_OP_AGAIN, 3, 1, 2, 0, SET_OP_END, 3, SET_OP_RECV_SET);
  /* DROPPED between the frames of a set (taken whole), then two the encoder
   * refuses (slot 5; a layout id other than the set's), which never go. */
  OPS(dir, "dropped_inside_a_set_and_refused_by_the_encoder", SET_OP_BEGIN, 0, 1, 1, 4, 0, SET_OP_MEM, 0, 0, 0,
      SET_OP_DROPPED, 2, 1, 3, SET_OP_MEMBER, 0, 0, 0, 0, 0, 0, SET_OP_END, 0, SET_OP_RECV_SET, SET_OP_DROPPED, 1, 5, 3,
      SET_OP_DROPPED, 1, 1, 6, SET_OP_RECV_SET);
  OPS(dir, "count_at_and_past_the_bound", SET_OP_BEGIN, 0, 0xC0, 1, 0xC0, 0, SET_OP_RECV_SET, SET_OP_BEGIN, 1, 0xC1, 1,
      0, 0, SET_OP_RECV_SET);
  OPS(dir, "frames_of_a_set_that_never_began", SET_OP_MEMBER, 3, 0, 0, 0, 0, 0, SET_OP_END, 3, SET_OP_RECV_SET);
  OPS(dir, "seven_memories_and_unclaimed_shares", SET_OP_SHARE, 1, SET_OP_SHARE, 2, SET_OP_SHARE, 3, SET_OP_BEGIN, 0, 7,
      7, 0, 0, SET_OP_MEM, 0, 0, 0, SET_OP_MEM, 0, 1, 0, SET_OP_MEM, 0, 2, 0, SET_OP_MEM, 0, 3, 0, SET_OP_MEM, 0, 4, 0,
      SET_OP_MEM, 0, 5, 0, SET_OP_MEM, 0, 6, 0, SET_OP_RECV_SET, SET_OP_RECV_VIEW);
  OPS(dir, "raw_bytes_in_a_set", SET_OP_BEGIN, 0, 1, 1, 0, 0, SET_OP_MEM, 0, 0, 0, SET_OP_RAW, 8, 'T', 'S', 'H', 'R', 1,
      3, 10, 0, SET_OP_RECV_SET);
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "--sets") == 0) {
    write_sets_corpus(argv[2]);
    return 0;
  }
  if (argc != 2) return 2;
  tshare_frame f[4];
  memset(f, 0, sizeof f);
  f[0].type = TSHARE_FRAME_HELLO;
  f[0].u.hello.pid = 100;
  strcpy(f[0].u.hello.name, "producer 0");
  f[0].u.hello.device_count = 1;
  write_seed(argv[1], "hello", f, 1, 16);
  memset(f, 0, sizeof f);
  for (int i = 0; i < 2; i++) {
    f[i].type = TSHARE_FRAME_SHARE;
    tshare_share_frame *s = &f[i].u.share;
    s->share_id = (uint64_t)i + 1;
    s->alloc_id = 9;
    s->alloc_size = 1 << 20;
    s->tensor.dtype = (tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1};
    s->tensor.ndim = 2;
    s->tensor.shape[0] = 16;
    s->tensor.shape[1] = 8;
    s->tensor.strides[0] = i ? 1 : 8;
    s->tensor.strides[1] = i ? 16 : 1;
    s->tensor.byte_offset = 4096;
    s->tag_len = 3;
    memcpy(s->tag, "abc", 3);
  }
  f[0].flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  f[0].u.share.mem_kind = TSHARE_MEM_HOST_MEMFD;
  f[0].u.share.device_type = TSHARE_DEVICE_CPU;
  f[1].flags = TSHARE_FRAME_FLAG_HAS_EVENT;
  f[1].u.share.mem_kind = TSHARE_MEM_CUDA_IPC;
  f[1].u.share.device_type = TSHARE_DEVICE_CUDA;
  f[1].u.share.handle_len = TSHARE_HANDLE_MAX;
  memset(f[1].u.share.handle, 0x42, TSHARE_HANDLE_MAX);
  f[2].type = TSHARE_FRAME_RELEASE;
  f[2].u.release.count = 2;
  f[2].u.release.share_ids[0] = 1;
  f[2].u.release.share_ids[1] = 2;
  f[3].type = TSHARE_FRAME_BYE;
  write_seed(argv[1], "share_host", f, 1, 5);
  write_seed(argv[1], "share_cuda", f + 1, 1, 200);
  write_seed(argv[1], "stream", f, 4, 3);
  /* Remote memory over UCX: an rkey frame, then a share naming it. */
  memset(f, 0, sizeof f);
  f[0].type = TSHARE_FRAME_RKEY;
  f[0].u.rkey.alloc_id = 9;
  f[0].u.rkey.address = 0x7f0000000000ull;
  f[0].u.rkey.length = 1 << 20;
  f[0].u.rkey.key_len = 48;
  memset(f[0].u.rkey.key, 0x5a, 48);
  f[1].type = TSHARE_FRAME_SHARE;
  f[1].u.share.share_id = 1;
  f[1].u.share.alloc_id = 9;
  f[1].u.share.mem_kind = TSHARE_MEM_UCX_REMOTE;
  f[1].u.share.device_type = TSHARE_DEVICE_CPU;
  f[1].u.share.alloc_size = 1 << 20;
  f[1].u.share.tensor.dtype = (tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1};
  f[1].u.share.tensor.ndim = 1;
  f[1].u.share.tensor.shape[0] = 1024;
  f[1].u.share.tensor.strides[0] = 1;
  write_seed(argv[1], "rkey_share", f, 2, 7);
  memset(f, 0, sizeof f);
  f[0].type = TSHARE_FRAME_ERROR;
  f[0].u.error.code = -7;
  strcpy(f[0].u.error.message, "version");
  write_seed(argv[1], "error", f, 1, 1);
  /* A uint8 share whose stride is INT64_MIN: rejected, and the check must get
   * there without negating it (the encoder refuses it, so it is written by hand). */
  memset(f, 0, sizeof f);
  f[0].type = TSHARE_FRAME_SHARE;
  tshare_share_frame *m = &f[0].u.share;
  m->share_id = 1;
  m->alloc_id = 1;
  m->mem_kind = TSHARE_MEM_CUDA_IPC;
  m->device_type = TSHARE_DEVICE_CUDA;
  m->handle_len = TSHARE_HANDLE_MAX;
  m->alloc_size = 4096;
  m->tensor.dtype = (tshare_dtype){TSHARE_DTYPE_UINT, 8, 1};
  m->tensor.ndim = 1;
  m->tensor.shape[0] = 2;
  m->tensor.strides[0] = 1;
  m->tensor.byte_offset = 1024;
  write_stride_seed(argv[1], "stride_int64_min", &f[0], INT64_MIN);
  write_set_seeds(argv[1]);
  return 0;
}
