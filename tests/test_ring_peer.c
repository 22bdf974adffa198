/* A channel's connection against peers that send at awkward moments or
 * break the ring transport's rules, watched the way event loops and busy
 * senders watch it: a poll loop on tshare_channel_fd() must wake for what the
 * peer sent right after the channel opened, must not spin on socket bytes it
 * cannot use yet, a send waiting for ring room must sleep and keep its
 * read-ahead within bounds, releases owed to a peer whose ring is full must
 * not keep a drive from reading what it sent, and fds past the channel's
 * budget must cost no memory. */
#include "harness.h"
#include "hostile_peer.h"
#include "proc_util.h"
#include "tshare/share.h"

#include <poll.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/resource.h>

static const tshare_dtype I32 = {TSHARE_DTYPE_INT, 32, 1};

static tshare_tensor_desc ints(int64_t n) { return tshare_tensor_contiguous(I32, 1, &n, 0); }

/* Drive a channel as an event loop does once its fd is readable: until
 * nothing more came (TSHARE_E_TIMEOUT) or something ended it. */
static int drive_until_quiet(tshare_channel *ch) {
  int rc;
  while ((rc = tshare_channel_poll(ch, 0)) == TSHARE_OK) {
  }
  return rc;
}

/* Sleep in poll() on the channel's fd and drive it after each wake-up, until
 * a drive ends with something other than "nothing came". At most `wakeups`
 * wake-ups, each within wait_ms: a loop that sleeps through the peer's frame,
 * or spins on the fd, fails. */
static int event_loop(tshare_channel *ch, int wakeups, int wait_ms) {
  struct pollfd p = {.fd = tshare_channel_fd(ch), .events = POLLIN, .revents = 0};
  for (int i = 0; i < wakeups; i++) {
    if (poll(&p, 1, wait_ms) != 1) TS_FAIL("the channel's fd stayed quiet for %d ms after %d wake-ups", wait_ms, i);
    int rc = drive_until_quiet(ch);
    if (rc != TSHARE_E_TIMEOUT) return rc;
  }
  TS_FAIL("the channel's fd woke the loop %d times and nothing came: it spins", wakeups);
}

/* ---- 1. a peer that sends as soon as the channel opens ---------------------- */

enum { OPEN_TRIALS = 40 };

/* Stays open after sending (a hang-up would wake the loop on its own) until
 * the other end closes. */
static void wait_for_the_other_end(tshare_channel *ch) {
  tshare_view *none;
  CHECK_RC(tshare_view_recv(ch, 10000, &none), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void says_bye_at_once(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "hasty peer", NULL, NULL);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  wait_for_the_other_end(ch);
}

static void reports_an_error_at_once(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "hasty peer", NULL, NULL);
  CHECK_RC(tshare_channel_send_error(ch, TSHARE_E_STATE, "an error right after the hello"), TSHARE_OK,
           tshare_channel_last_error(ch));
  wait_for_the_other_end(ch);
}

TS_TEST(a_poll_loop_wakes_for_what_the_peer_sends_as_the_channel_opens) {
  for (int trial = 0; trial < OPEN_TRIALS; trial++) {
    bool bye = trial % 2 == 0;
    int sock;
    pid_t pid = fork_with_socket(bye ? says_bye_at_once : reports_an_error_at_once, &sock);
    tshare_channel *ch = open_socket_channel(sock, "event loop", NULL, NULL);
    int rc = event_loop(ch, 100, 3000);
    CHECK_RC(rc, bye ? TSHARE_END : TSHARE_E_PEER_ERROR, tshare_channel_last_error(ch));
    tshare_channel_close(ch);
    CHECK_CHILD_OK(pid);
  }
}

/* ---- 2. fd frames on the socket without their place in the ring ------------- */

/* A memfd share on the socket with no SOCKET_NEXT entry in the ring, then
 * what follows it (a nudge, which ring peers do send on the socket, or a
 * second share); then waits until the other end closes. */
static void shares_without_ring_entries(int fd, bool second_share) {
  tshare_channel *ch = open_ring_channel(fd, "markerless peer");
  int mem = memfd_create("tshare-markerless", MFD_CLOEXEC);
  CHECK(mem >= 0 && ftruncate(mem, 64) == 0);
  tshare_frame s = memfd_share_frame(64, ints(16));
  send_raw(ch, &s, mem);
  if (second_share) {
    s.u.share.share_id = 2;
    send_raw(ch, &s, mem);
  } else {
    tshare_frame nudge = ring_op_frame(TSHARE_RING_NUDGE);
    send_raw(ch, &nudge, -1);
  }
  close(mem);
  tshare_frame f;
  int got = -1, rc;
  while ((rc = tshare_channel_recv_frame(ch, &f, &got, 10000)) == TSHARE_OK && f.type != TSHARE_FRAME_BYE) {
  }
  tshare_channel_close(ch);
}

static void one_share_and_a_nudge(int fd) { shares_without_ring_entries(fd, false); }
static void two_shares(int fd) { shares_without_ring_entries(fd, true); }

/* A legitimate ring peer puts an fd frame's entry into the ring before it
 * sends anything else on the socket: a second frame there first is the
 * peer's fault, said as such, and every fd it sent is closed. */
TS_TEST(a_second_socket_frame_before_the_ring_entry_of_the_first_is_a_protocol_error) {
  int fds_before = count_open_fds();
  int sock;
  pid_t pid = fork_with_socket(two_shares, &sock);
  tshare_channel *ch = open_ring_channel(sock, "event loop");
  int rc = event_loop(ch, 20, 5000);
  printf("%s: %s\n", tshare_status_name(rc), tshare_channel_last_error(ch));
  CHECK_RC(rc, TSHARE_E_PROTOCOL, tshare_channel_last_error(ch));
  CHECK(strstr(tshare_channel_last_error(ch), "markerless peer") != NULL);
  CHECK(strstr(tshare_channel_last_error(ch), "ring") != NULL);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
  CHECK_EQ(count_open_fds(), fds_before);
}

/* One fd frame waiting for its entry, and a nudge behind it: the loop takes
 * the nudge and sleeps (the frame waits, as it would for a peer whose ring is
 * full), instead of waking at once forever. */
TS_TEST(a_socket_frame_waiting_for_its_ring_entry_lets_a_poll_loop_sleep) {
  int sock;
  pid_t pid = fork_with_socket(one_share_and_a_nudge, &sock);
  tshare_channel *ch = open_ring_channel(sock, "event loop");
  struct pollfd p = {.fd = tshare_channel_fd(ch), .events = POLLIN, .revents = 0};
  int wakeups = 0;
  for (int64_t end = now_ms() + 500; now_ms() < end;) {
    if (poll(&p, 1, 100) != 1) continue;
    wakeups++;
    CHECK_RC(drive_until_quiet(ch), TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
    CHECK(wakeups < 1000);
  }
  printf("%d wake-ups in 500 ms\n", wakeups);
  CHECK(wakeups <= 10); /* the share's read, the nudge's; never a busy loop */
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

/* ---- 3. a peer that never reads its ring and floods the socket -------------- */

enum { FLOOD_BYTES = (16 << 20) + (64 << 10) }; /* past the 16 MiB a send reads ahead, with some left on the socket */
#define DONE_ID UINT64_MAX                      /* the release id that says "that was all" */
static int go[2];                               /* a byte: the flooding end may start reading */

static tshare_frame release_frame(uint64_t first_id) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = TSHARE_RELEASE_MAX;
  for (uint32_t i = 0; i < TSHARE_RELEASE_MAX; i++) f.u.release.share_ids[i] = first_id + i;
  return f;
}

/* Writes FLOOD_BYTES (rounded down to whole frames: the stream stays well
 * formed) of nudge frames on the socket, as fast as the other end reads. */
static void flood_nudges(int sock) {
  uint8_t one[64], burst[64 << 10];
  size_t len;
  tshare_frame nudge = ring_op_frame(TSHARE_RING_NUDGE);
  CHECK_RC(tshare_wire_encode(&nudge, one, sizeof one, &len, NULL), TSHARE_OK, "");
  size_t burst_len = sizeof burst / len * len, total = FLOOD_BYTES / len * len;
  for (size_t off = 0; off < burst_len; off += len) memcpy(burst + off, one, len);
  for (size_t sent = 0; sent < total;) {
    size_t at = sent % burst_len, want = burst_len - at;
    ssize_t w = write(sock, burst + at, want < total - sent ? want : total - sent);
    if (w > 0) {
      sent += (size_t)w;
      continue;
    }
    CHECK(errno == EAGAIN || errno == EINTR);
    struct pollfd p = {.fd = sock, .events = POLLOUT, .revents = 0};
    poll(&p, 1, 1000);
  }
}

/* Never reads its ring while it floods; once told, reads everything the
 * other end sent, shares a buffer, waits for its release and says bye. */
static void floods_nudges_and_reads_late(int fd) {
  tshare_channel *ch = open_ring_channel(fd, "nudge flooder");
  flood_nudges(tshare_channel_fd(ch));
  char byte;
  CHECK(read(go[0], &byte, 1) == 1);
  tshare_frame f;
  int got = -1;
  do CHECK_RC(tshare_channel_recv_frame(ch, &f, &got, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  while (!(f.type == TSHARE_FRAME_RELEASE && f.u.release.share_ids[0] == DONE_ID));
  tshare_host_buffer *b;
  CHECK_RC(tshare_host_buffer_create(64, "tshare-after-flood", &b, NULL), TSHARE_OK, "");
  memset(tshare_host_buffer_data(b), 7, 64);
  tshare_tensor_desc d = ints(16);
  CHECK_RC(tshare_share_host(ch, b, &d, NULL, NULL, 10000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, 0, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_host_buffer_destroy(b);
  wait_for_the_other_end(ch);
}

static double cpu_seconds(void) {
  struct rusage u;
  CHECK(getrusage(RUSAGE_SELF, &u) == 0);
  return (double)(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + (double)(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

TS_TEST(a_send_waiting_for_ring_room_sleeps_and_never_blames_a_live_peer) {
  CHECK(pipe2(go, O_CLOEXEC) == 0);
  int sock;
  pid_t pid = fork_with_socket(floods_nudges_and_reads_late, &sock);
  tshare_channel *ch = open_ring_channel(sock, "busy sender");
  tshare_frame f = release_frame(1);
  int rc;
  while ((rc = tshare_channel_send_frame(ch, &f, -1, 0)) == TSHARE_OK) {
  }
  CHECK_RC(rc, TSHARE_E_TIMEOUT, tshare_channel_last_error(ch)); /* the ring is full */
  /* A second's wait for room while the peer floods the socket: it reads up
   * to its read-ahead bound, then sleeps. */
  double cpu0 = cpu_seconds();
  CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 1000), TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
  double cpu = cpu_seconds() - cpu0;
  printf("a 1 s wait for ring room under a flood of nudges used %.3f s of CPU\n", cpu);
#if defined(__SANITIZE_THREAD__)
  /* ThreadSanitizer makes reading the read-ahead several times dearer; a
   * wait that spins still takes the whole second. */
  CHECK(cpu < 0.9);
#else
  CHECK(cpu < 0.5);
#endif
  CHECK(write(go[1], "g", 1) == 1);
  f.u.release.share_ids[0] = DONE_ID;
  CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  /* The peer is alive: its share comes, past everything read ahead. */
  tshare_view *v;
  CHECK_RC(tshare_view_recv(ch, 10000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(((const uint8_t *)tshare_view_data(v))[63], 7);
  tshare_view_release(v);
  CHECK_RC(tshare_view_recv(ch, 10000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

/* ---- 4. releases owed to a peer that never reads its ring -------------------- */

enum { OWED = 20 }; /* past the 16 owed releases that go even while frames wait to be read */

/* Shares a buffer OWED times; on the first byte on `go` once more; on the
 * second byte goes. Never reads its ring: what the other end owes stays owed. */
static void shares_and_never_reads(int fd) {
  close(go[1]); /* a parent that failed ends it too (EOF) */
  tshare_channel *ch = open_ring_channel(fd, "deaf peer");
  tshare_host_buffer *b;
  CHECK_RC(tshare_host_buffer_create(64, "tshare-deaf-peer", &b, NULL), TSHARE_OK, "");
  tshare_tensor_desc d = ints(16);
  char byte;
  for (int i = 0; i <= OWED; i++) {
    if (i == OWED && read(go[0], &byte, 1) != 1) _exit(0);
    memset(tshare_host_buffer_data(b), i == OWED ? 2 : 1, 64);
    CHECK_RC(tshare_share_host(ch, b, &d, NULL, NULL, 10000, NULL), TSHARE_OK, tshare_channel_last_error(ch));
  }
  if (read(go[0], &byte, 1) != 1) _exit(0);
  tshare_channel_close(ch);
  tshare_host_buffer_destroy(b);
}

/* A drive whose owed release times out on the full ring still reads what the
 * peer sent: returning at the release's "send: timed out" left the frame
 * unread and the fd readable, so an event loop spun. */
TS_TEST(a_release_owed_to_a_full_ring_does_not_keep_a_poll_loop_from_the_peers_frames) {
  CHECK(pipe2(go, O_CLOEXEC) == 0);
  int sock;
  pid_t pid = fork_with_socket(shares_and_never_reads, &sock);
  tshare_channel *ch = open_ring_channel(sock, "owing end");
  tshare_view *held[OWED], *v = NULL;
  for (int i = 0; i < OWED; i++)
    CHECK_RC(tshare_view_recv(ch, 10000, &held[i]), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_frame f = release_frame(1000);
  int rc;
  while ((rc = tshare_channel_send_frame(ch, &f, -1, 0)) == TSHARE_OK) {
  }
  CHECK_RC(rc, TSHARE_E_TIMEOUT, tshare_channel_last_error(ch)); /* the peer's ring is full */
  for (int i = 0; i < OWED; i++) tshare_view_release(held[i]); /* owed, due at the next drive, and cannot go */
  CHECK(write(go[1], "g", 1) == 1); /* the second share comes */
  struct pollfd p = {.fd = tshare_channel_fd(ch), .events = POLLIN, .revents = 0};
  for (int wakeups = 0; !v; wakeups++) { /* the event loop's rule, bounded */
    if (wakeups == 100) TS_FAIL("woke 100 times, the share never came: it spins (%s)", tshare_channel_last_error(ch));
    CHECK(poll(&p, 1, 5000) == 1);
    rc = tshare_view_recv(ch, 0, &v); /* the share, or nothing yet */
    if (rc != TSHARE_OK) CHECK_RC(rc, TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
  }
  CHECK_EQ(((const uint8_t *)tshare_view_data(v))[63], 2);
  /* Drained: the fd sleeps again (a wake or two for bytes left behind at most). */
  int wakeups = 0;
  while (poll(&p, 1, 100) == 1 && wakeups++ < 10)
    CHECK_RC(drive_until_quiet(ch), TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
  CHECK(wakeups <= 2);
  tshare_view_release(v);
  CHECK(write(go[1], "d", 1) == 1);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

/* ---- 5. one-byte messages, each carrying an fd, past the fd budget ----------- */

enum { FD_BUDGET = 4, WARM_UP = 1000, FD_MESSAGES = 100000 };
static int phase[2]; /* the flooding end says when the other end read all it sent ('1', '2') */

/* n one-byte messages on the socket, each with an fd beside it. */
static void send_bytes_with_fds(int sock, int fd, int n) {
  for (int i = 0; i < n; i++) {
    uint8_t byte = 0;
    struct iovec iov = {.iov_base = &byte, .iov_len = 1};
    union {
      char space[CMSG_SPACE(sizeof(int))];
      struct cmsghdr align;
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.space, .msg_controllen = sizeof ctl.space};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    ssize_t w;
    while ((w = sendmsg(sock, &msg, MSG_NOSIGNAL)) < 0 && (errno == EAGAIN || errno == EINTR)) {
      struct pollfd p = {.fd = sock, .events = POLLOUT, .revents = 0};
      poll(&p, 1, 1000);
    }
    CHECK(w == 1);
  }
}

/* Until the other end has read every byte sent (the socket's send queue is
 * empty), then says which phase ended. */
static void tell_when_read(int sock, char which) {
  int queued = 1;
  while (ioctl(sock, TIOCOUTQ, &queued) == 0 && queued > 0) usleep(1000);
  CHECK(write(phase[1], &which, 1) == 1);
}

static void sends_an_fd_with_every_byte(int fd) {
  tshare_channel *ch = open_socket_channel(fd, "fd flooder", NULL, NULL);
  char byte;
  CHECK(read(go[0], &byte, 1) == 1);
  int sock = tshare_channel_fd(ch), mem = memfd_create("tshare-fd-flood", MFD_CLOEXEC);
  send_bytes_with_fds(sock, mem, WARM_UP);
  tell_when_read(sock, '1');
  send_bytes_with_fds(sock, mem, FD_MESSAGES);
  tell_when_read(sock, '2');
  _exit(0); /* the stream it sent is no frame: it just goes */
}

static long resident_kib(void) {
  long size = 0, pages = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  CHECK(f && fscanf(f, "%ld %ld", &size, &pages) == 2);
  fclose(f);
  return pages * (sysconf(_SC_PAGESIZE) / 1024);
}

/* While a send waits for room (the peer reads nothing), the bytes the peer
 * sends are read ahead; fds past the budget that come with them are closed
 * at once, and the memory they cost does not grow with their number. */
TS_TEST(fds_past_the_budget_cost_no_memory_while_a_send_reads_ahead) {
  CHECK(pipe2(go, O_CLOEXEC) == 0 && pipe2(phase, O_CLOEXEC | O_NONBLOCK) == 0);
  int fds_before = count_open_fds();
  int sock;
  pid_t pid = fork_with_socket(sends_an_fd_with_every_byte, &sock);
  tshare_channel *ch = open_with_budget(sock, "reading ahead", FD_BUDGET);
  tshare_frame f = release_frame(1);
  int rc;
  while ((rc = tshare_channel_send_frame(ch, &f, -1, 0)) == TSHARE_OK) {
  }
  CHECK_RC(rc, TSHARE_E_TIMEOUT, tshare_channel_last_error(ch)); /* full: what follows waits and reads */
  CHECK(write(go[1], "g", 1) == 1);
  long kib[2] = {0, 0};
  for (int done = 0; done < 2;) {
    rc = tshare_channel_send_frame(ch, &f, -1, 20);
    CHECK(rc == TSHARE_E_TIMEOUT || (done == 1 && rc == TSHARE_E_PEER_CLOSED));
    char which;
    if (read(phase[0], &which, 1) == 1) kib[done++] = resident_kib();
  }
  long grown = kib[1] - kib[0];
  printf("%d one-byte messages with an fd each, past a budget of %d: resident memory grew by %ld KiB\n", FD_MESSAGES,
         FD_BUDGET, grown);
  /* The bytes read ahead (about 100 KiB, four times that in a sanitizer's
   * shadow), not 16 bytes more for each fd. */
  CHECK(grown * 1024 < FD_MESSAGES * 8L);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
  CHECK_EQ(count_open_fds(), fds_before); /* the fds kept within the budget went with the channel */
}

/* ---- 6. frames of every size across the ring's end -------------------------- */

enum { WRAP_FRAMES = 20000 }; /* ~2.6 MB of release frames: the 1 MiB ring wraps twice */

/* Release frames of 1..TSHARE_RELEASE_MAX ids, their ids counting up. */
static tshare_frame release_of(uint32_t count, uint64_t *next_id) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = count;
  for (uint32_t i = 0; i < count; i++) f.u.release.share_ids[i] = (*next_id)++;
  return f;
}

static uint32_t count_at(long i) { return (uint32_t)(i * 37 % TSHARE_RELEASE_MAX) + 1; }

static void receives_every_release_in_order(int fd) {
  tshare_channel *ch = open_ring_channel(fd, "wrap reader");
  uint64_t want = 1;
  for (long i = 0; i < WRAP_FRAMES; i++) {
    tshare_frame f;
    int got = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &got, 10000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(f.type, TSHARE_FRAME_RELEASE);
    CHECK_EQ(f.u.release.count, count_at(i));
    for (uint32_t k = 0; k < f.u.release.count; k++)
      if (f.u.release.share_ids[k] != want++) TS_FAIL("frame %ld, id %u: %llu", i, k,
                                                       (unsigned long long)f.u.release.share_ids[k]);
  }
  tshare_channel_close(ch);
}

/* Frames are encoded straight into the ring where they fit before its end,
 * and copied in two pieces where they do not: every one arrives whole and in
 * order, however the ring's end cuts them. */
TS_TEST(frames_of_every_size_cross_the_rings_end_whole_and_in_order) {
  int sock;
  pid_t pid = fork_with_socket(receives_every_release_in_order, &sock);
  tshare_channel *ch = open_ring_channel(sock, "wrap writer");
  CHECK_EQ(tshare_channel_transport(ch), TSHARE_TRANSPORT_RING);
  uint64_t next_id = 1;
  for (long i = 0; i < WRAP_FRAMES; i++) {
    tshare_frame f = release_of(count_at(i), &next_id);
    CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

TS_TEST_MAIN
