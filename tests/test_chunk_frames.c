/* A peer that repeats a share id while the first share of that id still
 * waits to be received, with chunk frames (the fds of VMM memory that spans
 * several chunks) before each: the repeat is a protocol error naming the
 * peer, its fds are closed, and the first share's stay filed for it. After
 * both are dealt with, the whole budget of unclaimed fds is free again and
 * closing the channel leaves none of the peer's fds open. */
#include "harness.h"
#include "hostile_peer.h"
#include "tshare/share.h"

static const tshare_dtype I32 = {TSHARE_DTYPE_INT, 32, 1};
enum { BUDGET = 12, CHUNKS = 4, CHUNK_BYTES = 4096, REPEATED_ID = 7, HOST_ID = 8 };

static tshare_tensor_desc ints(int64_t n) { return tshare_tensor_contiguous(I32, 1, &n, 0); }

/* Chunks 1..CHUNKS-1 of allocation 9, each with fd, then the share of id
 * REPEATED_ID that carries chunk 0. */
static void send_chunked_share(tshare_channel *ch, int fd) {
  for (uint32_t i = 1; i < CHUNKS; i++) {
    tshare_frame k;
    memset(&k, 0, sizeof k);
    k.type = TSHARE_FRAME_CHUNK;
    k.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
    k.u.chunk.alloc_id = 9;
    k.u.chunk.index = i;
    k.u.chunk.count = CHUNKS;
    k.u.chunk.size = CHUNK_BYTES;
    send_raw(ch, &k, fd);
  }
  tshare_frame s = memfd_share_frame(CHUNKS * CHUNK_BYTES, ints(16));
  s.u.share.share_id = REPEATED_ID;
  s.u.share.alloc_id = 9;
  s.u.share.mem_kind = TSHARE_MEM_CUDA_FD;
  s.u.share.device_type = TSHARE_DEVICE_CUDA;
  s.u.share.share_flags = TSHARE_SHARE_FLAG_CHUNKS;
  send_raw(ch, &s, fd);
}

static void send_host_share(tshare_channel *ch, uint64_t share_id, int fd) {
  tshare_frame s = memfd_share_frame(CHUNK_BYTES, ints(16));
  s.u.share.share_id = share_id;
  send_raw(ch, &s, fd);
}

static int go[2], sent[2]; /* parent -> child: go on; child -> parent: a phase is on the socket */

static void wait_byte(int fd) {
  char b;
  CHECK(read(fd, &b, 1) == 1);
}

static void say_byte(int fd) { CHECK(write(fd, "x", 1) == 1); }

/* Phase 1: a chunked share, the same id again with its own chunks, a host
 * share. Phase 2 (once told): BUDGET host shares at once, then bye; then it
 * waits for the consumer to be done. */
static void repeats_a_share_id(int fd) {
  tshare_channel *ch = open_socket_only_channel(fd, "repeating producer");
  tshare_host_buffer *b;
  CHECK_RC(tshare_host_buffer_create(CHUNK_BYTES, "tshare-repeat", &b, NULL), TSHARE_OK, "");
  int32_t *p = tshare_host_buffer_data(b);
  for (int i = 0; i < 16; i++) p[i] = 40 + i;
  int mem = tshare_host_buffer_fd(b);
  send_chunked_share(ch, mem);
  send_chunked_share(ch, mem);
  send_host_share(ch, HOST_ID, mem);
  say_byte(sent[1]);
  wait_byte(go[0]);
  for (uint64_t i = 0; i < BUDGET; i++) send_host_share(ch, 100 + i, mem);
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  say_byte(sent[1]);
  wait_byte(go[0]); /* the consumer is done (its hang-up cannot be seen: this child holds both socket ends) */
  tshare_host_buffer_destroy(b);
  tshare_channel_close(ch);
}

static void check_host_view(tshare_view *v) {
  const int32_t *p = tshare_view_data(v);
  for (int i = 0; i < 16; i++) CHECK_EQ(p[i], 40 + i);
  tshare_view_release(v);
}

/* Receive until the host share of HOST_ID: the first share of the repeated
 * id cannot be imported here (its chunks are memfds, not GPU memory). */
static void receive_until_the_host_share(tshare_channel *ch) {
  for (int tries = 0; tries < 4; tries++) {
    tshare_view *v = NULL;
    int rc = tshare_view_recv(ch, 5000, &v);
    if (rc == TSHARE_OK && tshare_view_share_id(v) == HOST_ID) {
      check_host_view(v);
      return;
    }
    CHECK(rc != TSHARE_OK && rc != TSHARE_E_TIMEOUT && rc != TSHARE_END);
    printf("share %d refused: %s\n", REPEATED_ID, tshare_channel_last_error(ch));
  }
  TS_FAIL("the host share never came");
}

TS_TEST(a_repeated_share_id_with_chunk_frames_leaks_no_fd_and_no_budget) {
#ifndef TSHARE_HAVE_CUDA
  TS_SKIP("built without CUDA: every chunk frame is refused outright");
#endif
  CHECK(pipe(go) == 0 && pipe(sent) == 0);
  int sock;
  pid_t pid = fork_with_socket(repeats_a_share_id, &sock);
  tshare_channel *ch = open_with_budget(sock, "consumer", BUDGET);

  wait_byte(sent[0]);
  int rc = tshare_channel_poll(ch, 5000); /* queues the first share, refuses the repeat */
  printf("%s: %s\n", tshare_status_name(rc), tshare_channel_last_error(ch));
  CHECK_EQ(rc, TSHARE_E_PROTOCOL);
  CHECK(strstr(tshare_channel_last_error(ch), "share 7") != NULL);
  CHECK(strstr(tshare_channel_last_error(ch), "repeating producer") != NULL);
  receive_until_the_host_share(ch);

  say_byte(go[1]);
  wait_byte(sent[0]);
  CHECK_RC(tshare_channel_poll(ch, 5000), TSHARE_END, tshare_channel_last_error(ch)); /* all queued, none refused */
  for (int i = 0; i < BUDGET; i++) {
    tshare_view *v;
    CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(tshare_view_share_id(v), 100 + i);
    check_host_view(v);
  }
  say_byte(go[1]);
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
  CHECK_EQ(count_memfds_named("tshare-repeat"), 0); /* a CUDA driver opens fds of its own */
}

TS_TEST_MAIN
