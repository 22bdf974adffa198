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

/* What keeps a CUDA member's memory alive: the Python tensor, a reference
 * per holder (the builder, each sent set). Called inside tshare calls that
 * run with the GIL released, and at the builder's with it held. */
static void retain_python_object(void *keep) {
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_INCREF((PyObject *)keep);
  PyGILState_Release(gil);
}

static void drop_python_object(void *keep) {
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_DECREF((PyObject *)keep);
  PyGILState_Release(gil);
}

/* A CUDA member (storage_key, storage_base, tensor, device after the common
 * fields): 1 added, 0 the Python side must look at it (a received tensor),
 * -1 with a Python error. An empty storage has no allocation to export: a
 * small owned buffer carries the (empty) layout, as a single send does. */
static int add_cuda_member(tshare_set_builder *b, const char *name, uintptr_t data, PyObject *cuda,
                           tshare_tensor_desc *d) {
  unsigned long long storage_key, base;
  PyObject *tensor;
  int device;
  if (!PyArg_ParseTuple(cuda, "KKOi", &storage_key, &base, &tensor, &device)) return -1;
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
    Py_INCREF(tensor); /* the builder's reference */
    rc = tshare_set_builder_add_cuda_keep(b, name, (void *)(uintptr_t)base, d, retain_python_object,
                                          drop_python_object, tensor, &err);
  }
  if (rc != TSHARE_OK) {
    py_raise_fmt(rc, "tshare: send: tensor '%.200s': %s", name, err.message);
    return -1;
  }
  return 1;
}

/* Add item (name, data_ptr, dtype, shape, strides, lazy[, cuda]): 1 added;
 * 0 the Python side must look at it (an odd name, dtype or layout, a lazily
 * negated or conjugated view, memory that is no host buffer); -1 with a
 * Python error. cuda, for a CUDA tensor: (storage_key, storage_base,
 * tensor, device). */
static int add_member(tshare_set_builder *b, PyObject *dtype_codes, PyObject *item, tshare_host_buffer **spare) {
  PyObject *name_obj, *dtype, *shape, *strides, *cuda = NULL;
  unsigned long long data;
  int lazy;
  if (!PyArg_ParseTuple(item, "OKOO!O!p|O!", &name_obj, &data, &dtype, &PyTuple_Type, &shape, &PyTuple_Type,
                        &strides, &lazy, &PyTuple_Type, &cuda))
    return -1;
  const char *name = member_name(name_obj);
  tshare_tensor_desc d;
  int r = name && !lazy ? fill_member_desc(dtype_codes, dtype, shape, strides, &d) : 0;
  if (r <= 0) return r;
  if (cuda) return add_cuda_member(b, name, (uintptr_t)data, cuda, &d);
  tshare_host_buffer *buf = member_buffer((uintptr_t)data, tshare_tensor_numel(&d) == 0, spare, &d.byte_offset);
  if (!buf) return 0;
  tshare_error err;
  int rc = tshare_set_builder_add_host(b, name, buf, &d, &err);
  if (rc != TSHARE_OK) {
    py_raise_fmt(rc, "tshare: send: tensor '%.200s': %s", name, err.message);
    return -1;
  }
  return 1;
}

/* The set of items and meta in a builder: 0, or the index + 1 of the first
 * item the Python side must look at, or -1 with a Python error. */
static Py_ssize_t build_set(tshare_set_builder *b, PyObject *dtype_codes, PyObject *items, Py_buffer *meta,
                            tshare_host_buffer **spare) {
  Py_ssize_t n = PyList_GET_SIZE(items);
  for (Py_ssize_t i = 0; i < n; i++) {
    int r = add_member(b, dtype_codes, PyList_GET_ITEM(items, i), spare);
    if (r <= 0) return r < 0 ? -1 : i + 1;
  }
  tshare_error err;
  int rc = tshare_set_builder_set_meta(b, meta->buf, (size_t)meta->len, &err);
  if (rc != TSHARE_OK) {
    py_raise_fmt(rc, "tshare: send: metadata: %s", err.message);
    return -1;
  }
  return 0;
}

/* The send itself, in one call: a set that timed out partway has gone in
 * part (the peer releases it), so it cannot be tried again in slices as a
 * single share is. */
static PyObject *send_built(PyChannel *self, tshare_set_builder *b, int timeout_ms) {
  tshare_channel *ch = py_channel_enter(self);
  if (!ch) return NULL;
  uint64_t id = 0;
  int rc;
  Py_BEGIN_ALLOW_THREADS rc = tshare_set_send(ch, b, NULL, timeout_ms, &id);
  Py_END_ALLOW_THREADS
  if (rc != TSHARE_OK) py_raise_channel(ch, rc, "send (tensor set)");
  py_channel_leave(self);
  return rc == TSHARE_OK ? PyLong_FromUnsignedLongLong(id) : NULL;
}

/* _send_set(items, dtype_codes, meta, timeout_ms[, stream]) -> (set_id,
 * None), or (None, index) when the Python side must look at items[index]
 * (nothing was sent). items: a list of (name, data_ptr, dtype, shape,
 * strides, lazy: a lazily negated or conjugated view[, cuda]), read straight
 * off the tensors; dtype_codes: {torch dtype: (DLPack code, bits)}; meta:
 * bytes-like; stream: the CUDA stream that wrote the CUDA members (0: the
 * default stream). */
PyObject *py_channel_send_set(PyChannel *self, PyObject *args) {
  PyObject *items, *dtype_codes;
  Py_buffer meta;
  int timeout_ms;
  unsigned long long stream = 0;
  if (!PyArg_ParseTuple(args, "O!O!y*i|K", &PyList_Type, &items, &PyDict_Type, &dtype_codes, &meta, &timeout_ms,
                        &stream))
    return NULL;
  PyObject *result = NULL;
  tshare_host_buffer *spare = NULL;
  tshare_set_builder *b = tshare_set_builder_create();
  if (!b) {
    PyErr_NoMemory();
  } else if (py_channel_get(self)) {
    tshare_set_builder_set_stream(b, (void *)(uintptr_t)stream);
    Py_ssize_t missing = build_set(b, dtype_codes, items, &meta, &spare);
    if (missing > 0) result = Py_BuildValue("(On)", Py_None, missing - 1);
    else if (missing == 0) result = send_built(self, b, timeout_ms);
    if (missing == 0 && result) result = Py_BuildValue("(NO)", result, Py_None);
  }
  tshare_set_builder_destroy(b); /* a sent set keeps its own references */
  tshare_host_buffer_destroy(spare);
  PyBuffer_Release(&meta);
  return result;
}

/* ---- receiving ------------------------------------------------------------- */

int py_set_waiting(PyChannel *self) {
  py_next_set *n = &self->next;
  if (n->set || n->refusal != TSHARE_OK) return 1;
  int rc = tshare_set_recv(self->ch, 0, &n->set);
  /* The peer's end: the shares it sent before come first, then recv's own
   * look at the channel reports it. */
  if (rc == TSHARE_OK || rc == TSHARE_E_TIMEOUT || rc == TSHARE_END || rc == TSHARE_E_PEER_CLOSED)
    return n->set != NULL;
  n->refusal = rc; /* a set the peer got wrong (already released back) */
  snprintf(n->refusal_msg, sizeof n->refusal_msg, "%s", tshare_channel_last_error(self->ch));
  return 1;
}

uint64_t py_set_waiting_id(const PyChannel *self) { return self->next.set ? tshare_set_id(self->next.set) : 0; }

void py_set_drop_waiting(PyChannel *self) {
  tshare_set_release(self->next.set);
  self->next.set = NULL;
  self->next.refusal = TSHARE_OK;
}

/* Why member i cannot become a torch tensor, or NULL. */
static const char *member_refusal(const tshare_tensor_desc *d, char *why, size_t cap) {
  if (d->dtype.lanes != 1) {
    char name[32];
    snprintf(why, cap, "a dtype %s, which has no PyTorch equivalent", tshare_dtype_name(d->dtype, name, sizeof name));
    return why;
  }
  for (int32_t k = 0; k < d->ndim; k++) {
    if (d->strides[k] < 0) {
      snprintf(why, cap, "a negative stride (%lld in dimension %d), which PyTorch tensors cannot have",
               (long long)d->strides[k], (int)k);
      return why;
    }
  }
  return NULL;
}

/* (name, capsule, dtype code, dtype bits) of member i; the capsule holds a
 * view of the set. */
static PyObject *member_entry(tshare_set *s, size_t i) {
  const tshare_tensor_desc *d = tshare_set_desc(s, i);
  char why[160];
  if (member_refusal(d, why, sizeof why))
    return py_raise_fmt(TSHARE_E_UNSUPPORTED, "tshare: recv: set %llu: tensor '%.200s' has %s",
                        (unsigned long long)tshare_set_id(s), tshare_set_name(s, i), why);
  tshare_view *view = NULL;
  int rc = tshare_set_view(s, i, &view);
  if (rc != TSHARE_OK) return py_raise_fmt(rc, "tshare: recv: set %llu: no view of tensor %zu", tshare_set_id(s), i);
  PyObject *capsule = py_memory_view_capsule(view); /* owns the view from here */
  if (!capsule) return NULL;
  const char *name = tshare_set_name(s, i);
  return Py_BuildValue("(s#Nii)", name, (Py_ssize_t)strlen(name), capsule, d->dtype.code, d->dtype.bits);
}

/* ("set", set_id, meta, [member entries]) for a set; the set handle goes
 * once every member holds it through its view. */
static PyObject *set_result(tshare_set *s) {
  size_t n = tshare_set_count(s), meta_len = 0;
  const void *meta = tshare_set_meta(s, &meta_len);
  PyObject *members = PyList_New((Py_ssize_t)n);
  PyObject *meta_bytes = PyBytes_FromStringAndSize(meta, (Py_ssize_t)meta_len);
  PyObject *result = NULL;
  for (size_t i = 0; members && meta_bytes && i < n; i++) {
    PyObject *entry = member_entry(s, i);
    if (!entry) goto done; /* the members made so far go with the list: the set goes back */
    PyList_SET_ITEM(members, (Py_ssize_t)i, entry);
  }
  if (members && meta_bytes)
    result = Py_BuildValue("(sKOO)", "set", (unsigned long long)tshare_set_id(s), meta_bytes, members);
done:
  Py_XDECREF(members);
  Py_XDECREF(meta_bytes);
  tshare_set_release(s);
  return result;
}

PyObject *py_set_take(PyChannel *self) {
  py_next_set *n = &self->next;
  if (n->refusal != TSHARE_OK) {
    int rc = n->refusal;
    n->refusal = TSHARE_OK;
    return py_raise_fmt(rc, "tshare: recv (tensor set): %s", n->refusal_msg);
  }
  tshare_set *s = n->set;
  n->set = NULL;
  return set_result(s);
}
