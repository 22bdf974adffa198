#include "supervisor.h"

#include "output.h"

#include "tshare/role.h"
#include "tshare/spawn.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define LINE_MAX_BYTES 4096

typedef struct line_buf {
  int fd; /* -1 once at EOF */
  size_t len;
  char data[LINE_MAX_BYTES];
} line_buf;

enum { OUT_STDOUT, OUT_STDERR, OUT_REPORT, OUT_COUNT };

typedef struct role_run {
  char label[32]; /* "producer", "consumer 2" */
  FILE *log;      /* --log-dir: this role's lines go here */
  bool prefixed;  /* lines get "[label pid N] " (not with --no-prefix or a log) */
  tshare_process *proc;
  pid_t pid;
  line_buf out[OUT_COUNT];
  out_queue pending[OUT_REPORT]; /* stdout and stderr lines the launcher's reader has not taken yet */
  double start_s, end_s;
  bool ended;
  tshare_exit_status status;
  long long shared, verified; /* -1: not reported */
} role_run;

static int signal_pipe[2] = {-1, -1};

/* Only async-signal-safe work here: the loop reads the number and acts. */
static void on_signal(int sig) {
  int saved = errno;
  unsigned char b = (unsigned char)sig;
  if (write(signal_pipe[1], &b, 1) < 0) {
    /* pipe full: a wakeup is already pending */
  }
  errno = saved;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A line goes out as it came, NUL bytes included: to the role's log file, or
 * queued for the launcher's stdout or stderr (see output.h). */
static void emit_line(role_run *r, int stream, const char *text, size_t n) {
  char prefix[64] = "";
  if (r->prefixed) snprintf(prefix, sizeof prefix, "[%s pid %d] ", r->label, (int)r->pid);
  if (!r->log) {
    out_queue_line(&r->pending[stream], prefix, strlen(prefix), text, n);
    return;
  }
  fputs(prefix, r->log);
  fwrite(text, 1, n, r->log);
  fputc('\n', r->log);
  fflush(r->log);
}

/* "key=N" sets a figure, "key+=N" adds to it (tshare_role_report / _add). */
static void handle_report(role_run *r, const char *text, size_t n) {
  char line[128];
  snprintf(line, sizeof line, "%.*s", (int)(n < sizeof line ? n : sizeof line - 1), text);
  long long v;
  char op[3] = "";
  long long *figure = NULL;
  if (sscanf(line, "shared%2[+=]%lld", op, &v) == 2)
    figure = &r->shared;
  else if (sscanf(line, "verified%2[+=]%lld", op, &v) == 2)
    figure = &r->verified;
  if (!figure) return;
  if (strcmp(op, "=") == 0)
    *figure = v;
  else if (strcmp(op, "+=") == 0)
    *figure = (*figure < 0 ? 0 : *figure) + v;
}

static void take_lines(role_run *r, int stream, bool at_eof) {
  line_buf *b = &r->out[stream];
  size_t start = 0;
  for (size_t i = 0; i < b->len; i++) {
    if (b->data[i] != '\n') continue;
    if (stream == OUT_REPORT)
      handle_report(r, b->data + start, i - start);
    else
      emit_line(r, stream, b->data + start, i - start);
    start = i + 1;
  }
  /* A line longer than the buffer, or the last line without '\n', goes as is. */
  if ((start == 0 && b->len == sizeof b->data) || (at_eof && start < b->len)) {
    if (stream == OUT_REPORT)
      handle_report(r, b->data + start, b->len - start);
    else
      emit_line(r, stream, b->data + start, b->len - start);
    start = b->len;
  }
  memmove(b->data, b->data + start, b->len - start);
  b->len -= start;
}

static void read_output(role_run *r, int stream) {
  line_buf *b = &r->out[stream];
  ssize_t n;
  do n = read(b->fd, b->data + b->len, sizeof b->data - b->len);
  while (n < 0 && errno == EINTR);
  if (n < 0 && errno == EAGAIN) return;
  if (n <= 0) {
    take_lines(r, stream, true);
    close(b->fd);
    b->fd = -1;
    return;
  }
  b->len += (size_t)n;
  take_lines(r, stream, false);
}

/* Channel ends for one role: the fds to give it and the text for
 * TSHARE_CHANNEL_FDS and TSHARE_CHANNEL_IDS. */
typedef struct role_fds {
  tshare_fd_map map[3 + 2 * TSHARE_ROLE_CHANNELS_MAX + 1];
  size_t n;
  char channel_env[1024];
  char ids_env[TSHARE_ROLE_CHANNELS_MAX * 42 + 1]; /* two 20-digit inodes, ":" and "," per channel */
  int next_child_fd;
} role_fds;

/* The inode of an fd we give a role: the role checks it before it takes the
 * fd, so a number it closed and reused for a file of its own is not taken. */
static unsigned long long inode_of(int fd) {
  struct stat st;
  return fstat(fd, &st) == 0 ? (unsigned long long)st.st_ino : 0;
}

static void add_channel(role_fds *f, tshare_channel_kind kind, int rfd, int wfd) {
  size_t used = strlen(f->channel_env), ids_used = strlen(f->ids_env);
  const char *sep = used ? "," : "";
  int first = f->next_child_fd;
  f->map[f->n++] = (tshare_fd_map){first, rfd};
  if (kind == TSHARE_CHANNEL_SOCKET) {
    snprintf(f->channel_env + used, sizeof f->channel_env - used, "%s%d", sep, first);
    snprintf(f->ids_env + ids_used, sizeof f->ids_env - ids_used, "%s%llu", sep, inode_of(rfd));
    f->next_child_fd++;
  } else {
    f->map[f->n++] = (tshare_fd_map){first + 1, wfd};
    snprintf(f->channel_env + used, sizeof f->channel_env - used, "%s%d:%d", sep, first, first + 1);
    snprintf(f->ids_env + ids_used, sizeof f->ids_env - ids_used, "%s%llu:%llu", sep, inode_of(rfd), inode_of(wfd));
    f->next_child_fd += 2;
  }
}

/* The channel across hosts: no fd, the role opens it by its address (in
 * TSHARE_UCX_LISTEN or TSHARE_UCX_CONNECT). */
static void add_ucx_channel(role_fds *f) {
  size_t used = strlen(f->channel_env), ids_used = strlen(f->ids_env);
  const char *sep = used ? "," : "";
  snprintf(f->channel_env + used, sizeof f->channel_env - used, "%s" TSHARE_ROLE_CHANNEL_UCX, sep);
  snprintf(f->ids_env + ids_used, sizeof f->ids_env - ids_used, "%s" TSHARE_ROLE_CHANNEL_UCX, sep);
}

static void describe(const role_run *r, char *buf, size_t cap) {
  char how[64];
  snprintf(buf, cap, "%s (pid %d) %s", r->label, (int)r->pid, tshare_exit_describe(r->status, how, sizeof how));
}

static bool failed(const role_run *r) {
  return r->ended && !(r->status.kind == TSHARE_EXIT_CODE && r->status.value == 0);
}

static void print_summary(FILE *to, const role_run *roles, int n, double wall_s) {
  fprintf(to, "\n%-12s %8s  %-34s %7s %9s %9s\n", "role", "pid", "status", "shared", "verified", "wall");
  for (int i = 0; i < n; i++) {
    const role_run *r = &roles[i];
    char how[64], shared[24] = "-", verified[24] = "-", pid[16] = "-";
    if (r->proc) snprintf(pid, sizeof pid, "%d", (int)r->pid);
    if (r->shared >= 0) snprintf(shared, sizeof shared, "%lld", r->shared);
    if (r->verified >= 0) snprintf(verified, sizeof verified, "%lld", r->verified);
    const char *status = r->proc    ? tshare_exit_describe(r->status, how, sizeof how)
                         : r->ended ? "could not be started"
                                    : "not started";
    fprintf(to, "%-12s %8s  %-34s %7s %9s %7.3f s\n", r->label, pid, status, shared, verified,
            r->proc || r->ended ? (r->ended ? r->end_s : r->start_s + wall_s) - r->start_s : 0.0);
  }
  fflush(to);
}

/* The whole job: roles, their channels, and how the run is going. */
typedef struct job {
  const launch_plan *plan;
  int nroles;  /* producer + consumers */
  int started; /* roles [0, started) were spawned */
  role_run *roles;
  double t0;
  bool tearing_down;
  double grace_deadline; /* 0: no SIGKILL pending */
  int interrupted;       /* the signal the launcher got, 0 if none */
  int first_failure;     /* index of the role whose failure stopped the job, or -1 */
  int not_started;       /* index of the role that could not be started, or -1 */
  bool timed_out;
  double stopped_s;          /* time spent stopped by job control: not counted against --timeout */
  out_queue own;             /* the launcher's own messages, on their way to stderr */
  out_sink sink[OUT_REPORT]; /* the launcher's stdout and stderr */
} job;

/* A message of the launcher's own ("tshare-launch: ..."), through the same
 * queues as the roles' lines: printing it must not block supervision either. */
__attribute__((format(printf, 2, 3))) static void say(job *j, const char *fmt, ...) {
  char text[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  size_t len = n < 0 ? 0 : (size_t)n < sizeof text ? (size_t)n : sizeof text - 1;
  static const char prefix[] = "tshare-launch: ";
  out_queue_line(&j->own, prefix, sizeof prefix - 1, text, len);
}

static void signal_roles(job *j, int sig) {
  for (int i = 0; i < j->started; i++)
    if (!j->roles[i].ended) tshare_process_signal(j->roles[i].proc, sig);
}

/* Send sig to every role still running and arm the SIGKILL deadline. */
static void begin_teardown(job *j, int sig) {
  j->tearing_down = true;
  j->grace_deadline = now_s() + j->plan->grace_s;
  signal_roles(j, sig);
}

static void kill_stragglers(job *j) {
  for (int i = 0; i < j->started; i++)
    if (!j->roles[i].ended) {
      say(j, "%s (pid %d) still running after %.1f s; killing it", j->roles[i].label, (int)j->roles[i].pid,
          j->plan->grace_s);
      tshare_process_signal(j->roles[i].proc, SIGKILL);
    }
  j->grace_deadline = 0;
}

/* Reap roles that ended; the first failure stops the rest. Returns true when
 * every started role has ended. */
static bool reap_roles(job *j) {
  bool all_ended = true;
  for (int i = 0; i < j->started; i++) {
    role_run *r = &j->roles[i];
    if (r->ended) continue;
    if (tshare_process_wait(r->proc, 0, &r->status) != TSHARE_OK) {
      all_ended = false;
      continue;
    }
    r->ended = true;
    r->end_s = now_s();
    tshare_process_terminate(r->proc, 0, NULL); /* whatever it left in its group goes too */
    if (failed(r) && !j->tearing_down) {
      char what[160];
      describe(r, what, sizeof what);
      say(j, "%s; stopping the other roles", what);
      j->first_failure = i;
      begin_teardown(j, SIGTERM);
    }
  }
  return all_ended;
}

/* Ctrl-Z: the terminal stops only the launcher's process group, and every
 * role runs in a group of its own; so stop the roles, then the launcher as
 * SIGTSTP's default would, so the shell sees the job stopped. The roles
 * continue when the launcher does (fg, bg: SIGCONT). Time spent stopped is
 * not counted against --timeout: the roles did not run. */
static void stop_job(job *j) {
  if (j->tearing_down) {
    say(j, "got SIGTSTP while stopping the roles; finishing that first");
    return;
  }
  signal_roles(j, SIGSTOP);
  out_sink_flush(&j->sink[OUT_STDOUT], false, now_s());
  out_sink_flush(&j->sink[OUT_STDERR], false, now_s());
  double stopped_at = now_s();
  raise(SIGSTOP); /* returns once continued */
  j->stopped_s += now_s() - stopped_at;
  signal_roles(j, SIGCONT);
}

static void handle_signals(job *j) {
  unsigned char sigs[64];
  ssize_t got = read(signal_pipe[0], sigs, sizeof sigs);
  for (ssize_t k = 0; k < got; k++) {
    int sig = sigs[k];
    if (sig == SIGCHLD) continue; /* reaping happens at the top of the loop */
    if (sig == SIGTSTP) {
      stop_job(j);
      continue;
    }
    if (sig == SIGCONT) { /* also when someone continued the launcher alone */
      signal_roles(j, SIGCONT);
      continue;
    }
    if (j->interrupted) { /* a second interrupt: no more grace */
      j->grace_deadline = now_s();
      continue;
    }
    j->interrupted = sig;
    say(j, "got SIG%s; forwarding it to the roles", sigabbrev_np(sig));
    begin_teardown(j, sig);
  }
}

static void install_signal_handlers(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  sigemptyset(&sa.sa_mask);
  /* Every signal whose default would end the launcher and leave the roles
   * running (SIGKILL cannot be caught: roles die with the launcher through
   * TSHARE_SPAWN_DIE_WITH_PARENT instead). */
  const int handled[] = {SIGCHLD, SIGINT,    SIGTERM, SIGHUP,  SIGQUIT, SIGUSR1, SIGUSR2,
                         SIGALRM, SIGVTALRM, SIGPROF, SIGXCPU, SIGXFSZ, SIGPWR};
  for (size_t i = 0; i < sizeof handled / sizeof handled[0]; i++) sigaction(handled[i], &sa, NULL);
  /* Job control reaches the roles through us too (stop_job). SIGTTIN and
   * SIGTTOU keep their default: caught, they would restart the terminal
   * write that raised them over and over. */
  sigaction(SIGTSTP, &sa, NULL);
  sigaction(SIGCONT, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
}

/* One channel between the producer and each consumer: fds [0],[1] are the
 * producer's read/write ends, [2],[3] the consumer's (equal for a socket). */
static int make_channels(const launch_plan *plan, int (*chan)[4]) {
  for (int c = 0; c < plan->consumers; c++) {
    if (plan->channel == TSHARE_CHANNEL_SOCKET) {
      int sv[2];
      tshare_error err;
      if (tshare_socketpair(sv, &err) != TSHARE_OK) {
        fprintf(stderr, "tshare-launch: %s\n", err.message);
        return -1;
      }
      chan[c][0] = chan[c][1] = sv[0];
      chan[c][2] = chan[c][3] = sv[1];
    } else {
      int down[2], up[2]; /* producer -> consumer, consumer -> producer */
      if (pipe2(down, O_CLOEXEC) != 0 || pipe2(up, O_CLOEXEC) != 0) {
        perror("tshare-launch: pipe");
        return -1;
      }
      chan[c][0] = up[0];
      chan[c][1] = down[1];
      chan[c][2] = down[0];
      chan[c][3] = up[1];
    }
  }
  return 0;
}

static void close_channels(int k, int (*chan)[4]) {
  for (int c = 0; c < k; c++) {
    close(chan[c][0]);
    if (chan[c][1] != chan[c][0]) close(chan[c][1]);
    close(chan[c][2]);
    if (chan[c][3] != chan[c][2]) close(chan[c][3]);
  }
}

/* Spawn role i with stdin from /dev/null, stdout/stderr/report through pipes
 * to us, and its channel ends at fds 3 and up. */
static int start_role(job *j, int i, int (*chan)[4], int devnull) {
  const launch_plan *plan = j->plan;
  role_run *r = &j->roles[i];
  role_fds f;
  memset(&f, 0, sizeof f);
  bool producer = i == 0;
  int rank = producer ? 0 : i - 1;
  int pipes[OUT_COUNT][2];
  for (int s = 0; s < OUT_COUNT; s++) {
    if (pipe2(pipes[s], O_CLOEXEC) != 0) {
      perror("tshare-launch: pipe");
      for (int t = 0; t < s; t++) close(pipes[t][1]);
      return -1;
    }
    fcntl(pipes[s][0], F_SETFL, O_NONBLOCK);
    r->out[s].fd = pipes[s][0];
  }
  f.map[f.n++] = (tshare_fd_map){0, devnull};
  f.map[f.n++] = (tshare_fd_map){1, pipes[OUT_STDOUT][1]};
  f.map[f.n++] = (tshare_fd_map){2, pipes[OUT_STDERR][1]};
  f.next_child_fd = 3;
  bool ucx = producer && (plan->ucx_listen || plan->ucx_connect);
  if (producer)
    for (int c = 0; c < plan->consumers; c++) add_channel(&f, plan->channel, chan[c][0], chan[c][1]);
  if (ucx) add_ucx_channel(&f);
  if (!producer)
    add_channel(&f, plan->channel, chan[rank][2], chan[rank][3]);
  int report_fd = f.next_child_fd++;
  f.map[f.n++] = (tshare_fd_map){report_fd, pipes[OUT_REPORT][1]};

  char role_env[64], rank_env[64], consumers_env[64], channels_env[1100], report_env[64];
  char ids_env[sizeof f.ids_env + 32];
  snprintf(role_env, sizeof role_env, TSHARE_ENV_ROLE "=%s", producer ? "producer" : "consumer");
  snprintf(rank_env, sizeof rank_env, TSHARE_ENV_RANK "=%d", rank);
  snprintf(consumers_env, sizeof consumers_env, TSHARE_ENV_NUM_CONSUMERS "=%d", plan->consumers);
  snprintf(channels_env, sizeof channels_env, TSHARE_ENV_CHANNEL_FDS "=%s", f.channel_env);
  snprintf(ids_env, sizeof ids_env, TSHARE_ENV_CHANNEL_IDS "=%s", f.ids_env);
  snprintf(report_env, sizeof report_env, TSHARE_ENV_REPORT_FD "=%d", report_fd);
  char ucx_env[1100] = "";
  if (ucx)
    snprintf(ucx_env, sizeof ucx_env, "%s=%s", plan->ucx_listen ? TSHARE_ENV_UCX_LISTEN : TSHARE_ENV_UCX_CONNECT,
             plan->ucx_listen ? plan->ucx_listen : plan->ucx_connect);
  char *env[] = {role_env, rank_env, consumers_env, channels_env, ids_env, report_env, ucx ? ucx_env : NULL, NULL};
  char **argv = producer               ? plan->producer_argv
                : plan->consumer_argvs ? plan->consumer_argvs[rank]
                                       : plan->consumer_argv;
  tshare_spawn_options o = {.file = argv[0],
                            .argv = argv,
                            .env_set = env,
                            .fds = f.map,
                            .nfds = f.n,
                            .flags = TSHARE_SPAWN_NEW_PROCESS_GROUP | TSHARE_SPAWN_DIE_WITH_PARENT};
  tshare_error err;
  r->start_s = now_s();
  int rc = tshare_spawn(&o, &r->proc, &err);
  for (int s = 0; s < OUT_COUNT; s++) close(pipes[s][1]); /* the child has them now */
  if (rc != TSHARE_OK) {
    say(j, "cannot start %s: %s", r->label, err.message);
    r->ended = true;
    r->end_s = r->start_s;
    return -1;
  }
  r->pid = tshare_process_pid(r->proc);
  return 0;
}

/* Whether to read role i's stream now: not while its queue is half full and
 * the reader is taking output (the role waits instead; nothing is lost). */
static bool takes_output(const job *j, int i, int stream, double now) {
  const role_run *r = &j->roles[i];
  return stream == OUT_REPORT || r->log || !out_queue_half_full(&r->pending[stream]) ||
         out_sink_stalled(&j->sink[stream], now);
}

/* Output still moving to a reader that takes it: worth waiting for. */
static bool output_moving(const job *j, double now) {
  for (int s = 0; s < OUT_REPORT; s++)
    if (out_sink_pending(&j->sink[s]) && !out_sink_stalled(&j->sink[s], now)) return true;
  return false;
}

/* Wait for output, signals, room for queued output or the next deadline, and
 * handle what came. Only this poll waits: nothing else in the loop blocks. */
static void pump(job *j, double wake) {
  enum { SINKS = OUT_REPORT, FIRST_ROLE_FD = 1 + SINKS };
  struct pollfd pfds[FIRST_ROLE_FD + OUT_COUNT * (TSHARE_ROLE_CHANNELS_MAX + 1)];
  struct {
    int role, stream;
  } owner[FIRST_ROLE_FD + OUT_COUNT * (TSHARE_ROLE_CHANNELS_MAX + 1)];
  int np = 0;
  pfds[np++] = (struct pollfd){.fd = signal_pipe[0], .events = POLLIN, .revents = 0};
  for (int s = 0; s < SINKS; s++) /* -1: poll ignores it */
    pfds[np++] =
        (struct pollfd){.fd = out_sink_pending(&j->sink[s]) ? j->sink[s].fd : -1, .events = POLLOUT, .revents = 0};
  double now = now_s();
  for (int i = 0; i < j->nroles; i++)
    for (int s = 0; s < OUT_COUNT; s++)
      if (j->roles[i].out[s].fd >= 0 && takes_output(j, i, s, now)) {
        owner[np].role = i;
        owner[np].stream = s;
        pfds[np++] = (struct pollfd){.fd = j->roles[i].out[s].fd, .events = POLLIN, .revents = 0};
      }
  int wait_ms = (int)((wake - now_s()) * 1000) + 1;
  int n = poll(pfds, (nfds_t)np, wait_ms < 0 ? 0 : wait_ms);
  if (n > 0 && (pfds[0].revents & POLLIN)) handle_signals(j);
  for (int k = FIRST_ROLE_FD; n > 0 && k < np; k++)
    if (pfds[k].revents) read_output(&j->roles[owner[k].role], owner[k].stream);
  for (int s = 0; s < SINKS; s++) out_sink_flush(&j->sink[s], false, now_s());
}

static bool outputs_open(const job *j) {
  for (int i = 0; i < j->nroles; i++)
    for (int s = 0; s < OUT_COUNT; s++)
      if (j->roles[i].out[s].fd >= 0) return true;
  return false;
}

static void run_until_done(job *j) {
  double drain_deadline = 0;
  for (;;) {
    bool all_ended = reap_roles(j);
    double now = now_s();
    double timeout_at = j->plan->timeout_s > 0 ? j->t0 + j->stopped_s + j->plan->timeout_s : 0;
    if (all_ended) {
      if (!outputs_open(j)) return;
      if (output_moving(j, now))
        drain_deadline = 0; /* what is left in the roles' pipes comes after it */
      else if (drain_deadline == 0)
        drain_deadline = now + 0.5;
      else if (now >= drain_deadline)
        return; /* something outside the roles holds a pipe */
    }
    if (timeout_at > 0 && now >= timeout_at && !j->tearing_down) {
      j->timed_out = true;
      say(j, "timeout after %.1f s; stopping the roles", j->plan->timeout_s);
      begin_teardown(j, SIGTERM);
    }
    if (j->grace_deadline > 0 && now >= j->grace_deadline) kill_stragglers(j);
    double wake = now + 1.0; /* re-check exits at least once a second */
    if (timeout_at > 0 && !j->tearing_down && timeout_at < wake) wake = timeout_at;
    if (j->grace_deadline > 0 && j->grace_deadline < wake) wake = j->grace_deadline;
    if (drain_deadline > 0 && drain_deadline < wake) wake = drain_deadline;
    pump(j, wake);
  }
}

/* Print the last line and pick the exit code. */
static int report_outcome(const job *j, double wall) {
  const launch_plan *plan = j->plan;
  char what[160];
  if (j->interrupted) {
    printf("tshare-launch: STOPPED: got SIG%s after %.3f s; every role was stopped\n", sigabbrev_np(j->interrupted),
           wall);
    return 128 + j->interrupted;
  }
  if (j->not_started >= 0) {
    printf("tshare-launch: FAILED: %s could not be started; the other roles were stopped\n",
           j->roles[j->not_started].label);
    return LAUNCH_NOT_STARTED;
  }
  if (j->timed_out) {
    printf("tshare-launch: FAILED: timeout after %.1f s; every role was stopped\n", plan->timeout_s);
    return LAUNCH_TIMEOUT;
  }
  if (j->first_failure >= 0) {
    describe(&j->roles[j->first_failure], what, sizeof what);
    printf("tshare-launch: FAILED: %s; the other roles were stopped\n", what);
    return LAUNCH_ROLE_FAILED;
  }
  if (plan->expect_verified <= 0) {
    printf("tshare-launch: OK: all %d roles exited with status 0 (%.3f s)\n", j->nroles, wall);
    return LAUNCH_OK;
  }
  long long verified = 0, shared = j->roles[0].shared;
  for (int i = 1; i < j->nroles; i++) verified += j->roles[i].verified > 0 ? j->roles[i].verified : 0;
  if (verified != plan->expect_verified || shared != plan->expect_shared) {
    printf("tshare-launch: FAILED: %lld tensors shared, %lld of %d verified intact\n", shared, verified,
           plan->expect_verified);
    return LAUNCH_ROLE_FAILED;
  }
  printf("tshare-launch: OK: %lld tensors shared with %d consumer%s, %lld of %d verified intact (%.3f s)\n", shared,
         plan->consumers, plan->consumers == 1 ? "" : "s", verified, plan->expect_verified, wall);
  return LAUNCH_OK;
}

/* Our children that are not roles: descendants the roles left behind, given
 * to us as their subreaper. Up to cap pids into out; returns how many. */
static int leftover_children(const job *j, pid_t *out, int cap) {
  DIR *d = opendir("/proc");
  if (!d) return 0;
  pid_t self = getpid();
  int n = 0;
  struct dirent *e;
  while (n < cap && (e = readdir(d))) {
    char *end;
    long pid = strtol(e->d_name, &end, 10);
    if (*end || pid <= 0) continue;
    char path[64], text[512];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    FILE *f = fopen(path, "re");
    if (!f) continue;
    size_t len = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[len] = '\0';
    const char *paren = strrchr(text, ')'); /* the name may hold anything; the fields follow the last ')' */
    char state;
    long ppid;
    if (!paren || sscanf(paren + 1, " %c %ld", &state, &ppid) != 2 || ppid != self) continue;
    bool role = false;
    for (int i = 0; i < j->started && !role; i++) role = j->roles[i].pid == (pid_t)pid && !j->roles[i].ended;
    if (role) continue;
    if (state == 'Z') { /* already ended (a role's group member killed with it): only reap it */
      int st;
      waitpid((pid_t)pid, &st, WNOHANG);
      continue;
    }
    out[n++] = (pid_t)pid;
  }
  closedir(d);
  return n;
}

/* End what the roles left behind: SIGTERM, the grace period, SIGKILL, and
 * again for whatever their ends hand to us, until nothing is left. */
static void stop_leftovers(job *j) {
  pid_t pids[256];
  int stopped = 0;
  for (int round = 0; round < 50; round++) {
    int n = leftover_children(j, pids, 256);
    if (n == 0) break;
    for (int k = 0; k < n; k++) {
      char comm[64] = "?", path[64];
      snprintf(path, sizeof path, "/proc/%d/comm", (int)pids[k]);
      FILE *f = fopen(path, "re");
      if (f) {
        if (fgets(comm, sizeof comm, f)) comm[strcspn(comm, "\n")] = '\0';
        fclose(f);
      }
      if (stopped++ < 8) say(j, "stopping pid %d (%s), left behind by the roles", (int)pids[k], comm);
      kill(pids[k], round == 0 ? SIGTERM : SIGKILL);
    }
    /* Reap them; the first round gives them the grace period to exit. */
    double until = now_s() + (round == 0 ? j->plan->grace_s : 1.0);
    for (int k = 0; k < n; k++) {
      int st;
      while (waitpid(pids[k], &st, WNOHANG) == 0 && now_s() < until) usleep(5000);
    }
  }
  if (stopped > 8) say(j, "... %d processes left behind were stopped in all", stopped);
}

/* --log-dir: DIR/producer.log, DIR/consumer-N.log. */
static int open_role_log(const char *dir, role_run *r, int index) {
  char path[4096];
  if (index == 0)
    snprintf(path, sizeof path, "%s/producer.log", dir);
  else
    snprintf(path, sizeof path, "%s/consumer-%d.log", dir, index - 1);
  r->log = fopen(path, "we");
  if (!r->log) {
    fprintf(stderr, "tshare-launch: --log-dir: cannot write %s: %s\n", path, strerror(errno));
    return -1;
  }
  return 0;
}

static void write_summary_file(const char *dir, const role_run *roles, int n, double wall) {
  char path[4096];
  snprintf(path, sizeof path, "%s/summary.txt", dir);
  FILE *f = fopen(path, "we");
  if (!f) {
    fprintf(stderr, "tshare-launch: --log-dir: cannot write %s: %s\n", path, strerror(errno));
    return;
  }
  print_summary(f, roles, n, wall);
  fclose(f);
}

static void setup_output(job *j) {
  out_sink_init(&j->sink[OUT_STDOUT], STDOUT_FILENO);
  out_sink_init(&j->sink[OUT_STDERR], STDERR_FILENO);
  for (int i = 0; i < j->nroles; i++)
    for (int s = 0; s < OUT_REPORT; s++) out_sink_add(&j->sink[s], &j->roles[i].pending[s]);
  out_sink_add(&j->sink[OUT_STDERR], &j->own);
}

static void report_dropped(const out_queue *q, const char *whose, const char *stream) {
  if (q->dropped_lines)
    fprintf(stderr,
            "tshare-launch: %lld lines (%lld bytes) of %s %s were dropped: the launcher's %s was not read fast "
            "enough\n",
            q->dropped_lines, q->dropped_bytes, whose, stream, stream);
}

/* The roles are stopped: now the rest of their output may wait for the
 * reader as long as it takes. Then what a stalled reader cost, by role (not
 * when the reader closed its end: nothing would have been read anyway). */
static void finish_output(job *j) {
  static const char *const names[OUT_REPORT] = {"stdout", "stderr"};
  for (int s = 0; s < OUT_REPORT; s++) out_sink_flush(&j->sink[s], true, now_s());
  for (int i = 0; i < j->nroles; i++)
    for (int s = 0; s < OUT_REPORT; s++) {
      char whose[48];
      snprintf(whose, sizeof whose, "%s's", j->roles[i].label);
      if (!j->sink[s].gone) report_dropped(&j->roles[i].pending[s], whose, names[s]);
      out_queue_free(&j->roles[i].pending[s]);
    }
  if (!j->sink[OUT_STDERR].gone) report_dropped(&j->own, "the launcher's own", names[OUT_STDERR]);
  out_queue_free(&j->own);
  for (int s = 0; s < OUT_REPORT; s++) out_sink_close(&j->sink[s]);
}

int launch_run(const launch_plan *plan) {
  job j = {.plan = plan, .nroles = plan->consumers + 1, .t0 = now_s(), .first_failure = -1, .not_started = -1};
  j.roles = calloc((size_t)j.nroles, sizeof *j.roles);
  int(*chan)[4] = calloc((size_t)plan->consumers, sizeof *chan);
  if (!j.roles || !chan || pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    fprintf(stderr, "tshare-launch: cannot set up: %s\n", strerror(errno));
    return LAUNCH_ROLE_FAILED;
  }
  for (int i = 0; i < j.nroles; i++) {
    if (i == 0)
      snprintf(j.roles[i].label, sizeof j.roles[i].label, "producer");
    else
      snprintf(j.roles[i].label, sizeof j.roles[i].label, "consumer %d", i - 1);
    j.roles[i].shared = j.roles[i].verified = -1;
    if (plan->log_dir && open_role_log(plan->log_dir, &j.roles[i], i) != 0) return LAUNCH_ROLE_FAILED;
    j.roles[i].prefixed = !plan->no_prefix && !j.roles[i].log;
    for (int s = 0; s < OUT_COUNT; s++) j.roles[i].out[s].fd = -1;
  }
  setup_output(&j);
  install_signal_handlers();
  /* Descendants whose parent ends (a role's daemon that called setsid()) come
   * to us instead of init, so stop_leftovers() can end them. */
  if (prctl(PR_SET_CHILD_SUBREAPER, 1) != 0)
    fprintf(stderr, "tshare-launch: warning: PR_SET_CHILD_SUBREAPER: %s; processes roles leave behind may survive\n",
            strerror(errno));
  if (make_channels(plan, chan) != 0) return LAUNCH_ROLE_FAILED;
  int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (; j.started < j.nroles; j.started++)
    if (start_role(&j, j.started, chan, devnull) != 0) {
      j.not_started = j.started;
      begin_teardown(&j, SIGTERM);
      break;
    }
  /* The children hold their channel ends now; ours would only hide a peer's death. */
  close_channels(plan->consumers, chan);
  close(devnull);

  run_until_done(&j);
  double wall = now_s() - j.t0;
  stop_leftovers(&j);
  finish_output(&j);
  print_summary(stdout, j.roles, j.nroles, wall);
  if (plan->log_dir) write_summary_file(plan->log_dir, j.roles, j.nroles, wall);
  int rc = report_outcome(&j, wall);
  fflush(stdout);
  for (int i = 0; i < j.nroles; i++) {
    if (j.roles[i].log) fclose(j.roles[i].log);
    for (int s = 0; s < OUT_COUNT; s++)
      if (j.roles[i].out[s].fd >= 0) close(j.roles[i].out[s].fd);
    tshare_process_destroy(j.roles[i].proc); /* reaps; ended roles' groups were already killed */
  }
  free(j.roles);
  free(chan);
  return rc;
}
