/* A poll loop on a ring channel's fd that also receives with blocking calls
 * (or takes over a channel that was received on), following
 * tshare_channel_fd()'s rule: frames that came while a receive ran do not
 * make the fd readable, so the loop drains the channel (timeout 0, until
 * TSHARE_E_TIMEOUT) before it waits on the fd; after that drain, the peer's
 * next frame wakes poll(). And the releases a loop's look sends do not
 * make the peer's answer to them cost a nudge. */
#include "harness.h"
#include "hostile_peer.h"
#include "tshare/hostmem.h"
#include "tshare/share.h"

#include <linux/sockios.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>

static int go[2], sent[2]; /* parent -> child: send the first burst, the last frame, done; child -> parent: sent */

static void send_release(tshare_channel *ch, uint64_t id) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = 1;
  f.u.release.share_ids[0] = id;
  CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
}

static void wait_byte(int fd) {
  char b;
  CHECK(read(fd, &b, 1) == 1);
}

/* Once told, releases 1, 2 and 3 back to back; release 4 once told again. */
static void sends_in_two_bursts(int fd) {
  tshare_channel *ch = open_ring_channel(fd, "bursty peer");
  wait_byte(go[0]);
  for (uint64_t id = 1; id <= 3; id++) send_release(ch, id);
  CHECK(write(sent[1], "x", 1) == 1);
  wait_byte(go[0]);
  send_release(ch, 4);
  wait_byte(go[0]); /* until the other end is done: its hang-up cannot be seen here */
  tshare_channel_close(ch);
}

/* The id of the next release frame; 0 when the receive timed out. */
static uint64_t next_release(tshare_channel *ch, int timeout_ms) {
  tshare_frame f;
  int fd = -1;
  int rc = tshare_channel_recv_frame(ch, &f, &fd, timeout_ms);
  if (rc == TSHARE_E_TIMEOUT) return 0;
  CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(f.type, TSHARE_FRAME_RELEASE);
  return f.u.release.share_ids[0];
}

/* The ids a drain with timeout 0 takes, in order, into ids; how many. */
static int drain(tshare_channel *ch, uint64_t *ids, int cap) {
  int n = 0;
  for (uint64_t id; (id = next_release(ch, 0)) != 0;) {
    CHECK(n < cap);
    ids[n++] = id;
  }
  return n;
}

TS_TEST(a_poll_loop_that_takes_over_a_channel_drains_it_first_then_wakes_for_new_frames) {
  CHECK(pipe(go) == 0 && pipe(sent) == 0);
  int sock;
  pid_t pid = fork_with_socket(sends_in_two_bursts, &sock);
  tshare_channel *ch = open_ring_channel(sock, "event loop");
  struct pollfd p = {.fd = tshare_channel_fd(ch), .events = POLLIN, .revents = 0};
  CHECK(write(go[1], "x", 1) == 1);
  CHECK_EQ(next_release(ch, 5000), 1); /* a blocking receive, while 2 and 3 come */
  wait_byte(sent[0]);
  uint64_t ids[8];
  CHECK_EQ(drain(ch, ids, 8), 2);
  CHECK_EQ(ids[0], 2);
  CHECK_EQ(ids[1], 3);
  CHECK(write(go[1], "x", 1) == 1);
  /* Woken for release 4 within 5 s; a wake-up for something already taken
   * (a nudge the peer sent for 2 or 3) drains nothing and waits again. */
  int n = 0;
  for (int wakeups = 0; n == 0; wakeups++) {
    CHECK(wakeups < 10);
    if (poll(&p, 1, 5000) != 1) TS_FAIL("the loop slept through release 4 after draining the channel");
    n = drain(ch, ids, 8);
  }
  CHECK_EQ(n, 1);
  CHECK_EQ(ids[0], 4);
  CHECK(write(go[1], "x", 1) == 1);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

/* Once told (each time), waits 200 ms, then sends release 10 + the round. */
static void sends_late_when_told(int fd) {
  tshare_channel *ch = open_ring_channel(fd, "late peer");
  for (uint64_t round = 0;; round++) {
    char b;
    if (read(go[0], &b, 1) != 1 || b == 'q') break;
    usleep(200 * 1000);
    send_release(ch, 10 + round); /* a nudge, if asked for, is written within the send */
    CHECK(write(sent[1], "x", 1) == 1);
  }
  tshare_channel_close(ch);
}

/* A poll loop's look without waiting asks the peer to nudge the socket for
 * its next frame. A blocking receive that then waits watches the ring
 * itself and withdraws that: the peer's frame comes through the ring alone,
 * with no socket write (which would cost the peer a system call per frame,
 * make it take this end for asleep and stop spinning for the answer, and
 * wake the fd for nothing). Seen from here: after the blocking receive, the
 * fd is not readable. The peer sends 200 ms after being told, so the
 * receive spins first; a round where this end was late is tried again. */
TS_TEST(a_blocking_receive_after_a_poll_loops_look_takes_the_frame_without_a_nudge) {
  CHECK(pipe(go) == 0 && pipe(sent) == 0);
  int sock;
  pid_t pid = fork_with_socket(sends_late_when_told, &sock);
  /* This end spins up to a second (the override), so the frame comes while
   * the receive spins: a sleeping one says so itself, which replaces the
   * request for a nudge anyway. */
  CHECK(setenv("TSHARE_SPIN_US", "1000000", 1) == 0);
  tshare_channel *ch = open_ring_channel(sock, "event loop");
  CHECK(unsetenv("TSHARE_SPIN_US") == 0);
  struct pollfd p = {.fd = tshare_channel_fd(ch), .events = POLLIN, .revents = 0};
  bool quiet = false;
  for (uint64_t round = 0; round < 3 && !quiet; round++) {
    CHECK_EQ(next_release(ch, 0), 0); /* the look: nothing there, a nudge asked for */
    CHECK(write(go[1], "x", 1) == 1);
    CHECK_EQ(next_release(ch, 5000), 10 + round);
    wait_byte(sent[0]); /* the peer's send, nudge and all, is over */
    quiet = poll(&p, 1, 0) == 0;
  }
  if (!quiet) TS_FAIL("every frame taken by a blocking receive still nudged the socket");
  CHECK(write(go[1], "q", 1) == 1);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

#define ANSWER_ROUNDS 300
#define ANSWER_WARMUP 20 /* the first share passes the buffer's fd on the socket */

/* Shares one host buffer again each time it comes back, and tells the
 * other end in how many rounds after the warm-up its share call left bytes
 * on the socket the other end had not read: a nudge (SIOCOUTQ: what the
 * peer has not taken yet). */
static void shares_again_when_released(int fd) {
  tshare_channel *ch = open_ring_channel(fd, "answering producer");
  tshare_host_buffer *buf;
  tshare_error err;
  CHECK_RC(tshare_host_buffer_create(4096, "answer", &buf, &err), TSHARE_OK, err.message);
  int64_t shape[1] = {16};
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, shape, 0);
  int nudged = 0;
  for (int i = 0; i < ANSWER_ROUNDS; i++) {
    uint64_t id;
    CHECK_RC(tshare_share_host(ch, buf, &d, NULL, NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
    int unread = 0;
    CHECK(ioctl(fd, SIOCOUTQ, &unread) == 0);
    if (i >= ANSWER_WARMUP && unread > 0) nudged++;
    CHECK_RC(tshare_channel_wait_released(ch, id, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  CHECK(write(sent[1], &nudged, sizeof nudged) == (ssize_t)sizeof nudged);
  wait_byte(go[0]);
  tshare_channel_close(ch);
  tshare_host_buffer_destroy(buf);
}

/* A consumer in an event loop's style on one CPU with its producer: it
 * takes each share with a receive that may wait, drops it, and drives the
 * channel once without waiting, which sends the release. The producer,
 * woken by the release, shares again at once, while that look runs; the
 * ask for a nudge the previous look left is withdrawn before the release
 * goes, so the answer costs no socket write. Before, every answer did:
 * the producer wrote a nudge and this end read it. */
TS_TEST(the_answer_to_a_release_a_poll_loops_look_sends_costs_no_nudge) {
  cpu_set_t saved, one;
  CHECK(sched_getaffinity(0, sizeof saved, &saved) == 0);
  CPU_ZERO(&one);
  for (unsigned cpu = 0; cpu < (unsigned)CPU_SETSIZE; cpu++)
    if (CPU_ISSET(cpu, &saved)) {
      CPU_SET(cpu, &one);
      break;
    }
  CHECK(sched_setaffinity(0, sizeof one, &one) == 0); /* the producer forked next shares it */
  CHECK(pipe(go) == 0 && pipe(sent) == 0);
  int sock;
  pid_t pid = fork_with_socket(shares_again_when_released, &sock);
  tshare_channel *ch = open_ring_channel(sock, "event loop");
  (void)tshare_channel_fd(ch); /* polled: a look that finds nothing asks for nudges */
  for (int i = 0; i < ANSWER_ROUNDS; i++) {
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    tshare_view_release(v);
    int rc = tshare_channel_poll(ch, 0);
    CHECK(rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT);
  }
  int nudged = -1;
  CHECK(read(sent[0], &nudged, sizeof nudged) == (ssize_t)sizeof nudged);
  CHECK(write(go[1], "x", 1) == 1);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
  CHECK(sched_setaffinity(0, sizeof saved, &saved) == 0);
  printf("  %d of %d answers left a nudge\n", nudged, ANSWER_ROUNDS - ANSWER_WARMUP);
  /* A look that finds nothing still asks, so an answer that comes after it
   * is nudged: a few may, under load. */
  CHECK(nudged * 4 < ANSWER_ROUNDS - ANSWER_WARMUP);
}

TS_TEST_MAIN
