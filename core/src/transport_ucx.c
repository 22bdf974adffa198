/* The UCX transport (transport_ucx.h): a byte stream whose bytes ride in
 * UCP active messages, so the connection's stream functions (the decoder,
 * tails, read-ahead) serve it unchanged. No fds travel, the kernel names no
 * peer, and the peer may run on another host: its caps claim none of that.
 *
 * Trust: the peer is authenticated by the bootstrap's token before any of
 * this runs; what it sends is still only bytes for the decoder. An active
 * message UCX could deliver only in rendezvous mode (too large for eager
 * sends, which tshare's are) ends the stream as a protocol error.
 *
 * Threads: the driving thread reads, any thread may write (under the
 * connection's send_lock); one mutex per endpoint covers every UCP call on
 * its worker, and the callbacks run inside those calls.
 *
 * Waking: the connection polls rfd, an epoll fd holding the worker's event
 * fd, the bootstrap socket and an eventfd of the liveness thread's. A read
 * that finds nothing arms the worker (ucp_worker_arm) before it says
 * EAGAIN, so the poll wakes on the next message; the bootstrap socket wakes
 * it when the peer's process is gone.
 *
 * Liveness (ucx_liveness.h): the liveness thread drives every endpoint a
 * few times per heartbeat interval: it takes what came (the peer's
 * heartbeats, which never reach the decoder, and stream bytes, which it
 * announces on the eventfd), sends this end's heartbeat when this end was
 * quiet, and declares a silent peer dead (the eventfd again: a poll loop
 * wakes, the next read ends the stream). */
#include "transport_ucx.h"

#include "clock.h"
#include "conn.h"
#include "error_detail.h"
#include "ucx_api.h"
#include "ucx_liveness.h"
#include "vec.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define UCX_AM_STREAM 0x7453u              /* the active message id of stream bytes */
#define UCX_AM_HEARTBEAT 0x7454u           /* the active message id of heartbeats: never stream bytes */
#define UCX_IDLE_TAKE_MAX (16u << 20)      /* unread bytes beyond which the liveness thread takes no more */
#define UCX_INBOX_MAX (256u << 20)         /* bytes received and not yet read, beyond which the peer is cut off */
#define UCX_OUTSTANDING_MAX (64u << 20)    /* bytes handed to UCX and not yet sent: beyond, a write waits */
#define UCX_LAST_WORDS_NS (50 * 1000000LL) /* after the peer's socket closed: how long its last messages may lag */
#define UCX_CLOSE_NS (200 * 1000000LL)     /* how long a close waits for UCX to send what it holds */
#define UCX_SEND_NOW_NS (2 * 1000000LL)    /* how long a write drives its message out before it returns */

struct ts_ucx_endpoint {
  pthread_mutex_t lock; /* every UCP call on worker; the fields below */
  const ts_ucx_api *ucx;
  ts_ucp_worker_h worker;
  ts_ucp_ep_h ep;
  ts_ucp_address *address; /* this worker's, until connected */
  size_t address_len;
  int boot_fd;  /* the bootstrap socket: its end is the peer's */
  int epoll_fd; /* the connection's rfd */
  int room_fd;  /* the connection's wfd: an eventfd, always writable */
  uint8_t *inbox;
  size_t in_len, in_off, in_cap;
  size_t outstanding; /* bytes of sends not yet completed */
  bool peer_failed;   /* UCX's error handler ran, or the peer's socket ended */
  bool ucx_failed;    /* UCX's error handler ran: what came before the failure was taken */
  bool last_words;    /* the lag after the peer's socket ended was waited out */
  bool broken;        /* a rendezvous message or an overfull inbox: the stream is lost */
  bool silent;        /* the liveness thread heard nothing for the peer timeout */
  bool heard, sent;   /* a message came from / went to the peer since the last tick */
  bool watched;       /* the liveness thread ticks this endpoint */
  int wake_fd;        /* in epoll_fd: the liveness thread says "read now" */
  ts_ucx_liveness live;
  uint8_t heartbeat[TS_UCX_HEARTBEAT_LEN]; /* the payload, alive as long as the endpoint */
};

typedef struct ucx_send {
  ts_ucx_endpoint *e;
  size_t len;
  uint8_t bytes[];
} ucx_send;

/* Endpoints connected and not yet claimed by a connection, by their rfd. */
TS_VEC_DEFINE(ucx_endpoint_vec, ts_ucx_endpoint *)
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static ucx_endpoint_vec registry;

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- callbacks (inside ucp_worker_progress, lock held) ----------------- */

/* Room in the inbox for len more bytes: what was read moves out first. */
static bool inbox_room(ts_ucx_endpoint *e, size_t len) {
  if (e->in_off > 0) {
    memmove(e->inbox, e->inbox + e->in_off, e->in_len - e->in_off);
    e->in_len -= e->in_off;
    e->in_off = 0;
  }
  if (e->in_len + len <= e->in_cap) return true;
  size_t cap = e->in_cap ? e->in_cap : 65536;
  while (cap < e->in_len + len) cap *= 2;
  uint8_t *grown = realloc(e->inbox, cap);
  if (!grown) return false;
  e->inbox = grown;
  e->in_cap = cap;
  return true;
}

static ts_ucs_status on_bytes(void *arg, const void *header, size_t header_len, void *data, size_t len,
                              const ts_ucp_am_recv_param *param) {
  (void)header, (void)header_len;
  ts_ucx_endpoint *e = arg;
  bool rendezvous = (param->recv_attr & TS_UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (rendezvous || e->in_len - e->in_off + len > UCX_INBOX_MAX || !inbox_room(e, len)) {
    e->broken = true;
    return TS_UCS_OK;
  }
  memcpy(e->inbox + e->in_len, data, len);
  e->in_len += len;
  e->heard = true;
  return TS_UCS_OK;
}

/* The peer's heartbeat: life, and its interval. */
static ts_ucs_status on_heartbeat(void *arg, const void *header, size_t header_len, void *data, size_t len,
                                  const ts_ucp_am_recv_param *param) {
  (void)header, (void)header_len, (void)param;
  ts_ucx_endpoint *e = arg;
  e->heard = true;
  int interval = ts_ucx_heartbeat_decode(data, len);
  if (interval) e->live.peer_heartbeat_ms = interval;
  return TS_UCS_OK;
}

static void on_peer_error(void *arg, ts_ucp_ep_h ep, ts_ucs_status status) {
  (void)ep, (void)status;
  ts_ucx_endpoint *e = arg;
  e->peer_failed = e->ucx_failed = true;
}

static void on_sent(void *request, ts_ucs_status status, void *user_data) {
  (void)status; /* a failed send is the peer's failure, which the error handler reports */
  ucx_send *s = user_data;
  s->e->outstanding -= s->len;
  s->e->ucx->ucp_request_free(request);
  free(s);
}

/* ---- making and freeing ------------------------------------------------ */

int ts_ucx_endpoint_new(ts_ucx_endpoint **out, const void **address, size_t *address_len, char *msg, size_t cap) {
  *out = NULL;
  int status;
  const char *why;
  const ts_ucx_api *ucx = ts_ucx(&status, &why);
  if (!ucx) return ts_errf(msg, cap, status, "%s", why);
  ts_ucx_endpoint *e = calloc(1, sizeof *e);
  if (!e) return ts_errf(msg, cap, TSHARE_E_NOMEM, "ucx: out of memory");
  pthread_mutex_init(&e->lock, NULL);
  e->ucx = ucx;
  e->boot_fd = e->epoll_fd = e->room_fd = e->wake_fd = -1;
  int rc = ts_ucx_liveness_init(&e->live, msg, cap);
  if (rc != TSHARE_OK) {
    pthread_mutex_destroy(&e->lock);
    free(e);
    return rc;
  }
  ts_ucx_heartbeat_encode(e->heartbeat, e->live.heartbeat_ms);
  ts_ucp_worker_params wp = {.field_mask = TS_UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                             .thread_mode = TS_UCS_THREAD_MODE_SERIALIZED};
  ts_ucs_status st = ucx->ucp_worker_create(ucx->context, &wp, &e->worker);
  if (st == TS_UCS_OK) {
    ts_ucp_am_handler_param hp = {.field_mask = TS_UCP_AM_HANDLER_PARAM_FIELD_ID | TS_UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                                                TS_UCP_AM_HANDLER_PARAM_FIELD_CB | TS_UCP_AM_HANDLER_PARAM_FIELD_ARG,
                                  .id = UCX_AM_STREAM,
                                  .flags = TS_UCP_AM_FLAG_WHOLE_MSG,
                                  .cb = on_bytes,
                                  .arg = e};
    st = ucx->ucp_worker_set_am_recv_handler(e->worker, &hp);
    hp.id = UCX_AM_HEARTBEAT;
    hp.cb = on_heartbeat;
    if (st == TS_UCS_OK) st = ucx->ucp_worker_set_am_recv_handler(e->worker, &hp);
    if (st == TS_UCS_OK) st = ucx->ucp_worker_get_address(e->worker, &e->address, &e->address_len);
  } else {
    e->worker = NULL;
  }
  if (st != TS_UCS_OK) {
    ts_ucx_endpoint_free(e);
    return ts_errf(msg, cap, TSHARE_E_SYSTEM, "ucx: making a worker failed: %s", ucx->ucs_status_string(st));
  }
  *address = e->address;
  *address_len = e->address_len;
  *out = e;
  return TSHARE_OK;
}

/* Progress until req is done or the deadline (ns, 0: none) passed; the
 * request is freed either way. Whether it completed with success. */
static bool finish(ts_ucx_endpoint *e, void *req, int64_t until) {
  if (!req) return true;
  if (TS_UCS_PTR_IS_ERR(req)) return false;
  ts_ucs_status st;
  while ((st = e->ucx->ucp_request_check_status(req)) == TS_UCS_INPROGRESS && (!until || now_ns() < until))
    if (!e->ucx->ucp_worker_progress(e->worker)) usleep(100);
  e->ucx->ucp_request_free(req);
  return st == TS_UCS_OK;
}

/* Let UCX send what it holds, for up to UCX_CLOSE_NS: a clean close sends
 * what was queued (the bye among it) before the peer's socket ends. */
static void close_ep(ts_ucx_endpoint *e) {
  ts_ucp_request_param p = {0};
  if (e->peer_failed) p.op_attr_mask = TS_UCP_OP_ATTR_FIELD_FLAGS, p.flags = TS_UCP_EP_CLOSE_FLAG_FORCE;
  (void)finish(e, e->ucx->ucp_ep_close_nbx(e->ep, &p), now_ns() + UCX_CLOSE_NS);
  e->ep = NULL;
}

void ts_ucx_endpoint_free(ts_ucx_endpoint *e) {
  if (!e) return;
  if (e->watched) ts_ucx_liveness_unwatch(e); /* first: its ticks use everything below */
  if (e->ep) close_ep(e);
  if (e->address) e->ucx->ucp_worker_release_address(e->worker, e->address);
  if (e->worker) {
    for (int i = 0; i < 64 && e->ucx->ucp_worker_progress(e->worker); i++) {
    } /* completions of cancelled sends free their copies */
    e->ucx->ucp_worker_destroy(e->worker);
  }
  if (e->boot_fd >= 0) close(e->boot_fd);
  if (e->wake_fd >= 0) close(e->wake_fd);
  free(e->inbox);
  pthread_mutex_destroy(&e->lock);
  free(e);
}

/* The epoll fd the connection polls and the always-writable eventfd its
 * send waits poll. */
static int make_fds(ts_ucx_endpoint *e, char *msg, size_t cap) {
  int efd;
  ts_ucs_status st = e->ucx->ucp_worker_get_efd(e->worker, &efd);
  if (st != TS_UCS_OK)
    return ts_errf(msg, cap, TSHARE_E_SYSTEM, "ucx: the worker has no event fd: %s", e->ucx->ucs_status_string(st));
  e->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
  e->room_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  e->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  struct epoll_event worker_ev = {.events = EPOLLIN}, boot_ev = {.events = EPOLLIN | EPOLLRDHUP},
                     wake_ev = {.events = EPOLLIN};
  if (e->epoll_fd < 0 || e->room_fd < 0 || e->wake_fd < 0 || epoll_ctl(e->epoll_fd, EPOLL_CTL_ADD, efd, &worker_ev) != 0 ||
      epoll_ctl(e->epoll_fd, EPOLL_CTL_ADD, e->boot_fd, &boot_ev) != 0 ||
      epoll_ctl(e->epoll_fd, EPOLL_CTL_ADD, e->wake_fd, &wake_ev) != 0)
    return ts_errsys(msg, cap, TSHARE_E_SYSTEM, errno, "ucx: epoll");
  return TSHARE_OK;
}

/* Wire the endpoint up now (a flush waits for it), not on the first frame:
 * a peer that sends and then stops driving its channel must not strand it. */
static int wire_up(ts_ucx_endpoint *e, int timeout_ms, char *msg, size_t cap) {
  ts_ucp_request_param p = {0};
  int64_t until = now_ns() + (int64_t)(timeout_ms > 0 ? timeout_ms : 1) * 1000000LL;
  if (finish(e, e->ucx->ucp_ep_flush_nbx(e->ep, &p), until) && !e->peer_failed) return TSHARE_OK;
  return ts_errf(msg, cap, TSHARE_E_PEER_CLOSED, "ucx: the connection to the peer's worker did not come up in %d ms",
                 timeout_ms);
}

static void liveness_tick(void *item);

static int watch(ts_ucx_endpoint *e, char *msg, size_t cap) {
  e->live.last_heard_ms = e->live.last_sent_ms = ts_now_ms(); /* the silence counts from the connection */
  int rc = ts_ucx_liveness_watch(e, liveness_tick, e->live.heartbeat_ms, msg, cap);
  e->watched = rc == TSHARE_OK;
  return rc;
}

int ts_ucx_endpoint_connect(ts_ucx_endpoint *e, const void *peer_address, size_t len, int boot_fd, int timeout_ms,
                            int *rfd, int *wfd, char *msg, size_t cap) {
  (void)len; /* the address carries its own length; the bootstrap bounded it */
  e->boot_fd = boot_fd;
  e->ucx->ucp_worker_release_address(e->worker, e->address);
  e->address = NULL;
  ts_ucp_ep_params ep = {.field_mask = TS_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | TS_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                       TS_UCP_EP_PARAM_FIELD_ERR_HANDLER,
                         .address = peer_address,
                         .err_mode = TS_UCP_ERR_HANDLING_MODE_PEER,
                         .err_handler = {on_peer_error, e}};
  ts_ucs_status st = e->ucx->ucp_ep_create(e->worker, &ep, &e->ep);
  int rc = st == TS_UCS_OK ? TSHARE_OK
                           : ts_errf(msg, cap, TSHARE_E_PEER_CLOSED, "ucx: connecting to the peer's worker failed: %s",
                                     e->ucx->ucs_status_string(st));
  if (st != TS_UCS_OK) e->ep = NULL;
  if (rc == TSHARE_OK) rc = wire_up(e, timeout_ms, msg, cap);
  if (rc == TSHARE_OK) rc = make_fds(e, msg, cap);
  if (rc == TSHARE_OK) rc = watch(e, msg, cap);
  if (rc == TSHARE_OK) {
    pthread_mutex_lock(&registry_lock);
    if (ucx_endpoint_vec_push(&registry, e) != TSHARE_OK) rc = ts_errf(msg, cap, TSHARE_E_NOMEM, "ucx: out of memory");
    pthread_mutex_unlock(&registry_lock);
  }
  if (rc != TSHARE_OK) {
    if (e->epoll_fd >= 0) close(e->epoll_fd);
    if (e->room_fd >= 0) close(e->room_fd);
    ts_ucx_endpoint_free(e);
    return rc;
  }
  *rfd = e->epoll_fd;
  *wfd = e->room_fd;
  return TSHARE_OK;
}

/* ---- the transport table ----------------------------------------------- */

static int ucx_check(ts_conn *c) {
  ts_ucx_endpoint *e = NULL;
  pthread_mutex_lock(&registry_lock);
  for (size_t i = 0; i < registry.len && !e; i++)
    if (registry.items[i]->epoll_fd == c->rfd && registry.items[i]->room_fd == c->wfd) {
      e = registry.items[i];
      ucx_endpoint_vec_remove(&registry, i, 1);
    }
  pthread_mutex_unlock(&registry_lock);
  if (!e)
    return ts_errf(c->err, c->err_cap, TSHARE_E_INVALID_ARG, "channel: fds %d/%d are not a UCX endpoint's", c->rfd,
                   c->wfd);
  c->stream_data = e;
  return TSHARE_OK;
}

/* Whether the peer's bootstrap socket ended (its process is gone, or it
 * closed the channel). */
static bool boot_socket_ended(ts_ucx_endpoint *e) {
  char byte;
  ssize_t r = recv(e->boot_fd, &byte, 1, MSG_DONTWAIT | MSG_PEEK);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

static void progress_all(ts_ucx_endpoint *e) {
  while (e->ucx->ucp_worker_progress(e->worker)) {
  }
}

/* The peer's socket ended: messages it sent just before may still be on
 * their way over UCX's own connections. Taken for a short while, once, or
 * until UCX itself reports the peer gone (it took what came before). */
static void take_last_words(ts_ucx_endpoint *e) {
  int64_t until = now_ns() + UCX_LAST_WORDS_NS;
  while (e->in_off == e->in_len && !e->broken && !e->ucx_failed && now_ns() < until) {
    progress_all(e);
    if (e->in_off == e->in_len) usleep(1000);
  }
  e->last_words = true;
}

/* Bytes received, 0 at the peer's end, or -1 with errno (EAGAIN once the
 * worker is armed: the epoll fd wakes on the next message). */
static ssize_t read_locked(ts_ucx_endpoint *e, uint8_t *buf, size_t cap) {
  for (;;) {
    progress_all(e);
    if (e->in_off < e->in_len) {
      size_t n = e->in_len - e->in_off < cap ? e->in_len - e->in_off : cap;
      memcpy(buf, e->inbox + e->in_off, n);
      e->in_off += n;
      return (ssize_t)n;
    }
    if (e->broken) {
      errno = EPROTO;
      return -1;
    }
    if (e->silent) { /* the link is gone, not the process: nothing more will come */
      errno = ETIMEDOUT;
      return -1;
    }
    if (!e->peer_failed && boot_socket_ended(e)) e->peer_failed = true;
    if (e->peer_failed && !e->last_words) {
      take_last_words(e);
      continue;
    }
    if (e->peer_failed) return 0;
    uint64_t woken;
    if (read(e->wake_fd, &woken, sizeof woken) < 0 && errno != EAGAIN) { /* the inbox was looked at: taken */
    }
    ts_ucs_status st = e->ucx->ucp_worker_arm(e->worker);
    if (st == TS_UCS_ERR_BUSY) continue; /* events came meanwhile: progress them first */
    errno = st == TS_UCS_OK ? EAGAIN : EIO;
    return -1;
  }
}

/* One heartbeat, eager, its request let go at once (UCX frees it when sent). */
static void send_heartbeat(ts_ucx_endpoint *e) {
  ts_ucp_request_param p = {.op_attr_mask = TS_UCP_OP_ATTR_FIELD_FLAGS, .flags = TS_UCP_AM_SEND_FLAG_EAGER};
  void *req = e->ucx->ucp_am_send_nbx(e->ep, UCX_AM_HEARTBEAT, NULL, 0, e->heartbeat, sizeof e->heartbeat, &p);
  if (req && TS_UCS_PTR_IS_ERR(req))
    e->peer_failed = true;
  else if (req)
    e->ucx->ucp_request_free(req);
}

/* The liveness thread's turn (ucx_liveness.h), lock held inside. Past
 * UCX_IDLE_TAKE_MAX unread bytes it takes no more (UCX's own flow control
 * then slows the peer, as an unread socket would) and counts the unread
 * bytes as life: the peer's liveness is not what holds this end up. */
static void liveness_tick(void *item) {
  ts_ucx_endpoint *e = item;
  pthread_mutex_lock(&e->lock);
  int64_t now = ts_now_ms();
  if (e->in_len - e->in_off < UCX_IDLE_TAKE_MAX)
    progress_all(e);
  else
    e->heard = true;
  if (e->heard) e->live.last_heard_ms = now;
  if (e->sent) e->live.last_sent_ms = now;
  e->heard = e->sent = false;
  if (!e->peer_failed && ts_ucx_heartbeat_due(&e->live, now)) {
    send_heartbeat(e);
    e->live.last_sent_ms = now;
  }
  if (!e->peer_failed && ts_ucx_peer_silent(&e->live, now)) e->peer_failed = e->silent = true;
  if (e->in_off < e->in_len || e->peer_failed || e->broken) {
    uint64_t one = 1;
    if (write(e->wake_fd, &one, sizeof one) < 0) { /* a full counter is awake already */
    }
  }
  pthread_mutex_unlock(&e->lock);
}

static ssize_t ucx_read(ts_conn *c, uint8_t *buf, size_t cap) {
  ts_ucx_endpoint *e = c->stream_data;
  pthread_mutex_lock(&e->lock);
  ssize_t r = read_locked(e, buf, cap);
  pthread_mutex_unlock(&e->lock);
  if (r > 0) c->rx_bytes += (uint64_t)r;
  return r;
}

/* One active message with a copy of the bytes (UCX owns it until sent). */
static ssize_t write_locked(ts_ucx_endpoint *e, const uint8_t *buf, size_t len) {
  e->ucx->ucp_worker_progress(e->worker);
  if (e->peer_failed) {
    errno = EPIPE;
    return -1;
  }
  if (e->outstanding > UCX_OUTSTANDING_MAX) {
    errno = EAGAIN;
    return -1;
  }
  ucx_send *s = malloc(sizeof *s + len);
  if (!s) {
    errno = ENOMEM;
    return -1;
  }
  s->e = e;
  s->len = len;
  memcpy(s->bytes, buf, len);
  ts_ucp_request_param p = {
      .op_attr_mask = TS_UCP_OP_ATTR_FIELD_CALLBACK | TS_UCP_OP_ATTR_FIELD_USER_DATA | TS_UCP_OP_ATTR_FIELD_FLAGS,
      .flags = TS_UCP_AM_SEND_FLAG_EAGER,
      .send_cb = on_sent,
      .user_data = s};
  void *req = e->ucx->ucp_am_send_nbx(e->ep, UCX_AM_STREAM, NULL, 0, s->bytes, len, &p);
  if (!req || TS_UCS_PTR_IS_ERR(req)) {
    free(s);
    if (req) {
      e->peer_failed = true;
      errno = EPIPE;
      return -1;
    }
  } else {
    e->sent = true;
    e->outstanding += len;
    /* A moment's progress lets it leave now: a sender that stops driving
     * its channel after this (a role that exits) must not strand it. */
    int64_t until = now_ns() + UCX_SEND_NOW_NS;
    while (e->ucx->ucp_request_check_status(req) == TS_UCS_INPROGRESS && now_ns() < until)
      e->ucx->ucp_worker_progress(e->worker);
  }
  return (ssize_t)len;
}

static ssize_t ucx_write(ts_conn *c, const uint8_t *buf, size_t len, int fd) {
  if (fd >= 0) { /* the connection refuses fds on a transport without them: never here */
    errno = EINVAL;
    return -1;
  }
  ts_ucx_endpoint *e = c->stream_data;
  pthread_mutex_lock(&e->lock);
  ssize_t r = write_locked(e, buf, len);
  pthread_mutex_unlock(&e->lock);
  return r;
}

/* Bytes received and not yet delivered: the decoder's and the inbox's. */
static size_t ucx_buffered(ts_conn *c) {
  ts_ucx_endpoint *e = c->stream_data;
  size_t inbox = 0;
  if (e) {
    pthread_mutex_lock(&e->lock);
    inbox = e->in_len - e->in_off;
    pthread_mutex_unlock(&e->lock);
  }
  return ts_stream_buffered(c) + inbox;
}

/* A forked child's copy lets go of the bootstrap socket only, so that the
 * peer sees the end when the parent goes: the worker is the parent's. */
static void ucx_close(ts_conn *c, bool fork_copy) {
  ts_ucx_endpoint *e = c->stream_data;
  if (e && fork_copy && e->boot_fd >= 0) close(e->boot_fd);
  if (e && !fork_copy) ts_ucx_endpoint_free(e);
  c->stream_data = NULL;
  ts_stream_close(c, fork_copy);
}

bool ts_ucx_link_of(const ts_conn *c, ts_ucx_link *out) {
  ts_ucx_endpoint *e = c->stream == &ts_transport_ucx ? c->stream_data : NULL;
  if (!e || !e->ep) return false;
  *out = (ts_ucx_link){e->worker, e->ep, &e->lock};
  return true;
}

bool ts_ucx_peer_failed_locked(const ts_conn *c) {
  const ts_ucx_endpoint *e = c->stream == &ts_transport_ucx ? c->stream_data : NULL;
  return !e || e->peer_failed || e->broken;
}

const ts_transport ts_transport_ucx = {
    .name = "ucx",
    .caps = 0, /* no fds, no kernel word on the peer, not necessarily this host, no shared memory */
    .check = ucx_check,
    .read = ucx_read,
    .write = ucx_write,
    .send = ts_stream_send,
    .send_now = ts_stream_send_now,
    .fill = ts_stream_fill,
    .recv = ts_stream_recv,
    .wait = ts_stream_wait,
    .poll_fd = ts_stream_poll_fd,
    .buffered = ucx_buffered, /* the inbox besides the decoder */
    .close = ucx_close,
};
