/* py_guard.c - turns at a channel's or listener's C calls, waits in slices. */
#include "py_guard.h"

#include "py_errors.h"

#include <limits.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
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
  pthread_condattr_t monotonic; /* slices of a wait for a turn are timed on the clock deadlines use */
  pthread_condattr_init(&monotonic);
  pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
  pthread_cond_init(&g->turn_changed, &monotonic);
  pthread_condattr_destroy(&monotonic);
  g->next_ticket = g->serving = 0;
  g->given_up = NULL;
  g->given_up_first = g->given_up_end = g->given_up_cap = 0;
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
  free(g->given_up);
}

static int refuse_reentry(const py_guard *g) {
  py_raise_fmt(TSHARE_E_STATE,
               "tshare: this thread is already inside a call on the %s (called back from within it): "
               "use the %s after that call returns",
               g->noun, g->noun);
  return -1;
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The turn goes to the next ticket whose caller still waits (mutex held):
 * given-up tickets are all ahead of the one served, the lowest first. */
static void pass_turn_locked(py_guard *g) {
  g->serving++;
  while (g->given_up_first < g->given_up_end && g->given_up[g->given_up_first] == g->serving) {
    g->given_up_first++;
    g->serving++;
  }
  if (g->given_up_first == g->given_up_end) g->given_up_first = g->given_up_end = 0;
  pthread_cond_broadcast(&g->turn_changed);
}

/* ticket leaves the line (mutex held): its turn is skipped. False when the
 * list could not grow. A caller that polls behind a long call gives up a
 * ticket per slice: the list grows as needed, in ticket order (a later
 * ticket almost always gives up later: it goes at the end), and empties as
 * the turns pass them. */
static bool give_up_locked(py_guard *g, unsigned long ticket) {
  if (g->given_up_end == g->given_up_cap && g->given_up_first > 0) { /* room at the front: moved down */
    memmove(g->given_up, g->given_up + g->given_up_first, (g->given_up_end - g->given_up_first) * sizeof *g->given_up);
    g->given_up_end -= g->given_up_first;
    g->given_up_first = 0;
  }
  if (g->given_up_end == g->given_up_cap) {
    size_t cap = g->given_up_cap ? 2 * g->given_up_cap : 16;
    unsigned long *grown = realloc(g->given_up, cap * sizeof *grown);
    if (!grown) return false;
    g->given_up = grown;
    g->given_up_cap = cap;
  }
  size_t at = g->given_up_end++;
  for (; at > g->given_up_first && g->given_up[at - 1] > ticket; at--) g->given_up[at] = g->given_up[at - 1];
  g->given_up[at] = ticket;
  return true;
}

enum { TURN_TAKEN = 0, TURN_TIMED_OUT, TURN_SIGNALLED };

/* Wait for a turn (mutex held; released meanwhile) until ticket is served,
 * or slice_ms (< 0: no limit) has passed. */
static void wait_for_turn_locked(py_guard *g, unsigned long ticket, int slice_ms) {
  if (slice_ms < 0) {
    while (ticket != g->serving) pthread_cond_wait(&g->turn_changed, &g->mutex);
    return;
  }
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  until.tv_sec += slice_ms / 1000;
  until.tv_nsec += (long)(slice_ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  while (ticket != g->serving && pthread_cond_timedwait(&g->turn_changed, &g->mutex, &until) == 0) {
  }
}

/* Wait (GIL released, mutex not held while taking the GIL back) until this
 * thread's ticket is served, then mark it the owner, and say in *closing
 * whether the guard was closing by then. An interruptible wait looks for
 * signals every slice and gives up once deadline (< 0: none), and one slice
 * at least, has passed:
 * TURN_SIGNALLED (the handler's exception set) or TURN_TIMED_OUT, its place
 * in the line given up (or, where the line cannot grow, its turn waited for
 * and handed on) and the caller not inside. */
static int take_turn(py_guard *g, int interruptible, int64_t deadline, int *closing) {
  unsigned long me = PyThread_get_thread_ident();
  int gave_up = TURN_TAKEN; /* why it gave up, once it has: it waits only to hand the turn on */
  pthread_mutex_lock(&g->mutex);
  unsigned long ticket = g->next_ticket++;
  if (ticket != g->serving && deadline >= 0 && deadline < now_ms() + PY_GUARD_SLICE_MS)
    deadline = now_ms() + PY_GUARD_SLICE_MS; /* a call without time to wait still waits out a short one */
  while (ticket != g->serving) {
    pthread_mutex_unlock(&g->mutex);
    PyThreadState *gil = PyEval_SaveThread();
    pthread_mutex_lock(&g->mutex);
    wait_for_turn_locked(g, ticket, interruptible && !gave_up ? PY_GUARD_SLICE_MS : -1);
    int waiting = ticket != g->serving && !gave_up;
    pthread_mutex_unlock(&g->mutex);
    PyEval_RestoreThread(gil);
    if (waiting && PyErr_CheckSignals() < 0) gave_up = TURN_SIGNALLED;
    else if (waiting && deadline >= 0 && now_ms() >= deadline) gave_up = TURN_TIMED_OUT;
    pthread_mutex_lock(&g->mutex);
    if (gave_up && ticket != g->serving && give_up_locked(g, ticket)) {
      pthread_mutex_unlock(&g->mutex);
      return gave_up;
    }
  }
  if (gave_up) { /* its turn came meanwhile, or the line could not grow: handed on */
    pass_turn_locked(g);
  } else {
    g->owner = me;
    *closing = g->closing;
  }
  pthread_mutex_unlock(&g->mutex);
  return gave_up;
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
  pass_turn_locked(g);
  pthread_mutex_unlock(&g->mutex);
}

/* Enter by deadline (< 0: none), one slice at least (take_turn). 0:
 * inside; else with a Python error set, TSHARE_E_TIMEOUT when the turn did
 * not come in time (tshare.TimeoutError naming what), TSHARE_E_STATE for
 * the rest: a signal handler's exception, a reentry, or a closed guard,
 * refused with a message saying what was closed (waited: the call waited
 * before, in slices). */
static int enter_for(py_guard *g, const char *what, int waited, int64_t deadline) {
  if (inherited(g)) return 0;
  if (is_owner(g)) return refuse_reentry(g), TSHARE_E_STATE;
  int closing = 0, why = take_turn(g, 1, deadline, &closing);
  if (why == TURN_SIGNALLED) return TSHARE_E_STATE;
  if (why == TURN_TIMED_OUT) {
    py_raise_fmt(TSHARE_E_TIMEOUT, "tshare: %s: timed out waiting for its turn: another thread's call on the %s "
                 "held it the whole time", what ? what : "call", g->noun);
    return TSHARE_E_TIMEOUT;
  }
  if (!closing) return 0;
  py_guard_leave(g);
  if (waited)
    py_raise_fmt(TSHARE_E_STATE, "tshare: %s: the %s was closed by another thread while this call waited", what,
                 g->noun);
  else
    py_raise_fmt(TSHARE_E_STATE, "tshare: the %s is closed", g->noun);
  return TSHARE_E_STATE;
}

int py_guard_enter_by(py_guard *g, const char *what, int64_t deadline) {
  return enter_for(g, what, 0, deadline) == 0 ? 0 : -1;
}

int py_guard_begin_close(py_guard *g) {
  if (inherited(g)) return 1;
  if (is_owner(g)) return refuse_reentry(g);
  pthread_mutex_lock(&g->mutex);
  int was_closing = g->closing;
  g->closing = 1; /* calls waiting in slices see it at their next one */
  pthread_mutex_unlock(&g->mutex);
  if (was_closing) return 0;
  int closing;
  (void)take_turn(g, 0, -1, &closing); /* after every call that came before: they leave, or see the mark and leave */
  return 1;
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
  if ((*status = enter_for(g, what, 0, deadline)) != 0) return -1;
  for (;;) {
    *status = call_slice(slice, next_slice_ms(deadline));
    if (*status != TSHARE_E_TIMEOUT || py_guard_left_ms(deadline) == 0) return 0;
    py_guard_leave(g); /* other threads' calls, and a close, go between slices */
    if (PyErr_CheckSignals() < 0) {
      *status = TSHARE_E_STATE; /* not a timeout: the handler's exception ends the call */
      return -1;
    }
    if ((*status = enter_for(g, what, 1, deadline)) != 0) return -1;
  }
}
