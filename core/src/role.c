#include "tshare/role.h"

#include "tshare/rendezvous.h"

#include "error_detail.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

static int parse_int(const char *s, long min, long max, int *out) {
  if (!s || !*s) return -1;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end || v < min || v > max) return -1;
  *out = (int)v;
  return 0;
}

static int parse_ino(const char *s, unsigned long long *out) {
  if (!s || *s < '0' || *s > '9') return -1; /* strtoull would take a sign */
  char *end;
  errno = 0;
  *out = strtoull(s, &end, 10);
  return errno || *end ? -1 : 0;
}

static int bad(tshare_error *err, const char *var, const char *value, const char *why) {
  char msg[TSHARE_ERROR_MSG_MAX];
  ts_errf(msg, sizeof msg, TSHARE_E_MALFORMED, "%s='%s': %s", var, value ? value : "", why);
  ts_error_fill(err, TSHARE_E_MALFORMED, msg);
  return TSHARE_E_MALFORMED;
}

static bool fd_open(int fd) { return fcntl(fd, F_GETFD) >= 0; }

/* TSHARE_CHANNEL_IDS: one entry per channel, shaped like its fds' entry. */
static int read_channel_ids(tshare_role *role, tshare_error *err) {
  const char *list = getenv(TSHARE_ENV_CHANNEL_IDS);
  if (!list) return TSHARE_OK;                  /* not from a launcher that names them: type checks only */
  char copy[TSHARE_ROLE_CHANNELS_MAX * 42 + 1]; /* two 20-digit inodes, ":" and "," per channel */
  if (strlen(list) >= sizeof copy) return bad(err, TSHARE_ENV_CHANNEL_IDS, list, "too long");
  snprintf(copy, sizeof copy, "%s", list);
  char *save = NULL;
  int n = 0;
  for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save), n++) {
    if (n == role->nchannels) return bad(err, TSHARE_ENV_CHANNEL_IDS, list, "more entries than channels");
    tshare_role_channel *c = &role->channels[n];
    if ((strcmp(item, TSHARE_ROLE_CHANNEL_UCX) == 0) != (c->kind == TSHARE_CHANNEL_UCX))
      return bad(err, TSHARE_ENV_CHANNEL_IDS, list, "an entry does not match " TSHARE_ENV_CHANNEL_FDS);
    if (c->kind == TSHARE_CHANNEL_UCX) continue;
    char *colon = strchr(item, ':');
    if ((colon != NULL) != (c->kind == TSHARE_CHANNEL_PIPES))
      return bad(err, TSHARE_ENV_CHANNEL_IDS, list, "an entry does not match " TSHARE_ENV_CHANNEL_FDS);
    if (colon) *colon = '\0';
    if (parse_ino(item, &c->read_ino) || (colon && parse_ino(colon + 1, &c->write_ino)))
      return bad(err, TSHARE_ENV_CHANNEL_IDS, list, "an entry is not I or R:W");
    if (!colon) c->write_ino = c->read_ino;
  }
  if (n != role->nchannels) return bad(err, TSHARE_ENV_CHANNEL_IDS, list, "fewer entries than channels");
  return TSHARE_OK;
}

/* The "ucx" entry: one, with exactly one of its two addresses set. */
static int read_ucx_entry(const tshare_role *role, tshare_role_channel *c, const char *list, tshare_error *err) {
  for (int i = 0; i < role->nchannels; i++)
    if (role->channels[i].kind == TSHARE_CHANNEL_UCX) return bad(err, TSHARE_ENV_CHANNEL_FDS, list, "two ucx entries");
  const char *listen = getenv(TSHARE_ENV_UCX_LISTEN), *connect = getenv(TSHARE_ENV_UCX_CONNECT);
  if ((listen != NULL) == (connect != NULL))
    return bad(err, TSHARE_ENV_CHANNEL_FDS, list,
               "a ucx entry needs one of " TSHARE_ENV_UCX_LISTEN " and " TSHARE_ENV_UCX_CONNECT);
  const char *address = listen ? listen : connect;
  if (strncmp(address, "ucx://", 6) != 0)
    return bad(err, listen ? TSHARE_ENV_UCX_LISTEN : TSHARE_ENV_UCX_CONNECT, address, "not a ucx:// address");
  c->kind = TSHARE_CHANNEL_UCX;
  c->read_fd = c->write_fd = -2;
  return TSHARE_OK;
}

int tshare_role_from_env(tshare_role *role, tshare_error *err) {
  memset(role, 0, sizeof *role);
  role->report_fd = -1;
  const char *name = getenv(TSHARE_ENV_ROLE);
  if (!name) {
    ts_error_fill(err, TSHARE_E_NOT_FOUND,
                  TSHARE_ENV_ROLE " is not set: this program expects to be started by tshare-launch");
    return TSHARE_E_NOT_FOUND;
  }
  if (!name[0] || strlen(name) >= sizeof role->name) return bad(err, TSHARE_ENV_ROLE, name, "empty or too long");
  snprintf(role->name, sizeof role->name, "%s", name);
  const char *v = getenv(TSHARE_ENV_RANK);
  if (parse_int(v, 0, INT_MAX, &role->rank) != 0) return bad(err, TSHARE_ENV_RANK, v, "not a rank");
  v = getenv(TSHARE_ENV_NUM_CONSUMERS);
  if (parse_int(v, 0, TSHARE_ROLE_CHANNELS_MAX, &role->num_consumers) != 0)
    return bad(err, TSHARE_ENV_NUM_CONSUMERS, v, "not a consumer count");
  v = getenv(TSHARE_ENV_REPORT_FD);
  if (v && (parse_int(v, 0, INT_MAX, &role->report_fd) != 0 || !fd_open(role->report_fd)))
    return bad(err, TSHARE_ENV_REPORT_FD, v, "not an open fd");
  const char *list = getenv(TSHARE_ENV_CHANNEL_FDS);
  if (!list) return bad(err, TSHARE_ENV_CHANNEL_FDS, "", "not set");
  char copy[1024];
  if (strlen(list) >= sizeof copy) return bad(err, TSHARE_ENV_CHANNEL_FDS, list, "too long");
  snprintf(copy, sizeof copy, "%s", list);
  char *save = NULL;
  for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
    if (role->nchannels == TSHARE_ROLE_CHANNELS_MAX) return bad(err, TSHARE_ENV_CHANNEL_FDS, list, "too many channels");
    tshare_role_channel *c = &role->channels[role->nchannels];
    char *colon = strchr(item, ':');
    if (strcmp(item, TSHARE_ROLE_CHANNEL_UCX) == 0) {
      int rc = read_ucx_entry(role, c, list, err);
      if (rc != TSHARE_OK) return rc;
      role->nchannels++;
      continue;
    }
    if (role->nchannels > 0 && role->channels[role->nchannels - 1].kind == TSHARE_CHANNEL_UCX)
      return bad(err, TSHARE_ENV_CHANNEL_FDS, list, "the ucx entry must be the last");
    if (colon) {
      *colon = '\0';
      c->kind = TSHARE_CHANNEL_PIPES;
      if (parse_int(item, 0, INT_MAX, &c->read_fd) || parse_int(colon + 1, 0, INT_MAX, &c->write_fd))
        return bad(err, TSHARE_ENV_CHANNEL_FDS, list, "an entry is not N or R:W");
    } else {
      c->kind = TSHARE_CHANNEL_SOCKET;
      if (parse_int(item, 0, INT_MAX, &c->read_fd))
        return bad(err, TSHARE_ENV_CHANNEL_FDS, list, "an entry is not N or R:W");
      c->write_fd = c->read_fd;
    }
    if (!fd_open(c->read_fd) || !fd_open(c->write_fd))
      return bad(err, TSHARE_ENV_CHANNEL_FDS, list, "names an fd that is not open in this process");
    role->nchannels++;
  }
  if (role->nchannels == 0) return bad(err, TSHARE_ENV_CHANNEL_FDS, list, "no channels");
  int rc = read_channel_ids(role, err);
  if (rc == TSHARE_OK) ts_error_fill(err, TSHARE_OK, "");
  return rc;
}

static const char *file_kind(mode_t mode) {
  return S_ISREG(mode)    ? "a regular file"
         : S_ISSOCK(mode) ? "a socket"
         : S_ISFIFO(mode) ? "a pipe"
         : S_ISCHR(mode)  ? "a character device"
         : S_ISDIR(mode)  ? "a directory"
                          : "a file";
}

/* What the fd is now, for the message: "/var/log/app.log (a regular file)". */
static void describe_fd(int fd, const struct stat *st, char *out, size_t cap) {
  char link[64], target[160];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof target - 1);
  target[n > 0 ? n : 0] = '\0';
  snprintf(out, cap, "%s%s%s%s", target, n > 0 ? " (" : "", file_kind(st->st_mode), n > 0 ? ")" : "");
}

static bool is_unix_stream_socket(int fd) {
  int type = 0, domain = 0;
  socklen_t len = sizeof type;
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return false;
  len = sizeof domain;
  return getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 && domain == AF_UNIX;
}

/* A program may close a channel fd and get its number back for a file of its
 * own (a log): taking that would close the program's file under it. So the fd
 * must still be the kind of file the launcher gave, with the inode it named. */
static int check_launcher_fd(int fd, tshare_channel_kind kind, unsigned long long ino, tshare_error *err) {
  const char *want = kind == TSHARE_CHANNEL_SOCKET ? "a Unix stream socket" : "a pipe";
  struct stat st;
  char now[224], msg[TSHARE_ERROR_MSG_MAX];
  if (fstat(fd, &st) != 0) {
    ts_errf(msg, sizeof msg, TSHARE_E_STATE, "role: fd %d, given by tshare-launch as %s, is closed", fd, want);
  } else {
    bool right_kind =
        kind == TSHARE_CHANNEL_SOCKET ? S_ISSOCK(st.st_mode) && is_unix_stream_socket(fd) : S_ISFIFO(st.st_mode);
    if (right_kind && (ino == 0 || (unsigned long long)st.st_ino == ino)) return TSHARE_OK;
    describe_fd(fd, &st, now, sizeof now);
    ts_errf(msg, sizeof msg, TSHARE_E_STATE,
            "role: fd %d is no longer tshare-launch's channel (%s%s) but %s, left open (did the program close it "
            "and reuse the number?)",
            fd, want, right_kind ? " of another inode" : "", now);
  }
  ts_error_fill(err, TSHARE_E_STATE, msg);
  return TSHARE_E_STATE;
}

/* The ucx channel: listen and accept the one peer, or connect, waiting up
 * to TSHARE_UCX_WAIT_MS for the other node (started by the cluster's tool,
 * not by this launcher, maybe later). */
static int open_ucx(const tshare_channel_options *o, tshare_channel **out, tshare_error *err) {
  const char *listen = getenv(TSHARE_ENV_UCX_LISTEN), *connect = getenv(TSHARE_ENV_UCX_CONNECT);
  const char *wait_text = getenv(TSHARE_ENV_UCX_WAIT_MS);
  int wait_ms = 60000;
  if (wait_text && parse_int(wait_text, 1, INT_MAX, &wait_ms) != 0)
    return bad(err, TSHARE_ENV_UCX_WAIT_MS, wait_text, "not a number of milliseconds");
  if (connect) return tshare_connect(connect, o, wait_ms, out, err);
  if (!listen) return bad(err, TSHARE_ENV_UCX_LISTEN, "", "not set");
  tshare_listener *l;
  int rc = tshare_listen(listen, &l, err);
  if (rc != TSHARE_OK) return rc;
  rc = tshare_listener_accept(l, o, wait_ms, out, err);
  tshare_listener_close(l);
  return rc;
}

int tshare_role_open_channel(tshare_role *role, int index, const tshare_channel_options *opts, tshare_channel **out,
                             tshare_error *err) {
  *out = NULL;
  if (!role || index < 0 || index >= role->nchannels) {
    ts_error_fill(err, TSHARE_E_INVALID_ARG, "role: no such channel index");
    return TSHARE_E_INVALID_ARG;
  }
  tshare_role_channel *c = &role->channels[index];
  if (c->read_fd == -1) {
    ts_error_fill(err, TSHARE_E_STATE, "role: channel already opened");
    return TSHARE_E_STATE;
  }
  int rc = c->kind == TSHARE_CHANNEL_UCX ? TSHARE_OK : check_launcher_fd(c->read_fd, c->kind, c->read_ino, err);
  if (rc == TSHARE_OK && c->write_fd != c->read_fd) rc = check_launcher_fd(c->write_fd, c->kind, c->write_ino, err);
  if (rc != TSHARE_OK) return rc; /* not taken: the fds stay as the program has them */
  tshare_channel_options o;
  char name[48];
  if (opts)
    o = *opts;
  else
    tshare_channel_options_init(&o);
  if (!opts || !opts->name) {
    snprintf(name, sizeof name, "%s %d", role->name, role->rank);
    o.name = name;
  }
  if (c->kind == TSHARE_CHANNEL_UCX) {
    c->read_fd = c->write_fd = -1;
    return open_ucx(&o, out, err);
  }
  int rfd = c->read_fd, wfd = c->write_fd;
  c->read_fd = c->write_fd = -1;
  if (c->kind == TSHARE_CHANNEL_SOCKET) return tshare_channel_open_socket(rfd, &o, out, err);
  return tshare_channel_open_pipes(rfd, wfd, &o, out, err);
}

static void report_line(const tshare_role *role, const char *key, const char *op, long long value) {
  if (!role || role->report_fd < 0 || !key) return;
  char line[128];
  int n = snprintf(line, sizeof line, "%s%s%lld\n", key, op, value);
  if (n <= 0 || (size_t)n >= sizeof line) return;
  /* One short write: lines under PIPE_BUF arrive whole. */
  ssize_t w;
  do w = write(role->report_fd, line, (size_t)n);
  while (w < 0 && errno == EINTR);
}

void tshare_role_report(const tshare_role *role, const char *key, long long value) {
  report_line(role, key, "=", value);
}

void tshare_role_report_add(const tshare_role *role, const char *key, long long delta) {
  report_line(role, key, "+=", delta);
}
