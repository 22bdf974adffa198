/* Tensor sets where applications use them: several threads of a producer
 * sending sets on one channel (each call either goes through or is refused
 * as busy, never both, never half: every set arrives once, whole, in each
 * thread's order); one thread sending sets while another receives them on
 * the same channel, at both ends, the two taking turns; and a producer and consumer pinned to one
 * CPU, a model's 290 tensors updated in place and sent again each round. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/set.h"

#include <pthread.h>
#include <sched.h>

static const tshare_dtype F32 = {TSHARE_DTYPE_FLOAT, 32, 1};
#define TENSORS 8  /* per set below, 16 floats each in one buffer */
#define FLOATS 16

/* Set (who, seq): tensor i named "t<i>" holds who*1e6 + seq*100 + i in each
 * float; the metadata is "who seq". */
static float value_of(int who, int seq, int i) { return (float)(who * 1000000 + seq * 100 + i); }

static tshare_set_builder *build_set(tshare_host_buffer *buf, int who, int seq) {
  tshare_set_builder *b = tshare_set_builder_create();
  CHECK(b);
  tshare_error err;
  float *data = tshare_host_buffer_data(buf);
  for (int i = 0; i < TENSORS; i++) {
    int64_t n = FLOATS;
    tshare_tensor_desc d = tshare_tensor_contiguous(F32, 1, &n, (uint64_t)i * FLOATS * sizeof(float));
    for (int j = 0; j < FLOATS; j++) data[i * FLOATS + j] = value_of(who, seq, i);
    char name[16];
    snprintf(name, sizeof name, "t%d", i);
    CHECK_RC(tshare_set_builder_add_host(b, name, buf, &d, &err), TSHARE_OK, err.message);
  }
  char meta[32];
  int len = snprintf(meta, sizeof meta, "%d %d", who, seq);
  CHECK_RC(tshare_set_builder_set_meta(b, meta, (size_t)len, &err), TSHARE_OK, err.message);
  return b;
}

/* The set is whole and what its metadata says; *who and *seq get it. */
static void check_set(tshare_set *s, int *who, int *seq) {
  size_t len;
  const char *meta = tshare_set_meta(s, &len);
  char text[32] = "";
  CHECK(meta && len < sizeof text);
  memcpy(text, meta, len);
  CHECK(sscanf(text, "%d %d", who, seq) == 2);
  CHECK_EQ(tshare_set_count(s), TENSORS);
  for (int i = 0; i < TENSORS; i++) {
    char name[16];
    snprintf(name, sizeof name, "t%d", i);
    CHECK_EQ(tshare_set_find(s, name), i);
    const float *f = tshare_set_data(s, (size_t)i);
    for (int j = 0; j < FLOATS; j++)
      if (f[j] != value_of(*who, *seq, i)) TS_FAIL("set %s: tensor %d [%d] = %f", text, i, j, (double)f[j]);
  }
}

/* A call on a channel another thread is inside of is refused as busy, and
 * did nothing: the caller tries again, as it would behind its own lock. */
static bool busy(tshare_channel *ch, int rc) {
  if (rc != TSHARE_E_BUSY) return false;
  if (!strstr(tshare_channel_last_error(ch), "one thread at a time")) TS_FAIL("busy: %s", tshare_channel_last_error(ch));
  sched_yield();
  return true;
}

/* ---- several threads sending on one channel -------------------------------- */

#define SENDERS 4
#define SETS_EACH 25

typedef struct sender {
  pthread_t thread;
  tshare_channel *ch;
  int who;
  uint64_t ids[SETS_EACH];
  int busy;
} sender;

/* Each set is sent once its buffer came back: set seq+1 overwrites it. */
static void *send_sets(void *arg) {
  sender *s = arg;
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(TENSORS * FLOATS * sizeof(float), "tshare-usage", &buf, NULL), TSHARE_OK, "");
  for (int seq = 0; seq < SETS_EACH; seq++) {
    while (tshare_host_buffer_outstanding(buf) > 0) {
      int rc = tshare_channel_poll(s->ch, 1);
      if (busy(s->ch, rc)) s->busy++;
      else if (rc != TSHARE_E_TIMEOUT) CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(s->ch));
    }
    tshare_set_builder *b = build_set(buf, s->who, seq);
    int rc;
    while (busy(s->ch, rc = tshare_set_send(s->ch, b, NULL, 10000, &s->ids[seq]))) {
      CHECK_EQ(s->ids[seq], 0);
      s->busy++;
    }
    CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(s->ch));
    tshare_set_builder_destroy(b);
  }
  while (tshare_host_buffer_outstanding(buf) > 0) {
    int rc = tshare_channel_poll(s->ch, 1);
    if (!busy(s->ch, rc) && rc != TSHARE_E_TIMEOUT) CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(s->ch));
  }
  tshare_host_buffer_destroy(buf);
  return NULL;
}

/* Takes SENDERS * SETS_EACH sets: each sender's in its order, each whole. */
static void consumer_of_all_senders(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  int next[SENDERS] = {0};
  for (int k = 0; k < SENDERS * SETS_EACH; k++) {
    tshare_set *s;
    CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
    int who, seq;
    check_set(s, &who, &seq);
    CHECK(who >= 0 && who < SENDERS);
    if (seq != next[who]) TS_FAIL("sender %d: set %d came when %d was next", who, seq, next[who]);
    next[who]++;
    tshare_set_release(s);
  }
  tshare_set *none;
  CHECK_RC(tshare_set_recv(ch, 10000, &none), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(threads_sending_sets_on_one_channel_each_arrive_once_whole_and_in_order) {
  int sock;
  pid_t pid = fork_with_socket(consumer_of_all_senders, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  static sender s[SENDERS];
  for (int t = 0; t < SENDERS; t++) {
    s[t] = (sender){.ch = ch, .who = t};
    CHECK(pthread_create(&s[t].thread, NULL, send_sets, &s[t]) == 0);
  }
  int refused = 0;
  /* Every sender done before the ids are looked at: tshare_share_is_released
   * reads the channel's exports, which a sending thread changes. */
  for (int t = 0; t < SENDERS; t++) CHECK(pthread_join(s[t].thread, NULL) == 0);
  for (int t = 0; t < SENDERS; t++) {
    refused += s[t].busy;
    for (int i = 0; i < SETS_EACH; i++) {
      CHECK(s[t].ids[i] != 0);
      CHECK_EQ(tshare_share_is_released(ch, s[t].ids[i]), 1);
      for (int u = 0; u < t; u++)
        for (int j = 0; j < SETS_EACH; j++)
          if (s[u].ids[j] == s[t].ids[i]) TS_FAIL("set id %llu handed out twice", (unsigned long long)s[t].ids[i]);
    }
  }
  printf("%d sets sent by %d threads, %d calls refused as busy\n", SENDERS * SETS_EACH, SENDERS, refused);
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* ---- one thread sends while another receives, at both ends ---------------- */

/* The two threads at one end take turns on the channel through a fair lock
 * of their own, as channel.h asks of threads sharing a channel: retrying a
 * refused call loses to a thread that calls again at once (a 5 ms wait for a
 * release left a 1 µs gap between calls), and with each end's receiver shut
 * out neither end's release ever came. A ticket each, served in order. */
typedef struct turns {
  pthread_mutex_t lock;
  pthread_cond_t served;
  unsigned long next, serving;
} turns;

static void take_turn(turns *t) {
  CHECK(pthread_mutex_lock(&t->lock) == 0);
  unsigned long mine = t->next++;
  while (t->serving != mine) CHECK(pthread_cond_wait(&t->served, &t->lock) == 0);
  CHECK(pthread_mutex_unlock(&t->lock) == 0);
}

static void end_turn(turns *t) {
  CHECK(pthread_mutex_lock(&t->lock) == 0);
  t->serving++;
  CHECK(pthread_cond_broadcast(&t->served) == 0);
  CHECK(pthread_mutex_unlock(&t->lock) == 0);
}

#define EXCHANGED 30

typedef struct exchange {
  tshare_channel *ch;
  turns turns;
  int who; /* 0 the parent, 1 the child */
  int received;
} exchange;

/* A call in this end's turn: never refused as busy, the other thread waits. */
#define IN_TURN(x, call) (take_turn(&(x)->turns), rc_ = (call), end_turn(&(x)->turns), rc_)

/* EXCHANGED sets to the other end, each once the one before came back. */
static void *send_to_other_end(void *arg) {
  exchange *x = arg;
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(TENSORS * FLOATS * sizeof(float), "tshare-usage", &buf, NULL), TSHARE_OK, "");
  for (int seq = 0; seq < EXCHANGED; seq++) {
    tshare_set_builder *b = build_set(buf, x->who, seq);
    uint64_t id = 0;
    int rc_, rc = IN_TURN(x, tshare_set_send(x->ch, b, NULL, 10000, &id));
    CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(x->ch));
    tshare_set_builder_destroy(b);
    while (!tshare_share_is_released(x->ch, id)) {
      rc = IN_TURN(x, tshare_channel_wait_released(x->ch, id, 5));
      if (rc != TSHARE_E_TIMEOUT) CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(x->ch));
    }
  }
  tshare_host_buffer_destroy(buf);
  return NULL;
}

/* The other end's sets, received in short waits that let the sender in. */
static void receive_from_other_end(exchange *x) {
  while (x->received < EXCHANGED) {
    tshare_set *s = NULL;
    int rc_, rc = IN_TURN(x, tshare_set_recv(x->ch, 5, &s));
    if (rc == TSHARE_E_TIMEOUT) continue;
    CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(x->ch));
    int who, seq;
    check_set(s, &who, &seq);
    CHECK_EQ(who, 1 - x->who);
    CHECK_EQ(seq, x->received);
    x->received++;
    tshare_set_release(s); /* from any thread, no turn needed */
  }
}

/* Both threads at one end of the channel; then it waits for the other end's bye. */
static void both_ways(tshare_channel *ch, int who) {
  exchange x = {.ch = ch, .who = who};
  CHECK(pthread_mutex_init(&x.turns.lock, NULL) == 0);
  CHECK(pthread_cond_init(&x.turns.served, NULL) == 0);
  pthread_t sender_thread;
  CHECK(pthread_create(&sender_thread, NULL, send_to_other_end, &x) == 0);
  receive_from_other_end(&x);
  CHECK(pthread_join(sender_thread, NULL) == 0);
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_set *none;
  CHECK_RC(tshare_set_recv(ch, 10000, &none), TSHARE_END, tshare_channel_last_error(ch));
  pthread_cond_destroy(&x.turns.served);
  pthread_mutex_destroy(&x.turns.lock);
}

static void child_both_ways(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "child", NULL, NULL);
  both_ways(ch, 1);
  tshare_channel_close(ch);
}

TS_TEST(one_thread_sends_sets_while_another_receives_them_at_both_ends) {
  int sock;
  pid_t pid = fork_with_socket(child_both_ways, &sock);
  tshare_channel *ch = open_socket_channel(sock, "parent", NULL, NULL);
  both_ways(ch, 0);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* ---- both ends pinned to one CPU ------------------------------------------ */

#define MODEL_TENSORS 290
#define ROUNDS 100

static void pin_to_first_cpu(void) {
  cpu_set_t cpus;
  CHECK(sched_getaffinity(0, sizeof cpus, &cpus) == 0);
  size_t first = 0;
  while (first < CPU_SETSIZE && !CPU_ISSET(first, &cpus)) first++;
  CPU_ZERO(&cpus);
  CPU_SET(first, &cpus);
  CHECK(sched_setaffinity(0, sizeof cpus, &cpus) == 0);
}

/* Each round's set: every tensor holds the round number (the metadata). */
static void pinned_consumer(int fd) {
  pin_to_first_cpu();
  tshare_channel *ch = open_socket_channel(fd, "pinned consumer", NULL, NULL);
  for (int round = 0; round < ROUNDS; round++) {
    tshare_set *s;
    CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(tshare_set_count(s), MODEL_TENSORS);
    size_t len;
    const int *version = tshare_set_meta(s, &len);
    CHECK_EQ(len, sizeof(int));
    CHECK_EQ(*version, round);
    for (size_t i = 0; i < MODEL_TENSORS; i++) CHECK_EQ(((const float *)tshare_set_data(s, i))[0], (float)round);
    tshare_set_release(s);
  }
  tshare_set *none;
  CHECK_RC(tshare_set_recv(ch, 10000, &none), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(a_model_updated_in_place_goes_round_with_both_ends_on_one_cpu) {
  int sock;
  pid_t pid = fork_with_socket(pinned_consumer, &sock);
  pin_to_first_cpu();
  tshare_channel *ch = open_socket_channel(sock, "pinned producer", NULL, NULL);
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(MODEL_TENSORS * 64 * sizeof(float), "tshare-usage", &buf, NULL), TSHARE_OK, "");
  tshare_set_builder *b = tshare_set_builder_create();
  tshare_error err;
  for (int i = 0; i < MODEL_TENSORS; i++) {
    int64_t n = 64;
    tshare_tensor_desc d = tshare_tensor_contiguous(F32, 1, &n, (uint64_t)i * 64 * sizeof(float));
    char name[64];
    snprintf(name, sizeof name, "model.layers.%d.weight", i);
    CHECK_RC(tshare_set_builder_add_host(b, name, buf, &d, &err), TSHARE_OK, err.message);
  }
  float *data = tshare_host_buffer_data(buf);
  for (int round = 0; round < ROUNDS; round++) {
    for (int i = 0; i < MODEL_TENSORS * 64; i++) data[i] = (float)round; /* the update, in place */
    CHECK_RC(tshare_set_builder_set_meta(b, &round, sizeof round, &err), TSHARE_OK, err.message);
    uint64_t id;
    CHECK_RC(tshare_set_send(ch, b, NULL, 10000, &id), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  tshare_set_builder_destroy(b);
  CHECK_EQ(tshare_host_buffer_outstanding(buf), 0);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
  tshare_host_buffer_destroy(buf);
}

TS_TEST_MAIN
