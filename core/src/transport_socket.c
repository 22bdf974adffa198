/* The Unix stream socket transport: frames with an fd riding on their first
 * byte (SCM_RIGHTS), the kernel's word on who the peer is (SO_PEERCRED, and
 * SCM_CREDENTIALS on the hello's bytes). */
#include "conn.h"

#include "error_detail.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define FDS_PER_READ 8 /* more than a frame carries: the rest are closed */

/* The fds of one message's control data, and who wrote the stream's first
 * bytes (the hello) where the kernel attached it. */
static size_t collect_fds(ts_conn *c, struct msghdr *msg, ssize_t r, int *fds) {
  size_t n = 0;
  for (struct cmsghdr *m = CMSG_FIRSTHDR(msg); m; m = CMSG_NXTHDR(msg, m)) {
    if (m->cmsg_level == SOL_SOCKET && m->cmsg_type == SCM_CREDENTIALS && c->rx_bytes == 0 && r > 0) {
      struct ucred cred;
      memcpy(&cred, CMSG_DATA(m), sizeof cred);
      c->peer_kpid = cred.pid; /* 0 when its pid namespace is not visible from here */
    }
    if (m->cmsg_level != SOL_SOCKET || m->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (m->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < k; i++) {
      int fd;
      memcpy(&fd, CMSG_DATA(m) + i * sizeof(int), sizeof fd);
      if (n < FDS_PER_READ)
        fds[n++] = fd;
      else
        close(fd);
    }
  }
  return n;
}

static ssize_t socket_read(ts_conn *c, uint8_t *buf, size_t cap) {
  struct iovec iov = {.iov_base = buf, .iov_len = cap};
  union {
    char space[CMSG_SPACE(sizeof(int) * FDS_PER_READ) + CMSG_SPACE(sizeof(struct ucred))];
    struct cmsghdr align;
  } ctl;
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctl.space;
  msg.msg_controllen = sizeof ctl.space;
  ssize_t r = recvmsg(c->rfd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (r < 0) return r;
  int fds[FDS_PER_READ];
  size_t n = collect_fds(c, &msg, r, fds);
  if (r == 0) { /* no bytes for them to ride on */
    for (size_t i = 0; i < n; i++) close(fds[i]);
    return 0;
  }
  c->rx_bytes += (uint64_t)r;
  ts_conn_take_fds(c, fds, n, (msg.msg_flags & MSG_CTRUNC) != 0);
  return r;
}

static ssize_t socket_write(ts_conn *c, const uint8_t *buf, size_t len, int fd) {
  struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
  struct msghdr msg = {0};
  union {
    char space[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } ctl;
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (fd >= 0) {
    memset(&ctl, 0, sizeof ctl);
    msg.msg_control = ctl.space;
    msg.msg_controllen = sizeof ctl.space;
    struct cmsghdr *m = CMSG_FIRSTHDR(&msg);
    m->cmsg_level = SOL_SOCKET;
    m->cmsg_type = SCM_RIGHTS;
    m->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(m), &fd, sizeof fd);
  }
  return sendmsg(c->wfd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static int socket_check(ts_conn *c) {
  int type = 0;
  socklen_t len = sizeof type;
  if (getsockopt(c->rfd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM)
    return ts_errf(c->err, c->err_cap, TSHARE_E_INVALID_ARG, "channel: fd %d is not a stream socket", c->rfd);
  return TSHARE_OK;
}

const ts_transport ts_transport_socket = {
    .name = "socket",
    .caps = TS_TRANSPORT_PASSES_FDS | TS_TRANSPORT_PEER_CREDENTIALS | TS_TRANSPORT_SAME_HOST,
    .check = socket_check,
    .read = socket_read,
    .write = socket_write,
    TS_STREAM_FRAME_OPS,
    .close = ts_stream_close,
};
