#include "supervisor.h"

#include "tshare/role.h"
#include "tshare/spawn.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LINE_MAX_BYTES 4096

typedef struct line_buf {
  int fd;         /* -1 once at EOF */
  size_t len;
  char data[LINE_MAX_BYTES];
} line_buf;

enum { OUT_STDOUT, OUT_STDERR, OUT_REPORT, OUT_COUNT };

typedef struct role_run {
  char label[32];  /* "producer", "consumer 2" */
  tshare_process *proc;
  pid_t pid;
  line_buf out[OUT_COUNT];
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

static void emit_line(const role_run *r, int stream, const char *text, size_t n) {
  FILE *to = stream == OUT_STDERR ? stderr : stdout;
  fprintf(to, "[%s pid %d] %.*s\n", r->label, (int)r->pid, (int)n, text);
  fflush(to);
}

static void handle_report(role_run *r, const char *text, size_t n) {
  char line[128];
  snprintf(line, sizeof line, "%.*s", (int)(n < sizeof line ? n : sizeof line - 1), text);
  long long v;
  if (sscanf(line, "shared=%lld", &v) == 1) r->shared = v;
  else if (sscanf(line, "verified=%lld", &v) == 1) r->verified = v;
}

static void take_lines(role_run *r, int stream, bool at_eof) {
  line_buf *b = &r->out[stream];
  size_t start = 0;
  for (size_t i = 0; i < b->len; i++) {
    if (b->data[i] != '\n') continue;
    if (stream == OUT_REPORT) handle_report(r, b->data + start, i - start);
    else emit_line(r, stream, b->data + start, i - start);
    start = i + 1;
  }
  /* A line longer than the buffer, or the last line without '\n', goes as is. */
  if ((start == 0 && b->len == sizeof b->data) || (at_eof && start < b->len)) {
    if (stream == OUT_REPORT) handle_report(r, b->data + start, b->len - start);
    else emit_line(r, stream, b->data + start, b->len - start);
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

/* Channel ends for one role: the fds to give it and the text for TSHARE_CHANNEL_FDS. */
typedef struct role_fds {
  tshare_fd_map map[3 + 2 * TSHARE_ROLE_CHANNELS_MAX + 1];
  size_t n;
  char channel_env[1024];
  char report_env[64];
  int next_child_fd;
} role_fds;

static void add_channel(role_fds *f, tshare_channel_kind kind, int rfd, int wfd) {
  size_t used = strlen(f->channel_env);
  const char *sep = used ? "," : "";
  if (kind == TSHARE_CHANNEL_SOCKET) {
    f->map[f->n++] = (tshare_fd_map){f->next_child_fd, rfd};
    snprintf(f->channel_env + used, sizeof f->channel_env - used, "%s%d", sep, f->next_child_fd);
    f->next_child_fd++;
  } else {
    f->map[f->n++] = (tshare_fd_map){f->next_child_fd, rfd};
    f->map[f->n++] = (tshare_fd_map){f->next_child_fd + 1, wfd};
    snprintf(f->channel_env + used, sizeof f->channel_env - used, "%s%d:%d", sep, f->next_child_fd,
             f->next_child_fd + 1);
    f->next_child_fd += 2;
  }
}

static void describe(const role_run *r, char *buf, size_t cap) {
  char how[64];
  snprintf(buf, cap, "%s (pid %d) %s", r->label, (int)r->pid, tshare_exit_describe(r->status, how, sizeof how));
}

static bool failed(const role_run *r) {
  return r->ended && !(r->status.kind == TSHARE_EXIT_CODE && r->status.value == 0);
}

static void print_summary(const role_run *roles, int n, double wall_s) {
  printf("\n%-12s %8s  %-34s %7s %9s %9s\n", "role", "pid", "status", "shared", "verified", "wall");
  for (int i = 0; i < n; i++) {
    const role_run *r = &roles[i];
    char how[64], shared[24] = "-", verified[24] = "-", pid[16] = "-";
    if (r->proc) snprintf(pid, sizeof pid, "%d", (int)r->pid);
    if (r->shared >= 0) snprintf(shared, sizeof shared, "%lld", r->shared);
    if (r->verified >= 0) snprintf(verified, sizeof verified, "%lld", r->verified);
    printf("%-12s %8s  %-34s %7s %9s %7.3f s\n", r->label, pid,
           r->proc ? tshare_exit_describe(r->status, how, sizeof how) : "not started", shared, verified,
           (r->ended ? r->end_s : r->start_s + wall_s) - r->start_s);
  }
  fflush(stdout);
}

int launch_run(const launch_plan *plan) {
  int k = plan->consumers, nroles = k + 1, rc = LAUNCH_OK;
  double t0 = now_s();
  role_run *roles = calloc((size_t)nroles, sizeof *roles);
  role_fds *fds = calloc((size_t)nroles, sizeof *fds);
  int (*chan)[4] = calloc((size_t)k, sizeof *chan); /* per consumer: producer end r/w, consumer end r/w */
  if (!roles || !fds || !chan) {
    fprintf(stderr, "tshare-launch: out of memory\n");
    return LAUNCH_ROLE_FAILED;
  }
  if (pipe2(signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    perror("tshare-launch: pipe");
    return LAUNCH_ROLE_FAILED;
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
  sigemptyset(&sa.sa_mask);
  int forwarded[] = {SIGINT, SIGTERM, SIGHUP};
  sigaction(SIGCHLD, &sa, NULL);
  for (size_t i = 0; i < sizeof forwarded / sizeof forwarded[0]; i++) sigaction(forwarded[i], &sa, NULL);
  signal(SIGPIPE, SIG_IGN);

  /* Channels: one between the producer and each consumer. */
  for (int c = 0; c < k; c++) {
    if (plan->channel == TSHARE_CHANNEL_SOCKET) {
      int sv[2];
      tshare_error err;
      if (tshare_socketpair(sv, &err) != TSHARE_OK) {
        fprintf(stderr, "tshare-launch: %s\n", err.message);
        return LAUNCH_ROLE_FAILED;
      }
      chan[c][0] = chan[c][1] = sv[0];
      chan[c][2] = chan[c][3] = sv[1];
    } else {
      int down[2], up[2]; /* producer -> consumer, consumer -> producer */
      if (pipe2(down, O_CLOEXEC) != 0 || pipe2(up, O_CLOEXEC) != 0) {
        perror("tshare-launch: pipe");
        return LAUNCH_ROLE_FAILED;
      }
      chan[c][0] = up[0];
      chan[c][1] = down[1];
      chan[c][2] = down[0];
      chan[c][3] = up[1];
    }
  }

  int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
  char num_consumers[32];
  snprintf(num_consumers, sizeof num_consumers, TSHARE_ENV_NUM_CONSUMERS "=%d", k);
  int not_started = -1;
  for (int i = 0; i < nroles; i++) {
    role_run *r = &roles[i];
    role_fds *f = &fds[i];
    bool producer = i == 0;
    int rank = producer ? 0 : i - 1;
    if (producer) snprintf(r->label, sizeof r->label, "producer");
    else snprintf(r->label, sizeof r->label, "consumer %d", rank);
    r->shared = r->verified = -1;
    int pipes[OUT_COUNT][2];
    for (int s = 0; s < OUT_COUNT; s++) {
      if (pipe2(pipes[s], O_CLOEXEC) != 0) {
        perror("tshare-launch: pipe");
        return LAUNCH_ROLE_FAILED;
      }
      fcntl(pipes[s][0], F_SETFL, O_NONBLOCK);
      r->out[s].fd = pipes[s][0];
    }
    f->map[f->n++] = (tshare_fd_map){0, devnull};
    f->map[f->n++] = (tshare_fd_map){1, pipes[OUT_STDOUT][1]};
    f->map[f->n++] = (tshare_fd_map){2, pipes[OUT_STDERR][1]};
    f->next_child_fd = 3;
    if (producer)
      for (int c = 0; c < k; c++) add_channel(f, plan->channel, chan[c][0], chan[c][1]);
    else
      add_channel(f, plan->channel, chan[rank][2], chan[rank][3]);
    int report_fd = f->next_child_fd++;
    f->map[f->n++] = (tshare_fd_map){report_fd, pipes[OUT_REPORT][1]};
    char role_env[64], rank_env[64], channels_env[1100];
    snprintf(role_env, sizeof role_env, TSHARE_ENV_ROLE "=%s", producer ? "producer" : "consumer");
    snprintf(rank_env, sizeof rank_env, TSHARE_ENV_RANK "=%d", rank);
    snprintf(channels_env, sizeof channels_env, TSHARE_ENV_CHANNEL_FDS "=%s", f->channel_env);
    snprintf(f->report_env, sizeof f->report_env, TSHARE_ENV_REPORT_FD "=%d", report_fd);
    char *env[] = {role_env, rank_env, num_consumers, channels_env, f->report_env, NULL};
    char **argv = producer ? plan->producer_argv : plan->consumer_argv;
    tshare_spawn_options o = {.file = argv[0], .argv = argv, .env_set = env, .fds = f->map, .nfds = f->n,
                              .flags = TSHARE_SPAWN_NEW_PROCESS_GROUP};
    tshare_error err;
    r->start_s = now_s();
    int src = tshare_spawn(&o, &r->proc, &err);
    for (int s = 0; s < OUT_COUNT; s++) close(pipes[s][1]);
    if (src != TSHARE_OK) {
      fprintf(stderr, "tshare-launch: cannot start %s: %s\n", r->label, err.message);
      not_started = i;
      r->ended = true;
      r->end_s = r->start_s;
      break;
    }
    r->pid = tshare_process_pid(r->proc);
  }
  /* The children hold their channel ends now; ours would only hide a peer's death. */
  for (int c = 0; c < k; c++) {
    close(chan[c][0]);
    if (chan[c][1] != chan[c][0]) close(chan[c][1]);
    close(chan[c][2]);
    if (chan[c][3] != chan[c][2]) close(chan[c][3]);
  }
  close(devnull);

  bool tearing_down = false;
  int interrupted = 0, first_failure = -1;
  bool timed_out = false;
  double grace_deadline = 0, drain_deadline = 0;
  double timeout_at = plan->timeout_s > 0 ? t0 + plan->timeout_s : 0;

  if (not_started >= 0) {
    tearing_down = true;
    grace_deadline = now_s() + plan->grace_s;
    for (int i = 0; i < not_started; i++) tshare_process_signal(roles[i].proc, SIGTERM);
  }

  for (;;) {
    /* Reap whoever ended; the first failure stops the rest. */
    bool all_ended = true;
    for (int i = 0; i < nroles; i++) {
      role_run *r = &roles[i];
      if (r->ended) continue;
      if (!r->proc || tshare_process_wait(r->proc, 0, &r->status) != TSHARE_OK) {
        all_ended = all_ended && !r->proc;
        continue;
      }
      r->ended = true;
      r->end_s = now_s();
      tshare_process_terminate(r->proc, 0, NULL); /* whatever it left in its group goes too */
      if (failed(r) && !tearing_down) {
        char what[160];
        describe(r, what, sizeof what);
        first_failure = i;
        fprintf(stderr, "tshare-launch: %s; stopping the other roles\n", what);
        tearing_down = true;
        grace_deadline = now_s() + plan->grace_s;
        for (int j = 0; j < nroles; j++)
          if (!roles[j].ended && roles[j].proc) tshare_process_signal(roles[j].proc, SIGTERM);
      }
    }
    bool outputs_open = false;
    for (int i = 0; i < nroles; i++)
      for (int s = 0; s < OUT_COUNT; s++) outputs_open = outputs_open || roles[i].out[s].fd >= 0;
    double now = now_s();
    if (all_ended) {
      if (!outputs_open) break;
      if (drain_deadline == 0) drain_deadline = now + 0.5;
      else if (now >= drain_deadline) break; /* something outside the roles holds a pipe */
    }
    if (timeout_at > 0 && now >= timeout_at && !tearing_down) {
      timed_out = true;
      fprintf(stderr, "tshare-launch: timeout after %.1f s; stopping the roles\n", plan->timeout_s);
      tearing_down = true;
      grace_deadline = now + plan->grace_s;
      for (int j = 0; j < nroles; j++)
        if (!roles[j].ended && roles[j].proc) tshare_process_signal(roles[j].proc, SIGTERM);
    }
    if (tearing_down && grace_deadline > 0 && now >= grace_deadline) {
      for (int j = 0; j < nroles; j++)
        if (!roles[j].ended && roles[j].proc) {
          fprintf(stderr, "tshare-launch: %s (pid %d) still running after %.1f s; killing it\n", roles[j].label,
                  (int)roles[j].pid, plan->grace_s);
          tshare_process_signal(roles[j].proc, SIGKILL);
        }
      grace_deadline = 0;
    }

    struct pollfd pfds[1 + 3 * (TSHARE_ROLE_CHANNELS_MAX + 1)];
    struct { int role, stream; } owner[1 + 3 * (TSHARE_ROLE_CHANNELS_MAX + 1)];
    int np = 0;
    pfds[np++] = (struct pollfd){.fd = signal_pipe[0], .events = POLLIN, .revents = 0};
    for (int i = 0; i < nroles; i++)
      for (int s = 0; s < OUT_COUNT; s++)
        if (roles[i].out[s].fd >= 0) {
          owner[np].role = i;
          owner[np].stream = s;
          pfds[np++] = (struct pollfd){.fd = roles[i].out[s].fd, .events = POLLIN, .revents = 0};
        }
    double wake = now + 1.0; /* re-check exits at least once a second */
    if (timeout_at > 0 && !tearing_down && timeout_at < wake) wake = timeout_at;
    if (grace_deadline > 0 && grace_deadline < wake) wake = grace_deadline;
    if (drain_deadline > 0 && drain_deadline < wake) wake = drain_deadline;
    int wait_ms = (int)((wake - now) * 1000) + 1;
    int n = poll(pfds, (nfds_t)np, wait_ms < 0 ? 0 : wait_ms);
    if (n < 0 && errno != EINTR) {
      perror("tshare-launch: poll");
      break;
    }
    if (n <= 0) continue;
    if (pfds[0].revents & POLLIN) {
      unsigned char sigs[64];
      ssize_t got = read(signal_pipe[0], sigs, sizeof sigs);
      for (ssize_t j = 0; j < got; j++) {
        int sig = sigs[j];
        if (sig == SIGCHLD) continue; /* reaping happens at the top of the loop */
        if (interrupted) { /* a second interrupt: no more grace */
          for (int i = 0; i < nroles; i++)
            if (!roles[i].ended && roles[i].proc) tshare_process_signal(roles[i].proc, SIGKILL);
          continue;
        }
        interrupted = sig;
        fprintf(stderr, "tshare-launch: got SIG%s; forwarding it to the roles\n", sigabbrev_np(sig));
        tearing_down = true;
        grace_deadline = now_s() + plan->grace_s;
        for (int i = 0; i < nroles; i++)
          if (!roles[i].ended && roles[i].proc) tshare_process_signal(roles[i].proc, sig);
      }
    }
    for (int j = 1; j < np; j++)
      if (pfds[j].revents) read_output(&roles[owner[j].role], owner[j].stream);
  }
  double wall = now_s() - t0;

  print_summary(roles, not_started >= 0 ? not_started + 1 : nroles, wall);
  char what[160];
  if (interrupted) {
    printf("tshare-launch: STOPPED: got SIG%s after %.3f s; every role was stopped\n", sigabbrev_np(interrupted), wall);
    rc = 128 + interrupted;
  } else if (not_started >= 0) {
    printf("tshare-launch: FAILED: %s could not be started; the other roles were stopped\n", roles[not_started].label);
    rc = LAUNCH_NOT_STARTED;
  } else if (timed_out) {
    printf("tshare-launch: FAILED: timeout after %.1f s; every role was stopped\n", plan->timeout_s);
    rc = LAUNCH_TIMEOUT;
  } else if (first_failure >= 0) {
    describe(&roles[first_failure], what, sizeof what);
    printf("tshare-launch: FAILED: %s; the other roles were stopped\n", what);
    rc = LAUNCH_ROLE_FAILED;
  } else {
    long long verified = 0;
    for (int i = 1; i < nroles; i++) verified += roles[i].verified > 0 ? roles[i].verified : 0;
    if (plan->expect_verified > 0 && (verified != plan->expect_verified || roles[0].shared != plan->expect_shared)) {
      printf("tshare-launch: FAILED: %lld tensors shared, %lld of %d verified intact\n", roles[0].shared, verified,
             plan->expect_verified);
      rc = LAUNCH_ROLE_FAILED;
    } else if (plan->expect_verified > 0) {
      printf("tshare-launch: OK: %lld tensors shared with %d consumer%s, %lld of %d verified intact (%.3f s)\n",
             roles[0].shared, k, k == 1 ? "" : "s", verified, plan->expect_verified, wall);
    } else {
      printf("tshare-launch: OK: all %d roles exited with status 0 (%.3f s)\n", nroles, wall);
    }
  }
  fflush(stdout);
  for (int i = 0; i < nroles; i++) {
    for (int s = 0; s < OUT_COUNT; s++)
      if (roles[i].out[s].fd >= 0) close(roles[i].out[s].fd);
    tshare_process_terminate(roles[i].proc, 0, NULL);
    tshare_process_destroy(roles[i].proc);
  }
  free(roles);
  free(fds);
  free(chan);
  return rc;
}
