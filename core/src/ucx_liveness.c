/* Heartbeat settings, the silence rule and the thread that applies them
 * (ucx_liveness.h). */
#include "ucx_liveness.h"

#include "clock.h"
#include "error_detail.h"
#include "vec.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HEARTBEAT_MIN_MS 10
#define HEARTBEAT_MAX_MS 60000
#define TIMEOUT_MAX_MS 3600000
#define TICK_MIN_MS 5
#define TICK_MAX_MS 50

/* ---- the settings and the rule ------------------------------------------ */

/* An integer setting from the environment: *out, or dflt when unset. */
static int setting(const char *name, int dflt, int lo, int hi, int *out, char *msg, size_t cap) {
  const char *text = getenv(name);
  *out = dflt;
  if (!text || !*text) return TSHARE_OK;
  char *end;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi)
    return ts_errf(msg, cap, TSHARE_E_INVALID_ARG, "%s='%s': give milliseconds from %d to %d", name, text, lo, hi);
  *out = (int)v;
  return TSHARE_OK;
}

int ts_ucx_liveness_init(ts_ucx_liveness *l, char *msg, size_t cap) {
  memset(l, 0, sizeof *l);
  int rc = setting(TS_UCX_HEARTBEAT_ENV, TS_UCX_HEARTBEAT_MS_DEFAULT, HEARTBEAT_MIN_MS, HEARTBEAT_MAX_MS,
                   &l->heartbeat_ms, msg, cap);
  if (rc != TSHARE_OK) return rc;
  /* Below two intervals one late heartbeat would end a live channel. */
  int dflt = TS_UCX_PEER_TIMEOUT_MS_DEFAULT > 2 * l->heartbeat_ms ? TS_UCX_PEER_TIMEOUT_MS_DEFAULT : 4 * l->heartbeat_ms;
  rc = setting(TS_UCX_PEER_TIMEOUT_ENV, dflt, 2 * l->heartbeat_ms, TIMEOUT_MAX_MS, &l->timeout_ms, msg, cap);
  if (rc != TSHARE_OK) return rc;
  l->last_sent_ms = l->last_heard_ms = ts_now_ms();
  return TSHARE_OK;
}

bool ts_ucx_heartbeat_due(const ts_ucx_liveness *l, int64_t now_ms) {
  return now_ms - l->last_sent_ms >= l->heartbeat_ms;
}

int ts_ucx_peer_timeout_ms(const ts_ucx_liveness *l) {
  int peers = 2 * l->peer_heartbeat_ms;
  return peers > l->timeout_ms ? peers : l->timeout_ms;
}

bool ts_ucx_peer_silent(const ts_ucx_liveness *l, int64_t now_ms) {
  return now_ms - l->last_heard_ms > ts_ucx_peer_timeout_ms(l);
}

void ts_ucx_heartbeat_encode(uint8_t out[TS_UCX_HEARTBEAT_LEN], int heartbeat_ms) {
  uint32_t v = (uint32_t)heartbeat_ms;
  for (int i = 0; i < TS_UCX_HEARTBEAT_LEN; i++) out[i] = (uint8_t)(v >> (8 * i));
}

int ts_ucx_heartbeat_decode(const void *data, size_t len) {
  if (!data || len != TS_UCX_HEARTBEAT_LEN) return 0;
  const uint8_t *b = data;
  uint32_t v = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
  return v >= HEARTBEAT_MIN_MS && v <= HEARTBEAT_MAX_MS ? (int)v : 0;
}

/* ---- the thread --------------------------------------------------------- */

typedef struct watched {
  void *item;
  ts_ucx_tick_fn tick;
  int heartbeat_ms;
} watched;

TS_VEC_DEFINE(watched_vec, watched)
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER; /* held through a round of ticks */
static watched_vec items;
static bool running; /* a thread is started and has not yet seen the list empty */
static bool exiting; /* the process is exiting: UCX's own teardown may run, no more ticks */
static pthread_once_t handlers_once = PTHREAD_ONCE_INIT;

/* A quarter of the shortest interval: a heartbeat leaves at most that late,
 * and a silence is found at most that late. */
static int tick_ms_locked(void) {
  int shortest = HEARTBEAT_MAX_MS;
  for (size_t i = 0; i < items.len; i++)
    if (items.items[i].heartbeat_ms < shortest) shortest = items.items[i].heartbeat_ms;
  int t = shortest / 4;
  return t < TICK_MIN_MS ? TICK_MIN_MS : t > TICK_MAX_MS ? TICK_MAX_MS : t;
}

static void *run(void *unused) {
  (void)unused;
  for (;;) {
    pthread_mutex_lock(&lock);
    if (items.len == 0) { /* the last channel went: a later one starts another thread */
      running = false;
      watched_vec_free(&items);
      pthread_mutex_unlock(&lock);
      return NULL;
    }
    for (size_t i = 0; i < items.len && !exiting; i++) items.items[i].tick(items.items[i].item);
    int ms = tick_ms_locked();
    pthread_mutex_unlock(&lock);
    struct timespec ts = {0, (long)ms * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  }
}

/* A forked child has no thread and owns none of its parent's endpoints. */
static void fork_prepare(void) { pthread_mutex_lock(&lock); }
static void fork_parent(void) { pthread_mutex_unlock(&lock); }
static void fork_child(void) {
  items = (watched_vec){0}; /* the parent's list: its storage is the parent's to free */
  running = false;
  pthread_mutex_unlock(&lock);
}
/* exit() of a process that did not close its channels: libucp's destructors
 * run after this (registered once UCX was loaded), never beside a tick. */
static void at_exit(void) {
  pthread_mutex_lock(&lock);
  exiting = true;
  pthread_mutex_unlock(&lock);
}

static void register_handlers(void) {
  pthread_atfork(fork_prepare, fork_parent, fork_child);
  atexit(at_exit);
}

/* The thread, with every signal blocked: they are the application's. */
static int start_locked(char *msg, size_t cap) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t t;
  int rc = pthread_create(&t, &attr, run, NULL);
  pthread_attr_destroy(&attr);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) return ts_errsys(msg, cap, TSHARE_E_SYSTEM, rc, "ucx: starting the heartbeat thread");
  running = true;
  return TSHARE_OK;
}

int ts_ucx_liveness_watch(void *item, ts_ucx_tick_fn tick, int heartbeat_ms, char *msg, size_t cap) {
  pthread_once(&handlers_once, register_handlers);
  pthread_mutex_lock(&lock);
  int rc = watched_vec_push(&items, (watched){item, tick, heartbeat_ms});
  if (rc != TSHARE_OK) {
    rc = ts_errf(msg, cap, TSHARE_E_NOMEM, "ucx: out of memory");
  } else if (!running) {
    rc = start_locked(msg, cap);
    if (rc != TSHARE_OK) watched_vec_remove(&items, items.len - 1, 1);
  }
  pthread_mutex_unlock(&lock);
  return rc;
}

void ts_ucx_liveness_unwatch(void *item) {
  pthread_mutex_lock(&lock);
  for (size_t i = 0; i < items.len; i++)
    if (items.items[i].item == item) {
      watched_vec_remove(&items, i, 1);
      break;
    }
  pthread_mutex_unlock(&lock);
}
