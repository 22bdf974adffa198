/* Listening on and connecting to a socket path in a private directory, or
 * to a ucx:// address across hosts (ucx_bootstrap.c). */
#include "tshare/rendezvous.h"

#include "clock.h"
#include "error_detail.h"
#include "ucx_address.h"
#include "ucx_bootstrap.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

struct tshare_listener {
  int fd;
  char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  dev_t dev; /* of the socket file we bound: close removes only that one */
  ino_t ino;
  ts_ucx_listener *ucx; /* a ucx:// listener instead (fd -1, path unused) */
};

#define CONNECT_RETRY_MS 20 /* how often a connect looks again for a listener that is not up yet */

static int fail(tshare_error *err, int status, const char *msg) {
  ts_error_fill(err, status, msg);
  return status;
}

int tshare_rendezvous_path(const char *name, char *out, size_t cap, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX];
  if (!name || !*name || !out) return fail(err, TSHARE_E_INVALID_ARG, "rendezvous: empty name");
  int n;
  if (strchr(name, '/')) {
    n = snprintf(out, cap, "%s", name);
  } else {
    const char *run = getenv("XDG_RUNTIME_DIR");
    if (run && *run == '/')
      n = snprintf(out, cap, "%s/tshare/%s", run, name);
    else
      n = snprintf(out, cap, "/tmp/tshare-%ld/%s", (long)getuid(), name);
  }
  size_t max = sizeof(((struct sockaddr_un *)0)->sun_path);
  if (n < 0 || (size_t)n >= cap || (size_t)n >= max)
    return fail(err,
                ts_errf(msg, sizeof msg, TSHARE_E_TOO_LARGE,
                        "rendezvous: the path for '%s' is over the %zu bytes a Unix socket address holds", name,
                        max - 1),
                msg);
  ts_error_fill(err, TSHARE_OK, "");
  return TSHARE_OK;
}

/* The socket's directory must be ours alone: created 0700 when missing,
 * refused when it is a symlink, another user's, or open to others. */
static int private_dir(const char *path, char *msg, size_t cap) {
  char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash)
    snprintf(dir, sizeof dir, ".");
  else if (slash == dir)
    dir[1] = '\0';
  else
    *slash = '\0';
  struct stat st;
  if (lstat(dir, &st) != 0) {
    if (errno != ENOENT) return ts_errsys(msg, cap, TSHARE_E_SYSTEM, errno, "rendezvous: lstat %s", dir);
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
      return ts_errsys(msg, cap, TSHARE_E_SYSTEM, errno, "rendezvous: mkdir %s", dir);
    if (lstat(dir, &st) != 0) return ts_errsys(msg, cap, TSHARE_E_SYSTEM, errno, "rendezvous: lstat %s", dir);
  }
  if (!S_ISDIR(st.st_mode))
    return ts_errf(msg, cap, TSHARE_E_PERMISSION, "rendezvous: %s is not a directory (a symlink is refused)", dir);
  if (st.st_uid != getuid())
    return ts_errf(msg, cap, TSHARE_E_PERMISSION, "rendezvous: %s belongs to uid %ld, not to this user (uid %ld)", dir,
                   (long)st.st_uid, (long)getuid());
  if (st.st_mode & 077)
    return ts_errf(msg, cap, TSHARE_E_PERMISSION,
                   "rendezvous: %s has mode %03o; the socket's directory must be private (chmod 700)", dir,
                   (unsigned)(st.st_mode & 0777));
  return TSHARE_OK;
}

static int unix_socket(void) { return socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0); }

static struct sockaddr_un address_of(const char *path) {
  struct sockaddr_un a;
  memset(&a, 0, sizeof a);
  a.sun_family = AF_UNIX;
  snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
  return a;
}

/* A non-blocking connect: 0, or -1 with errno. On a Unix socket it never
 * waits: a listener whose backlog is full answers EAGAIN at once. */
static int connect_now(int fd, const char *path) {
  struct sockaddr_un a = address_of(path);
  int r;
  do r = connect(fd, (struct sockaddr *)&a, sizeof a);
  while (r != 0 && errno == EINTR);
  return r;
}

/* A socket file at path: live (someone listens, even one too busy to accept)
 * or left behind. The probe's connection is closed at once; a listener's
 * accept drops it and waits for the next. */
static bool someone_listens(const char *path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  bool live = connect_now(fd, path) == 0 || errno == EAGAIN;
  close(fd);
  return live;
}

/* opts with the hello bounded by what is left of the caller's deadline. */
static tshare_channel_options bounded_options(const tshare_channel_options *opts, int64_t deadline) {
  tshare_channel_options o;
  if (opts)
    o = *opts;
  else
    tshare_channel_options_init(&o);
  int left = ts_remaining(deadline);
  if (left >= 0 && (o.handshake_timeout_ms < 0 || left < o.handshake_timeout_ms))
    o.handshake_timeout_ms = left > 0 ? left : 1;
  return o;
}

int tshare_listen(const char *name, tshare_listener **out, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX];
  if (!out) return fail(err, TSHARE_E_INVALID_ARG, "listen: NULL out");
  *out = NULL;
  tshare_listener *l = calloc(1, sizeof *l);
  if (!l) return fail(err, TSHARE_E_NOMEM, "listen: out of memory");
  l->fd = -1;
  if (ts_ucx_is_address(name)) {
    int rc = ts_ucx_listen(name, &l->ucx, msg, sizeof msg);
    if (rc != TSHARE_OK) {
      free(l);
      return fail(err, rc, msg);
    }
    ts_error_fill(err, TSHARE_OK, "");
    *out = l;
    return TSHARE_OK;
  }
  int rc = tshare_rendezvous_path(name, l->path, sizeof l->path, err);
  if (rc != TSHARE_OK) {
    free(l);
    return rc;
  }
  rc = private_dir(l->path, msg, sizeof msg);
  struct stat st;
  if (rc == TSHARE_OK && lstat(l->path, &st) == 0) {
    if (!S_ISSOCK(st.st_mode))
      rc = ts_errf(msg, sizeof msg, TSHARE_E_STATE, "listen: %s exists and is not a socket", l->path);
    else if (someone_listens(l->path))
      rc = ts_errf(msg, sizeof msg, TSHARE_E_STATE, "listen: another process listens on %s", l->path);
    else if (unlink(l->path) != 0) /* left behind by a listener that died */
      rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "listen: removing the stale socket %s", l->path);
  }
  if (rc == TSHARE_OK && (l->fd = unix_socket()) < 0)
    rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "listen: socket");
  if (rc == TSHARE_OK) {
    struct sockaddr_un a = address_of(l->path);
    if (bind(l->fd, (struct sockaddr *)&a, sizeof a) != 0)
      rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "listen: bind %s", l->path);
    else if (chmod(l->path, 0600) != 0 || listen(l->fd, 64) != 0 || lstat(l->path, &st) != 0)
      rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "listen: %s", l->path);
    else if (fcntl(l->fd, F_SETFL, fcntl(l->fd, F_GETFL) | O_NONBLOCK) != 0)
      rc = ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "listen: fcntl");
    l->dev = st.st_dev;
    l->ino = st.st_ino;
  }
  if (rc != TSHARE_OK) {
    if (l->fd >= 0) close(l->fd);
    free(l);
    return fail(err, rc, msg);
  }
  ts_error_fill(err, TSHARE_OK, "");
  *out = l;
  return TSHARE_OK;
}

int tshare_listener_accept(tshare_listener *l, const tshare_channel_options *opts, int timeout_ms, tshare_channel **out,
                           tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX];
  char refused[TSHARE_ERROR_MSG_MAX] = ""; /* the last connection dropped, for the timeout's message */
  if (!out) return fail(err, TSHARE_E_INVALID_ARG, "accept: NULL out");
  *out = NULL;
  if (l && l->ucx) return ts_ucx_accept(l->ucx, opts, timeout_ms, out, err);
  if (!l || l->fd < 0) return fail(err, TSHARE_E_INVALID_ARG, "accept: no listener");
  int64_t deadline = ts_deadline(timeout_ms);
  for (;;) {
    int fd = accept4(l->fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd >= 0) {
      /* One bad connection (a liveness probe, a client that never says hello,
       * another user, a version skew) is dropped: the next may be good. */
      tshare_channel_options o = bounded_options(opts, deadline);
      tshare_error why;
      int rc = tshare_channel_open_socket(fd, &o, out, &why); /* checks the peer's uid first */
      if (rc == TSHARE_OK || rc == TSHARE_E_NOMEM || rc == TSHARE_E_SYSTEM) {
        ts_error_fill(err, rc, why.message);
        return rc;
      }
      snprintf(refused, sizeof refused, "%s", why.message);
    } else if (errno == EINTR || errno == ECONNABORTED) {
      continue;
    } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return fail(err, ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "accept on %s", l->path), msg);
    }
    int left = ts_remaining(deadline);
    if (left == 0) {
      if (refused[0])
        ts_errf(msg, sizeof msg, TSHARE_E_TIMEOUT, "accept: no usable peer on %s in time; the last one was dropped: %s",
                l->path, refused);
      else
        ts_errf(msg, sizeof msg, TSHARE_E_TIMEOUT, "accept: nobody connected to %s in time", l->path);
      return fail(err, TSHARE_E_TIMEOUT, msg);
    }
    if (fd >= 0) continue; /* more may be waiting */
    struct pollfd p = {l->fd, POLLIN, 0};
    if (poll(&p, 1, left) < 0 && errno != EINTR)
      return fail(err, ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "accept: poll"), msg);
  }
}

int tshare_listener_fd(const tshare_listener *l) { return !l ? -1 : l->ucx ? ts_ucx_listener_fd(l->ucx) : l->fd; }
const char *tshare_listener_path(const tshare_listener *l) {
  return !l ? "" : l->ucx ? ts_ucx_listener_address(l->ucx) : l->path;
}

void tshare_listener_close(tshare_listener *l) {
  if (!l) return;
  if (l->ucx) {
    ts_ucx_listener_close(l->ucx);
    free(l);
    return;
  }
  struct stat st;
  /* Only our own socket: a later listener may have replaced it meanwhile. */
  if (lstat(l->path, &st) == 0 && st.st_dev == l->dev && st.st_ino == l->ino) unlink(l->path);
  close(l->fd);
  free(l);
}

int tshare_connect(const char *name, const tshare_channel_options *opts, int timeout_ms, tshare_channel **out,
                   tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX];
  char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  if (!out) return fail(err, TSHARE_E_INVALID_ARG, "connect: NULL out");
  *out = NULL;
  if (ts_ucx_is_address(name)) return ts_ucx_connect(name, opts, timeout_ms, out, err);
  int rc = tshare_rendezvous_path(name, path, sizeof path, err);
  if (rc != TSHARE_OK) return rc;
  int64_t deadline = ts_deadline(timeout_ms);
  bool busy = false; /* a listener answered, but its backlog was full */
  for (;;) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return fail(err, ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "connect: socket"), msg);
    if (connect_now(fd, path) == 0) {
      tshare_channel_options o = bounded_options(opts, deadline); /* the hello waits for an accept */
      return tshare_channel_open_socket(fd, &o, out, err);        /* checks the listener's uid first */
    }
    int e = errno;
    close(fd);
    if (e == EACCES || e == EPERM)
      return fail(err, ts_errsys(msg, sizeof msg, TSHARE_E_PERMISSION, e, "connect: %s", path), msg);
    if (e != ENOENT && e != ECONNREFUSED && e != EAGAIN)
      return fail(err, ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, e, "connect: %s", path), msg);
    busy = e == EAGAIN;
    int left = ts_remaining(deadline);
    if (left == 0 && busy)
      return fail(err,
                  ts_errf(msg, sizeof msg, TSHARE_E_TIMEOUT,
                          "connect: the listener on %s did not take the connection in time (its backlog is full)",
                          path),
                  msg);
    if (left == 0)
      return fail(err, ts_errf(msg, sizeof msg, TSHARE_E_NOT_FOUND, "connect: nobody listens on %s", path), msg);
    usleep(1000u * (unsigned)(left < 0 || left > CONNECT_RETRY_MS ? CONNECT_RETRY_MS : left));
  }
}
