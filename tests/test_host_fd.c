/* Host buffers over a file of the caller's (tshare_host_buffer_wrap_fd):
 * an unsealed tmpfs file, as torch's shared CPU memory is, travels as
 * itself (TSHARE_MEM_HOST_FD) with no copy; the consumer refuses what it
 * cannot map safely (not a regular file, smaller than claimed) and
 * releases it back, the channel usable. */
#include "harness.h"
#include "hostile_peer.h"
#include "tshare/hostmem.h"
#include "tshare/share.h"
#include "tshare/wire.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>

#define I32 ((tshare_dtype){TSHARE_DTYPE_INT, 32, 1})
enum { INTS = 1024, FILE_BYTES = INTS * 4 };

static tshare_tensor_desc ints(int64_t n) { return tshare_tensor_contiguous(I32, 1, &n, 0); }

/* An unsealed file of FILE_BYTES in tmpfs, filled with base + i: torch's
 * file_descriptor strategy makes the same (an unlinked /dev/shm file). */
static int unsealed_file(int32_t base) {
  int fd = open("/dev/shm", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) fd = memfd_create("unsealed", MFD_CLOEXEC); /* no sealing allowed: never sealed */
  CHECK(fd >= 0);
  CHECK(ftruncate(fd, FILE_BYTES) == 0);
  int32_t *p = mmap(NULL, FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  CHECK(p != MAP_FAILED);
  for (int i = 0; i < INTS; i++) p[i] = base + i;
  munmap(p, FILE_BYTES);
  return fd;
}

/* The consumer's releases go out when it drives the channel. */
static void flush_releases(tshare_channel *ch) {
  int rc = tshare_channel_poll(ch, 0);
  CHECK(rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT || rc == TSHARE_END);
}

static int last_ref_calls;
static void count_last_ref(void *ctx) { (*(int *)ctx)++; }

TS_TEST(what_is_not_a_regular_file_of_the_size_claimed_cannot_be_wrapped) {
  tshare_host_buffer *b = NULL;
  tshare_error err;
  int p[2];
  CHECK(pipe(p) == 0);
  CHECK_RC(tshare_host_buffer_wrap_fd(p[0], 4096, NULL, NULL, NULL, &b, &err), TSHARE_E_INVALID_ARG, err.message);
  CHECK(b == NULL && strstr(err.message, "not a regular file"));
  int s[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, s) == 0);
  CHECK_RC(tshare_host_buffer_wrap_fd(s[0], 4096, NULL, NULL, NULL, &b, &err), TSHARE_E_INVALID_ARG, err.message);
  int fd = unsealed_file(0);
  CHECK_RC(tshare_host_buffer_wrap_fd(fd, FILE_BYTES + 1, NULL, NULL, NULL, &b, &err), TSHARE_E_OUT_OF_BOUNDS,
           err.message);
  CHECK_RC(tshare_host_buffer_wrap_fd(-1, 4096, NULL, NULL, NULL, &b, &err), TSHARE_E_INVALID_ARG, err.message);
  close(p[0]), close(p[1]), close(s[0]), close(s[1]), close(fd);
}

/* The producer: one share of an unsealed file, over its own mapping; waits
 * for the release and checks the consumer's write and the last reference. */
static void shares_an_unsealed_file(int sock) {
  tshare_channel *ch = open_socket_channel(sock, "file producer", NULL, NULL);
  int fd = unsealed_file(100);
  int32_t *mine = mmap(NULL, FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  CHECK(mine != MAP_FAILED);
  tshare_host_buffer *b = NULL;
  tshare_error err;
  CHECK_RC(tshare_host_buffer_wrap_fd(fd, FILE_BYTES, mine, count_last_ref, &last_ref_calls, &b, &err), TSHARE_OK,
           err.message);
  close(fd); /* the buffer holds its own duplicate */
  CHECK(tshare_host_buffer_data(b) == mine);
  uint64_t id;
  tshare_tensor_desc d = ints(INTS);
  CHECK_RC(tshare_share_host(ch, b, &d, "file", NULL, 5000, &id), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_host_buffer_destroy(b);
  CHECK_EQ(last_ref_calls, 0); /* the share holds it */
  CHECK_RC(tshare_channel_wait_released(ch, id, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(last_ref_calls, 1);
  CHECK_EQ(mine[0], -7); /* the consumer wrote into this very file */
  munmap(mine, FILE_BYTES);
  tshare_channel_close(ch);
}

TS_TEST(an_unsealed_file_travels_as_itself_and_the_consumers_writes_land_in_it) {
  int sock;
  pid_t pid = fork_with_socket(shares_an_unsealed_file, &sock);
  tshare_channel *ch = open_socket_channel(sock, "consumer", NULL, NULL);
  tshare_view *v = NULL;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  const int32_t *p = tshare_view_data(v);
  for (int i = 0; i < INTS; i++) CHECK_EQ(p[i], 100 + i);
  ((int32_t *)tshare_view_data(v))[0] = -7;
  tshare_view_release(v);
  flush_releases(ch);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* A hand-rolled producer: TSHARE_MEM_HOST_FD shares of a pipe, of a socket,
 * of a file smaller than claimed, then a good one; every one comes back. */
static void sends_what_cannot_be_mapped(int sock) {
  tshare_channel *ch = open_socket_only_channel(sock, "lying producer");
  int p[2], s[2];
  CHECK(pipe(p) == 0 && socketpair(AF_UNIX, SOCK_STREAM, 0, s) == 0);
  int small = unsealed_file(0), good = unsealed_file(5);
  CHECK(ftruncate(small, FILE_BYTES / 4) == 0);
  int fds[] = {p[0], s[0], small, good};
  for (unsigned i = 0; i < 4; i++) {
    tshare_frame f = memfd_share_frame(FILE_BYTES, ints(INTS));
    f.u.share.mem_kind = TSHARE_MEM_HOST_FD;
    f.u.share.share_id = i + 1;
    f.u.share.alloc_id = i + 1;
    send_raw(ch, &f, fds[i]);
  }
  unsigned came_back = 0;
  while (came_back < 4) {
    tshare_frame f;
    int got = -1;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &got, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    if (got >= 0) close(got);
    if (f.type == TSHARE_FRAME_RELEASE) came_back += f.u.release.count;
  }
  CHECK_RC(tshare_channel_send_bye(ch, 0, 5000), TSHARE_OK, "");
  tshare_channel_close(ch);
}

TS_TEST(a_pipe_a_socket_or_a_short_file_is_refused_and_released_back) {
  int sock;
  pid_t pid = fork_with_socket(sends_what_cannot_be_mapped, &sock);
  tshare_channel *ch = open_socket_channel(sock, "consumer", NULL, NULL);
  const char *want[] = {"not a regular file", "not a regular file", "claims"};
  for (unsigned i = 0; i < 3; i++) {
    tshare_view *v = NULL;
    int rc = tshare_view_recv(ch, 5000, &v);
    printf("%s: %s\n", tshare_status_name(rc), tshare_channel_last_error(ch));
    CHECK(rc != TSHARE_OK && v == NULL);
    CHECK(strstr(tshare_channel_last_error(ch), want[i]) != NULL);
  }
  tshare_view *v = NULL;
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(((const int32_t *)tshare_view_data(v))[3], 8); /* the channel goes on */
  tshare_view_release(v);
  CHECK_RC(tshare_view_recv(ch, 5000, &v), TSHARE_END, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
  CHECK_CHILD_OK(pid);
}

TS_TEST_MAIN
