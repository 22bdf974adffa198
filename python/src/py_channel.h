/* py_channel.h - tshare.Channel, tshare.Listener and tshare.Role: the C
 * objects behind a channel, the rendezvous and the launcher's roles. */
#ifndef TSHARE_PY_CHANNEL_H
#define TSHARE_PY_CHANNEL_H

#define PY_SSIZE_T_CLEAN
#include "py_guard.h"
#include "py_set_ahead.h"

#include <Python.h>
#include <tshare/tshare.h>

/* A tensor set the channel's recv found: taken from the C library (which
 * queues sets apart from single shares) and kept here until recv hands it
 * out in the sender's order; or the refusal of a set the peer got wrong,
 * kept for the recv that comes to it. Read and written inside the guard. */
typedef struct py_next_set {
  tshare_set *set;
  int refusal;          /* a tshare status, TSHARE_OK when none */
  char refusal_msg[256];
} py_next_set;

/* The last tensor set sent on the channel: its builder, sent again while
 * send is given the same tensors (names, addresses, dtypes, layouts), with
 * the items it was built from. The builder holds every memory of the set, so
 * an equal address is the same memory while it is kept. Read and written
 * inside the guard; dropped at close. */
typedef struct py_set_cache {
  tshare_set_builder *builder; /* NULL when none */
  PyObject *items;             /* what send was given for it */
  int cuda_device;             /* of its CUDA members; -1 when it has none */
  unsigned long long hits, builds;
} py_set_cache;

typedef struct {
  PyObject_HEAD tshare_channel *ch; /* NULL once closed */
  py_guard guard;                   /* one thread at a time inside ch's calls */
  py_next_set next;
  py_set_cache last_set;
  py_set_ahead ahead; /* the next set's tensors, made while recv waits */
} PyChannel;

extern PyTypeObject PyChannel_Type;
extern PyTypeObject PyListener_Type;
extern PyTypeObject PyRole_Type;

/* A Channel owning ch; NULL (ch closed) on failure. */
PyObject *py_channel_wrap(tshare_channel *ch);

/* The open channel behind self, for a caller that reads what never changes
 * (the peer's hello, the fd) and keeps the GIL until it is done with it: a
 * close frees the channel only after taking the GIL back. NULL with
 * tshare.Error (TSHARE_E_STATE) if closed. */
tshare_channel *py_channel_get(PyChannel *self);

/* The open channel behind self with this thread inside its guard until
 * py_channel_leave(): for every C call that may release the GIL or reads
 * state that calls change (counts, the last error). NULL with tshare.Error
 * if closed. */
tshare_channel *py_channel_enter(PyChannel *self);
/* The same, giving up with tshare.TimeoutError (naming what) once deadline
 * (py_guard_deadline) has passed while another thread's call held it. */
tshare_channel *py_channel_enter_by(PyChannel *self, const char *what, int64_t deadline);
void py_channel_leave(PyChannel *self);

/* A wait on self's channel in slices (py_guard_wait), then leave. 0 with
 * *status TSHARE_OK or TSHARE_END, or TSHARE_E_TIMEOUT when timeout_answers
 * (the call's own answer, not an error; also when another thread's call
 * held the channel for the whole timeout); -1 with a Python error for any
 * other status, raised as "tshare: WHAT: <the channel's detail>" before
 * leaving, so that the detail is this call's. */
int py_channel_wait(PyChannel *self, const char *what, int timeout_ms, const py_guard_slice *slice,
                    int timeout_answers, int *status);

/* Channel options from keyword values: name, transport ("ring", "socket" or
 * None), spin_us, allow_uid. name must outlive the options (it is borrowed). */
int py_channel_options(PyObject *name, PyObject *transport, int spin_us, long allow_uid, tshare_channel_options *opts);

/* Module-level functions (tshare_module.c lists them). */
PyObject *py_open_socket(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_check_options(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_socketpair(PyObject *module, PyObject *unused);
PyObject *py_listen(PyObject *module, PyObject *args);
PyObject *py_connect(PyObject *module, PyObject *args, PyObject *kwargs);
PyObject *py_role_from_env(PyObject *module, PyObject *unused);

/* Tensor sets (py_set.c). Inside the guard, no GIL needed: whether a set
 * (or a set's refusal) waits for recv, taking it from the C library first. */
int py_set_waiting(PyChannel *self);
/* The id of the set waiting, 0 when a refusal waits. */
uint64_t py_set_waiting_id(const PyChannel *self);
/* Inside the guard, with the GIL: the waiting set as recv's result, or its
 * refusal raised; the set is no longer waiting either way. */
PyObject *py_set_take(PyChannel *self);
/* The channel closes: a set never handed out goes back. */
void py_set_drop_waiting(PyChannel *self);
PyObject *py_channel_send_set(PyChannel *self, PyObject *args);
/* How a built (or kept) set, its metadata set, goes out inside self's
 * guard: its result is _send_set's, ctx the caller's. */
typedef PyObject *(*py_set_sender)(PyChannel *self, tshare_set_builder *b, int timeout_ms, void *ctx);
/* _send_set's arguments parsed and its work done (the kept set, or items
 * built and kept), the set going out through send. */
PyObject *py_set_send_args(PyChannel *self, PyObject *args, py_set_sender send, void *ctx);
/* _send_set_all(others, <_send_set's arguments>): one set to self and every
 * channel of the list others (py_set_fanout.c). */
PyObject *py_channel_send_set_all(PyChannel *self, PyObject *args);
/* Drop the last set's builder (close, dealloc, forget_set), with the GIL,
 * when no other call is inside. */
void py_set_forget(PyChannel *self);
PyObject *py_channel_forget_set(PyChannel *self, PyObject *unused);
PyObject *py_channel_set_cache_counts(PyChannel *self, void *unused);

/* Channel methods that move tensors (py_tensor.c). */
PyObject *py_channel_send(PyChannel *self, PyObject *args);
PyObject *py_channel_send_host_at(PyChannel *self, PyObject *args);
PyObject *py_channel_recv(PyChannel *self, PyObject *args);
PyObject *py_channel_peek(PyChannel *self, PyObject *unused);

#endif /* TSHARE_PY_CHANNEL_H */
