/* The bootstrap of channels across hosts (ucx_bootstrap.h): a TCP exchange
 * of one offer (connecting end) and one answer (listening end), both
 * little-endian, checked against their bounds before anything is allocated:
 *
 *   offer:  magic[8] | u16 name_len | u16 token_len | u32 address_len | name | token | worker address
 *   answer: magic[8] | u32 status (0 or a negative tshare_status) | u16 message_len | u32 address_len
 *           | message | worker address (none when refused)
 */
#include "ucx_bootstrap.h"

#include "bytes.h"
#include "clock.h"
#include "error_detail.h"
#include "log.h"
#include "session.h"
#include "transport_ucx.h"
#include "ucx_address.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define BOOT_MAGIC "TSUCX01\n"
#define BOOT_MAGIC_LEN 8
#define BOOT_OFFER_HEAD (BOOT_MAGIC_LEN + 2 + 2 + 4)
#define BOOT_ANSWER_HEAD (BOOT_MAGIC_LEN + 4 + 2 + 4)
#define BOOT_ADDRESS_MAX 65536u /* a worker address (tens to hundreds of bytes over TCP) */
#define CONNECT_RETRY_MS 20

struct ts_ucx_listener {
  int fd;
  ts_ucx_address where;
  char text[sizeof(TS_UCX_SCHEME) + TS_UCX_HOST_MAX + 8 + TS_UCX_NAME_MAX];
};

static int fail(tshare_error *err, int status, const char *msg) {
  ts_error_fill(err, status, msg);
  return status;
}

/* The token: the option, else TSHARE_TOKEN; 1-255 bytes. */
static int token_of(const tshare_channel_options *opts, const char **token, char *msg, size_t cap) {
  *token = NULL; /* set on every path: callers read it only on success, which gcc -O3 cannot see */
  const char *t = opts && opts->token ? opts->token : getenv(TS_UCX_TOKEN_ENV);
  if (!t || !*t)
    return ts_errf(msg, cap, TSHARE_E_PERMISSION,
                   "ucx: no token: a channel across hosts needs the shared secret in the channel options' token or in "
                   "%s, the same on both ends",
                   TS_UCX_TOKEN_ENV);
  if (strlen(t) > TS_UCX_TOKEN_MAX)
    return ts_errf(msg, cap, TSHARE_E_TOO_LARGE, "ucx: the token is over %d bytes", TS_UCX_TOKEN_MAX);
  *token = t;
  return TSHARE_OK;
}

/* Equal tokens, in a time that depends on the lengths only. */
static bool same_token(const uint8_t *a, size_t a_len, const char *b) {
  size_t b_len = strlen(b), n = a_len > b_len ? a_len : b_len;
  unsigned diff = a_len != b_len;
  for (size_t i = 0; i < n; i++) diff |= (unsigned)((i < a_len ? a[i] : 0) ^ (i < b_len ? (uint8_t)b[i] : 0));
  return diff == 0;
}

/* All n bytes in or out of a non-blocking socket by the deadline. */
static int io_all(int fd, void *buf, size_t n, bool out, int64_t deadline, char *msg, size_t cap) {
  uint8_t *p = buf;
  while (n > 0) {
    ssize_t r = out ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r, n -= (size_t)r;
      continue;
    }
    if (r == 0) return ts_errf(msg, cap, TSHARE_E_PEER_CLOSED, "ucx: the peer hung up during the bootstrap");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return ts_errsys(msg, cap, TSHARE_E_PEER_CLOSED, errno, "ucx: bootstrap %s", out ? "send" : "receive");
    int left = ts_remaining(deadline);
    struct pollfd pfd = {fd, out ? POLLOUT : POLLIN, 0};
    if (left == 0 || (poll(&pfd, 1, left) == 0 && ts_remaining(deadline) == 0))
      return ts_errf(msg, cap, TSHARE_E_TIMEOUT, "ucx: the peer did not complete the bootstrap in time");
  }
  return TSHARE_OK;
}

/* Send head (already encoded) and up to three parts. */
static int send_parts(int fd, const uint8_t *head, size_t head_len, const void *const parts[3], const size_t lens[3],
                      int64_t deadline, char *msg, size_t cap) {
  int rc = io_all(fd, (void *)head, head_len, true, deadline, msg, cap);
  for (int i = 0; i < 3 && rc == TSHARE_OK; i++)
    if (lens[i]) rc = io_all(fd, (void *)parts[i], lens[i], true, deadline, msg, cap);
  return rc;
}

static int send_offer(int fd, const char *name, const char *token, const void *addr, size_t addr_len,
                      int64_t deadline, char *msg, size_t cap) {
  uint8_t head[BOOT_OFFER_HEAD];
  ts_writer w = {head, sizeof head, false};
  ts_put_bytes(&w, BOOT_MAGIC, BOOT_MAGIC_LEN);
  ts_put_u16(&w, (uint16_t)strlen(name));
  ts_put_u16(&w, (uint16_t)strlen(token));
  ts_put_u32(&w, (uint32_t)addr_len);
  const void *parts[3] = {name, token, addr};
  const size_t lens[3] = {strlen(name), strlen(token), addr_len};
  return send_parts(fd, head, sizeof head, parts, lens, deadline, msg, cap);
}

static int send_answer(int fd, int status, const char *text, const void *addr, size_t addr_len, int64_t deadline,
                       char *msg, size_t cap) {
  uint8_t head[BOOT_ANSWER_HEAD];
  size_t text_len = strlen(text) < TSHARE_ERROR_MSG_MAX ? strlen(text) : TSHARE_ERROR_MSG_MAX - 1;
  ts_writer w = {head, sizeof head, false};
  ts_put_bytes(&w, BOOT_MAGIC, BOOT_MAGIC_LEN);
  ts_put_u32(&w, (uint32_t)status);
  ts_put_u16(&w, (uint16_t)text_len);
  ts_put_u32(&w, (uint32_t)addr_len);
  const void *parts[3] = {text, addr, NULL};
  const size_t lens[3] = {text_len, addr_len, 0};
  return send_parts(fd, head, sizeof head, parts, lens, deadline, msg, cap);
}

/* What the other end sent: its parts, bounded, in one allocation. */
typedef struct boot_message {
  uint8_t *body;
  int status;                 /* an answer's */
  size_t len[3];              /* offer: name, token, address; answer: message, address */
  const uint8_t *part[3];
} boot_message;

static int recv_message(int fd, bool offer, boot_message *m, int64_t deadline, char *msg, size_t cap) {
  memset(m, 0, sizeof *m);
  uint8_t head[BOOT_ANSWER_HEAD > BOOT_OFFER_HEAD ? BOOT_ANSWER_HEAD : BOOT_OFFER_HEAD];
  size_t head_len = offer ? BOOT_OFFER_HEAD : BOOT_ANSWER_HEAD;
  int rc = io_all(fd, head, head_len, false, deadline, msg, cap);
  if (rc != TSHARE_OK) return rc;
  ts_reader r = {head, head_len, false};
  char magic[BOOT_MAGIC_LEN];
  ts_get_bytes(&r, magic, sizeof magic);
  if (memcmp(magic, BOOT_MAGIC, BOOT_MAGIC_LEN) != 0)
    return ts_errf(msg, cap, TSHARE_E_PROTOCOL, "ucx: the peer is not a tshare UCX channel of this version");
  if (offer) {
    m->len[0] = ts_get_u16(&r), m->len[1] = ts_get_u16(&r);
  } else {
    m->status = (int)ts_get_u32(&r);
    m->len[0] = ts_get_u16(&r);
  }
  m->len[offer ? 2 : 1] = ts_get_u32(&r);
  bool bad = m->len[offer ? 2 : 1] > BOOT_ADDRESS_MAX || (offer && (m->len[0] > TS_UCX_NAME_MAX || m->len[1] > TS_UCX_TOKEN_MAX)) ||
             (!offer && m->len[0] >= TSHARE_ERROR_MSG_MAX) || m->status > 0 || m->status < -1000;
  if (bad) return ts_errf(msg, cap, TSHARE_E_PROTOCOL, "ucx: the peer's bootstrap message is over its bounds");
  size_t total = m->len[0] + m->len[1] + m->len[2];
  if (!(m->body = malloc(total + 1))) return ts_errf(msg, cap, TSHARE_E_NOMEM, "ucx: out of memory");
  rc = io_all(fd, m->body, total, false, deadline, msg, cap);
  m->part[0] = m->body, m->part[1] = m->body + m->len[0], m->part[2] = m->part[1] + m->len[1];
  return rc;
}

/* host:port as an IPv4 socket address. */
static int resolve(const ts_ucx_address *a, bool passive, struct sockaddr_in *out, char *msg, size_t cap) {
  struct addrinfo hints = {0}, *res = NULL;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  char port[8];
  snprintf(port, sizeof port, "%u", a->port);
  int rc = getaddrinfo(a->host, port, &hints, &res);
  if (rc != 0 || !res)
    return ts_errf(msg, cap, TSHARE_E_NOT_FOUND, "ucx: host '%s' is not known: %s", a->host, gai_strerror(rc));
  memcpy(out, res->ai_addr, sizeof *out);
  freeaddrinfo(res);
  return TSHARE_OK;
}

static int tcp_socket(void) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int one = 1;
  if (fd >= 0) setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

/* UCX is loaded before anything binds or connects: without it the caller
 * hears so at once. */
static int ucx_ready(char *msg, size_t cap) {
  ts_ucx_endpoint *probe;
  const void *addr;
  size_t len;
  int rc = ts_ucx_endpoint_new(&probe, &addr, &len, msg, cap);
  ts_ucx_endpoint_free(probe);
  return rc;
}

int ts_ucx_listen(const char *address, ts_ucx_listener **out, char *msg, size_t cap) {
  *out = NULL;
  ts_ucx_listener *l = calloc(1, sizeof *l);
  if (!l) return ts_errf(msg, cap, TSHARE_E_NOMEM, "listen: out of memory");
  l->fd = -1;
  struct sockaddr_in sa;
  int rc = ts_ucx_parse_address(address, &l->where, msg, cap);
  if (rc == TSHARE_OK) rc = ucx_ready(msg, cap);
  if (rc == TSHARE_OK) rc = resolve(&l->where, true, &sa, msg, cap);
  if (rc == TSHARE_OK && (l->fd = tcp_socket()) < 0) rc = ts_errsys(msg, cap, TSHARE_E_SYSTEM, errno, "listen: socket");
  int one = 1;
  if (rc == TSHARE_OK) setsockopt(l->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (rc == TSHARE_OK && bind(l->fd, (struct sockaddr *)&sa, sizeof sa) != 0)
    rc = ts_errsys(msg, cap, errno == EADDRINUSE ? TSHARE_E_STATE : TSHARE_E_SYSTEM, errno, "listen: bind %s:%u",
                   l->where.host, l->where.port);
  if (rc == TSHARE_OK && listen(l->fd, 64) != 0) rc = ts_errsys(msg, cap, TSHARE_E_SYSTEM, errno, "listen: %s", address);
  if (rc != TSHARE_OK) {
    ts_ucx_listener_close(l);
    return rc;
  }
  snprintf(l->text, sizeof l->text, "%s%s:%u/%s", TS_UCX_SCHEME, l->where.host, l->where.port, l->where.name);
  *out = l;
  return TSHARE_OK;
}

int ts_ucx_listener_fd(const ts_ucx_listener *l) { return l->fd; }
const char *ts_ucx_listener_address(const ts_ucx_listener *l) { return l->text; }

void ts_ucx_listener_close(ts_ucx_listener *l) {
  if (!l) return;
  if (l->fd >= 0) close(l->fd);
  free(l);
}

/* The channel on a bootstrapped endpoint: the hello over UCX, bounded by
 * what is left of the deadline. */
static int open_on(ts_ucx_endpoint *e, const void *peer_addr, size_t len, int fd, const tshare_channel_options *opts,
                   int64_t deadline, tshare_channel **out, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX];
  int rfd, wfd;
  int left = ts_remaining(deadline);
  int rc = ts_ucx_endpoint_connect(e, peer_addr, len, fd, left < 0 ? 10000 : left, &rfd, &wfd, msg, sizeof msg);
  if (rc != TSHARE_OK) return fail(err, rc, msg);
  tshare_channel_options o;
  if (opts)
    o = *opts;
  else
    tshare_channel_options_init(&o);
  left = ts_remaining(deadline);
  if (left >= 0 && (o.handshake_timeout_ms < 0 || left < o.handshake_timeout_ms)) o.handshake_timeout_ms = left > 0 ? left : 1;
  return ts_channel_open_on(TS_CONN_UCX, rfd, wfd, &o, out, err);
}

/* Whether the offer m may have this listener's channel: the name, then the
 * token. The refusal's text goes to both ends. */
static int check_offer(const ts_ucx_listener *l, const boot_message *m, const char *token, char *msg, size_t cap) {
  if (m->len[0] != strlen(l->where.name) || memcmp(m->part[0], l->where.name, m->len[0]) != 0)
    return ts_errf(msg, cap, TSHARE_E_NOT_FOUND, "ucx: %s has no channel '%.*s'", l->text, (int)m->len[0],
                   (const char *)m->part[0]);
  if (m->len[1] == 0)
    return ts_errf(msg, cap, TSHARE_E_PERMISSION, "ucx: %s refused a peer that sent no token (set %s)", l->text,
                   TS_UCX_TOKEN_ENV);
  if (!same_token(m->part[1], m->len[1], token))
    return ts_errf(msg, cap, TSHARE_E_PERMISSION, "ucx: %s refused a peer whose token does not match", l->text);
  return TSHARE_OK;
}

/* One connection taken by accept: the offer, the answer, the channel. */
static int serve_one(ts_ucx_listener *l, int fd, const char *token, const tshare_channel_options *opts,
                     int64_t deadline, tshare_channel **out, tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX];
  boot_message m;
  ts_ucx_endpoint *e = NULL;
  const void *addr = NULL;
  size_t addr_len = 0;
  int64_t boot_deadline = ts_deadline(opts && opts->handshake_timeout_ms >= 0 ? opts->handshake_timeout_ms : 10000);
  if (deadline >= 0 && (boot_deadline < 0 || deadline < boot_deadline)) boot_deadline = deadline;
  int rc = recv_message(fd, true, &m, boot_deadline, msg, sizeof msg);
  int refusal = rc == TSHARE_OK ? check_offer(l, &m, token, msg, sizeof msg) : rc;
  if (refusal == TSHARE_OK) refusal = ts_ucx_endpoint_new(&e, &addr, &addr_len, msg, sizeof msg);
  if (rc == TSHARE_OK) {
    char sent[TSHARE_ERROR_MSG_MAX];
    rc = send_answer(fd, refusal, refusal == TSHARE_OK ? "" : msg, addr, addr_len, boot_deadline, sent, sizeof sent);
    if (refusal == TSHARE_OK && rc != TSHARE_OK) snprintf(msg, sizeof msg, "%s", sent);
    if (refusal != TSHARE_OK) rc = refusal;
  }
  if (rc == TSHARE_OK) {
    rc = open_on(e, m.part[2], m.len[2], fd, opts, deadline, out, err); /* e and fd are the channel's now */
    free(m.body);
    return rc;
  }
  free(m.body);
  ts_ucx_endpoint_free(e);
  close(fd);
  return fail(err, rc, msg);
}

int ts_ucx_accept(ts_ucx_listener *l, const tshare_channel_options *opts, int timeout_ms, tshare_channel **out,
                  tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX], dropped[TSHARE_ERROR_MSG_MAX] = "";
  const char *token;
  int rc = token_of(opts, &token, msg, sizeof msg);
  if (rc != TSHARE_OK) return fail(err, rc, msg);
  int64_t deadline = ts_deadline(timeout_ms);
  for (;;) {
    int fd = accept4(l->fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      tshare_error why;
      rc = serve_one(l, fd, token, opts, deadline, out, &why);
      if (rc == TSHARE_OK || rc == TSHARE_E_NOMEM || rc == TSHARE_E_UNSUPPORTED) return fail(err, rc, why.message);
      TS_LOG(TS_LOG_WARN, "%s: a peer was dropped: %s", l->text, why.message);
      snprintf(dropped, sizeof dropped, "%s", why.message);
      continue; /* the next peer may be good */
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK)
      return fail(err, ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "accept on %s", l->text), msg);
    int left = ts_remaining(deadline);
    if (left == 0) {
      if (dropped[0])
        ts_errf(msg, sizeof msg, TSHARE_E_TIMEOUT, "accept: no usable peer on %s in time; the last one was dropped: %s",
                l->text, dropped);
      else
        ts_errf(msg, sizeof msg, TSHARE_E_TIMEOUT, "accept: nobody connected to %s in time", l->text);
      return fail(err, TSHARE_E_TIMEOUT, msg);
    }
    struct pollfd p = {l->fd, POLLIN, 0};
    if (poll(&p, 1, left) < 0 && errno != EINTR)
      return fail(err, ts_errsys(msg, sizeof msg, TSHARE_E_SYSTEM, errno, "accept: poll"), msg);
  }
}

/* A TCP connection to sa by the deadline: the fd, or -1 with errno
 * (ECONNREFUSED while nobody listens yet, ETIMEDOUT). */
static int tcp_connect(const struct sockaddr_in *sa, int64_t deadline) {
  int fd = tcp_socket();
  if (fd < 0) return -1;
  if (connect(fd, (const struct sockaddr *)sa, sizeof *sa) == 0) return fd;
  while (errno == EINPROGRESS || errno == EINTR) {
    struct pollfd p = {fd, POLLOUT, 0};
    int left = ts_remaining(deadline);
    int n = left == 0 ? 0 : poll(&p, 1, left);
    if (n == 0) {
      errno = ETIMEDOUT;
      break;
    }
    if (n < 0) continue; /* EINTR */
    int so_error = 0;
    socklen_t len = sizeof so_error;
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
    if (so_error == 0) return fd;
    errno = so_error;
    break;
  }
  int e = errno;
  close(fd);
  errno = e;
  return -1;
}

/* Connect, retrying while nobody listens, until the deadline. */
static int reach(const ts_ucx_address *a, const struct sockaddr_in *sa, int64_t deadline, int *fd, char *msg,
                 size_t cap) {
  for (;;) {
    *fd = tcp_connect(sa, deadline);
    if (*fd >= 0) return TSHARE_OK;
    int e = errno, left = ts_remaining(deadline);
    if (e != ECONNREFUSED && e != ETIMEDOUT && e != EHOSTUNREACH && e != ENETUNREACH)
      return ts_errsys(msg, cap, TSHARE_E_SYSTEM, e, "connect: %s:%u", a->host, a->port);
    if (left == 0)
      return ts_errsys(msg, cap, TSHARE_E_NOT_FOUND, e, "connect: nobody listens at %s:%u", a->host, a->port);
    usleep(1000u * (unsigned)(left < 0 || left > CONNECT_RETRY_MS ? CONNECT_RETRY_MS : left));
  }
}

int ts_ucx_connect(const char *address, const tshare_channel_options *opts, int timeout_ms, tshare_channel **out,
                   tshare_error *err) {
  char msg[TSHARE_ERROR_MSG_MAX];
  ts_ucx_address a;
  struct sockaddr_in sa;
  const char *token = NULL;
  ts_ucx_endpoint *e = NULL;
  const void *addr = NULL;
  size_t addr_len = 0;
  int fd = -1;
  int64_t deadline = ts_deadline(timeout_ms);
  int rc = ts_ucx_parse_address(address, &a, msg, sizeof msg);
  if (rc == TSHARE_OK) rc = token_of(opts, &token, msg, sizeof msg);
  if (rc == TSHARE_OK) rc = ts_ucx_endpoint_new(&e, &addr, &addr_len, msg, sizeof msg);
  if (rc == TSHARE_OK) rc = resolve(&a, false, &sa, msg, sizeof msg);
  if (rc == TSHARE_OK) rc = reach(&a, &sa, deadline, &fd, msg, sizeof msg);
  if (rc == TSHARE_OK) rc = send_offer(fd, a.name, token, addr, addr_len, deadline, msg, sizeof msg);
  boot_message m = {0};
  if (rc == TSHARE_OK) rc = recv_message(fd, false, &m, deadline, msg, sizeof msg);
  if (rc == TSHARE_OK && m.status != TSHARE_OK)
    rc = ts_errf(msg, sizeof msg, m.status, "connect: the listener refused: %.*s", (int)m.len[0],
                 (const char *)m.part[0]);
  if (rc == TSHARE_OK) {
    rc = open_on(e, m.part[1], m.len[1], fd, opts, deadline, out, err); /* e and fd are the channel's now */
    free(m.body);
    return rc;
  }
  free(m.body);
  ts_ucx_endpoint_free(e);
  if (fd >= 0) close(fd);
  return fail(err, rc, msg);
}
