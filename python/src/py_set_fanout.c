/* py_set_fanout.c - Channel._send_set_all: one tensor set, built once (or
 * the channel's kept set), to many consumers in one call
 * (tshare_set_send_all), each consumer's outcome reported on its own.
 *
 * The set is built and kept by the channel the call is made on (self): the
 * Python side makes that the channel of lowest address, and the others'
 * guards are entered in address order, so two fan-outs over the same
 * channels, in whatever order they list them, never wait on each other.
 * A channel listed twice, or self among the others, is refused by its guard
 * (this thread is inside it already): that place's error, no send. */
#include "py_channel.h"
#include "py_errors.h"

#include <stdlib.h>

typedef struct fanout {
  Py_ssize_t n;          /* channels: self, then the others */
  PyChannel **objs;      /* [n] */
  tshare_channel **chs;  /* [n]: self's, then each other one's once entered; NULL where it could not be */
  PyObject **refused;    /* [n]: why a channel could not be entered, or NULL */
} fanout;

typedef struct place {
  PyChannel *obj;
  Py_ssize_t index;
} place;

static int by_address(const void *a, const void *b) {
  uintptr_t x = (uintptr_t)((const place *)a)->obj, y = (uintptr_t)((const place *)b)->obj;
  return x < y ? -1 : x > y;
}

/* The exception a failed entry left, taken off as an object. */
static PyObject *take_error(void) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  Py_XDECREF(type);
  Py_XDECREF(tb);
  return value;
}

/* The others' guards, entered in address order by deadline; one that
 * refuses (closed, entered already, held by another thread's call past the
 * deadline) gets its error and no send. -1 when a signal handler raised
 * while it waited (Ctrl-C): the call ends there, those entered left. */
static int enter_others(fanout *f, int64_t deadline) {
  place *order = malloc((size_t)f->n * sizeof *order);
  if (!order) return 0; /* out of memory: every other channel stays NULL, and is reported so */
  int rc = 0;
  for (Py_ssize_t k = 0; k < f->n - 1; k++) order[k] = (place){f->objs[k + 1], k + 1};
  qsort(order, (size_t)f->n - 1, sizeof *order, by_address);
  for (Py_ssize_t k = 0; rc == 0 && k < f->n - 1; k++) {
    Py_ssize_t i = order[k].index;
    f->chs[i] = py_channel_enter_by(order[k].obj, "send_all", deadline);
    if (f->chs[i]) continue;
    if (!py_error_is_tshare()) rc = -1; /* the handler's exception stays set */
    else f->refused[i] = take_error();
  }
  free(order);
  return rc;
}

static void leave_others(fanout *f) {
  for (Py_ssize_t i = 1; i < f->n; i++)
    if (f->chs[i]) py_channel_leave(f->objs[i]);
}

/* [(set_id, None) or (0, tshare.Error)] in f's order. */
static PyObject *outcomes(const fanout *f, const uint64_t *ids, const tshare_error *results) {
  PyObject *list = PyList_New(f->n);
  for (Py_ssize_t i = 0; list && i < f->n; i++) {
    PyObject *error = f->refused[i];
    if (error) Py_INCREF(error);
    else if (results[i].code != TSHARE_OK) error = py_error_new(results[i].code, results[i].message);
    else {
      Py_INCREF(Py_None);
      error = Py_None;
    }
    PyObject *item = error ? Py_BuildValue("(KN)", (unsigned long long)(error == Py_None ? ids[i] : 0), error) : NULL;
    if (!item) Py_CLEAR(list);
    else PyList_SET_ITEM(list, i, item);
  }
  return list;
}

/* The sender: self's channel and every other one that could be entered. */
static PyObject *send_to_all(PyChannel *self, tshare_set_builder *b, int timeout_ms, void *ctx) {
  fanout *f = ctx;
  f->chs[0] = self->ch;
  int64_t deadline = py_guard_deadline(timeout_ms);
  if (enter_others(f, deadline) < 0) {
    leave_others(f);
    return NULL;
  }
  timeout_ms = py_guard_left_ms(deadline); /* what the wait for the others' turns left */
  uint64_t *ids = calloc((size_t)f->n, sizeof *ids);
  tshare_error *results = calloc((size_t)f->n, sizeof *results);
  PyObject *out = NULL;
  if (ids && results) {
    size_t n = (size_t)f->n;
    tshare_channel *const *chs = f->chs;
    Py_BEGIN_ALLOW_THREADS (void)tshare_set_send_all(b, chs, n, NULL, timeout_ms, ids, results);
    Py_END_ALLOW_THREADS
    out = outcomes(f, ids, results);
  } else {
    PyErr_NoMemory();
  }
  leave_others(f);
  free(ids);
  free(results);
  return out ? Py_BuildValue("(NO)", out, Py_None) : NULL;
}

static void fanout_free(fanout *f) {
  for (Py_ssize_t i = 0; f->refused && i < f->n; i++) Py_XDECREF(f->refused[i]);
  for (Py_ssize_t i = 1; f->objs && i < f->n; i++) Py_XDECREF((PyObject *)f->objs[i]);
  free(f->objs);
  free(f->chs);
  free(f->refused);
}

PyObject *py_channel_send_set_all(PyChannel *self, PyObject *args) {
  Py_ssize_t argc = PyTuple_GET_SIZE(args);
  PyObject *others = argc ? PyTuple_GET_ITEM(args, 0) : NULL;
  if (!others || !PyList_Check(others)) {
    PyErr_SetString(PyExc_TypeError, "_send_set_all: the other channels come first, as a list");
    return NULL;
  }
  fanout f = {.n = 1 + PyList_GET_SIZE(others)};
  f.objs = calloc((size_t)f.n, sizeof *f.objs);
  f.chs = calloc((size_t)f.n, sizeof *f.chs);
  f.refused = calloc((size_t)f.n, sizeof *f.refused);
  PyObject *result = NULL;
  if (!f.objs || !f.chs || !f.refused) {
    PyErr_NoMemory();
  } else {
    f.objs[0] = self;
    int typed = 1;
    for (Py_ssize_t i = 1; typed && i < f.n; i++) {
      PyObject *o = PyList_GET_ITEM(others, i - 1);
      typed = PyObject_TypeCheck(o, &PyChannel_Type);
      Py_INCREF(o); /* held while the GIL is released: the list is the caller's */
      f.objs[i] = (PyChannel *)o;
    }
    PyObject *rest = typed ? PyTuple_GetSlice(args, 1, argc) : NULL;
    if (!typed) PyErr_SetString(PyExc_TypeError, "_send_set_all: others holds something that is not a channel");
    if (rest) result = py_set_send_args(self, rest, send_to_all, &f);
    Py_XDECREF(rest);
  }
  fanout_free(&f);
  return result;
}
