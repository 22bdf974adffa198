/* fds as a hand-written peer passes them, and as a test counts them: no
 * test harness needed (the fuzz targets use these too). */
#ifndef TSHARE_TEST_FD_UTIL_H
#define TSHARE_TEST_FD_UTIL_H

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

/* One sendmsg of len bytes with fd (or -1) riding on the first: like
 * sendmsg, the count written or -1. */
static inline ssize_t send_with_fd(int sock, const void *buf, size_t len, int fd, int flags) {
  struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
  union {
    char space[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } ctl;
  struct msghdr msg;
  memset(&msg, 0, sizeof msg);
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (fd >= 0) {
    memset(&ctl, 0, sizeof ctl);
    msg.msg_control = ctl.space;
    msg.msg_controllen = sizeof ctl.space;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  return sendmsg(sock, &msg, flags | MSG_NOSIGNAL);
}

/* fds of this process open on a memfd created with `name` (other fds, such
 * as those a CUDA driver opens for itself, do not count); -1 if
 * /proc/self/fd cannot be read. */
static inline int count_memfds_named(const char *name) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  char want[300];
  snprintf(want, sizeof want, "memfd:%s", name);
  int n = 0;
  for (struct dirent *e; (e = readdir(d));) {
    char path[300], target[256];
    snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
    ssize_t len = readlink(path, target, sizeof target - 1);
    if (len > 0) target[len] = '\0';
    if (len > 0 && strstr(target, want)) n++;
  }
  closedir(d);
  return n;
}

#endif
