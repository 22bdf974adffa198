/* Helpers for tests that need a real second process. */
#ifndef TSHARE_TEST_PROC_UTIL_H
#define TSHARE_TEST_PROC_UTIL_H

#include "harness.h"
#include "tshare/channel.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <stdbool.h>
#include <errno.h>
#include <signal.h>
#include <sys/wait.h>

/* A channel on one end of a connected socket, named name; cb (optional) gets
 * the releases of what this end shares. */
static inline tshare_channel *open_channel_over(int fd, const char *name, tshare_release_cb cb, void *cb_user,
                                                int transport) {
  tshare_channel_options o;
  tshare_channel_options_init(&o);
  o.name = name;
  o.transport = transport;
  o.on_release = cb;
  o.cb_user = cb_user;
  tshare_channel *ch = NULL;
  tshare_error err;
  CHECK_RC(tshare_channel_open_socket(fd, &o, &ch, &err), TSHARE_OK, err.message);
  return ch;
}

static inline tshare_channel *open_socket_channel(int fd, const char *name, tshare_release_cb cb, void *cb_user) {
  return open_channel_over(fd, name, cb, cb_user, TSHARE_TRANSPORT_DEFAULT);
}

/* For a test that writes frames straight to the socket, as a hand-rolled
 * peer would: the ring transport takes frames only in its ring's order. */
static inline tshare_channel *open_socket_only_channel(int fd, const char *name) {
  return open_channel_over(fd, name, NULL, NULL, TSHARE_TRANSPORT_SOCKET);
}

/* Fork; the child runs fn(arg) and exits 0 (a failed CHECK exits 1). */
static inline pid_t fork_child(void (*fn)(int), int arg) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    alarm(20); /* a child must never outlive the test */
    fn(arg);
    fflush(stdout);
    _exit(0);
  }
  return pid;
}

/* A socketpair with fn(fd) running in a forked child on one end; the other
 * end comes back in *parent_fd. */
static inline pid_t fork_with_socket(void (*fn)(int), int *parent_fd) {
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
  pid_t pid = fork_child(fn, sv[1]);
  close(sv[1]);
  *parent_fd = sv[0];
  return pid;
}

/* Two pipes between parent and a forked child running fn(0). The child takes
 * its ends with child_pipe_ends(); the parent gets its read and write ends. */
static int ts_pipe_fds[4]; /* parent->child [0,1], child->parent [2,3] */

static inline void child_pipe_ends(int *read_fd, int *write_fd) {
  close(ts_pipe_fds[1]);
  close(ts_pipe_fds[2]);
  *read_fd = ts_pipe_fds[0];
  *write_fd = ts_pipe_fds[3];
}

static inline pid_t fork_with_pipes(void (*fn)(int), int *read_fd, int *write_fd) {
  CHECK(pipe2(ts_pipe_fds, O_CLOEXEC) == 0 && pipe2(ts_pipe_fds + 2, O_CLOEXEC) == 0);
  pid_t pid = fork_child(fn, 0);
  close(ts_pipe_fds[0]);
  close(ts_pipe_fds[3]);
  *read_fd = ts_pipe_fds[2];
  *write_fd = ts_pipe_fds[1];
  return pid;
}

static inline int wait_child(pid_t pid) {
  int st = 0;
  pid_t r;
  do r = waitpid(pid, &st, 0);
  while (r < 0 && errno == EINTR);
  CHECK(r == pid);
  return st;
}

#define CHECK_CHILD_OK(pid)                                                                                            \
  do {                                                                                                                 \
    int st_ = wait_child(pid);                                                                                         \
    if (!WIFEXITED(st_) || WEXITSTATUS(st_) != 0) TS_FAIL("child %d ended with status 0x%x", (int)(pid), st_);         \
  } while (0)

static inline int count_open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  CHECK(d);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the directory's own fd */
}

/* Lines of /proc/self/maps that mention needle. */
static inline int count_mappings(const char *needle) {
  FILE *f = fopen("/proc/self/maps", "r");
  CHECK(f);
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, f))
    if (strstr(line, needle)) n++;
  fclose(f);
  return n;
}

/* Dead: no such process, or a zombie (an orphan's zombie waits for a PID 1
 * that may never reap it; it runs nothing and holds nothing but its pid). */
static inline bool pid_gone(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  char path[64], stat_text[256] = {0};
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return true;
  size_t n = fread(stat_text, 1, sizeof stat_text - 1, f);
  fclose(f);
  const char *close_paren = n ? strrchr(stat_text, ')') : NULL;
  return close_paren && close_paren[1] == ' ' && close_paren[2] == 'Z';
}

#endif
