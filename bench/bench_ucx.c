/* tshare-bench's UCX rows: host memory across two network namespaces
 * joined by a veth pair (UCX_TLS=tcp), tshare beside raw UCP doing the same
 * steps in the same run:
 *
 *   raw UCP   the producer sends an active message with the region's
 *             address and packed key (unpacked once by the consumer), the
 *             consumer reads it with ucp_get_nbx into a buffer of its own and
 *             answers with an active message; both wait as an event loop
 *             does (progress, arm the worker, poll its fd), as tshare does
 *   tshare    tshare_share_host() on a ucx:// channel, the consumer's
 *             tshare_view_recv() (the read) and release, the producer's
 *             tshare_channel_wait_released()
 *
 * Rows: a 4 KiB round trip (share to release) each way, the bandwidth of
 * 64 MiB (tshare: share to release; raw: the consumer's get alone), and a
 * model's 290 host tensors as one tensor set (tshare_set_send to its
 * release: every buffer read once), the first hand-off and the update.
 * Skipped with the reason where UCX, root or `ip netns` is missing. */
#include "bench.h"
#include "bench_ucx_common.h"

#include "tshare/hostmem.h"
#include "tshare/set.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define SMALL_FLOATS 1024 /* the native row's share: 4 KiB */

/* The rows and targets, not measured: why (the set rows too unless they
 * were measured). */
static void skip_all(bench *b, const char *why, bool sets_too) {
  br_skip(&b->rep, BR_LATENCY, "latency", "ucx_share_4k", "ucx: 4 KiB host share round trip [veth, tcp]", why);
  br_skip(&b->rep, BR_VALUE, "bandwidth", "ucx_share_64m", "ucx: 64 MiB host share, share to release", why);
  if (sets_too) {
    br_skip(&b->rep, BR_LATENCY, "sets", "sets_ucx_cpu_first_1", "ucx: one set of 290 tensors, first [veth, tcp]",
            why);
    br_skip(&b->rep, BR_LATENCY, "sets", "sets_ucx_cpu_update_1", "ucx: one set of 290 tensors, update [veth, tcp]",
            why);
  }
  br_target_add(&b->rep, "ucx: 4 KiB share round trip <= 1.2x raw UCP AM + get + AM", -1, "not measured: %s", why);
  br_target_add(&b->rep, "ucx: 64 MiB share >= 0.9x raw ucp_get_nbx bandwidth", -1, "not measured: %s", why);
}

/* ---- same host: the native path -------------------------------------------- */

/* A channel opened by name on this host (tshare_listen / tshare_connect)
 * never goes over UCX: UCX is used only where a ucx:// address asks for it.
 * The row is the 4 KiB host share round trip on such a channel, its label
 * naming the transport it chose; the target checks that it is not UCX. */
static void native_consumer(const char *name) {
  tshare_channel *ch = NULL;
  if (tshare_connect(name, NULL, 10000, &ch, NULL) != TSHARE_OK) _exit(1);
  for (;;) {
    tshare_view *v;
    if (tshare_view_recv(ch, BENCH_TIMEOUT_MS, &v) != TSHARE_OK) break; /* the producer's bye ends it */
    tshare_view_release(v);
  }
  tshare_channel_close(ch);
  _exit(0);
}

static void native_row(bench *b, long iters) {
  char name[64], why[300] = "";
  snprintf(name, sizeof name, "tshare-bench-native-%ld", (long)getpid());
  tshare_listener *l = NULL;
  tshare_error err;
  if (tshare_listen(name, &l, &err) != TSHARE_OK) snprintf(why, sizeof why, "%s", err.message);
  pid_t pid = l ? fork() : -1;
  if (pid == 0) native_consumer(name);
  tshare_channel *ch = NULL;
  if (pid > 0 && tshare_listener_accept(l, NULL, 10000, &ch, &err) != TSHARE_OK) snprintf(why, sizeof why, "%s", err.message);
  if (l) tshare_listener_close(l);
  tshare_host_buffer *buf = NULL;
  int64_t n = SMALL_FLOATS;
  tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, &n, 0);
  bs_samples ts = {0};
  if (ch && tshare_host_buffer_create(SMALL_FLOATS * 4, "bench-native", &buf, &err) == TSHARE_OK)
    for (long i = 0; i < iters; i++) {
      uint64_t id, t0 = bs_now_ns();
      if (tshare_share_host(ch, buf, &d, NULL, NULL, 10000, &id) != TSHARE_OK ||
          tshare_channel_wait_released(ch, id, 10000) != TSHARE_OK) {
        snprintf(why, sizeof why, "%s", tshare_channel_last_error(ch));
        break;
      }
      bs_add(&ts, (double)(bs_now_ns() - t0));
    }
  tshare_transport kind = ch ? tshare_channel_transport(ch) : TSHARE_TRANSPORT_DEFAULT;
  const char *kind_name = kind == TSHARE_TRANSPORT_RING ? "ring" : kind == TSHARE_TRANSPORT_SOCKET ? "socket" : "ucx";
  if (ch) tshare_channel_close(ch);
  if (buf) tshare_host_buffer_destroy(buf);
  if (pid > 0) waitpid(pid, NULL, 0);
  if (why[0] || !ts.n) {
    br_skip(&b->rep, BR_LATENCY, "latency", "ucx_same_host_native", "same host, a channel by name: 4 KiB host share",
            why[0] ? why : "no round trip");
    br_target_add(&b->rep, "ucx: a same-host channel by name never uses UCX", -1, "not measured: %s", why);
  } else {
    char label[96];
    snprintf(label, sizeof label, "same host, a channel by name: 4 KiB host share [%s]", kind_name);
    br_row *row = bench_latency_row(b, "ucx_same_host_native", label, &ts, NULL, NULL);
    snprintf(row->note, sizeof row->note, "share to release: the native path (an fd, mapped), never UCX");
    br_target_add(&b->rep, "ucx: a same-host channel by name never uses UCX", kind != TSHARE_TRANSPORT_UCX,
                  "the transport chosen: %s", kind_name);
  }
  bs_free(&ts);
}

#ifdef TSHARE_BENCH_HAVE_UCP
#include <ucp/api/ucp.h>

#define SMALL 4096
#define BIG (64u << 20)
#define BIG_ROUNDS 5
#define UCX_ITERS_MAX 2000
#define AM_OFFER 11
#define AM_DONE 12
#define PORT 7790
/* The set rows' model: a 24-layer transformer's 290 bf16 tensors (4
 * attention weights and biases, 2 MLP weights, 2 norms per layer; the
 * embedding and the final norm), each in a buffer of its own, as a
 * state_dict's storages are. Hidden 256 on this CPU path: ~37 MiB. */
#define SET_HIDDEN 256
#define SET_TENSORS BENCH_MODEL_TENSORS
#define SET_ROUNDS 10

typedef struct ucx_results {
  int ok;
  char why[160];
  long n_raw, n_ts;
  double raw_ns[UCX_ITERS_MAX], ts_ns[UCX_ITERS_MAX];
  double raw_get_s, ts_big_s; /* the best of BIG_ROUNDS */
  double set_first_ns, set_update_ns[SET_ROUNDS];
  double set_mib;
  int sets_ok; /* the set rows were measured (before the shares) */
} ucx_results;

static char ns[2][32];
static int net;

static int sh(const char *cmd) {
  int rc = system(cmd);
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

static void namespaces_remove(void) {
  char cmd[160];
  for (int i = 0; i < 2; i++)
    if (ns[i][0]) {
      snprintf(cmd, sizeof cmd, "ip netns delete %s 2>/dev/null", ns[i]);
      (void)sh(cmd);
      ns[i][0] = '\0';
    }
}

/* Two namespaces, 10.78.N.1 and .2 on a veth pair; 0 or the reason in why. */
static int namespaces_make(char *why, size_t cap) {
  if (geteuid() != 0) return snprintf(why, cap, "network namespaces need root"), -1;
  long id = (long)getpid() % 100000;
  net = (int)(id % 250) + 1;
  snprintf(ns[0], sizeof ns[0], "tsbench-%ld-a", id);
  snprintf(ns[1], sizeof ns[1], "tsbench-%ld-b", id);
  char cmd[1024];
  snprintf(cmd, sizeof cmd,
           "set -e; ip netns add %1$s; ip netns add %2$s; ip link add tbva%3$ld type veth peer name tbvb%3$ld; "
           "ip link set tbva%3$ld netns %1$s; ip link set tbvb%3$ld netns %2$s; "
           "ip -n %1$s addr add 10.78.%4$d.1/24 dev tbva%3$ld; ip -n %2$s addr add 10.78.%4$d.2/24 dev tbvb%3$ld; "
           "ip -n %1$s link set tbva%3$ld up; ip -n %2$s link set tbvb%3$ld up; "
           "ip -n %1$s link set lo up; ip -n %2$s link set lo up; "
           "for i in $(seq 100); do ip -n %1$s link show tbva%3$ld | grep -q LOWER_UP && "
           "ip -n %2$s link show tbvb%3$ld | grep -q LOWER_UP && exit 0; sleep 0.05; done; exit 1",
           ns[0], ns[1], id, net);
  if (sh(cmd) != 0) {
    namespaces_remove();
    return snprintf(why, cap, "ip netns is not permitted here (or iproute2 is missing)"), -1;
  }
  return 0;
}

/* This process into namespace side, with a sysfs of it (UCX lists the
 * interfaces there). */
static int namespace_enter(int side) {
  char path[96];
  snprintf(path, sizeof path, "/var/run/netns/%s", ns[side]);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  int rc = fd >= 0 && setns(fd, CLONE_NEWNET) == 0 && unshare(CLONE_NEWNS) == 0 &&
                   mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) == 0 && umount2("/sys", MNT_DETACH) == 0 &&
                   mount("sysfs", "/sys", "sysfs", 0, NULL) == 0
               ? 0
               : -1;
  if (fd >= 0) close(fd);
  return rc;
}

/* ---- raw UCP ------------------------------------------------------------------ */

typedef struct raw_end {
  ucp_context_h ctx;
  ucp_worker_h worker;
  ucp_ep_h ep;
  int efd;
  /* what came: an offer (address, length, key) or a done */
  int offers, dones;
  uint64_t address, length;
  uint8_t key[1024];
  size_t key_len;
} raw_end;

static ucs_status_t on_am(void *arg, const void *header, size_t header_len, void *data, size_t len,
                          const ucp_am_recv_param_t *param) {
  (void)header, (void)header_len, (void)param;
  raw_end *r = arg;
  if (len >= 16 && len - 16 <= sizeof r->key) { /* an offer */
    memcpy(&r->address, data, 8);
    memcpy(&r->length, (const char *)data + 8, 8);
    r->key_len = len - 16;
    memcpy(r->key, (const char *)data + 16, r->key_len);
    r->offers++;
  } else {
    r->dones++;
  }
  return UCS_OK;
}

/* Progress until *counter passes seen, sleeping in poll() as an event loop. */
static void wait_for(raw_end *r, int *counter, int seen) {
  while (*counter == seen) {
    if (ucp_worker_progress(r->worker)) continue;
    if (ucp_worker_arm(r->worker) == UCS_ERR_BUSY) continue;
    struct pollfd p = {r->efd, POLLIN, 0};
    (void)poll(&p, 1, 1000);
  }
}

static void finish(raw_end *r, void *req) {
  if (!req || UCS_PTR_IS_ERR(req)) return;
  while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(r->worker);
  ucp_request_free(req);
}

static int raw_open(raw_end *r, int sock) {
  ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                    .features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP};
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
  if (ucp_init(&p, NULL, &r->ctx) != UCS_OK || ucp_worker_create(r->ctx, &wp, &r->worker) != UCS_OK) return -1;
  ucp_am_handler_param_t hp = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                                             UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
                               .flags = UCP_AM_FLAG_WHOLE_MSG,
                               .cb = on_am,
                               .arg = r};
  hp.id = AM_OFFER;
  if (ucp_worker_set_am_recv_handler(r->worker, &hp) != UCS_OK) return -1;
  hp.id = AM_DONE;
  if (ucp_worker_set_am_recv_handler(r->worker, &hp) != UCS_OK) return -1;
  ucp_address_t *mine;
  size_t len;
  if (ucp_worker_get_address(r->worker, &mine, &len) != UCS_OK || ucp_worker_get_efd(r->worker, &r->efd) != UCS_OK)
    return -1;
  /* Worker addresses over the socket pair both ends came from. */
  uint32_t n = (uint32_t)len, peer_n = 0;
  uint8_t peer[4096];
  if (write(sock, &n, 4) != 4 || write(sock, mine, len) != (ssize_t)len || read(sock, &peer_n, 4) != 4 ||
      peer_n > sizeof peer || recv(sock, peer, peer_n, MSG_WAITALL) != (ssize_t)peer_n)
    return -1;
  ucp_worker_release_address(r->worker, mine);
  ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = (ucp_address_t *)peer};
  if (ucp_ep_create(r->worker, &ep, &r->ep) != UCS_OK) return -1;
  ucp_request_param_t fp = {0};
  finish(r, ucp_ep_flush_nbx(r->ep, &fp));
  return 0;
}

static void am(raw_end *r, unsigned id, const void *bytes, size_t len) {
  ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_AM_SEND_FLAG_EAGER};
  finish(r, ucp_am_send_nbx(r->ep, id, NULL, 0, bytes, len, &p));
}

/* The producer: offers its small region iters times, then its big one
 * BIG_ROUNDS times; each offer's round trip (to the consumer's done). */
static void raw_producer(raw_end *r, long iters, ucx_results *out) {
  static uint8_t small[SMALL];
  uint8_t *big = malloc(BIG);
  memset(small, 1, sizeof small);
  memset(big, 2, BIG);
  for (int which = 0; which < 2; which++) {
    void *base = which ? (void *)big : (void *)small;
    size_t size = which ? BIG : SMALL;
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = base,
                               .length = size};
    ucp_mem_h memh;
    void *key;
    size_t key_len;
    ucp_mem_map(r->ctx, &mp, &memh);
    ucp_rkey_pack(r->ctx, memh, &key, &key_len);
    uint8_t offer[16 + 1024];
    uint64_t address = (uint64_t)(uintptr_t)base, length = size;
    memcpy(offer, &address, 8);
    memcpy(offer + 8, &length, 8);
    memcpy(offer + 16, key, key_len);
    long rounds = which ? BIG_ROUNDS : iters;
    for (long i = 0; i < rounds; i++) {
      uint64_t t0 = bs_now_ns();
      int seen = r->dones;
      am(r, AM_OFFER, offer, 16 + key_len);
      wait_for(r, &r->dones, seen);
      if (!which && out->n_raw < UCX_ITERS_MAX) out->raw_ns[out->n_raw++] = (double)(bs_now_ns() - t0);
    }
    ucp_rkey_buffer_release(key);
    ucp_mem_unmap(r->ctx, memh);
  }
  free(big);
}

static void raw_consumer(raw_end *r, long iters, ucx_results *out) {
  static uint8_t small[SMALL];
  uint8_t *big = malloc(BIG);
  memset(big, 0, BIG);
  out->raw_get_s = 1e30;
  for (int which = 0; which < 2; which++) {
    ucp_rkey_h rkey = NULL;
    long rounds = which ? BIG_ROUNDS : iters;
    for (long i = 0; i < rounds; i++) {
      int seen = r->offers;
      wait_for(r, &r->offers, seen);
      if (!rkey) ucp_ep_rkey_unpack(r->ep, r->key, &rkey); /* once per region, as tshare's cache */
      ucp_request_param_t p = {0};
      uint64_t t0 = bs_now_ns();
      finish(r, ucp_get_nbx(r->ep, which ? (void *)big : (void *)small, r->length, r->address, rkey, &p));
      double s = (double)(bs_now_ns() - t0) / 1e9;
      if (which && s < out->raw_get_s) out->raw_get_s = s;
      uint8_t done = 1;
      am(r, AM_DONE, &done, 1);
    }
    ucp_rkey_destroy(rkey);
  }
  free(big);
}

/* ---- tshare ------------------------------------------------------------------ */

static tshare_channel *ts_open(int side, char *why, size_t cap) {
  char address[96];
  snprintf(address, sizeof address, "ucx://10.78.%d.1:%d/bench", net, PORT);
  tshare_channel *ch = NULL;
  tshare_error err;
  if (bench_ucx_open(address, side == 0, &ch, &err) != TSHARE_OK)
    snprintf(why, cap, "%.*s", cap > 1 ? (int)cap - 1 : 0, err.message); /* cut to fit */
  return ch;
}

static int ts_set_producer(tshare_channel *ch, ucx_results *out);

static int ts_producer(tshare_channel *ch, long iters, ucx_results *out) {
  tshare_host_buffer *small, *big;
  tshare_error err;
  if (tshare_host_buffer_create(SMALL, "bench-small", &small, &err) != TSHARE_OK ||
      tshare_host_buffer_create(BIG, "bench-big", &big, &err) != TSHARE_OK)
    return -1;
  memset(tshare_host_buffer_data(big), 2, BIG);
  int64_t n_small = SMALL / 4, n_big = BIG / 4;
  tshare_tensor_desc ds = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, &n_small, 0);
  tshare_tensor_desc db = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_FLOAT, 32, 1}, 1, &n_big, 0);
  out->ts_big_s = 1e30;
  if (ts_set_producer(ch, out) != 0) return -1; /* the sets first: what a 64 MiB read leaves does not slow them */
  for (long i = 0; i < iters + BIG_ROUNDS; i++) {
    bool is_big = i >= iters;
    uint64_t id, t0 = bs_now_ns();
    if (tshare_share_host(ch, is_big ? big : small, is_big ? &db : &ds, NULL, NULL, 10000, &id) != TSHARE_OK ||
        tshare_channel_wait_released(ch, id, 30000) != TSHARE_OK)
      return snprintf(out->why, sizeof out->why, "%s", tshare_channel_last_error(ch)), -1;
    double took = (double)(bs_now_ns() - t0);
    if (!is_big && out->n_ts < UCX_ITERS_MAX) out->ts_ns[out->n_ts++] = took;
    if (is_big && took / 1e9 < out->ts_big_s) out->ts_big_s = took / 1e9;
  }
  tshare_host_buffer_destroy(small);
  tshare_host_buffer_destroy(big);
  return 0;
}

static int ts_consumer(tshare_channel *ch, long iters, ucx_results *out) {
  for (int i = 0; i < 1 + SET_ROUNDS; i++) {
    tshare_set *s;
    if (tshare_set_recv(ch, 30000, &s) != TSHARE_OK)
      return snprintf(out->why, sizeof out->why, "%s", tshare_channel_last_error(ch)), -1;
    tshare_set_release(s);
  }
  for (long i = 0; i < iters + BIG_ROUNDS; i++) {
    tshare_view *v;
    if (tshare_view_recv(ch, 30000, &v) != TSHARE_OK)
      return snprintf(out->why, sizeof out->why, "%s", tshare_channel_last_error(ch)), -1;
    tshare_view_release(v);
  }
  return 0;
}

/* The model as a set of 290 buffers (the builder holds them), or NULL. */
static tshare_set_builder *model_set(double *mib) {
  tshare_set_builder *b = tshare_set_builder_create();
  size_t bytes = 0;
  for (int i = 0; b && i < SET_TENSORS; i++) {
    char name[64];
    int64_t shape[2];
    int ndim = bench_model_tensor(i, SET_HIDDEN, name, sizeof name, shape);
    tshare_tensor_desc d = tshare_tensor_contiguous((tshare_dtype){TSHARE_DTYPE_BFLOAT, 16, 1}, ndim, shape, 0);
    size_t size = (size_t)tshare_tensor_numel(&d) * 2;
    tshare_host_buffer *buf;
    if (tshare_host_buffer_create(size, "bench-model", &buf, NULL) != TSHARE_OK) break;
    memset(tshare_host_buffer_data(buf), i & 0x7f, size);
    int rc = tshare_set_builder_add_host(b, name, buf, &d, NULL);
    tshare_host_buffer_destroy(buf);
    if (rc != TSHARE_OK) break;
    bytes += size;
  }
  if (b && tshare_set_builder_count(b) != SET_TENSORS) tshare_set_builder_destroy(b), b = NULL;
  *mib = (double)bytes / (1 << 20);
  return b;
}

/* The first hand-off of the model, then SET_ROUNDS updates (the same
 * buffers sent again), each timed from the send to the release. */
static int ts_set_producer(tshare_channel *ch, ucx_results *out) {
  tshare_set_builder *b = model_set(&out->set_mib);
  if (!b) return snprintf(out->why, sizeof out->why, "building the model's set failed"), -1;
  for (int i = 0; i < 1 + SET_ROUNDS; i++) {
    uint64_t id, t0 = bs_now_ns();
    if (tshare_set_send(ch, b, NULL, 30000, &id) != TSHARE_OK || tshare_channel_wait_released(ch, id, 60000) != TSHARE_OK) {
      snprintf(out->why, sizeof out->why, "%s", tshare_channel_last_error(ch));
      tshare_set_builder_destroy(b);
      return -1;
    }
    double took = (double)(bs_now_ns() - t0);
    if (i == 0) out->set_first_ns = took;
    else out->set_update_ns[i - 1] = took;
  }
  tshare_set_builder_destroy(b);
  out->sets_ok = 1;
  return 0;
}

/* ---- the two processes ------------------------------------------------------------ */

static void side_main(int side, int sock, int result_fd, long iters) {
  static ucx_results out;
  if (namespace_enter(side) != 0) {
    snprintf(out.why, sizeof out.why, "entering %s: %s", ns[side], strerror(errno));
  } else {
    raw_end r = {0};
    if (raw_open(&r, sock) != 0) {
      snprintf(out.why, sizeof out.why, "raw UCP did not connect across the veth pair");
    } else {
      if (side == 0) raw_producer(&r, iters, &out);
      else raw_consumer(&r, iters, &out);
      ucp_request_param_t cp = {0};
      finish(&r, ucp_ep_close_nbx(r.ep, &cp));
      ucp_worker_destroy(r.worker);
      ucp_cleanup(r.ctx);
      tshare_channel *ch = ts_open(side, out.why, sizeof out.why);
      if (ch) {
        out.ok = (side == 0 ? ts_producer(ch, iters, &out) : ts_consumer(ch, iters, &out)) == 0;
        tshare_channel_close(ch);
      }
    }
  }
  ssize_t w = write(result_fd, &out, sizeof out);
  _exit(w == (ssize_t)sizeof out ? 0 : 1);
}

static int read_all(int fd, void *buf, size_t len) {
  size_t got = 0;
  while (got < len) {
    ssize_t r = read(fd, (char *)buf + got, len - got);
    if (r <= 0) return -1;
    got += (size_t)r;
  }
  return 0;
}

/* Both sides' results, or -1 with why. */
static int run_sides(long iters, ucx_results *res, char *why, size_t cap) {
  int pair[2], results[2][2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0 || pipe(results[0]) != 0 || pipe(results[1]) != 0)
    return snprintf(why, cap, "socketpair/pipe: %s", strerror(errno)), -1;
  if (!getenv("UCX_TLS")) setenv("UCX_TLS", "tcp", 1);
  pid_t pid[2];
  for (int side = 0; side < 2; side++) {
    pid[side] = fork();
    if (pid[side] == 0) side_main(side, pair[side], results[side][1], iters);
    close(results[side][1]);
  }
  close(pair[0]);
  close(pair[1]);
  int rc = 0;
  for (int side = 0; side < 2; side++) {
    struct pollfd p = {results[side][0], POLLIN, 0};
    if (poll(&p, 1, 300000) != 1 || read_all(results[side][0], &res[side], sizeof res[side]) != 0) {
      rc = -1;
      snprintf(why, cap, "the %s did not report (killed after 300 s)", side ? "consumer" : "producer");
      kill(pid[0], SIGKILL), kill(pid[1], SIGKILL);
    }
    close(results[side][0]);
  }
  for (int side = 0; side < 2; side++) waitpid(pid[side], NULL, 0);
  return rc;
}

static void set_rows(bench *b, const ucx_results *r) {
  bs_samples first = {0}, update = {0};
  bs_add(&first, r->set_first_ns);
  for (int i = 0; i < SET_ROUNDS; i++) bs_add(&update, r->set_update_ns[i]);
  bs_samples *modes[2] = {&first, &update};
  const char *names[2] = {"first", "update"};
  for (int m = 0; m < 2; m++) {
    char key[48], label[80];
    snprintf(key, sizeof key, "sets_ucx_cpu_%s_1", names[m]);
    snprintf(label, sizeof label, "ucx: one set of 290 tensors, %s [veth, tcp]", names[m]);
    br_row *row = br_add(&b->rep, BR_LATENCY, "sets", key, label, "us");
    row->value = bs_percentile(modes[m], 50) / 1000.0;
    row->p99 = bs_percentile(modes[m], 99) / 1000.0;
    row->n = (long)modes[m]->n;
    snprintf(row->note, sizeof row->note,
             "send to release, per model: %d bf16 tensors in as many buffers, %.1f MiB, each read once", SET_TENSORS,
             r->set_mib);
  }
  bs_free(&first);
  bs_free(&update);
}

static void rows(bench *b, ucx_results *res) {
  bs_samples raw = {0}, ts = {0};
  for (long i = 0; i < res[0].n_raw; i++) bs_add(&raw, res[0].raw_ns[i]);
  for (long i = 0; i < res[0].n_ts; i++) bs_add(&ts, res[0].ts_ns[i]);
  bench_latency_row(b, "ucx_raw_4k", "ucx: raw UCP AM + get 4 KiB + AM round trip [veth, tcp]", &raw, NULL, NULL);
  br_row *row = bench_latency_row(b, "ucx_share_4k", "ucx: 4 KiB host share round trip [veth, tcp]", &ts,
                                  "ucx_raw_4k", NULL);
  snprintf(row->note, sizeof row->note, "share to release: rkey cached, the consumer's get into a pooled buffer");
  double raw_p50 = bs_percentile(&raw, 50), ts_p50 = bs_percentile(&ts, 50);
  br_target_add(&b->rep, "ucx: 4 KiB share round trip <= 1.2x raw UCP AM + get + AM", ts_p50 <= 1.2 * raw_p50,
                "%.1f us against %.1f us (%.2fx)", ts_p50 / 1e3, raw_p50 / 1e3, ts_p50 / raw_p50);
  double raw_gbs = BIG / res[1].raw_get_s / 1e9, ts_gbs = BIG / res[0].ts_big_s / 1e9;
  br_row *g = br_add(&b->rep, BR_VALUE, "bandwidth", "ucx_raw_get_64m", "ucx: raw ucp_get_nbx 64 MiB [veth, tcp]",
                     "GB/s");
  g->value = raw_gbs;
  g->n = BIG_ROUNDS;
  br_row *s = br_add(&b->rep, BR_VALUE, "bandwidth", "ucx_share_64m", "ucx: 64 MiB host share, share to release",
                     "GB/s");
  s->value = ts_gbs;
  s->n = BIG_ROUNDS;
  snprintf(s->ratio_key, sizeof s->ratio_key, "ucx_raw_get_64m");
  br_target_add(&b->rep, "ucx: 64 MiB share >= 0.9x raw ucp_get_nbx bandwidth", ts_gbs >= 0.9 * raw_gbs,
                "%.2f GB/s against %.2f GB/s (%.2fx), best of %d", ts_gbs, raw_gbs, ts_gbs / raw_gbs, BIG_ROUNDS);
  bs_free(&raw);
  bs_free(&ts);
}

void bench_ucx(bench *b) {
  char why[200] = "";
  static ucx_results res[2];
  long iters = b->opt.iters < UCX_ITERS_MAX ? b->opt.iters : UCX_ITERS_MAX;
  native_row(b, iters);
  fprintf(stderr, "tshare-bench: UCX rows (%ld round trips each way, %d x 64 MiB)\n", iters, BIG_ROUNDS);
  if (namespaces_make(why, sizeof why) != 0) {
    skip_all(b, why, true);
    return;
  }
  int rc = run_sides(iters, res, why, sizeof why);
  namespaces_remove();
  bool sets_ok = rc == 0 && res[0].sets_ok; /* measured, whatever came after them */
  if (rc == 0 && (!res[0].ok || !res[1].ok))
    rc = -1, snprintf(why, sizeof why, "%s", res[0].ok ? res[1].why : res[0].why);
  if (sets_ok) set_rows(b, &res[0]);
  if (rc != 0) {
    skip_all(b, why, !sets_ok);
    return;
  }
  rows(b, res);
}

#else

void bench_ucx(bench *b) {
  native_row(b, b->opt.iters < 2000 ? b->opt.iters : 2000);
  skip_all(b, "built without UCX's headers (libucx-dev)", true);
}

#endif
