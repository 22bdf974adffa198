/* spawn: exit codes, signals, missing binaries, fd mapping, teardown, and no
 * process left behind. Programs run through /bin/sh so the tests need nothing
 * but a POSIX shell. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/spawn.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>

static tshare_process *run_sh(const char *script, const tshare_fd_map *fds, size_t nfds, unsigned flags) {
  char *argv[] = {"sh", "-c", (char *)script, NULL};
  tshare_spawn_options o = {.file = "sh", .argv = argv, .fds = fds, .nfds = nfds, .flags = flags};
  tshare_process *p = NULL;
  tshare_error err;
  CHECK_RC(tshare_spawn(&o, &p, &err), TSHARE_OK, err.message);
  return p;
}

/* Run as a child: write to both mapped fds, then list every open fd. */
static int fd_census(int argc, char **argv) {
  if (argc < 3 || strcmp(argv[2], "fd-census") != 0) return 2;
  char line[256] = "fds:";
  for (int fd = 0; fd < 1024; fd++)
    if (fcntl(fd, F_GETFD) >= 0) snprintf(line + strlen(line), sizeof line - strlen(line), " %d", fd);
  dprintf(3, "to-b\n");
  dprintf(4, "to-a\n");
  dprintf(3, "%s\n", line);
  return 0;
}

__attribute__((constructor)) static void install_census(void) { ts_role_main = fd_census; }

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

TS_TEST(exit_code_comes_back) {
  tshare_process *p = run_sh("exit 3", NULL, 0, 0);
  tshare_exit_status st;
  CHECK_RC(tshare_process_wait(p, 5000, &st), TSHARE_OK, "");
  CHECK_EQ(st.kind, TSHARE_EXIT_CODE);
  CHECK_EQ(st.value, 3);
  char text[64];
  CHECK(strcmp(tshare_exit_describe(st, text, sizeof text), "exited with status 3") == 0);
  pid_t pid = tshare_process_pid(p);
  tshare_process_destroy(p);
  CHECK(waitpid(pid, NULL, WNOHANG) < 0 && errno == ECHILD); /* reaped: no zombie */
}

TS_TEST(killed_by_signal_is_reported) {
  tshare_process *p = run_sh("kill -9 $$", NULL, 0, 0);
  tshare_exit_status st;
  CHECK_RC(tshare_process_wait(p, 5000, &st), TSHARE_OK, "");
  CHECK_EQ(st.kind, TSHARE_EXIT_SIGNAL);
  CHECK_EQ(st.value, SIGKILL);
  char text[64];
  CHECK(strcmp(tshare_exit_describe(st, text, sizeof text), "killed by signal 9 (SIGKILL)") == 0);
  tshare_process_destroy(p);
}

TS_TEST(missing_binary_is_an_error_with_its_path) {
  tshare_spawn_options o = {.file = "/nonexistent/dir/tool"};
  tshare_process *p = (tshare_process *)1;
  tshare_error err;
  CHECK_RC(tshare_spawn(&o, &p, &err), TSHARE_E_NOT_FOUND, err.message);
  CHECK(p == NULL);
  CHECK(strstr(err.message, "/nonexistent/dir/tool") != NULL);
  o.file = "tshare-no-such-program";
  CHECK_RC(tshare_spawn(&o, &p, &err), TSHARE_E_NOT_FOUND, err.message);
  CHECK(strstr(err.message, "tshare-no-such-program") != NULL);
  CHECK(strstr(err.message, "PATH") != NULL);
}

TS_TEST(non_executable_file_is_refused) {
  char path[] = "/tmp/tshare-noexec-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  CHECK_EQ(write(fd, "#!/bin/sh\nexit 0\n", 17), 17);
  close(fd);
  chmod(path, 0644);
  tshare_spawn_options o = {.file = path};
  tshare_process *p;
  tshare_error err;
  CHECK_RC(tshare_spawn(&o, &p, &err), TSHARE_E_SPAWN, err.message);
  CHECK(strstr(err.message, path) != NULL);
  /* A file the kernel cannot execute at all (no #!, not ELF) fails in exec:
   * that error comes back too, not as an exit status 127. */
  fd = open(path, O_WRONLY | O_TRUNC);
  CHECK_EQ(write(fd, "\x01\x02garbage", 9), 9);
  close(fd);
  chmod(path, 0755);
  int rc = tshare_spawn(&o, &p, &err);
  CHECK_RC(rc, TSHARE_E_SPAWN, err.message);
  CHECK(strstr(err.message, "Exec format error") != NULL);
  unlink(path);
}

static void fds_land(unsigned flags);

TS_TEST(fds_land_at_their_numbers_and_nothing_else_leaks) { fds_land(0); }

/* The fork + execve path keeps every promise posix_spawn keeps. */
TS_TEST(die_with_parent_spawns_like_posix_spawn) {
  fds_land(TSHARE_SPAWN_DIE_WITH_PARENT);
  tshare_spawn_options o = {.file = "/nonexistent/dir/tool", .flags = TSHARE_SPAWN_DIE_WITH_PARENT};
  tshare_process *p;
  tshare_error err;
  CHECK_RC(tshare_spawn(&o, &p, &err), TSHARE_E_NOT_FOUND, err.message);
  /* An exec failure after the fork comes back through the pipe as an error. */
  char path[] = "/tmp/tshare-noexec-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0 && write(fd, "\x01\x02garbage", 9) == 9);
  close(fd);
  chmod(path, 0755);
  o.file = path;
  CHECK_RC(tshare_spawn(&o, &p, &err), TSHARE_E_SPAWN, err.message);
  CHECK(strstr(err.message, "Exec format error") != NULL);
  unlink(path);
  p = run_sh("exit 5", NULL, 0, TSHARE_SPAWN_DIE_WITH_PARENT | TSHARE_SPAWN_NEW_PROCESS_GROUP);
  tshare_exit_status st;
  CHECK_RC(tshare_process_wait(p, 5000, &st), TSHARE_OK, "");
  CHECK_EQ(st.value, 5);
  tshare_process_destroy(p);
}

static int spawned_pid[2]; /* a pipe: the middle process writes the pid it spawned */
static unsigned middle_flags;

static void middle_spawns_and_waits(int unused) {
  (void)unused;
  tshare_process *p = run_sh("exec sleep 30", NULL, 0, middle_flags);
  pid_t pid = tshare_process_pid(p);
  CHECK(write(spawned_pid[1], &pid, sizeof pid) == sizeof pid);
  pause();
}

/* Its parent SIGKILLed: the child goes too with the flag, stays without. */
TS_TEST(die_with_parent_child_dies_with_its_parent) {
  for (int with = 1; with >= 0; with--) {
    middle_flags = with ? TSHARE_SPAWN_DIE_WITH_PARENT : 0;
    CHECK(pipe2(spawned_pid, O_CLOEXEC) == 0);
    pid_t middle = fork_child(middle_spawns_and_waits, 0);
    pid_t child;
    CHECK(read(spawned_pid[0], &child, sizeof child) == sizeof child);
    kill(middle, SIGKILL);
    wait_child(middle);
    for (int i = 0; i < 200 && !pid_gone(child); i++) usleep(10000);
    printf("%s the flag: the child %s\n", with ? "with" : "without", pid_gone(child) ? "died" : "lives on");
    CHECK(pid_gone(child) == (with == 1));
    if (!with) kill(child, SIGKILL);
    close(spawned_pid[0]);
    close(spawned_pid[1]);
  }
}

static void fds_land(unsigned flags) {
  /* Adversarial: the parent's fds 3 and 4 go to the child's 4 and 3. A
   * naive dup2(4 -> 3) would destroy the source of the second mapping. */
  int a[2], b[2];
  CHECK(pipe2(a, O_CLOEXEC) == 0 && pipe2(b, O_CLOEXEC) == 0);
  int ends[4];
  for (int i = 0; i < 4; i++) ends[i] = fcntl(i < 2 ? a[i] : b[i - 2], F_DUPFD_CLOEXEC, 60);
  close(a[0]), close(a[1]), close(b[0]), close(b[1]);
  a[0] = ends[0], b[0] = ends[2];
  CHECK(dup3(ends[1], 3, O_CLOEXEC) == 3 && dup3(ends[3], 4, O_CLOEXEC) == 4);
  close(ends[1]), close(ends[3]);
  a[1] = 3, b[1] = 4;
  int leaked = open("/dev/null", O_RDONLY); /* no O_CLOEXEC: must still not reach the child */
  CHECK(leaked >= 0);
  /* child 3 <- parent 4 (b), child 4 <- parent 3 (a). The child is this
   * binary (fd_census below): a shell keeps fds of its own and cannot count. */
  tshare_fd_map map[] = {{3, 4}, {4, 3}};
  char self[4096];
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  CHECK(len > 0);
  self[len] = '\0';
  char *argv[] = {self, "--role", "fd-census", NULL};
  tshare_spawn_options o = {.file = self, .argv = argv, .fds = map, .nfds = 2, .flags = flags};
  tshare_process *p;
  tshare_error err;
  CHECK_RC(tshare_spawn(&o, &p, &err), TSHARE_OK, err.message);
  close(a[1]);
  close(b[1]);
  tshare_exit_status st;
  CHECK_RC(tshare_process_wait(p, 5000, &st), TSHARE_OK, "");
  CHECK_EQ(st.value, 0);
  char got_a[64] = {0}, got_b[256] = {0};
  CHECK(read(a[0], got_a, sizeof got_a - 1) > 0);
  CHECK(read(b[0], got_b, sizeof got_b - 1) > 0);
  printf("a: %s\nb: %s\n", got_a, got_b);
  CHECK(strcmp(got_a, "to-a\n") == 0);
  CHECK(strncmp(got_b, "to-b\n", 5) == 0);
  /* The shell holds exactly stdio and the two mapped fds: not the leaked one. */
  CHECK(strcmp(got_b + 5, "fds: 0 1 2 3 4\n") == 0);
  tshare_process_destroy(p);
  close(leaked);
}

TS_TEST(environment_is_inherited_and_extended) {
  setenv("TSHARE_TEST_INHERITED", "yes", 1);
  setenv("TSHARE_TEST_REPLACED", "old", 1);
  char *env[] = {"TSHARE_TEST_ADDED=1", "TSHARE_TEST_REPLACED=new", NULL};
  char *argv[] = {"sh", "-c",
                  "test \"$TSHARE_TEST_INHERITED\" = yes && test \"$TSHARE_TEST_ADDED\" = 1 && "
                  "test \"$TSHARE_TEST_REPLACED\" = new",
                  NULL};
  tshare_spawn_options o = {.file = "sh", .argv = argv, .env_set = env};
  tshare_process *p;
  CHECK_RC(tshare_spawn(&o, &p, NULL), TSHARE_OK, "");
  tshare_exit_status st;
  CHECK_RC(tshare_process_wait(p, 5000, &st), TSHARE_OK, "");
  CHECK_EQ(st.value, 0);
  tshare_process_destroy(p);
}

TS_TEST(wait_times_out_then_destroy_reaps) {
  /* In its own group: the shell forks sleep, and destroy must take both. */
  tshare_process *p = run_sh("sleep 30; exit 0", NULL, 0, TSHARE_SPAWN_NEW_PROCESS_GROUP);
  double t0 = now_s();
  CHECK_RC(tshare_process_wait(p, 150, NULL), TSHARE_E_TIMEOUT, "");
  CHECK(now_s() - t0 >= 0.14);
  pid_t pid = tshare_process_pid(p);
  tshare_process_destroy(p); /* kills and reaps */
  CHECK(pid_gone(pid));
}

TS_TEST(terminate_escalates_to_sigkill_and_takes_the_group) {
  /* The role ignores SIGTERM and leaves a grandchild in its process group. */
  int out[2];
  CHECK(pipe2(out, O_CLOEXEC) == 0);
  tshare_fd_map map[] = {{3, out[1]}};
  tshare_process *p = run_sh("trap '' TERM; sleep 30 & echo $! >&3; wait", map, 1, TSHARE_SPAWN_NEW_PROCESS_GROUP);
  close(out[1]);
  char text[32] = {0};
  CHECK(read(out[0], text, sizeof text - 1) > 0);
  pid_t grandchild = (pid_t)atoi(text);
  CHECK(grandchild > 0);
  CHECK(!pid_gone(grandchild));
  double t0 = now_s();
  tshare_exit_status st;
  CHECK_RC(tshare_process_terminate(p, 300, &st), TSHARE_OK, "");
  double took = now_s() - t0;
  CHECK_EQ(st.kind, TSHARE_EXIT_SIGNAL);
  CHECK_EQ(st.value, SIGKILL);
  CHECK(took >= 0.29 && took < 5);
  for (int i = 0; i < 100 && !pid_gone(grandchild); i++) usleep(10000); /* init reaps it */
  CHECK(pid_gone(grandchild));
  tshare_process_destroy(p);
  close(out[0]);
}

TS_TEST(terminate_lets_a_cooperative_child_exit) {
  tshare_process *p =
      run_sh("trap 'exit 7' TERM; while :; do sleep 0.01; done", NULL, 0, TSHARE_SPAWN_NEW_PROCESS_GROUP);
  usleep(100000); /* let the shell install its trap */
  tshare_exit_status st;
  CHECK_RC(tshare_process_terminate(p, 5000, &st), TSHARE_OK, "");
  CHECK_EQ(st.kind, TSHARE_EXIT_CODE);
  CHECK_EQ(st.value, 7);
  tshare_process_destroy(p);
}

TS_TEST_MAIN
