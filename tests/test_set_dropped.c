/* A consumer that lost a set layout says so (TSHARE_SET_DROPPED), and the
 * producer stops sending sets again from it: the builder goes whole at its
 * next send, declares its layout anew, and goes again from that one. Tested:
 * what travels (a consumer speaking frames by hand drops the layout of a
 * declaring set and refuses an AGAIN, and counts BEGIN and AGAIN frames),
 * DROPPED frames a hostile consumer sends (malformed, or naming a layout the
 * slot does not hold) leaving the channel as it was, and a real consumer
 * that refused a declaring set (its fds over the process's limit) taking
 * every later set with the right data. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/hostmem.h"
#include "tshare/set.h"
#include "tshare/share.h"
#include "tshare/wire.h"

#include <sys/resource.h>

#define F32 ((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1})
enum { FLOATS = 256 };

/* ---- the producer: one builder, a member per buffer ------------------------- */

typedef struct weights {
  tshare_set_builder *b;
  tshare_host_buffer **bufs;
  int n;
} weights;

static float value_of(int round, int j, int i) { return (float)(round * 100000 + j * 1000 + i); }

static void make_weights(weights *w, int n) {
  w->n = n;
  w->b = tshare_set_builder_create();
  w->bufs = calloc((size_t)n, sizeof *w->bufs);
  CHECK(w->b && w->bufs);
  for (int j = 0; j < n; j++) {
    CHECK_RC(tshare_host_buffer_create(FLOATS * sizeof(float), "tshare-dropped", &w->bufs[j], NULL), TSHARE_OK, "");
    int64_t len = FLOATS;
    tshare_tensor_desc d = tshare_tensor_contiguous(F32, 1, &len, 0);
    char name[32];
    snprintf(name, sizeof name, "t%d", j);
    CHECK_RC(tshare_set_builder_add_host(w->b, name, w->bufs[j], &d, NULL), TSHARE_OK, name);
  }
}

static void drop_weights(weights *w) {
  tshare_set_builder_destroy(w->b);
  for (int j = 0; j < w->n; j++) tshare_host_buffer_destroy(w->bufs[j]);
  free(w->bufs);
}

/* The tensors updated in place for round, and the set sent and waited for. */
static void send_round(tshare_channel *ch, weights *w, int round) {
  for (int j = 0; j < w->n; j++) {
    float *p = tshare_host_buffer_data(w->bufs[j]);
    for (int i = 0; i < FLOATS; i++) p[i] = value_of(round, j, i);
  }
  CHECK_RC(tshare_set_builder_set_meta(w->b, &round, sizeof round, NULL), TSHARE_OK, "");
  uint64_t id;
  CHECK_RC(tshare_set_send(ch, w->b, NULL, 10000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
}

/* ---- a consumer speaking frames by hand ------------------------------------- */

static tshare_frame frame_of(int type) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = (uint8_t)type;
  return f;
}

static void send_frame(tshare_channel *ch, const tshare_frame *f) {
  CHECK_RC(tshare_channel_send_frame(ch, f, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
}

static tshare_frame dropped_frame(uint8_t slot, uint64_t layout_id) {
  tshare_frame f = frame_of(TSHARE_FRAME_SET);
  f.u.set.op = TSHARE_SET_DROPPED;
  f.u.set.set_id = layout_id;
  f.u.set.u.dropped = (tshare_set_dropped_frame){slot, layout_id};
  return f;
}

/* A DROPPED frame the encoder would not write: slot and layout id patched
 * into the bytes of a valid one of set_id, straight onto the socket. */
static void write_bad_dropped(int sock, uint64_t set_id, uint8_t slot, uint64_t layout_id) {
  tshare_frame f = dropped_frame(1, set_id);
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, NULL), TSHARE_OK, "");
  CHECK_EQ(len, (size_t)TSHARE_WIRE_HEADER_SIZE + 1 + 8 + 1 + 8);
  buf[TSHARE_WIRE_HEADER_SIZE + 9] = slot;
  for (int i = 0; i < 8; i++) buf[TSHARE_WIRE_HEADER_SIZE + 10 + i] = (uint8_t)(layout_id >> (8 * i));
  CHECK(write(sock, buf, len) == (ssize_t)len);
}

/* What the hand consumer saw of one set: its first frame's op, the slot it
 * names and, sent again, the layout. */
typedef struct seen {
  uint8_t op, slot;
  uint64_t id, layout_id;
} seen;

enum { BAD_ID = 7, BAD_FRAMES = 3 };

/* A release the producer sent back for a malformed frame. */
static void stray_release(int *strays, const tshare_frame *f) {
  for (uint32_t i = 0; i < f->u.release.count; i++)
    CHECK(f->u.release.share_ids[i] >= BAD_ID && f->u.release.share_ids[i] < BAD_ID + BAD_FRAMES);
  *strays += (int)f->u.release.count;
}

typedef struct hand {
  tshare_channel *ch;
  int sock;
  int strays; /* releases of the malformed frames' set ids (BAD_ID..), from the producer */
} hand;

/* The next set, read to its end; the memfds offered are said to be kept
 * (before the release: the producer reads that first). Stray releases
 * (answers to malformed frames) are counted. */
static seen take_set(hand *h) {
  seen s = {0, 0, 0, 0};
  for (;;) {
    tshare_frame f;
    int fd = -1;
    CHECK_RC(tshare_channel_recv_frame(h->ch, &f, &fd, 5000), TSHARE_OK, tshare_channel_last_error(h->ch));
    if (fd >= 0) close(fd);
    if (f.type == TSHARE_FRAME_RETIRE) continue;
    if (f.type == TSHARE_FRAME_RELEASE) {
      stray_release(&h->strays, &f);
      continue;
    }
    CHECK_EQ(f.type, TSHARE_FRAME_SET);
    const tshare_set_frame *sf = &f.u.set;
    if (sf->op == TSHARE_SET_BEGIN || sf->op == TSHARE_SET_AGAIN) {
      s.op = sf->op;
      s.id = sf->set_id;
      s.slot = sf->op == TSHARE_SET_BEGIN ? sf->u.begin.layout_slot : sf->u.again.layout_slot;
      s.layout_id = sf->op == TSHARE_SET_AGAIN ? sf->u.again.layout_id : 0;
    }
    CHECK_EQ(sf->set_id, s.id);
    if (sf->op == TSHARE_SET_MEM && sf->u.mem.mem_kind == TSHARE_MEM_HOST_MEMFD) {
      tshare_frame kept = frame_of(TSHARE_FRAME_RETIRE);
      kept.u.retire =
          (tshare_retire_frame){.closed = TSHARE_RETIRE_KEPT, .count = 1, .mem_kind = TSHARE_MEM_HOST_MEMFD};
      kept.u.retire.alloc_ids[0] = sf->u.mem.alloc_id;
      send_frame(h->ch, &kept);
    }
    if (sf->op == TSHARE_SET_END) return s;
  }
}

static void release(hand *h, uint64_t id) {
  tshare_frame rel = frame_of(TSHARE_FRAME_RELEASE);
  rel.u.release.count = 1;
  rel.u.release.share_ids[0] = id;
  send_frame(h->ch, &rel);
}

/* A whole set, in a slot: it declares its layout there. */
static seen expect_whole(hand *h) {
  seen s = take_set(h);
  if (s.op != TSHARE_SET_BEGIN) TS_FAIL("set %llu came sent again, not whole", (unsigned long long)s.id);
  CHECK(s.slot >= 1 && s.slot <= TSHARE_SET_LAYOUT_SLOTS);
  return s;
}

static seen expect_again(hand *h, const seen *from) {
  seen s = take_set(h);
  if (s.op != TSHARE_SET_AGAIN) TS_FAIL("set %llu came whole, not sent again", (unsigned long long)s.id);
  CHECK_EQ(s.slot, from->slot);
  CHECK_EQ(s.layout_id, from->id);
  return s;
}

/* Drops the layout of the declaring set, refuses an AGAIN, and sends
 * DROPPED frames the producer must ignore; each time the builder's next
 * set is checked to be whole or sent again, as it must be. */
static void consumer_that_drops(int fd) {
  hand h = {open_socket_only_channel(fd, "hand consumer"), fd, 0};
  seen first = expect_whole(&h);
  tshare_frame f = dropped_frame(first.slot, first.id); /* refused, say, before its end */
  send_frame(h.ch, &f);
  release(&h, first.id);
  seen second = expect_whole(&h); /* declared anew */
  CHECK_EQ(second.slot, first.slot);
  release(&h, second.id);
  seen s = expect_again(&h, &second);
  f = dropped_frame(s.slot, second.id); /* an AGAIN refused */
  send_frame(h.ch, &f);
  release(&h, s.id);
  seen third = expect_whole(&h);
  release(&h, third.id);
  s = expect_again(&h, &third);
  /* Layouts the slot does not hold: one of another id, one of another slot. */
  f = dropped_frame(third.slot, third.id + 1000);
  send_frame(h.ch, &f);
  f = dropped_frame((uint8_t)(third.slot % TSHARE_SET_LAYOUT_SLOTS + 1), third.id);
  send_frame(h.ch, &f);
  release(&h, s.id);
  s = expect_again(&h, &third);
  /* Malformed: slot 0, slot 5, layout id 0 (another than the set id). */
  write_bad_dropped(fd, BAD_ID, 0, BAD_ID);
  write_bad_dropped(fd, BAD_ID + 1, TSHARE_SET_LAYOUT_SLOTS + 1, BAD_ID + 1);
  write_bad_dropped(fd, BAD_ID + 2, third.slot, 0);
  release(&h, s.id);
  s = expect_again(&h, &third);
  release(&h, s.id);
  for (;;) { /* the bye, and the releases of the malformed frames before it */
    tshare_frame g;
    int gfd = -1;
    CHECK_RC(tshare_channel_recv_frame(h.ch, &g, &gfd, 5000), TSHARE_OK, tshare_channel_last_error(h.ch));
    if (g.type == TSHARE_FRAME_BYE) break;
    if (g.type == TSHARE_FRAME_RETIRE) { /* the weights the producer dropped just before its bye */
      if (gfd >= 0) close(gfd);
      continue;
    }
    CHECK_EQ(g.type, TSHARE_FRAME_RELEASE);
    stray_release(&h.strays, &g);
  }
  CHECK_EQ(h.strays, BAD_FRAMES); /* each malformed frame refused alone, as any malformed set frame */
  tshare_channel_close(h.ch);
}

TS_TEST(a_builder_whose_layout_the_consumer_dropped_goes_whole_next_then_again_from_its_new_layout) {
  int sock;
  pid_t pid = fork_with_socket(consumer_that_drops, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  weights w;
  make_weights(&w, 2);
  for (int round = 0; round < 7; round++) send_round(ch, &w, round);
  drop_weights(&w);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* ---- a real consumer that refused a declaring set --------------------------- */

enum { MANY = 80, LOW_FD_LIMIT = 48, ROUNDS = 4 };

static void expect_round(tshare_channel *ch, int round) {
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  size_t len = 0;
  const int *m = tshare_set_meta(s, &len);
  CHECK(len == sizeof round && *m == round);
  CHECK_EQ(tshare_set_count(s), MANY);
  for (int j = 0; j < MANY; j++) {
    const float *p = tshare_set_data(s, (size_t)j);
    for (int i = 0; i < FLOATS; i++)
      if (p[i] != value_of(round, j, i)) TS_FAIL("round %d: t%d[%d] is %g, expected %g", round, j, i, (double)p[i],
                                                 (double)value_of(round, j, i));
  }
  tshare_set_release(s);
}

/* Under an fd limit of 48 the first set (80 memfds) is refused before its
 * end; with the limit back, the buffers come as single shares and are kept
 * mapped, so the producer sends their memories as kept from then on. */
static void consumer_out_of_fds_once(int fd) {
  struct rlimit rl, low;
  CHECK(getrlimit(RLIMIT_NOFILE, &rl) == 0);
  if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < LOW_FD_LIMIT) TS_SKIP("hard fd limit %lu", rl.rlim_max);
  low = rl;
  low.rlim_cur = LOW_FD_LIMIT;
  CHECK(setrlimit(RLIMIT_NOFILE, &low) == 0);
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  tshare_set *s = NULL;
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_E_LIMIT, tshare_channel_last_error(ch));
  CHECK(strstr(tshare_channel_last_error(ch), "EMFILE"));
  CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
  for (int j = 0; j < MANY; j++) {
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, 10000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    tshare_view_release(v);
  }
  for (int round = 1; round < ROUNDS; round++) expect_round(ch, round);
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(after_a_declaring_set_was_refused_the_next_sets_of_its_builder_are_taken_with_the_right_data) {
  int sock;
  pid_t pid = fork_with_socket(consumer_out_of_fds_once, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  weights w;
  make_weights(&w, MANY);
  send_round(ch, &w, 0); /* refused: released back */
  for (int j = 0; j < MANY; j++) {
    int64_t len = FLOATS;
    tshare_tensor_desc d = tshare_tensor_contiguous(F32, 1, &len, 0);
    CHECK_RC(tshare_share_host(ch, w.bufs[j], &d, NULL, NULL, 5000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  }
  CHECK_RC(tshare_channel_wait_released(ch, 0, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  for (int round = 1; round < ROUNDS; round++) send_round(ch, &w, round);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  drop_weights(&w);
  tshare_channel_close(ch);
}

TS_TEST_MAIN
