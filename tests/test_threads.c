/* The thread rule, enforced: one thread at a time calls a channel (only
 * tshare_view_release runs beside it). A call made while another thread is
 * inside one is refused with TSHARE_E_BUSY instead of corrupting the
 * channel; a close while another thread waits wakes it and finishes once
 * that call returned. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/share.h"

#include <pthread.h>
#include <time.h>

#define SENDERS 8
#define SENDS_EACH 200

static tshare_tensor_desc one_float(void) {
  tshare_dtype f32 = {TSHARE_DTYPE_FLOAT, 32, 1};
  int64_t n = 1;
  return tshare_tensor_contiguous(f32, 1, &n, 0);
}

/* The peer: releases every share at once, until bye. */
static void consumer_releases_everything(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  for (;;) {
    tshare_view *v;
    int rc = tshare_view_recv(ch, 20000, &v);
    if (rc == TSHARE_END) break;
    CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(ch));
    tshare_view_release(v);
  }
  tshare_channel_close(ch);
}

typedef struct sender {
  pthread_t thread;
  tshare_channel *ch;
  tshare_host_buffer *buf;
  uint64_t ids[SENDS_EACH];
  int sent, refused;
  char other[TSHARE_ERROR_MSG_MAX]; /* the first status that is neither OK nor BUSY */
} sender;

static void *send_many(void *arg) {
  sender *s = arg;
  tshare_tensor_desc d = one_float();
  for (int i = 0; i < SENDS_EACH; i++) {
    uint64_t id = 0;
    int rc = tshare_share_host(s->ch, s->buf, &d, NULL, NULL, 10000, &id);
    if (rc == TSHARE_OK) {
      s->ids[s->sent++] = id;
    } else if (rc == TSHARE_E_BUSY && strstr(tshare_channel_last_error(s->ch), "one thread at a time")) {
      s->refused++;
    } else if (!s->other[0]) {
      snprintf(s->other, sizeof s->other, "%s: %s", tshare_status_name(rc), tshare_channel_last_error(s->ch));
    }
  }
  return NULL;
}

static int by_value(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

TS_TEST(eight_threads_sending_on_one_channel_get_unique_ids_or_busy) {
  int sock;
  pid_t consumer = fork_with_socket(consumer_releases_everything, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-threads", &buf, NULL), TSHARE_OK, "");
  static sender s[SENDERS];
  for (int t = 0; t < SENDERS; t++) {
    s[t].ch = ch;
    s[t].buf = buf;
    CHECK(pthread_create(&s[t].thread, NULL, send_many, &s[t]) == 0);
  }
  static uint64_t all[SENDERS * SENDS_EACH];
  int n = 0;
  for (int t = 0; t < SENDERS; t++) {
    CHECK(pthread_join(s[t].thread, NULL) == 0);
    if (s[t].other[0]) TS_FAIL("thread %d: %s", t, s[t].other);
    CHECK_EQ(s[t].sent + s[t].refused, SENDS_EACH);
    for (int i = 0; i < s[t].sent; i++) all[n++] = s[t].ids[i];
  }
  printf("%d shares sent, %d calls refused as busy\n", n, SENDERS * SENDS_EACH - n);
  CHECK(n > 0);
  qsort(all, (size_t)n, sizeof *all, by_value);
  for (int i = 1; i < n; i++)
    if (all[i] == all[i - 1]) TS_FAIL("share id %llu handed out twice", (unsigned long long)all[i]);
  CHECK_RC(tshare_channel_wait_released(ch, 0, 20000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  CHECK_EQ(tshare_host_buffer_outstanding(buf), 0);
  for (int i = 0; i < n; i++) CHECK_EQ(tshare_share_is_released(ch, all[i]), 1);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(consumer);
  tshare_host_buffer_destroy(buf);
  tshare_channel_close(ch);
}

/* A thread blocked in a receive on a channel nothing arrives on. */
typedef struct waiter {
  pthread_t thread;
  tshare_channel *ch;
  int timeout_ms;
  int rc;
} waiter;

static void *wait_for_a_share(void *arg) {
  waiter *w = arg;
  tshare_view *v = NULL;
  /* until_busy's polls may be inside when this thread first calls: again */
  while ((w->rc = tshare_view_recv(w->ch, w->timeout_ms, &v)) == TSHARE_E_BUSY) usleep(1000);
  if (v) tshare_view_release(v);
  return NULL;
}

static void start_waiter(waiter *w, tshare_channel *ch, int timeout_ms) {
  w->ch = ch;
  w->timeout_ms = timeout_ms;
  w->rc = 1000;
  CHECK(pthread_create(&w->thread, NULL, wait_for_a_share, w) == 0);
}

/* Until the waiter is inside its call, a poll from here gets in first and
 * finds nothing; from then on it is refused as busy (within 5 s). */
static void until_busy(tshare_channel *ch) {
  for (int i = 0; i < 5000; i++) {
    int rc = tshare_channel_poll(ch, 0);
    if (rc == TSHARE_E_BUSY) return;
    CHECK_RC(rc, TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
    usleep(1000);
  }
  TS_FAIL("the waiting thread never got inside its receive");
}

/* pthread_join, failing the test if the thread has not returned in time. */
static void join_within(pthread_t t, int seconds) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += seconds;
  int rc = pthread_timedjoin_np(t, NULL, &until);
  if (rc != 0) TS_FAIL("the waiting thread did not return within %d s (%s)", seconds, strerror(rc));
}

TS_TEST(a_call_while_another_thread_waits_is_refused_as_busy) {
  int sock;
  pid_t consumer = fork_with_socket(consumer_releases_everything, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  waiter w;
  start_waiter(&w, ch, 2000);
  until_busy(ch);
  CHECK(strstr(tshare_channel_last_error(ch), "poll: another thread is inside a call on channel 'producer'"));
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-threads", &buf, NULL), TSHARE_OK, "");
  tshare_tensor_desc d = one_float();
  uint64_t id = 9;
  int rc = tshare_share_host(ch, buf, &d, NULL, NULL, 1000, &id);
  if (rc != TSHARE_OK) { /* else the waiter timed out first, and the share went */
    CHECK_RC(rc, TSHARE_E_BUSY, tshare_channel_last_error(ch));
    CHECK_EQ(id, 0);
    CHECK_EQ(tshare_host_buffer_outstanding(buf), 0);
    CHECK_EQ(tshare_channel_outstanding(ch), 0);
  }
  join_within(w.thread, 10);
  CHECK_RC(w.rc, TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
  /* The waiter is out: this thread may call again. */
  CHECK_RC(tshare_channel_poll(ch, 0), TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(consumer);
  tshare_channel_close(ch);
  tshare_host_buffer_destroy(buf);
}

TS_TEST(close_while_another_thread_waits_wakes_it_and_closes_after_it) {
  int sock;
  pid_t consumer = fork_with_socket(consumer_releases_everything, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  waiter w;
  start_waiter(&w, ch, -1); /* would wait forever */
  until_busy(ch);
  tshare_channel_close(ch); /* returns at once; the waiter finishes the close */
  join_within(w.thread, 5);
  CHECK_RC(w.rc, TSHARE_E_STATE, "the receive cut short by the close");
  CHECK_CHILD_OK(consumer); /* it saw the bye of a clean close */
}

/* A producer that shares one buffer OWED times, then reads nothing until
 * told: the consumer's releases find no room. (More than a handful: a few
 * releases wait to go out together, and would not be sent at all.) */
#define OWED 20
static int go[2];
static void producer_that_stops_reading(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "producer", NULL, NULL);
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-threads", &buf, NULL), TSHARE_OK, "");
  tshare_tensor_desc d = one_float();
  uint64_t id;
  for (int i = 0; i < OWED; i++)
    CHECK_RC(tshare_share_host(ch, buf, &d, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  char b;
  CHECK(read(go[0], &b, 1) == 1);
  tshare_channel_close(ch);
  tshare_host_buffer_destroy(buf);
}

TS_TEST(close_wakes_a_receive_whose_releases_find_no_room) {
  CHECK(pipe(go) == 0);
  int sock;
  pid_t producer = fork_with_socket(producer_that_stops_reading, &sock);
  tshare_channel *ch = open_socket_channel(sock, "consumer", NULL, NULL);
  tshare_view *v[OWED];
  for (int i = 0; i < OWED; i++) CHECK_RC(tshare_view_recv(ch, 5000, &v[i]), TSHARE_OK, tshare_channel_last_error(ch));
  /* Fill the producer's side (ring or socket) until a frame finds no room. */
  int frames = 0;
  while (tshare_channel_send_error(ch, TSHARE_E_INVALID_ARG, "filler: the producer reads none of these") ==
         TSHARE_OK)
    CHECK(++frames < 1000000);
  for (int i = 0; i < OWED; i++) tshare_view_release(v[i]); /* owed now, with no room for them */
  waiter w;
  start_waiter(&w, ch, -1);
  until_busy(ch);
  tshare_channel_close(ch);
  join_within(w.thread, 5);
  CHECK_RC(w.rc, TSHARE_E_STATE, "the receive cut short by the close");
  CHECK(write(go[1], "x", 1) == 1);
  CHECK_CHILD_OK(producer);
}

TS_TEST_MAIN
