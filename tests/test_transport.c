/* The transport table below the session: what each transport says it can
 * do, the connection's own statuses and their public names, a connection
 * on an unknown kind or the wrong fds refused, and the fd queue pairing fds
 * with the frames they came with. */
#include "conn.h"
#include "harness.h"
#include "tshare/channel.h" /* TSHARE_ANY_UID, which TS_CONN_ANY_UID must equal */

#include <errno.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

TS_TEST(each_transport_says_what_it_can_do) {
  const uint32_t fds = TS_TRANSPORT_PASSES_FDS, creds = TS_TRANSPORT_PEER_CREDENTIALS, host = TS_TRANSPORT_SAME_HOST,
                 shm = TS_TRANSPORT_SHARED_MEMORY;
  CHECK_EQ(ts_transport_of(TS_CONN_SOCKET)->caps, fds | creds | host);
  CHECK_EQ(ts_transport_of(TS_CONN_PIPES)->caps, host);
  CHECK_EQ(ts_transport_of(TS_CONN_LOOPBACK)->caps, fds | host);
  CHECK_EQ(ts_transport_ring.caps, fds | creds | host | shm);
  CHECK(ts_transport_of((ts_conn_kind)99) == NULL);
}

TS_TEST(a_connection_asks_its_transport) {
  int sv[2], p[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0 && pipe(p) == 0);
  char err[256];
  ts_conn s, q;
  CHECK_RC(ts_conn_init(&s, TS_CONN_SOCKET, sv[0], sv[0], NULL, 0, err, sizeof err), TSHARE_OK, err);
  CHECK_RC(ts_conn_init(&q, TS_CONN_PIPES, p[0], p[1], NULL, 0, err, sizeof err), TSHARE_OK, err);
  CHECK_EQ(ts_conn_caps(&s), ts_transport_socket.caps);
  CHECK_EQ(ts_conn_caps(&q), ts_transport_pipes.caps);
  CHECK(!ts_conn_uses_ring(&s)); /* only a hello both ends asked for sets it up */
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_BYE;
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  CHECK_RC(ts_conn_send(&q, &f, sv[1], 100), TSHARE_E_UNSUPPORTED, err);
  CHECK(strstr(err, "pipe channel cannot carry fds") != NULL);
  ts_conn_close(&s);
  ts_conn_destroy(&s);
  ts_conn_close(&q);
  ts_conn_destroy(&q);
  close(sv[1]);
}

TS_TEST(a_connection_on_an_unknown_kind_or_the_wrong_fds_is_refused) {
  int p[2];
  CHECK(pipe(p) == 0);
  char err[256];
  ts_conn c;
  CHECK_RC(ts_conn_init(&c, (ts_conn_kind)99, p[0], p[1], NULL, 0, err, sizeof err), TSHARE_E_INVALID_ARG, err);
  CHECK(strstr(err, "unknown transport") != NULL);
  ts_conn_close(&c); /* closes the fds it was given */
  ts_conn_destroy(&c);
  CHECK(fcntl(p[0], F_GETFD) < 0 && errno == EBADF);
  CHECK(pipe(p) == 0);
  CHECK_RC(ts_conn_init(&c, TS_CONN_SOCKET, p[0], p[1], NULL, 0, err, sizeof err), TSHARE_E_INVALID_ARG, err);
  CHECK(strstr(err, "not a stream socket") != NULL);
  ts_conn_close(&c);
  ts_conn_destroy(&c);
  CHECK(pipe(p) == 0);
  CHECK_RC(ts_conn_init(&c, TS_CONN_LOOPBACK, p[0], p[1], NULL, 0, err, sizeof err), TSHARE_E_INVALID_ARG, err);
  ts_conn_close(&c);
  ts_conn_destroy(&c);
}

TS_TEST(the_connections_own_statuses_have_public_names) {
  CHECK_EQ(ts_conn_status_public(TS_CONN_WOKEN), TSHARE_AGAIN);
  CHECK_EQ(ts_conn_status_public(TS_FD_OVER_BUDGET), TSHARE_E_LIMIT);
  CHECK_EQ(ts_conn_status_public(TS_RING_CORRUPT), TSHARE_E_PROTOCOL);
  CHECK_EQ(ts_conn_status_public(12345), TSHARE_E_STATE);
  /* Apart from errno values (an fd's lost reason) and from counts. */
  CHECK(TS_FD_OVER_BUDGET < 0 && TS_RING_CORRUPT < 0 && TS_CONN_WOKEN < 0);
  CHECK((int)TS_CONN_WOKEN != (int)TSHARE_OK && (int)TS_CONN_WOKEN != (int)TSHARE_AGAIN);
  CHECK(TS_CONN_ANY_UID == TSHARE_ANY_UID);
}

static int new_fd(void) { return fcntl(0, F_DUPFD_CLOEXEC, 0); }

TS_TEST(the_fd_queue_gives_each_frame_the_fds_of_its_bytes) {
  ts_fd_queue q = {.budget = 2};
  int a = new_fd(), b = new_fd(), c = new_fd();
  CHECK_RC(ts_fd_queue_take(&q, &a, 1, false, 9), TSHARE_OK, "");  /* rode on bytes up to offset 9 */
  CHECK_RC(ts_fd_queue_take(&q, &b, 1, false, 19), TSHARE_OK, ""); /* up to 19 */
  CHECK_EQ(q.held, 2u);
  CHECK_RC(ts_fd_queue_take(&q, &c, 1, false, 29), TSHARE_OK, ""); /* past the budget: closed at once */
  CHECK(fcntl(c, F_GETFD) < 0);
  CHECK_RC(ts_fd_queue_take(&q, NULL, 0, true, 39), TSHARE_OK, ""); /* cut: joins the lost run */
  bool found;
  ts_fd_entry e = ts_fd_queue_frame(&q, 5, &found); /* a frame ending before any fd came */
  CHECK(!found);
  e = ts_fd_queue_frame(&q, 10, &found);
  CHECK(found && e.fd == a && e.lost == 0);
  e = ts_fd_queue_frame(&q, 20, &found);
  CHECK(found && e.fd == b);
  CHECK_EQ(q.held, 0u);
  e = ts_fd_queue_frame(&q, 30, &found);
  CHECK(found && e.fd == -1 && e.lost == TS_FD_OVER_BUDGET);
  e = ts_fd_queue_frame(&q, 40, &found); /* the same run of losses */
  CHECK(found && e.fd == -1 && e.lost == TS_FD_OVER_BUDGET);
  CHECK_EQ(ts_fd_queue_len(&q), 0u);
  close(a);
  close(b);
  ts_fd_queue_close_all(&q);
}

TS_TEST_MAIN
