/* TSHARE_LOG: what the library says at each level, read from a real run (this
 * binary again, `test_log --role share`, with TSHARE_LOG set and its stderr
 * captured), and silence at the default level when nothing goes wrong. */
#include "harness.h"
#include "proc_util.h"
#include "tshare/tshare.h"

#include <poll.h>

/* A host share between two processes, released. */
static int share_once(int argc, char **argv) {
  (void)argc, (void)argv;
  int sv[2];
  if (tshare_socketpair(sv, NULL) != TSHARE_OK) return 2;
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    tshare_channel *ch;
    tshare_view *v;
    if (tshare_channel_open_socket(sv[1], NULL, &ch, NULL) != TSHARE_OK) _exit(3);
    if (tshare_view_recv(ch, 5000, &v) != TSHARE_OK) _exit(4);
    tshare_view_release(v);
    tshare_channel_close(ch);
    _exit(0);
  }
  close(sv[1]);
  tshare_channel *ch;
  tshare_host_buffer *b;
  if (tshare_channel_open_socket(sv[0], NULL, &ch, NULL) != TSHARE_OK) return 5;
  if (tshare_host_buffer_create(64, "log", &b, NULL) != TSHARE_OK) return 6;
  int64_t n = 4;
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_INT, 32, 1}, 1, &n, 0);
  if (tshare_share_host(ch, b, &d, "logged", NULL, 5000, NULL) != TSHARE_OK) return 7;
  if (tshare_channel_wait_released(ch, 0, 5000) != TSHARE_OK) return 8;
  tshare_channel_close(ch);
  tshare_host_buffer_destroy(b);
  int st;
  waitpid(pid, &st, 0);
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 9;
}

__attribute__((constructor)) static void install_role(void) { ts_role_main = share_once; }

static char said[16384];

/* Run the role with TSHARE_LOG=level (NULL: unset); its stderr lands in said. */
static void run_with_log_level(const char *level) {
  int err[2];
  CHECK(pipe2(err, O_CLOEXEC) == 0);
  char env_text[64];
  snprintf(env_text, sizeof env_text, "TSHARE_LOG=%s", level ? level : "");
  char *env[] = {env_text, NULL};
  static char self[4096]; /* this binary's path (under valgrind /proc/self/exe is valgrind's) */
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  CHECK(n > 0);
  self[n] = '\0';
  char *argv[] = {self, "--role", "share", NULL};
  tshare_fd_map fds[] = {{2, err[1]}};
  tshare_spawn_options o = {.file = self, .argv = argv, .env_set = env, .fds = fds, .nfds = 1};
  tshare_process *p;
  tshare_error e;
  CHECK_RC(tshare_spawn(&o, &p, &e), TSHARE_OK, e.message);
  close(err[1]);
  size_t len = 0;
  ssize_t r;
  while ((r = read(err[0], said + len, sizeof said - 1 - len)) > 0) len += (size_t)r;
  said[len] = '\0';
  close(err[0]);
  tshare_exit_status st;
  CHECK_RC(tshare_process_wait(p, 10000, &st), TSHARE_OK, "the role did not end");
  tshare_process_destroy(p);
  printf("---- TSHARE_LOG=%s ----\n%s", level ? level : "(unset)", said);
  CHECK_EQ(st.value, 0);
}

TS_TEST(levels_say_what_happened) {
  run_with_log_level("debug");
  CHECK(strstr(said, "info: channel 'tshare' open to"));
  CHECK(strstr(said, "info: shared 1 (host memfd"));
  CHECK(strstr(said, "tag 'logged'"));
  CHECK(strstr(said, "debug: mapped allocation"));
  CHECK(strstr(said, "info: received share 1 (host"));
  CHECK(strstr(said, "info: released share 1"));
  CHECK(strstr(said, "debug: share 1 released by"));
  run_with_log_level("info");
  CHECK(strstr(said, "info: shared 1"));
  CHECK(!strstr(said, "debug:"));
  run_with_log_level(NULL); /* the default, warn: a run without trouble says nothing */
  CHECK_EQ(strlen(said), 0);
  run_with_log_level("loud");
  CHECK(strstr(said, "warn: TSHARE_LOG='loud' is not warn, info or debug: using warn"));
  CHECK(!strstr(said, "info:"));
}

TS_TEST_MAIN
