/* tshare/spawn.h - start, wait for and tear down role processes.
 *
 * Built on posix_spawn (fork + execve for TSHARE_SPAWN_DIE_WITH_PARENT). The child gets exactly the fds named in the
 * options, dup2'd to the numbers asked for (stdio included); every other fd is closed in the child, whatever its
 * close-on-exec flag. Signal dispositions and the signal mask are reset to defaults in the child.
 *
 * A program that cannot be executed (missing, not executable, bad format)
 * fails tshare_spawn() with TSHARE_E_SPAWN or TSHARE_E_NOT_FOUND and the path
 * in the detail; there is never an exit status 127 to interpret.
 *
 * A process handle must be waited for or destroyed: destroy kills and reaps a
 * child still running, so no zombie is left behind.
 */
#ifndef TSHARE_SPAWN_H
#define TSHARE_SPAWN_H

#include "tshare/errors.h"

#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tshare_process tshare_process;

typedef struct tshare_fd_map {
  int child_fd;  /* the number the child sees, >= 0 */
  int parent_fd; /* the fd in this process to give it; stays open here */
} tshare_fd_map;

/* Flags for tshare_spawn_options.flags. */
#define TSHARE_SPAWN_NEW_PROCESS_GROUP (1u << 0) /* the child leads a new process group; signals go to the group */
/* The child gets SIGKILL when this process dies, even by SIGKILL
 * (PR_SET_PDEATHSIG; Linux ties it to the thread that spawned, so spawn from
 * a thread that lives as long as the child should). Set between fork and
 * exec, so this flag spawns with fork + execve instead of posix_spawn; exec
 * failures still come back as tshare_spawn()'s error. Its own children are
 * not covered: see PR_SET_CHILD_SUBREAPER. */
#define TSHARE_SPAWN_DIE_WITH_PARENT (1u << 1)

typedef struct tshare_spawn_options {
  const char *file;  /* a path, or a name looked up in PATH when it has no '/' */
  char *const *argv; /* NULL-terminated; NULL means { file, NULL } */
  char *const
      *env_set; /* NULL-terminated "NAME=VALUE" entries added to or replacing the inherited environment; may be NULL */
  const tshare_fd_map *fds; /* fds the child gets; 0, 1, 2 are inherited unless mapped here */
  size_t nfds;
  unsigned flags; /* TSHARE_SPAWN_* */
} tshare_spawn_options;

typedef enum tshare_exit_kind {
  TSHARE_EXIT_RUNNING = 0, /* not ended (yet) */
  TSHARE_EXIT_CODE = 1,    /* exited; value is the exit code */
  TSHARE_EXIT_SIGNAL = 2   /* killed; value is the signal number */
} tshare_exit_kind;

typedef struct tshare_exit_status {
  tshare_exit_kind kind;
  int value;
} tshare_exit_status;

/* Start a process. On failure *out is NULL and err (optional) names the path and cause. */
TSHARE_API int tshare_spawn(const tshare_spawn_options *opts, tshare_process **out, tshare_error *err);

TSHARE_API pid_t tshare_process_pid(const tshare_process *p);

/* Wait up to timeout_ms (< 0 forever, 0 poll) for the process to end.
 * TSHARE_OK: *status holds how it ended (the process is reaped).
 * TSHARE_E_TIMEOUT: still running. */
TSHARE_API int tshare_process_wait(tshare_process *p, int timeout_ms, tshare_exit_status *status);

/* Send sig to the process (to its group with TSHARE_SPAWN_NEW_PROCESS_GROUP). */
TSHARE_API int tshare_process_signal(tshare_process *p, int sig);

/* SIGTERM, wait up to grace_ms, then SIGKILL; always reaps. With a process
 * group, whatever is left of the group is killed too. */
TSHARE_API int tshare_process_terminate(tshare_process *p, int grace_ms, tshare_exit_status *status);

/* How the process ended so far (TSHARE_EXIT_RUNNING until waited for). */
TSHARE_API tshare_exit_status tshare_process_status(const tshare_process *p);

/* Kill (SIGKILL) and reap if still running, then free. NULL is a no-op. */
TSHARE_API void tshare_process_destroy(tshare_process *p);

/* "exited with status 3", "killed by signal 9 (SIGKILL)", "running". Returns buf. */
TSHARE_API const char *tshare_exit_describe(tshare_exit_status status, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* TSHARE_SPAWN_H */
