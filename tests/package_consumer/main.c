/* Proves the installed headers and library work: a share between two
 * processes through the package's own API. */
#include <tshare/tshare.h>

#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int main(void) {
  int sv[2];
  if (tshare_socketpair(sv, NULL) != TSHARE_OK) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    tshare_channel *ch;
    tshare_view *v;
    if (tshare_channel_open_socket(sv[1], NULL, &ch, NULL) != TSHARE_OK) _exit(2);
    if (tshare_view_recv(ch, 5000, &v) != TSHARE_OK) _exit(3);
    int ok = strcmp((const char *)tshare_view_data(v), "from the package") == 0;
    tshare_view_release(v);
    tshare_channel_close(ch);
    _exit(ok ? 0 : 4);
  }
  close(sv[1]);
  tshare_channel *ch;
  tshare_host_buffer *buf;
  if (tshare_channel_open_socket(sv[0], NULL, &ch, NULL) != TSHARE_OK) return 5;
  if (tshare_host_buffer_create(64, "package", &buf, NULL) != TSHARE_OK) return 6;
  strcpy(tshare_host_buffer_data(buf), "from the package");
  int64_t bytes = 17;
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_UINT, 8, 1}, 1, &bytes, 0);
  if (tshare_share_host(ch, buf, &d, NULL, NULL, 5000, NULL) != TSHARE_OK) return 7;
  if (tshare_channel_wait_released(ch, 0, 5000) != TSHARE_OK) return 8;
  int st;
  waitpid(pid, &st, 0);
  tshare_host_buffer_destroy(buf);
  tshare_channel_close(ch);
  printf("package consumer: %s\n", WIFEXITED(st) && WEXITSTATUS(st) == 0 ? "ok" : "FAILED");
  return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : 9;
}
