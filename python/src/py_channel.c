/* py_channel.c - the Channel, Listener and Role types. Every call that can
 * wait lets other Python threads run while it does. */
#include "py_channel.h"

#include "py_errors.h"

#include <errno.h>
#include <poll.h>
#include <string.h>

/* ---- options -------------------------------------------------------------- */

int py_channel_options(PyObject *name, PyObject *transport, int spin_us, long allow_uid,
                       tshare_channel_options *opts) {
  tshare_channel_options_init(opts);
  if (name && name != Py_None) {
    opts->name = PyUnicode_AsUTF8(name);
    if (!opts->name) return -1;
  }
  if (transport && transport != Py_None) {
    const char *t = PyUnicode_AsUTF8(transport);
    if (!t) return -1;
    if (strcmp(t, "ring") == 0) opts->transport = TSHARE_TRANSPORT_RING;
    else if (strcmp(t, "socket") == 0) opts->transport = TSHARE_TRANSPORT_SOCKET;
    else {
      py_raise_fmt(TSHARE_E_INVALID_ARG, "tshare: transport '%s': use 'ring', 'socket' or None", t);
      return -1;
    }
  }
  opts->spin_us = spin_us;
  if (allow_uid != -1) opts->allow_uid = allow_uid;
  return 0;
}

/* ---- Channel -------------------------------------------------------------- */

PyObject *py_channel_wrap(tshare_channel *ch) {
  PyChannel *self = PyObject_New(PyChannel, &PyChannel_Type);
  if (!self) {
    tshare_channel_close(ch);
    return NULL;
  }
  self->ch = ch;
  memset(&self->next, 0, sizeof self->next);
  memset(&self->last_set, 0, sizeof self->last_set);
  self->last_set.cuda_device = -1;
  memset(&self->ahead, 0, sizeof self->ahead);
  self->ahead.cuda_device = -1;
  py_guard_init(&self->guard, "channel");
  return (PyObject *)self;
}

tshare_channel *py_channel_get(PyChannel *self) {
  if (!self->ch) py_raise(TSHARE_E_STATE, "tshare: the channel is closed");
  return self->ch;
}

tshare_channel *py_channel_enter_by(PyChannel *self, const char *what, int64_t deadline) {
  if (py_guard_enter_by(&self->guard, what, deadline) < 0) return NULL;
  if (self->ch) return self->ch;
  py_guard_leave(&self->guard); /* closed in a forked child, where the guard is not used */
  return py_channel_get(self);
}

tshare_channel *py_channel_enter(PyChannel *self) { return py_channel_enter_by(self, NULL, -1); }

void py_channel_leave(PyChannel *self) { py_guard_leave(&self->guard); }

int py_channel_wait(PyChannel *self, const char *what, int timeout_ms, const py_guard_slice *slice,
                    int timeout_answers, int *status) {
  if (!py_channel_get(self)) return -1;
  if (py_guard_wait(&self->guard, what, timeout_ms, slice, status) < 0) {
    if (!timeout_answers || *status != TSHARE_E_TIMEOUT) return -1;
    PyErr_Clear(); /* its turn did not come in time: nothing came in time, the answer */
    return 0;
  }
  int answer = *status == TSHARE_OK || *status == TSHARE_END || (timeout_answers && *status == TSHARE_E_TIMEOUT);
  if (!answer) py_raise_channel(self->ch, *status, what);
  py_channel_leave(self);
  return answer ? 0 : -1;
}

/* Frees the C channel once no call is inside: a call waiting in another
 * thread sees the close at its next slice and raises. */
static int close_channel(PyChannel *self) {
  int r = py_guard_begin_close(&self->guard);
  if (r <= 0) return r;
  tshare_channel *ch = self->ch;
  self->ch = NULL;
  py_set_drop_waiting(self);
  py_set_forget(self);
  py_ahead_forget(&self->ahead);
  Py_BEGIN_ALLOW_THREADS tshare_channel_close(ch);
  Py_END_ALLOW_THREADS
  py_guard_leave(&self->guard);
  return 0;
}

/* Nothing can be inside: every call holds a reference to self. */
static void channel_dealloc(PyChannel *self) {
  tshare_channel *ch = self->ch;
  py_set_drop_waiting(self);
  py_set_forget(self);
  py_ahead_forget(&self->ahead);
  Py_BEGIN_ALLOW_THREADS tshare_channel_close(ch);
  Py_END_ALLOW_THREADS
  py_guard_destroy(&self->guard);
  PyObject_Free(self);
}

static PyObject *channel_close(PyChannel *self, PyObject *unused) {
  (void)unused;
  if (close_channel(self) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *channel_enter(PyChannel *self, PyObject *unused) {
  (void)unused;
  if (!py_channel_get(self)) return NULL;
  Py_INCREF(self);
  return (PyObject *)self;
}

static PyObject *channel_exit(PyChannel *self, PyObject *args) {
  (void)args;
  if (close_channel(self) < 0) return NULL;
  Py_RETURN_FALSE;
}

static PyObject *channel_fileno(PyChannel *self, PyObject *unused) {
  (void)unused;
  tshare_channel *ch = py_channel_get(self);
  return ch ? PyLong_FromLong(tshare_channel_fd(ch)) : NULL;
}

/* Slices of poll and send_bye: arg is the channel. */
static int poll_slice(void *arg, int slice_ms) { return tshare_channel_poll(((PyChannel *)arg)->ch, slice_ms); }

static int send_bye_slice(void *arg, int slice_ms) {
  return tshare_channel_send_bye(((PyChannel *)arg)->ch, 0, slice_ms); /* a bye that timed out did not go */
}

/* True: something was processed; False: nothing came in time; None: the peer said bye. */
static PyObject *channel_poll(PyChannel *self, PyObject *args) {
  int timeout_ms = 0, rc;
  if (!PyArg_ParseTuple(args, "|i", &timeout_ms)) return NULL;
  py_guard_slice slice = {poll_slice, NULL, self};
  if (py_channel_wait(self, "poll", timeout_ms, &slice, 1, &rc) < 0) return NULL;
  if (rc == TSHARE_OK) Py_RETURN_TRUE;
  if (rc == TSHARE_E_TIMEOUT) Py_RETURN_FALSE;
  Py_RETURN_NONE;
}

typedef struct release_wait {
  PyChannel *self;
  uint64_t share_id;
} release_wait;

static int wait_released_slice(void *arg, int slice_ms) {
  release_wait *w = arg;
  return tshare_channel_wait_released(w->self->ch, w->share_id, slice_ms);
}

static PyObject *channel_wait_released(PyChannel *self, PyObject *args) {
  unsigned long long share_id = 0;
  int timeout_ms = -1, rc;
  if (!PyArg_ParseTuple(args, "|Ki", &share_id, &timeout_ms)) return NULL;
  release_wait w = {self, share_id};
  py_guard_slice slice = {wait_released_slice, NULL, &w};
  if (py_channel_wait(self, "wait_released", timeout_ms, &slice, 0, &rc) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *channel_is_released(PyChannel *self, PyObject *args) {
  unsigned long long share_id;
  if (!PyArg_ParseTuple(args, "K", &share_id)) return NULL;
  tshare_channel *ch = py_channel_enter(self);
  if (!ch) return NULL;
  int r = tshare_share_is_released(ch, share_id);
  py_channel_leave(self);
  if (r < 0) return py_raise_fmt(TSHARE_E_INVALID_ARG, "tshare: share %llu was not sent on this channel", share_id);
  return PyBool_FromLong(r);
}

static PyObject *channel_outstanding(PyChannel *self, PyObject *unused) {
  (void)unused;
  tshare_channel *ch = py_channel_enter(self);
  if (!ch) return NULL;
  size_t n = tshare_channel_outstanding(ch);
  py_channel_leave(self);
  return PyLong_FromSize_t(n);
}

static PyObject *channel_send_bye(PyChannel *self, PyObject *args) {
  int timeout_ms = -1, rc;
  if (!PyArg_ParseTuple(args, "|i", &timeout_ms)) return NULL;
  py_guard_slice slice = {send_bye_slice, NULL, self};
  if (py_channel_wait(self, "send_bye", timeout_ms, &slice, 0, &rc) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *channel_get_closed(PyChannel *self, void *unused) {
  (void)unused;
  return PyBool_FromLong(self->ch == NULL);
}

/* How the channel's frames travel, as Channel.transport names it. */
static const char *transport_name(tshare_channel *ch) {
  if (tshare_channel_kind_of(ch) == TSHARE_CHANNEL_PIPES) return "pipes";
  switch (tshare_channel_transport(ch)) {
  case TSHARE_TRANSPORT_RING:
    return "ring";
  case TSHARE_TRANSPORT_UCX:
    return "ucx";
  default:
    return "socket";
  }
}

static PyObject *channel_get_transport(PyChannel *self, void *unused) {
  (void)unused;
  tshare_channel *ch = py_channel_get(self);
  if (!ch) return NULL;
  return PyUnicode_FromString(transport_name(ch));
}

static PyObject *channel_get_gpu_path(PyChannel *self, void *unused) {
  (void)unused;
  tshare_channel *ch = py_channel_get(self);
  if (!ch) return NULL;
  switch (tshare_channel_gpu_path(ch)) {
  case TSHARE_GPU_PATH_IPC: return PyUnicode_FromString("ipc");
  case TSHARE_GPU_PATH_STAGED: return PyUnicode_FromString("staged");
  default: Py_RETURN_NONE;
  }
}

static PyObject *channel_get_peer_name(PyChannel *self, void *unused) {
  (void)unused;
  tshare_channel *ch = py_channel_get(self);
  return ch ? PyUnicode_DecodeUTF8(tshare_channel_peer(ch)->name, strlen(tshare_channel_peer(ch)->name), "replace")
            : NULL;
}

static PyObject *channel_get_peer_pid(PyChannel *self, void *unused) {
  (void)unused;
  tshare_channel *ch = py_channel_get(self);
  return ch ? PyLong_FromUnsignedLong(tshare_channel_peer(ch)->pid) : NULL;
}

static PyObject *channel_get_last_error(PyChannel *self, void *unused) {
  (void)unused;
  tshare_channel *ch = self->ch ? py_channel_enter(self) : NULL;
  if (!ch) { /* closed, also meanwhile; a signal handler's exception (Ctrl-C while it waited for its turn) goes on */
    if (PyErr_Occurred() && !py_error_is_tshare()) return NULL;
    PyErr_Clear();
    return PyUnicode_FromString("");
  }
  PyObject *detail = PyUnicode_FromString(tshare_channel_last_error(ch));
  py_channel_leave(self);
  return detail;
}

static PyObject *channel_repr(PyChannel *self) {
  if (!self->ch) return PyUnicode_FromString("<tshare.Channel closed>");
  tshare_channel *ch = py_channel_enter(self);
  if (!ch) { /* closed meanwhile; a signal handler's exception goes on */
    if (!py_error_is_tshare()) return NULL;
    PyErr_Clear();
    return PyUnicode_FromString("<tshare.Channel closed>");
  }
  const tshare_hello *peer = tshare_channel_peer(ch);
  const char *transport = transport_name(ch);
  PyObject *r = PyUnicode_FromFormat("<tshare.Channel to '%s' (pid %u) over %s, %zu shares outstanding>", peer->name,
                                     (unsigned)peer->pid, transport, tshare_channel_outstanding(ch));
  py_channel_leave(self);
  return r;
}

static PyMethodDef channel_methods[] = {
  {"close", (PyCFunction)channel_close, METH_NOARGS,
   "Close: flush releases, say bye unless sent, drop what the peer holds. Idempotent."},
  {"fileno", (PyCFunction)channel_fileno, METH_NOARGS, "The fd an event loop watches for readability."},
  {"poll", (PyCFunction)channel_poll, METH_VARARGS,
   "_poll(timeout_ms): True if something was processed, False if nothing came, None once the peer said bye."},
  {"_wait_released", (PyCFunction)channel_wait_released, METH_VARARGS, NULL},
  {"is_released", (PyCFunction)channel_is_released, METH_VARARGS, "Whether the peer released share_id."},
  {"outstanding", (PyCFunction)channel_outstanding, METH_NOARGS, "Shares sent that the peer still holds."},
  {"_send_bye", (PyCFunction)channel_send_bye, METH_VARARGS, NULL},
  {"_send", (PyCFunction)py_channel_send, METH_VARARGS, NULL},
  {"_send_host_at", (PyCFunction)py_channel_send_host_at, METH_VARARGS, NULL},
  {"_send_set", (PyCFunction)py_channel_send_set, METH_VARARGS, NULL},
  {"_send_set_all", (PyCFunction)py_channel_send_set_all, METH_VARARGS, NULL},
  {"_forget_set", (PyCFunction)py_channel_forget_set, METH_NOARGS, NULL},
  {"_recv", (PyCFunction)py_channel_recv, METH_VARARGS, NULL},
  {"_peek", (PyCFunction)py_channel_peek, METH_NOARGS, NULL},
  {"_ahead_wanted", py_channel_ahead_wanted, METH_NOARGS, NULL},
  {"_ahead_spec", py_channel_ahead_spec, METH_NOARGS, NULL},
  {"_ahead_put", py_channel_ahead_put, METH_VARARGS, NULL},
  {"_ahead_into", py_channel_ahead_into, METH_VARARGS, NULL},
  {"_ahead_withdraw", py_channel_ahead_withdraw, METH_O, NULL},
  {"__enter__", (PyCFunction)channel_enter, METH_NOARGS, NULL},
  {"__exit__", (PyCFunction)channel_exit, METH_VARARGS, NULL},
  {NULL, NULL, 0, NULL}};

static PyGetSetDef channel_getset[] = {
  {"closed", (getter)channel_get_closed, NULL, "True once closed.", NULL},
  {"transport", (getter)channel_get_transport, NULL, "'ring', 'socket', 'pipes' or 'ucx'.", NULL},
  {"gpu_path", (getter)channel_get_gpu_path, NULL,
   "How GPU tensors reach the peer: 'ipc' (mapped, same host), 'staged' (through host memory, across hosts) or None.",
   NULL},
  {"peer_name", (getter)channel_get_peer_name, NULL, "The name the peer gave in its hello.", NULL},
  {"peer_pid", (getter)channel_get_peer_pid, NULL, "The peer's pid as the kernel reports it.", NULL},
  {"last_error", (getter)channel_get_last_error, NULL, "The channel's last error detail.", NULL},
  {"_set_cache_counts", (getter)py_channel_set_cache_counts, NULL, NULL, NULL},
  {"_ahead_counts", py_channel_ahead_counts, NULL, NULL, NULL},
  {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject PyChannel_Type = {
  PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tshare._tshare.Channel",
  .tp_basicsize = sizeof(PyChannel),
  .tp_dealloc = (destructor)channel_dealloc,
  .tp_repr = (reprfunc)channel_repr,
  .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
  .tp_doc = "A connected tshare channel (see tshare.Channel).",
  .tp_methods = channel_methods,
  .tp_getset = channel_getset,
};

/* ---- opening channels ------------------------------------------------------ */

static char *open_keywords[] = {"fd", "name", "transport", "spin_us", "allow_uid", NULL};

PyObject *py_open_socket(PyObject *module, PyObject *args, PyObject *kwargs) {
  (void)module;
  int fd, spin_us = -1, rc;
  long allow_uid = -1;
  PyObject *name = NULL, *transport = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i|OOil", open_keywords, &fd, &name, &transport, &spin_us,
                                   &allow_uid))
    return NULL;
  tshare_channel_options opts;
  if (py_channel_options(name, transport, spin_us, allow_uid, &opts) < 0) return NULL;
  tshare_channel *ch = NULL;
  tshare_error err;
  Py_BEGIN_ALLOW_THREADS rc = tshare_channel_open_socket(fd, &opts, &ch, &err);
  Py_END_ALLOW_THREADS
  if (rc != TSHARE_OK) return py_raise_fmt(rc, "tshare: open channel: %s", err.message);
  return py_channel_wrap(ch);
}

static char *option_keywords[] = {"name", "transport", "spin_us", "allow_uid", NULL};

/* _open_socket's checks of its options alone: a caller that must keep its fd
 * when they fail (the fd goes to the library only once they passed) asks
 * first. */
PyObject *py_check_options(PyObject *module, PyObject *args, PyObject *kwargs) {
  (void)module;
  int spin_us = -1;
  long allow_uid = -1;
  PyObject *name = NULL, *transport = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OOil", option_keywords, &name, &transport, &spin_us, &allow_uid))
    return NULL;
  tshare_channel_options opts;
  if (py_channel_options(name, transport, spin_us, allow_uid, &opts) < 0) return NULL;
  Py_RETURN_NONE;
}

PyObject *py_socketpair(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  int fds[2];
  tshare_error err;
  int rc = tshare_socketpair(fds, &err);
  if (rc != TSHARE_OK) return py_raise_fmt(rc, "tshare: socketpair: %s", err.message);
  return Py_BuildValue("(ii)", fds[0], fds[1]);
}

static char *connect_keywords[] = {"name",    "timeout_ms", "channel_name", "transport",
                                   "spin_us", "allow_uid",  "token",        NULL};

PyObject *py_connect(PyObject *module, PyObject *args, PyObject *kwargs) {
  (void)module;
  const char *where;
  int timeout_ms = -1, spin_us = -1, rc;
  long allow_uid = -1;
  PyObject *name = NULL, *transport = NULL;
  const char *token = NULL; /* ucx:// addresses: None takes TSHARE_TOKEN */
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|iOOilz", connect_keywords, &where, &timeout_ms, &name, &transport,
                                   &spin_us, &allow_uid, &token))
    return NULL;
  tshare_channel_options opts;
  if (py_channel_options(name, transport, spin_us, allow_uid, &opts) < 0) return NULL;
  opts.token = token;
  tshare_channel *ch = NULL;
  tshare_error err;
  Py_BEGIN_ALLOW_THREADS rc = tshare_connect(where, &opts, timeout_ms, &ch, &err);
  Py_END_ALLOW_THREADS
  if (rc != TSHARE_OK) return py_raise_fmt(rc, "tshare: connect to '%s': %s", where, err.message);
  return py_channel_wrap(ch);
}

/* ---- Listener ------------------------------------------------------------- */

typedef struct {
  PyObject_HEAD tshare_listener *l; /* NULL once closed */
  py_guard guard;                   /* one thread at a time inside l's calls, as for channels */
} PyListener;

PyObject *py_listen(PyObject *module, PyObject *args) {
  (void)module;
  const char *name;
  if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
  tshare_listener *l = NULL;
  tshare_error err;
  int rc = tshare_listen(name, &l, &err);
  if (rc != TSHARE_OK) return py_raise_fmt(rc, "tshare: listen on '%s': %s", name, err.message);
  PyListener *self = PyObject_New(PyListener, &PyListener_Type);
  if (!self) {
    tshare_listener_close(l);
    return NULL;
  }
  self->l = l;
  py_guard_init(&self->guard, "listener");
  return (PyObject *)self;
}

static int listener_close_now(PyListener *self) {
  int r = py_guard_begin_close(&self->guard);
  if (r <= 0) return r;
  tshare_listener_close(self->l);
  self->l = NULL;
  py_guard_leave(&self->guard);
  return 0;
}

static void listener_dealloc(PyListener *self) {
  tshare_listener_close(self->l);
  py_guard_destroy(&self->guard);
  PyObject_Free(self);
}

/* For what never changes while the GIL is held (the fd, the path). */
static tshare_listener *listener_get(PyListener *self) {
  if (!self->l) py_raise(TSHARE_E_STATE, "tshare: the listener is closed");
  return self->l;
}

typedef struct accept_call {
  PyListener *self;
  const tshare_channel_options *opts;
  int64_t deadline;
  tshare_channel *ch;
  tshare_error err;
} accept_call;

/* Whether a peer knocked within slice_ms (a signal counts as no). */
static int knocked(int fd, int slice_ms) {
  struct pollfd p = {fd, POLLIN, 0};
  int n = poll(&p, 1, slice_ms);
  return n > 0 || (n < 0 && errno != EINTR); /* a poll error: accept reports it */
}

/* The accept's budget once a peer knocked: its whole hello (a slice would
 * cut a slow but good peer short), within the caller's timeout. When that
 * peer is dropped, the accept waits for the next one for the rest of it. */
static int hello_budget_ms(const accept_call *a) {
  int left = py_guard_left_ms(a->deadline), hello = a->opts->handshake_timeout_ms;
  return left < 0 || left > hello ? hello : left;
}

/* One slice of accept: wait for a knock, and only then accept. */
static int accept_slice(void *arg, int slice_ms) {
  accept_call *a = arg;
  tshare_listener *l = a->self->l;
  if (!knocked(tshare_listener_fd(l), slice_ms)) return TSHARE_E_TIMEOUT;
  return tshare_listener_accept(l, a->opts, hello_budget_ms(a), &a->ch, &a->err);
}

static char *accept_keywords[] = {"timeout_ms", "name", "transport", "spin_us", "allow_uid", "token", NULL};

static PyObject *listener_accept(PyListener *self, PyObject *args, PyObject *kwargs) {
  int timeout_ms = -1, spin_us = -1, rc;
  long allow_uid = -1;
  PyObject *name = NULL, *transport = NULL;
  const char *token = NULL; /* a ucx:// listener's: None takes TSHARE_TOKEN */
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|iOOilz", accept_keywords, &timeout_ms, &name, &transport, &spin_us,
                                   &allow_uid, &token))
    return NULL;
  if (!listener_get(self)) return NULL;
  tshare_channel_options opts;
  if (py_channel_options(name, transport, spin_us, allow_uid, &opts) < 0) return NULL;
  opts.token = token;
  accept_call a = {self, &opts, py_guard_deadline(timeout_ms), NULL, {0}};
  py_guard_slice slice = {accept_slice, NULL, &a};
  if (py_guard_wait(&self->guard, "accept", timeout_ms, &slice, &rc) < 0) return NULL;
  const char *path = tshare_listener_path(self->l);
  py_guard_leave(&self->guard);
  if (rc == TSHARE_E_TIMEOUT && !a.err.message[0])
    return py_raise_fmt(rc, "tshare: accept: nobody connected to %s in time", path);
  if (rc != TSHARE_OK) return py_raise_fmt(rc, "tshare: accept: %s", a.err.message);
  return py_channel_wrap(a.ch);
}

static PyObject *listener_close(PyListener *self, PyObject *unused) {
  (void)unused;
  if (listener_close_now(self) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *listener_fileno(PyListener *self, PyObject *unused) {
  (void)unused;
  tshare_listener *l = listener_get(self);
  return l ? PyLong_FromLong(tshare_listener_fd(l)) : NULL;
}

static PyObject *listener_get_path(PyListener *self, void *unused) {
  (void)unused;
  tshare_listener *l = listener_get(self);
  return l ? PyUnicode_DecodeFSDefault(tshare_listener_path(l)) : NULL;
}

static PyObject *listener_enter(PyListener *self, PyObject *unused) {
  (void)unused;
  if (!listener_get(self)) return NULL;
  Py_INCREF(self);
  return (PyObject *)self;
}

static PyObject *listener_exit(PyListener *self, PyObject *args) {
  (void)args;
  if (listener_close_now(self) < 0) return NULL;
  Py_RETURN_FALSE;
}

static PyObject *listener_repr(PyListener *self) {
  if (!self->l) return PyUnicode_FromString("<tshare.Listener closed>");
  return PyUnicode_FromFormat("<tshare.Listener on %s>", tshare_listener_path(self->l));
}

static PyMethodDef listener_methods[] = {
  {"_accept", (PyCFunction)(void (*)(void))listener_accept, METH_VARARGS | METH_KEYWORDS, NULL},
  {"close", (PyCFunction)listener_close, METH_NOARGS, "Stop listening and remove the socket file. Idempotent."},
  {"fileno", (PyCFunction)listener_fileno, METH_NOARGS, "Readable when a peer waits."},
  {"__enter__", (PyCFunction)listener_enter, METH_NOARGS, NULL},
  {"__exit__", (PyCFunction)listener_exit, METH_VARARGS, NULL},
  {NULL, NULL, 0, NULL}};

static PyGetSetDef listener_getset[] = {{"path", (getter)listener_get_path, NULL, "The socket's path.", NULL},
                                        {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject PyListener_Type = {
  PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tshare._tshare.Listener",
  .tp_basicsize = sizeof(PyListener),
  .tp_dealloc = (destructor)listener_dealloc,
  .tp_repr = (reprfunc)listener_repr,
  .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
  .tp_doc = "A rendezvous listener (see tshare.listen).",
  .tp_methods = listener_methods,
  .tp_getset = listener_getset,
};

/* ---- Role ------------------------------------------------------------------ */

typedef struct {
  PyObject_HEAD tshare_role role;
} PyRole;

PyObject *py_role_from_env(PyObject *module, PyObject *unused) {
  (void)module;
  (void)unused;
  PyRole *self = PyObject_New(PyRole, &PyRole_Type);
  if (!self) return NULL;
  tshare_error err;
  int rc = tshare_role_from_env(&self->role, &err);
  if (rc == TSHARE_E_NOT_FOUND) {
    Py_DECREF(self);
    Py_RETURN_NONE;
  }
  if (rc != TSHARE_OK) {
    Py_DECREF(self);
    return py_raise_fmt(rc, "tshare: role: %s", err.message);
  }
  return (PyObject *)self;
}

/* Channels it did not open stay the process's fds, as with the C API. */
static void role_dealloc(PyRole *self) { PyObject_Free(self); }

static char *role_channel_keywords[] = {"index", "name", "transport", "spin_us", "allow_uid", NULL};

static PyObject *role_channel(PyRole *self, PyObject *args, PyObject *kwargs) {
  int index = 0, spin_us = -1, rc;
  long allow_uid = -1;
  PyObject *name = NULL, *transport = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|iOOil", role_channel_keywords, &index, &name, &transport, &spin_us,
                                   &allow_uid))
    return NULL;
  if (index < 0 || index >= self->role.nchannels)
    return py_raise_fmt(TSHARE_E_INVALID_ARG, "tshare: role %s %d has %d channel(s); there is no channel %d",
                        self->role.name, self->role.rank, self->role.nchannels, index);
  if (self->role.channels[index].read_fd == -1)
    return py_raise_fmt(TSHARE_E_STATE, "tshare: channel %d of this role is already open", index);
  tshare_channel_options opts;
  if (py_channel_options(name, transport, spin_us, allow_uid, &opts) < 0) return NULL;
  tshare_channel *ch = NULL;
  tshare_error err;
  Py_BEGIN_ALLOW_THREADS rc = tshare_role_open_channel(&self->role, index, &opts, &ch, &err);
  Py_END_ALLOW_THREADS
  if (rc != TSHARE_OK) return py_raise_fmt(rc, "tshare: role channel %d: %s", index, err.message);
  return py_channel_wrap(ch);
}

static PyObject *role_report(PyRole *self, PyObject *args) {
  const char *key;
  long long value;
  if (!PyArg_ParseTuple(args, "sL", &key, &value)) return NULL;
  tshare_role_report(&self->role, key, value);
  Py_RETURN_NONE;
}

static PyObject *role_report_add(PyRole *self, PyObject *args) {
  const char *key;
  long long delta;
  if (!PyArg_ParseTuple(args, "sL", &key, &delta)) return NULL;
  tshare_role_report_add(&self->role, key, delta);
  Py_RETURN_NONE;
}

static PyObject *role_get_name(PyRole *self, void *unused) {
  (void)unused;
  return PyUnicode_FromString(self->role.name);
}
static PyObject *role_get_rank(PyRole *self, void *unused) {
  (void)unused;
  return PyLong_FromLong(self->role.rank);
}
static PyObject *role_get_num_consumers(PyRole *self, void *unused) {
  (void)unused;
  return PyLong_FromLong(self->role.num_consumers);
}
static PyObject *role_get_num_channels(PyRole *self, void *unused) {
  (void)unused;
  return PyLong_FromLong(self->role.nchannels);
}

static PyObject *role_repr(PyRole *self) {
  return PyUnicode_FromFormat("<tshare.Role %s rank %d of %d consumer(s), %d channel(s)>", self->role.name,
                              self->role.rank, self->role.num_consumers, self->role.nchannels);
}

static PyMethodDef role_methods[] = {
  {"channel", (PyCFunction)(void (*)(void))role_channel, METH_VARARGS | METH_KEYWORDS,
   "channel(index=0, name=None, transport=None): open the role's channel index (each once)."},
  {"report", (PyCFunction)role_report, METH_VARARGS, "report(key, value): set a figure in the launcher's summary."},
  {"report_add", (PyCFunction)role_report_add, METH_VARARGS, "report_add(key, delta): add to a figure."},
  {NULL, NULL, 0, NULL}};

static PyGetSetDef role_getset[] = {
  {"name", (getter)role_get_name, NULL, "'producer' or 'consumer'.", NULL},
  {"rank", (getter)role_get_rank, NULL, "0 for the producer; 0..K-1 for consumers.", NULL},
  {"num_consumers", (getter)role_get_num_consumers, NULL, "K.", NULL},
  {"num_channels", (getter)role_get_num_channels, NULL, "K for the producer, 1 for a consumer.", NULL},
  {NULL, NULL, NULL, NULL, NULL}};

PyTypeObject PyRole_Type = {
  PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tshare._tshare.Role",
  .tp_basicsize = sizeof(PyRole),
  .tp_dealloc = (destructor)role_dealloc,
  .tp_repr = (reprfunc)role_repr,
  .tp_flags = Py_TPFLAGS_DEFAULT,
  .tp_doc = "This process's role under tshare-launch (see tshare.role).",
  .tp_methods = role_methods,
  .tp_getset = role_getset,
};
