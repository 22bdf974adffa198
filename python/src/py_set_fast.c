/* py_set_fast.c - the per-member loops of a tensor set's send and recv.
 *
 * A state_dict is hundreds of tensors, and per member the Python side made
 * a handful of torch calls with the interpreter's work around each (a
 * comprehension's frame, a tuple, a dict slot). The torch calls stay the
 * same, in the same order, made from here: what goes is the interpreter's
 * share, which on a set of a few hundred members is a good part of a
 * hand-off. The methods are looked up by interned name on each tensor, as
 * the Python code did, so a tensor subclass sees the calls it saw before. */
#include "py_set_fast.h"

#include "py_memory.h"

static PyObject *name_data_ptr, *name_dtype, *name_shape, *name_stride, *name_is_neg, *name_is_conj, *name_as_strided,
  *name_cdata, *name_items;

int py_set_fast_init(void) {
  name_data_ptr = PyUnicode_InternFromString("data_ptr");
  name_dtype = PyUnicode_InternFromString("dtype");
  name_shape = PyUnicode_InternFromString("shape");
  name_stride = PyUnicode_InternFromString("stride");
  name_is_neg = PyUnicode_InternFromString("is_neg");
  name_is_conj = PyUnicode_InternFromString("is_conj");
  name_as_strided = PyUnicode_InternFromString("as_strided");
  name_cdata = PyUnicode_InternFromString("_cdata");
  name_items = PyUnicode_InternFromString("items");
  return name_data_ptr && name_dtype && name_shape && name_stride && name_is_neg && name_is_conj && name_as_strided &&
             name_cdata && name_items
           ? 0
           : -1;
}

/* ---- what a send reads of each member ---------------------------------------- */

/* 1 when method of t returns something true, 0 false, -1 with an error. */
static int method_is_true(PyObject *t, PyObject *method) {
  PyObject *r = PyObject_CallMethodObjArgs(t, method, NULL);
  if (!r) return -1;
  int truth = PyObject_IsTrue(r);
  Py_DECREF(r);
  return truth;
}

/* Whether t is a lazily negated view, or a lazily conjugated one of a
 * complex dtype (is_conj only asked there): 1, 0, or -1 with an error. */
static int is_lazy(PyObject *t, PyObject *dtype, PyObject *complex_dtypes) {
  int lazy = method_is_true(t, name_is_neg);
  if (lazy != 0) return lazy;
  int complex_dtype = PySequence_Contains(complex_dtypes, dtype);
  return complex_dtype > 0 ? method_is_true(t, name_is_conj) : complex_dtype;
}

/* (name, data_ptr, dtype, shape, strides, lazy) of member t, read in that
 * order: a member that is no tensor fails at data_ptr. */
static PyObject *member_item(PyObject *name, PyObject *t, PyObject *complex_dtypes) {
  PyObject *item = NULL, *dtype = NULL, *shape = NULL, *strides = NULL;
  PyObject *data = PyObject_CallMethodObjArgs(t, name_data_ptr, NULL);
  if (data && (dtype = PyObject_GetAttr(t, name_dtype)) && (shape = PyObject_GetAttr(t, name_shape)) &&
      (strides = PyObject_CallMethodObjArgs(t, name_stride, NULL))) {
    int lazy = is_lazy(t, dtype, complex_dtypes);
    if (lazy >= 0) item = PyTuple_Pack(6, name, data, dtype, shape, strides, lazy ? Py_True : Py_False);
  }
  Py_XDECREF(data);
  Py_XDECREF(dtype);
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  return item;
}

/* The items of a Mapping that is not exactly a dict, through its items():
 * an OrderedDict's order, a user Mapping's own. */
static PyObject *mapping_items(PyObject *tensors, PyObject *complex_dtypes) {
  PyObject *pairs = PyObject_CallMethodObjArgs(tensors, name_items, NULL);
  PyObject *iter = pairs ? PyObject_GetIter(pairs) : NULL;
  Py_XDECREF(pairs);
  if (!iter) return NULL;
  PyObject *out = PyList_New(0), *pair;
  while (out && (pair = PyIter_Next(iter))) {
    PyObject *item = NULL;
    if (PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2)
      item = member_item(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), complex_dtypes);
    else
      PyErr_SetString(PyExc_TypeError, "items() of the tensor set gave something other than (name, tensor)");
    Py_DECREF(pair);
    if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
    Py_XDECREF(item);
  }
  Py_DECREF(iter);
  if (out && PyErr_Occurred()) Py_CLEAR(out);
  return out;
}

PyObject *py_set_items(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *tensors, *complex_dtypes;
  if (!PyArg_ParseTuple(args, "OO", &tensors, &complex_dtypes)) return NULL;
  if (!PyDict_CheckExact(tensors)) return mapping_items(tensors, complex_dtypes);
  PyObject *out = PyList_New(PyDict_GET_SIZE(tensors));
  Py_ssize_t pos = 0, i = 0;
  PyObject *name, *t;
  while (out && PyDict_Next(tensors, &pos, &name, &t)) {
    if (i >= PyList_GET_SIZE(out)) { /* changed under us by a method called on a member */
      PyErr_SetString(PyExc_RuntimeError, "the tensor set changed size while it was read");
      Py_CLEAR(out);
      break;
    }
    Py_INCREF(name);
    Py_INCREF(t);
    PyObject *item = member_item(name, t, complex_dtypes);
    Py_DECREF(name);
    Py_DECREF(t);
    if (!item) Py_CLEAR(out);
    else PyList_SET_ITEM(out, i++, item);
  }
  if (out && i != PyList_GET_SIZE(out)) {
    PyErr_SetString(PyExc_RuntimeError, "the tensor set changed size while it was read");
    Py_CLEAR(out);
  }
  return out;
}

/* ---- what a recv makes of each member ------------------------------------------ */

PyObject *py_set_members(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *kind_views, *views;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &kind_views, &PyList_Type, &views)) return NULL;
  PyObject *out = PyDict_New();
  for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(views); i++) {
    PyObject *name, *shape, *strides, *offset;
    Py_ssize_t kind;
    if (!PyArg_ParseTuple(PyList_GET_ITEM(views, i), "OnOOO", &name, &kind, &shape, &strides, &offset)) {
      Py_CLEAR(out);
      break;
    }
    if (kind < 0 || kind >= PyList_GET_SIZE(kind_views)) {
      PyErr_Format(PyExc_IndexError, "member %zd: no kind %zd", i, kind);
      Py_CLEAR(out);
      break;
    }
    PyObject *t =
      PyObject_CallMethodObjArgs(PyList_GET_ITEM(kind_views, kind), name_as_strided, shape, strides, offset, NULL);
    if (!t || PyDict_SetItem(out, name, t) < 0) Py_CLEAR(out);
    Py_XDECREF(t);
  }
  return out;
}

/* torch's tensor over capsule, its storage bound to the capsule's memory. */
static PyObject *bound_tensor(PyObject *capsule, PyObject *from_dlpack, PyObject *raw_storage) {
  PyObject *t = PyObject_CallFunctionObjArgs(from_dlpack, capsule, NULL);
  PyObject *storage = t ? PyObject_CallFunctionObjArgs(raw_storage, t, NULL) : NULL;
  PyObject *key = storage ? PyObject_GetAttr(storage, name_cdata) : NULL;
  Py_XDECREF(storage);
  unsigned long long cdata = key ? PyLong_AsUnsignedLongLong(key) : 0;
  Py_XDECREF(key);
  if (!t || PyErr_Occurred() || py_memory_bind(capsule, (uintptr_t)cdata) < 0) Py_CLEAR(t);
  return t;
}

PyObject *py_bound(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *capsule, *from_dlpack, *raw_storage;
  if (!PyArg_ParseTuple(args, "OOO", &capsule, &from_dlpack, &raw_storage)) return NULL;
  return bound_tensor(capsule, from_dlpack, raw_storage);
}

PyObject *py_bound_made(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *capsule, *maker, *dtype, *t = NULL;
  if (!PyArg_ParseTuple(args, "OOO", &capsule, &maker, &dtype)) return NULL;
  PyObject *made = PyObject_CallFunctionObjArgs(maker, capsule, dtype, NULL);
  if (made && PyTuple_Check(made) && PyTuple_GET_SIZE(made) == 2) {
    unsigned long long key = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(made, 1));
    if (!PyErr_Occurred() && py_memory_bind(capsule, (uintptr_t)key) == 0) {
      t = PyTuple_GET_ITEM(made, 0);
      Py_INCREF(t);
    }
  } else if (made) {
    PyErr_SetString(PyExc_TypeError, "tshare: _bound_made: the maker gave no (tensor, key)");
  }
  Py_XDECREF(made);
  return t;
}

PyObject *py_bound_all(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *capsules, *from_dlpack, *raw_storage;
  if (!PyArg_ParseTuple(args, "O!OO", &PyList_Type, &capsules, &from_dlpack, &raw_storage)) return NULL;
  PyObject *out = PyList_New(PyList_GET_SIZE(capsules));
  for (Py_ssize_t i = 0; out && i < PyList_GET_SIZE(out); i++) {
    PyObject *t = bound_tensor(PyList_GET_ITEM(capsules, i), from_dlpack, raw_storage);
    if (!t) Py_CLEAR(out);
    else PyList_SET_ITEM(out, i, t);
  }
  return out;
}

PyObject *py_bind_keys(PyObject *module, PyObject *args) {
  (void)module;
  PyObject *capsules, *keys;
  if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &capsules, &PyList_Type, &keys)) return NULL;
  if (PyList_GET_SIZE(capsules) != PyList_GET_SIZE(keys)) {
    PyErr_SetString(PyExc_ValueError, "tshare: bind: a key per capsule");
    return NULL;
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(capsules); i++) {
    unsigned long long key = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(keys, i));
    if (PyErr_Occurred() || py_memory_bind(PyList_GET_ITEM(capsules, i), (uintptr_t)key) < 0) return NULL;
  }
  Py_RETURN_NONE;
}
