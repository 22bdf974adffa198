/* A set member's memory pinned past the set's release
 * (tshare_set_view_release_pinned): the consumer of the weight-sync loop
 * gives each version back while its tensors still point into the memory,
 * and attaches the next version, of the same layout at the same addresses,
 * to them. Tested against a real producer: each release reaches it while
 * the pins hold (it waits for them, then writes the next version), the next
 * set has the layout and addresses the pins remember, a memory the producer
 * retired stays mapped (and shows its last writes) until the last pin goes,
 * from another thread, and is unmapped at the channel's next idle turn
 * after that (not on the thread that let go); a view that is not a set
 * member's is refused and stays usable. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/hostmem.h"
#include "tshare/set.h"
#include "tshare/share.h"

#include <pthread.h>

#define F32 ((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1})
#define MEMFD_NAME "tshare-pin-test"
enum { FLOATS = 1024, MEMBERS = 2, ROUNDS = 4 };

static float value_of(int round, int member, int i) { return (float)(round * 10000 + member * 2000 + i); }

static tshare_tensor_desc member_desc(int member) {
  int64_t n = FLOATS;
  return tshare_tensor_contiguous(F32, 1, &n, (uint64_t)member * FLOATS * sizeof(float));
}

static void fill(tshare_host_buffer *buf, int round) {
  float *p = tshare_host_buffer_data(buf);
  for (int m = 0; m < MEMBERS; m++)
    for (int i = 0; i < FLOATS; i++) p[m * FLOATS + i] = value_of(round, m, i);
}

static void check_member(const float *p, int round, int member) {
  for (int i = 0; i < FLOATS; i++)
    if (p[i] != value_of(round, member, i))
      TS_FAIL("member %d element %d is %g, expected round %d's %g", member, i, (double)p[i], round,
              (double)value_of(round, member, i));
}

/* Sends ROUNDS versions of one builder's set, each after the last was
 * released (what a pinned consumer must still give back); then writes round
 * ROUNDS into the buffer, shares it alone, destroys it (its memory is
 * retired once that share is back) and says bye. */
static void producer(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "pin producer", NULL, NULL);
  tshare_host_buffer *buf = NULL;
  CHECK_RC(tshare_host_buffer_create(MEMBERS * FLOATS * sizeof(float), MEMFD_NAME, &buf, NULL), TSHARE_OK, "");
  tshare_set_builder *b = tshare_set_builder_create();
  for (int m = 0; m < MEMBERS; m++) {
    tshare_tensor_desc d = member_desc(m);
    CHECK_RC(tshare_set_builder_add_host(b, m ? "layer.b" : "layer.a", buf, &d, NULL), TSHARE_OK, "");
  }
  for (int round = 0; round < ROUNDS; round++) {
    fill(buf, round);
    uint64_t id = 0;
    CHECK_RC(tshare_set_send(ch, b, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  fill(buf, ROUNDS);
  tshare_tensor_desc d = member_desc(0);
  uint64_t single = 0;
  CHECK_RC(tshare_share_host(ch, buf, &d, "single", NULL, 5000, &single), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_builder_destroy(b);
  tshare_host_buffer_destroy(buf); /* retired (the consumer told) once the single share comes back */
  CHECK_RC(tshare_channel_wait_released(ch, single, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  int polled = tshare_channel_poll(ch, 0); /* a turn of the channel's housekeeping: the retire goes out */
  CHECK(polled == TSHARE_OK || polled == TSHARE_E_TIMEOUT);
  while ((polled = tshare_channel_poll(ch, 10000)) == TSHARE_OK) { /* until the consumer's bye */
  }
  CHECK_RC(polled, TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void *release_pins(void *arg) {
  tshare_set_pin **pins = arg;
  for (int m = 0; m < MEMBERS; m++) tshare_set_pin_release(pins[m]);
  return NULL;
}

/* A forked child's whole-set pin of the set its parent holds: it reads the
 * memory through it and lets go of its copies of the pin and the set, which
 * tells the producer nothing. */
static void child_pins_and_lets_go(tshare_set *s) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    tshare_set_pin *pin = NULL;
    CHECK_RC(tshare_set_pin_memories(s, &pin), TSHARE_OK, "");
    for (int m = 0; m < MEMBERS; m++) check_member(tshare_set_data(s, (size_t)m), 0, m);
    tshare_set_release(s);
    check_member(tshare_set_pin_data(pin), 0, 0); /* the pin holds the child's copy */
    tshare_set_pin_release(pin);
    fflush(stdout);
    _exit(0);
  }
  CHECK_CHILD_OK(pid);
}

/* The consumer: each round's set released while its memory stays pinned,
 * one pin per member view (tshare_set_view_release_pinned) or one pin of
 * the whole set (whole: tshare_set_pin_memories). fork_first: a child
 * forked with round 0's set pins and releases its copy first; the
 * producer, waiting for round 0's release, sends nothing until this end's. */
static void pinned_consumer(bool whole, bool fork_first) {
  int sock;
  pid_t pid = fork_with_socket(producer, &sock);
  tshare_channel *ch = open_socket_channel(sock, "pin consumer", NULL, NULL);
  tshare_set_pin *pins[MEMBERS] = {0};
  void *data[MEMBERS] = {0};
  uint64_t layout = 0;
  for (int round = 0; round < ROUNDS; round++) {
    tshare_set *s = NULL;
    CHECK_RC(tshare_set_recv(ch, 5000, &s), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(tshare_set_count(s), (size_t)MEMBERS);
    if (round == 0) {
      layout = tshare_set_layout(s);
      CHECK(layout != 0); /* a builder's set is kept by its layout: the next ones are at the same addresses */
    } else {
      CHECK_EQ(tshare_set_layout(s), layout);
      for (int m = 0; m < MEMBERS; m++) CHECK(tshare_set_data(s, (size_t)m) == data[m]);
      if (!whole)
        for (int m = 0; m < MEMBERS; m++) CHECK(tshare_set_pin_data(pins[m]) == data[m]);
    }
    for (int m = 0; m < MEMBERS; m++) data[m] = tshare_set_data(s, (size_t)m);
    if (fork_first && round == 0) {
      child_pins_and_lets_go(s);
      tshare_set *early = NULL;
      CHECK_RC(tshare_set_recv(ch, 200, &early), TSHARE_E_TIMEOUT, "round 1 came before round 0's release");
      for (int m = 0; m < MEMBERS; m++) check_member(data[m], 0, m); /* the child's going left this end's intact */
    }
    if (whole) {
      for (int m = 0; m < MEMBERS; m++) check_member(data[m], round, m);
      tshare_set_pin *next = NULL;
      CHECK_RC(tshare_set_pin_memories(s, &next), TSHARE_OK, "");
      CHECK(tshare_set_pin_data(next) == data[0]);
      tshare_set_release(s);
      tshare_set_pin_release(pins[0]); /* the pin of this version holds the memory now */
      pins[0] = next;
      continue;
    }
    tshare_view *views[MEMBERS];
    for (int m = 0; m < MEMBERS; m++) {
      check_member(data[m], round, m);
      CHECK_RC(tshare_set_view(s, (size_t)m, &views[m]), TSHARE_OK, "");
    }
    tshare_set_release(s);
    for (int m = 0; m < MEMBERS; m++) {
      tshare_set_pin_release(pins[m]); /* the view of this version holds the memory now */
      pins[m] = NULL;
      CHECK_RC(tshare_set_view_release_pinned(views[m], &pins[m]), TSHARE_OK, "");
      CHECK(pins[m] != NULL);
    }
    /* The set is back with the producer now (it waits for that before the
     * next round); the pins hold the memory where it is. */
  }
  tshare_view *single = NULL;
  CHECK_RC(tshare_view_recv(ch, 5000, &single), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set_pin *not_a_pin = (tshare_set_pin *)&not_a_pin;
  CHECK_EQ(tshare_set_view_release_pinned(single, &not_a_pin), TSHARE_E_INVALID_ARG);
  CHECK(not_a_pin == NULL);
  CHECK_EQ(tshare_set_view_release_pinned(NULL, &not_a_pin), TSHARE_E_INVALID_ARG);
  CHECK_EQ(tshare_set_pin_memories(NULL, &not_a_pin), TSHARE_E_INVALID_ARG);
  check_member(tshare_view_data(single), ROUNDS, 0); /* the refused view is still held and usable */
  tshare_view_release(single);

  /* The producer wrote round ROUNDS after the last release and then retired
   * the memory (its retire comes after the single share's release): the
   * pins still map it, and show those writes. The producer waits for this
   * end's bye, so the channel is live throughout. */
  for (int turn = 0; turn < 20 && tshare_channel_poll(ch, 10) != TSHARE_E_PEER_CLOSED; turn++) {
  }
  for (int m = 0; m < MEMBERS; m++) check_member(data[m], ROUNDS, m);
  CHECK(count_mappings(MEMFD_NAME) > 0);
  pthread_t t;
  CHECK(pthread_create(&t, NULL, release_pins, pins) == 0);
  CHECK(pthread_join(t, NULL) == 0);
  CHECK(count_mappings(MEMFD_NAME) > 0); /* not where the pins went (a tensor's deleter, on any thread), */
  int polled = tshare_channel_poll(ch, 0); /* but at the channel's next idle turn, the producer still there */
  CHECK_RC(polled, TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
  CHECK_EQ(count_mappings(MEMFD_NAME), 0);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_set_pin_release(NULL);
  CHECK(tshare_set_pin_data(NULL) == NULL);
  tshare_channel_close(ch);
}

TS_TEST(a_pinned_set_goes_back_while_its_memory_stays_mapped_for_the_next_version_and_past_its_retire) {
  pinned_consumer(false, false);
}

TS_TEST(a_whole_set_pinned_in_one_goes_back_while_its_memory_stays_mapped_past_its_retire) {
  pinned_consumer(true, false);
}

TS_TEST(a_whole_set_pin_in_a_forked_child_lets_go_of_the_childs_copy_alone) { pinned_consumer(true, true); }

TS_TEST_MAIN
