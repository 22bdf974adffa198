/* py_guard.h - one Python thread at a time inside a channel's (or a
 * listener's) C calls, waits that Ctrl-C and close() can end.
 *
 * The C library lets one thread drive a channel at a time. Python programs
 * share objects between threads freely, so every C call on a channel or a
 * listener enters its guard first: threads take turns in arrival order,
 * waiting with the GIL released. A call that may wait long (recv,
 * wait_released, poll, send waiting for room, accept) waits in slices of at
 * most PY_GUARD_SLICE_MS and leaves the guard between them, so that
 *   - Ctrl-C (any signal with a Python handler) is seen: PyErr_CheckSignals
 *     runs between slices and its exception ends the call;
 *   - other threads' calls on the same object run between the slices;
 *   - close() from another thread marks the guard closing and takes its turn:
 *     the waiting call sees the mark at its next slice and raises tshare.Error,
 *     and the C object is freed only once no call is inside.
 * A call waiting for its turn behind another thread's long call (a set send
 * waiting for room is one C call) sees Ctrl-C too, every slice, and gives
 * up its place in the line once its timeout has passed (after one slice at
 * least, so that a call without time to wait still waits out a short one).
 *
 * In a process forked from the one that made the guard, the guard is not
 * used: a thread of the parent may have held it at the fork and will never
 * leave it there; the C library refuses calls on a channel the process
 * inherited. */
#ifndef TSHARE_PY_GUARD_H
#define TSHARE_PY_GUARD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

/* Long enough that an idle wait costs nothing measurable (a ring receive
 * spins ~50 us per slice), short enough for a prompt Ctrl-C and for other
 * threads' sends to wait at most this long behind a waiting recv. */
#define PY_GUARD_SLICE_MS 20

typedef struct py_guard {
  pthread_mutex_t mutex; /* guards the fields below; never held while waiting for the GIL */
  pthread_cond_t turn_changed;
  unsigned long next_ticket, serving; /* a ticket per caller: turns in arrival order */
  unsigned long *given_up; /* [first, end): tickets whose callers left the line before their turn, ascending */
  size_t given_up_first, given_up_end, given_up_cap;
  unsigned long owner;                /* the thread inside (PyThread_get_thread_ident), 0 if none */
  int closing;                        /* set by the first close: every later entry is refused */
  unsigned long forks;                /* forks seen when it was made: another count, another process */
  const char *noun;                   /* "channel" or "listener", for messages */
} py_guard;

void py_guard_init(py_guard *g, const char *noun);
void py_guard_destroy(py_guard *g);

/* Wait for this thread's turn (GIL released while waiting). 0: inside; -1
 * with tshare.Error (TSHARE_E_STATE) when the object is closed or this
 * thread is already inside (called back from within a call), with the
 * exception a signal handler raised while it waited, or with
 * tshare.TimeoutError (naming what) once deadline (py_guard_deadline; < 0:
 * none) and a slice have passed. */
int py_guard_enter_by(py_guard *g, const char *what, int64_t deadline);
void py_guard_leave(py_guard *g);

/* Mark closing and wait for the calls inside to leave. 1: the caller is
 * inside and closes the C object, then leaves; 0: it was closed already;
 * -1 with tshare.Error when called back from within a call of this thread. */
int py_guard_begin_close(py_guard *g);

/* A deadline timeout_ms from now on the monotonic clock (< 0: none), and
 * the milliseconds left before it (-1: no deadline; 0: passed). */
int64_t py_guard_deadline(int timeout_ms);
int py_guard_left_ms(int64_t deadline);

/* One slice of a wait. */
typedef struct py_guard_slice {
  /* The C call, given at most slice_ms, made without the GIL; a tshare
   * status, TSHARE_E_TIMEOUT asking for another slice. */
  int (*call)(void *arg, int slice_ms);
  void (*before)(void *arg); /* optional: with the GIL, before each call */
  void *arg;
} py_guard_slice;

/* Enter, then make slice's call until it returns something other than
 * TSHARE_E_TIMEOUT or timeout_ms (< 0: forever) has passed, leaving the
 * guard between slices to check signals. 0: *status is the last call's
 * status and the caller is inside (it reads the object's error detail, then
 * leaves); -1: a Python error is set (a signal handler raised, the object
 * was closed, or its turn did not come in time: then *status is
 * TSHARE_E_TIMEOUT and the error a tshare.TimeoutError) and the caller is
 * not inside. what names the call in messages. */
int py_guard_wait(py_guard *g, const char *what, int timeout_ms, const py_guard_slice *slice, int *status);

#endif /* TSHARE_PY_GUARD_H */
