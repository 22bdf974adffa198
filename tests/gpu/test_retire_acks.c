/* The CUDA backend's retire answers when the peer stops reading: acks that
 * take several retire frames, where the socket takes some frames and a later
 * one times out. What went must not go again; the rest goes once the peer
 * reads. Needs the CUDA backend built, no device: the retire notices are
 * handed to the backend as the receive loop would (more of them than one
 * receive brings, so that the acks fill several frames). */
#include "cuda_hooks.h"
#include "harness.h"
#include "proc_util.h"
#include "tshare/share.h"

#include <poll.h>
#include <string.h>
#include <sys/socket.h>

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
    CHECK_RC(ts_cuda_on_frame(ch, &f), TSHARE_OK, tshare_channel_last_error(ch));
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
  CHECK_EQ(rc, TSHARE_E_TIMEOUT);
  CHECK(strstr(tshare_channel_last_error(ch), "send") != NULL); /* the acks', not the receive's */
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

TS_TEST_MAIN
