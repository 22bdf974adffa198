/* Host-memory shares between two real processes: contents, the import cache,
 * the lifetime protocol (release frees, a dead consumer frees everything),
 * releases from other threads, and hostile shares. */
#include "frame_util.h"
#include "harness.h"
#include "proc_util.h"
#include "tshare/share.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <time.h>

static tshare_tensor_desc desc_1d(tshare_dtype dt, int64_t n, uint64_t offset) {
  return tshare_tensor_contiguous(dt, 1, &n, offset);
}

static const tshare_dtype F32 = {TSHARE_DTYPE_FLOAT, 32, 1};
static const tshare_dtype I64 = {TSHARE_DTYPE_INT, 64, 1};

/* The producer end of a test: a forked consumer running fn, a channel to it
 * and a host buffer of size bytes named name. */
typedef struct producer_end {
  pid_t consumer;
  tshare_channel *ch;
  tshare_host_buffer *buf;
} producer_end;

static producer_end start_producer(void (*fn)(int), size_t size, const char *name) {
  producer_end p;
  int sock;
  p.consumer = fork_with_socket(fn, &sock);
  p.ch = open_socket_channel(sock, "producer", NULL, NULL);
  CHECK_RC(tshare_host_buffer_create(size, name, &p.buf, NULL), TSHARE_OK, "");
  return p;
}

/* Bye, the consumer exits cleanly, then the buffer and the channel go. */
static void end_producer(producer_end *p) {
  CHECK_RC(tshare_channel_send_bye(p->ch, 0, 1000), TSHARE_OK, tshare_channel_last_error(p->ch));
  CHECK_CHILD_OK(p->consumer);
  tshare_host_buffer_destroy(p->buf);
  tshare_channel_close(p->ch);
}

/* ---- contents, layouts and writes back ----------------------------------- */

static void consumer_checks_contents(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  tshare_view *v[3];
  for (int i = 0; i < 3; i++) CHECK_RC(tshare_view_recv(ch, 5000, &v[i]), TSHARE_OK, tshare_channel_last_error(ch));
  /* 0: 1000 floats, value 0.5*i */
  CHECK(strcmp(tshare_view_tag(v[0]), "floats") == 0);
  const float *f = tshare_view_data(v[0]);
  CHECK_EQ(tshare_view_desc(v[0])->shape[0], 1000);
  for (int i = 0; i < 1000; i++)
    if (f[i] != 0.5f * (float)i) TS_FAIL("floats[%d] = %f", i, (double)f[i]);
  /* 1: a transposed 3x4 view of a row-major 4x3 int64 matrix m[r][c] = 10r + c */
  const tshare_tensor_desc *d = tshare_view_desc(v[1]);
  CHECK_EQ(d->ndim, 2);
  CHECK_EQ(d->strides[0], 1);
  CHECK_EQ(d->strides[1], 3);
  const int64_t *m = tshare_view_data(v[1]);
  for (int64_t r = 0; r < 3; r++)
    for (int64_t c = 0; c < 4; c++) CHECK_EQ(m[r * d->strides[0] + c * d->strides[1]], 10 * c + r);
  /* 2: same allocation as 0: mapped once, so the bases coincide */
  CHECK((char *)tshare_view_data(v[2]) - tshare_view_desc(v[2])->byte_offset ==
        (char *)tshare_view_data(v[0]) - tshare_view_desc(v[0])->byte_offset);
  CHECK_EQ(count_mappings("memfd:tshare-test-a"), 1);
  /* Write through a view: the producer sees it. */
  int64_t *w = tshare_view_data(v[2]);
  w[0] = 424242;
  for (int i = 0; i < 3; i++) tshare_view_release(v[i]);
  /* Kept mapped for later shares of the same buffers, until they are
   * retired or the channel goes. */
  CHECK_EQ(count_mappings("memfd:tshare-test"), 2);
  tshare_view *none;
  CHECK_RC(tshare_view_recv(ch, 5000, &none), TSHARE_END, tshare_channel_last_error(ch));
  CHECK(none == NULL);
  tshare_channel_close(ch);
  CHECK_EQ(count_mappings("memfd:tshare-test"), 0);
}

TS_TEST(host_share_contents_layouts_and_writes) {
  int sock;
  pid_t pid = fork_with_socket(consumer_checks_contents, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer *a, *b;
  tshare_error err;
  CHECK_RC(tshare_host_buffer_create(64 * 1024, "tshare-test-a", &a, &err), TSHARE_OK, err.message);
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-test-b", &b, &err), TSHARE_OK, err.message);
  float *f = (float *)((char *)tshare_host_buffer_data(a) + 512);
  for (int i = 0; i < 1000; i++) f[i] = 0.5f * (float)i;
  int64_t *m = (int64_t *)((char *)tshare_host_buffer_data(b) + 64);
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 3; c++) m[r * 3 + c] = 10 * r + c;
  tshare_tensor_desc t0 = desc_1d(F32, 1000, 512);
  tshare_tensor_desc t1;
  memset(&t1, 0, sizeof t1);
  t1.dtype = I64;
  t1.ndim = 2;
  t1.shape[0] = 3;
  t1.shape[1] = 4;
  t1.strides[0] = 1;
  t1.strides[1] = 3;
  t1.byte_offset = 64;
  tshare_tensor_desc t2 = desc_1d(I64, 8, 32768);
  uint64_t ids[3];
  CHECK_RC(tshare_share_host(ch, a, &t0, "floats", NULL, 5000, &ids[0]), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_share_host(ch, b, &t1, "transposed", NULL, 5000, &ids[1]), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_share_host(ch, a, &t2, NULL, NULL, 5000, &ids[2]), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_host_buffer_outstanding(a), 2);
  CHECK_EQ(tshare_channel_outstanding(ch), 3);
  CHECK_RC(tshare_channel_wait_released(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  for (int i = 0; i < 3; i++) CHECK_EQ(tshare_share_is_released(ch, ids[i]), 1);
  CHECK_EQ(tshare_host_buffer_outstanding(a), 0);
  CHECK_EQ(((int64_t *)((char *)tshare_host_buffer_data(a) + 32768))[0], 424242);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_host_buffer_destroy(a);
  tshare_host_buffer_destroy(b);
  tshare_channel_close(ch);
}

/* ---- argument checks that need no second process -------------------------- */

static void handshake_then_wait_bye(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "idle consumer", NULL, NULL);
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(share_refuses_bad_views_and_tags) {
  producer_end p = start_producer(handshake_then_wait_bye, 4096, "tshare-test-a");
  tshare_channel *ch = p.ch;
  tshare_host_buffer *a = p.buf;
  tshare_tensor_desc t = desc_1d(F32, 1025, 0); /* one float too many */
  CHECK_RC(tshare_share_host(ch, a, &t, NULL, NULL, 1000, NULL), TSHARE_E_OUT_OF_BOUNDS, tshare_channel_last_error(ch));
  t = desc_1d(F32, 4, 0);
  char tag[TSHARE_TAG_MAX + 2];
  memset(tag, 'x', sizeof tag - 1);
  tag[sizeof tag - 1] = '\0';
  CHECK_RC(tshare_share_host(ch, a, &t, tag, NULL, 1000, NULL), TSHARE_E_TOO_LARGE, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_host_buffer_outstanding(a), 0); /* failed shares hold nothing */
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  end_producer(&p);
}

/* ---- the lifetime protocol ------------------------------------------------- */

static int released_ok, released_dropped;
static void count_releases(void *user, uint64_t id, void *user_data, int status) {
  (void)user;
  (void)id;
  (void)user_data;
  if (status == TSHARE_OK)
    released_ok++;
  else
    released_dropped++;
}

static void consumer_holds_then_releases(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "consumer", NULL, NULL);
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  /* Wait until the producer says it has dropped its own handle. */
  tshare_frame f;
  int got_fd;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &got_fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(f.type, TSHARE_FRAME_BYE);
  CHECK_EQ(((int *)tshare_view_data(v))[10], 10); /* still readable: the share keeps it alive */
  tshare_view_release(v);
  tshare_channel_close(ch); /* close flushes the release */
}

TS_TEST(release_frees_the_memory) {
  int sock;
  pid_t pid = fork_with_socket(consumer_holds_then_releases, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", count_releases, NULL);
  int fds_before = count_open_fds();
  tshare_host_buffer *a;
  CHECK_RC(tshare_host_buffer_create(1 << 20, "tshare-test-free", &a, NULL), TSHARE_OK, "");
  int *p = tshare_host_buffer_data(a);
  for (int i = 0; i < 100; i++) p[i] = i;
  tshare_tensor_desc t = desc_1d((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 100, 0);
  uint64_t id;
  CHECK_RC(tshare_share_host(ch, a, &t, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_host_buffer_destroy(a); /* the creator lets go; the share still holds it */
  CHECK_EQ(count_mappings("tshare-test-free"), 1);
  CHECK_EQ(count_open_fds(), fds_before + 1);
  CHECK_EQ(tshare_share_is_released(ch, id), 0);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, "");
  CHECK_RC(tshare_channel_wait_released(ch, id, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(released_ok, 1);
  CHECK_EQ(released_dropped, 0);
  CHECK_EQ(count_mappings("tshare-test-free"), 0); /* unmapped and closed */
  CHECK_EQ(count_open_fds(), fds_before);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

enum { STREAM = 200, HOLD = 37 };

static tshare_view *volatile held_at_death[HOLD]; /* reachable: held on purpose, not leaked */

static void consumer_dies_holding(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "doomed consumer", NULL, NULL);
  for (int i = 0; i < HOLD; i++) {
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    if (i % 2)
      tshare_view_release(v); /* some released, the rest held at death */
    else
      held_at_death[i] = v;
  }
  raise(SIGKILL);
}

TS_TEST(consumer_killed_mid_stream_frees_everything) {
  int sock;
  pid_t pid = fork_with_socket(consumer_dies_holding, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", count_releases, NULL);
  int fds_before = count_open_fds();
  tshare_host_buffer *bufs[4];
  for (int b = 0; b < 4; b++)
    CHECK_RC(tshare_host_buffer_create(1 << 16, "tshare-test-stream", &bufs[b], NULL), TSHARE_OK, "");
  int sent = 0, rc = TSHARE_OK;
  for (; sent < STREAM; sent++) {
    tshare_tensor_desc t = desc_1d(F32, 16, (uint64_t)(sent % 100) * 64);
    rc = tshare_share_host(ch, bufs[sent % 4], &t, NULL, NULL, 5000, NULL);
    if (rc != TSHARE_OK) break; /* the consumer may already be dead */
  }
  CHECK(rc == TSHARE_OK || rc == TSHARE_E_PEER_CLOSED);
  for (int b = 0; b < 4; b++) tshare_host_buffer_destroy(bufs[b]);
  int st = wait_child(pid);
  CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
  /* The disconnect releases everything the consumer held or never read. */
  CHECK_RC(tshare_channel_wait_released(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  CHECK_EQ(released_ok + released_dropped, sent);
  CHECK(released_dropped >= HOLD / 2);
  printf("sent %d, released %d, dropped at disconnect %d\n", sent, released_ok, released_dropped);
  CHECK_EQ(count_mappings("tshare-test-stream"), 0);
  CHECK_EQ(count_open_fds(), fds_before);
  tshare_channel_close(ch);
}

TS_TEST(producer_close_drops_unreleased_shares) {
  int sock;
  pid_t pid = fork_with_socket(handshake_then_wait_bye, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", count_releases, NULL);
  tshare_host_buffer *a;
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-test-close", &a, NULL), TSHARE_OK, "");
  tshare_tensor_desc t = desc_1d(F32, 4, 0);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 1000), TSHARE_OK, "");
  tshare_host_buffer_destroy(a);
  CHECK_EQ(count_mappings("tshare-test-close"), 0); /* never shared: freed at once */
  CHECK_RC(tshare_host_buffer_create(4096, "tshare-test-close", &a, NULL), TSHARE_OK, "");
  CHECK_CHILD_OK(pid); /* the consumer is gone without releasing */
  int rc = tshare_share_host(ch, a, &t, NULL, NULL, 1000, NULL);
  CHECK(rc == TSHARE_OK || rc == TSHARE_E_PEER_CLOSED);
  tshare_host_buffer_destroy(a);
  tshare_channel_close(ch); /* whatever is outstanding is dropped, memory freed */
  CHECK_EQ(count_mappings("tshare-test-close"), 0);
}

/* ---- releases from another thread ------------------------------------------ */

static void *release_later(void *arg) {
  struct timespec ts = {0, 100 * 1000000};
  nanosleep(&ts, NULL);
  tshare_view_release(arg);
  return NULL;
}

static void consumer_releases_on_a_thread(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "threaded consumer", NULL, NULL);
  for (int round = 0; round < 3; round++) {
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(*(int *)tshare_view_data(v), round);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, release_later, v) == 0);
    /* Blocks for the next share while the thread releases this one: the
     * release must go out now, or producer and consumer wait on each other. */
    pthread_detach(t);
  }
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(release_from_another_thread_wakes_a_blocked_receiver) {
  producer_end p = start_producer(consumer_releases_on_a_thread, 4096, "tshare-test-thread");
  tshare_channel *ch = p.ch;
  tshare_host_buffer *a = p.buf;
  tshare_tensor_desc t = desc_1d((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, 0);
  for (int round = 0; round < 3; round++) {
    *(int *)tshare_host_buffer_data(a) = round; /* reuse the memory only once it is released */
    uint64_t id;
    CHECK_RC(tshare_share_host(ch, a, &t, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_RC(tshare_channel_wait_released(ch, id, 3000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  end_producer(&p);
}

/* The driving thread is busy elsewhere (here: blocked outside tshare until
 * the producer says it got the releases) while a worker thread releases: the
 * releases must reach the producer without the driving thread's help. */
static int producer_done[2]; /* a pipe: the producer writes one byte when it is done waiting */

static void *release_all(void *arg) {
  tshare_view **views = arg;
  for (int i = 0; i < 3; i++) tshare_view_release(views[i]);
  return NULL;
}

static void consumer_busy_while_a_worker_releases(int fd) {
  close(producer_done[1]);
  tshare_channel *ch = open_socket_channel(fd, "busy consumer", NULL, NULL);
  tshare_view *views[3];
  for (int i = 0; i < 3; i++) CHECK_RC(tshare_view_recv(ch, 5000, &views[i]), TSHARE_OK, tshare_channel_last_error(ch));
  pthread_t t;
  CHECK(pthread_create(&t, NULL, release_all, views) == 0);
  CHECK(pthread_join(t, NULL) == 0);
  char byte;
  CHECK(read(producer_done[0], &byte, 1) == 1); /* not driving the channel meanwhile */
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(release_from_another_thread_goes_out_while_the_receiver_is_busy) {
  CHECK(pipe(producer_done) == 0);
  producer_end p = start_producer(consumer_busy_while_a_worker_releases, 4096, "tshare-test-busy");
  tshare_channel *ch = p.ch;
  tshare_host_buffer *a = p.buf;
  close(producer_done[0]);
  tshare_tensor_desc t = desc_1d((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 4, 0);
  for (int i = 0; i < 3; i++)
    CHECK_RC(tshare_share_host(ch, a, &t, NULL, NULL, 5000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, 3000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  CHECK(write(producer_done[1], "x", 1) == 1);
  close(producer_done[1]);
  end_producer(&p);
}

/* Two worker threads release while the driving thread keeps receiving:
 * their releases and the driving thread's frames share one socket, so this
 * is where they could cut into each other. The producer reuses each of 32
 * slots only once its share came back. */
enum { RACE_SHARES = 4000, RACE_WINDOW = 32 };

static struct {
  pthread_mutex_t lock;
  pthread_cond_t more;
  tshare_view *views[RACE_SHARES];
  int head, tail;
  bool done;
  int wrong;
} race = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, {0}, 0, 0, false, 0};

static void *race_releaser(void *arg) {
  (void)arg;
  for (;;) {
    pthread_mutex_lock(&race.lock);
    while (race.head == race.tail && !race.done) pthread_cond_wait(&race.more, &race.lock);
    if (race.head == race.tail) {
      pthread_mutex_unlock(&race.lock);
      return NULL;
    }
    int i = race.head++;
    tshare_view *v = race.views[i];
    pthread_mutex_unlock(&race.lock);
    if (*(const int *)tshare_view_data(v) != i) {
      pthread_mutex_lock(&race.lock);
      race.wrong++;
      pthread_mutex_unlock(&race.lock);
    }
    tshare_view_release(v);
  }
}

static void consumer_receives_while_workers_release(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "racing consumer", NULL, NULL);
  pthread_t workers[2];
  for (int w = 0; w < 2; w++) CHECK(pthread_create(&workers[w], NULL, race_releaser, NULL) == 0);
  for (int i = 0;; i++) {
    tshare_view *v;
    int rc = tshare_view_recv(ch, 5000, &v);
    if (rc == TSHARE_END) break;
    CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(ch));
    CHECK(i < RACE_SHARES);
    pthread_mutex_lock(&race.lock);
    race.views[race.tail++] = v;
    pthread_cond_signal(&race.more);
    pthread_mutex_unlock(&race.lock);
  }
  pthread_mutex_lock(&race.lock);
  race.done = true;
  pthread_cond_broadcast(&race.more);
  pthread_mutex_unlock(&race.lock);
  for (int w = 0; w < 2; w++) CHECK(pthread_join(workers[w], NULL) == 0);
  CHECK_EQ(race.tail, RACE_SHARES);
  CHECK_EQ(race.wrong, 0);
  tshare_channel_close(ch);
}

TS_TEST(releases_from_worker_threads_interleave_with_the_driving_thread) {
  producer_end p =
      start_producer(consumer_receives_while_workers_release, RACE_WINDOW * sizeof(int), "tshare-test-race");
  tshare_channel *ch = p.ch;
  tshare_host_buffer *a = p.buf;
  int *slots = tshare_host_buffer_data(a);
  static uint64_t ids[RACE_SHARES];
  for (int i = 0; i < RACE_SHARES; i++) {
    if (i >= RACE_WINDOW)
      CHECK_RC(tshare_channel_wait_released(ch, ids[i - RACE_WINDOW], 5000), TSHARE_OK, tshare_channel_last_error(ch));
    int slot = i % RACE_WINDOW;
    slots[slot] = i;
    tshare_tensor_desc t = desc_1d((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, (uint64_t)slot * sizeof(int));
    CHECK_RC(tshare_share_host(ch, a, &t, NULL, NULL, 5000, &ids[i]), TSHARE_OK, tshare_channel_last_error(ch));
  }
  CHECK_RC(tshare_channel_wait_released(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  end_producer(&p);
}

/* ---- hostile shares ----------------------------------------------------------- */

static int hostile_case;

static void consumer_refuses(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "careful consumer", NULL, NULL);
  tshare_view *v = NULL;
  int want = hostile_case == 0 ? TSHARE_E_PROTOCOL : TSHARE_E_OUT_OF_BOUNDS;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), want, tshare_channel_last_error(ch));
  printf("consumer refused: %s\n", tshare_channel_last_error(ch));
  CHECK(v == NULL);
  /* The refusal released the share, and the channel still works. */
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void send_hostile_share(int kind) {
  hostile_case = kind;
  int sock;
  pid_t pid = fork_with_socket(consumer_refuses, &sock);
  tshare_channel *ch = open_socket_channel(sock, "hostile producer", NULL, NULL);
  /* Case 0: a memfd without seals (could be truncated under the consumer).
   * Case 1: a sealed memfd smaller than the allocation size claimed. */
  int mfd = memfd_create("hostile", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  CHECK(ftruncate(mfd, 4096) == 0);
  if (kind == 1) CHECK(fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0);
  tshare_frame f = memfd_share_frame(kind == 1 ? (1u << 30) : 4096, desc_1d(F32, 16, 0));
  CHECK_RC(tshare_channel_send_frame(ch, &f, mfd, 1000), TSHARE_OK, tshare_channel_last_error(ch));
  close(mfd);
  /* The consumer answers with a release of share 1 before we say bye. */
  tshare_frame g;
  int got;
  CHECK_RC(tshare_channel_recv_frame(ch, &g, &got, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(g.type, TSHARE_FRAME_RELEASE);
  CHECK_EQ(g.u.release.share_ids[0], 1);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 1000), TSHARE_OK, "");
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

TS_TEST(consumer_refuses_unsealed_memfd) { send_hostile_share(0); }
TS_TEST(consumer_refuses_memfd_smaller_than_claimed) { send_hostile_share(1); }

static void pipe_consumer(int unused) {
  (void)unused;
  int rfd, wfd;
  child_pipe_ends(&rfd, &wfd);
  tshare_channel *ch = NULL;
  CHECK_RC(tshare_channel_open_pipes(rfd, wfd, NULL, &ch, NULL), TSHARE_OK, "");
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(host_share_over_pipes_is_refused_clearly) {
  int rfd, wfd;
  pid_t pid = fork_with_pipes(pipe_consumer, &rfd, &wfd);
  tshare_channel *ch = NULL;
  CHECK_RC(tshare_channel_open_pipes(rfd, wfd, NULL, &ch, NULL), TSHARE_OK, "");
  tshare_host_buffer *a;
  CHECK_RC(tshare_host_buffer_create(4096, NULL, &a, NULL), TSHARE_OK, "");
  tshare_tensor_desc t = desc_1d(F32, 4, 0);
  CHECK_RC(tshare_share_host(ch, a, &t, NULL, NULL, 1000, NULL), TSHARE_E_UNSUPPORTED, "");
  CHECK(strstr(tshare_channel_last_error(ch), "open a socket channel") != NULL); /* says what to do */
  CHECK(strstr(tshare_channel_last_error(ch), "socket") != NULL);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 1000), TSHARE_OK, "");
  CHECK_CHILD_OK(pid);
  tshare_host_buffer_destroy(a);
  tshare_channel_close(ch);
}

/* ---- sharing received views on ------------------------------------------ */

static int drops;
static void count_drop(void *keep) {
  CHECK(keep == &drops);
  drops++;
}

static void third_writes_through(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "third", NULL, NULL);
  tshare_view *part, *whole;
  CHECK_RC(tshare_view_recv(ch, 5000, &part), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_view_recv(ch, 5000, &whole), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK(strcmp(tshare_view_tag(part), "every other of 100..119") == 0);
  CHECK(strcmp(tshare_view_tag(whole), "orig") == 0); /* a forward keeps the tag unless given one */
  const tshare_tensor_desc *d = tshare_view_desc(part);
  CHECK_EQ(d->shape[0], 10);
  int32_t *q = tshare_view_data(part);
  for (int i = 0; i < 10; i++) CHECK_EQ(q[i * d->strides[0]], 100 + 2 * i);
  /* Both forwards name one allocation of the forwarder: mapped once here. */
  CHECK((char *)tshare_view_data(part) - d->byte_offset ==
        (char *)tshare_view_data(whole) - tshare_view_desc(whole)->byte_offset);
  CHECK_EQ(((int32_t *)tshare_view_data(whole))[500], 500);
  q[0] = -5; /* the owner, two processes away, sees this */
  tshare_view_release(part);
  tshare_view_release(whole);
  tshare_channel_close(ch);
}

static void forwarder(int fd) {
  tshare_channel *up = open_socket_channel(fd, "forwarder", NULL, NULL);
  int down_fd;
  pid_t third = fork_with_socket(third_writes_through, &down_fd);
  tshare_channel *down = open_socket_channel(down_fd, "forwarder down", NULL, NULL);
  tshare_share_info info;
  CHECK_RC(tshare_channel_peek_share(up, 5000, &info), TSHARE_OK, tshare_channel_last_error(up));
  CHECK_EQ(info.device_type, TSHARE_DEVICE_CPU);
  CHECK_EQ(info.cuda_device, -1);
  CHECK_EQ(info.share_id, 1);
  tshare_view *v;
  CHECK_RC(tshare_view_recv(up, 5000, &v), TSHARE_OK, tshare_channel_last_error(up));
  CHECK_EQ(tshare_view_share_id(v), info.share_id);

  /* A part outside what the producer shared is refused, and drop still runs. */
  tshare_tensor_desc too_big = desc_1d((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1 << 20, 0);
  CHECK_RC(tshare_share_view_part(down, v, &too_big, NULL, NULL, count_drop, &drops, NULL, 5000, NULL),
           TSHARE_E_OUT_OF_BOUNDS, tshare_channel_last_error(down));
  CHECK_EQ(drops, 1);

  int64_t n = 10;
  tshare_tensor_desc every_other = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, &n, 400);
  every_other.strides[0] = 2;
  uint64_t part_id, whole_id;
  CHECK_RC(tshare_share_view_part(down, v, &every_other, NULL, "every other of 100..119", count_drop, &drops, NULL,
                                  5000, &part_id),
           TSHARE_OK, tshare_channel_last_error(down));
  CHECK_RC(tshare_share_view(down, v, NULL, NULL, NULL, 5000, &whole_id), TSHARE_OK, tshare_channel_last_error(down));
  CHECK_RC(tshare_channel_wait_released(down, 0, 5000), TSHARE_OK, tshare_channel_last_error(down));
  CHECK_EQ(drops, 2);
  CHECK_CHILD_OK(third);
  tshare_channel_close(down);
  tshare_channel_close(up); /* the whole view was released by its forward */
}

TS_TEST(forwarded_views_reach_a_third_process) {
  int sock;
  pid_t pid = fork_with_socket(forwarder, &sock);
  tshare_channel *ch = open_socket_channel(sock, "owner", count_releases, NULL);
  tshare_host_buffer *a;
  CHECK_RC(tshare_host_buffer_create(1000 * sizeof(int32_t), "tshare-test-forward", &a, NULL), TSHARE_OK, "");
  int32_t *p = tshare_host_buffer_data(a);
  for (int i = 0; i < 1000; i++) p[i] = i;
  tshare_tensor_desc t = desc_1d((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1000, 0);
  uint64_t id;
  CHECK_RC(tshare_share_host(ch, a, &t, "orig", NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(released_ok, 1);
  CHECK_EQ(p[100], -5);
  CHECK_EQ(p[101], 101);
  CHECK_CHILD_OK(pid);
  tshare_host_buffer_destroy(a);
  tshare_channel_close(ch);
}

/* A producer that closes its channel without a bye still ends the stream
 * cleanly: the consumer's loop sees its views, then TSHARE_END, not an error
 * (a producer that dies is TSHARE_E_PEER_CLOSED: stress kill-producer). */
static void consumer_loops_until_the_end(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "looping consumer", NULL, NULL);
  tshare_view *v;
  int rc, n = 0;
  while ((rc = tshare_view_recv(ch, 5000, &v)) == TSHARE_OK) {
    CHECK_EQ(((const int32_t *)tshare_view_data(v))[0], 7);
    tshare_view_release(v);
    n++;
  }
  CHECK_RC(rc, TSHARE_END, tshare_channel_last_error(ch));
  CHECK_EQ(n, 3);
  tshare_channel_close(ch);
}

TS_TEST(close_without_bye_ends_the_stream_cleanly) {
  int sock;
  pid_t pid = fork_with_socket(consumer_loops_until_the_end, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  tshare_host_buffer *b;
  CHECK_RC(tshare_host_buffer_create(64, "tshare-close", &b, NULL), TSHARE_OK, "");
  ((int32_t *)tshare_host_buffer_data(b))[0] = 7;
  tshare_tensor_desc d = desc_1d((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, 0);
  for (int i = 0; i < 3; i++)
    CHECK_RC(tshare_share_host(ch, b, &d, NULL, NULL, 5000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch); /* no bye of its own */
  tshare_host_buffer_destroy(b);
  CHECK_CHILD_OK(pid);
}

/* A consumer that says bye before it releases what it holds: the producer
 * still reads those releases (they free its memory as releases, not as a
 * dead peer's drops), and its wait ends when they came. */
static int bye_first_done[2];
static void consumer_says_bye_then_releases(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "polite consumer", NULL, NULL);
  tshare_view *v[3];
  for (int i = 0; i < 3; i++) CHECK_RC(tshare_view_recv(ch, 5000, &v[i]), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  usleep(100 * 1000);
  for (int i = 0; i < 3; i++) tshare_view_release(v[i]);
  CHECK_RC(tshare_channel_poll(ch, 0), TSHARE_E_TIMEOUT, tshare_channel_last_error(ch)); /* the releases go out */
  char c;
  CHECK(read(bye_first_done[0], &c, 1) == 1); /* stays until the producer had them */
  tshare_channel_close(ch);
}

TS_TEST(releases_after_the_consumers_bye_still_count) {
  CHECK(pipe(bye_first_done) == 0);
  released_ok = released_dropped = 0;
  int sock;
  pid_t pid = fork_with_socket(consumer_says_bye_then_releases, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", count_releases, NULL);
  tshare_host_buffer *b;
  CHECK_RC(tshare_host_buffer_create(64, "tshare-bye-first", &b, NULL), TSHARE_OK, "");
  tshare_tensor_desc d = desc_1d(F32, 4, 0);
  for (int i = 0; i < 3; i++)
    CHECK_RC(tshare_share_host(ch, b, &d, NULL, NULL, 5000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(released_ok, 3); /* released, not dropped */
  CHECK_EQ(released_dropped, 0);
  CHECK_RC(tshare_channel_poll(ch, -1), TSHARE_END, tshare_channel_last_error(ch)); /* at once: it said bye */
  CHECK(write(bye_first_done[1], "x", 1) == 1);
  CHECK_CHILD_OK(pid);
  tshare_host_buffer_destroy(b);
  tshare_channel_close(ch);
}

TS_TEST_MAIN
