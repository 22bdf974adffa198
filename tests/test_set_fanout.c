/* One tensor set to several consumers at once (tshare_set_send_all,
 * tshare_set_wait_all), each a real process: all of them see the producer's
 * bytes and their releases are awaited together; a consumer killed before it
 * could receive fails alone, its result naming it, while the others get the
 * set and give it back; a consumer that holds on past the deadline times out
 * alone; bad arguments are refused per consumer or as a whole. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/set.h"

#include <signal.h>

enum { CONSUMERS = 3, TENSORS = 8, ELEMS = 16 };

static const tshare_dtype F32 = {TSHARE_DTYPE_FLOAT, 32, 1};
static const char META[] = "version=7";

static tshare_host_buffer *new_buffer(void) {
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(TENSORS * ELEMS * sizeof(float), "fanout", &buf, NULL), TSHARE_OK, "");
  return buf;
}

/* Tensor i holds i*100, i*100+1, ...; one buffer holds them all. */
static tshare_set_builder *build_set(tshare_host_buffer *buf) {
  tshare_set_builder *b = tshare_set_builder_create();
  CHECK(b);
  tshare_error err;
  float *f = tshare_host_buffer_data(buf);
  for (int i = 0; i < TENSORS; i++) {
    int64_t n = ELEMS;
    tshare_tensor_desc d = tshare_tensor_contiguous(F32, 1, &n, (uint64_t)i * ELEMS * sizeof(float));
    for (int j = 0; j < ELEMS; j++) f[i * ELEMS + j] = (float)(i * 100 + j);
    char name[32];
    snprintf(name, sizeof name, "layers.%d.weight", i);
    CHECK_RC(tshare_set_builder_add_host(b, name, buf, &d, &err), TSHARE_OK, err.message);
  }
  CHECK_RC(tshare_set_builder_set_meta(b, META, sizeof META - 1, &err), TSHARE_OK, err.message);
  return b;
}

static void check_received(tshare_set *s) {
  CHECK_EQ(tshare_set_count(s), TENSORS);
  for (int i = 0; i < TENSORS; i++) {
    char name[32];
    snprintf(name, sizeof name, "layers.%d.weight", i);
    CHECK(strcmp(tshare_set_name(s, (size_t)i), name) == 0);
    const float *f = tshare_set_data(s, (size_t)i);
    for (int j = 0; j < ELEMS; j++)
      if (f[j] != (float)(i * 100 + j)) TS_FAIL("tensor %d [%d] = %f", i, j, (double)f[j]);
  }
  size_t len;
  const char *meta = tshare_set_meta(s, &len);
  CHECK(len == sizeof META - 1 && memcmp(meta, META, len) == 0);
}

/* The consumers' names, as their hellos carry them. */
static const char *const NAMES[CONSUMERS] = {"consumer-0", "consumer-1", "consumer-2"};
static int hold_until[2] = {-1, -1}; /* a pipe: a holding consumer reads a byte, then releases */
static size_t holder = CONSUMERS;    /* the consumer that holds its set until told, if any */

static void consumer(int fd, size_t index) {
  tshare_channel *ch = open_socket_channel(fd, NAMES[index], NULL, NULL);
  tshare_set *s;
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_OK, tshare_channel_last_error(ch));
  check_received(s);
  if (index == holder) {
    char byte;
    CHECK(read(hold_until[0], &byte, 1) == 1);
  }
  tshare_set_release(s);
  CHECK_RC(tshare_set_recv(ch, 10000, &s), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void consumer_0(int fd) { consumer(fd, 0); }
static void consumer_1(int fd) { consumer(fd, 1); }
static void consumer_2(int fd) { consumer(fd, 2); }

/* Opens its channel (the producer's open completes on its hello), then
 * waits to be killed. */
static void consumer_killed_before_receiving(int fd) {
  tshare_channel *ch = open_socket_channel(fd, NAMES[1], NULL, NULL);
  (void)ch;
  for (;;) pause();
}

typedef struct fleet {
  pid_t pids[CONSUMERS];
  tshare_channel *chs[CONSUMERS];
} fleet;

static fleet start_consumers(void (*const fns[CONSUMERS])(int)) {
  fleet f;
  for (size_t i = 0; i < CONSUMERS; i++) {
    int sock;
    f.pids[i] = fork_with_socket(fns[i], &sock);
    f.chs[i] = open_socket_channel(sock, "producer", NULL, NULL);
  }
  return f;
}

/* Says bye to the consumers still there and checks that they passed. */
static void finish(fleet *f, size_t skip) {
  for (size_t i = 0; i < CONSUMERS; i++) {
    if (i == skip) continue;
    CHECK_RC(tshare_channel_send_bye(f->chs[i], 0, 1000), TSHARE_OK, tshare_channel_last_error(f->chs[i]));
    CHECK_CHILD_OK(f->pids[i]);
  }
  for (size_t i = 0; i < CONSUMERS; i++) tshare_channel_close(f->chs[i]);
}

TS_TEST(three_consumers_get_the_same_set_and_all_releases_are_awaited) {
  void (*const fns[CONSUMERS])(int) = {consumer_0, consumer_1, consumer_2};
  fleet f = start_consumers(fns);
  tshare_host_buffer *buf = new_buffer();
  tshare_set_builder *b = build_set(buf);
  uint64_t ids[CONSUMERS];
  tshare_error results[CONSUMERS];
  CHECK_RC(tshare_set_send_all(b, f.chs, CONSUMERS, NULL, 10000, ids, results), TSHARE_OK, results[0].message);
  tshare_set_builder_destroy(b); /* each sent set keeps its own references */
  for (size_t i = 0; i < CONSUMERS; i++) {
    CHECK(ids[i] != 0);
    CHECK_RC(results[i].code, TSHARE_OK, results[i].message);
    CHECK_EQ(tshare_channel_outstanding(f.chs[i]), 1);
  }
  CHECK(tshare_host_buffer_outstanding(buf) > 0);
  CHECK_RC(tshare_set_wait_all(f.chs, ids, CONSUMERS, 10000, results), TSHARE_OK, results[0].message);
  for (size_t i = 0; i < CONSUMERS; i++) {
    CHECK_RC(results[i].code, TSHARE_OK, results[i].message);
    CHECK_EQ(tshare_share_is_released(f.chs[i], ids[i]), 1);
    CHECK_EQ(tshare_channel_outstanding(f.chs[i]), 0);
  }
  CHECK_EQ(tshare_host_buffer_outstanding(buf), 0);
  finish(&f, CONSUMERS);
  tshare_host_buffer_destroy(buf);
}

TS_TEST(a_consumer_killed_before_receiving_fails_alone_and_is_named) {
  void (*const fns[CONSUMERS])(int) = {consumer_0, consumer_killed_before_receiving, consumer_2};
  fleet f = start_consumers(fns);
  CHECK(kill(f.pids[1], SIGKILL) == 0);
  int st = wait_child(f.pids[1]); /* reaped: its end of the socket is closed */
  CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
  tshare_host_buffer *buf = new_buffer();
  tshare_set_builder *b = build_set(buf);
  uint64_t ids[CONSUMERS];
  tshare_error results[CONSUMERS];
  int rc = tshare_set_send_all(b, f.chs, CONSUMERS, NULL, 10000, ids, results);
  tshare_set_builder_destroy(b);
  CHECK(rc < 0);
  CHECK_EQ(results[1].code, rc); /* the first (and only) failure */
  CHECK(ids[1] == 0);
  char pid_text[32];
  snprintf(pid_text, sizeof pid_text, "pid %d", (int)f.pids[1]);
  if (!strstr(results[1].message, "consumer-1") || !strstr(results[1].message, pid_text))
    TS_FAIL("the failure does not name the dead consumer (%s): %s", pid_text, results[1].message);
  printf("consumer 1: %s: %s\n", tshare_status_name(rc), results[1].message);
  for (size_t i = 0; i < CONSUMERS; i += 2) {
    CHECK_RC(results[i].code, TSHARE_OK, results[i].message);
    CHECK(ids[i] != 0);
  }
  /* The two living consumers got the set and give it back; the failed send
   * has nothing to wait for. */
  CHECK_RC(tshare_set_wait_all(f.chs, ids, CONSUMERS, 10000, results), TSHARE_OK, results[0].message);
  for (size_t i = 0; i < CONSUMERS; i++) CHECK_RC(results[i].code, TSHARE_OK, results[i].message);
  CHECK_EQ(tshare_host_buffer_outstanding(buf), 0);
  finish(&f, 1);
  tshare_host_buffer_destroy(buf);
}

TS_TEST(a_consumer_holding_past_the_deadline_times_out_alone) {
  CHECK(pipe(hold_until) == 0);
  holder = 2;
  void (*const fns[CONSUMERS])(int) = {consumer_0, consumer_1, consumer_2};
  fleet f = start_consumers(fns);
  close(hold_until[0]);
  tshare_host_buffer *buf = new_buffer();
  tshare_set_builder *b = build_set(buf);
  uint64_t ids[CONSUMERS];
  CHECK_RC(tshare_set_send_all(b, f.chs, CONSUMERS, NULL, 10000, ids, NULL), TSHARE_OK, "no results asked for");
  tshare_set_builder_destroy(b);
  /* Consumers 0 and 1 release; 2 holds on until the pipe says. */
  tshare_error results[CONSUMERS];
  CHECK_RC(tshare_set_wait_all(f.chs, ids, CONSUMERS, 300, results), TSHARE_E_TIMEOUT, results[2].message);
  CHECK_RC(results[0].code, TSHARE_OK, results[0].message);
  CHECK_RC(results[1].code, TSHARE_OK, results[1].message);
  CHECK_EQ(results[2].code, TSHARE_E_TIMEOUT);
  CHECK(strstr(results[2].message, "consumer-2") && strstr(results[2].message, "not released"));
  CHECK_EQ(tshare_share_is_released(f.chs[0], ids[0]), 1);
  CHECK_EQ(tshare_share_is_released(f.chs[2], ids[2]), 0);
  /* Told to let go, it does; waiting again on all of them is fine. */
  CHECK(write(hold_until[1], "x", 1) == 1);
  CHECK_RC(tshare_set_wait_all(f.chs, ids, CONSUMERS, 10000, NULL), TSHARE_OK, "second wait");
  CHECK_EQ(tshare_host_buffer_outstanding(buf), 0);
  close(hold_until[1]);
  finish(&f, CONSUMERS);
  tshare_host_buffer_destroy(buf);
}

TS_TEST(bad_arguments_are_refused_per_consumer_or_as_a_whole) {
  int sock;
  pid_t pid = fork_with_socket(consumer_0, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer *buf = new_buffer();
  tshare_set_builder *b = build_set(buf);
  uint64_t ids[2] = {99, 99};
  tshare_error results[2];

  /* A NULL channel among good ones: refused alone, the good one gets the set. */
  tshare_channel *chs[2] = {NULL, ch};
  CHECK_RC(tshare_set_send_all(b, chs, 2, NULL, 10000, ids, results), TSHARE_E_INVALID_ARG, results[0].message);
  CHECK(ids[0] == 0 && ids[1] != 0);
  CHECK_EQ(results[0].code, TSHARE_E_INVALID_ARG);
  CHECK(strstr(results[0].message, "consumer 0") && strstr(results[0].message, "NULL"));
  CHECK_RC(results[1].code, TSHARE_OK, results[1].message);
  CHECK_RC(tshare_set_wait_all(chs, ids, 2, 10000, results), TSHARE_E_INVALID_ARG, results[1].message);
  CHECK_EQ(results[0].code, TSHARE_E_INVALID_ARG);
  CHECK_RC(results[1].code, TSHARE_OK, results[1].message);
  CHECK_EQ(tshare_share_is_released(ch, ids[1]), 1);

  /* Missing lists or builder: refused as a whole, nothing sent. */
  CHECK_EQ(tshare_set_send_all(b, NULL, 1, NULL, 0, ids, results), TSHARE_E_INVALID_ARG);
  CHECK_EQ(results[0].code, TSHARE_E_INVALID_ARG);
  CHECK_EQ(tshare_set_send_all(b, &ch, 1, NULL, 0, NULL, NULL), TSHARE_E_INVALID_ARG);
  CHECK_EQ(tshare_set_send_all(NULL, &ch, 1, NULL, 0, ids, results), TSHARE_E_INVALID_ARG);
  CHECK(ids[0] == 0 && strstr(results[0].message, "builder"));
  CHECK_EQ(tshare_set_wait_all(NULL, ids, 1, 0, NULL), TSHARE_E_INVALID_ARG);
  CHECK_EQ(tshare_set_wait_all(&ch, NULL, 1, 0, NULL), TSHARE_E_INVALID_ARG);
  CHECK_EQ(tshare_set_send_all(b, NULL, 0, NULL, 0, NULL, NULL), TSHARE_OK); /* no consumers: nothing to do */
  CHECK_EQ(tshare_set_wait_all(NULL, NULL, 0, 0, NULL), TSHARE_OK);
  CHECK_EQ(tshare_channel_outstanding(ch), 0);

  tshare_set_builder_destroy(b);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 1000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
  tshare_host_buffer_destroy(buf);
}

TS_TEST_MAIN
