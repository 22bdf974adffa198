/* Fuzz target: tensor sets assembled by a real channel from a hand-written
 * peer that the input drives, in this process, over a socketpair (the
 * socket transport). The peer sends set steps (BEGIN, MEM, MEMBER, META,
 * END, AGAIN from a layout the consumer may or may not keep, and DROPPED
 * naming a layout of the consumer's own sets, inside a set too) with
 * hostile values: ids that repeat or never began, memories and
 * tensors out of order or past the counts, names duplicated, long or not
 * UTF-8, tensors past their memory, metadata past its bound, memfds missing
 * or claimed larger than they are, CUDA memories; single shares and raw
 * bytes in between, and its end in the middle of a set. The consumer takes
 * whatever sets and shares come, as an application does.
 *
 * Besides crashes, sanitizer reports and hangs, it fails (abort) when:
 * - a set is handed out with a tensor whose bytes lie outside the memory
 *   the peer sent (every byte a tensor spans is read);
 * - a set's names are not unique, or find() does not find its own names;
 * - the channel says the peer closed while the peer's socket is open;
 * - an fd the peer sent is still open after the channel closed.
 *
 * Input: fuzz_sets_ops.h. */
#include "fd_util.h"
#include "frame_util.h"
#include "fuzz_input.h"
#include "fuzz_sets_ops.h"
#include "log.h"
#include "tshare/set.h"
#include "tshare/share.h"

#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#define PEER_MEMFD_NAME "tshare-fuzz-sets"
#define FD_BUDGET 8

typedef struct harness {
  int sock; /* the peer's end, non-blocking */
  int mem;  /* the peer's memfd: every fd it sends is this one */
  bool peer_gone;
  tshare_channel *ch;
} harness;

/* ---- the peer's side ------------------------------------------------------ */

/* Whole frames only: a frame the socket cannot take now is dropped, so the
 * stream stays frames (the raw operation alone breaks it). */
static void peer_send(harness *h, const void *buf, size_t len, int fd) {
  if (h->peer_gone || len == 0) return;
  ssize_t w = send_with_fd(h->sock, buf, len, fd, MSG_DONTWAIT);
  if (w <= 0 || (size_t)w == len) return;
  /* The rest, once the channel read some; a channel that no longer reads
   * (it ended) leaves the frame cut, as a raw operation may. */
  const uint8_t *rest = (const uint8_t *)buf + w;
  for (size_t left = len - (size_t)w, tries = 0; left > 0 && tries < 1000; tries++) {
    int rc = tshare_channel_poll(h->ch, 0);
    if (rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT) return;
    ssize_t r = send(h->sock, rest, left, MSG_DONTWAIT);
    if (r > 0) rest += r, left -= (size_t)r;
  }
}

static void peer_send_frame(harness *h, const tshare_frame *f, int fd) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len = 0;
  if (tshare_wire_encode(f, buf, sizeof buf, &len, NULL) == TSHARE_OK) peer_send(h, buf, len, fd);
}

/* What the channel wrote (its hello, releases, errors) is read and dropped. */
static void peer_read_socket(harness *h) {
  uint8_t buf[16384];
  while (!h->peer_gone && recv(h->sock, buf, sizeof buf, MSG_DONTWAIT) > 0) {
  }
}

static tshare_frame set_frame(uint8_t op, input *in) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SET;
  f.u.set.op = op;
  f.u.set.set_id = 1 + take(in) % SET_FUZZ_IDS;
  return f;
}

/* Small counts mostly, the bounds and just past them sometimes. */
static uint32_t count_of(uint8_t v, uint32_t bound) {
  switch (v >> 6) {
  case 3:
    return bound + (v & 1);
  default:
    return v % 8;
  }
}

static void op_begin(harness *h, input *in) {
  tshare_frame f = set_frame(TSHARE_SET_BEGIN, in);
  tshare_set_begin_frame *b = &f.u.set.u.begin;
  b->count = count_of(take(in), TSHARE_SET_MEMBERS_MAX);
  b->mem_count = count_of(take(in), b->count);
  uint8_t nb = take(in);
  b->names_bytes = nb >> 6 == 3 ? TSHARE_SET_NAMES_MAX : b->count * (1 + nb % 4);
  b->layout_slot = (uint8_t)((nb >> 2) % (TSHARE_SET_LAYOUT_SLOTS + 1));
  b->meta_bytes = count_of(take(in), TSHARE_SET_META_MAX) * 3;
  peer_send_frame(h, &f, -1);
}

static void op_mem(harness *h, input *in) {
  tshare_frame f = set_frame(TSHARE_SET_MEM, in);
  tshare_set_mem_frame *m = &f.u.set.u.mem;
  m->index = take(in) % 8;
  uint8_t how = take(in);
  static const uint64_t sizes[4] = {SET_FUZZ_MEM, SET_FUZZ_MEM / 2, 2 * SET_FUZZ_MEM, 0};
  m->alloc_id = f.u.set.set_id * 16 + m->index;
  m->alloc_size = sizes[(how >> 2) & 3];
  bool cuda = how & 2, kept = (how & 32) && !cuda, with_fd = !(how & 1) && !cuda && !kept;
  m->mem_kind = cuda ? TSHARE_MEM_CUDA_IPC : kept ? TSHARE_MEM_HOST_KEPT : TSHARE_MEM_HOST_MEMFD;
  if ((how & 16) && m->mem_kind == TSHARE_MEM_HOST_MEMFD) m->share_flags = TSHARE_SHARE_FLAG_RETIRE_NOTICE;
  m->device_type = cuda ? TSHARE_DEVICE_CUDA : TSHARE_DEVICE_CPU;
  m->handle_len = cuda ? TSHARE_HANDLE_MAX : 0;
  f.flags = cuda || kept ? 0 : (uint8_t)TSHARE_FRAME_FLAG_FD_ATTACHED;
  peer_send_frame(h, &f, with_fd ? h->mem : -1); /* without: the frame says an fd and none comes */
}

static void name_of(uint8_t pick, tshare_set_member_frame *m) {
  static const char *const names[] = {"w", "b", "model.layers.0.mlp.up_proj.weight", "\xc3\xa9t\xc3\xa9", "w"};
  if (pick >> 6 == 3) { /* the longest a name may be */
    m->name_len = TSHARE_SET_NAME_MAX;
    memset(m->name, 'a' + pick % 3, TSHARE_SET_NAME_MAX);
  } else {
    const char *n = names[pick % 5];
    m->name_len = (uint16_t)strlen(n);
    memcpy(m->name, n, m->name_len);
  }
  m->name[m->name_len] = '\0';
}

static void op_member(harness *h, input *in) {
  tshare_frame f = set_frame(TSHARE_SET_MEMBER, in);
  tshare_set_member_frame *m = &f.u.set.u.member;
  m->index = take(in) % 8;
  m->mem_index = take(in) % 4;
  name_of(take(in), m);
  uint64_t offset = (uint64_t)take(in) * 32; /* up to 8160: past the memory's end too */
  uint8_t shape = take(in);
  int64_t dims[2] = {1 + shape % 64, 1 + (shape >> 6)};
  m->tensor = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1 + (shape & 1), dims, offset);
  if (shape == 255) m->tensor.strides[0] = -1; /* reaches before the memory's start */
  peer_send_frame(h, &f, -1);
}

static void op_meta(harness *h, input *in) {
  tshare_frame f = set_frame(TSHARE_SET_META, in);
  f.u.set.u.meta.offset = take(in);
  f.u.set.u.meta.len = (uint16_t)(1 + take(in) % 16);
  memset(f.u.set.u.meta.bytes, 'm', f.u.set.u.meta.len);
  peer_send_frame(h, &f, -1);
}

/* A set sent again from a layout slot (kept by an earlier set of this
 * input, or never). */
static void op_again(harness *h, input *in) {
  tshare_frame f = set_frame(TSHARE_SET_AGAIN, in);
  f.u.set.u.again.layout_slot = (uint8_t)(take(in) % (TSHARE_SET_LAYOUT_SLOTS + 2));
  f.u.set.u.again.layout_id = 1 + take(in) % SET_FUZZ_IDS;
  f.u.set.u.again.meta_bytes = count_of(take(in), TSHARE_SET_META_MAX) * 3;
  peer_send_frame(h, &f, -1);
}

/* The peer lost a layout of the consumer's own sets (it sent none): never
 * refuses a set of the peer's, even between its frames. */
static void op_dropped(harness *h, input *in) {
  tshare_frame f = set_frame(TSHARE_SET_DROPPED, in);
  f.u.set.u.dropped.layout_slot = (uint8_t)(take(in) % (TSHARE_SET_LAYOUT_SLOTS + 2));
  uint8_t pick = take(in);
  f.u.set.u.dropped.layout_id = pick & 1 ? f.u.set.set_id : pick / 2;
  peer_send_frame(h, &f, -1);
}

static void op_share(harness *h, input *in) {
  int64_t n = 16;
  tshare_frame f = memfd_share_frame(SET_FUZZ_MEM, tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, &n, 0));
  f.u.share.share_id = 1 + take(in) % SET_FUZZ_IDS; /* the ids of sets too */
  f.u.share.alloc_id = 100 + f.u.share.share_id;
  peer_send_frame(h, &f, h->mem);
}

static void op_raw(harness *h, input *in) {
  uint8_t want = take(in), buf[256];
  size_t n = 0;
  while (n < want && in->n) buf[n++] = take(in);
  peer_send(h, buf, n, -1);
}

/* ---- the consumer's side -------------------------------------------------- */

static void check_rc(const harness *h, int rc) {
  if (rc == TSHARE_E_PEER_CLOSED && !h->peer_gone) abort(); /* a live peer blamed */
}

/* Every byte of every tensor read; names unique and found; views taken and
 * dropped after the handle: the set goes back with the last of them. */
static void use_set(tshare_set *s) {
  size_t n = tshare_set_count(s);
  for (size_t i = 0; i < n; i++) {
    const tshare_tensor_desc *d = tshare_set_desc(s, i);
    uint64_t begin = 0, end = 0;
    if (tshare_tensor_check(d, UINT64_MAX, &begin, &end, NULL) != TSHARE_OK || end > SET_FUZZ_MEM) abort();
    const volatile uint8_t *base = (const uint8_t *)tshare_set_data(s, i) - d->byte_offset;
    for (uint64_t b = begin; b < end && base; b++) (void)base[b];
    const char *name = tshare_set_name(s, i);
    if (!name || tshare_set_find(s, name) != (long)i) abort();
  }
  size_t len = 0;
  const volatile uint8_t *meta = tshare_set_meta(s, &len);
  for (size_t i = 0; i < len; i++) (void)meta[i];
  tshare_view *v = NULL;
  if (n && tshare_set_view(s, n - 1, &v) != TSHARE_OK) abort();
  tshare_set_release(s);
  tshare_view_release(v);
}

static void recv_set(harness *h) {
  tshare_set *s = NULL;
  int rc = tshare_set_recv(h->ch, 0, &s);
  check_rc(h, rc);
  if (rc == TSHARE_OK) use_set(s);
}

static void recv_view(harness *h) {
  tshare_view *v = NULL;
  int rc = tshare_view_recv(h->ch, 0, &v);
  check_rc(h, rc);
  if (rc != TSHARE_OK) return;
  const volatile uint8_t *data = tshare_view_data(v);
  if (data) (void)data[0];
  tshare_view_release(v);
}

/* ---- operations, setup and teardown ---------------------------------------- */

static void run_op(harness *h, input *in) {
  peer_read_socket(h);
  switch (take(in) % SET_OP_COUNT) {
  case SET_OP_BEGIN: op_begin(h, in); break;
  case SET_OP_MEM: op_mem(h, in); break;
  case SET_OP_MEMBER: op_member(h, in); break;
  case SET_OP_META: op_meta(h, in); break;
  case SET_OP_END: {
    tshare_frame f = set_frame(TSHARE_SET_END, in);
    peer_send_frame(h, &f, -1);
    break;
  }
  case SET_OP_SHARE: op_share(h, in); break;
  case SET_OP_RAW: op_raw(h, in); break;
  case SET_OP_RECV_SET: recv_set(h); break;
  case SET_OP_RECV_VIEW: recv_view(h); break;
  case SET_OP_AGAIN: op_again(h, in); break;
  case SET_OP_DROPPED: op_dropped(h, in); break;
  default: /* the peer hangs up; what it sent before is still taken */
    close(h->sock);
    h->peer_gone = true;
    in->n = 0;
    break;
  }
}

static void peer_hello(harness *h) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_HELLO;
  f.u.hello.major = TSHARE_WIRE_MAJOR;
  f.u.hello.minor = TSHARE_WIRE_MINOR;
  f.u.hello.pid = (uint32_t)getpid();
  f.u.hello.uid = (uint32_t)getuid();
  f.u.hello.capabilities = TSHARE_CAP_FD_PASSING | TSHARE_CAP_HOST_MEMFD | TSHARE_CAP_TENSOR_SETS |
                           TSHARE_CAP_HOST_KEPT | TSHARE_CAP_SET_HOST_KEPT | TSHARE_CAP_SET_AGAIN;
  snprintf(f.u.hello.name, sizeof f.u.hello.name, "fuzz set peer");
  peer_send_frame(h, &f, -1);
}

static tshare_channel *channel_open(int sock) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "fuzzed set consumer";
  o.transport = TSHARE_TRANSPORT_SOCKET;
  o.max_unclaimed_fds = FD_BUDGET;
  o.handshake_timeout_ms = 5000;
  tshare_channel *ch = NULL;
  tshare_error err;
  if (tshare_channel_open_socket(sock, &o, &ch, &err) != TSHARE_OK) abort(); /* the peer's hello is valid */
  return ch;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  atomic_store(&ts_log_level, -1); /* below warn: refusals would be logged thousands of times a second */
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) abort();
  if (fcntl(sv[1], F_SETFL, O_NONBLOCK) != 0) abort();
  harness h;
  memset(&h, 0, sizeof h);
  h.sock = sv[1];
  h.mem = memfd_create(PEER_MEMFD_NAME, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (h.mem < 0 || ftruncate(h.mem, SET_FUZZ_MEM) != 0 || fcntl(h.mem, F_ADD_SEALS, F_SEAL_SHRINK) != 0) abort();
  peer_hello(&h);
  h.ch = channel_open(sv[0]);
  input in = {data, size};
  while (in.n) run_op(&h, &in);
  for (int i = 0; i < 64; i++) { /* what is left: taken as an application would, until nothing comes */
    recv_set(&h);
    recv_view(&h);
  }
  tshare_channel_close(h.ch);
  if (!h.peer_gone) close(h.sock);
  close(h.mem);
  if (count_memfds_named(PEER_MEMFD_NAME) != 0) abort(); /* the channel kept an fd the peer sent */
  return 0;
}
