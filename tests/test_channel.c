/* Channels between two real processes: frames with and without fds, hello
 * refusals, a peer that dies or stalls, and signals during blocking calls. */
#include "frame_util.h"
#include "harness.h"
#include "proc_util.h"
#include "tshare/channel.h"
#include "tshare/role.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>

static tshare_channel *open_sock_over(int fd, const char *name, int transport) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = name;
  o.transport = transport;
  o.handshake_timeout_ms = 5000;
  tshare_channel *ch = NULL;
  tshare_error err;
  CHECK_RC(tshare_channel_open_socket(fd, &o, &ch, &err), TSHARE_OK, err.message);
  return ch;
}

static tshare_channel *open_sock(int fd, const char *name) { return open_sock_over(fd, name, TSHARE_TRANSPORT_DEFAULT); }

static tshare_frame bye_frame(uint32_t reason) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_BYE;
  f.u.bye.reason = reason;
  return f;
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- frames with an fd ---------------------------------------------------- */

static void fd_receiver(int fd) {
  tshare_channel *ch = open_sock(fd, "receiver");
  CHECK(strcmp(tshare_channel_peer(ch)->name, "sender") == 0);
  CHECK_EQ(tshare_channel_peer(ch)->pid, getppid());
  tshare_frame f;
  int got_fd;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &got_fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(f.type, TSHARE_FRAME_SHARE);
  CHECK(got_fd >= 0);
  CHECK(fcntl(got_fd, F_GETFD) & FD_CLOEXEC); /* received fds never leak into exec'd programs */
  char text[6] = {0};
  CHECK_EQ(pread(got_fd, text, 5, 0), 5);
  CHECK(strcmp(text, "hello") == 0);
  close(got_fd);
  /* A frame without an fd after one with. */
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &got_fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(f.type, TSHARE_FRAME_BYE);
  CHECK_EQ(f.u.bye.reason, 9);
  CHECK_EQ(got_fd, -1);
  tshare_channel_close(ch);
}

TS_TEST(socket_frames_with_and_without_fds) {
  int sock;
  pid_t pid = fork_with_socket(fd_receiver, &sock);
  tshare_channel *ch = open_sock(sock, "sender");
  int mfd = memfd_create("payload", MFD_CLOEXEC);
  CHECK_EQ(write(mfd, "hello", 5), 5);
  int64_t five = 5;
  tshare_frame f = memfd_share_frame(5, tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_UINT, 8, 1}, 1, &five, 0));
  /* The flag and the fd must agree. */
  CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 1000), TSHARE_E_INVALID_ARG, "");
  CHECK_RC(tshare_channel_send_frame(ch, &f, mfd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_frame b = bye_frame(9);
  CHECK_RC(tshare_channel_send_frame(ch, &b, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  close(mfd);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* ---- pipes ---------------------------------------------------------------- */

static void pipe_child(int unused) {
  (void)unused;
  int rfd, wfd;
  child_pipe_ends(&rfd, &wfd);
  tshare_channel *ch = NULL;
  tshare_error err;
  CHECK_RC(tshare_channel_open_pipes(rfd, wfd, NULL, &ch, &err), TSHARE_OK, err.message);
  CHECK_EQ(tshare_channel_kind_of(ch), TSHARE_CHANNEL_PIPES);
  CHECK_EQ(tshare_channel_peer(ch)->capabilities & TSHARE_CAP_FD_PASSING, 0);
  for (uint32_t i = 0; i < 100; i++) { /* echo 100 frames back */
    tshare_frame f;
    int fd;
    CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(f.u.bye.reason, i);
    CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  }
  tshare_channel_close(ch);
}

TS_TEST(pipe_frames_and_no_fds) {
  int rfd, wfd;
  pid_t pid = fork_with_pipes(pipe_child, &rfd, &wfd);
  tshare_channel *ch = NULL;
  tshare_error err;
  CHECK_RC(tshare_channel_open_pipes(rfd, wfd, NULL, &ch, &err), TSHARE_OK, err.message);
  for (uint32_t i = 0; i < 100; i++) {
    tshare_frame f = bye_frame(i), g;
    int fd;
    CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_RC(tshare_channel_recv_frame(ch, &g, &fd, 5000), TSHARE_OK, tshare_channel_last_error(ch));
    CHECK_EQ(g.u.bye.reason, i);
  }
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_SHARE;
  f.flags = TSHARE_FRAME_FLAG_FD_ATTACHED;
  CHECK_RC(tshare_channel_send_frame(ch, &f, 0, 1000), TSHARE_E_UNSUPPORTED, "");
  CHECK(strstr(tshare_channel_last_error(ch), "pipe") != NULL);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* ---- a peer that goes away ------------------------------------------------ */

static tshare_channel *volatile quitter; /* still reachable when the child dies on purpose */

static void dies_mid_frame(int fd) {
  tshare_channel *ch = quitter = open_sock_over(fd, "quitter", TSHARE_TRANSPORT_SOCKET); /* writes the socket itself */
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  tshare_frame f = bye_frame(1);
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, NULL), TSHARE_OK, "");
  CHECK_EQ(write(tshare_channel_fd(ch), buf, len - 2), (ssize_t)(len - 2)); /* all but 2 bytes */
  _exit(0);
}

TS_TEST(peer_closes_mid_frame) {
  int sock;
  pid_t pid = fork_with_socket(dies_mid_frame, &sock);
  tshare_channel *ch = open_sock(sock, "reader");
  tshare_frame f;
  int fd;
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 5000), TSHARE_E_PEER_CLOSED, tshare_channel_last_error(ch));
  CHECK(strstr(tshare_channel_last_error(ch), "mid-frame") != NULL);
  CHECK(strstr(tshare_channel_last_error(ch), "quitter") != NULL);
  /* It stays closed. */
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 100), TSHARE_E_PEER_CLOSED, "");
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

static void handshake_then_exit(int fd) {
  tshare_channel *ch = open_sock(fd, "short-lived");
  tshare_channel_close(ch);
}

TS_TEST(send_after_peer_died_socket) {
  int sock;
  pid_t pid = fork_with_socket(handshake_then_exit, &sock);
  tshare_channel *ch = open_sock(sock, "survivor");
  CHECK_CHILD_OK(pid);
  tshare_frame f = bye_frame(0);
  CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 1000), TSHARE_E_PEER_CLOSED, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void pipe_peer_exits(int unused) {
  (void)unused;
  int rfd, wfd;
  child_pipe_ends(&rfd, &wfd);
  tshare_channel *ch = NULL;
  CHECK_RC(tshare_channel_open_pipes(rfd, wfd, NULL, &ch, NULL), TSHARE_OK, "");
  tshare_channel_close(ch);
}

TS_TEST(send_after_peer_died_pipe_no_sigpipe) {
  /* Default SIGPIPE disposition: a write to a dead pipe would kill us. */
  signal(SIGPIPE, SIG_DFL);
  int rfd, wfd;
  pid_t pid = fork_with_pipes(pipe_peer_exits, &rfd, &wfd);
  tshare_channel *ch = NULL;
  CHECK_RC(tshare_channel_open_pipes(rfd, wfd, NULL, &ch, NULL), TSHARE_OK, "");
  CHECK_CHILD_OK(pid);
  tshare_frame f = bye_frame(0);
  CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 1000), TSHARE_E_PEER_CLOSED, tshare_channel_last_error(ch));
  sigset_t pending;
  sigpending(&pending);
  CHECK(!sigismember(&pending, SIGPIPE)); /* the SIGPIPE we caused was consumed */
  int fd; /* the peer closed its channel: a bye (a clean end), then nothing */
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 1000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(f.type, TSHARE_FRAME_BYE);
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 1000), TSHARE_E_PEER_CLOSED, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

static void stalls(int fd) {
  tshare_channel *ch = open_sock(fd, "staller");
  tshare_frame f;
  int got;
  /* Wait for the parent to finish its timeout test, then leave. */
  tshare_channel_recv_frame(ch, &f, &got, 5000);
  tshare_channel_close(ch);
}

TS_TEST(receive_timeout) {
  int sock;
  pid_t pid = fork_with_socket(stalls, &sock);
  tshare_channel *ch = open_sock(sock, "waiter");
  tshare_frame f;
  int fd;
  int64_t t0 = now_ms();
  CHECK_RC(tshare_channel_recv_frame(ch, &f, &fd, 150), TSHARE_E_TIMEOUT, tshare_channel_last_error(ch));
  CHECK(now_ms() - t0 >= 140);
  /* A timeout does not break the channel. */
  f = bye_frame(0);
  CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 1000), TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

static void silent_peer(int fd) {
  sleep(2); /* never says hello */
  close(fd);
}

TS_TEST(handshake_timeout) {
  int sock;
  pid_t pid = fork_with_socket(silent_peer, &sock);
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.handshake_timeout_ms = 200;
  tshare_channel *ch = NULL;
  tshare_error err;
  CHECK_RC(tshare_channel_open_socket(sock, &o, &ch, &err), TSHARE_E_TIMEOUT, err.message);
  CHECK(ch == NULL);
  CHECK(strstr(err.message, "hello") != NULL);
  kill(pid, SIGKILL);
  wait_child(pid);
}

/* ---- hello refusals --------------------------------------------------------- */

static int hello_patch; /* which field the fake peer corrupts */

static void fake_peer(int fd) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_HELLO;
  f.u.hello.pid = (uint32_t)getpid();
  strcpy(f.u.hello.name, "impostor");
  if (hello_patch == 2) memset(f.u.hello.boot_id, 0x11, 16); /* another boot */
  uint8_t buf[TSHARE_WIRE_FRAME_MAX];
  size_t len;
  CHECK_RC(tshare_wire_encode(&f, buf, sizeof buf, &len, NULL), TSHARE_OK, "");
  if (hello_patch == 1) buf[4] = TSHARE_WIRE_MAJOR + 1; /* another major */
  if (hello_patch == 3) {
    memcpy(buf, "GET / HTTP/1.1\r\n", 16);
    len = 16;
  }
  CHECK_EQ(write(fd, buf, len), (ssize_t)len);
  /* Expect the real end's hello and then an error frame saying why. */
  tshare_decoder *d = tshare_decoder_create(NULL);
  int seen_error = 0;
  while (!seen_error) {
    uint8_t in[512];
    ssize_t n = read(fd, in, sizeof in);
    if (n <= 0) break;
    CHECK_RC(tshare_decoder_feed(d, in, (size_t)n), TSHARE_OK, "");
    tshare_frame g;
    while (tshare_decoder_next(d, &g) == TSHARE_OK)
      if (g.type == TSHARE_FRAME_ERROR) {
        printf("fake peer got error frame: %s\n", g.u.error.message);
        seen_error = g.u.error.code;
      }
  }
  CHECK(seen_error != 0);
  tshare_decoder_destroy(d);
}

static void expect_refusal(int patch, int want, const char *words) {
  hello_patch = patch;
  int sock;
  pid_t pid = fork_with_socket(fake_peer, &sock);
  tshare_channel *ch = NULL;
  tshare_error err;
  CHECK_RC(tshare_channel_open_socket(sock, NULL, &ch, &err), want, err.message);
  printf("refused: %s\n", err.message);
  CHECK(strstr(err.message, words) != NULL);
  CHECK(ch == NULL);
  CHECK_CHILD_OK(pid); /* the peer was told why */
}

TS_TEST(hello_refuses_other_major_version) { expect_refusal(1, TSHARE_E_VERSION, "version 2.x"); }

TS_TEST(hello_refuses_other_boot) { expect_refusal(2, TSHARE_E_PEER_MISMATCH, "boot"); }

TS_TEST(hello_refuses_garbage) { expect_refusal(3, TSHARE_E_BAD_MAGIC, "magic"); }

/* ---- signals during blocking calls ------------------------------------------ */

static volatile sig_atomic_t alarms;
static void on_alarm(int sig) {
  (void)sig;
  alarms++;
}

static void slow_sender(int fd) {
  tshare_channel *ch = open_sock(fd, "slow");
  struct timespec ts = {0, 300 * 1000000};
  nanosleep(&ts, NULL);
  tshare_frame f = bye_frame(4);
  CHECK_RC(tshare_channel_send_frame(ch, &f, -1, 5000), TSHARE_OK, tshare_channel_last_error(ch));
  tshare_channel_close(ch);
}

TS_TEST(blocking_receive_survives_signals) {
  int sock;
  pid_t pid = fork_with_socket(slow_sender, &sock);
  tshare_channel *ch = open_sock(sock, "patient");
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_alarm; /* no SA_RESTART: every syscall sees EINTR */
  sigaction(SIGALRM, &sa, NULL);
  struct itimerval it = {{0, 2000}, {0, 2000}};
  setitimer(ITIMER_REAL, &it, NULL);
  tshare_frame f;
  int fd;
  int rc = tshare_channel_recv_frame(ch, &f, &fd, 5000);
  struct itimerval off = {{0, 0}, {0, 0}};
  setitimer(ITIMER_REAL, &off, NULL);
  CHECK_RC(rc, TSHARE_OK, tshare_channel_last_error(ch));
  CHECK_EQ(f.u.bye.reason, 4);
  CHECK(alarms > 10);
  CHECK_CHILD_OK(pid);
  tshare_channel_close(ch);
}

/* ---- the environment contract -------------------------------------------- */

TS_TEST(role_from_env) {
  tshare_role role;
  tshare_error err;
  unsetenv(TSHARE_ENV_ROLE);
  CHECK_RC(tshare_role_from_env(&role, &err), TSHARE_E_NOT_FOUND, err.message);
  CHECK(strstr(err.message, "tshare-launch") != NULL);
  int sv[2];
  CHECK_RC(tshare_socketpair(sv, NULL), TSHARE_OK, "");
  char fds[64];
  snprintf(fds, sizeof fds, "%d,%d:%d", sv[0], sv[1], sv[1]);
  setenv(TSHARE_ENV_ROLE, "consumer", 1);
  setenv(TSHARE_ENV_RANK, "2", 1);
  setenv(TSHARE_ENV_NUM_CONSUMERS, "3", 1);
  setenv(TSHARE_ENV_CHANNEL_FDS, fds, 1);
  CHECK_RC(tshare_role_from_env(&role, &err), TSHARE_OK, err.message);
  CHECK(strcmp(role.name, "consumer") == 0);
  CHECK_EQ(role.rank, 2);
  CHECK_EQ(role.num_consumers, 3);
  CHECK_EQ(role.nchannels, 2);
  CHECK_EQ(role.channels[0].kind, TSHARE_CHANNEL_SOCKET);
  CHECK_EQ(role.channels[0].read_fd, sv[0]);
  CHECK_EQ(role.channels[1].kind, TSHARE_CHANNEL_PIPES);
  CHECK_EQ(role.report_fd, -1);
  setenv(TSHARE_ENV_RANK, "two", 1);
  CHECK_RC(tshare_role_from_env(&role, &err), TSHARE_E_MALFORMED, err.message);
  CHECK(strstr(err.message, TSHARE_ENV_RANK) != NULL);
  setenv(TSHARE_ENV_RANK, "2", 1);
  setenv(TSHARE_ENV_CHANNEL_FDS, "987", 1); /* not open */
  CHECK_RC(tshare_role_from_env(&role, &err), TSHARE_E_MALFORMED, err.message);
  CHECK(strstr(err.message, "not open") != NULL);
  setenv(TSHARE_ENV_CHANNEL_FDS, "3;4", 1);
  CHECK_RC(tshare_role_from_env(&role, &err), TSHARE_E_MALFORMED, err.message);
}

TS_TEST_MAIN
