/* Kept host mappings in tensor sets: the weight-sync loop. A set's memfd is
 * offered to be kept as a share's is; the consumer keeps it once it took the
 * set whole and says so, and the next set naming that buffer carries a
 * memory frame of TSHARE_MEM_HOST_KEPT: no fd, no new mapping, the
 * producer's in-place updates seen. Each half is tested against a peer that
 * speaks frames by hand, so what travels is seen and what a lying peer
 * sends is refused, the set released back and the channel still usable. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/hostmem.h"
#include "tshare/set.h"
#include "tshare/share.h"
#include "tshare/wire.h"

#include <sys/mman.h>

#define F32 ((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1})
enum { FLOATS = 1024, MEMS = 2, ROUNDS = 3, ALLOC_A = 70, ALLOC_B = 71 };

static tshare_tensor_desc floats(int64_t n, uint64_t byte_offset) {
  return tshare_tensor_contiguous(F32, 1, &n, byte_offset);
}

static void fill(float *p, float v) {
  for (int i = 0; i < FLOATS; i++) p[i] = v + (float)i;
}

static void check_filled(const float *p, float v) {
  for (int i = 0; i < FLOATS; i++)
    if (p[i] != v + (float)i) TS_FAIL("element %d is %g, expected %g", i, (double)p[i], (double)(v + (float)i));
}

static void send_frame(tshare_channel *ch, const tshare_frame *f, int fd) {
  CHECK_RC(tshare_channel_send_frame(ch, f, fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
}

static tshare_frame frame_of(int type) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = (uint8_t)type;
  return f;
}

static tshare_frame retire_frame(uint8_t closed, uint64_t alloc_id) {
  tshare_frame f = frame_of(TSHARE_FRAME_RETIRE);
  f.u.retire.closed = closed;
  f.u.retire.mem_kind = TSHARE_MEM_HOST_MEMFD;
  f.u.retire.count = 1;
  f.u.retire.alloc_ids[0] = alloc_id;
  return f;
}

static tshare_frame release_frame(uint64_t share_id) {
  tshare_frame f = frame_of(TSHARE_FRAME_RELEASE);
  f.u.release.count = 1;
  f.u.release.share_ids[0] = share_id;
  return f;
}

static tshare_frame set_step(uint8_t op, uint64_t set_id) {
  tshare_frame f = frame_of(TSHARE_FRAME_SET);
  f.u.set.op = op;
  f.u.set.set_id = set_id;
  return f;
}

/* ---- the producer half, against a consumer speaking frames by hand ------- */

/* What one set brought: its id, and each memory's frame and fd (-1: none). */
typedef struct raw_set {
  uint64_t id;
  tshare_set_mem_frame mems[MEMS];
  int fds[MEMS];
} raw_set;

/* The frames of one set, up to its end; retire frames between them fail. */
static raw_set read_set(tshare_channel *ch) {
  raw_set s;
  memset(&s, 0, sizeof s);
  for (;;) {
    tshare_frame f;
    int fd = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    if (f.type != TSHARE_FRAME_SET) TS_FAIL("a %s frame inside a set", tshare_frame_type_name(f.type));
    s.id = f.u.set.set_id;
    if (f.u.set.op == TSHARE_SET_MEM) {
      CHECK(f.u.set.u.mem.index < MEMS);
      s.mems[f.u.set.u.mem.index] = f.u.set.u.mem;
      s.fds[f.u.set.u.mem.index] = fd;
    }
    if (f.u.set.op == TSHARE_SET_END) return s;
  }
}

/* Round 0 maps both memfds and says it keeps them; rounds 1.. come with no
 * fd, kept, and show the producer's in-place update of each round. */
static void hand_consumer_of_weights(int fd) {
  setenv("TSHARE_SET_AGAIN", "0", 1); /* the memory frames themselves, not a set sent again as one frame */
  tshare_channel *ch = open_socket_channel(fd, "hand consumer", NULL, NULL);
  float *maps[MEMS];
  uint64_t allocs[MEMS], sizes[MEMS];
  for (int round = 0; round < ROUNDS; round++) {
    raw_set s = read_set(ch);
    for (int m = 0; m < MEMS; m++) {
      if (round == 0) {
        CHECK_EQ(s.mems[m].mem_kind, TSHARE_MEM_HOST_MEMFD);
        CHECK(s.fds[m] >= 0);
        CHECK_EQ(s.mems[m].share_flags, TSHARE_SHARE_FLAG_RETIRE_NOTICE); /* offered to be kept */
        maps[m] = mmap(NULL, s.mems[m].alloc_size, PROT_READ, MAP_SHARED, s.fds[m], 0);
        CHECK(maps[m] != MAP_FAILED);
        close(s.fds[m]);
        allocs[m] = s.mems[m].alloc_id;
        sizes[m] = s.mems[m].alloc_size;
        tshare_frame kept = retire_frame(TSHARE_RETIRE_KEPT, allocs[m]);
        send_frame(ch, &kept, -1); /* before the release: the producer reads it first */
      } else {
        CHECK_EQ(s.mems[m].mem_kind, TSHARE_MEM_HOST_KEPT); /* the frame alone */
        CHECK_EQ(s.fds[m], -1);
        CHECK_EQ(s.mems[m].alloc_id, allocs[m]);
        CHECK_EQ(s.mems[m].share_flags, 0);
      }
      check_filled(maps[m], (float)(100 * round + m));
    }
    tshare_frame rel = release_frame(s.id);
    send_frame(ch, &rel, -1);
  }
  /* The producer destroyed its buffers: both are retired. */
  bool retired[MEMS] = {false, false};
  for (int n = 0; n < MEMS;) {
    tshare_frame f;
    int none = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &none, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(f.type, TSHARE_FRAME_RETIRE);
    CHECK_EQ(f.u.retire.closed, TSHARE_RETIRE_FREED);
    for (uint32_t i = 0; i < f.u.retire.count; i++)
      for (int m = 0; m < MEMS; m++)
        if (f.u.retire.alloc_ids[i] == allocs[m] && !retired[m]) retired[m] = true, n++;
  }
  for (int m = 0; m < MEMS; m++) munmap(maps[m], sizes[m]);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(a_set_sent_again_names_the_kept_buffers_without_fds_and_shows_updates_in_place) {
  int sock;
  pid_t pid = fork_with_socket(hand_consumer_of_weights, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer *bufs[MEMS];
  tshare_set_builder *b = tshare_set_builder_create();
  for (int m = 0; m < MEMS; m++) {
    CHECK_RC(tshare_host_buffer_create(FLOATS * sizeof(float) * 2, "tshare-kept-set", &bufs[m], NULL), TSHARE_OK,
             "");
    tshare_tensor_desc d = floats(FLOATS, 0);
    char name[32];
    snprintf(name, sizeof name, "layer%d.weight", m);
    CHECK_RC(tshare_set_builder_add_host(b, name, bufs[m], &d, NULL), TSHARE_OK, "");
  }
  tshare_tensor_desc bias = floats(16, FLOATS * sizeof(float)); /* a second tensor in memory 0 */
  CHECK_RC(tshare_set_builder_add_host(b, "layer0.bias", bufs[0], &bias, NULL), TSHARE_OK, "");
  for (int round = 0; round < ROUNDS; round++) {
    for (int m = 0; m < MEMS; m++) fill(tshare_host_buffer_data(bufs[m]), (float)(100 * round + m));
    uint64_t id;
    CHECK_RC(tshare_set_send(ch, b, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_RC(tshare_channel_wait_released(ch, id, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  tshare_set_builder_destroy(b);
  for (int m = 0; m < MEMS; m++) tshare_host_buffer_destroy(bufs[m]);
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch)); /* the retires went first */
  CHECK_EQ(count_mappings("memfd:tshare-kept-set"), 0);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* ---- the consumer half, against a producer speaking frames by hand ------- */

/* Set id of one tensor of FLOATS floats in one memory (alloc_id, alloc_size,
 * of kind; a memfd comes with memfd and share_flags). */
static void send_set(tshare_channel *ch, uint64_t id, uint64_t alloc_id, uint64_t alloc_size, int kind, int memfd,
                     uint32_t share_flags, int64_t count) {
  tshare_frame f = set_step(TSHARE_SET_BEGIN, id);
  f.u.set.u.begin = (tshare_set_begin_frame){.count = 1, .mem_count = 1, .names_bytes = 1, .meta_bytes = 0};
  send_frame(ch, &f, -1);
  f = set_step(TSHARE_SET_MEM, id);
  bool with_fd = kind == TSHARE_MEM_HOST_MEMFD;
  f.flags = with_fd ? TSHARE_FRAME_FLAG_FD_ATTACHED : 0;
  f.u.set.u.mem = (tshare_set_mem_frame){.index = 0, .alloc_id = alloc_id, .mem_kind = (uint8_t)kind,
                                         .device_type = TSHARE_DEVICE_CPU, .alloc_size = alloc_size,
                                         .share_flags = share_flags};
  send_frame(ch, &f, with_fd ? memfd : -1);
  f = set_step(TSHARE_SET_MEMBER, id);
  f.u.set.u.member.name_len = 1;
  f.u.set.u.member.name[0] = 'w';
  f.u.set.u.member.tensor = floats(count, 0);
  send_frame(ch, &f, -1);
  f = set_step(TSHARE_SET_END, id);
  send_frame(ch, &f, -1);
}

/* The consumer's answers to set id: its release and, when it keeps
 * something, a KEPT notice naming *kept_alloc (0: none came). */
static void collect_release(tshare_channel *ch, uint64_t id, uint64_t *kept_alloc) {
  *kept_alloc = 0;
  for (bool released = false; !released;) {
    tshare_frame f;
    int fd = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(fd, -1);
    if (f.type == TSHARE_FRAME_RETIRE) {
      CHECK_EQ(f.u.retire.closed, TSHARE_RETIRE_KEPT);
      CHECK_EQ(f.u.retire.count, 1);
      *kept_alloc = f.u.retire.alloc_ids[0];
      continue;
    }
    CHECK_EQ(f.type, TSHARE_FRAME_RELEASE);
    CHECK_EQ(f.u.release.count, 1);
    CHECK_EQ(f.u.release.share_ids[0], id);
    released = true;
  }
}

static void expect_refused(tshare_channel *ch, int status, const char *cause) {
  tshare_set *s = NULL;
  CHECK_RC(tshare_set_recv(ch, 5000, &s), status, tshare_channel_last_error(ch));
  CHECK(s == NULL);
  const char *msg = tshare_channel_last_error(ch);
  printf("%s\n", msg);
  if (!strstr(msg, cause)) TS_FAIL("'%s' does not say '%s'", msg, cause);
}

static void *expect_set(tshare_channel *ch, uint64_t id, float first) {
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 5000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_set_id(s), id);
  void *data = tshare_set_data(s, 0);
  check_filled(data, first);
  tshare_set_release(s);
  return data;
}

/* Sets 1 (offered) and 2 (kept): the same mapping, updated in place; then
 * the refusals the hand producer provokes, the channel going on each time. */
static void consumer_of_hand_sets(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  void *first = expect_set(ch, 1, 1000);
  CHECK_EQ(count_mappings("memfd:tshare-hand-set"), 1); /* kept while idle */
  int fds = count_open_fds();
  void *again = expect_set(ch, 2, 2000);
  CHECK(again == first); /* no new mapping */
  CHECK_EQ(count_open_fds(), fds);
  expect_refused(ch, TSHARE_E_PROTOCOL, "keeps no mapping");      /* 3: memory never mapped here */
  expect_refused(ch, TSHARE_E_PROTOCOL, "was mapped with");       /* 4: the wrong size */
  expect_refused(ch, TSHARE_E_PROTOCOL, "keeps no mapping");      /* 5: after its retire */
  expect_refused(ch, TSHARE_E_OUT_OF_BOUNDS, "tensor 0 ('w')");   /* 6: offered, but the set is wrong */
  expect_refused(ch, TSHARE_E_PROTOCOL, "keeps no mapping");      /* 7: so nothing of 6 was kept */
  CHECK_EQ(count_mappings("memfd:tshare-hand-set"), 0);           /* the retired one went */
  expect_set(ch, 8, 8000);                                        /* the channel goes on */
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_view_share_id(v), 9);
  tshare_view_release(v);
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(a_consumer_keeps_a_sets_memfd_and_refuses_kept_memory_it_does_not_keep) {
  int sock;
  pid_t pid = fork_with_socket(consumer_of_hand_sets, &sock);
  tshare_channel *ch = open_socket_only_channel(sock, "hand producer");
  tshare_host_buffer *buf, *other;
  CHECK_RC(tshare_host_buffer_create(FLOATS * sizeof(float), "tshare-hand-set", &buf, NULL), TSHARE_OK, "");
  CHECK_RC(tshare_host_buffer_create(FLOATS * sizeof(float), "tshare-hand-other", &other, NULL), TSHARE_OK, "");
  uint64_t size = tshare_host_buffer_size(buf), kept;
  fill(tshare_host_buffer_data(buf), 1000);
  send_set(ch, 1, ALLOC_A, size, TSHARE_MEM_HOST_MEMFD, tshare_host_buffer_fd(buf), TSHARE_SHARE_FLAG_RETIRE_NOTICE,
           FLOATS);
  collect_release(ch, 1, &kept);
  if (kept == 0) { /* the notice may follow the release */
    tshare_frame g;
    int none = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &g, &none, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(g.type, TSHARE_FRAME_RETIRE);
    CHECK_EQ(g.u.retire.closed, TSHARE_RETIRE_KEPT);
    kept = g.u.retire.alloc_ids[0];
  }
  CHECK_EQ(kept, ALLOC_A);
  fill(tshare_host_buffer_data(buf), 2000); /* updated in place */
  send_set(ch, 2, ALLOC_A, size, TSHARE_MEM_HOST_KEPT, -1, 0, FLOATS);
  collect_release(ch, 2, &kept);
  send_set(ch, 3, ALLOC_B, size, TSHARE_MEM_HOST_KEPT, -1, 0, FLOATS);
  collect_release(ch, 3, &kept);
  send_set(ch, 4, ALLOC_A, size * 2, TSHARE_MEM_HOST_KEPT, -1, 0, FLOATS);
  collect_release(ch, 4, &kept);
  tshare_frame freed = retire_frame(TSHARE_RETIRE_FREED, ALLOC_A);
  send_frame(ch, &freed, -1);
  send_set(ch, 5, ALLOC_A, size, TSHARE_MEM_HOST_KEPT, -1, 0, FLOATS);
  collect_release(ch, 5, &kept);
  send_set(ch, 6, ALLOC_B, size, TSHARE_MEM_HOST_MEMFD, tshare_host_buffer_fd(other),
           TSHARE_SHARE_FLAG_RETIRE_NOTICE, FLOATS * 2);
  collect_release(ch, 6, &kept);
  CHECK_EQ(kept, 0); /* a refused set keeps nothing */
  send_set(ch, 7, ALLOC_B, size, TSHARE_MEM_HOST_KEPT, -1, 0, FLOATS);
  collect_release(ch, 7, &kept);
  fill(tshare_host_buffer_data(other), 8000);
  send_set(ch, 8, ALLOC_B, size, TSHARE_MEM_HOST_MEMFD, tshare_host_buffer_fd(other), 0, FLOATS);
  collect_release(ch, 8, &kept);
  tshare_frame share = frame_of(TSHARE_FRAME_SHARE);
  share.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  share.u.share = (tshare_share_frame){.share_id = 9, .alloc_id = ALLOC_B, .mem_kind = TSHARE_MEM_HOST_MEMFD,
                                       .device_type = TSHARE_DEVICE_CPU, .alloc_size = size,
                                       .tensor = floats(16, 0)};
  send_frame(ch, &share, tshare_host_buffer_fd(other));
  collect_release(ch, 9, &kept);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_host_buffer_destroy(buf);
  tshare_host_buffer_destroy(other);
  tshare_channel_close(ch);
}

TS_TEST_MAIN
