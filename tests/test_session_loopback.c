/* The session over the loopback transport: two channel ends in one
 * process, opened on ts_loopback_pair()'s fds, carry frames, fds and host
 * shares with no socket between them; the end's close reads as the peer's
 * end; fds that are not a loopback end are refused. */
#include "harness.h"
#include "session.h"
#include "tshare/share.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

/* Opening blocks in the hello until the other end says its own: the second
 * end opens on a thread of its own. */
typedef struct opening {
  int fds[2];
  const char *name;
  tshare_channel *ch;
  int rc;
  char message[TSHARE_ERROR_MSG_MAX];
} opening;

static void *open_end(void *arg) {
  opening *o = arg;
  tshare_channel_options opts;
  tshare_channel_options_init(&opts);
  opts.name = o->name;
  tshare_error err;
  o->rc = ts_channel_open_on(TS_CONN_LOOPBACK, o->fds[0], o->fds[1], &opts, &o->ch, &err);
  snprintf(o->message, sizeof o->message, "%s", err.message);
  return NULL;
}

/* Both ends of a fresh loopback pair, opened. */
static void open_pair(tshare_channel **a, tshare_channel **b) {
  opening ends[2] = {{.name = "left"}, {.name = "right"}};
  CHECK_RC(ts_loopback_pair(ends[0].fds, ends[1].fds), TSHARE_OK, "");
  pthread_t t;
  CHECK(pthread_create(&t, NULL, open_end, &ends[1]) == 0);
  open_end(&ends[0]);
  pthread_join(t, NULL);
  CHECK_RC(ends[0].rc, TSHARE_OK, ends[0].message);
  CHECK_RC(ends[1].rc, TSHARE_OK, ends[1].message);
  *a = ends[0].ch;
  *b = ends[1].ch;
}

TS_TEST(a_loopback_pair_says_what_it_can_do) {
  tshare_channel *a, *b;
  open_pair(&a, &b);
  uint32_t caps = ts_conn_caps(&a->conn);
  CHECK(caps & TS_TRANSPORT_PASSES_FDS);
  CHECK(caps & TS_TRANSPORT_SAME_HOST);
  CHECK(!(caps & TS_TRANSPORT_PEER_CREDENTIALS)); /* no kernel between the ends */
  CHECK(!(caps & TS_TRANSPORT_SHARED_MEMORY));    /* no ring rides on it */
  CHECK(strcmp(tshare_channel_peer(a)->name, "right") == 0);
  CHECK(strcmp(tshare_channel_peer(b)->name, "left") == 0);
  tshare_channel_close(a);
  tshare_channel_close(b);
}

TS_TEST(frames_carry_fds_and_a_close_ends_the_peers_stream) {
  tshare_channel *a, *b;
  open_pair(&a, &b);
  int p[2];
  CHECK(pipe(p) == 0);
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_BYE; /* any frame: the flag says an fd rides on it */
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  CHECK_RC(tshare_channel_send_frame(a, &f, p[1], 1000), TSHARE_OK, tshare_channel_last_error(a));
  f.flags = 0;
  CHECK_RC(tshare_channel_send_frame(a, &f, -1, 1000), TSHARE_OK, tshare_channel_last_error(a));
  tshare_frame got;
  int fd = -1;
  CHECK_RC(tshare_channel_recv_frame(b, &got, &fd, 1000), TSHARE_OK, tshare_channel_last_error(b));
  CHECK(fd >= 0 && fd != p[1]); /* a copy of the sender's */
  struct stat sent, received;
  CHECK(fstat(p[1], &sent) == 0 && fstat(fd, &received) == 0);
  CHECK(sent.st_ino == received.st_ino);
  CHECK(write(fd, "x", 1) == 1); /* the same pipe */
  char c = 0;
  CHECK(read(p[0], &c, 1) == 1 && c == 'x');
  close(fd);
  CHECK_RC(tshare_channel_recv_frame(b, &got, &fd, 1000), TSHARE_OK, tshare_channel_last_error(b));
  CHECK_EQ(fd, -1);
  CHECK_RC(tshare_channel_recv_frame(b, &got, &fd, 50), TSHARE_E_TIMEOUT, tshare_channel_last_error(b));
  tshare_channel_close(a); /* says bye, then the stream ends */
  CHECK_RC(tshare_channel_recv_frame(b, &got, &fd, 1000), TSHARE_OK, tshare_channel_last_error(b));
  CHECK_EQ(got.type, TSHARE_FRAME_BYE);
  CHECK_RC(tshare_channel_recv_frame(b, &got, &fd, 1000), TSHARE_E_PEER_CLOSED, tshare_channel_last_error(b));
  tshare_channel_close(b);
  close(p[0]);
  close(p[1]);
}

/* The consumer end: one view, its contents checked, released. */
static void *consume_one(void *arg) {
  tshare_channel *ch = arg;
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  const int *p = tshare_view_data(v);
  for (int i = 0; i < 100; i++)
    if (p[i] != 3 * i) TS_FAIL("shared[%d] = %d", i, p[i]);
  tshare_view_release(v);
  (void)tshare_channel_poll(ch, 0); /* the driving thread's release goes out when it drives */
  return NULL;
}

TS_TEST(a_host_share_goes_over_loopback_and_its_release_comes_back) {
  tshare_channel *producer, *consumer;
  open_pair(&producer, &consumer);
  tshare_host_buffer *buf;
  CHECK_RC(tshare_host_buffer_create(1 << 16, "tshare-test-loopback", &buf, NULL), TSHARE_OK, "");
  int *p = tshare_host_buffer_data(buf);
  for (int i = 0; i < 100; i++) p[i] = 3 * i;
  int64_t n = 100;
  tshare_tensor_desc t = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, &n, 0);
  pthread_t thread;
  CHECK(pthread_create(&thread, NULL, consume_one, consumer) == 0);
  uint64_t id;
  CHECK_RC(tshare_share_host(producer, buf, &t, "ints", NULL, 5000, &id), TSHARE_OK,
           tshare_channel_last_error(producer));
  CHECK_RC(tshare_channel_wait_released(producer, id, 5000), TSHARE_OK, tshare_channel_last_error(producer));
  pthread_join(thread, NULL);
  CHECK_EQ(tshare_host_buffer_outstanding(buf), 0u);
  tshare_host_buffer_destroy(buf);
  tshare_channel_close(producer);
  tshare_channel_close(consumer);
}

TS_TEST(fds_that_are_no_loopback_end_are_refused) {
  int p[2];
  CHECK(pipe(p) == 0);
  tshare_channel *ch = NULL;
  tshare_error err;
  CHECK_RC(ts_channel_open_on(TS_CONN_LOOPBACK, p[0], p[1], NULL, &ch, &err), TSHARE_E_INVALID_ARG, err.message);
  CHECK(ch == NULL);
  CHECK(strstr(err.message, "loopback") != NULL);
}

TS_TEST_MAIN
