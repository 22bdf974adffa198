/* py_guard.c - turns at a channel's or listener's C calls, waits in slices. */
#include "py_guard.h"

#include "py_errors.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

/* Forks seen in this process's line, counted in each child by an atfork
 * handler: a guard made before the last fork belongs to a parent. Every
 * call on a channel enters and leaves its guard, where comparing pids would
 * cost a getpid() system call each time (glibc no longer caches it). */
static atomic_ulong forks;
static pthread_once_t watch_forks_once = PTHREAD_ONCE_INIT;

static void count_fork(void) { atomic_fetch_add(&forks, 1); }
static void watch_forks(void) { pthread_atfork(NULL, NULL, count_fork); }

void py_guard_init(py_guard *g, const char *noun) {
  pthread_once(&watch_forks_once, watch_forks);
  pthread_mutex_init(&g->mutex, NULL);
  pthread_cond_init(&g->turn_changed, NULL);
  g->next_ticket = g->serving = 0;
  g->owner = 0;
  g->closing = 0;
  g->forks = atomic_load(&forks);
  g->noun = noun;
}

/* Made by the process this one was forked from: see py_guard.h. */
static int inherited(const py_guard *g) { return g->forks != atomic_load_explicit(&forks, memory_order_relaxed); }

void py_guard_destroy(py_guard *g) {
  if (inherited(g)) return; /* the mutex may be held by a thread this process does not have */
  pthread_cond_destroy(&g->turn_changed);
  pthread_mutex_destroy(&g->mutex);
}

static int refuse_reentry(const py_guard *g) {
  py_raise_fmt(TSHARE_E_STATE,
               "tshare: this thread is already inside a call on the %s (called back from within it): "
               "use the %s after that call returns",
               g->noun, g->noun);
  return -1;
}

/* Wait (GIL released, mutex not held while taking the GIL back) until this
 * thread's ticket is served, then mark it the owner. Returns whether the
 * guard was closing by then; the caller holds the turn either way. */
static int take_turn(py_guard *g) {
  unsigned long me = PyThread_get_thread_ident();
  pthread_mutex_lock(&g->mutex);
  unsigned long ticket = g->next_ticket++;
  if (ticket != g->serving) {
    pthread_mutex_unlock(&g->mutex);
    PyThreadState *gil = PyEval_SaveThread();
    pthread_mutex_lock(&g->mutex);
    while (ticket != g->serving) pthread_cond_wait(&g->turn_changed, &g->mutex);
    pthread_mutex_unlock(&g->mutex);
    PyEval_RestoreThread(gil);
    pthread_mutex_lock(&g->mutex);
  }
  g->owner = me;
  int closing = g->closing;
  pthread_mutex_unlock(&g->mutex);
  return closing;
}

static int is_owner(py_guard *g) {
  pthread_mutex_lock(&g->mutex);
  int mine = g->owner == PyThread_get_thread_ident();
  pthread_mutex_unlock(&g->mutex);
  return mine;
}

void py_guard_leave(py_guard *g) {
  if (inherited(g)) return;
  pthread_mutex_lock(&g->mutex);
  g->owner = 0;
  g->serving++;
  pthread_cond_broadcast(&g->turn_changed);
  pthread_mutex_unlock(&g->mutex);
}

/* Enter; a closed guard is refused with a message saying what (NULL: the
 * first entry of a call, else the call that was waiting). */
static int enter_for(py_guard *g, const char *what) {
  if (inherited(g)) return 0;
  if (is_owner(g)) return refuse_reentry(g);
  if (!take_turn(g)) return 0;
  py_guard_leave(g);
  if (what)
    py_raise_fmt(TSHARE_E_STATE, "tshare: %s: the %s was closed by another thread while this call waited", what,
                 g->noun);
  else
    py_raise_fmt(TSHARE_E_STATE, "tshare: the %s is closed", g->noun);
  return -1;
}

int py_guard_enter(py_guard *g) { return enter_for(g, NULL); }

int py_guard_begin_close(py_guard *g) {
  if (inherited(g)) return 1;
  if (is_owner(g)) return refuse_reentry(g);
  pthread_mutex_lock(&g->mutex);
  int was_closing = g->closing;
  g->closing = 1; /* calls waiting in slices see it at their next one */
  pthread_mutex_unlock(&g->mutex);
  if (was_closing) return 0;
  (void)take_turn(g); /* after every call that came before: they leave, or see the mark and leave */
  return 1;
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int64_t py_guard_deadline(int timeout_ms) { return timeout_ms < 0 ? -1 : now_ms() + timeout_ms; }

int py_guard_left_ms(int64_t deadline) {
  if (deadline < 0) return -1;
  int64_t left = deadline - now_ms();
  return left <= 0 ? 0 : left > INT_MAX ? INT_MAX : (int)left;
}

/* The next slice's length: what is left of the wait, at most a slice. */
static int next_slice_ms(int64_t deadline) {
  int left = py_guard_left_ms(deadline);
  return left < 0 || left > PY_GUARD_SLICE_MS ? PY_GUARD_SLICE_MS : left;
}

static int call_slice(const py_guard_slice *slice, int slice_ms) {
  int rc;
  if (slice->before) slice->before(slice->arg);
  Py_BEGIN_ALLOW_THREADS rc = slice->call(slice->arg, slice_ms);
  Py_END_ALLOW_THREADS
  return rc;
}

int py_guard_wait(py_guard *g, const char *what, int timeout_ms, const py_guard_slice *slice, int *status) {
  int64_t deadline = py_guard_deadline(timeout_ms); /* the wait for the first turn counts too */
  if (py_guard_enter(g) < 0) return -1;
  for (;;) {
    *status = call_slice(slice, next_slice_ms(deadline));
    if (*status != TSHARE_E_TIMEOUT || py_guard_left_ms(deadline) == 0) return 0;
    py_guard_leave(g); /* other threads' calls, and a close, go between slices */
    if (PyErr_CheckSignals() < 0) return -1;
    if (enter_for(g, what) < 0) return -1;
  }
}
