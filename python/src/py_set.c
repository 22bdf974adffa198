/* py_set.c - tensor sets for the Python package: Channel._send_set hands
 * many named host and CUDA tensors and metadata over in one set
 * (tshare/set.h), and
 * recv takes sets as well as single shares, in the order they were sent.
 *
 * The C library queues received sets apart from single shares. Both kinds
 * take their ids from one counter of the sender's channel, so when a set and
 * a share both wait, the lower id went first: recv takes a set off the
 * library's queue into the channel (PyChannel.next) and hands it out once no
 * share with a lower id waits before it. */
#include "py_channel.h"
#include "py_errors.h"
#include "py_memory.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- sending --------------------------------------------------------------- */

/* The host buffer a member lives in and its offset there. An empty tensor
 * has no memory of its own: when its address lies in no buffer, it rides in
 * the set's spare buffer (made on first need) at offset 0. */
static tshare_host_buffer *member_buffer(uintptr_t data, int empty, tshare_host_buffer **spare, uint64_t *offset) {
  tshare_host_buffer *buf = py_memory_host_buffer_at(data);
  if (buf) {
    *offset = data - (uintptr_t)tshare_host_buffer_data(buf);
    return buf;
  }
  if (!empty) return NULL;
  tshare_error err;
  if (!*spare && tshare_host_buffer_create(1, "tshare-python", spare, &err) != TSHARE_OK) return NULL;
  *offset = 0;
  return *spare;
}

static int fill_member_desc(PyObject *dtype_codes, PyObject *dtype, PyObject *shape, PyObject *strides,
                            tshare_tensor_desc *d) {
  memset(d, 0, sizeof *d);
  PyObject *code_bits = PyDict_GetItemWithError(dtype_codes, dtype); /* borrowed */
  Py_ssize_t n = PyTuple_GET_SIZE(shape);
  if (!code_bits || n > TSHARE_MAX_NDIM || PyTuple_GET_SIZE(strides) != n) return 0;
  d->dtype = (tshare_dtype){(uint8_t)PyLong_AsLong(PyTuple_GET_ITEM(code_bits, 0)),
                            (uint8_t)PyLong_AsLong(PyTuple_GET_ITEM(code_bits, 1)), 1};
  d->ndim = (int32_t)n;
  for (Py_ssize_t i = 0; i < n; i++) {
    d->shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
    d->strides[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, i));
  }
  return PyErr_Occurred() ? -1 : 1;
}

/* A name the set takes as is (1..TSHARE_SET_NAME_MAX bytes of UTF-8, no
 * NUL), or NULL: the Python side says what is wrong with it. */
static const char *member_name(PyObject *name) {
  Py_ssize_t len;
  const char *utf8 = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, &len) : NULL;
  if (!utf8) {
    PyErr_Clear(); /* a lone surrogate */
    return NULL;
  }
  return len >= 1 && len <= TSHARE_SET_NAME_MAX && strlen(utf8) == (size_t)len ? utf8 : NULL;
}

/* What keeps a CUDA member's memory alive: its storage (a Python object the
 * items give: torch's storage, or tshare._torch_native's hold of it), held
 * once by a counted box in which every holder (the builder, each sent set,
 * a segment kept between sets) counts. The core retains and drops inside
 * calls that run with the GIL released, once per member of every set sent:
 * counting takes no GIL, which a 290-tensor set sent again would otherwise
 * take and give back 290 times per send and as many at its release. Only
 * the last drop takes it, to let the storage go. */
typedef struct python_keep {
  _Atomic size_t refs;
  PyObject *object;
} python_keep;

static void retain_python_keep(void *keep) {
  atomic_fetch_add_explicit(&((python_keep *)keep)->refs, 1, memory_order_relaxed);
}

static void drop_python_keep(void *keep) {
  python_keep *k = keep;
  if (atomic_fetch_sub_explicit(&k->refs, 1, memory_order_acq_rel) != 1) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_DECREF(k->object);
  PyGILState_Release(gil);
  free(k);
}

/* A CUDA member (storage_key, storage_base, storage holder, device after
 * the common fields): 1 added, 0 the Python side must look at it (a received tensor),
 * -1 with a Python error. An empty storage has no allocation to export: a
 * small owned buffer carries the (empty) layout, as a single send does. */
static int add_cuda_member(tshare_set_builder *b, const char *name, uintptr_t data, PyObject *cuda,
                           tshare_tensor_desc *d, int *cuda_device) {
  unsigned long long storage_key, base;
  PyObject *holder;
  int device;
  if (!PyArg_ParseTuple(cuda, "KKOi", &storage_key, &base, &holder, &device)) return -1;
  *cuda_device = device;
  void *memory;
  if (py_memory_lookup((uintptr_t)storage_key, &memory) != PY_MEM_NONE) return 0;
  tshare_error err;
  int rc;
  if (base == 0) {
    tshare_cuda_buffer *buffer = NULL;
    rc = tshare_cuda_buffer_create_kind(device, 256, TSHARE_CUDA_HANDLE_LEGACY, &buffer, &err);
    d->byte_offset = 0;
    if (rc == TSHARE_OK) rc = tshare_set_builder_add_cuda_buffer(b, name, buffer, d, &err);
    tshare_cuda_buffer_release(buffer); /* the builder holds it */
  } else {
    d->byte_offset = tshare_tensor_numel(d) == 0 ? 0 : data - base;
    python_keep *keep = malloc(sizeof *keep);
    if (!keep) {
      PyErr_NoMemory();
      return -1;
    }
    atomic_init(&keep->refs, 1); /* the builder's */
    Py_INCREF(holder);
    keep->object = holder;
    rc = tshare_set_builder_add_cuda_keep(b, name, (void *)(uintptr_t)base, d, retain_python_keep, drop_python_keep,
                                          keep, &err);
  }
  if (rc != TSHARE_OK) {
    py_raise_fmt(rc, "tshare: send: tensor '%.200s': %s", name, err.message);
    return -1;
  }
  return 1;
}

/* A set being built: the builder, and what its members need. */
typedef struct set_build {
  tshare_set_builder *b;
  PyObject *dtype_codes;      /* {torch dtype: (DLPack code, bits)} */
  tshare_host_buffer *spare;  /* empty members' buffer, made on first need */
  int cuda_device;            /* of the CUDA members, -1 when none */
} set_build;

/* Add item (name, data_ptr, dtype, shape, strides, lazy[, cuda]): 1 added;
 * 0 the Python side must look at it (an odd name, dtype or layout, a lazily
 * negated or conjugated view, memory that is no host buffer); -1 with a
 * Python error. cuda, for a CUDA tensor: (storage_key, storage_base,
 * storage holder, device). */
static int add_member(set_build *sb, PyObject *item) {
  PyObject *name_obj, *dtype, *shape, *strides, *cuda = NULL;
  unsigned long long data;
  int lazy;
  if (!PyArg_ParseTuple(item, "OKOO!O!p|O!", &name_obj, &data, &dtype, &PyTuple_Type, &shape, &PyTuple_Type,
                        &strides, &lazy, &PyTuple_Type, &cuda))
    return -1;
  const char *name = member_name(name_obj);
  tshare_tensor_desc d;
  int r = name && !lazy ? fill_member_desc(sb->dtype_codes, dtype, shape, strides, &d) : 0;
  if (r <= 0) return r;
  if (cuda) return add_cuda_member(sb->b, name, (uintptr_t)data, cuda, &d, &sb->cuda_device);
  tshare_host_buffer *buf = member_buffer((uintptr_t)data, tshare_tensor_numel(&d) == 0, &sb->spare, &d.byte_offset);
  if (!buf) return 0;
  tshare_error err;
  int rc = tshare_set_builder_add_host(sb->b, name, buf, &d, &err);
  if (rc != TSHARE_OK) {
    py_raise_fmt(rc, "tshare: send: tensor '%.200s': %s", name, err.message);
    return -1;
  }
  return 1;
}

/* The members of items in sb's builder: 0, or the index + 1 of the first
 * item the Python side must look at, or -1 with a Python error. */
static Py_ssize_t build_set(set_build *sb, PyObject *items) {
  Py_ssize_t n = PyList_GET_SIZE(items);
  for (Py_ssize_t i = 0; i < n; i++) {
    int r = add_member(sb, PyList_GET_ITEM(items, i));
    if (r <= 0) return r < 0 ? -1 : i + 1;
  }
  return 0;
}

/* ---- the last set, kept to be sent again ----------------------------------- */

void py_set_forget(PyChannel *self) {
  py_set_cache *c = &self->last_set;
  tshare_set_builder *b = c->builder;
  PyObject *items = c->items;
  c->builder = NULL;
  c->items = NULL;
  c->cuda_device = -1;
  tshare_set_builder_destroy(b); /* drops its references on the set's memory (sets sent keep their own) */
  Py_XDECREF(items);
}

static void keep_last_set(PyChannel *self, set_build *sb, PyObject *items) {
  py_set_forget(self);
  py_set_cache *c = &self->last_set;
  c->builder = sb->b;
  sb->b = NULL;
  Py_INCREF(items);
  c->items = items;
  c->cuda_device = sb->cuda_device;
  c->builds++;
}

/* The kept builder when items are those it was built from (one comparison:
 * names, addresses, dtypes, shapes, strides), with the stream its CUDA
 * members are ordered after now set; NULL when there is none, or with a
 * Python error. */
static tshare_set_builder *kept_builder_for(PyChannel *self, PyObject *items, PyObject *stream_for) {
  py_set_cache *c = &self->last_set;
  if (!c->builder) return NULL;
  int same = PyObject_RichCompareBool(c->items, items, Py_EQ);
  if (same <= 0) return NULL;
  unsigned long long stream = 0;
  if (c->cuda_device >= 0) {
    PyObject *r = PyObject_CallFunction(stream_for, "i", c->cuda_device);
    stream = r ? PyLong_AsUnsignedLongLong(r) : 0;
    Py_XDECREF(r);
    if (PyErr_Occurred()) return NULL;
  }
  tshare_set_builder_set_stream(c->builder, (void *)(uintptr_t)stream);
  c->hits++;
  return c->builder;
}

PyObject *py_channel_forget_set(PyChannel *self, PyObject *unused) {
  (void)unused;
  if (!self->ch) Py_RETURN_NONE; /* closed: nothing kept */
  if (!py_channel_enter(self)) return NULL;
  py_set_forget(self);
  py_channel_leave(self);
  Py_RETURN_NONE;
}

PyObject *py_channel_set_cache_counts(PyChannel *self, void *unused) {
  (void)unused;
  return Py_BuildValue("(KK)", self->last_set.hits, self->last_set.builds);
}

/* ---- sending it ------------------------------------------------------------- */

/* The send itself, inside the guard, in one call: a set that timed out
 * partway has gone in part (the peer releases it), so it cannot be tried
 * again in slices as a single share is. */
static PyObject *send_built(PyChannel *self, tshare_set_builder *b, int timeout_ms, void *unused) {
  (void)unused;
  tshare_channel *ch = self->ch;
  uint64_t id = 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = tshare_set_send(ch, b, NULL, timeout_ms, &id);
  Py_END_ALLOW_THREADS
  if (rc != TSHARE_OK) return py_raise_channel(ch, rc, "send (tensor set)");
  return Py_BuildValue("(KO)", (unsigned long long)id, Py_None);
}

/* b with meta, sent by send (with ctx). */
static PyObject *send_with_meta(PyChannel *self, tshare_set_builder *b, Py_buffer *meta, int timeout_ms,
                                py_set_sender send, void *ctx) {
  tshare_error err;
  int rc = tshare_set_builder_set_meta(b, meta->buf, (size_t)meta->len, &err);
  if (rc != TSHARE_OK) return py_raise_fmt(rc, "tshare: send: metadata: %s", err.message);
  return send(self, b, timeout_ms, ctx);
}

/* Inside the guard: the kept set sent again, or items built and sent (by
 * send, with ctx). */
static PyObject *send_in_guard(PyChannel *self, PyObject *items, PyObject *key, PyObject *dtype_codes,
                               Py_buffer *meta, int timeout_ms, PyObject *stream_for, int keep,
                               unsigned long long stream, py_set_sender send, void *ctx) {
  tshare_set_builder *kept = kept_builder_for(self, key, stream_for);
  if (kept) return send_with_meta(self, kept, meta, timeout_ms, send, ctx);
  if (PyErr_Occurred()) return NULL;
  if (items == Py_None) return Py_BuildValue("(On)", Py_None, (Py_ssize_t)-1); /* the kept set only, and it is not */
  set_build sb = {.b = tshare_set_builder_create(), .dtype_codes = dtype_codes, .cuda_device = -1};
  if (!sb.b) return PyErr_NoMemory();
  tshare_set_builder_set_stream(sb.b, (void *)(uintptr_t)stream);
  PyObject *result = NULL;
  Py_ssize_t missing = build_set(&sb, items);
  if (missing > 0) result = Py_BuildValue("(On)", Py_None, missing - 1);
  else if (missing == 0) result = send_with_meta(self, sb.b, meta, timeout_ms, send, ctx);
  if (missing == 0 && keep) keep_last_set(self, &sb, key); /* sent or not, it is what was asked for last */
  tshare_set_builder_destroy(sb.b); /* NULL when kept; a sent set keeps its own references */
  tshare_host_buffer_destroy(sb.spare);
  return result;
}

/* _send_set(items, dtype_codes, meta, timeout_ms, stream_for, keep[, key,
 * stream]) -> (set_id, None), or (None, index) when the Python side must
 * look at items[index] (nothing was sent). items: a list of (name,
 * data_ptr, dtype, shape, strides, lazy: a lazily negated or conjugated
 * view[, cuda]), read straight off the tensors; dtype_codes: {torch dtype:
 * (DLPack code, bits)}; meta: bytes-like; stream_for(device): the current
 * CUDA stream of device (a kept set with CUDA members is ordered after it);
 * keep: whether this set's builder is kept to be sent again; key: what the
 * kept set is known by, compared whole (default items; the items without
 * their cuda fields, or tshare._torch_native's key of the same fields);
 * stream: the CUDA stream that wrote the CUDA members (0: the default
 * stream). items None: send the kept set if key is its key, else (None, -1)
 * and nothing sent. */
PyObject *py_set_send_args(PyChannel *self, PyObject *args, py_set_sender send, void *ctx) {
  PyObject *items, *dtype_codes, *stream_for, *key = NULL;
  Py_buffer meta;
  int timeout_ms, keep;
  unsigned long long stream = 0;
  if (!PyArg_ParseTuple(args, "OO!y*iOp|OK", &items, &PyDict_Type, &dtype_codes, &meta, &timeout_ms, &stream_for,
                        &keep, &key, &stream))
    return NULL;
  if ((items != Py_None && !PyList_Check(items)) || (items == Py_None && !key) || key == Py_None) {
    PyBuffer_Release(&meta);
    PyErr_SetString(PyExc_TypeError, "_send_set: items is a list, or None with a key");
    return NULL;
  }
  PyObject *result = NULL;
  int64_t deadline = py_guard_deadline(timeout_ms); /* the wait for the turn counts */
  if (py_channel_enter_by(self, "send (tensor set)", deadline)) {
    result = send_in_guard(self, items, key ? key : items, dtype_codes, &meta, py_guard_left_ms(deadline), stream_for,
                           keep, stream, send, ctx);
    py_channel_leave(self);
  }
  PyBuffer_Release(&meta);
  return result;
}

PyObject *py_channel_send_set(PyChannel *self, PyObject *args) { return py_set_send_args(self, args, send_built, NULL); }
