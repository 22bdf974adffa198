/* Two processes that meet over a ucx:// address, for the UCX tests: a
 * listener and a connector forked from the test, over 127.0.0.1 or in two
 * network namespaces joined by a veth pair (made here, unique names,
 * removed on every exit path; skipped when `ip netns` is not permitted).
 * UCX_TLS is tcp unless the environment sets it. Without UCX the exchanges
 * skip. Include once, from a test file. */
#ifndef TSHARE_TEST_UCX_PAIR_H
#define TSHARE_TEST_UCX_PAIR_H

#include "harness.h"
#include "port_util.h"
#include "tshare/hostmem.h"
#include "tshare/rendezvous.h"
#include "tshare/share.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TOKEN "s3cret-shared-token"
#define PAIR_LIMIT_S 20 /* the whole exchange; ctest's limit is longer */

static char ns_name[2][32]; /* the listener's and the connector's, when made */
static char listen_address[96], connect_address[96];

/* ---- namespaces -------------------------------------------------------- */

static inline int sh(const char *cmd) {
  int rc = system(cmd);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static inline void remove_namespaces(void) {
  char cmd[128];
  for (int i = 0; i < 2; i++)
    if (ns_name[i][0]) {
      snprintf(cmd, sizeof cmd, "ip netns delete %s 2>/dev/null", ns_name[i]);
      (void)sh(cmd);
      ns_name[i][0] = '\0';
    }
}

/* Namespaces an earlier run left behind (killed before its cleanup):
 * tsucx-PID-x whose PID is gone. */
static inline void remove_stale_namespaces(void) {
  DIR *d = opendir("/var/run/netns");
  if (!d) return;
  struct dirent *de;
  while ((de = readdir(d))) {
    long pid;
    char side;
    if (sscanf(de->d_name, "tsucx-%ld-%c", &pid, &side) != 2 || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
    char cmd[320];
    snprintf(cmd, sizeof cmd, "ip netns delete %s 2>/dev/null", de->d_name);
    (void)sh(cmd);
  }
  closedir(d);
}

static inline void on_alarm(int sig) {
  (void)sig;
  remove_namespaces();
  static const char msg[] = "FAILED: the exchange did not end in time\n";
  if (write(2, msg, sizeof msg - 1) < 0) _exit(1);
  kill(0, SIGKILL); /* the children too, then this process */
}

/* Two namespaces joined by a veth pair: 10.77.N.1 (listener), 10.77.N.2. */
static inline void make_namespaces(void) {
  if (geteuid() != 0) TS_SKIP("network namespaces need root (ip netns); run the loopback cases instead");
  remove_stale_namespaces();
  long id = (long)getpid();
  snprintf(ns_name[0], sizeof ns_name[0], "tsucx-%ld-a", id);
  snprintf(ns_name[1], sizeof ns_name[1], "tsucx-%ld-b", id);
  atexit(remove_namespaces);
  char cmd[1024];
  int net = (int)(id % 250) + 1;
  snprintf(cmd, sizeof cmd,
           "set -e; ip netns add %1$s; ip netns add %2$s; "
           "ip link add tsva%3$ld type veth peer name tsvb%3$ld; "
           "ip link set tsva%3$ld netns %1$s; ip link set tsvb%3$ld netns %2$s; "
           "ip -n %1$s addr add 10.77.%4$d.1/24 dev tsva%3$ld; ip -n %2$s addr add 10.77.%4$d.2/24 dev tsvb%3$ld; "
           "ip -n %1$s link set tsva%3$ld up; ip -n %2$s link set tsvb%3$ld up; "
           "ip -n %1$s link set lo up; ip -n %2$s link set lo up",
           ns_name[0], ns_name[1], id % 100000, net);
  if (sh(cmd) != 0) {
    remove_namespaces();
    TS_SKIP("ip netns is not permitted here (no CAP_SYS_ADMIN or no iproute2): the loopback cases cover UCX");
  }
  /* UCX takes only interfaces that are running: wait for the veth's carrier. */
  snprintf(cmd, sizeof cmd,
           "for i in $(seq 100); do ip -n %s link show tsva%ld | grep -q LOWER_UP && "
           "ip -n %s link show tsvb%ld | grep -q LOWER_UP && exit 0; sleep 0.05; done; exit 1",
           ns_name[0], id % 100000, ns_name[1], id % 100000);
  if (sh(cmd) != 0) TS_FAIL("the veth pair between %s and %s did not come up", ns_name[0], ns_name[1]);
  snprintf(listen_address, sizeof listen_address, "ucx://10.77.%d.1:7700/weights", net);
  snprintf(connect_address, sizeof connect_address, "ucx://10.77.%d.1:7700/weights", net);
}

/* The veth end in a side's namespace, as a child of the test names it. */
static inline void veth_of(int side, char *out, size_t cap) {
  snprintf(out, cap, "tsv%c%ld", side ? 'b' : 'a', (long)getppid() % 100000);
}

static inline void use_loopback(void) {
  unsigned port = free_loopback_port();
  snprintf(listen_address, sizeof listen_address, "ucx://127.0.0.1:%u/weights", port);
  snprintf(connect_address, sizeof connect_address, "ucx://127.0.0.1:%u/weights", port);
}

static inline void enter_namespace(int side) {
  if (!ns_name[side][0]) return;
  char path[96];
  snprintf(path, sizeof path, "/var/run/netns/%s", ns_name[side]);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) TS_FAIL("entering namespace %s: %s", ns_name[side], strerror(errno));
  close(fd);
  /* UCX lists interfaces under /sys/class/net, which shows the namespace of
   * whoever mounted /sys: a sysfs of this namespace, in a mount namespace of
   * this process's own (as `ip netns exec` does). */
  if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) != 0 ||
      umount2("/sys", MNT_DETACH) != 0 || mount("sysfs", "/sys", "sysfs", 0, NULL) != 0)
    TS_FAIL("a sysfs for namespace %s: %s", ns_name[side], strerror(errno));
}

/* ---- the two processes --------------------------------------------------- */

typedef void (*side_fn)(void);

static inline pid_t start_side(int side, side_fn fn) {
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    ns_name[0][0] = ns_name[1][0] = '\0'; /* the parent removes them, not an exiting child */
    char path[96];
    snprintf(path, sizeof path, "/var/run/netns/tsucx-%ld-%c", (long)getppid(), side ? 'b' : 'a');
    if (access(path, F_OK) == 0) snprintf(ns_name[side], sizeof ns_name[side], "tsucx-%ld-%c", (long)getppid(), side ? 'b' : 'a');
    enter_namespace(side);
    ns_name[side][0] = '\0';
    fn();
    _exit(0);
  }
  return pid;
}

/* The listener and the connector, each in its own process: both must exit
 * 0, or the connector die of connector_signal where it is not 0. A
 * connector that stops itself (SIGSTOP) is killed once the listener is done. */
static inline void run_pair_ending(side_fn listener, side_fn connector, int connector_signal) {
  if (!getenv("UCX_TLS")) setenv("UCX_TLS", "tcp", 1);
  signal(SIGALRM, on_alarm);
  alarm(PAIR_LIMIT_S);
  pid_t a = start_side(0, listener), b = start_side(1, connector);
  int status_a, status_b;
  CHECK(waitpid(a, &status_a, 0) == a);
  if (connector_signal == SIGSTOP) {
    kill(b, SIGKILL);
    connector_signal = SIGKILL;
  }
  CHECK(waitpid(b, &status_b, 0) == b);
  alarm(0);
  if (WIFEXITED(status_a) && WEXITSTATUS(status_a) == 77) TS_SKIP("UCX is not installed (libucp.so.0)");
  CHECK(WIFEXITED(status_a) && WEXITSTATUS(status_a) == 0);
  if (connector_signal)
    CHECK(WIFSIGNALED(status_b) && WTERMSIG(status_b) == connector_signal);
  else
    CHECK(WIFEXITED(status_b) && WEXITSTATUS(status_b) == 0);
}

static inline void run_pair(side_fn listener, side_fn connector) { run_pair_ending(listener, connector, 0); }

static inline tshare_channel_options options(const char *name, const char *token) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = name;
  o.token = token;
  o.handshake_timeout_ms = 5000;
  return o;
}

static inline tshare_listener *listen_or_skip(void) {
  tshare_listener *l;
  tshare_error err;
  int rc = tshare_listen(listen_address, &l, &err);
  if (rc == TSHARE_E_UNSUPPORTED) {
    printf("SKIP: %s\n", err.message);
    _exit(77);
  }
  CHECK_RC(rc, TSHARE_OK, err.message);
  return l;
}

static inline tshare_channel *accept_one(const char *token) {
  tshare_listener *l = listen_or_skip();
  tshare_channel_options o = options("listener", token);
  tshare_channel *ch;
  tshare_error err;
  CHECK_RC(tshare_listener_accept(l, &o, 10000, &ch, &err), TSHARE_OK, err.message);
  tshare_listener_close(l);
  return ch;
}

static inline tshare_channel *connect_one(const char *token) {
  tshare_channel_options o = options("connector", token);
  tshare_channel *ch;
  tshare_error err;
  int rc = tshare_connect(connect_address, &o, 10000, &ch, &err);
  if (rc == TSHARE_E_UNSUPPORTED) _exit(0); /* the listener reports the skip */
  CHECK_RC(rc, TSHARE_OK, err.message);
  return ch;
}

static inline void send_release(tshare_channel *ch, uint64_t id) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = 3;
  for (uint32_t i = 0; i < 3; i++) f.u.release.share_ids[i] = id + i;
  CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
}

static inline uint64_t recv_release(tshare_channel *ch) {
  tshare_frame f;
  int fd;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(f.type, TSHARE_FRAME_RELEASE);
  CHECK_EQ(fd, -1);
  CHECK_EQ(f.u.release.count, 3);
  for (uint32_t i = 1; i < 3; i++) CHECK_EQ(f.u.release.share_ids[i], f.u.release.share_ids[0] + i);
  return f.u.release.share_ids[0];
}

#endif
