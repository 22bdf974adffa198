/* tshare-launch end to end: the demo, the C examples, role failures, missing
 * binaries, timeouts, SIGINT, pipe channels, the fds roles inherit, and no
 * process left behind after any of them. This binary also plays roles
 * (`test_launcher --role NAME`) for the launcher to start. */
#include "harness.h"
#include "port_util.h"
#include "proc_util.h"
#include "tshare/tshare.h"

#include <ctype.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <time.h>

typedef struct run_result {
  tshare_exit_status status;
  char out[65536]; /* stdout and stderr together */
  size_t len;
} run_result;

static run_result result;

static const char *launcher(void) {
  const char *l = getenv("TSHARE_LAUNCH");
  if (!l) TS_SKIP("TSHARE_LAUNCH is not set (run through ctest)");
  return l;
}

static const char *self_exe(void) {
  static char path[4096];
  ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  CHECK(n > 0);
  path[n] = '\0';
  return path;
}

/* A launcher running, its stdout and stderr into one pipe that we read. */
typedef struct launched {
  tshare_process *p;
  int out;
  int pause_us;       /* after each read: a slow reader */
  long long newlines; /* in everything read */
} launched;

static launched start_launcher(char *const *args) {
  char *argv[32];
  int n = 0;
  argv[n++] = (char *)launcher();
  for (int i = 0; args[i]; i++) argv[n++] = args[i];
  argv[n] = NULL;
  int out[2];
  CHECK(pipe2(out, O_CLOEXEC) == 0);
  tshare_fd_map map[] = {{1, out[1]}, {2, out[1]}};
  tshare_spawn_options o = {.file = argv[0], .argv = argv, .fds = map, .nfds = 2};
  launched l = {0};
  tshare_error err;
  CHECK_RC(tshare_spawn(&o, &l.p, &err), TSHARE_OK, err.message);
  close(out[1]);
  l.out = out[0];
  memset(&result, 0, sizeof result);
  return l;
}

enum { OUTPUT_END = -1, OUTPUT_NONE = 0, OUTPUT_READ = 1 };

/* Read what comes within wait_ms into result (keeping the newest half when it
 * fills up). */
static int read_output(launched *l, int wait_ms) {
  struct pollfd pf = {.fd = l->out, .events = POLLIN, .revents = 0};
  if (poll(&pf, 1, wait_ms) == 0) return OUTPUT_NONE;
  if (result.len == sizeof result.out - 1) {
    size_t half = result.len / 2;
    memmove(result.out, result.out + half, result.len - half);
    result.len -= half;
  }
  ssize_t got = read(l->out, result.out + result.len, sizeof result.out - 1 - result.len);
  if (got <= 0) return OUTPUT_END;
  for (ssize_t i = 0; i < got; i++) l->newlines += result.out[result.len + (size_t)i] == '\n';
  if (l->pause_us) usleep((useconds_t)l->pause_us);
  result.len += (size_t)got;
  result.out[result.len] = '\0';
  return OUTPUT_READ;
}

/* Read to the end, sending sig (if any) after signal_after_ms; then reap. */
static void finish_launcher(launched *l, int sig, int signal_after_ms) {
  int waited = 0, got;
  while ((got = read_output(l, 50)) != OUTPUT_END) {
    if (got == OUTPUT_READ) continue;
    waited += 50;
    if (sig && waited >= signal_after_ms) {
      kill(tshare_process_pid(l->p), sig);
      sig = 0;
    }
    CHECK(waited < 20000);
  }
  close(l->out);
  CHECK_RC(tshare_process_wait(l->p, 10000, &result.status), TSHARE_OK, "launcher did not exit");
  tshare_process_destroy(l->p);
  printf("---- launcher output ----\n%s-------------------------\n", result.out);
}

/* Run tshare-launch with args; optionally send sig after signal_after_ms. */
static void run_launcher_sig(char *const *args, int sig, int signal_after_ms) {
  launched l = start_launcher(args);
  finish_launcher(&l, sig, signal_after_ms);
}

static void run_launcher(char *const *args) { run_launcher_sig(args, 0, 0); }

static void expect_exit(int code) {
  if (result.status.kind != TSHARE_EXIT_CODE || result.status.value != code)
    TS_FAIL("launcher ended %s %d, expected exit %d", result.status.kind == TSHARE_EXIT_CODE ? "with" : "by signal",
            result.status.value, code);
}

static void expect_output(const char *text) {
  if (!strstr(result.out, text)) TS_FAIL("output lacks \"%s\"", text);
}

/* A whole line of the output is exactly line (roles' lines come in any order). */
static void expect_line(const char *line) {
  size_t n = strlen(line);
  for (const char *p = result.out; (p = strstr(p, line)); p++)
    if ((p == result.out || p[-1] == '\n') && p[n] == '\n') return;
  TS_FAIL("output lacks the line \"%s\"", line);
}

/* Every pid in the summary table, and every number a role printed as
 * "grandchild N", must be gone. */
static void expect_no_process_left(void) {
  int checked = 0;
  for (const char *line = result.out; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
    int pid = 0;
    char label[32];
    if (sscanf(line, "producer %d", &pid) == 1 || sscanf(line, "consumer %*d %d", &pid) == 1) {
    } else if (sscanf(line, "[%31[^]]] grandchild %d", label, &pid) == 2) {
    } else
      continue;
    if (pid <= 0) continue;
    for (int i = 0; i < 200 && !pid_gone(pid); i++) usleep(10000);
    if (!pid_gone(pid)) TS_FAIL("process %d is still running", pid);
    checked++;
  }
  printf("checked %d processes: all gone\n", checked);
  CHECK(checked > 0);
}

/* ---- roles played by this binary ----------------------------------------------- */

/* Asks for channel 0, which must be refused with a message holding want;
 * the fd stays open as the program had it. */
static bool channel_refused(tshare_role *role, int fd, const char *want) {
  tshare_channel *ch = NULL;
  tshare_error err;
  int rc = tshare_role_open_channel(role, 0, NULL, &ch, &err);
  printf("refused: %s\n", err.message);
  if (rc != TSHARE_E_STATE || !strstr(err.message, want)) return false;
  char fd_text[32];
  snprintf(fd_text, sizeof fd_text, "fd %d ", fd);
  return strstr(err.message, fd_text) && fcntl(fd, F_GETFD) >= 0 && role->channels[0].read_fd == fd;
}

/* A program that closed its channel's fd and got the number back for its own
 * log file, then for a socket of its own: neither is taken or closed. */
static int reused_fd_role(tshare_role *role) {
  int fd = role->channels[0].read_fd;
  close(fd);
  char path[] = "/tmp/tshare-role-log-XXXXXX";
  int log = mkstemp(path); /* the lowest free number: the channel's */
  if (log != fd) return 20;
  bool file_refused = channel_refused(role, fd, "(a regular file)");
  bool writable = write(log, "still mine\n", 11) == 11;
  char back[16] = {0};
  bool kept = pread(log, back, sizeof back - 1, 0) == 11 && strcmp(back, "still mine\n") == 0;
  unlink(path);
  close(log);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0 || sv[0] != fd) return 21;
  bool socket_refused = channel_refused(role, fd, "a Unix stream socket of another inode");
  printf("log file %s; its own socket %s\n", writable && kept ? "still open and writable" : "LOST",
         socket_refused ? "refused and kept" : "TAKEN");
  return file_refused && writable && kept && socket_refused ? 0 : 22;
}

/* A frame carrying one number, and the number of the next one received. */
static int send_number(tshare_channel *ch, uint64_t n) {
  tshare_frame f;
  memset(&f, 0, sizeof f);
  f.type = TSHARE_FRAME_RELEASE;
  f.u.release.count = 1;
  f.u.release.share_ids[0] = n;
  return tshare_channel_send_frame(ch, &f, -1, 5000);
}

static long long recv_number(tshare_channel *ch) {
  tshare_frame f;
  int fd;
  int rc = tshare_channel_recv_frame(ch, &f, &fd, 20000);
  if (rc != TSHARE_OK) {
    fprintf(stderr, "receive: %s\n", tshare_channel_last_error(ch));
    return -1;
  }
  return f.type == TSHARE_FRAME_RELEASE ? (long long)f.u.release.share_ids[0] : -1;
}

/* Two launched groups joined by --listen/--connect: on node A the sender
 * sends 4242 across and waits for 4243 back; on node B the relay takes
 * 4242, hands it to its local consumer and answers 4243. */
static int ucx_role(tshare_role *role, const char *name) {
  tshare_error err;
  tshare_channel *remote, *local = NULL;
  int last = role->nchannels - 1;
  if (role->channels[last].kind != TSHARE_CHANNEL_UCX) return 20;
  if (tshare_role_open_channel(role, last, NULL, &remote, &err) != TSHARE_OK) {
    fprintf(stderr, "%s\n", err.message);
    return 21;
  }
  printf("%s: channel %d of %d is over %s to '%s'\n", name, last, role->nchannels,
         tshare_channel_transport(remote) == TSHARE_TRANSPORT_UCX ? "ucx" : "something else",
         tshare_channel_peer(remote)->name);
  int rc = 0;
  if (strcmp(name, "ucx-sender") == 0) {
    if (send_number(remote, 4242) != TSHARE_OK || recv_number(remote) != 4243) rc = 22;
  } else {
    long long n = recv_number(remote);
    if (n != 4242 || tshare_role_open_channel(role, 0, NULL, &local, &err) != TSHARE_OK ||
        send_number(local, (uint64_t)n) != TSHARE_OK || send_number(remote, 4243) != TSHARE_OK)
      rc = 23;
    else
      tshare_role_report(role, "shared", 1);
  }
  if (local) tshare_channel_close(local);
  tshare_channel_close(remote);
  return rc;
}

static int role_main(int argc, char **argv) {
  (void)argc;
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *name = argv[2];
  if (strcmp(name, "fd-census") == 0) { /* print the fds this role inherited */
    char line[256] = "fds:";
    for (int fd = 0; fd < 256; fd++)
      if (fcntl(fd, F_GETFD) >= 0) snprintf(line + strlen(line), sizeof line - strlen(line), " %d", fd);
    printf("%s\n", line);
    return 0;
  }
  if (strcmp(name, "ten-naps") == 0) { /* 2 s of work in one process (a shell's vfork would show state D) */
    printf("started\n");
    for (int i = 0; i < 10; i++) usleep(200000);
    printf("finished\n");
    return 0;
  }
  tshare_role role;
  tshare_error err;
  if (tshare_role_from_env(&role, &err) != TSHARE_OK) {
    fprintf(stderr, "%s\n", err.message);
    return 10;
  }
  if (strcmp(name, "counting") == 0) { /* reports set and add; the summary shows what they mean */
    for (int i = 0; i < 3; i++) {
      tshare_role_report(&role, "verified", 5);
      tshare_role_report_add(&role, "shared", 1);
    }
    return 0;
  }
  if (strcmp(name, "reused-fd") == 0) return reused_fd_role(&role);
  if (strcmp(name, "ucx-sender") == 0 || strcmp(name, "ucx-relay") == 0) return ucx_role(&role, name);
  tshare_channel *ch;
  if (tshare_role_open_channel(&role, 0, NULL, &ch, &err) != TSHARE_OK) {
    fprintf(stderr, "%s\n", err.message);
    return 11;
  }
  if (strcmp(name, "wrong-producer") == 0) { /* tensor t0 with the demo's layout but zeros inside */
    tshare_host_buffer *buf;
    if (tshare_host_buffer_create(4096, "wrong", &buf, &err) != TSHARE_OK) return 17;
    int64_t n = 64;
    tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, &n, 0);
    if (tshare_share_host(ch, buf, &d, "t0", NULL, 5000, NULL) != TSHARE_OK) return 18;
    tshare_channel_send_bye(ch, 0, 5000);
    tshare_channel_wait_released(ch, 0, 5000);
    tshare_role_report(&role, "shared", 1);
    tshare_channel_close(ch);
    tshare_host_buffer_destroy(buf);
    return 0;
  }
  if (strcmp(name, "pipe-producer") == 0) {
    if (tshare_channel_kind_of(ch) != TSHARE_CHANNEL_PIPES) return 12;
    if (tshare_channel_send_bye(ch, 42, 5000) != TSHARE_OK) return 13;
    tshare_frame f;
    int fd;
    int rc = tshare_channel_recv_frame(ch, &f, &fd, 5000); /* the consumer closes: its bye */
    bool bye = rc == TSHARE_OK && f.type == TSHARE_FRAME_BYE;
    if (bye) rc = tshare_channel_recv_frame(ch, &f, &fd, 5000); /* then the end of the stream */
    tshare_channel_close(ch);
    tshare_role_report(&role, "shared", 1);
    printf("producer: peer %s after bye\n", bye && rc == TSHARE_E_PEER_CLOSED ? "closed" : "did something else");
    return bye && rc == TSHARE_E_PEER_CLOSED ? 0 : 14;
  }
  if (strcmp(name, "relay-consumer") == 0) {
    long long n = recv_number(ch);
    printf("consumer: got %lld from the other node\n", n);
    tshare_role_report(&role, "verified", 1);
    tshare_channel_close(ch);
    return n == 4242 ? 0 : 24;
  }
  if (strcmp(name, "pipe-consumer") == 0) {
    tshare_frame f;
    int fd;
    if (tshare_channel_recv_frame(ch, &f, &fd, 5000) != TSHARE_OK) return 15;
    printf("consumer: got %s with reason %u over %s\n", tshare_frame_type_name(f.type), f.u.bye.reason,
           tshare_channel_kind_of(ch) == TSHARE_CHANNEL_PIPES ? "pipes" : "a socket");
    tshare_role_report(&role, "verified", 1);
    tshare_channel_close(ch);
    return f.type == TSHARE_FRAME_BYE && f.u.bye.reason == 42 ? 0 : 16;
  }
  return 2;
}

__attribute__((constructor)) static void install_roles(void) { ts_role_main = role_main; }

static char *role_cmd(const char *name) {
  static char bufs[4][4200];
  static int next;
  char *b = bufs[next++ % 4];
  snprintf(b, sizeof bufs[0], "'%s' --role %s", self_exe(), name);
  return b;
}

/* ---- the tests ---------------------------------------------------------------- */

/* The C API's demo roles (--api c: where the bridge is built, auto picks it). */
TS_TEST(demo_default) {
  char *args[] = {"demo", "--api", "c", NULL};
  run_launcher(args);
  expect_exit(0);
  expect_output("tshare-launch: OK: 8 tensors shared with 1 consumer, 8 of 8 verified intact");
  expect_output("#7 float16[5x24]: 120/120 elements intact");
  expect_no_process_left();
}

TS_TEST(demo_many_tensors_four_consumers) {
  char *args[] = {"--consumers", "4", "demo", "--tensors", "60", "--api", "c", NULL};
  run_launcher(args);
  expect_exit(0);
  expect_output("tshare-launch: OK: 60 tensors shared with 4 consumers, 240 of 240 verified intact");
  expect_output("0 still held; 0 tensors changed on this side");
  expect_no_process_left();
}

TS_TEST(demo_refuses_what_it_cannot_do) {
  char *pipes[] = {"demo", "--device", "cpu", "--channel", "pipe", NULL};
  run_launcher(pipes);
  expect_exit(2);
  expect_output("--channel socket");
  char *bad_device[] = {"demo", "--device", "tpu", NULL};
  run_launcher(bad_device);
  expect_exit(2);
  expect_output("use cpu, cuda or auto");
  char *bad_api[] = {"demo", "--api", "python", NULL};
  run_launcher(bad_api);
  expect_exit(2);
  expect_output("use c, torch or auto");
}

/* Without a usable GPU, --device cuda says why and fails; auto falls back. */
TS_TEST(demo_device_cuda_without_gpu) {
  if (tshare_cuda_init(NULL) == TSHARE_OK) TS_SKIP("a CUDA device is usable here (the GPU suite covers it)");
  char *cuda[] = {"demo", "--device", "cuda", NULL};
  run_launcher(cuda);
  CHECK(result.status.kind == TSHARE_EXIT_CODE && (result.status.value == 1 || result.status.value == 2));
  expect_output("--device cuda: ");
  char *autodev[] = {"demo", "--device", "auto", NULL};
  run_launcher(autodev);
  expect_exit(0);
  expect_output("device cpu (auto: no CUDA device)");
}

TS_TEST(demo_consumer_catches_wrong_data) {
  /* The real demo consumer against a producer whose tensor holds zeros. */
  char consumer[4200];
  snprintf(consumer, sizeof consumer, "'%s' __role consumer --tensors 1", launcher());
  char *args[] = {"--producer", role_cmd("wrong-producer"), "--consumer", consumer, NULL};
  run_launcher(args);
  expect_exit(1);
  expect_output("elements WRONG (first at element 0)");
  expect_output("FAILED: consumer 0");
  expect_no_process_left();
}

TS_TEST(c_examples_end_to_end) {
  const char *dir = getenv("TSHARE_EXAMPLES_DIR");
  if (!dir) TS_SKIP("TSHARE_EXAMPLES_DIR is not set");
  char producer[4200], consumer[4200];
  snprintf(producer, sizeof producer, "%s/batch_producer 30", dir);
  snprintf(consumer, sizeof consumer, "%s/batch_consumer", dir);
  char *args[] = {"--producer", producer, "--consumer", consumer, "--consumers", "3", NULL};
  run_launcher(args);
  expect_exit(0);
  expect_output("all 30 batches handed out and released");
  expect_output("worker 2: batch 29 [32x256]");
  expect_no_process_left();
}

TS_TEST(role_exiting_3_fails_the_launch) {
  char *args[] = {"--producer",  "sh -c 'sleep 30 & echo grandchild $!; wait'",
                  "--consumer",  "sh -c 'exit 3'",
                  "--consumers", "2",
                  "--grace",     "0.5",
                  NULL};
  run_launcher(args);
  expect_exit(1);
  expect_output("exited with status 3; the other roles were stopped");
  expect_output("FAILED: consumer");
  expect_no_process_left();
}

TS_TEST(role_killed_by_signal_fails_the_launch) {
  char *args[] = {"--producer", "sleep 30", "--consumer", "sh -c 'kill -9 $$'", "--grace", "0.5", NULL};
  run_launcher(args);
  expect_exit(1);
  expect_output("FAILED: consumer 0 (pid ");
  expect_output("killed by signal 9 (SIGKILL)");
  expect_no_process_left();
}

TS_TEST(role_ignoring_sigterm_is_killed_after_grace) {
  char *args[] = {"--producer", "sh -c 'trap \"\" TERM; sleep 30; exit 0'",
                  "--consumer", "sh -c 'sleep 0.3; exit 1'",
                  "--grace",    "0.3",
                  NULL};
  run_launcher(args);
  expect_exit(1);
  expect_output("still running after 0.3 s; killing it");
  expect_no_process_left();
}

TS_TEST(missing_binary_is_named) {
  char *args[] = {"--producer", "sleep 30", "--consumer", "/no/such/consumer-binary --x", NULL};
  run_launcher(args);
  expect_exit(127);
  expect_output("cannot start consumer 0");
  expect_output("/no/such/consumer-binary");
  expect_no_process_left(); /* the producer that did start was stopped */
}

TS_TEST(timeout_stops_everything) {
  char *args[] = {"--producer", "sleep 30", "--consumer", "sh -c 'sleep 30 & echo grandchild $!; wait'",
                  "--timeout",  "0.5",      "--grace",    "0.3",
                  NULL};
  run_launcher(args);
  expect_exit(124);
  expect_output("timeout after 0.5 s");
  expect_no_process_left();
}

TS_TEST(sigint_is_forwarded_and_everything_stops) {
  char *args[] = {"--producer",  "sh -c 'sleep 30 & echo grandchild $!; wait'",
                  "--consumer",  "sleep 30",
                  "--consumers", "2",
                  "--grace",     "0.5",
                  NULL};
  run_launcher_sig(args, SIGINT, 400);
  expect_exit(128 + SIGINT);
  expect_output("got SIGINT; forwarding it to the roles");
  expect_output("STOPPED");
  expect_no_process_left();
}

/* Every terminating signal is forwarded, not only SIGINT/SIGTERM/SIGHUP. */
TS_TEST(sigquit_and_sigusr1_are_forwarded) {
  const int sigs[] = {SIGQUIT, SIGUSR1};
  for (int i = 0; i < 2; i++) {
    char *args[] = {
        "--producer", "sh -c 'sleep 30 & echo grandchild $!; wait'", "--consumer", "sleep 30", "--grace", "0.5", NULL};
    run_launcher_sig(args, sigs[i], 400);
    expect_exit(128 + sigs[i]);
    char text[64];
    snprintf(text, sizeof text, "got SIG%s; forwarding it", sigabbrev_np(sigs[i]));
    expect_output(text);
    expect_no_process_left();
  }
}

static double seconds_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The pid a role wrote to path, waiting up to 5 s for it to be written. */
static pid_t pid_from_file(const char *path) {
  for (int i = 0; i < 500; i++, usleep(10000)) {
    FILE *f = fopen(path, "r");
    int pid = 0;
    bool read = f && fscanf(f, "%d", &pid) == 1;
    if (f) fclose(f);
    if (read && pid > 0) return (pid_t)pid;
  }
  TS_FAIL("no pid in %s after 5 s", path);
}

/* The launcher's stdout and stderr are a pipe nobody reads while the roles
 * print without end: --timeout still stops them on time (2 s timeout, 0.5 s
 * grace: gone well before 6 s, unless the launcher waits in a write), and the
 * lines that could not wait are counted. */
TS_TEST(timeout_holds_while_nobody_reads_the_output) {
  char dir[] = "/tmp/tshare-stall-XXXXXX", role[4200], paths[2][300];
  CHECK(mkdtemp(dir) != NULL);
  snprintf(role, sizeof role, "sh -c 'echo $$ > %s/$TSHARE_ROLE.pid; exec yes a-line-of-role-output'", dir);
  snprintf(paths[0], sizeof paths[0], "%s/producer.pid", dir);
  snprintf(paths[1], sizeof paths[1], "%s/consumer.pid", dir);
  char *args[] = {"--producer", role, "--consumer", role, "--timeout", "2", "--grace", "0.5", NULL};
  double t0 = seconds_now();
  launched l = start_launcher(args);
  pid_t roles[2] = {pid_from_file(paths[0]), pid_from_file(paths[1])};
  bool stopped; /* looked at once a turn: the answer the loop ended on is the one reported */
  while (!(stopped = pid_gone(roles[0]) && pid_gone(roles[1])) && seconds_now() - t0 < 6.0) usleep(20000);
  double at = seconds_now() - t0;
  finish_launcher(&l, 0, 0); /* now read, so that the launcher can finish */
  unlink(paths[0]);
  unlink(paths[1]);
  rmdir(dir);
  if (!stopped)
    TS_FAIL("the roles still ran %.1f s after the start, with --timeout 2, while nobody read the output", at);
  printf("roles gone %.2f s after the start\n", at);
  expect_exit(124);
  expect_output("timeout after 2.0 s");
  expect_output("of producer's stdout were dropped: the launcher's stdout was not read fast enough");
  expect_output("of consumer 0's stdout were dropped");
}

/* The state letter of a process (R, S, T, Z...), or 0 when it is gone. */
static char proc_state(pid_t pid) {
  char path[64], text[512] = {0};
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  const char *paren = n ? strrchr(text, ')') : NULL;
  return paren && paren[1] == ' ' ? paren[2] : 0;
}

/* Up to 5 s for pid to be stopped (want true) or not; the launcher is killed
 * when it does not happen, so that no stopped process outlives the test. */
static void expect_stopped(launched *l, pid_t pid, const char *who, bool want) {
  for (int i = 0; i < 500 && (proc_state(pid) == 'T') != want; i++) usleep(10000);
  char state = proc_state(pid);
  if ((state == 'T') == want) return;
  kill(tshare_process_pid(l->p), SIGKILL);
  TS_FAIL("%s (pid %d) is %s after 5 s (state %c)", who, (int)pid, want ? "not stopped" : "still stopped",
          state ? state : '-');
}

/* The pid in the prefix of the line "[label pid N] text". */
static pid_t pid_of_line(const char *label, const char *text) {
  char want[64];
  snprintf(want, sizeof want, "[%s pid ", label);
  for (const char *p = result.out; (p = strstr(p, want)); p++) {
    int pid;
    char rest[64];
    if (sscanf(p + strlen(want), "%d] %63[^\n]", &pid, rest) == 2 && strcmp(rest, text) == 0) return (pid_t)pid;
  }
  return 0;
}

/* Ctrl-Z (SIGTSTP to the launcher) stops the roles, which run in process
 * groups of their own, and the launcher itself; SIGCONT continues them, and
 * the time stopped does not count against --timeout: each role works 2 s in
 * short sleeps, stopped 3 s in between, under --timeout 4. */
TS_TEST(sigtstp_stops_the_roles_and_sigcont_continues_them) {
  char *args[] = {"--producer", role_cmd("ten-naps"), "--consumer", role_cmd("ten-naps"), "--timeout", "4", NULL};
  launched l = start_launcher(args);
  pid_t producer = 0, consumer = 0;
  for (int waited = 0; !(producer && consumer); waited += 50) {
    CHECK(waited < 5000 && read_output(&l, 50) != OUTPUT_END);
    producer = pid_of_line("producer", "started");
    consumer = pid_of_line("consumer 0", "started");
  }
  pid_t self = tshare_process_pid(l.p);
  kill(self, SIGTSTP);
  expect_stopped(&l, producer, "the producer", true);
  expect_stopped(&l, consumer, "the consumer", true);
  expect_stopped(&l, self, "the launcher", true);
  sleep(3);
  expect_stopped(&l, producer, "the producer", true);
  kill(self, SIGCONT);
  expect_stopped(&l, producer, "the producer", false);
  expect_stopped(&l, consumer, "the consumer", false);
  finish_launcher(&l, 0, 0);
  expect_exit(0);
  expect_output("] finished\n");
  expect_output("tshare-launch: OK: all 2 roles exited with status 0");
}

/* A reader slower than the roles but never stalled loses nothing: the roles
 * wait for it instead. */
TS_TEST(slow_reader_gets_every_line) {
  char *args[] = {"--producer", "seq 100000", "--consumer", "seq 100000", NULL};
  launched l = start_launcher(args);
  l.pause_us = 2000; /* 2 ms after every read of at most 64 KiB */
  finish_launcher(&l, 0, 0);
  expect_exit(0);
  CHECK(strstr(result.out, "dropped") == NULL);
  CHECK_EQ(l.newlines, 200000 + 5); /* and the summary: a blank line, the header, 2 roles, OK */
}

/* A SIGKILLed launcher cannot forward anything: its roles die with it. */
TS_TEST(sigkill_to_the_launcher_takes_its_roles) {
  char *args[] = {"--producer", "sh -c 'echo grandchild $$; exec sleep 30'", "--consumer",
                  "sh -c 'echo grandchild $$; exec sleep 30'", NULL};
  run_launcher_sig(args, SIGKILL, 400);
  CHECK_EQ(result.status.kind, TSHARE_EXIT_SIGNAL);
  expect_no_process_left();
}

/* A role's daemon (setsid, its own session) does not outlive the job, even
 * when every role succeeded. */
TS_TEST(processes_left_behind_by_roles_are_stopped) {
  char *args[] = {"--producer", "sh -c 'setsid sleep 30 & echo grandchild $!; exit 0'", "--consumer",
                  "sh -c 'setsid sh -c \"sleep 30 & echo grandchild \\$!; wait\" & sleep 0.2; exit 0'", NULL};
  run_launcher(args);
  expect_exit(0);
  expect_output("left behind by the roles");
  expect_no_process_left();
}

/* Output is passed on byte for byte (a NUL does not cut the line); the
 * summary lists every role, started or not; reports set or add. */
TS_TEST(output_summary_and_reports) {
  char *nul[] = {"--producer", "printf 'left\\000right\\n'", "--consumer", "true", NULL};
  run_launcher(nul);
  expect_exit(0);
  CHECK(memmem(result.out, result.len, "left\0right\n", 11) != NULL);
  char *missing[] = {"--producer", "sleep 30", "--consumer", "./tshare-no-such-consumer", "--consumers", "2", NULL};
  run_launcher(missing);
  expect_exit(127);
  CHECK(strstr(result.out, "\nconsumer 0 ") && strstr(result.out, "could not be started"));
  CHECK(strstr(result.out, "\nconsumer 1 ") && strstr(result.out, "not started"));
  char *counting[] = {"--producer", role_cmd("counting"), "--consumer", role_cmd("counting"), NULL};
  run_launcher(counting);
  expect_exit(0);
  long long shared = -1, verified = -1;
  const char *p = strstr(result.out, "\nproducer ");
  const char *c = strstr(result.out, "\nconsumer 0 ");
  CHECK(p && c);
  CHECK(sscanf(p, "\nproducer %*d exited with status 0 %lld", &shared) == 1);
  CHECK(sscanf(c, "\nconsumer 0 %*d exited with status 0 %*s %lld", &verified) == 1);
  CHECK_EQ(shared, 3);   /* added three times */
  CHECK_EQ(verified, 5); /* set three times */
}

/* --version, --no-prefix, --log-dir and a --consumer per rank. */
TS_TEST(version_prefix_logs_and_commands_per_rank) {
  char *version[] = {"--version", NULL};
  run_launcher(version);
  expect_exit(0);
  char want[64];
  snprintf(want, sizeof want, "tshare-launch %s (libtshare %s, wire format %d.%d)", tshare_version(), tshare_version(),
           TSHARE_WIRE_MAJOR, TSHARE_WIRE_MINOR);
  expect_output(want);

  char *per_rank[] = {"--producer",  "echo made",
                      "--consumer",  "sh -c 'echo first $TSHARE_RANK'",
                      "--consumer",  "sh -c 'echo second $TSHARE_RANK'",
                      "--no-prefix", NULL};
  run_launcher(per_rank);
  expect_exit(0);
  expect_line("first 0"); /* each consumer its own command, no prefix */
  expect_line("second 1");
  expect_output("\nconsumer 1 "); /* two consumers without --consumers */

  char dir[] = "/tmp/tshare-logs-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  char *logs[] = {"--producer",  "echo to the file",
                  "--consumer",  "sh -c 'echo rank $TSHARE_RANK >&2'",
                  "--consumers", "2",
                  "--log-dir",   dir,
                  NULL};
  run_launcher(logs);
  expect_exit(0);
  CHECK(strstr(result.out, "to the file") == NULL); /* not on the terminal */
  expect_output("tshare-launch: OK");
  const char *files[][2] = {{"producer.log", "to the file\n"},
                            {"consumer-0.log", "rank 0\n"},
                            {"consumer-1.log", "rank 1\n"},
                            {"summary.txt", "consumer 1 "}};
  for (size_t i = 0; i < 4; i++) {
    char path[256], text[4096] = {0};
    snprintf(path, sizeof path, "%s/%s", dir, files[i][0]);
    FILE *f = fopen(path, "r");
    if (!f) TS_FAIL("%s was not written", path);
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    if (!strstr(text, files[i][1])) TS_FAIL("%s lacks \"%s\": %s", path, files[i][1], text);
    unlink(path);
  }
  rmdir(dir);
}

TS_TEST(pipe_channels_carry_frames) {
  char *args[] = {"--channel", "pipe", "--producer", role_cmd("pipe-producer"), "--consumer", role_cmd("pipe-consumer"),
                  NULL};
  run_launcher(args);
  expect_exit(0);
  expect_output("consumer: got bye with reason 42 over pipes");
  expect_output("producer: peer closed after bye");
  expect_no_process_left();
}

TS_TEST(roles_inherit_only_their_fds) {
  char *args[] = {"--producer", role_cmd("fd-census"), "--consumer", role_cmd("fd-census"), "--consumers", "2", NULL};
  run_launcher(args);
  expect_exit(0);
  /* producer: stdio, 2 channels (3, 4), report fd 5; consumer: stdio, 1 channel, report fd 4 */
  CHECK(strstr(result.out, "] fds: 0 1 2 3 4 5\n") != NULL);
  CHECK(strstr(result.out, "] fds: 0 1 2 3 4\n") != NULL);
  char *pipes[] = {"--channel", "pipe", "--producer", role_cmd("fd-census"), "--consumer", role_cmd("fd-census"), NULL};
  run_launcher(pipes);
  expect_exit(0);
  CHECK(strstr(result.out, "] fds: 0 1 2 3 4 5\n") != NULL); /* a pipe pair (3, 4) and the report fd */
}

/* A role that reused its channel's fd number for its own files gets a clear
 * refusal, and keeps its files. */
TS_TEST(role_channel_fd_reused_by_the_program_is_not_taken) {
  char *args[] = {"--producer", "true", "--consumer", role_cmd("reused-fd"), NULL};
  run_launcher(args);
  expect_exit(0);
  expect_output(
      "refused: role: fd 3 is no longer tshare-launch's channel (a Unix stream socket) but /tmp/tshare-role-log-");
  expect_output(
      "refused: role: fd 3 is no longer tshare-launch's channel (a Unix stream socket of another inode) but socket:[");
  expect_output("log file still open and writable; its own socket refused and kept");
}

/* TSHARE_CHANNEL_IDS must match TSHARE_CHANNEL_FDS entry for entry; a
 * channel fd closed after it was read is refused, not handed to a channel. */
TS_TEST(role_channel_ids_are_checked) {
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  struct stat st;
  CHECK(fstat(sv[0], &st) == 0);
  char fds[32], ids[64];
  snprintf(fds, sizeof fds, "%d", sv[0]);
  setenv(TSHARE_ENV_ROLE, "consumer", 1);
  setenv(TSHARE_ENV_RANK, "0", 1);
  setenv(TSHARE_ENV_NUM_CONSUMERS, "1", 1);
  setenv(TSHARE_ENV_CHANNEL_FDS, fds, 1);
  const char *bad[] = {"12:13", "x", "-1", "1,2"};
  tshare_role role;
  tshare_error err;
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    setenv(TSHARE_ENV_CHANNEL_IDS, bad[i], 1);
    CHECK_RC(tshare_role_from_env(&role, &err), TSHARE_E_MALFORMED, bad[i]);
    if (!strstr(err.message, TSHARE_ENV_CHANNEL_IDS)) TS_FAIL("%s: %s", bad[i], err.message);
  }
  snprintf(ids, sizeof ids, "%llu", (unsigned long long)st.st_ino);
  setenv(TSHARE_ENV_CHANNEL_IDS, ids, 1);
  CHECK_RC(tshare_role_from_env(&role, &err), TSHARE_OK, err.message);
  CHECK_EQ(role.channels[0].read_ino, st.st_ino);
  close(sv[0]);
  tshare_channel *ch;
  CHECK_RC(tshare_role_open_channel(&role, 0, NULL, &ch, &err), TSHARE_E_STATE, err.message);
  printf("%s\n", err.message);
  CHECK(strstr(err.message, "is closed") != NULL);
  close(sv[1]);
}

/* Node A's group listens on a ucx:// address, node B's connects (here both
 * on 127.0.0.1): B's producer relays A's frame to B's consumer. */
TS_TEST(listen_and_connect_join_two_groups) {
  char address[64];
  snprintf(address, sizeof address, "ucx://127.0.0.1:%u/weights", free_loopback_port());
  setenv("TSHARE_TOKEN", "launcher-test-token", 1);
  if (!getenv("UCX_TLS")) setenv("UCX_TLS", "tcp", 1);
  tshare_listener *probe; /* UCX is there (else skip) and the port is free */
  tshare_error err;
  int rc = tshare_listen(address, &probe, &err);
  if (rc == TSHARE_E_UNSUPPORTED) TS_SKIP("%s", err.message);
  CHECK_RC(rc, TSHARE_OK, err.message);
  tshare_listener_close(probe);
  char *a[] = {"--listen", address, "--producer", role_cmd("ucx-sender"), "--consumer", "true", NULL};
  char *b[] = {"--connect", address, "--producer", role_cmd("ucx-relay"), "--consumer", role_cmd("relay-consumer"),
               NULL};
  launched node_a = start_launcher(a);
  launched node_b = start_launcher(b);
  finish_launcher(&node_b, 0, 0);
  expect_exit(0);
  expect_output("ucx-relay: channel 1 of 2 is over ucx to 'producer 0'");
  expect_output("consumer: got 4242 from the other node");
  memset(&result, 0, sizeof result);
  finish_launcher(&node_a, 0, 0);
  expect_exit(0);
  expect_output("ucx-sender: channel 1 of 2 is over ucx to 'producer 0'");
  expect_no_process_left();
}

TS_TEST(usage_errors) {
  char *a[] = {"--bogus", NULL};
  run_launcher(a);
  expect_exit(2);
  expect_output("unknown option '--bogus'");
  expect_output("--help");
  char *b[] = {"--producer", "true", NULL};
  run_launcher(b);
  expect_exit(2);
  char *c[] = {"--consumers", "0", "demo", NULL};
  run_launcher(c);
  expect_exit(2);
  char *d[] = {"--producer", "sh -c 'unterminated", "--consumer", "true", NULL};
  run_launcher(d);
  expect_exit(2);
  expect_output("unterminated");
  char *spaced[] = {"--consumers", " 3", "demo", NULL}; /* strtol would have skipped the space */
  run_launcher(spaced);
  expect_exit(2);
  char *no_value[] = {"demo", "--timeout", NULL};
  run_launcher(no_value);
  expect_exit(2);
  expect_output("option '--timeout' needs a value");
  char *mismatch[] = {"--producer", "true", "--consumer", "true", "--consumer", "true", "--consumers", "3", NULL};
  run_launcher(mismatch);
  expect_exit(2);
  expect_output("--consumer given 2 times for --consumers 3");
  char *no_scheme[] = {"--listen", "nodeA:7700/w", "--producer", "true", "--consumer", "true", NULL};
  run_launcher(no_scheme);
  expect_exit(2);
  expect_output("give a ucx://HOST:PORT/NAME address");
  char *both[] = {"--listen", "ucx://a:1/w", "--connect", "ucx://b:1/w", "--producer", "true", "--consumer", "true", NULL};
  run_launcher(both);
  expect_exit(2);
  expect_output("give one, once");
  unsetenv("TSHARE_TOKEN");
  char *no_token[] = {"--connect", "ucx://b:1/w", "--producer", "true", "--consumer", "true", NULL};
  run_launcher(no_token);
  expect_exit(2);
  expect_output("set TSHARE_TOKEN");
  char *e[] = {"--help", NULL};
  run_launcher(e);
  expect_exit(0);
  expect_output("TSHARE_CHANNEL_FDS");
}

TS_TEST_MAIN
