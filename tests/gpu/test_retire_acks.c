/* The CUDA backend's retire frames when the peer stops reading. Acks that
 * take several retire frames, where the socket takes some frames and a later
 * one times out: what went must not go again; the rest goes once the peer
 * reads. Needs the CUDA backend built, no device: the retire notices are
 * handed to the backend's frame hook as the receive loop would (more of them than one
 * receive brings, so that the acks fill several frames). And a producer's
 * own retire notice (an allocation nobody holds any more, a held segment
 * idle long enough) that times out: it goes once the peer reads again, or
 * the peer would keep its mapping, and the producer the memory, until the
 * channel closes. Those need a device (they exit 77 without one). */
#include "backend.h"
#include "harness.h"
#include "proc_util.h"
#include "tshare/cuda.h"
#include "tshare/share.h"

#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>

enum { FRAMES = 8, IDS = FRAMES * TSHARE_RELEASE_MAX };

static int go[2], done[2]; /* parent -> child: read now; child -> parent: every ack came */

/* Reads retire acks (closed = 1) until every id came, failing on one that
 * comes twice. */
static void reads_acks_late(int fd) {
  tshare_channel *ch = open_socket_only_channel(fd, "silent peer");
  char b;
  CHECK(read(go[0], &b, 1) == 1);
  static bool seen[IDS + 1];
  int distinct = 0;
  while (distinct < IDS) {
    tshare_frame f;
    int got = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &got, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    if (f.type != TSHARE_FRAME_RETIRE || f.u.retire.closed != 1) continue;
    for (uint32_t i = 0; i < f.u.retire.count; i++) {
      uint64_t id = f.u.retire.alloc_ids[i];
      CHECK(id >= 1 && id <= IDS);
      if (seen[id]) TS_FAIL("the ack of allocation %llu came twice", (unsigned long long)id);
      seen[id] = true;
      distinct++;
    }
  }
  CHECK(write(done[1], "x", 1) == 1);
  CHECK(read(go[0], &b, 1) == 1); /* until the consumer is done: its hang-up cannot be seen here */
  tshare_channel_close(ch);
}

/* Retire notices for allocations 1..IDS, as the receive loop passes them on. */
static void peer_retires_everything(tshare_channel *ch) {
  for (uint64_t first = 1; first <= IDS; first += TSHARE_RELEASE_MAX) {
    tshare_frame f;
    memset(&f, 0, sizeof f);
    f.type = TSHARE_FRAME_RETIRE;
    f.u.retire.closed = 0;
    for (uint64_t id = first; id < first + TSHARE_RELEASE_MAX; id++) f.u.retire.alloc_ids[f.u.retire.count++] = id;
    const ts_backend *cuda = ts_backend_for_frame(TSHARE_FRAME_RETIRE);
    CHECK(cuda != NULL);
    CHECK_RC(cuda->on_frame(ch, &f, -1, 0), TSHARE_OK, tshare_channel_last_error(ch));
  }
}

TS_TEST(acks_that_went_before_a_retire_frame_timed_out_do_not_go_again) {
  CHECK(pipe(go) == 0 && pipe(done) == 0);
  int sock;
  pid_t pid = fork_with_socket(reads_acks_late, &sock);
  close(done[1]);   /* a child that failed is seen as an end of file */
  int small = 4096; /* room for a few frames of acks, not for all of them */
  CHECK(setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &small, sizeof small) == 0);
  tshare_channel *ch = open_socket_only_channel(sock, "consumer");
  peer_retires_everything(ch);
  /* The acks go before the receive waits: some frames fit, then one times out. */
  int rc = tshare_channel_poll(ch, 300);
  printf("%s: %s\n", tshare_status_name(rc), tshare_channel_last_error(ch));
  CHECK_EQ(rc, TSHARE_E_TIMEOUT); /* the acks' send timed out, then the receive found nothing */
  CHECK(write(go[1], "x", 1) == 1);
  char b;
  for (int tries = 0; tries < 100; tries++) { /* the rest go as the peer reads (each poll up to 50 ms) */
    rc = tshare_channel_poll(ch, 50);
    CHECK(rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT);
    struct pollfd p = {.fd = done[0], .events = POLLIN};
    if (poll(&p, 1, 0) == 1) break;
  }
  CHECK(read(done[0], &b, 1) == 1);
  CHECK(write(go[1], "x", 1) == 1);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

/* ---- a producer's retire notice that timed out -------------------------- */

/* Whether a CUDA device is usable, asked in a child: a process that
 * initialized CUDA must not fork, and the peers below are forked. */
static bool cuda_device_usable(void) {
  fflush(stdout);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) _exit(tshare_cuda_device_count() > 0 ? 0 : 1);
  int st = wait_child(pid);
  return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

/* Takes the one share that comes and releases it at once, then reads nothing
 * until told; then reads until the retire notice (closed = 0) of that
 * share's allocation comes. */
static void waits_for_the_retire(int fd) {
  tshare_channel *ch = open_socket_only_channel(fd, "silent consumer");
  tshare_frame f;
  int got = -1;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &got, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(f.type, TSHARE_FRAME_SHARE);
  if (got >= 0) close(got);
  uint64_t alloc_id = f.u.share.alloc_id;
  tshare_frame r;
  memset(&r, 0, sizeof r);
  r.type = TSHARE_FRAME_RELEASE;
  r.u.release.count = 1;
  r.u.release.share_ids[0] = f.u.share.share_id;
  CHECK_RC(tshare_channel_send_frame(ch, &r, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  char b;
  CHECK(read(go[0], &b, 1) == 1);
  for (bool seen = false; !seen;) {
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &got, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    if (got >= 0) close(got);
    for (uint32_t i = 0; f.type == TSHARE_FRAME_RETIRE && f.u.retire.closed == 0 && i < f.u.retire.count; i++)
      seen = seen || f.u.retire.alloc_ids[i] == alloc_id;
  }
  CHECK(write(done[1], "x", 1) == 1);
  CHECK(read(go[0], &b, 1) == 1); /* until the producer is done: its hang-up cannot be seen here */
  tshare_channel_close(ch);
}

/* Frames the peer does not read, sent until the socket takes no more. */
static void fill_the_socket(tshare_channel *ch) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = TSHARE_RELEASE_MAX;
  for (uint32_t i = 0; i < TSHARE_RELEASE_MAX; i++) f.u.release.share_ids[i] = UINT64_MAX - i; /* nobody's */
  int rc;
  while ((rc = tshare_channel_send_frame(ch, &f, -1, 0)) == TSHARE_OK) {
  }
  CHECK_RC(rc, TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
}

/* The notice's first try times out on the full socket; once the peer reads,
 * polls send it. */
static void retire_goes_once_the_peer_reads(tshare_channel *ch) {
  int rc = tshare_channel_poll(ch, 300);
  printf("%s: %s\n", tshare_status_name(rc), tshare_channel_last_error(ch));
  CHECK_EQ(rc, TSHARE_E_TIMEOUT); /* the notice's send timed out, then the receive found nothing */
  CHECK(write(go[1], "x", 1) == 1);
  for (int tries = 0; tries < 100; tries++) { /* each poll up to 50 ms */
    rc = tshare_channel_poll(ch, 50);
    CHECK(rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT);
    struct pollfd p = {.fd = done[0], .events = POLLIN, .revents = 0};
    if (poll(&p, 1, 0) == 1) break;
  }
  char b;
  CHECK(read(done[0], &b, 1) == 1); /* the notice came (end of file: the peer failed) */
  CHECK(write(go[1], "x", 1) == 1);
}

static tshare_channel *producer_beside_a_silent_consumer(pid_t *pid) {
  if (!cuda_device_usable()) TS_SKIP("no CUDA device");
  CHECK(pipe(go) == 0 && pipe(done) == 0);
  int sock;
  *pid = fork_with_socket(waits_for_the_retire, &sock);
  close(done[1]);
  int small = 4096;
  CHECK(setsockopt(sock, SOL_SOCKET, SO_SNDBUF, &small, sizeof small) == 0);
  return open_socket_only_channel(sock, "producer");
}

static tshare_tensor_desc ints(int64_t n) {
  return tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, &n, 0);
}

/* A buffer of tshare's own, shared, released by the peer, then dropped by
 * the program: the peer is told to close its mapping. */
TS_TEST(the_retire_of_an_allocation_nobody_holds_goes_again_after_a_timeout) {
  pid_t pid;
  tshare_channel *ch = producer_beside_a_silent_consumer(&pid);
  tshare_cuda_buffer *buf;
  tshare_error err;
  CHECK_RC(tshare_cuda_buffer_create(0, 1 << 20, &buf, &err), TSHARE_OK, err.message);
  tshare_tensor_desc d = ints(1024);
  uint64_t id;
  CHECK_RC(tshare_share_cuda_buffer(ch, buf, &d, NULL, "owned", NULL, 10000, &id), TSHARE_OK,
           tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  fill_the_socket(ch);
  tshare_cuda_buffer_release(buf); /* only the peer's mapping holds it now */
  retire_goes_once_the_peer_reads(ch);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

static void count_drop(void *keep) { ++*(int *)keep; }

/* cudaMalloc memory shared with a drop function: the producer holds the
 * segment for the peer's mapping after the release, and asks the peer to
 * close it once it was idle a while. */
TS_TEST(the_retire_of_an_idle_held_segment_goes_again_after_a_timeout) {
  pid_t pid;
  tshare_channel *ch = producer_beside_a_silent_consumer(&pid);
  tshare_cuda_buffer *buf;
  tshare_error err;
  CHECK_RC(tshare_cuda_buffer_create_kind(0, 1 << 20, TSHARE_CUDA_HANDLE_LEGACY, &buf, &err), TSHARE_OK, err.message);
  tshare_tensor_desc d = ints(1024);
  int drops = 0;
  uint64_t id;
  CHECK_RC(tshare_share_cuda_keep(ch, tshare_cuda_buffer_ptr(buf), &d, NULL, "held", count_drop, &drops, NULL, 10000,
                                  &id),
           TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_RC(tshare_channel_wait_released(ch, id, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(drops, 0); /* held for the peer's mapping */
  fill_the_socket(ch);
  usleep(300 * 1000); /* past the idle time after which a held segment is retired */
  retire_goes_once_the_peer_reads(ch);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
  CHECK_EQ(drops, 1);
  tshare_cuda_buffer_release(buf);
}

TS_TEST_MAIN
