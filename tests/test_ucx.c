/* Channels across hosts over UCX (ucx:// addresses): address checks, the
 * missing library, the token, frames both ways, a peer killed mid-channel.
 *
 * Each exchange runs as two forked processes, a listener and a connector.
 * The *_netns cases put them in two network namespaces joined by a veth
 * pair (made here, unique names, removed on every exit path; skipped when
 * `ip netns` is not permitted); the others talk over 127.0.0.1. UCX_TLS is
 * tcp unless the environment sets it. Without UCX the exchanges skip. */
#include "ucx_pair.h"

/* ---- the exchanges ------------------------------------------------------- */

#define ROUNDS 200

/* Frames both ways, in order, and a clean end: the connector's close reads
 * as the end of the channel, not as a failure. */
static void round_trip_listener(void) {
  tshare_channel *ch = accept_one(TOKEN);
  CHECK_EQ(tshare_channel_kind_of(ch), TSHARE_CHANNEL_UCX);
  CHECK_EQ(tshare_channel_transport(ch), TSHARE_TRANSPORT_UCX);
  CHECK(strcmp(tshare_channel_peer(ch)->name, "connector") == 0);
  for (uint64_t i = 1; i <= ROUNDS; i++) {
    CHECK_EQ(recv_release(ch), i * 10);
    send_release(ch, i * 10 + 5);
  }
  tshare_frame f;
  int fd;
  int rc = tshare_channel_recv_frame(ch, &f, &fd, 5000);
  CHECK(rc == TSHARE_OK || rc == TSHARE_END);
  if (rc == TSHARE_OK) CHECK_EQ(f.type, TSHARE_FRAME_BYE);
  tshare_channel_close(ch);
}

static void round_trip_connector(void) {
  tshare_channel *ch = connect_one(TOKEN);
  CHECK(strcmp(tshare_channel_peer(ch)->name, "listener") == 0);
  for (uint64_t i = 1; i <= ROUNDS; i++) {
    send_release(ch, i * 10);
    CHECK_EQ(recv_release(ch), i * 10 + 5);
  }
  tshare_channel_close(ch);
}

/* The channel's fd wakes a poll loop when a frame comes. */
static void poll_listener(void) {
  tshare_channel *ch = accept_one(TOKEN);
  int fd = tshare_channel_fd(ch);
  CHECK(fd >= 0);
  for (uint64_t i = 1; i <= 20; i++) {
    tshare_frame f;
    int got_fd;
    int rc;
    while ((rc = tshare_channel_recv_frame(ch, &f, &got_fd, 0)) == TSHARE_E_TIMEOUT || rc == TSHARE_AGAIN) {
      struct pollfd p = {fd, POLLIN, 0};
      CHECK(poll(&p, 1, 5000) == 1); /* never a hang: the fd wakes for the frame */
    }
    CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(f.u.release.share_ids[0], i);
    send_release(ch, i);
  }
  tshare_channel_close(ch);
}

static void poll_connector(void) {
  tshare_channel *ch = connect_one(TOKEN);
  for (uint64_t i = 1; i <= 20; i++) {
    usleep(2000);
    send_release(ch, i);
    CHECK_EQ(recv_release(ch), i);
  }
  tshare_channel_close(ch);
}

/* A wrong token: the connector hears the refusal, the listener drops it and
 * says why when its accept times out. */
static void wrong_token_listener(void) {
  tshare_listener *l = listen_or_skip();
  tshare_channel_options o = options("listener", TOKEN);
  tshare_channel *ch;
  tshare_error err;
  CHECK_RC(tshare_listener_accept(l, &o, 3000, &ch, &err), TSHARE_E_TIMEOUT, err.message);
  CHECK(ch == NULL);
  if (!strstr(err.message, "token does not match")) TS_FAIL("accept's detail: %s", err.message);
  tshare_listener_close(l);
}

static void wrong_token_connector(void) {
  tshare_channel_options o = options("connector", "not-the-token");
  tshare_channel *ch;
  tshare_error err;
  int rc = tshare_connect(connect_address, &o, 2000, &ch, &err);
  if (rc == TSHARE_E_UNSUPPORTED) return;
  CHECK_RC(rc, TSHARE_E_PERMISSION, err.message);
  CHECK(ch == NULL);
  if (!strstr(err.message, "refused") || !strstr(err.message, "token")) TS_FAIL("connect's detail: %s", err.message);
}

/* The connector is SIGKILLed after its first frame: the listener's next
 * receive returns the peer's end, long before its own timeout. */
static void killed_peer_listener(void) {
  tshare_channel *ch = accept_one(TOKEN);
  CHECK_EQ(recv_release(ch), 77);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  tshare_frame f;
  int fd;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 15000), TSHARE_E_PEER_CLOSED, tshare_channel_last_error(ch));
  clock_gettime(CLOCK_MONOTONIC, &t1);
  printf("the peer's death was seen after %.0f ms\n",
         (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6);
  fflush(stdout); /* this process ends in _exit */
  CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 1000) == TSHARE_OK ? TSHARE_E_STATE : TSHARE_OK, TSHARE_OK,
           "a send to the dead peer succeeded");
  tshare_channel_close(ch);
}

static void killed_peer_connector(void) {
  tshare_channel *ch = connect_one(TOKEN);
  send_release(ch, 77);
  usleep(100000); /* let it go out before dying */
  raise(SIGKILL);
}

/* Bootstrap connections that are not tshare's, or lie about their lengths,
 * are dropped without harm; the good connector after them gets its channel. */
static void hostile_listener(void) {
  tshare_channel *ch = accept_one(TOKEN);
  send_release(ch, 4);
  CHECK_EQ(recv_release(ch), 5);
  tshare_channel_close(ch);
}

/* A raw TCP connection to the listener that sends bytes and hangs up. */
static void send_raw(const void *bytes, size_t len) {
  unsigned port = 0;
  char host[64];
  CHECK(sscanf(connect_address, "ucx://%63[^:]:%u/", host, &port) == 2);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  CHECK(inet_pton(AF_INET, host, &sa.sin_addr) == 1);
  for (int tries = 0;; tries++) { /* the listener may not be up yet */
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) {
      CHECK(write(fd, bytes, len) == (ssize_t)len);
      usleep(20000);
      close(fd);
      return;
    }
    close(fd);
    CHECK(tries < 500);
    usleep(10000);
  }
}

static void hostile_connector(void) {
  send_raw("GET / HTTP/1.0\r\n\r\n", 18); /* not tshare's */
  /* the right magic, a name of 65535 bytes (over its bound) */
  static const uint8_t too_long[] = {'T', 'S', 'U', 'C', 'X', '0', '1', '\n', 0xff, 0xff, 0, 0, 0, 0, 0, 0};
  send_raw(too_long, sizeof too_long);
  /* a worker address of 4 GiB announced */
  static const uint8_t huge_address[] = {'T', 'S', 'U', 'C', 'X', '0', '1', '\n', 7, 0, 3, 0, 0xff, 0xff, 0xff, 0xff};
  send_raw(huge_address, sizeof huge_address);
  tshare_channel *ch = connect_one(TOKEN);
  CHECK_EQ(recv_release(ch), 4);
  send_release(ch, 5);
  tshare_channel_close(ch);
}

TS_TEST(hostile_bootstrap_loopback) {
  use_loopback();
  run_pair(hostile_listener, hostile_connector);
}

TS_TEST(round_trip_loopback) {
  use_loopback();
  run_pair(round_trip_listener, round_trip_connector);
}

TS_TEST(poll_fd_loopback) {
  use_loopback();
  run_pair(poll_listener, poll_connector);
}

TS_TEST(wrong_token_loopback) {
  use_loopback();
  run_pair(wrong_token_listener, wrong_token_connector);
}

TS_TEST(killed_peer_loopback) {
  use_loopback();
  run_pair_ending(killed_peer_listener, killed_peer_connector, SIGKILL);
}

TS_TEST(round_trip_netns) {
  make_namespaces();
  run_pair(round_trip_listener, round_trip_connector);
}

TS_TEST(wrong_token_netns) {
  make_namespaces();
  run_pair(wrong_token_listener, wrong_token_connector);
}

TS_TEST(killed_peer_netns) {
  make_namespaces();
  run_pair_ending(killed_peer_listener, killed_peer_connector, SIGKILL);
}

/* ---- without a peer ------------------------------------------------------ */

static void expect_refused(const char *address, int want, const char *words) {
  tshare_listener *l = NULL;
  tshare_error err;
  CHECK_RC(tshare_listen(address, &l, &err), want, err.message);
  CHECK(l == NULL);
  if (!strstr(err.message, words)) TS_FAIL("listen '%s': the detail '%s' does not say '%s'", address, err.message, words);
  tshare_channel_options o = options("connector", TOKEN);
  tshare_channel *ch = NULL;
  CHECK_RC(tshare_connect(address, &o, 100, &ch, &err), want, err.message);
  CHECK(ch == NULL);
}

TS_TEST(bad_addresses) {
  expect_refused("ucx://:7700/weights", TSHARE_E_INVALID_ARG, "no host");
  expect_refused("ucx://nodeA/weights", TSHARE_E_INVALID_ARG, "no port");
  expect_refused("ucx://nodeA:0/weights", TSHARE_E_INVALID_ARG, "port");
  expect_refused("ucx://nodeA:65536/weights", TSHARE_E_INVALID_ARG, "port");
  expect_refused("ucx://nodeA:77x/weights", TSHARE_E_INVALID_ARG, "port");
  expect_refused("ucx://nodeA:7700", TSHARE_E_INVALID_ARG, "no channel name");
  expect_refused("ucx://nodeA:7700/", TSHARE_E_INVALID_ARG, "no channel name");
  expect_refused("ucx://nodeA:7700/a/b", TSHARE_E_INVALID_ARG, "channel name");
  char long_name[400];
  snprintf(long_name, sizeof long_name, "ucx://nodeA:7700/%0300d", 7);
  expect_refused(long_name, TSHARE_E_TOO_LARGE, "over");
  char long_host[400];
  snprintf(long_host, sizeof long_host, "ucx://%0300d:7700/w", 7);
  expect_refused(long_host, TSHARE_E_TOO_LARGE, "over");
}

/* Without UCX: the missing library is named, nothing crashes. */
TS_TEST(missing_library) {
  setenv("TSHARE_UCX_LIBRARY", "libucp-not-installed.so.0", 1);
  tshare_listener *l = NULL;
  tshare_error err;
  CHECK_RC(tshare_listen("ucx://127.0.0.1:7701/weights", &l, &err), TSHARE_E_UNSUPPORTED, err.message);
  if (!strstr(err.message, "libucp-not-installed.so.0")) TS_FAIL("the detail does not name the library: %s", err.message);
  tshare_channel_options o = options("connector", TOKEN);
  tshare_channel *ch = NULL;
  CHECK_RC(tshare_connect("ucx://127.0.0.1:7701/weights", &o, 100, &ch, &err), TSHARE_E_UNSUPPORTED, err.message);
  if (!strstr(err.message, "UCX is not installed")) TS_FAIL("connect's detail: %s", err.message);
}

/* No token on this end: refused before anything is sent. */
TS_TEST(missing_token) {
  unsetenv("TSHARE_TOKEN");
  tshare_channel_options o = options("connector", NULL);
  tshare_channel *ch = NULL;
  tshare_error err;
  int rc = tshare_connect("ucx://127.0.0.1:7702/weights", &o, 100, &ch, &err);
  CHECK_RC(rc, TSHARE_E_PERMISSION, err.message);
  if (!strstr(err.message, "no token")) TS_FAIL("the detail: %s", err.message);
  use_loopback(); /* a listener without a token refuses to accept, at once */
  tshare_listener *l;
  rc = tshare_listen(listen_address, &l, &err);
  if (rc != TSHARE_E_UNSUPPORTED) {
    CHECK_RC(rc, TSHARE_OK, err.message);
    CHECK_RC(tshare_listener_accept(l, &o, 10000, &ch, &err), TSHARE_E_PERMISSION, err.message);
    if (!strstr(err.message, "no token")) TS_FAIL("accept's detail: %s", err.message);
    tshare_listener_close(l);
  }
  setenv("TSHARE_TOKEN", TOKEN, 1); /* the environment's token is taken: connecting to nobody times out */
  rc = tshare_connect("ucx://127.0.0.1:7702/weights", &o, 200, &ch, &err);
  CHECK(rc == TSHARE_E_NOT_FOUND || rc == TSHARE_E_UNSUPPORTED);
}

TS_TEST_MAIN
