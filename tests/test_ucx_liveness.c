/* Liveness of channels across hosts (core/src/ucx_liveness.h): a killed, a
 * stopped or an unreachable peer ends the channel with TSHARE_E_PEER_CLOSED
 * on both sides, also for an end that waits in poll() and never calls into
 * tshare; an idle peer is not taken for a dead one; the connection is up
 * when the channel opens.
 *
 * The times are printed; only a bound far beyond the documented one
 * (about 1 s) fails, so that a busy machine does not. */
#include "ucx_pair.h"

#include <sys/stat.h>

#define FAR_BEYOND_MS 5000.0 /* the failure threshold: five times the heartbeat timeout */

static double ms_since(const struct timespec *t0) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (double)(t1.tv_sec - t0->tv_sec) * 1e3 + (double)(t1.tv_nsec - t0->tv_nsec) / 1e6;
}

/* A moment 100 ms from now, as the frame that announces it carries it: the
 * peer dies (or stops) then, and the times printed count from it. */
static uint64_t moment_ahead(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec + 100000000ull;
}

static struct timespec timespec_of(uint64_t ns) {
  return (struct timespec){(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
}

/* Send the moment, wait for it, then end with sig. */
static void announce_and_raise(tshare_channel *ch, int sig) {
  uint64_t when = moment_ahead();
  send_release(ch, when);
  struct timespec t = timespec_of(when);
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) != 0) {
  }
  raise(sig);
}

static int open_fds(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  CHECK(d != NULL);
  struct dirent *de;
  while ((de = readdir(d)))
    if (de->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the directory's own fd */
}

/* Wait in poll() on the channel's fd only (no call into tshare) until it
 * wakes, then receive: the end must be there. The time from t0 to it. */
static double end_seen_by_poll(tshare_channel *ch, const struct timespec *t0) {
  struct pollfd p = {tshare_channel_fd(ch), POLLIN, 0};
  for (;;) {
    int n = poll(&p, 1, 15000);
    CHECK(n == 1); /* 15 s of nothing: the end was never signalled */
    tshare_frame f;
    int fd;
    int rc = tshare_channel_recv_frame(ch, &f, &fd, 0);
    if (rc == TSHARE_AGAIN || rc == TSHARE_E_TIMEOUT) continue; /* a heartbeat woke it */
    CHECK_RC(rc, TSHARE_E_PEER_CLOSED, tshare_channel_last_error(ch));
    return ms_since(t0);
  }
}

/* The end of a channel: seen in time, nothing outstanding, and once closed
 * every fd it opened is closed. */
static void check_end(tshare_channel *ch, double ms, const char *what, int fds_before) {
  printf("%s: the end was seen after %.0f ms (%s)\n", what, ms, tshare_channel_last_error(ch));
  fflush(stdout); /* this process ends in _exit */
  if (ms > FAR_BEYOND_MS) TS_FAIL("%s: the end took %.0f ms", what, ms);
  CHECK_EQ(tshare_channel_outstanding(ch), 0);
  tshare_channel_close(ch);
  if (fds_before >= 0) CHECK_EQ(open_fds(), fds_before);
}

/* ---- a killed peer, seen by a poll loop ---------------------------------- */

static void killed_listener(void) {
  tshare_listener *l = listen_or_skip();
  int fds_before = open_fds();
  tshare_channel_options o = options("listener", TOKEN);
  tshare_channel *ch;
  tshare_error err;
  CHECK_RC(tshare_listener_accept(l, &o, 10000, &ch, &err), TSHARE_OK, err.message);
  struct timespec death = timespec_of(recv_release(ch));
  double ms = end_seen_by_poll(ch, &death);
  check_end(ch, ms, "killed peer", fds_before);
  tshare_listener_close(l);
}

static void killed_connector(void) {
  tshare_channel *ch = connect_one(TOKEN);
  announce_and_raise(ch, SIGKILL);
}

TS_TEST(killed_peer_poll_loopback) {
  use_loopback();
  run_pair_ending(killed_listener, killed_connector, SIGKILL);
}

TS_TEST(killed_peer_poll_netns) {
  make_namespaces();
  run_pair_ending(killed_listener, killed_connector, SIGKILL);
}

/* ---- a stopped peer: its process and its sockets live, it is silent ------- */

static void stopped_listener(void) {
  tshare_channel *ch = accept_one(TOKEN);
  struct timespec stop = timespec_of(recv_release(ch));
  double ms = end_seen_by_poll(ch, &stop);
  if (!strstr(tshare_channel_last_error(ch), "unreachable")) TS_FAIL("the detail: %s", tshare_channel_last_error(ch));
  check_end(ch, ms, "stopped peer", -1);
}

static void stopped_connector(void) {
  tshare_channel *ch = connect_one(TOKEN);
  announce_and_raise(ch, SIGSTOP); /* killed by the test once the listener is done */
}

TS_TEST(stopped_peer_loopback) {
  use_loopback();
  run_pair_ending(stopped_listener, stopped_connector, SIGSTOP);
}

/* ---- the link goes down: both ends see it ---------------------------------- */

/* TCP connections of this namespace that are established (/proc/net is
 * the reading process's namespace's). */
static int established_tcp(void) {
  FILE *f = fopen("/proc/net/tcp", "r");
  CHECK(f != NULL);
  char line[512];
  int n = 0;
  unsigned state;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, " %*u: %*x:%*x %*x:%*x %x", &state) == 1 && state == 1) n++;
  fclose(f);
  return n;
}

static void link_down_listener(void) {
  tshare_channel *ch = accept_one(TOKEN);
  send_release(ch, 51); /* the connector takes the link down once it has this */
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  tshare_frame f;
  int fd;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 15000), TSHARE_E_PEER_CLOSED, tshare_channel_last_error(ch));
  check_end(ch, ms_since(&t0), "link down, listener", -1);
}

static void link_down_connector(void) {
  tshare_channel *ch = connect_one(TOKEN);
  /* Nothing shared yet, and UCX's own connection is there beside the
   * bootstrap's: made when the channel opened. */
  int established = established_tcp();
  printf("established TCP connections once open: %d\n", established);
  CHECK(established >= 2);
  CHECK_EQ(recv_release(ch), 51);
  char veth[32], cmd[96];
  veth_of(1, veth, sizeof veth);
  snprintf(cmd, sizeof cmd, "ip link set %s down", veth);
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  CHECK_EQ(sh(cmd), 0);
  double ms = end_seen_by_poll(ch, &t0);
  check_end(ch, ms, "link down, connector", -1);
}

TS_TEST(link_down_netns) {
  make_namespaces();
  run_pair(link_down_listener, link_down_connector);
}

/* ---- an idle peer lives ---------------------------------------------------- */

#define IDLE_US 2500000 /* over twice the timeout: heartbeats must come from the idle end */

/* Each end in turn idles (no call into tshare) while the other waits in a
 * receive; the waiting end gets the frame that follows, not an end. */
static void idle_listener(void) {
  tshare_channel *ch = accept_one(TOKEN);
  usleep(IDLE_US);
  send_release(ch, 61);
  tshare_frame f;
  int fd;
  int rc = tshare_channel_recv_frame(ch, &f, &fd, 10000);
  CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(f.u.release.share_ids[0], 62);
  send_release(ch, 63);
  tshare_channel_close(ch);
}

static void idle_connector(void) {
  tshare_channel *ch = connect_one(TOKEN);
  tshare_frame f;
  int fd;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 10000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(f.u.release.share_ids[0], 61);
  usleep(IDLE_US);
  send_release(ch, 62);
  CHECK_EQ(recv_release(ch), 63);
  tshare_channel_close(ch);
}

TS_TEST(idle_peer_loopback) {
  use_loopback();
  run_pair(idle_listener, idle_connector);
}

/* ---- the settings ---------------------------------------------------------- */

/* A bad setting is refused with its name, before anything listens. */
TS_TEST(bad_settings) {
  static const char *const bad[][2] = {{"TSHARE_UCX_HEARTBEAT_MS", "0"},
                                       {"TSHARE_UCX_HEARTBEAT_MS", "25x"},
                                       {"TSHARE_UCX_HEARTBEAT_MS", "99999999999"},
                                       {"TSHARE_UCX_PEER_TIMEOUT_MS", "100"}}; /* under two heartbeats */
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    unsetenv("TSHARE_UCX_HEARTBEAT_MS");
    unsetenv("TSHARE_UCX_PEER_TIMEOUT_MS");
    setenv(bad[i][0], bad[i][1], 1);
    tshare_listener *l = NULL;
    tshare_error err;
    int rc = tshare_listen("ucx://127.0.0.1:7703/weights", &l, &err);
    if (rc == TSHARE_E_UNSUPPORTED && strstr(err.message, "not installed")) TS_SKIP("%s", err.message);
    CHECK_RC(rc, TSHARE_E_INVALID_ARG, err.message);
    CHECK(l == NULL);
    if (!strstr(err.message, bad[i][0])) TS_FAIL("the detail does not name %s: %s", bad[i][0], err.message);
  }
}

/* A longer timeout is kept: a peer silent for 3 s (stopped) still counts
 * as alive under a 60 s one, where the default would have ended it. */
static void patient_listener(void) {
  tshare_channel *ch = accept_one(TOKEN);
  (void)recv_release(ch); /* the moment it stops */
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (ms_since(&t0) < 3000) {
    struct pollfd p = {tshare_channel_fd(ch), POLLIN, 0};
    (void)poll(&p, 1, 500);
    tshare_frame f;
    int fd;
    int rc = tshare_channel_recv_frame(ch, &f, &fd, 0);
    CHECK_RC(rc == TSHARE_E_TIMEOUT ? TSHARE_AGAIN : rc, TSHARE_AGAIN, tshare_channel_last_error(ch));
  }
  tshare_channel_close(ch);
}

TS_TEST(long_timeout_loopback) {
  setenv("TSHARE_UCX_PEER_TIMEOUT_MS", "60000", 1);
  use_loopback();
  run_pair_ending(patient_listener, stopped_connector, SIGSTOP);
}

TS_TEST_MAIN
