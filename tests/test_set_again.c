/* A set sent again is one frame: the weight-sync loop, where the same
 * builder is sent again and again with its buffers updated in place. The
 * consumer keeps the layout of a set it took (members, names, memories) in
 * one of TSHARE_SET_LAYOUT_SLOTS slots; the producer then sends the set as
 * TSHARE_SET_AGAIN, its metadata and its end. Tested: what travels (a
 * consumer speaking frames by hand counts them and checks each AGAIN names
 * the layout its slot holds), what arrives (a real consumer checks names,
 * data and metadata of every set), a builder changed or new, LRU slots,
 * the refusals a lying producer provokes, and a peer of wire 1.5. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/hostmem.h"
#include "tshare/set.h"
#include "tshare/share.h"
#include "tshare/wire.h"

#include <pthread.h>
#include <sched.h>

#define F32 ((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1})
enum { FLOATS = 256, BUILDERS = 5, SENT_AGAIN = 50, MEMBERS_MAX = 8 };

/* ---- the producer's scenario, against either consumer -------------------- */

/* Builder k: two buffers, nmem members "b<k>.t<j>" of FLOATS floats, member
 * j in buffer j % 2 at slot j / 2; the metadata says who and which round. */
typedef struct weights {
  tshare_set_builder *b;
  tshare_host_buffer *bufs[2];
  int nmem;
} weights;

typedef struct meta {
  int builder, round, nmem;
} meta;

static float value_of(int k, int round, int j, int i) { return (float)(round * 1000 + k * 100 + j * 10) + (float)i; }

static void add_member(weights *w, int k) {
  int j = w->nmem++;
  int64_t n = FLOATS;
  tshare_tensor_desc d = tshare_tensor_contiguous(F32, 1, &n, (uint64_t)(j / 2) * FLOATS * sizeof(float));
  char name[32];
  snprintf(name, sizeof name, "b%d.t%d", k, j);
  CHECK_RC(tshare_set_builder_add_host(w->b, name, w->bufs[j % 2], &d, NULL), TSHARE_OK, name);
}

static void make_weights(weights *w, int k, int nmem) {
  memset(w, 0, sizeof *w);
  w->b = tshare_set_builder_create();
  for (int m = 0; m < 2; m++)
    CHECK_RC(tshare_host_buffer_create(MEMBERS_MAX / 2 * FLOATS * sizeof(float), "tshare-again", &w->bufs[m], NULL),
             TSHARE_OK, "");
  for (int j = 0; j < nmem; j++) add_member(w, k);
}

static void drop_weights(weights *w) {
  tshare_set_builder_destroy(w->b);
  for (int m = 0; m < 2; m++) tshare_host_buffer_destroy(w->bufs[m]);
}

/* Update builder k's tensors in place for round, and send its set. */
static void send_round(tshare_channel *ch, weights *w, int k, int round) {
  for (int j = 0; j < w->nmem; j++) {
    float *p = (float *)tshare_host_buffer_data(w->bufs[j % 2]) + (j / 2) * FLOATS;
    for (int i = 0; i < FLOATS; i++) p[i] = value_of(k, round, j, i);
  }
  meta m = {k, round, w->nmem};
  CHECK_RC(tshare_set_builder_set_meta(w->b, &m, sizeof m, NULL), TSHARE_OK, "");
  /* The stream it was written on, set before each send as the Python
   * package does: the same stream changes nothing, and the set goes again. */
  tshare_set_builder_set_stream(w->b, NULL);
  uint64_t id;
  CHECK_RC(tshare_set_send(ch, w->b, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, id, 5000), TSHARE_OK, tshare_channel_last_error(ch));
}

/* Sets sent whole and sent again by the scenario below. */
enum { SETS_WHOLE = 15, SETS_AGAIN = 72 };

static void run_scenario(tshare_channel *ch) {
  weights w[BUILDERS];
  make_weights(&w[0], 0, 3);
  int round = 0;
  for (int n = 0; n < SENT_AGAIN; n++) send_round(ch, &w[0], 0, round++); /* 1 whole, 49 again */
  add_member(&w[0], 0);                                                      /* changed: whole once more */
  for (int n = 0; n < 3; n++) send_round(ch, &w[0], 0, round++);           /* 1 whole, 2 again */
  make_weights(&w[1], 1, 2);
  for (int n = 0; n < 4; n++) { /* two builders, two slots: 1 whole, 7 again */
    send_round(ch, &w[0], 0, round++);
    send_round(ch, &w[1], 1, round++);
  }
  for (int k = 2; k < BUILDERS; k++) make_weights(&w[k], k, k + 1);
  /* Five builders, four slots: builder 0, used between each of the others,
   * is never the least recently used; the others evict one another (b1
   * again once, then b2..b4 and every later one whole: 12 + 1 again, 11 whole). */
  for (int r = 0; r < 3; r++)
    for (int k = 1; k < BUILDERS; k++) {
      send_round(ch, &w[0], 0, round++);
      send_round(ch, &w[k], k, round++);
    }
  /* A builder and its buffers gone, new ones made in their place: never
   * served from the old layout (1 whole, 1 again). */
  drop_weights(&w[4]);
  make_weights(&w[4], 4, 5);
  for (int n = 0; n < 2; n++) send_round(ch, &w[4], 4, round++);
  for (int k = 0; k < BUILDERS; k++) drop_weights(&w[k]);
}

/* ---- a consumer speaking frames by hand: what travels --------------------- */

static void send_frame(tshare_channel *ch, const tshare_frame *f, int fd) {
  CHECK_RC(tshare_channel_send_frame(ch, f, fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
}

static tshare_frame frame_of(int type) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = (uint8_t)type;
  return f;
}

static tshare_frame set_step(uint8_t op, uint64_t set_id) {
  tshare_frame f = frame_of(TSHARE_FRAME_SET);
  f.u.set.op = op;
  f.u.set.set_id = set_id;
  return f;
}

static tshare_frame release_frame(uint64_t id) {
  tshare_frame f = frame_of(TSHARE_FRAME_RELEASE);
  f.u.release.count = 1;
  f.u.release.share_ids[0] = id;
  return f;
}

static tshare_frame kept_frame(uint64_t alloc_id) {
  tshare_frame f = frame_of(TSHARE_FRAME_RETIRE);
  f.u.retire.closed = TSHARE_RETIRE_KEPT;
  f.u.retire.mem_kind = TSHARE_MEM_HOST_MEMFD;
  f.u.retire.count = 1;
  f.u.retire.alloc_ids[0] = alloc_id;
  return f;
}

/* The consumer as the producer sees it: it keeps every memfd offered, and
 * the layout of every whole set in the slot its begin frame names. Every
 * set sent again must name the layout its slot holds, and be three frames. */
static void hand_consumer(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "hand consumer", NULL, NULL);
  uint64_t slots[TSHARE_SET_LAYOUT_SLOTS] = {0};
  int whole = 0, again = 0;
  for (;;) {
    tshare_frame f;
    int mem_fd = -1;
    int rc = tshare_channel_recv_frame(ch, &f, &mem_fd, 5000);
    CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(ch));
    if (f.type == TSHARE_FRAME_BYE) break;
    if (f.type == TSHARE_FRAME_RETIRE) continue; /* buffers retired: their ids are not used again */
    CHECK_EQ(f.type, TSHARE_FRAME_SET);
    uint64_t id = f.u.set.set_id;
    unsigned slot = 0, frames = 1;
    if (f.u.set.op == TSHARE_SET_AGAIN) {
      slot = f.u.set.u.again.layout_slot;
      CHECK(slot >= 1 && slot <= TSHARE_SET_LAYOUT_SLOTS);
      CHECK_EQ(f.u.set.u.again.layout_id, slots[slot - 1]);
      CHECK_EQ(f.u.set.u.again.meta_bytes, sizeof(meta));
      again++;
    } else {
      CHECK_EQ(f.u.set.op, TSHARE_SET_BEGIN);
      slot = f.u.set.u.begin.layout_slot;
      CHECK(slot >= 1 && slot <= TSHARE_SET_LAYOUT_SLOTS); /* every memory here is kept: always offered */
      whole++;
    }
    while (f.u.set.op != TSHARE_SET_END) {
      CHECK_RC(tshare_channel_recv_frame(ch, &f, &mem_fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
      CHECK_EQ(f.type, TSHARE_FRAME_SET);
      CHECK_EQ(f.u.set.set_id, id);
      frames++;
      if (mem_fd >= 0) close(mem_fd);
      mem_fd = -1;
      if (f.u.set.op == TSHARE_SET_MEM && f.u.set.u.mem.mem_kind == TSHARE_MEM_HOST_MEMFD) {
        CHECK_EQ(f.u.set.u.mem.share_flags, TSHARE_SHARE_FLAG_RETIRE_NOTICE);
        tshare_frame kept = kept_frame(f.u.set.u.mem.alloc_id);
        send_frame(ch, &kept, -1); /* before the release: the producer reads it first */
      }
    }
    if (slots[slot - 1] != id && frames > 3) slots[slot - 1] = id; /* a whole set declared it */
    else CHECK_EQ(frames, 3);                                      /* again: its metadata and end only */
    tshare_frame rel = release_frame(id);
    send_frame(ch, &rel, -1);
  }
  printf("%d sets whole, %d sent again\n", whole, again);
  CHECK_EQ(whole, SETS_WHOLE);
  CHECK_EQ(again, SETS_AGAIN);
  tshare_channel_close(ch);
}

/* run_scenario against consumer (in a child, over a socket), after check
 * (optional) looked at the open channel; then the bye and the child's exit. */
static void scenario_against(void (*consumer)(int), void (*check)(tshare_channel *)) {
  int sock;
  pid_t pid = fork_with_socket(consumer, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  if (check) check(ch);
  run_scenario(ch);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

static void check_no_again(tshare_channel *ch) { CHECK(!(tshare_channel_peer(ch)->capabilities & TSHARE_CAP_SET_AGAIN)); }

TS_TEST(a_set_sent_again_travels_as_its_again_metadata_and_end_frames_naming_the_layout_its_slot_holds) {
  scenario_against(hand_consumer, NULL);
}

/* ---- a real consumer: what arrives ----------------------------------------- */

static void check_set(tshare_set *s) {
  size_t len = 0;
  const meta *m = tshare_set_meta(s, &len);
  CHECK_EQ(len, sizeof *m);
  CHECK_EQ(tshare_set_count(s), (size_t)m->nmem);
  for (int j = 0; j < m->nmem; j++) {
    char name[32];
    snprintf(name, sizeof name, "b%d.t%d", m->builder, j);
    if (strcmp(tshare_set_name(s, (size_t)j), name) != 0)
      TS_FAIL("tensor %d is '%s', expected '%s'", j, tshare_set_name(s, (size_t)j), name);
    CHECK_EQ(tshare_set_find(s, name), j);
    CHECK_EQ(tshare_set_desc(s, (size_t)j)->shape[0], FLOATS);
    const float *p = tshare_set_data(s, (size_t)j);
    for (int i = 0; i < FLOATS; i++)
      if (p[i] != value_of(m->builder, m->round, j, i))
        TS_FAIL("set of builder %d round %d: %s[%d] is %g, expected %g", m->builder, m->round, name, i, (double)p[i],
                (double)value_of(m->builder, m->round, j, i));
  }
  CHECK_EQ(tshare_set_find(s, "b9.t0"), -1);
}

static int expected_sets = SETS_WHOLE + SETS_AGAIN; /* what real_consumer counts, set before the fork */
static bool scenario_counts = true;                   /* and whether they are run_scenario's whole and again */

/* Each set sent whole gets a layout id of its own (kept where sets go
 * again, 0 where they do not); each set sent again has the id of its
 * builder's last set. */
typedef struct layouts_seen {
  uint64_t last_of[BUILDERS];
  int whole, again;
} layouts_seen;

static void check_layout(layouts_seen *seen, const tshare_set *s, bool kept) {
  const meta *m = tshare_set_meta(s, NULL);
  uint64_t id = tshare_set_layout(s);
  if (!kept) {
    CHECK_EQ(id, 0);
    return;
  }
  CHECK(id != 0);
  bool known = false;
  for (int k = 0; k < BUILDERS; k++) known |= seen->last_of[k] == id;
  if (known && seen->last_of[m->builder] != id)
    TS_FAIL("set of builder %d round %d has the layout of another builder's set", m->builder, m->round);
  if (known) seen->again++;
  else seen->whole++;
  seen->last_of[m->builder] = id;
}

static void real_consumer(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  /* Kept where both ends offered sets sent again (this end does not with
   * TSHARE_SET_AGAIN=0). */
  const char *again = getenv("TSHARE_SET_AGAIN");
  bool kept = (tshare_channel_peer(ch)->capabilities & TSHARE_CAP_SET_AGAIN) != 0 && !(again && strcmp(again, "0") == 0);
  layouts_seen seen = {{0}, 0, 0};
  int sets = 0;
  CHECK_EQ(tshare_set_layout(NULL), 0);
  for (;;) {
    tshare_set *s;
    int rc = tshare_set_recv(ch, 5000, &s);
    if (rc == TSHARE_END) break;
    CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(ch));
    check_set(s);
    check_layout(&seen, s, kept);
    tshare_view *v; /* a view keeps its set after the handle goes */
    CHECK_RC(tshare_set_view(s, 0, &v), TSHARE_OK, "");
    tshare_set_release(s);
    tshare_view_release(v);
    sets++;
  }
  CHECK_EQ(sets, expected_sets);
  if (kept && scenario_counts) {
    CHECK_EQ(seen.whole, SETS_WHOLE);
    CHECK_EQ(seen.again, SETS_AGAIN);
  }
  tshare_channel_close(ch);
}

TS_TEST(sets_sent_again_arrive_with_the_right_names_data_and_metadata_each_time) {
  scenario_against(real_consumer, NULL);
}

static void *release_set(void *set) {
  tshare_set_release(set);
  return NULL;
}

/* Each set released on a thread of its own while this one receives the
 * next: a set sent again and its layout share their catalog across threads
 * (TSan, in CI, watches the counts). */
static void consumer_releasing_on_threads(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  int sets = 0;
  pthread_t releaser;
  bool releasing = false;
  for (;;) {
    tshare_set *s;
    int rc = tshare_set_recv(ch, 5000, &s);
    if (releasing) CHECK(pthread_join(releaser, NULL) == 0);
    releasing = false;
    if (rc == TSHARE_END) break;
    CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(ch));
    check_set(s);
    CHECK(pthread_create(&releaser, NULL, release_set, s) == 0);
    releasing = true;
    sets++;
  }
  CHECK_EQ(sets, expected_sets);
  tshare_channel_close(ch);
}

TS_TEST(sets_sent_again_released_on_other_threads_arrive_right) {
  scenario_against(consumer_releasing_on_threads, NULL);
}

/* The same with the switch off in the consumer: every set travels whole. */
static void consumer_without_again(int fd) {
  setenv("TSHARE_SET_AGAIN", "0", 1);
  real_consumer(fd);
}

TS_TEST(with_TSHARE_SET_AGAIN_0_every_set_travels_whole_and_arrives_right) {
  scenario_against(consumer_without_again, check_no_again);
}

/* ---- the caller's work while a receive would wait ---------------------------- */

/* The consumer asks for each set by a byte on this pipe (made before the
 * fork), so it knows when none can have come. */
static int ask_pipe[2];

typedef struct idle_work {
  tshare_channel *ch;
  int calls;
  bool close_from_a_thread;
} idle_work;

static void *close_channel(void *ch) {
  tshare_channel_close(ch);
  return NULL;
}

/* Counts its calls; the last one has another thread close the channel (and
 * waits for that close to return) while the receive is inside its call. */
static void before_wait(void *arg) {
  idle_work *w = arg;
  w->calls++;
  if (!w->close_from_a_thread) return;
  pthread_t t;
  CHECK(pthread_create(&t, NULL, close_channel, w->ch) == 0);
  CHECK(pthread_join(t, NULL) == 0);
}

static void idle_consumer(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  idle_work w = {ch, 0, false};
  tshare_set *s = NULL;
  CHECK_RC(tshare_set_recv_idle(ch, 0, NULL, NULL, &s), TSHARE_E_INVALID_ARG, "");
  CHECK_RC(tshare_set_recv_idle(ch, 0, before_wait, &w, NULL), TSHARE_E_INVALID_ARG, "");
  CHECK_RC(tshare_set_recv_idle(NULL, 0, before_wait, &w, &s), TSHARE_E_INVALID_ARG, "");
  /* Nothing asked for yet: a poll does the work and times out. */
  CHECK_RC(tshare_set_recv_idle(ch, 0, before_wait, &w, &s), TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
  CHECK(s == NULL && w.calls == 1);
  for (int round = 0; round < 3; round++) {
    CHECK(write(ask_pipe[1], "n", 1) == 1);
    CHECK_RC(tshare_set_recv_idle(ch, 5000, before_wait, &w, &s), TSHARE_OK, tshare_channel_last_error(ch));
    check_set(s);
    CHECK(w.calls >= 1 && w.calls <= 2 + round); /* once per call at most: where the set had not come yet */
    tshare_set_release(s);
  }
  /* Closed from another thread while the call does the caller's work: the
   * close waits for the call, which returns TSHARE_E_STATE saying so. */
  w.close_from_a_thread = true;
  int calls = w.calls;
  CHECK_RC(tshare_set_recv_idle(ch, 5000, before_wait, &w, &s), TSHARE_E_STATE, "closed while it waited");
  CHECK(s == NULL && w.calls == calls + 1);
  CHECK(strstr(tshare_channel_last_error(ch), "closed") != NULL); /* read by the pointer: the handle is gone */
  close(ask_pipe[1]);
}

TS_TEST(a_receive_does_the_callers_work_where_it_would_wait_and_a_close_meanwhile_waits_for_it) {
  CHECK(pipe(ask_pipe) == 0);
  int sock;
  pid_t pid = fork_with_socket(idle_consumer, &sock);
  close(ask_pipe[1]);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  weights w;
  make_weights(&w, 0, 3);
  char asked;
  for (int round = 0; read(ask_pipe[0], &asked, 1) == 1; round++) send_round(ch, &w, 0, round);
  close(ask_pipe[0]);
  CHECK_CHILD_OK(pid);
  drop_weights(&w);
  tshare_channel_close(ch);
}

/* ---- threads and fork ------------------------------------------------------ */

enum { THREAD_SENDS = 40 };

typedef struct sender {
  tshare_channel *ch;
  weights *w;
} sender;

/* Sends w's set THREAD_SENDS times, each waited for, taking turns with
 * another thread on the channel (a call refused as busy is tried again). */
static void *send_repeatedly(void *arg) {
  sender *s = arg;
  for (int n = 0; n < THREAD_SENDS; n++) {
    uint64_t id = 0;
    int rc;
    while ((rc = tshare_set_send(s->ch, s->w->b, NULL, 5000, &id)) == TSHARE_E_BUSY) sched_yield();
    CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(s->ch));
    while ((rc = tshare_channel_wait_released(s->ch, id, 5000)) == TSHARE_E_BUSY) sched_yield();
    CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(s->ch));
  }
  return NULL;
}

static void two_threads_send(tshare_channel *ch, weights *a, weights *b) {
  sender sa = {ch, a}, sb = {ch, b};
  pthread_t ta, tb;
  CHECK_EQ(pthread_create(&ta, NULL, send_repeatedly, &sa), 0);
  CHECK_EQ(pthread_create(&tb, NULL, send_repeatedly, &sb), 0);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
}

/* Each builder's tensors hold its round 0, its metadata says so. */
static void fill_round_0(weights *w, int k) {
  for (int j = 0; j < w->nmem; j++) {
    float *p = (float *)tshare_host_buffer_data(w->bufs[j % 2]) + (j / 2) * FLOATS;
    for (int i = 0; i < FLOATS; i++) p[i] = value_of(k, 0, j, i);
  }
  meta m = {k, 0, w->nmem};
  CHECK_RC(tshare_set_builder_set_meta(w->b, &m, sizeof m, NULL), TSHARE_OK, "");
}

TS_TEST(two_threads_sending_two_builders_or_one_on_a_channel_get_their_own_sets) {
  expected_sets = 4 * THREAD_SENDS;
  scenario_counts = false;
  int sock;
  pid_t pid = fork_with_socket(real_consumer, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  weights w[2];
  for (int k = 0; k < 2; k++) {
    make_weights(&w[k], k, 2 + k);
    fill_round_0(&w[k], k);
  }
  two_threads_send(ch, &w[0], &w[1]);
  two_threads_send(ch, &w[1], &w[1]);
  for (int k = 0; k < 2; k++) drop_weights(&w[k]);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* One builder sent to two consumers at once, again and again: each channel
 * keeps its own slots, each consumer gets every round right. */
TS_TEST(a_set_sent_again_to_two_consumers_at_once_arrives_right_at_both) {
  enum { ROUNDS = 12 };
  expected_sets = ROUNDS;
  scenario_counts = false;
  int socks[2];
  pid_t pids[2];
  tshare_channel *chs[2];
  for (int c = 0; c < 2; c++) {
    pids[c] = fork_with_socket(real_consumer, &socks[c]);
    chs[c] = open_socket_channel(socks[c], "producer", NULL, NULL);
  }
  weights w;
  make_weights(&w, 0, 5);
  for (int round = 0; round < ROUNDS; round++) {
    for (int j = 0; j < w.nmem; j++) {
      float *p = (float *)tshare_host_buffer_data(w.bufs[j % 2]) + (j / 2) * FLOATS;
      for (int i = 0; i < FLOATS; i++) p[i] = value_of(0, round, j, i);
    }
    meta m = {0, round, w.nmem};
    CHECK_RC(tshare_set_builder_set_meta(w.b, &m, sizeof m, NULL), TSHARE_OK, "");
    uint64_t ids[2];
    tshare_error results[2];
    CHECK_RC(tshare_set_send_all(w.b, chs, 2, NULL, 5000, ids, results), TSHARE_OK, results[0].message);
    CHECK_RC(tshare_set_wait_all(chs, ids, 2, 5000, results), TSHARE_OK, results[0].message);
  }
  drop_weights(&w);
  for (int c = 0; c < 2; c++) {
    CHECK_RC(tshare_channel_send_bye(chs[c], 0, 5000), TSHARE_OK, tshare_channel_last_error(chs[c]));
    CHECK_CHILD_OK(pids[c]);
    tshare_channel_close(chs[c]);
  }
}

static tshare_channel *forked_from;
static weights *forked_weights;

/* A child of the producer holds a copy of the channel and its slots: it may
 * not send on it, sent again or not. */
static void child_of_producer(int unused) {
  (void)unused;
  CHECK_RC(tshare_set_send(forked_from, forked_weights->b, NULL, 1000, NULL), TSHARE_E_STATE, "");
}

TS_TEST(a_forked_child_of_the_producer_cannot_send_from_its_parents_slots) {
  expected_sets = 4;
  scenario_counts = false;
  int sock;
  pid_t consumer = fork_with_socket(real_consumer, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  weights w;
  make_weights(&w, 0, 3);
  send_round(ch, &w, 0, 0);
  send_round(ch, &w, 0, 1); /* its layout is kept now */
  forked_from = ch;
  forked_weights = &w;
  CHECK_CHILD_OK(fork_child(child_of_producer, 0));
  send_round(ch, &w, 0, 2); /* the parent goes on, again from its layout */
  send_round(ch, &w, 0, 3);
  drop_weights(&w);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(consumer);
  tshare_channel_close(ch);
}

/* ---- a producer speaking frames by hand: what is refused ------------------ */

enum { ALLOC = 90 };

/* A set of one tensor "w" of FLOATS floats in memfd (allocation alloc;
 * offered to be kept with TSHARE_SHARE_FLAG_RETIRE_NOTICE in share_flags),
 * its layout to be kept in slot. */
static void send_whole(tshare_channel *ch, uint64_t id, int memfd, uint64_t alloc, uint8_t slot,
                       uint32_t share_flags) {
  tshare_frame f = set_step(TSHARE_SET_BEGIN, id);
  f.u.set.u.begin = (tshare_set_begin_frame){.count = 1, .mem_count = 1, .names_bytes = 1, .layout_slot = slot};
  send_frame(ch, &f, -1);
  f = set_step(TSHARE_SET_MEM, id);
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  f.u.set.u.mem = (tshare_set_mem_frame){.alloc_id = alloc, .mem_kind = TSHARE_MEM_HOST_MEMFD,
                                         .device_type = TSHARE_DEVICE_CPU, .alloc_size = FLOATS * sizeof(float),
                                         .share_flags = share_flags};
  send_frame(ch, &f, memfd);
  f = set_step(TSHARE_SET_MEMBER, id);
  f.u.set.u.member.name_len = 1;
  f.u.set.u.member.name[0] = 'w';
  int64_t n = FLOATS;
  f.u.set.u.member.tensor = tshare_tensor_contiguous(F32, 1, &n, 0);
  send_frame(ch, &f, -1);
  f = set_step(TSHARE_SET_END, id);
  send_frame(ch, &f, -1);
}

/* AGAIN, one metadata byte (the round) and the end, as frames. */
static void send_again(tshare_channel *ch, uint64_t id, uint8_t slot, uint64_t layout_id, uint8_t round) {
  tshare_frame f = set_step(TSHARE_SET_AGAIN, id);
  f.u.set.u.again = (tshare_set_again_frame){slot, layout_id, 1};
  send_frame(ch, &f, -1);
  f = set_step(TSHARE_SET_META, id);
  f.u.set.u.meta.len = 1;
  f.u.set.u.meta.bytes[0] = round;
  send_frame(ch, &f, -1);
  f = set_step(TSHARE_SET_END, id);
  send_frame(ch, &f, -1);
}

/* An AGAIN frame the encoder would not write: its slot and metadata size
 * patched into the bytes of a valid one, straight onto the socket. */
static void send_bad_again(int sock, uint64_t id, uint8_t slot, uint32_t meta_bytes) {
  tshare_frame f = set_step(TSHARE_SET_AGAIN, id);
  f.u.set.u.again = (tshare_set_again_frame){1, 1, 0};
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, NULL), TSHARE_OK, "");
  CHECK_EQ(len, (size_t)TSHARE_WIRE_HEADER_SIZE + 1 + 8 + 1 + 8 + 4);
  buf[TSHARE_WIRE_HEADER_SIZE + 9] = slot;
  for (int i = 0; i < 4; i++) buf[TSHARE_WIRE_HEADER_SIZE + 18 + i] = (uint8_t)(meta_bytes >> (8 * i));
  CHECK(write(sock, buf, len) == (ssize_t)len);
  tshare_frame end = set_step(TSHARE_SET_END, id); /* the rest of a refused set is dropped */
  CHECK_RC(tshare_wire_encode(&end, buf, sizeof buf, &len, NULL), TSHARE_OK, "");
  CHECK(write(sock, buf, len) == (ssize_t)len);
}

/* The consumer's answers to set id: its release, after any KEPT notice
 * and, when dropped_id is not 0, after the notice that it lost the layout
 * dropped_id of slot dropped_slot (TSHARE_SET_DROPPED); none otherwise. */
static void collect_dropped_and_release(tshare_channel *ch, uint64_t id, uint8_t dropped_slot, uint64_t dropped_id) {
  bool dropped = false;
  for (;;) {
    tshare_frame f;
    int fd = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(fd, -1);
    if (f.type == TSHARE_FRAME_RETIRE) continue;
    if (f.type == TSHARE_FRAME_SET) {
      CHECK_EQ(f.u.set.op, TSHARE_SET_DROPPED);
      CHECK(!dropped && dropped_id != 0);
      CHECK_EQ(f.u.set.u.dropped.layout_slot, dropped_slot);
      CHECK_EQ(f.u.set.u.dropped.layout_id, dropped_id);
      CHECK_EQ(f.u.set.set_id, dropped_id);
      dropped = true;
      continue;
    }
    CHECK_EQ(f.type, TSHARE_FRAME_RELEASE);
    CHECK_EQ(f.u.release.share_ids[0], id);
    CHECK_EQ(dropped, dropped_id != 0);
    return;
  }
}

static void collect_release(tshare_channel *ch, uint64_t id) { collect_dropped_and_release(ch, id, 0, 0); }

static void expect_refused(tshare_channel *ch, int status, const char *cause) {
  tshare_set *s = NULL;
  CHECK_RC(tshare_set_recv(ch, 5000, &s), status, tshare_channel_last_error(ch));
  CHECK(s == NULL);
  const char *msg = tshare_channel_last_error(ch);
  printf("%s\n", msg);
  if (!strstr(msg, cause)) TS_FAIL("'%s' does not say '%s'", msg, cause);
}

static void expect_round(tshare_channel *ch, uint64_t id, float first, int round) {
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 5000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_set_id(s), id);
  CHECK_EQ(tshare_set_count(s), 1);
  CHECK(strcmp(tshare_set_name(s, 0), "w") == 0);
  CHECK_EQ(((const float *)tshare_set_data(s, 0))[FLOATS - 1], first + FLOATS - 1);
  CHECK_EQ(((const float *)tshare_set_data(s, 0))[0], first);
  size_t len;
  const uint8_t *m = tshare_set_meta(s, &len);
  if (round >= 0) CHECK(len == 1 && m[0] == round);
  tshare_set_release(s);
}

/* The producer's bye: nothing more comes; the channel closed. */
static void expect_bye(tshare_channel *ch) {
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 5000, &s), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void consumer_of_hand_sets(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  expect_round(ch, 1, 1000, -1);
  expect_round(ch, 2, 2000, 2); /* from the layout: the update in place seen */
  expect_refused(ch, TSHARE_E_PROTOCOL, "layout slot 2, which holds no layout");
  expect_refused(ch, TSHARE_E_MALFORMED, "outside 1..4");
  expect_refused(ch, TSHARE_E_TOO_LARGE, "metadata, over");
  expect_round(ch, 6, 6000, 6); /* the layout survived the refusals of other slots and malformed frames */
  expect_refused(ch, TSHARE_E_PROTOCOL, "layout 99 in slot 1, which holds layout 1");
  expect_refused(ch, TSHARE_E_PROTOCOL, "layout slot 1, which holds no layout"); /* emptied by the refusal */
  expect_round(ch, 9, 9000, -1);
  expect_refused(ch, TSHARE_E_PROTOCOL, "keeps no mapping"); /* retired meanwhile */
  expect_round(ch, 11, 11000, -1);
  expect_refused(ch, TSHARE_E_PROTOCOL, "layout slot 1, which holds no layout");
  expect_round(ch, 13, 13000, -1);
  expect_bye(ch);
}

static void fill(tshare_host_buffer *buf, float first) {
  float *p = tshare_host_buffer_data(buf);
  for (int i = 0; i < FLOATS; i++) p[i] = first + (float)i;
}

/* A hand producer's run: its consumer forked, a socket-only channel to it,
 * and a memfd of FLOATS floats from 1000 on, sent as set 1 (kept, its
 * layout in slot 1) and released. */
typedef struct hand_run {
  pid_t pid;
  int sock; /* the channel's socket: for frames written by hand */
  tshare_channel *ch;
  tshare_host_buffer *buf;
} hand_run;

static hand_run start_hand_producer(void (*consumer)(int), const char *memfd_name) {
  int sock;
  hand_run run;
  run.pid = fork_with_socket(consumer, &sock);
  run.sock = sock;
  run.ch = open_socket_only_channel(sock, "hand producer");
  CHECK_RC(tshare_host_buffer_create(FLOATS * sizeof(float), memfd_name, &run.buf, NULL), TSHARE_OK, "");
  fill(run.buf, 1000);
  send_whole(run.ch, 1, tshare_host_buffer_fd(run.buf), ALLOC, 1, TSHARE_SHARE_FLAG_RETIRE_NOTICE);
  collect_release(run.ch, 1);
  return run;
}

static void end_hand_producer(hand_run *run) {
  CHECK_RC(tshare_channel_send_bye(run->ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(run->ch));
  CHECK_CHILD_OK(run->pid);
  tshare_host_buffer_destroy(run->buf);
  tshare_channel_close(run->ch);
}

TS_TEST(a_consumer_refuses_a_set_sent_again_it_cannot_serve_and_goes_on) {
  hand_run run = start_hand_producer(consumer_of_hand_sets, "tshare-again-hand");
  tshare_channel *ch = run.ch;
  tshare_host_buffer *buf = run.buf;
  int sock = run.sock;
  fill(buf, 2000);
  send_again(ch, 2, 1, 1, 2);
  collect_release(ch, 2);
  /* Each AGAIN refused tells the producer the layout it named is lost. */
  send_again(ch, 3, 2, 1, 3);
  collect_dropped_and_release(ch, 3, 2, 1);
  send_bad_again(sock, 4, 7, 0); /* malformed: refused as such, naming no layout */
  collect_release(ch, 4);
  send_bad_again(sock, 5, 1, TSHARE_SET_META_MAX + 1);
  collect_release(ch, 5);
  fill(buf, 6000);
  send_again(ch, 6, 1, 1, 6);
  collect_release(ch, 6);
  send_again(ch, 7, 1, 99, 7); /* the slot holds another: emptied, the producer's id named */
  collect_dropped_and_release(ch, 7, 1, 99);
  send_again(ch, 8, 1, 1, 8);
  collect_dropped_and_release(ch, 8, 1, 1);
  fill(buf, 9000);
  send_whole(ch, 9, tshare_host_buffer_fd(buf), ALLOC + 1, 1, TSHARE_SHARE_FLAG_RETIRE_NOTICE);
  collect_release(ch, 9);
  tshare_frame freed = frame_of(TSHARE_FRAME_RETIRE);
  freed.u.retire = (tshare_retire_frame){.closed = TSHARE_RETIRE_FREED, .count = 1, .mem_kind = TSHARE_MEM_HOST_MEMFD};
  freed.u.retire.alloc_ids[0] = ALLOC + 1;
  send_frame(ch, &freed, -1);
  send_again(ch, 10, 1, 9, 10);
  collect_dropped_and_release(ch, 10, 1, 9);
  /* A whole set of memory this end does not keep (not offered) names slot
   * 1: the slot is emptied, its layout not kept, and the producer told. */
  fill(buf, 11000);
  send_whole(ch, 11, tshare_host_buffer_fd(buf), ALLOC + 2, 1, 0);
  collect_dropped_and_release(ch, 11, 1, 11);
  send_again(ch, 12, 1, 11, 12);
  collect_dropped_and_release(ch, 12, 1, 11);
  fill(buf, 13000);
  send_whole(ch, 13, tshare_host_buffer_fd(buf), ALLOC + 2, 0, 0);
  collect_release(ch, 13);
  end_hand_producer(&run);
}

/* A set sent again shares its layout's members and names: held past that
 * layout (replaced in its slot by another set's, then the slot emptied by a
 * refusal), it still reads them (ASan, in CI, sees any use after free). */
static void consumer_holding_past_the_layout(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  expect_round(ch, 1, 1000, -1);
  tshare_set *held;
  CHECK_RC(tshare_set_recv(ch, 5000, &held), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_set_id(held), 2);
  expect_round(ch, 3, 3000, -1); /* its layout replaces set 1's in slot 1 */
  expect_refused(ch, TSHARE_E_PROTOCOL, "layout 1 in slot 1, which holds layout 3");
  CHECK(strcmp(tshare_set_name(held, 0), "w") == 0);
  CHECK_EQ(tshare_set_find(held, "w"), 0);
  CHECK_EQ(tshare_set_desc(held, 0)->shape[0], FLOATS);
  CHECK_EQ(((const float *)tshare_set_data(held, 0))[1], 3001); /* the producer's memory, as it is now */
  tshare_set_release(held);
  expect_bye(ch);
}

TS_TEST(a_set_sent_again_held_past_its_layout_keeps_its_names) {
  hand_run run = start_hand_producer(consumer_holding_past_the_layout, "tshare-again-held");
  tshare_channel *ch = run.ch;
  tshare_host_buffer *buf = run.buf;
  fill(buf, 2000);
  send_again(ch, 2, 1, 1, 2); /* held by the consumer until the end */
  fill(buf, 3000);
  send_whole(ch, 3, tshare_host_buffer_fd(buf), ALLOC + 1, 1, TSHARE_SHARE_FLAG_RETIRE_NOTICE);
  collect_release(ch, 3);
  send_again(ch, 4, 1, 1, 4);
  /* Set 4's release (refused) may go in one frame with set 2's, after the
   * notice that slot 1 lost layout 1. */
  bool dropped = false, got[2] = {false, false};
  while (!got[0] || !got[1]) {
    tshare_frame f;
    int fd = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    if (f.type == TSHARE_FRAME_RETIRE) continue;
    if (f.type == TSHARE_FRAME_SET) {
      CHECK(f.u.set.op == TSHARE_SET_DROPPED && f.u.set.u.dropped.layout_id == 1 && !dropped);
      dropped = true;
      continue;
    }
    CHECK_EQ(f.type, TSHARE_FRAME_RELEASE);
    for (uint32_t i = 0; i < f.u.release.count; i++) {
      CHECK(f.u.release.share_ids[i] == 4 || f.u.release.share_ids[i] == 2);
      got[f.u.release.share_ids[i] == 2] = true;
    }
  }
  CHECK(dropped);
  end_hand_producer(&run);
}

/* The switch off in the consumer: an AGAIN is refused, not served. */
static void consumer_without_the_cap(int fd) {
  setenv("TSHARE_SET_AGAIN", "0", 1);
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  expect_round(ch, 1, 1000, -1);
  expect_refused(ch, TSHARE_E_PROTOCOL, "did not agree on TSHARE_CAP_SET_AGAIN");
  expect_bye(ch);
}

TS_TEST(a_set_sent_again_without_the_capability_agreed_is_refused) {
  hand_run run = start_hand_producer(consumer_without_the_cap, "tshare-again-hand");
  send_again(run.ch, 2, 1, 1, 2);
  collect_release(run.ch, 2); /* and no DROPPED: the peer never agreed on sets sent again */
  end_hand_producer(&run);
}

/* ---- a peer of wire 1.5: whole sets, exactly as before -------------------- */

static void write_frame(int fd, const tshare_frame *f) {
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  CHECK_RC(tshare_wire_encode(f, buf, sizeof buf, &len, NULL), TSHARE_OK, "");
  buf[5] = 5; /* the header's minor */
  CHECK(write(fd, buf, len) == (ssize_t)len);
}

/* Claims every capability of sets, this one too, but speaks minor 5: it
 * keeps memfds (so later sets name them kept) and sees no layout slot and
 * no AGAIN. The fds that come are dropped by read(). */
static void minor_5_peer(int fd) {
  tshare_frame f = frame_of(TSHARE_FRAME_HELLO);
  f.u.hello.pid = (uint32_t)getpid();
  f.u.hello.uid = (uint32_t)getuid();
  f.u.hello.capabilities = TSHARE_CAP_FD_PASSING | TSHARE_CAP_HOST_MEMFD | TSHARE_CAP_TENSOR_SETS |
                           TSHARE_CAP_HOST_KEPT | TSHARE_CAP_SET_HOST_KEPT | TSHARE_CAP_SET_AGAIN;
  snprintf(f.u.hello.name, sizeof f.u.hello.name, "old");
  write_frame(fd, &f);
  tshare_decoder *d = tshare_decoder_create(NULL);
  int sets = 0, kept_mems = 0;
  for (bool bye = false; !bye;) {
    uint8_t *space;
    size_t avail;
    CHECK_RC(tshare_decoder_space(d, &space, &avail), TSHARE_OK, "");
    ssize_t n = read(fd, space, avail);
    CHECK(n > 0);
    tshare_decoder_commit(d, (size_t)n);
    while (!bye && tshare_decoder_next(d, &f) == TSHARE_OK) {
      bye = f.type == TSHARE_FRAME_BYE;
      if (f.type != TSHARE_FRAME_SET) continue;
      CHECK(f.u.set.op != TSHARE_SET_AGAIN);
      if (f.u.set.op == TSHARE_SET_BEGIN) CHECK_EQ(f.u.set.u.begin.layout_slot, 0);
      if (f.u.set.op == TSHARE_SET_MEM && f.u.set.u.mem.mem_kind == TSHARE_MEM_HOST_KEPT) kept_mems++;
      if (f.u.set.op == TSHARE_SET_MEM && f.u.set.u.mem.mem_kind == TSHARE_MEM_HOST_MEMFD) {
        tshare_frame kept = kept_frame(f.u.set.u.mem.alloc_id);
        write_frame(fd, &kept);
      }
      if (f.u.set.op == TSHARE_SET_END) {
        tshare_frame rel = release_frame(f.u.set.set_id);
        write_frame(fd, &rel);
        sets++;
      }
    }
  }
  tshare_decoder_destroy(d);
  CHECK_EQ(sets, 4);
  CHECK_EQ(kept_mems, 3 * 2); /* sets 2..4 name both memories kept: still whole */
}

TS_TEST(a_peer_of_wire_1_5_gets_whole_sets_as_before) {
  int sock;
  pid_t pid = fork_with_socket(minor_5_peer, &sock);
  tshare_channel *ch = open_socket_only_channel(sock, "producer");
  CHECK_EQ(tshare_channel_peer(ch)->minor, 5);
  weights w;
  make_weights(&w, 0, 3);
  for (int round = 0; round < 4; round++) send_round(ch, &w, 0, round);
  drop_weights(&w);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

TS_TEST_MAIN
