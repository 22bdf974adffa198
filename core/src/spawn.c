#include "tshare/spawn.h"

#include "clock.h"
#include "error_detail.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;

struct tshare_process {
  pid_t pid;
  bool group;
  tshare_exit_status status;
};

/* Resolve a program the way execvp would, but tell apart "no such program"
 * from "found but not executable" so the error names the real problem. */
static int resolve_program(const char *file, char *path, size_t cap, char *msg, size_t msg_cap) {
  if (!file || !file[0]) return ts_errf(msg, msg_cap, TSHARE_E_INVALID_ARG, "spawn: empty program name");
  if (strchr(file, '/')) {
    struct stat st;
    if (stat(file, &st) != 0)
      return ts_errsys(msg, msg_cap, errno == ENOENT ? TSHARE_E_NOT_FOUND : TSHARE_E_SPAWN, errno, "spawn '%s'", file);
    if (S_ISDIR(st.st_mode)) return ts_errf(msg, msg_cap, TSHARE_E_SPAWN, "spawn '%s': is a directory", file);
    if (access(file, X_OK) != 0) return ts_errsys(msg, msg_cap, TSHARE_E_SPAWN, errno, "spawn '%s'", file);
    snprintf(path, cap, "%s", file);
    return TSHARE_OK;
  }
  const char *env_path = getenv("PATH");
  if (!env_path) env_path = "/usr/local/bin:/usr/bin:/bin";
  bool seen_not_executable = false;
  for (const char *p = env_path;;) {
    const char *end = strchr(p, ':');
    size_t n = end ? (size_t)(end - p) : strlen(p);
    int w = snprintf(path, cap, "%.*s%s%s", (int)n, p, n ? "/" : "", file);
    struct stat st;
    if (w > 0 && (size_t)w < cap && stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
      if (access(path, X_OK) == 0) return TSHARE_OK;
      seen_not_executable = true;
    }
    if (!end) break;
    p = end + 1;
  }
  if (seen_not_executable)
    return ts_errf(msg, msg_cap, TSHARE_E_SPAWN, "spawn '%s': found in PATH but not executable", file);
  return ts_errf(msg, msg_cap, TSHARE_E_NOT_FOUND, "spawn '%s': no such program in PATH (%s)", file, env_path);
}

/* The inherited environment with env_set applied (later entries win). */
static char **build_env(char *const *env_set) {
  size_t n_env = 0, n_set = 0;
  while (environ && environ[n_env]) n_env++;
  while (env_set && env_set[n_set]) n_set++;
  char **env = calloc(n_env + n_set + 1, sizeof *env);
  if (!env) return NULL;
  size_t k = 0;
  for (size_t i = 0; i < n_env; i++) {
    const char *eq = strchr(environ[i], '=');
    size_t name_len = eq ? (size_t)(eq - environ[i]) : strlen(environ[i]);
    bool replaced = false;
    for (size_t j = 0; j < n_set && !replaced; j++)
      replaced = strncmp(env_set[j], environ[i], name_len) == 0 && env_set[j][name_len] == '=';
    if (!replaced) env[k++] = environ[i];
  }
  for (size_t j = 0; j < n_set; j++) env[k++] = env_set[j];
  env[k] = NULL;
  return env;
}

/* What both ways of starting a child share: the program, its argv and env,
 * and the fds to give it (already moved above every target number). */
typedef struct spawn_plan {
  const char *path;
  char *const *argv;
  char **env;
  const tshare_spawn_options *o;
  const int *moved;
  int max_target;
} spawn_plan;

static int exec_error(int e, const char *path, char *msg, size_t cap) {
  return ts_errsys(msg, cap, e == ENOENT ? TSHARE_E_NOT_FOUND : TSHARE_E_SPAWN, e, "spawn '%s'", path);
}

/* posix_spawn: glibc reports a failed exec as its return value. */
static int spawn_posix(const spawn_plan *sp, pid_t *pid, char *msg, size_t cap) {
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  int rc = TSHARE_OK;
  for (size_t i = 0; rc == TSHARE_OK && i < sp->o->nfds; i++)
    if (posix_spawn_file_actions_adddup2(&actions, sp->moved[i], sp->o->fds[i].child_fd) != 0)
      rc = ts_errf(msg, cap, TSHARE_E_NOMEM, "spawn: file actions");
  /* Whatever else is open stays out of the child, even fds an application
   * forgot to mark close-on-exec. */
  if (rc == TSHARE_OK && posix_spawn_file_actions_addclosefrom_np(&actions, sp->max_target + 1) != 0)
    rc = ts_errf(msg, cap, TSHARE_E_NOMEM, "spawn: file actions");
  if (rc == TSHARE_OK) {
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    sigdelset(&all, SIGKILL);
    sigdelset(&all, SIGSTOP);
    short flags = POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF;
    if (sp->o->flags & TSHARE_SPAWN_NEW_PROCESS_GROUP) flags |= POSIX_SPAWN_SETPGROUP;
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setpgroup(&attr, 0);
    posix_spawnattr_setflags(&attr, flags);
    int e = posix_spawn(pid, sp->path, &actions, &attr, sp->argv, sp->env);
    if (e != 0) rc = exec_error(e, sp->path, msg, cap);
  }
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  return rc;
}

/* The child's side of spawn_forked: only async-signal-safe calls (the parent
 * may have threads). An exec failure goes back as errno through report. */
static void child_exec(const spawn_plan *sp, pid_t parent, int report) {
  if (sp->o->flags & TSHARE_SPAWN_NEW_PROCESS_GROUP) setpgid(0, 0);
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(127); /* it died before we could ask */
  struct sigaction dfl;
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; sig++)
    if (sig != SIGKILL && sig != SIGSTOP) sigaction(sig, &dfl, NULL);
  for (size_t i = 0; i < sp->o->nfds; i++)
    if (dup2(sp->moved[i], sp->o->fds[i].child_fd) < 0) goto fail;
  /* report sits above every target (F_DUPFD): close around it. */
  if (report > sp->max_target + 1) close_range((unsigned)sp->max_target + 1, (unsigned)report - 1, 0);
  close_range((unsigned)report + 1, ~0u, 0);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  execve(sp->path, sp->argv, sp->env);
fail:;
  int e = errno;
  ssize_t w = write(report, &e, sizeof e);
  (void)w;
  _exit(127);
}

/* fork + execve, for what posix_spawn cannot do between the two. */
static int spawn_forked(const spawn_plan *sp, pid_t *pid, char *msg, size_t cap) {
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) return ts_errsys(msg, cap, TSHARE_E_SYSTEM, errno, "spawn: pipe");
  int report = fcntl(pipefd[1], F_DUPFD_CLOEXEC, sp->max_target + 1);
  close(pipefd[1]);
  if (report < 0) {
    close(pipefd[0]);
    return ts_errsys(msg, cap, TSHARE_E_SYSTEM, errno, "spawn: fcntl(F_DUPFD)");
  }
  pid_t parent = getpid();
  pid_t child = fork();
  if (child == 0) child_exec(sp, parent, report);
  int fork_errno = errno;
  close(report);
  if (child < 0) {
    close(pipefd[0]);
    return ts_errsys(msg, cap, TSHARE_E_SPAWN, fork_errno, "spawn '%s': fork", sp->path);
  }
  int e = 0;
  ssize_t r;
  do r = read(pipefd[0], &e, sizeof e); /* EOF: the exec closed it */
  while (r < 0 && errno == EINTR);
  close(pipefd[0]);
  if (r == (ssize_t)sizeof e) {
    int st;
    while (waitpid(child, &st, 0) < 0 && errno == EINTR) {
    }
    return exec_error(e, sp->path, msg, cap);
  }
  *pid = child;
  return TSHARE_OK;
}

int tshare_spawn(const tshare_spawn_options *o, tshare_process **out, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX] = "";
  char path[PATH_MAX];
  if (!o || !out) return TSHARE_E_INVALID_ARG;
  *out = NULL;
  int rc = resolve_program(o->file, path, sizeof path, msg, sizeof msg);
  if (rc != TSHARE_OK) {
    ts_error_fill(err, rc, msg);
    return rc;
  }
  int max_target = 2;
  for (size_t i = 0; i < o->nfds; i++) {
    if (o->fds[i].child_fd < 0 || o->fds[i].parent_fd < 0) {
      ts_error_fill(err, TSHARE_E_INVALID_ARG, "spawn: negative fd in the fd map");
      return TSHARE_E_INVALID_ARG;
    }
    if (o->fds[i].child_fd > max_target) max_target = o->fds[i].child_fd;
  }

  tshare_process *p = calloc(1, sizeof *p);
  int *moved = calloc(o->nfds ? o->nfds : 1, sizeof *moved);
  char **env = build_env(o->env_set);
  size_t nmoved = 0;
  if (!p || !moved || !env) rc = ts_errf(msg, sizeof msg, TSHARE_E_NOMEM, "spawn: out of memory");

  /* Move every source above every target first (in this process, close-on-exec),
   * so no dup2 into place can clobber a source still to be moved. */
  for (size_t i = 0; rc == TSHARE_OK && i < o->nfds; i++, nmoved++) {
    moved[i] = fcntl(o->fds[i].parent_fd, F_DUPFD_CLOEXEC, max_target + 1);
    if (moved[i] < 0)
      rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "spawn: fcntl(F_DUPFD) of fd %d", o->fds[i].parent_fd);
  }
  if (rc == TSHARE_OK) {
    char *default_argv[] = {(char *)o->file, NULL};
    spawn_plan sp = {.path = path,
                     .argv = o->argv ? o->argv : default_argv,
                     .env = env,
                     .o = o,
                     .moved = moved,
                     .max_target = max_target};
    pid_t pid;
    rc = o->flags & TSHARE_SPAWN_DIE_WITH_PARENT ? spawn_forked(&sp, &pid, msg, sizeof msg)
                                                 : spawn_posix(&sp, &pid, msg, sizeof msg);
    if (rc == TSHARE_OK) {
      p->pid = pid;
      p->group = (o->flags & TSHARE_SPAWN_NEW_PROCESS_GROUP) != 0;
    }
  }
  for (size_t i = 0; i < nmoved; i++)
    if (moved[i] >= 0) close(moved[i]);
  free(moved);
  free(env);
  if (rc != TSHARE_OK) {
    free(p);
    ts_error_fill(err, rc, msg);
    return rc;
  }
  ts_error_fill(err, TSHARE_OK, "");
  *out = p;
  return TSHARE_OK;
}

pid_t tshare_process_pid(const tshare_process *p) { return p ? p->pid : -1; }
tshare_exit_status tshare_process_status(const tshare_process *p) {
  tshare_exit_status none = {TSHARE_EXIT_RUNNING, 0};
  return p ? p->status : none;
}

static bool reap(tshare_process *p, int flags) {
  int st;
  pid_t r;
  do r = waitpid(p->pid, &st, flags);
  while (r < 0 && errno == EINTR);
  if (r != p->pid) return false;
  if (WIFEXITED(st)) {
    p->status.kind = TSHARE_EXIT_CODE;
    p->status.value = WEXITSTATUS(st);
  } else {
    p->status.kind = TSHARE_EXIT_SIGNAL;
    p->status.value = WTERMSIG(st);
  }
  return true;
}

int tshare_process_wait(tshare_process *p, int timeout_ms, tshare_exit_status *status) {
  if (!p) return TSHARE_E_INVALID_ARG;
  if (p->status.kind == TSHARE_EXIT_RUNNING) {
    if (timeout_ms < 0) {
      if (!reap(p, 0)) return TSHARE_E_SYSTEM;
    } else {
      /* A pidfd turns the wait into a poll with a timeout; without one, poll
       * waitpid with a short, growing sleep. */
      int pidfd = (int)syscall(SYS_pidfd_open, p->pid, 0);
      int64_t deadline = ts_deadline(timeout_ms);
      long sleep_us = 200;
      while (!reap(p, WNOHANG)) {
        int left = ts_remaining(deadline);
        if (left == 0) break;
        if (pidfd >= 0) {
          struct pollfd pf = {.fd = pidfd, .events = POLLIN, .revents = 0};
          poll(&pf, 1, left);
        } else {
          struct timespec ts = {0, sleep_us * 1000};
          nanosleep(&ts, NULL);
          if (sleep_us < 20000) sleep_us *= 2;
        }
      }
      if (pidfd >= 0) close(pidfd);
      if (p->status.kind == TSHARE_EXIT_RUNNING) return TSHARE_E_TIMEOUT;
    }
  }
  if (status) *status = p->status;
  return TSHARE_OK;
}

int tshare_process_signal(tshare_process *p, int sig) {
  if (!p) return TSHARE_E_INVALID_ARG;
  if (p->status.kind != TSHARE_EXIT_RUNNING) return TSHARE_E_STATE;
  if (kill(p->group ? -p->pid : p->pid, sig) != 0 && !(p->group && kill(p->pid, sig) == 0)) return TSHARE_E_SYSTEM;
  return TSHARE_OK;
}

int tshare_process_terminate(tshare_process *p, int grace_ms, tshare_exit_status *status) {
  if (!p) return TSHARE_E_INVALID_ARG;
  if (p->status.kind == TSHARE_EXIT_RUNNING) {
    tshare_process_signal(p, SIGTERM);
    if (tshare_process_wait(p, grace_ms, NULL) == TSHARE_E_TIMEOUT) {
      tshare_process_signal(p, SIGKILL);
      tshare_process_wait(p, -1, NULL);
    }
  }
  /* The leader is gone; members of its group that outlived it go too. */
  if (p->group) kill(-p->pid, SIGKILL);
  if (status) *status = p->status;
  return TSHARE_OK;
}

void tshare_process_destroy(tshare_process *p) {
  if (!p) return;
  if (p->status.kind == TSHARE_EXIT_RUNNING) {
    kill(p->group ? -p->pid : p->pid, SIGKILL);
    kill(p->pid, SIGKILL);
    tshare_process_wait(p, -1, NULL);
  }
  free(p);
}

const char *tshare_exit_describe(tshare_exit_status s, char *buf, size_t cap) {
  if (!buf || !cap) return "";
  switch (s.kind) {
  case TSHARE_EXIT_CODE:
    snprintf(buf, cap, "exited with status %d", s.value);
    break;
  case TSHARE_EXIT_SIGNAL: {
    const char *abbrev = sigabbrev_np(s.value);
    snprintf(buf, cap, "killed by signal %d (SIG%s)", s.value, abbrev ? abbrev : "?");
    break;
  }
  default:
    snprintf(buf, cap, "running");
  }
  return buf;
}
