/* Rendezvous by socket path (listen/connect) and the SO_PEERCRED check. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/rendezvous.h"
#include "tshare/share.h"
#include "tshare/spawn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static char tmp[64];

static const char *temp_dir(void) {
  snprintf(tmp, sizeof tmp, "/tmp/tshare-rv-XXXXXX");
  CHECK(mkdtemp(tmp) != NULL); /* mode 0700 */
  return tmp;
}

static char sock_path[128];

static void connect_and_bye(int delay_ms) {
  usleep((unsigned)delay_ms * 1000u);
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "dialer";
  tshare_channel *ch;
  tshare_error err;
  CHECK_RC(tshare_connect(sock_path, &o, 5000, &ch, &err), TSHARE_OK, err.message);
  CHECK(strcmp(tshare_channel_peer(ch)->name, "listener") == 0);
  CHECK_RC(tshare_channel_send_bye(ch, 7, 1000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void accept_one(tshare_listener *l) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "listener";
  tshare_channel *ch;
  tshare_error err;
  CHECK_RC(tshare_listener_accept(l, &o, 5000, &ch, &err), TSHARE_OK, err.message);
  CHECK(strcmp(tshare_channel_peer(ch)->name, "dialer") == 0);
  tshare_frame f;
  int fd;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK(f.type == TSHARE_FRAME_BYE && f.u.bye.reason == 7);
  tshare_channel_close(ch);
}

static int exit_code(pid_t pid) {
  int st = wait_child(pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* A peer that connects before anyone listens waits for the listener; two
 * peers in a row each get a channel of their own. */
TS_TEST(listen_connect) {
  snprintf(sock_path, sizeof sock_path, "%s/run/feed.sock", temp_dir());
  pid_t early = fork_child(connect_and_bye, 0); /* before the listener exists */
  usleep(150 * 1000);
  tshare_listener *l;
  tshare_error err;
  CHECK_RC(tshare_listen(sock_path, &l, &err), TSHARE_OK, err.message);
  struct stat st;
  char dir[160];
  snprintf(dir, sizeof dir, "%s/run", tmp);
  CHECK(stat(dir, &st) == 0 && (st.st_mode & 0777) == 0700); /* created private */
  CHECK(stat(sock_path, &st) == 0 && S_ISSOCK(st.st_mode));
  accept_one(l);
  CHECK_EQ(exit_code(early), 0);
  pid_t late = fork_child(connect_and_bye, 0);
  accept_one(l);
  CHECK_EQ(exit_code(late), 0);
  tshare_channel *none;
  CHECK_EQ(tshare_listener_accept(l, NULL, 50, &none, &err), TSHARE_E_TIMEOUT);
  CHECK(none == NULL);
  tshare_listener_close(l);
  CHECK(stat(sock_path, &st) != 0); /* the socket file is gone */
}

/* The directory must be private: open to others, another user's or a
 * symlink is refused before anything is bound. */
TS_TEST(directory_must_be_private) {
  const char *base = temp_dir();
  char dir[160], path[200], link[160];
  snprintf(dir, sizeof dir, "%s/open", base);
  CHECK(mkdir(dir, 0755) == 0);
  CHECK(chmod(dir, 0755) == 0);
  snprintf(path, sizeof path, "%s/s", dir);
  tshare_listener *l;
  tshare_error err;
  CHECK_EQ(tshare_listen(path, &l, &err), TSHARE_E_PERMISSION);
  printf("open directory: %s\n", err.message);
  CHECK(strstr(err.message, "private") != NULL);
  CHECK(chmod(dir, 0700) == 0);
  snprintf(link, sizeof link, "%s/link", base);
  CHECK(symlink(dir, link) == 0);
  snprintf(path, sizeof path, "%s/s", link);
  CHECK_EQ(tshare_listen(path, &l, &err), TSHARE_E_PERMISSION);
  printf("symlinked directory: %s\n", err.message);
  if (getuid() == 0) { /* root can hand the directory to someone else */
    CHECK(chown(dir, 65534, 65534) == 0);
    snprintf(path, sizeof path, "%s/s", dir);
    CHECK_EQ(tshare_listen(path, &l, &err), TSHARE_E_PERMISSION);
    printf("another user's directory: %s\n", err.message);
    CHECK(strstr(err.message, "uid 65534") != NULL);
  }
}

/* A socket file left by a dead listener is replaced; a live one is not. */
TS_TEST(stale_and_live_sockets) {
  snprintf(sock_path, sizeof sock_path, "%s/s", temp_dir());
  tshare_listener *a, *b;
  tshare_error err;
  CHECK_RC(tshare_listen(sock_path, &a, &err), TSHARE_OK, err.message);
  CHECK_EQ(tshare_listen(sock_path, &b, &err), TSHARE_E_STATE);
  printf("second listener: %s\n", err.message);
  /* A listener that died leaves its file: close the fd but keep the file. */
  close(tshare_listener_fd(a));
  CHECK_RC(tshare_listen(sock_path, &b, &err), TSHARE_OK, err.message);
  pid_t p = fork_child(connect_and_bye, 0);
  accept_one(b);
  CHECK_EQ(exit_code(p), 0);
  tshare_listener_close(b);
  free(a); /* its fd is closed above; the struct is all that is left */
  char file[200];
  snprintf(file, sizeof file, "%s/f", tmp);
  FILE *f = fopen(file, "w");
  CHECK(f != NULL);
  fclose(f);
  CHECK_EQ(tshare_listen(file, &b, &err), TSHARE_E_STATE); /* never unlinks what is not a socket */
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A listener that never accepts, its backlog filled: returns its fd and
 * keeps the queued connections open in fills[]. */
static struct sockaddr_un unix_address(const char *path) {
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  size_t n = strlen(path);
  CHECK(n < sizeof a.sun_path);
  memcpy(a.sun_path, path, n + 1);
  return a;
}

static int fills[64], nfills;
static int busy_listener(const char *path) {
  int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un a = unix_address(path);
  CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&a, sizeof a) == 0 && listen(lfd, 0) == 0);
  for (nfills = 0; nfills < 64; nfills++) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    CHECK(fd >= 0);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
      CHECK_EQ(errno, EAGAIN);
      close(fd);
      return lfd;
    }
    fills[nfills] = fd;
  }
  TS_FAIL("the backlog never filled");
}

/* Connecting to, or listening over, a listener whose backlog is full keeps
 * to the timeout instead of blocking in connect(). */
TS_TEST(a_full_backlog_keeps_to_timeouts) {
  snprintf(sock_path, sizeof sock_path, "%s/busy", temp_dir());
  int lfd = busy_listener(sock_path);
  tshare_channel *ch;
  tshare_error err;
  double t0 = now_s();
  CHECK_EQ(tshare_connect(sock_path, NULL, 500, &ch, &err), TSHARE_E_TIMEOUT);
  double took = now_s() - t0;
  printf("connect: %s (%.2f s)\n", err.message, took);
  CHECK(strstr(err.message, "backlog") != NULL);
  CHECK(took < 5);
  tshare_listener *l;
  t0 = now_s();
  CHECK_EQ(tshare_listen(sock_path, &l, &err), TSHARE_E_STATE); /* busy is alive */
  printf("listen: %s (%.2f s)\n", err.message, now_s() - t0);
  CHECK(now_s() - t0 < 5);
  for (int i = 0; i < nfills; i++) close(fills[i]);
  close(lfd);
}

static void connect_raw_and_stay_silent(int seconds) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un a = unix_address(sock_path);
  CHECK(fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0);
  sleep((unsigned)seconds);
  close(fd);
}

static void probe_then_connect(int unused) {
  (void)unused;
  usleep(100 * 1000);
  tshare_listener *l;
  tshare_error err;
  CHECK_EQ(tshare_listen(sock_path, &l, &err), TSHARE_E_STATE); /* probes the live listener */
  usleep(100 * 1000);
  connect_and_bye(0);
}

/* An accept keeps to its timeout behind a client that never says hello, and
 * one bad connection (a silent client, a second listener's liveness probe)
 * never fails the accept of the good one after it. */
TS_TEST(accept_survives_bad_connections) {
  snprintf(sock_path, sizeof sock_path, "%s/s", temp_dir());
  tshare_listener *l;
  tshare_error err;
  CHECK_RC(tshare_listen(sock_path, &l, &err), TSHARE_OK, err.message);
  pid_t silent = fork_child(connect_raw_and_stay_silent, 3);
  tshare_channel *ch;
  double t0 = now_s();
  CHECK_EQ(tshare_listener_accept(l, NULL, 500, &ch, &err), TSHARE_E_TIMEOUT);
  double took = now_s() - t0;
  printf("silent client: %s (%.2f s)\n", err.message, took);
  CHECK(took < 2.5);
  CHECK(strstr(err.message, "dropped") != NULL);
  pid_t good = fork_child(probe_then_connect, 0);
  accept_one(l);
  CHECK_EQ(exit_code(good), 0);
  CHECK_EQ(exit_code(silent), 0);
  tshare_listener_close(l);
}

/* `test_rendezvous --role ns-producer PATH VALUE`: connect to PATH and share
 * a host buffer (this process's first) full of VALUE. */
static int ns_producer(int argc, char **argv) {
  if (argc != 5 || strcmp(argv[2], "ns-producer") != 0) return 2;
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = "ns producer";
  tshare_channel *ch;
  tshare_error err;
  if (tshare_connect(argv[3], &o, 5000, &ch, &err) != TSHARE_OK) {
    fprintf(stderr, "%s\n", err.message);
    return 3;
  }
  tshare_host_buffer *b;
  if (tshare_host_buffer_create(4096, "ns", &b, &err) != TSHARE_OK) return 4;
  int32_t *p = tshare_host_buffer_data(b);
  for (int i = 0; i < 1024; i++) p[i] = atoi(argv[4]);
  int64_t n = 1024;
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, &n, 0);
  if (tshare_share_host(ch, b, &d, NULL, NULL, 5000, NULL) != TSHARE_OK) return 5;
  if (tshare_channel_send_bye(ch, 0, 5000) != TSHARE_OK) return 6;
  if (tshare_channel_wait_released(ch, 0, 5000) != TSHARE_OK) return 7;
  tshare_host_buffer_destroy(b);
  tshare_channel_close(ch);
  return getpid() == 1 ? 0 : 8; /* it did run as pid 1 of its namespace */
}

__attribute__((constructor)) static void install_ns_producer(void) { ts_role_main = ns_producer; }

/* Peers in other pid namespaces (containers sharing a socket) work: both
 * producers say pid 1 in their hello and number their allocations alike, and
 * each share maps its own producer's memory. */
TS_TEST(peers_in_other_pid_namespaces) {
  if (getuid() != 0) TS_SKIP("needs root for unshare --pid");
  if (access("/usr/bin/unshare", X_OK) != 0) TS_SKIP("needs /usr/bin/unshare (util-linux)");
  snprintf(sock_path, sizeof sock_path, "%s/ns.sock", temp_dir());
  tshare_listener *l;
  tshare_error err;
  CHECK_RC(tshare_listen(sock_path, &l, &err), TSHARE_OK, err.message);
  char self[4096];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  CHECK(len > 0);
  self[len] = '\0';
  tshare_process *prod[2];
  tshare_channel *ch[2];
  tshare_view *v[2];
  for (int i = 0; i < 2; i++) {
    char value[16];
    snprintf(value, sizeof value, "%d", 111 * (i + 1));
    char *argv[] = {"unshare", "--pid",       "--fork",  "--mount-proc", self,
                    "--role",  "ns-producer", sock_path, value,          NULL};
    tshare_spawn_options so = {.file = "/usr/bin/unshare", .argv = argv};
    CHECK_RC(tshare_spawn(&so, &prod[i], &err), TSHARE_OK, err.message);
    CHECK_RC(tshare_listener_accept(l, NULL, 5000, &ch[i], &err), TSHARE_OK, err.message);
    CHECK_EQ(tshare_channel_peer(ch[i])->pid, 1);
    CHECK_RC(tshare_view_recv(ch[i], 5000, &v[i]), TSHARE_OK, tshare_channel_last_error(ch[i]));
  }
  for (int i = 0; i < 2; i++) {
    const int32_t *p = tshare_view_data(v[i]);
    for (int k = 0; k < 1024; k++)
      if (p[k] != 111 * (i + 1)) TS_FAIL("producer %d: element %d is %d", i, k, (int)p[k]);
    tshare_view_release(v[i]);
    tshare_view *none;
    CHECK_RC(tshare_view_recv(ch[i], 5000, &none), TSHARE_END, tshare_channel_last_error(ch[i]));
    tshare_channel_close(ch[i]);
    tshare_exit_status st;
    CHECK_RC(tshare_process_wait(prod[i], 10000, &st), TSHARE_OK, "producer did not end");
    CHECK_EQ(st.value, 0);
    tshare_process_destroy(prod[i]);
  }
  printf("two producers, both pid 1 in their namespaces: each share mapped its own producer's memory\n");
  tshare_listener_close(l);
}

TS_TEST(connect_to_nobody) {
  snprintf(sock_path, sizeof sock_path, "%s/nobody", temp_dir());
  tshare_channel *ch;
  tshare_error err;
  int64_t t0 = (int64_t)time(NULL);
  CHECK_EQ(tshare_connect(sock_path, NULL, 200, &ch, &err), TSHARE_E_NOT_FOUND);
  CHECK(ch == NULL);
  CHECK((int64_t)time(NULL) - t0 < 5);
  printf("%s\n", err.message);
}

TS_TEST(default_paths) {
  char out[200];
  tshare_error err;
  setenv("XDG_RUNTIME_DIR", "/run/user/1234", 1);
  CHECK_RC(tshare_rendezvous_path("feed", out, sizeof out, &err), TSHARE_OK, err.message);
  CHECK(strcmp(out, "/run/user/1234/tshare/feed") == 0);
  unsetenv("XDG_RUNTIME_DIR");
  CHECK_RC(tshare_rendezvous_path("feed", out, sizeof out, &err), TSHARE_OK, err.message);
  char want[64];
  snprintf(want, sizeof want, "/tmp/tshare-%ld/feed", (long)getuid());
  CHECK(strcmp(out, want) == 0);
  CHECK_RC(tshare_rendezvous_path("./x.sock", out, sizeof out, &err), TSHARE_OK, err.message);
  CHECK(strcmp(out, "./x.sock") == 0);
  char longname[160];
  memset(longname, 'n', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  CHECK_EQ(tshare_rendezvous_path(longname, out, sizeof out, &err), TSHARE_E_TOO_LARGE);
  CHECK_EQ(tshare_rendezvous_path("", out, sizeof out, &err), TSHARE_E_INVALID_ARG);
}

/* SO_PEERCRED: a peer under another uid is refused unless allowed. The
 * child drops to uid 65534 (root only) and then connects: the kernel
 * records a socket's credentials when it connects (for a socketpair, when
 * it is made). The test's own socket sits in a directory open to all, which
 * tshare_listen would refuse, so that the other user can reach it. */
static long child_allow;
static struct sockaddr_un open_addr;

static void other_user(int unused) {
  (void)unused;
  CHECK(setgid(65534) == 0 && setuid(65534) == 0);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  CHECK(fd >= 0 && connect(fd, (struct sockaddr *)&open_addr, sizeof open_addr) == 0);
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.allow_uid = child_allow;
  tshare_channel *ch;
  tshare_error err;
  int rc = tshare_channel_open_socket(fd, &o, &ch, &err);
  if (rc == TSHARE_OK) tshare_channel_close(ch);
  _exit(rc == TSHARE_OK ? 0 : 3);
}

static int open_against_other_user(int lfd, long parent_allow, long allow_in_child, tshare_error *err) {
  child_allow = allow_in_child;
  pid_t pid = fork_child(other_user, 0);
  int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
  CHECK(fd >= 0);
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.allow_uid = parent_allow;
  o.handshake_timeout_ms = 3000;
  tshare_channel *ch;
  int rc = tshare_channel_open_socket(fd, &o, &ch, err);
  if (rc == TSHARE_OK) tshare_channel_close(ch);
  int child = exit_code(pid);
  printf("parent allow %ld, child allow %ld: parent %s (%s), child exit %d\n", parent_allow, allow_in_child,
         tshare_status_name(rc), err->message, child);
  return rc;
}

TS_TEST(peer_uid_checked) {
  if (getuid() != 0) TS_SKIP("needs root to run a peer as another user");
  const char *dir = temp_dir();
  CHECK(chmod(dir, 0777) == 0);
  open_addr.sun_family = AF_UNIX;
  snprintf(open_addr.sun_path, sizeof open_addr.sun_path, "%s/open.sock", dir);
  int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&open_addr, sizeof open_addr) == 0);
  CHECK(chmod(open_addr.sun_path, 0777) == 0 && listen(lfd, 4) == 0);
  tshare_error err;
  CHECK_EQ(open_against_other_user(lfd, -1, 0, &err), TSHARE_E_PERMISSION); /* the default: same uid only */
  CHECK(strstr(err.message, "uid 65534") != NULL);
  CHECK_EQ(open_against_other_user(lfd, 65534, 0, &err), TSHARE_OK);
  CHECK_EQ(open_against_other_user(lfd, TSHARE_ANY_UID, TSHARE_ANY_UID, &err), TSHARE_OK);
  /* The child refuses root: the parent sees the peer hang up. */
  CHECK_EQ(open_against_other_user(lfd, 65534, -1, &err), TSHARE_E_PEER_CLOSED);
  close(lfd);
}

TS_TEST_MAIN
