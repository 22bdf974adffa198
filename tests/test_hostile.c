/* What careless and hostile peers do to a socket channel's fds: two ends
 * sharing to each other at once, fds riding on frames that announce none, a
 * peer filling a process's fd table with shares it never receives, and a
 * process out of fds. Each ends with the channel still usable and every fd
 * accounted for. */
#include "harness.h"
#include "hostile_peer.h"
#include "proc_util.h"
#include "tshare/share.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>

static const tshare_dtype I32 = {TSHARE_DTYPE_INT, 32, 1};

static tshare_tensor_desc ints_at(int64_t n, uint64_t offset) { return tshare_tensor_contiguous(I32, 1, &n, offset); }

/* A buffer of n int32 where element i holds base + i. */
static tshare_host_buffer *filled_buffer(const char *name, int n, int base) {
  tshare_host_buffer *b;
  CHECK_RC(tshare_host_buffer_create((size_t)n * 4, name, &b, NULL), TSHARE_OK, "");
  int32_t *p = tshare_host_buffer_data(b);
  for (int i = 0; i < n; i++) p[i] = base + i;
  return b;
}

static void check_view(tshare_view *v, int n, int base) {
  const int32_t *p = tshare_view_data(v);
  CHECK_EQ(tshare_view_desc(v)->shape[0], n);
  for (int i = 0; i < n; i++)
    if (p[i] != base + i) TS_FAIL("element %d is %d, expected %d", i, (int)p[i], base + i);
}

static void set_fd_limit(rlim_t soft) {
  struct rlimit rl;
  CHECK(getrlimit(RLIMIT_NOFILE, &rl) == 0);
  if (rl.rlim_max != RLIM_INFINITY && soft > rl.rlim_max)
    TS_SKIP("the hard fd limit %lu is under %lu", rl.rlim_max, soft);
  rl.rlim_cur = soft;
  CHECK(setrlimit(RLIMIT_NOFILE, &rl) == 0);
}

/* ---- 1. both ends share to each other at once -------------------------------- */

enum { BOTH_WAYS = 1500 };

/* Share BOTH_WAYS tensors to the peer without receiving, then receive and
 * check the peer's, then wait until the peer released ours. */
static void share_then_receive(tshare_channel *ch, int mine, int theirs) {
  tshare_host_buffer *b = filled_buffer("tshare-both-ways", 64, mine);
  tshare_tensor_desc d = ints_at(64, 0);
  for (int i = 0; i < BOTH_WAYS; i++)
    CHECK_RC(tshare_share_host(ch, b, &d, NULL, NULL, 10000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  for (int i = 0; i < BOTH_WAYS; i++) {
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, 10000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    check_view(v, 64, theirs);
    tshare_view_release(v);
  }
  CHECK_RC(tshare_channel_wait_released(ch, 0, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_host_buffer_destroy(b);
}

static void other_end_shares_too(int fd) {
  set_fd_limit(4096);
  tshare_channel *ch = open_with_budget(fd, "end b", 2000);
  share_then_receive(ch, 5000, 100);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_view *none;
  CHECK_RC(tshare_view_recv(ch, 5000, &none), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(both_ends_share_to_each_other_at_once) {
  set_fd_limit(4096);
  int sock;
  pid_t pid = fork_with_socket(other_end_shares_too, &sock);
  tshare_channel *ch = open_with_budget(sock, "end a", 2000);
  share_then_receive(ch, 100, 5000);
  tshare_view *none;
  CHECK_RC(tshare_view_recv(ch, 5000, &none), TSHARE_END, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* ---- 2. fds on frames that announce none, or that may carry none ------------ */

static int released;
static void count_release(void *user, uint64_t id, void *user_data, int status) {
  (void)user, (void)id, (void)user_data;
  if (status == TSHARE_OK)
    released++;
  else
    fprintf(stderr, "share %llu dropped: %s\n", (unsigned long long)id, tshare_status_name(status));
}

enum { SHARES_RELEASED_WITH_FDS = 300, RETIRES_WITH_FDS = 100 };

/* A consumer that answers every share with a release frame flagged as
 * carrying an fd, and sends retire and error frames with fds too. */
static void consumer_attaches_fds_to_everything(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "sloppy consumer", NULL, NULL);
  int junk = memfd_create("junk", MFD_CLOEXEC);
  CHECK(junk >= 0);
  for (int i = 0; i < SHARES_RELEASED_WITH_FDS; i++) {
    tshare_frame f;
    int got;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &got, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(f.type, TSHARE_FRAME_SHARE);
    close(got);
    tshare_frame r;
    memset(&r, 0, sizeof r);
    r.type = TSHARE_FRAME_RELEASE;
    r.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
    r.u.release.count = 1;
    r.u.release.share_ids[0] = f.u.share.share_id;
    CHECK_RC(tshare_channel_send_frame(ch, &r, junk, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  for (int i = 0; i < RETIRES_WITH_FDS; i++) {
    tshare_frame r;
    memset(&r, 0, sizeof r);
    r.type = TSHARE_FRAME_RETIRE;
    r.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
    r.u.retire.closed = 1;
    r.u.retire.count = 1;
    r.u.retire.alloc_ids[0] = 12345;
    CHECK_RC(tshare_channel_send_frame(ch, &r, junk, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  tshare_frame e;
  memset(&e, 0, sizeof e);
  e.type = TSHARE_FRAME_ERROR;
  e.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  e.u.error.code = TSHARE_E_STATE;
  snprintf(e.u.error.message, sizeof e.u.error.message, "an error frame with an fd");
  CHECK_RC(tshare_channel_send_frame(ch, &e, junk, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_frame bye;
  memset(&bye, 0, sizeof bye);
  bye.type = TSHARE_FRAME_BYE;
  bye.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  CHECK_RC(tshare_channel_send_frame(ch, &bye, junk, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  close(junk);
  tshare_channel_close(ch);
}

TS_TEST(fds_on_frames_that_carry_none_are_closed) {
  int fds_before = count_open_fds();
  int sock;
  pid_t pid = fork_with_socket(consumer_attaches_fds_to_everything, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", count_release, NULL);
  tshare_host_buffer *b = filled_buffer("tshare-stray", 16, 0);
  tshare_tensor_desc d = ints_at(16, 0);
  for (int i = 0; i < SHARES_RELEASED_WITH_FDS; i++)
    CHECK_RC(tshare_share_host(ch, b, &d, NULL, NULL, 5000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(released, SHARES_RELEASED_WITH_FDS);
  /* The retire frames and the error frame; the error is the peer's word. */
  int rc; /* a build without CUDA refuses each retire frame, and goes on */
  while ((rc = tshare_channel_poll(ch, 5000)) == TSHARE_OK ||
         (rc == TSHARE_E_PROTOCOL && strstr(tshare_channel_last_error(ch), "offered no CUDA"))) {
  }
  CHECK_RC(rc, TSHARE_E_PEER_ERROR, tshare_channel_last_error(ch));
  CHECK(strstr(tshare_channel_last_error(ch), "an error frame with an fd"));
  CHECK_RC(tshare_channel_poll(ch, 5000), TSHARE_END, tshare_channel_last_error(ch));
  printf("fds: %d before, %d with the channel open\n", fds_before, count_open_fds());
  tshare_host_buffer_destroy(b);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
  CHECK_EQ(count_open_fds(), fds_before);
}

/* A producer whose first fd rides on an error frame (which announces none),
 * followed by a share carrying the right memfd. */
static void producer_sends_a_stray_fd(int fd) {
  tshare_channel *ch = open_socket_only_channel(fd, "stray producer");
  tshare_host_buffer *wrong = filled_buffer("tshare-wrong", 16, 900);
  tshare_host_buffer *right = filled_buffer("tshare-right", 16, 7);
  tshare_frame e;
  memset(&e, 0, sizeof e);
  e.type = TSHARE_FRAME_ERROR;
  e.u.error.code = TSHARE_E_STATE;
  snprintf(e.u.error.message, sizeof e.u.error.message, "stray");
  send_raw(ch, &e, tshare_host_buffer_fd(wrong));
  tshare_frame s = memfd_share_frame(tshare_host_buffer_size(right), ints_at(16, 0));
  send_raw(ch, &s, tshare_host_buffer_fd(right));
  tshare_frame g;
  int got;
  CHECK_RC(tshare_channel_recv_frame(ch, &g, &got, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(g.type, TSHARE_FRAME_RELEASE);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, "");
  tshare_host_buffer_destroy(wrong);
  tshare_host_buffer_destroy(right);
  tshare_channel_close(ch);
}

TS_TEST(an_fd_on_a_frame_announcing_none_never_reaches_the_next_share) {
  int fds_before = count_open_fds();
  int sock;
  pid_t pid = fork_with_socket(producer_sends_a_stray_fd, &sock);
  tshare_channel *ch = open_socket_channel(sock, "consumer", NULL, NULL);
  tshare_view *v = NULL;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_E_PEER_ERROR, tshare_channel_last_error(ch));
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  check_view(v, 16, 7); /* the share's own memfd, not the stray one */
  CHECK_EQ(count_mappings("tshare-wrong"), 0);
  tshare_view_release(v);
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
  CHECK_EQ(count_open_fds(), fds_before);
}

/* ---- 3. a peer filling the fd table of a process that never receives -------- */

enum { FLOOD = 500, FLOOD_FD_LIMIT = 256 };
static int go_receive[2]; /* the producer writes a byte when the consumer may start receiving */

/* Only polls (as a producer waiting for releases does) while the peer shares
 * memfds to it, under a soft fd limit of 256: a budget of 64. */
static void polls_under_a_low_fd_limit(int fd) {
  set_fd_limit(FLOOD_FD_LIMIT);
  int fds_before = count_open_fds(), fds_max = fds_before; /* the socket is one of them */
  tshare_channel *ch = open_socket_channel(fd, "polling end", NULL, NULL);
  for (;;) {
    int rc = tshare_channel_poll(ch, 20);
    if (rc == TSHARE_END) break; /* the bye came before the byte */
    if (rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT)
      TS_FAIL("poll: %s: %s", tshare_status_name(rc), tshare_channel_last_error(ch));
    int n = count_open_fds();
    if (n > fds_max) fds_max = n;
    struct pollfd p = {go_receive[0], POLLIN, 0};
    if (poll(&p, 1, 0) == 1) break;
  }
  printf("polling end: fds %d at the start, at most %d while flooded (budget %d)\n", fds_before, fds_max,
         FLOOD_FD_LIMIT / 4);
  CHECK(fds_max <= fds_before + 1 + FLOOD_FD_LIMIT / 4 + 8); /* + the channel's eventfd */
  int views = 0;
  tshare_view *v;
  int rc;
  while ((rc = tshare_view_recv(ch, 5000, &v)) == TSHARE_OK) {
    check_view(v, 16, 40);
    tshare_view_release(v);
    views++;
  }
  CHECK_RC(rc, TSHARE_END, tshare_channel_last_error(ch));
  printf("polling end: received %d of %d shares, the rest refused\n", views, FLOOD);
  CHECK(views >= FLOOD_FD_LIMIT / 4 && views < FLOOD);
  tshare_channel_close(ch);
  CHECK_EQ(count_open_fds(), fds_before - 1); /* the channel closed the socket */
}

TS_TEST(a_peer_cannot_fill_the_fd_table) {
  CHECK(pipe2(go_receive, O_CLOEXEC) == 0);
  int sock;
  pid_t pid = fork_with_socket(polls_under_a_low_fd_limit, &sock);
  tshare_channel *ch = open_socket_channel(sock, "flooding end", count_release, NULL);
  tshare_host_buffer *b = filled_buffer("tshare-flood", 16, 40);
  tshare_tensor_desc d = ints_at(16, 0);
  for (int i = 0; i < FLOOD; i++)
    CHECK_RC(tshare_share_host(ch, b, &d, NULL, NULL, 5000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  /* The refused shares come back with an error that names the limit. */
  bool told = false;
  for (int tries = 0; tries < 100 && !(told && tshare_channel_outstanding(ch) <= FLOOD_FD_LIMIT / 4 + 8); tries++) {
    int rc = tshare_channel_wait_released(ch, 0, 100);
    if (rc == TSHARE_E_PEER_ERROR) {
      printf("flooding end: %s\n", tshare_channel_last_error(ch));
      CHECK(strstr(tshare_channel_last_error(ch), "TSHARE_E_LIMIT"));
      CHECK(strstr(tshare_channel_last_error(ch), "max_unclaimed_fds"));
      told = true;
    } else if (rc != TSHARE_E_TIMEOUT) {
      TS_FAIL("wait_released: %s", tshare_channel_last_error(ch));
    }
  }
  CHECK(told);
  printf("flooding end: %d released back unused, %zu held by the peer\n", released, tshare_channel_outstanding(ch));
  CHECK(tshare_channel_outstanding(ch) <= FLOOD_FD_LIMIT / 4 + 8);
  CHECK(write(go_receive[1], "g", 1) == 1);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(released, FLOOD);
  CHECK_CHILD_OK(pid);
  tshare_host_buffer_destroy(b);
  tshare_channel_close(ch);
}

/* ---- 4. a process out of fds ------------------------------------------------- */

enum { DISTINCT = 80, LOW_FD_LIMIT = 48 };

/* Holds views of distinct allocations (each mapping keeps its memfd) under
 * an fd limit of 48 until a receive fails, then lets go and takes the rest. */
static void holds_views_until_out_of_fds(int fd) {
  set_fd_limit(LOW_FD_LIMIT);
  tshare_channel *ch = open_socket_channel(fd, "hoarder", NULL, NULL);
  tshare_view *held[DISTINCT];
  int n = 0, rc;
  while ((rc = tshare_view_recv(ch, 5000, &held[n])) == TSHARE_OK) {
    check_view(held[n], 16, 1000 * n);
    n++;
    CHECK(n < DISTINCT);
  }
  printf("hoarder: after %d views: %s\n", n, tshare_channel_last_error(ch));
  CHECK_RC(rc, TSHARE_E_LIMIT, tshare_channel_last_error(ch));
  CHECK(strstr(tshare_channel_last_error(ch), "EMFILE"));
  CHECK(strstr(tshare_channel_last_error(ch), "RLIMIT_NOFILE 48"));
  for (int i = 0; i < n; i++) tshare_view_release(held[i]);
  /* The channel still works: the rest arrive (share n was released back). */
  int more = 0;
  tshare_view *v;
  while ((rc = tshare_view_recv(ch, 5000, &v)) == TSHARE_OK) {
    check_view(v, 16, 1000 * (n + 1 + more));
    tshare_view_release(v);
    more++;
  }
  CHECK_RC(rc, TSHARE_END, tshare_channel_last_error(ch));
  printf("hoarder: %d more received after releasing\n", more);
  CHECK_EQ(n + 1 + more, DISTINCT);
  tshare_channel_close(ch);
}

/* Share DISTINCT buffers (allocation i full of 1000 * i) with a consumer
 * running fn; every share must come back released. */
static void share_distinct_allocations(void (*fn)(int)) {
  released = 0;
  int sock;
  pid_t pid = fork_with_socket(fn, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", count_release, NULL);
  tshare_host_buffer *b[DISTINCT];
  tshare_tensor_desc d = ints_at(16, 0);
  for (int i = 0; i < DISTINCT; i++) {
    b[i] = filled_buffer("tshare-distinct", 16, 1000 * i);
    CHECK_RC(tshare_share_host(ch, b[i], &d, NULL, NULL, 5000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  }
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(released, DISTINCT);
  CHECK_CHILD_OK(pid);
  for (int i = 0; i < DISTINCT; i++) tshare_host_buffer_destroy(b[i]);
  tshare_channel_close(ch);
}

TS_TEST(out_of_fds_is_a_clear_limit_and_the_channel_lives_on) {
  share_distinct_allocations(holds_views_until_out_of_fds);
}

/* A consumer that never shares views on holds no fd per allocation: with
 * keep_host_fds 0 the same 80 distinct allocations fit under the fd limit of
 * 48, all held at once; sharing one on says why it cannot. */
static void holds_every_view_without_their_fds(int fd) {
  set_fd_limit(LOW_FD_LIMIT);
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "lean hoarder";
  o.keep_host_fds = 0;
  tshare_channel *ch;
  tshare_error err;
  CHECK_RC(tshare_channel_open_socket(fd, &o, &ch, &err), TSHARE_OK, err.message);
  tshare_view *held[DISTINCT];
  for (int n = 0; n < DISTINCT; n++) {
    CHECK_RC(tshare_view_recv(ch, 5000, &held[n]), TSHARE_OK, tshare_channel_last_error(ch));
    check_view(held[n], 16, 1000 * n);
  }
  printf("lean hoarder: %d views of distinct allocations held at once, %d fds open\n", DISTINCT, count_open_fds());
  CHECK(count_open_fds() < LOW_FD_LIMIT);
  CHECK_RC(tshare_share_view(ch, held[0], NULL, NULL, NULL, 1000, NULL), TSHARE_E_STATE, tshare_channel_last_error(ch));
  CHECK(strstr(tshare_channel_last_error(ch), "keep_host_fds") != NULL);
  for (int i = 1; i < DISTINCT; i++) tshare_view_release(held[i]); /* held[0] went with the failed share */
  tshare_view *none;
  CHECK_RC(tshare_view_recv(ch, 5000, &none), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(views_without_their_fds_when_nothing_is_shared_on) {
  share_distinct_allocations(holds_every_view_without_their_fds);
}

/* ---- 5. a hello's pid is the peer's word only ---------------------------------- */

/* Speaks the wire by hand: a hello claiming to be 'init', pid 1, then a
 * release of a share that was never sent. */
static void claims_to_be_init(int fd) {
  usleep(100 * 1000); /* most often after the other end asked for credentials */
  uint8_t buf[2 * TSHARE_WIRE_FRAME_MAX];
  size_t len, more;
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_HELLO;
  f.u.hello.major = TSHARE_WIRE_MAJOR;
  f.u.hello.minor = TSHARE_WIRE_MINOR;
  f.u.hello.pid = 1;
  f.u.hello.uid = (uint32_t)getuid();
  f.u.hello.capabilities = TSHARE_CAP_FD_PASSING | TSHARE_CAP_HOST_MEMFD;
  snprintf(f.u.hello.name, sizeof f.u.hello.name, "init");
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, NULL), TSHARE_OK, "");
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = 1;
  f.u.release.share_ids[0] = 77;
  CHECK_RC(tshare_wire_encode(&f, buf + len, sizeof buf - len, &more, NULL), TSHARE_OK, "");
  CHECK(write(fd, buf, len + more) == (ssize_t)(len + more)); /* they stay readable after this process ends */
}

TS_TEST(messages_name_the_peer_by_the_kernels_pid) {
  int sock;
  pid_t pid = fork_with_socket(claims_to_be_init, &sock);
  tshare_channel *ch = open_socket_channel(sock, "producer", NULL, NULL);
  CHECK_EQ(tshare_channel_peer(ch)->pid, 1); /* what it said */
  CHECK_RC(tshare_channel_poll(ch, 5000), TSHARE_E_PROTOCOL, tshare_channel_last_error(ch));
  printf("%s\n", tshare_channel_last_error(ch));
  /* The kernel's pid where it came with the hello (the hello was written after
   * this end asked for credentials), else the claim, said to be one. */
  char real[32];
  snprintf(real, sizeof real, "'init' (pid %d)", (int)pid);
  const char *msg = tshare_channel_last_error(ch);
  CHECK(strstr(msg, real) != NULL || strstr(msg, "'init' (says pid 1)") != NULL);
  CHECK(strstr(msg, "(pid 1)") == NULL);
  tshare_channel_close(ch);
  close(sock);
  CHECK_CHILD_OK(pid);
}

TS_TEST_MAIN

/* ---- 10. the ring transport: the peer owns half of the shared memory ------------ */

/* The ring mappings of this process ("memfd:tshare-ring"): the one it
 * writes into and the one its peer writes into. */
static int ring_mappings(uint8_t *starts[2], size_t lens[2]) {
  FILE *f = fopen("/proc/self/maps", "r");
  CHECK(f != NULL);
  char line[512];
  int n = 0;
  while (n < 2 && fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    if (strstr(line, "memfd:tshare-ring") && sscanf(line, "%lx-%lx", &lo, &hi) == 2) {
      starts[n] = (uint8_t *)lo;
      lens[n++] = hi - lo;
    }
  }
  fclose(f);
  return n;
}

/* A channel of a child that ends without closing it on purpose: still
 * reachable from here when it exits (no leak to report). */
static tshare_channel *volatile dying_end;

/* Moves the tail of every ring it maps far past the ring's capacity (the
 * control page starts with the writer's tail), then waits to be killed. */
static void moves_the_tail_past_the_ring(int fd) {
  tshare_channel *ch = open_ring_channel(fd, "tail mover");
  uint8_t *at[2];
  size_t len[2];
  CHECK_EQ(ring_mappings(at, len), 2);
  usleep(50 * 1000); /* the other end is asleep in its receive by now */
  for (int i = 0; i < 2; i++) {
    uint64_t far = UINT64_C(1) << 40;
    memcpy(at[i], &far, sizeof far);
  }
  pause(); /* holds the channel open (the hang-up is not what is tested) until killed */
  (void)ch;
}

/* A receive with a long timeout that must end with `expected` in well under
 * a second: what a sleeping receive notices within its bounded waits. */
static void receive_fails_soon(tshare_channel *ch, int expected, int timeout_ms) {
  tshare_frame f;
  int fd = -1;
  int64_t t0 = now_ms();
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, timeout_ms), expected, tshare_channel_last_error(ch));
  CHECK(now_ms() - t0 < 1000);
}

TS_TEST(a_ring_tail_moved_past_the_capacity_is_a_protocol_error_not_a_wild_read) {
  int sock;
  pid_t pid = fork_with_socket(moves_the_tail_past_the_ring, &sock);
  tshare_channel *ch = open_ring_channel(sock, "ring reader");
  receive_fails_soon(ch, TSHARE_E_PROTOCOL, 5000); /* found while it slept */
  CHECK(strstr(tshare_channel_last_error(ch), "ring") != NULL);
  CHECK(strstr(tshare_channel_last_error(ch), "tail mover") != NULL);
  kill(pid, SIGKILL);
  wait_child(pid);
  tshare_channel_close(ch);
}

/* Writes random bytes over both rings, control pages included, as fast as
 * it can for a while, then exits without a word. */
static void scribbles_into_the_rings(int fd) {
  tshare_channel *ch = dying_end = open_ring_channel(fd, "scribbler");
  uint8_t *at[2];
  size_t len[2];
  CHECK_EQ(ring_mappings(at, len), 2);
  uint64_t x = UINT64_C(0x9e3779b97f4a7c15) ^ (uint64_t)(unsigned)getpid();
  int64_t end = now_ms() + 300;
  if (getpid() % 2) { /* tails that stay in bounds: garbage reaches the decoder */
    uint64_t tail = 0;
    while (now_ms() < end) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      for (int i = 0; i < 2; i++) {
        for (size_t off = 4096 + tail % 4096; off < 4096 + tail % 4096 + 64 && off < len[i]; off++)
          at[i][off] = (uint8_t)(x >> (off % 56));
        uint64_t next = tail + 1 + x % 64;
        memcpy(at[i], &next, sizeof next);
      }
      tail += 1 + x % 64;
      usleep(100);
    }
    _exit(0);
  }
  while (now_ms() < end) {
    for (int k = 0; k < 4096; k++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      int which = (int)(x & 1);
      /* Half the writes hit the control page, where the indices live. */
      size_t off = (x >> 8) % ((x >> 1) & 1 ? 256 : len[which]);
      at[which][off] = (uint8_t)(x >> 40);
    }
  }
  _exit(0);
  (void)ch;
}

TS_TEST(a_peer_scribbling_into_the_rings_cannot_crash_or_hang_the_other_end) {
  for (int round = 0; round < 4; round++) { /* an odd pid scribbles data under sane tails, an even one anything */
    int sock;
    pid_t pid = fork_with_socket(scribbles_into_the_rings, &sock);
    tshare_channel *ch = open_ring_channel(sock, "ring reader");
    int64_t t0 = now_ms();
    int rc;
    long frames = 0;
    for (;;) {
      tshare_frame f;
      int fd = -1;
      rc = tshare_channel_recv_frame(ch, &f, &fd, 2000);
      if (fd >= 0) close(fd);
      if (rc != TSHARE_OK && rc != TSHARE_E_LIMIT) break;
      frames++; /* bytes that happened to form a valid frame were checked like any other */
    }
    /* Whatever it wrote ends as an error that names the fault (or its
     * death), within its 300 ms of scribbling and the 100 ms a sleeping
     * receive takes to notice a hang-up. */
    fprintf(stderr, "round %d: %ld frames, then %s: %s\n", round, frames, tshare_status_name(rc),
            tshare_channel_last_error(ch));
    CHECK(rc != TSHARE_E_TIMEOUT);
    CHECK(rc < 0);
    CHECK(now_ms() - t0 < 1500);
    CHECK(frames < 100000);
    tshare_channel_close(ch);
    CHECK_CHILD_OK(pid);
  }
}

/* A ring peer that dies without a word is seen within the sleeping
 * receive's slice (100 ms), not at the timeout. */
static void dies_quietly(int fd) {
  dying_end = open_ring_channel(fd, "quiet one");
  usleep(100 * 1000);
  _exit(0);
}

TS_TEST(a_ring_peer_that_dies_is_seen_within_a_sleep_slice) {
  int sock;
  pid_t pid = fork_with_socket(dies_quietly, &sock);
  tshare_channel *ch = open_ring_channel(sock, "watcher");
  receive_fails_soon(ch, TSHARE_E_PEER_CLOSED, 30000); /* it died ~100 ms in */
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* ---- 11. VMM chunk frames that do not add up ------------------------------------- */

static tshare_frame chunk_frame(uint64_t alloc_id, uint32_t index, uint32_t count) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_CHUNK;
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  f.u.chunk.alloc_id = alloc_id;
  f.u.chunk.index = index;
  f.u.chunk.count = count;
  f.u.chunk.size = 4096;
  return f;
}

/* Chunks of one allocation, then a share of one piece; or chunks out of
 * order: each ends the channel with a protocol error, every fd closed. */
static void sends_chunks_that_do_not_add_up(int fd) {
  tshare_channel *ch = open_socket_only_channel(fd, "chunky producer");
  tshare_host_buffer *b = filled_buffer("tshare-chunk", 16, 5);
  tshare_frame k1 = chunk_frame(9, 1, 4), k2 = chunk_frame(9, 2, 4);
  send_raw(ch, &k1, tshare_host_buffer_fd(b));
  send_raw(ch, &k2, tshare_host_buffer_fd(b));
  tshare_frame s = memfd_share_frame(tshare_host_buffer_size(b), ints_at(16, 0));
  send_raw(ch, &s, tshare_host_buffer_fd(b));
  tshare_frame f;
  int got = -1;
  (void)tshare_channel_recv_frame(ch, &f, &got, 5000); /* the consumer's error, or its hang-up */
  if (got >= 0) close(got);
  tshare_host_buffer_destroy(b);
  tshare_channel_close(ch);
}

/* Names GPU memory the consumer never said it keeps mapped (a share of kind
 * TSHARE_MEM_CUDA_HELD, no fd), then shares host memory; both must come back. */
static void sends_memory_the_consumer_does_not_keep(int fd) {
  tshare_channel *ch = open_socket_only_channel(fd, "held producer");
  tshare_frame h = memfd_share_frame(4096, ints_at(16, 0));
  h.flags = 0;
  h.u.share.alloc_id = 99;
  h.u.share.mem_kind = TSHARE_MEM_CUDA_HELD;
  h.u.share.device_type = TSHARE_DEVICE_CUDA;
  send_raw(ch, &h, -1);
  tshare_host_buffer *b = filled_buffer("tshare-held", 16, 5);
  tshare_frame s = memfd_share_frame(tshare_host_buffer_size(b), ints_at(16, 0));
  s.u.share.share_id = 2;
  send_raw(ch, &s, tshare_host_buffer_fd(b));
  unsigned came_back = 0;
  while (came_back < 2) {
    tshare_frame f;
    int got = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &got, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    if (got >= 0) close(got);
    if (f.type == TSHARE_FRAME_RELEASE) came_back += f.u.release.count;
  }
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, "");
  tshare_host_buffer_destroy(b);
  tshare_channel_close(ch);
}

TS_TEST(a_share_of_memory_this_end_does_not_keep_mapped_is_released_back) {
  int sock;
  pid_t pid = fork_with_socket(sends_memory_the_consumer_does_not_keep, &sock);
  tshare_channel *ch = open_socket_channel(sock, "consumer", NULL, NULL);
  tshare_view *v = NULL;
  int rc = tshare_view_recv(ch, 5000, &v);
  printf("%s: %s\n", tshare_status_name(rc), tshare_channel_last_error(ch));
  CHECK(rc != TSHARE_OK && v == NULL);
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  check_view(v, 16, 5); /* the channel goes on */
  tshare_view_release(v);
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

TS_TEST(chunk_frames_that_do_not_add_up_are_a_protocol_error_and_leak_no_fd) {
  int fds_before = count_open_fds();
  int sock;
  pid_t pid = fork_with_socket(sends_chunks_that_do_not_add_up, &sock);
  tshare_channel *ch = open_socket_channel(sock, "consumer", NULL, NULL);
  tshare_view *v = NULL;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_E_PROTOCOL, tshare_channel_last_error(ch));
  printf("%s\n", tshare_channel_last_error(ch));
  CHECK(strstr(tshare_channel_last_error(ch), "chunk") != NULL);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
  CHECK_EQ(count_open_fds(), fds_before);
}
